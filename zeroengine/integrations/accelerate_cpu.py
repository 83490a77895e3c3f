"""accelerate's DeepSpeed path on a machine without an accelerator (gloo), under the switch only.

accelerate picks its process-group backend from the devices it finds (nccl for CUDA, hccl, xccl, ...)
and, on a machine with none of them, leaves it unset unless the script asked for ``cpu=True``, which turns
DeepSpeed off. With no backend it then counts the world as one process, so under ``torchrun
--nproc_per_node 2`` every rank believes it is rank 0 of 1 (Hugging Face's Trainer sizes the batch
for one rank and zeroengine refuses the config). Real DeepSpeed is not run this way. zeroengine is: on
CPU it trains over gloo, which is the backend ``deepspeed.init_distributed`` (zeroengine's) picks there.

So, while ``ZEROENGINE_AS_DEEPSPEED`` is on, :func:`patch_partial_state` fills in that one gap when
``accelerate.state`` is imported: where accelerate found no backend, DeepSpeed is requested
(``ACCELERATE_USE_DEEPSPEED``) and the process was launched as a rank (``LOCAL_RANK``), the backend is
``gloo``. Every other case, CUDA machines included, is left exactly as accelerate decides it.
"""
from __future__ import annotations

import os

MODULE = "accelerate.state"


def _deepspeed_rank_without_backend(cpu: bool) -> bool:
    return (not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1
            and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true")


def patch_partial_state(state_module) -> None:
    """Wrap ``PartialState._prepare_backend`` of the freshly imported ``accelerate.state`` (see module doc)."""
    cls = getattr(state_module, "PartialState", None)
    original = getattr(cls, "_prepare_backend", None)
    if original is None or getattr(original, "_zeroengine_gloo", False):
        return  # another accelerate layout: leave it alone rather than guess

    def _prepare_backend(self, cpu: bool = False, sagemaker_dp=False, backend=None):
        chosen, distributed_type = original(self, cpu, sagemaker_dp, backend)
        if chosen is None and _deepspeed_rank_without_backend(cpu):
            chosen = "gloo"
        return chosen, distributed_type

    _prepare_backend._zeroengine_gloo = True
    cls._prepare_backend = _prepare_backend
