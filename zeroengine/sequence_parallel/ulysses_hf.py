"""Ulysses attention for Hugging Face models (DeepSpeed's ``UlyssesSPAttentionHF``).

``UlyssesSPAttentionHF.register_with_transformers(...)`` replaces transformers' attention function of the
model's implementation (``"sdpa"``, ``"flash_attention_2"``, ...) by a wrapper, under the same name, so the
model's own code runs unchanged: each sequence-parallel rank runs the model on its piece of every sequence, and
only inside attention do the ranks switch, by an all-to-all, to the whole sequence for a share of the heads
(:mod:`.all_to_all`). Attention is computed exactly, and causally: the wrapper drops the attention mask the
model built for its local piece (a mask for the whole sequence would cost O(seq²) memory, which is what this
is here to avoid), so sequences must not be padded in the middle; padding tokens are left out of the loss with
label -100, and packed sequences rely on ``position_ids`` (flash attention's varlen path reads them).

Key/value heads: with grouped-query attention, k/v heads fewer than the sequence ranks are replicated (each k/v
head repeated sp / kv times, which needs kv to divide sp) so that every rank gets one; otherwise their count
must be a multiple of sp, like the query heads'. DeepSpeed's rules, kept.
"""
from __future__ import annotations

import logging

import torch

from zeroengine import comm

from . import parallel_state
from .all_to_all import heads_to_sequence, sequence_to_heads

# eager's mask is built for the local piece only; flex attention's block mask likewise (DeepSpeed rebuilds a causal
# one, accelerate refuses it): zeroengine refuses both, naming what works.
_REFUSED = ("eager", "paged|eager", "flex_attention")
logger = logging.getLogger(__name__)


