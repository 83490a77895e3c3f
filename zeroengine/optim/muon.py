"""Muon (momentum orthogonalised by Newton-Schulz) with an auxiliary Adam, DeepSpeed 0.19.8's update, exact under
ZeRO partitioning.

What DeepSpeed's ``"type": "Muon"`` trains (its ``MuonWithAuxAdam``), and so what this does:

* Parameters are tagged ``use_muon`` when they are matrices (two or more dimensions, by their layer shape) whose
  names hold neither "embed" nor "lm_head"; the rest train with Adam. Each param group splits into a Muon half
  (``lr`` / ``muon_lr``, ``momentum`` 0.95, ``weight_decay``, ``ns_method``) and an Adam half (``lr`` /
  ``adam_lr``, ``betas`` (0.9, 0.95), ``eps`` 1e-10, ``weight_decay``); ``adam_w_mode`` (default true) decouples
  the Adam half's weight decay.
* Muon, per matrix: ``m <- lerp(m, g, 1 - momentum)``; ``u = lerp(g, m, momentum)`` (Nesterov);
  ``u <- NS5(u) * sqrt(max(1, rows / cols))``; ``p *= 1 - lr * weight_decay``; ``p -= lr * u``. NS5 is five
  quintic Newton-Schulz iterations (coefficients 3.4445, -4.7750, 2.0315) on ``u / (|u|_F + 1e-7)``, on the
  wide orientation; ``ns_method`` "gram" (default) iterates on the Gram matrix ``X X^T`` with a restart at the
  second iteration (the same function, fewer FLOPs for wide matrices) in fp16, "standard" on ``X`` in bf16, each
  in fp32 where the device cannot (as DeepSpeed decides: :func:`ns_compute_dtype`). A 4-D (conv) tensor is
  orthogonalised as ``[out, in * kh * kw]`` and scaled by that matrix's ``sqrt(max(1, rows / cols))``: DeepSpeed
  0.19.8's ``muon_update`` fails on 4-D tensors, and Keller Jordan's, which reshapes the same way, takes the
  scale from the kernel's ``kh / kw`` instead; ours is the matrix that was orthogonalised.
* Adam: ``m <- lerp(m, g, 1 - b1)``, ``v <- lerp(v, g^2, 1 - b2)``, ``p -= lr * m_hat / (sqrt(v_hat) + eps)``.

Under ZeRO a rank holds flat pieces of matrices. Newton-Schulz is not elementwise, so each Muon matrix is made
whole first, one bucket at a time: every rank writes its pieces' ``u`` into a zeroed buffer laid out by the
bucket's Muon parameters (the same on every rank) and one all-reduce sums them (each element comes from exactly
one rank, so the sum is exact); each rank then orthogonalises the matrices it holds a piece of and applies its
own elements before the next bucket, so at most one bucket's Muon matrices are whole at once. The momentum is per
element and stays partitioned (4 bytes per parameter); the Adam half is elementwise.
"""
from __future__ import annotations

import math
import os
from collections import defaultdict

import torch

from .partitioned import PartitionAware

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_METHODS = ("gram", "standard")
GRAM_RESTART = 2  # the iteration at which the Gram iteration folds Q into X and starts again (half precision)
MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}


def ns_compute_dtype(ns_method: str, device: torch.device) -> torch.dtype:
    """The dtype Newton-Schulz runs in, chosen as DeepSpeed 0.19.8 does: "gram" fp16, "standard" bf16, fp32
    where the device does not support that (on a CPU, fp16 needs oneDNN's fp16 support; on a GPU, compute
    capability 7 or more, or 6 with DeepSpeed's DS_ALLOW_DEPRECATED_FP16=1)."""
    if ns_method == "gram":
        if device.type == "cuda":
            major, _ = torch.cuda.get_device_capability(device)
            deprecated_ok = major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1"
            return torch.float16 if major >= 7 or deprecated_ok else torch.float32
        try:
            return torch.float16 if torch.ops.mkldnn._is_mkldnn_fp16_supported() else torch.float32
        except (AttributeError, RuntimeError):
            return torch.float32
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16


