"""AutoTP: split a Hugging Face-style transformer's layers across the tensor group (``tensor_parallel.autotp_size``).

Recognised by structure, not by model name (so Mistral, Qwen2 and their relatives are covered with Llama):

* GPT-2 attention (``c_attn`` + ``c_proj`` Conv1D): the fused query-key-value matrix column-parallel in three
  blocks (each rank keeps whole heads of all three), the output projection row-parallel; the module's head
  count and split size are divided so its reshapes see this rank's heads. GPT-2's MLP (``c_fc`` + ``c_proj``):
  column- then row-parallel.
* Llama-style attention (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``): the three projections column-parallel
  by heads (key-value heads too, so grouped-query attention keeps its grouping), ``o_proj`` row-parallel.
  Llama-style MLP (``gate_proj``, ``up_proj``, ``down_proj``): column, column, row.
* The input embedding vocabulary-parallel, and the LM head column-parallel by vocabulary with its logits
  gathered (the model's own loss then sees the whole vocabulary); a head tied to the embedding stays tied to
  its rows. When the vocabulary does not divide by the tensor size both stay replicated (said in the log).
* Stacked MoE experts (Mixtral, Qwen2-MoE, DeepSeek in transformers: one module holding ``gate_up_proj``
  [E, 2I, H] and ``down_proj`` [E, H, I] for all experts): every expert's intermediate dimension cut like a
  Llama MLP's (gate and up as two blocks, so each rank keeps matching halves), the experts' partial outputs
  summed over the group. The routing weights enter the experts through copy_to as the hidden states do, so
  the router's gradient is whole on every rank. Expert layouts with biases or a norm after each expert stay
  replicated (a bias or a norm would see a partial sum).

What is not listed (norms, position embeddings, routers) stays replicated: every tensor rank holds it and
computes the same gradient for it.

Random numbers follow Megatron (rng.py's note): conversion makes the default generators agree across the tensor
group, and each split attention and MLP block runs from its entry to its row-parallel layer inside the model-parallel
RNG tracker's fork, so dropout of this rank's heads draws its own masks while dropout of replicated activations
draws the same masks on every tensor rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .layers import ParallelLinear, VocabParallelEmbedding, split_param
from .ops import TensorGroup, copy_to, reduce_from
from .rng import SplitRegion, share_generators


@dataclass
class AutoTPResult:
    size: int
    attention: list[str] = field(default_factory=list)
    mlp: list[str] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)  # stacked MoE experts split; replicated ones are not listed
    embeddings: str = "replicated"  # "vocab-parallel", or why not

    @property
    def layers(self) -> int:
        return len(self.attention) + len(self.mlp) + len(self.experts)


def _is_conv1d(m) -> bool:
    return type(m).__name__ == "Conv1D" and hasattr(m, "weight") and m.weight.dim() == 2


def _linear(m) -> bool:
    return isinstance(m, torch.nn.Linear)


def _column(m, tg, input_major=False, blocks=1, gather=False, input_copied=False) -> ParallelLinear:
    return ParallelLinear(m.weight, m.bias, "column", tg, input_major=input_major, blocks=blocks, gather_output=gather,
                          input_copied=input_copied)


def _copy_input_once(module: torch.nn.Module, tg: TensorGroup) -> None:
    """``module``'s first input (its hidden states) through copy_to before its column-parallel layers read it:
    Megatron fuses q, k and v (and gate and up) into one matrix, whose input gradient is all-reduced once; the
    separate layers of a Hugging Face module share one copy_to instead of all-reducing a part each."""
    def hook(_, args, kwargs):
        if args:
            return (copy_to(args[0], tg),) + tuple(args[1:]), kwargs
        key = next((k for k in ("hidden_states", "x") if k in kwargs), None)
        if key is None:
            raise TypeError(f"{type(module).__name__} was called without its hidden states (positional, or as "
                            "hidden_states=): tensor parallelism cannot find the input its projections share")
        return args, {**kwargs, key: copy_to(kwargs[key], tg)}
    module.register_forward_pre_hook(hook, with_kwargs=True)


def _row(m, tg, input_major=False) -> ParallelLinear:
    return ParallelLinear(m.weight, m.bias, "row", tg, input_major=input_major)


def _heads_divide(name: str, heads: int, tg: TensorGroup, what: str) -> None:
    if heads % tg.size:
        raise ValueError(f"{name}: {heads} {what} cannot be split across {tg.size} tensor-parallel ranks "
                         "(autotp_size must divide the number of attention heads and of key-value heads)")


def convert(model: torch.nn.Module, tg: TensorGroup) -> AutoTPResult:
    """Replace ``model``'s recognised layers in place by tensor-parallel ones over ``tg``. Collective over ``tg``
    (the ranks agree on their random streams)."""
    share_generators(tg)
    result = AutoTPResult(tg.size)
    for name, module in list(model.named_modules()):
        children = dict(module.named_children())
        if _is_conv1d(children.get("c_attn")) and _is_conv1d(children.get("c_proj")) and hasattr(module, "num_heads"):
            _heads_divide(name, module.num_heads, tg, "attention heads")
            module.c_attn = _column(module.c_attn, tg, input_major=True, blocks=3)
            module.c_proj = _row(module.c_proj, tg, input_major=True)
            module.num_heads //= tg.size
            module.split_size //= tg.size
            module.embed_dim //= tg.size
            SplitRegion.around(module, module.c_proj)
            result.attention.append(name)
        elif _is_conv1d(children.get("c_fc")) and _is_conv1d(children.get("c_proj")):
            module.c_fc = _column(module.c_fc, tg, input_major=True)
            module.c_proj = _row(module.c_proj, tg, input_major=True)
            SplitRegion.around(module, module.c_proj)
            result.mlp.append(name)
        elif all(_linear(children.get(k)) for k in ("q_proj", "k_proj", "v_proj", "o_proj")):
            head_dim = getattr(module, "head_dim", None)
            if not head_dim:
                raise ValueError(f"{name}: an attention module without head_dim; tensor parallelism cannot tell "
                                 "how its projections divide into heads")
            _heads_divide(name, module.q_proj.out_features // head_dim, tg, "attention heads")
            _heads_divide(name, module.k_proj.out_features // head_dim, tg, "key-value heads")
            for proj in ("q_proj", "k_proj", "v_proj"):
                setattr(module, proj, _column(getattr(module, proj), tg, input_copied=True))
            module.o_proj = _row(module.o_proj, tg)
            _copy_input_once(module, tg)
            SplitRegion.around(module, module.o_proj)
            result.attention.append(name)
        elif all(_linear(children.get(k)) for k in ("gate_proj", "up_proj", "down_proj")):
            module.gate_proj = _column(module.gate_proj, tg, input_copied=True)
            module.up_proj = _column(module.up_proj, tg, input_copied=True)
            module.down_proj = _row(module.down_proj, tg)
            _copy_input_once(module, tg)
            SplitRegion.around(module, module.down_proj)
            result.mlp.append(name)
        elif _splittable_experts(module, tg):
            _split_experts(module, tg)
            result.experts.append(name)
    result.embeddings = _convert_embeddings(model, tg)
    return result


def _stacked(module, name: str):
    p = module._parameters.get(name)
    return p if p is not None and p.dim() == 3 else None


def _splittable_experts(module, tg: TensorGroup) -> bool:
    """transformers' stacked-experts layout, without a per-expert bias or norm (which would see partial sums)
    and with an intermediate dimension that divides by the tensor size."""
    if _stacked(module, "down_proj") is None or getattr(module, "has_bias", False):
        return False
    if getattr(module, "has_post_expert_norm", False) or any(k.endswith("_bias") for k in module._parameters):
        return False
    up = _stacked(module, "gate_up_proj") if getattr(module, "has_gate", True) else _stacked(module, "up_proj")
    if up is None:
        return False
    inner = module.down_proj.shape[1 if getattr(module, "is_transposed", False) else 2]
    return inner % tg.size == 0


def _split_experts(module, tg: TensorGroup) -> None:
    """Every expert's intermediate features split across ``tg`` (see the module docstring)."""
    transposed = getattr(module, "is_transposed", False)  # [E, H, 2I] and [E, I, H] instead
    if getattr(module, "has_gate", True):
        # concatenated [gate; up] is two blocks each rank takes a part of; interleaved [g0, u0, g1, u1, ...]
        # keeps its pairs whole under a plain cut.
        blocks = 2 if getattr(module, "is_concatenated", True) else 1
        module.gate_up_proj = split_param(module.gate_up_proj, 2 if transposed else 1, tg, blocks=blocks)
    else:
        module.up_proj = split_param(module.up_proj, 2 if transposed else 1, tg)
    module.down_proj = split_param(module.down_proj, 1 if transposed else 2, tg)
    if hasattr(module, "intermediate_dim"):
        module.intermediate_dim //= tg.size

    def copy_inputs(_, args, kwargs):
        # (hidden_states, top_k_index, top_k_weights): the states and the weights are read by every rank's
        # part of every expert, so each gets its gradient all-reduced once.
        named = dict(zip(("hidden_states", "top_k_index", "top_k_weights"), args))
        named.update(kwargs)
        for key in ("hidden_states", "top_k_weights"):
            if key not in named:
                raise TypeError(f"{type(module).__name__} was called without {key}: tensor parallelism splits its "
                                "experts and must see the inputs they share")
            named[key] = copy_to(named[key], tg)
        return (), named

    module.register_forward_pre_hook(copy_inputs, with_kwargs=True)
    module.register_forward_hook(lambda _, __, out: reduce_from(out, tg))


def _convert_embeddings(model, tg: TensorGroup) -> str:
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    embedding = get_in() if get_in else None
    head = get_out() if get_out else None
    if not isinstance(embedding, torch.nn.Embedding):
        return "replicated (no input embedding found)"
    vocab = embedding.num_embeddings
    if vocab % tg.size:
        return f"replicated (the vocabulary of {vocab} does not divide by {tg.size})"
    tied = head is not None and head.weight is embedding.weight
    parallel = VocabParallelEmbedding(embedding.weight, tg, embedding.padding_idx)
    model.set_input_embeddings(parallel)
    if isinstance(head, torch.nn.Linear) and head.out_features == vocab:
        new_head = _column(head, tg, gather=True)
        if tied:
            new_head.weight = parallel.weight  # the same rows of the same tensor, as before
        model.set_output_embeddings(new_head)
    return "vocab-parallel" + (" (LM head tied)" if tied else "")
