"""``deepspeed.runtime.zero.partition_parameters``: ``Init`` and ``GatheredParameters``, and the two names
transformers' ``prevent_arange_dtype_change`` swaps around ``zero.Init``.

DeepSpeed's ``zero.Init`` wraps tensor constructors (``torch.arange`` among them) to give them the
training dtype and device; transformers swaps ``zero_wrapper_for_fp_tensor_constructor`` to spare
``arange``. zeroengine's ``Init`` partitions parameters as modules register them and wraps no
constructor, so the wrapper here returns the constructor unchanged: the swap is harmless, and
``arange`` keeps its dtype either way, which is what transformers wants.
"""
from __future__ import annotations

import torch

from ...accelerator import get_accelerator  # noqa: F401 (transformers reaches it through here)
from ...zero import GatheredParameters, Init, register_external_parameter  # noqa: F401

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    """The constructor itself: zeroengine's Init changes no constructor's dtype or device."""
    return fn