def _quintic(X: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X


def newton_schulz(G: torch.Tensor, steps: int = NS_STEPS, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The standard iteration on ``G`` ([..., rows, cols]), in ``dtype``."""
    tall = G.size(-2) > G.size(-1)
    X = G.to(dtype)
    X = X.mT if tall else X
    X = _quintic(X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7), steps)
    return X.mT if tall else X


def gram_newton_schulz(G: torch.Tensor, steps: int = NS_STEPS, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The same function computed on the Gram matrix R = X X^T of the wide orientation X ([n, m], n <= m): each
    iteration's polynomial in R accumulates into Q (X_k = Q X_0), R follows as X_k X_k^T, and at
    :data:`GRAM_RESTART` Q is folded into X and R recomputed (so the half-precision products stay short).
    Square matrices take the standard iteration (no saving). Normalised in the input's range first: an fp16
    input normalises in fp32."""
    a, b, c = NS_COEFFICIENTS
    tall = G.size(-2) > G.size(-1)
    X = G.to(torch.float32 if G.dtype == torch.float16 else G.dtype)
    X = X.mT if tall else X
    X = (X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(dtype)
    n, m = X.size(-2), X.size(-1)
    if m <= n:
        X = _quintic(X, steps)
        return X.mT if tall else X
    R, Q = X @ X.mT, None
    for i in range(steps):
        if i == GRAM_RESTART:
            X, Q = Q @ X, None
            R = X @ X.mT
        Z = b * R + c * R @ R
        if Q is None:
            Q = Z.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q = a * Q + Z @ Q
        if i < steps - 1 and i + 1 != GRAM_RESTART:  # R for the next iteration: X_{k+1} X_{k+1}^T
            RZ = a * R + Z @ R
            R = a * RZ + Z @ RZ
    X = Q @ X
    return X.mT if tall else X


def orthogonalize(update: torch.Tensor, ns_method: str, steps: int = NS_STEPS,
                  dtype: torch.dtype | None = None, num_heads: int | None = None) -> torch.Tensor:
    """NS5 of a matrix (a 4-D conv weight as [out, rest]) times sqrt(max(1, rows / cols)), in ``update``'s dtype.
    ``num_heads`` (``per_head_muon``): an attention projection [heads * head_dim, in] is orthogonalised per head,
    as the batch [heads, head_dim, in], each block scaled by its own shape."""
    shape = update.shape
    if num_heads is not None:
        if update.dim() != 2 or shape[0] % num_heads:
            raise ValueError(f"per-head Muon needs a 2-D projection whose rows divide into {num_heads} heads, got "
                             f"{tuple(shape)}")
        return orthogonalize(update.view(num_heads, shape[0] // num_heads, shape[1]), ns_method, steps,
                             dtype).reshape(shape)
    matrix = update.reshape(shape[0], -1) if update.dim() == 4 else update
    dtype = dtype or ns_compute_dtype(ns_method, update.device)
    iterate = gram_newton_schulz if ns_method == "gram" else newton_schulz
    rows, cols = matrix.size(-2), matrix.size(-1)
    out = iterate(matrix, steps, dtype) * (math.sqrt(rows / cols) if rows > cols else 1.0)
    return out.to(update.dtype).reshape(shape)


class Muon(PartitionAware):
    """``MuonWithAuxAdam``: param groups carry ``use_muon`` (see :func:`muon_param_groups`)."""

    # Tests pin the Newton-Schulz dtype to compare with an fp32 reference; None: DeepSpeed's choice.
    ns_dtype: torch.dtype | None = None

    def __init__(self, param_groups, adam_w_mode: bool = True):
        groups = []
        for group in param_groups:
            if "use_muon" not in group:
                raise ValueError("Muon's param groups must say use_muon (muon_param_groups builds them)")
            defaults = MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS
            group = {**defaults, **group}
            if group["use_muon"] and group["ns_method"] not in NS_METHODS:
                raise ValueError(f"ns_method must be one of {NS_METHODS}, got {group['ns_method']!r}")
            groups.append(group)
        self.adam_w_mode = adam_w_mode
        super().__init__(groups, {})

    def step_pieces(self, stepped, device) -> None:
        for group, p, _ in stepped:
            if not group["use_muon"]:
                self._adam(group, p)
        muon = [(g, p, place) for g, p, place in stepped if g["use_muon"]]
        if self.partition is None:  # each piece is its whole parameter
            for group, p, place in muon:
                self._apply(group, p, place, self._nesterov(group, p).view(place.shape), getattr(
                    p, "muon_num_heads", None))
            return
        # One bucket at a time, in the same order on every rank: its Muon matrices made whole, orthogonalised and
        # applied before the next, so what is held at once is one bucket's worth (reduce_bucket_size).
        by_bucket = defaultdict(list)
        for entry in muon:
            by_bucket[entry[2].bucket].append(entry)
        partition = self.partition
        for b in partition.stepping if partition.stepping is not None else range(len(partition.bucket_params)):
            catalog = [(key, shape) for key, shape in partition.bucket_params[b] if key in partition.muon_keys]
            if catalog:
                whole = self._whole_matrices(catalog, by_bucket.get(b, []))
                for group, p, place in by_bucket.get(b, []):
                    self._apply(group, p, place, whole[place.key], partition.heads.get(place.key))

    def _nesterov(self, group, p) -> torch.Tensor:
        """The piece's momentum updated in place, and its Nesterov update lerp(g, m, momentum) (a new tensor)."""
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        grad = p.grad.float() if p.grad.dtype != p.dtype else p.grad.clone()
        buf = state["momentum_buffer"]
        buf.lerp_(grad.to(buf.dtype), 1 - group["momentum"])
        return grad.lerp_(buf.to(grad.dtype), group["momentum"])

    def _apply(self, group, p, place, full: torch.Tensor, heads: int | None) -> None:
        """Orthogonalise the whole matrix's update and apply the piece's elements of it."""
        o = orthogonalize(full, group["ns_method"], dtype=self.ns_dtype, num_heads=heads)
        o = o.reshape(-1)[place.start:place.end]
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(o.view(p.shape).to(p.dtype), alpha=-group["lr"])

    def _whole_matrices(self, catalog, pieces) -> dict:
        """key -> the whole matrix of Nesterov updates of ``catalog``'s parameters: each rank writes its pieces'
        into a zeroed buffer and one all-reduce sums them (every element comes from one rank: exact)."""
        offsets, total = {}, 0
        for key, shape in catalog:
            offsets[key] = total
            total += math.prod(shape)
        device = pieces[0][1].device if pieces else torch.device("cpu")
        flat = torch.zeros(total, dtype=torch.float32, device=device)
        for group, p, place in pieces:
            start = offsets[place.key] + place.start
            flat[start:start + place.end - place.start] = self._nesterov(group, p).reshape(-1).float()
        self.reduce(flat)
        return {key: flat[offsets[key]:offsets[key] + math.prod(shape)].view(shape) for key, shape in catalog}

    def _adam(self, group, p) -> None:
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] = 0
        state["step"] += 1
        grad = p.grad.to(p.dtype)
        if not self.adam_w_mode and group["weight_decay"]:
            grad = grad.add(p, alpha=group["weight_decay"])
        beta1, beta2 = group["betas"]
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].lerp_(grad.square(), 1 - beta2)
        m_hat = state["exp_avg"] / (1 - beta1 ** state["step"])
        v_hat = state["exp_avg_sq"] / (1 - beta2 ** state["step"])
        if self.adam_w_mode:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(m_hat / (v_hat.sqrt() + group["eps"]), alpha=-group["lr"])


MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


def is_muon_parameter(name: str, shape) -> bool:
    """DeepSpeed's rule: matrices (two or more dimensions) whose names hold neither "embed" nor "lm_head"."""
    return len(shape) >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))