class UlyssesSPAttentionHF(torch.nn.Module):
    """Wraps transformers' attention function ``attn`` (``ALL_ATTENTION_FUNCTIONS[name]``) for sequence
    parallelism over ``process_group``. The shape arguments are checked against each call (as DeepSpeed's);
    ``seq_length_is_variable`` takes the sequence length from each call instead of ``local_seq_length``."""

    def __init__(self, attn, batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group, seq_length_is_variable: bool = False,
                 local_seq_length: int | None = None, global_seq_length: int | None = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world = comm.get_world_size(process_group)
        self.batch_size, self.attn_head_size = batch_size, attn_head_size
        self.attn_head_count, self.kv_head_count = attn_head_count, kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval
        self.core_attn_implementation = None
        self.warned_eval_training = False
        world = self.world
        if attn_head_count % world:
            raise ValueError(f"Ulysses sequence parallelism: {attn_head_count} attention heads cannot be split over "
                             f"{world} sequence-parallel ranks (the head count must be a multiple of sp)")
        if kv_head_count % world and world % kv_head_count:
            raise ValueError(f"Ulysses sequence parallelism: {kv_head_count} key/value heads over {world} ranks: "
                             "the key/value head count must be a multiple of sp, or divide it (its heads are then "
                             "replicated)")
        self.kv_replication = world // kv_head_count if kv_head_count < world else 1
        self.local_q_heads = attn_head_count // world
        self.local_kv_heads = kv_head_count * self.kv_replication // world

    def forward(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                *args, **kwargs):
        if self.disable_in_eval and not module.training:  # plain attention, the model's own mask
            if torch.is_grad_enabled() and not self.warned_eval_training:
                # from_pretrained leaves a model in eval mode, and accelerate registers with disable_in_eval: a loop
                # that trains without model.train() would attend within each rank's piece only (DeepSpeed alike)
                self.warned_eval_training = True
                logger.warning("Ulysses attention: the model is in eval mode with gradients enabled, so sequence "
                               "parallelism is off (disable_in_eval) and each rank attends within its own piece; "
                               "call model.train() before training")
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        self._check(query, key)
        if "position_ids" not in kwargs:
            raise ValueError("Ulysses sequence parallelism needs position_ids in the attention's arguments (pass "
                             "position_ids to the model: UlyssesSPDataLoaderAdapter's batches carry them)")
        kwargs["position_ids"] = self._global_positions(kwargs["position_ids"])
        if self.kv_replication > 1:
            key = key.repeat_interleave(self.kv_replication, dim=1)
            value = value.repeat_interleave(self.kv_replication, dim=1)
        group, world = self.process_group, self.world
        query, key, value = (sequence_to_heads(t, group, world) for t in (query, key, value))
        groups_before = getattr(module, "num_key_value_groups", None)
        if groups_before is not None:  # (the core's repeat of k/v heads, for this rank's share; restored after)
            module.num_key_value_groups = self.local_q_heads // self.local_kv_heads
        try:
            # no mask: the model made it for this rank's piece; over the whole sequence it is the implied causal one
            output, weights = self.attn(module, query, key, value, None, *args, **kwargs)
        finally:
            if groups_before is not None:
                module.num_key_value_groups = groups_before
        # the core returns [batch, seq, heads/sp, dim]; back to this rank's piece of the sequence, every head
        output = heads_to_sequence(output.transpose(1, 2), group, world).transpose(1, 2)
        return output, weights

    def _check(self, query: torch.Tensor, key: torch.Tensor) -> None:
        batch, heads, local, dim = query.shape
        expected_local = local if self.seq_length_is_variable else self.local_seq_length
        want = (self.batch_size, self.attn_head_count, expected_local, self.attn_head_size)
        if (batch, heads, local, dim) != want or key.shape[1] != self.kv_head_count:
            raise ValueError(f"Ulysses sequence parallelism: attention got query {tuple(query.shape)} and key "
                             f"{tuple(key.shape)} ([batch, heads, local sequence, head dim]); registered for query "
                             f"{want} and {self.kv_head_count} key/value heads (micro_batch_size, seq_length)")

    def _global_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Every rank's piece of ``position_ids`` (``[batch, seq/sp]``), in sequence order: ``[batch, seq]``."""
        pieces = torch.empty((self.world,) + tuple(position_ids.shape), dtype=position_ids.dtype,
                             device=position_ids.device)
        comm.all_gather(pieces.view(-1), position_ids.contiguous().view(-1), group=self.process_group)
        return torch.cat(list(pieces), dim=-1)

    @classmethod
    def register_with_transformers(cls, model_name_or_path, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None):
        """Make the sequence-parallel groups and put Ulysses around transformers' ``core_attn_implementation``
        (the name the model's config uses). ``model_name_or_path``: a model (its ``config``) or what
        ``AutoConfig.from_pretrained`` takes. Returns the mpu to pass to ``initialize(mpu=...)`` (None when
        ``sequence_parallel_size`` is 1: nothing to do)."""
        if sequence_parallel_size == 1:
            return None
        seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("register_with_transformers: give seq_length, or seq_length_is_variable=True")
        if core_attn_implementation in _REFUSED:
            raise ValueError(f"register_with_transformers: core_attn_implementation={core_attn_implementation!r} "
                             "is not supported (its mask is the model's local one); use \"sdpa\" or a flash "
                             "attention implementation")
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        config = model_name_or_path.config if hasattr(model_name_or_path, "config") else \
            AutoConfig.from_pretrained(model_name_or_path)
        if hasattr(model_name_or_path, "config") and config._attn_implementation != core_attn_implementation:
            raise ValueError(f"register_with_transformers: the model uses attention {config._attn_implementation!r} "
                             f"but core_attn_implementation is {core_attn_implementation!r}; make them agree")
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"register_with_transformers: {core_attn_implementation!r} is not one of transformers' "
                             f"attention functions ({sorted(ALL_ATTENTION_FUNCTIONS.keys())})")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        parallel_state.initialize_sequence_parallel(sequence_parallel_size)
        core = _core_of(ALL_ATTENTION_FUNCTIONS[core_attn_implementation])
        ulysses = cls(attn=core, batch_size=micro_batch_size, attn_head_count=heads,
                      attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
                      kv_head_count=getattr(text, "num_key_value_heads", None) or heads,
                      num_hidden_layers=text.num_hidden_layers,
                      process_group=parallel_state.get_sequence_parallel_group(),
                      seq_length_is_variable=seq_length_is_variable,
                      local_seq_length=None if seq_length is None else seq_length // sequence_parallel_size,
                      global_seq_length=seq_length, disable_in_eval=disable_in_eval)
        ulysses.core_attn_implementation = core_attn_implementation
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = _Wrapper(ulysses, core)
        return parallel_state

    @staticmethod
    def unregister_from_transformers(core_attn_implementation: str) -> None:
        """Put back transformers' own function (zeroengine's addition: tests, notebooks)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        current = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = _core_of(current)


class _Wrapper:
    """What transformers calls in place of its function (a plain callable, which its registry expects); ``core``
    is what it replaced, for unregistering."""

    def __init__(self, ulysses: UlyssesSPAttentionHF, core):
        self.ulysses, self.core = ulysses, core

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        return self.ulysses(module, query, key, value, attention_mask, *args, **kwargs)


def _core_of(function):
    """The function a wrapper wraps (registering twice wraps transformers' own function, not a wrapper)."""
    return function.core if isinstance(function, _Wrapper) else function