# per_head_muon: projections whose output rows are blocked by heads (DeepSpeed's names); the output projection and
# fused q/k/v matrices are not (their heads lie on the input dimension, or mix three kinds of rows)
QUERY_LEAVES = ("q_proj", "query", "wq")
KV_LEAVES = ("k_proj", "key", "wk", "v_proj", "value", "wv")
FUSED_LEAVES = ("qkv_proj", "query_key_value", "c_attn", "in_proj_qkv", "wqkv")


def tag_muon_parameters(model: torch.nn.Module, per_head: bool = False) -> dict[str, int]:
    """``p.use_muon`` by :func:`is_muon_parameter`, on the layer shape (zero.Init's placeholders are flat). With
    ``per_head`` also ``p.muon_num_heads`` on the attention projections the model's config describes (a
    Hugging Face ``config``: ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` or hidden / heads),
    confirmed by the shape (rows == heads x head_dim); returns {name: heads} of those tagged."""
    from zeroengine.zero.param_guard import full_shape

    config = getattr(getattr(model, "config", None), "text_config", None) or getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // heads if heads and getattr(config, "hidden_size", None) else None)
    tagged = {}
    for name, p in model.named_parameters():
        shape = full_shape(p)
        p.use_muon = is_muon_parameter(name, shape)
        p.muon_num_heads = None
        leaf = name.split(".")[-2].lower() if "." in name else name.lower()
        if not (per_head and p.use_muon and len(shape) == 2 and head_dim) or leaf.startswith(FUSED_LEAVES):
            continue
        count = heads if leaf.startswith(QUERY_LEAVES) else kv_heads if leaf.startswith(KV_LEAVES) else None
        if count and shape[0] == count * head_dim:
            p.muon_num_heads = tagged[name] = count
    return tagged


def muon_param_groups(groups: list, config_params: dict) -> list[dict]:
    """Each incoming group (or the loose parameters) split into its Muon and Adam halves, settings resolved most
    specific last: the config's shared value, ``muon_lr`` / ``adam_lr``, the group's own (DeepSpeed's order)."""
    dict_groups = [g for g in groups if isinstance(g, dict)]
    loose = [p for g in groups if not isinstance(g, dict) for p in ([g] if isinstance(g, torch.Tensor) else g)]
    if loose or not dict_groups:
        dict_groups.append({"params": loose})
    halves = []
    for use_muon, keys, lr_key in ((True, MUON_KEYS, "muon_lr"), (False, ADAM_KEYS, "adam_lr")):
        shared = {k: config_params[k] for k in keys if k in config_params}
        if lr_key in config_params:
            shared["lr"] = config_params[lr_key]
        halves.append((use_muon, keys, shared))
    out = []
    for group in dict_groups:
        untagged = [p for p in group["params"] if not hasattr(p, "use_muon")]
        if untagged:
            raise ValueError(f"Muon needs every parameter tagged with use_muon ({len(untagged)} are not): "
                             "initialize() tags the model's; set p.use_muon on others")
        own = {k: v for k, v in group.items() if k != "params"}
        for use_muon, keys, shared in halves:
            params = [p for p in group["params"] if p.requires_grad and bool(p.use_muon) is use_muon]
            if params:
                out.append({"params": params, "use_muon": use_muon, **shared,
                            **{k: v for k, v in own.items() if k in keys}})
    return out
