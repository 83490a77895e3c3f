"""``ze_to_deepspeed``: a zeroengine checkpoint rewritten as DeepSpeed 0.19 saves one, for DeepSpeed to resume.

    ze_to_deepspeed SRC DST --world N --stage S [--tag T] [--universal] [--dtype fp32|bf16|fp16]
                    [--config DS_CONFIG.json] [--param-order FILE] [--force]

writes ``DST/<tag>/`` as DeepSpeed 0.19.8's ``engine.save_checkpoint`` would at data-parallel world size N
and ZeRO stage S, then ``DST/latest`` naming it (last, atomically). DeepSpeed at that world size, stage and
precision loads it with ``engine.load_checkpoint(DST)`` and goes on as zeroengine would: same weights, fp32
masters, Adam moments and step, param-group settings, lr scheduler, loss scaler, counters, client_state.
``--universal`` writes what ``ds_to_universal.py`` does (``zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt``,
``zero/optimizer_state.pt``, model-states files) and ``DST/latest_universal``: DeepSpeed loads it with
``"checkpoint": {"load_universal": true}`` at any world size and ZeRO stage 1-3 (at stage 3 DeepSpeed gives
every param group the first one's settings).

The layout is computed (layout_ds): DeepSpeed's loaders copy flat partitions without looking at names, so
every padding and boundary must be its own. Files pickle DeepSpeed's own classes (pickles) and are written
atomically into a staging folder renamed into place when complete. Memory is bounded by one DeepSpeed file's
content: the memory-mapped shards are read one parameter range at a time.

Note: parameter order. DeepSpeed's flat groups hold each param group's parameters in the order the optimizer
got them, which for ``model.parameters()`` (or groups built by walking ``model.named_parameters()``) is the
model's registration order. A zeroengine manifest keys its parameter table by name (written sorted) and its
shards follow zeroengine's own layout (stages 1-2: reverse registration order; stage 3: module units), so
neither is that order. It comes from, first that applies: ``param_order`` (``--param-order``: the model's
parameter names in ``named_parameters()`` order); the manifest's ``"param_order"``; for a stage 0
checkpoint, the order its pieces were written in, which is the optimizer's. Otherwise conversion is refused.

The optimizer state is written as ``torch.optim.Adam``/``AdamW`` keeps it (a float32 tensor ``step``, as
DeepSpeed saves it with ``"torch_adam": true``). ``--config``, the DeepSpeed config that will load it, is
checked against stage and precision and gives ``gradient_clipping`` and the fp16 loss-scale settings; without
it the files leave DeepSpeed's clipping as configured and use its default loss-scale window and hysteresis.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from zeroengine.progress import get_logger

from .. import manifest as mf
from ..files import CheckpointError, fsync_dir, load_tensors, save_text
from ..formats import read_manifest
from . import layout_ds
from .pickles import DynamicLossScaler, LossScaler, ZeroStageEnum, fragment_address, save_for_deepspeed

DS_VERSION = "0.19.8"
ADAM_OPTIMIZERS = ("Adam", "AdamW", "CPUAdam", "FusedAdam")  # zeroengine's classes keeping Adam's state
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
LATEST, LATEST_UNIVERSAL = "latest", "latest_universal"


def write_deepspeed_checkpoint(src_dir: str, dst_dir: str, world_size: int, stage: int, tag: str | None = None,
                               universal: bool = False, dtype=None, *, ds_config=None,
                               param_order: list[str] | None = None, force: bool = False) -> str:
    """Write ``src_dir``'s checkpoint (``tag``, default the one ``latest`` names) as DeepSpeed 0.19's, under
    ``dst_dir/<tag>``; returns that folder. ``dtype`` (default: the checkpoint's, or ``ds_config``'s precision)
    is the training dtype DeepSpeed will run in; ``ds_config`` a dict or JSON path of the config that will load
    it; ``param_order`` the model's parameter names in order (see the note above); ``force`` replaces an
    existing ``dst_dir/<tag>``."""
    if not isinstance(world_size, int) or world_size < 1:
        raise CheckpointError(f"world size must be a positive integer, got {world_size!r}")
    if stage not in (0, 1, 2, 3) or (universal and stage == 0):
        raise CheckpointError(f"ZeRO stage must be 0, 1, 2 or 3 (universal: 1-3, as DeepSpeed 0.19 restores those "
                              f"only through a ZeRO optimizer), got {stage!r}")
    tag_dir = mf.find_tag_dir(src_dir, tag)
    tag = mf.check_tag(tag if tag is not None else os.path.basename(os.path.normpath(tag_dir)))
    src = _Source(tag_dir, param_order)
    if universal and any(hyper != src.hyper[0] for hyper in src.hyper):
        get_logger().warning("DeepSpeed 0.19.8 loads a universal checkpoint at ZeRO stage 3 with every param group "
                             "set to the first group's settings (lr, weight_decay, ...), and these groups differ: "
                             "load it at stage 1 or 2, or convert for stage 3 at the target world size instead")
    if stage == 0 and src.frozen:
        get_logger().warning(f"frozen parameters ({src.frozen[0]!r} ...) have no optimizer state: DeepSpeed at stage "
                             "0 loads this when its optimizer holds only the trainable parameters (model_parameters "
                             "filtered by requires_grad), as torch optimizers index every parameter they hold")
    target = _target(world_size, stage, universal, dtype, src.manifest.data.get("dtype", "float32"), ds_config)
    final = os.path.join(dst_dir, tag)
    if os.path.exists(final) and not force:
        raise CheckpointError(f"{final} already exists: refusing to overwrite DeepSpeed tag {tag!r} (pass "
                              "--force to replace it, or --tag another)")
    os.makedirs(dst_dir, exist_ok=True)
    staging = os.path.join(dst_dir, f".ze_to_deepspeed-{tag}-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(staging)
        if universal:
            _write_universal(src, target, staging)
        elif stage == 0:
            _write_stage0(src, target, staging)
        elif stage in (1, 2):
            _write_stage12(src, target, staging)
        else:
            _write_stage3(src, target, staging)
        _move_into_place(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    save_text(tag + "\n", os.path.join(dst_dir, LATEST_UNIVERSAL if universal else LATEST))
    return final


# -- the source -----------------------------------------------------------------
class _Source:
    """A zeroengine checkpoint read one parameter range at a time (shard files memory-mapped, verified once)."""

    def __init__(self, tag_dir: str, param_order: list[str] | None):
        self.manifest = read_manifest(tag_dir)  # zeroengine's, or another DeepSpeed layout (a reshard)
        data = self.manifest.data
        if data.get("optimizer") not in ADAM_OPTIMIZERS:
            raise CheckpointError(f"{tag_dir} holds {data.get('optimizer')} optimizer state; ze_to_deepspeed "
                                  f"converts Adam's (exp_avg, exp_avg_sq, step: optimizers {', '.join(ADAM_OPTIMIZERS)})")
        split = [name for name, info in self.manifest.params.items() if "split" in info]
        if split:
            raise CheckpointError(f"{tag_dir} holds tensor-parallel pieces ({split[0]!r}, ...): ze_to_deepspeed "
                                  "writes data-parallel DeepSpeed checkpoints only; load it into zeroengine "
                                  "without tensor parallelism and save again first")
        self._files: dict[str, dict] = {}
        self.common = self.open(mf.COMMON)
        self.order = _parameter_order(self.manifest, param_order)
        groups = {self.manifest.params[n]["group"] for n in self.order}
        if None in groups:
            raise CheckpointError(f"{tag_dir}: the manifest does not record every parameter's param group")
        # DeepSpeed drops param groups without parameters; the rest keep their order
        self.group_ids = sorted(groups)
        self.groups = [[n for n in self.order if self.manifest.params[n]["group"] == g] for g in self.group_ids]
        hyper = self.common["param_groups"]
        self.hyper = [{k: v for k, v in hyper[g].items() if k != "params"} for g in self.group_ids]
        self.steps, self.moments = (list(x) for x in zip(*(self._group_state(names) for names in self.groups)))
        self.group_of = {n: i for i, names in enumerate(self.groups) for n in names}
        self.extras = self._extras()
        self.frozen = [n for n in self.extras if n in set(data.get("frozen_params", []))]

    def open(self, file: str) -> dict:
        if file not in self._files:
            self._files[file] = self.manifest.open(file)
        return self._files[file]

    def numel(self, name: str) -> int:
        return math.prod(self.manifest.params[name]["shape"])

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self.manifest.params[name]["shape"])

    def _pieces(self, name: str, start: int, end: int):
        for e in self.manifest.entries_overlapping(name, start, end):
            yield e, self.open(e.file)["entries"][e.index]

    def _group_state(self, names: list[str]):
        """The group's step (one for all its parameters, as DeepSpeed's flat groups have) and moment keys."""
        steps, moments = {}, set()
        for name in names:
            for e, entry in self._pieces(name, 0, self.numel(name)):
                unknown = set(entry["state"]) - {"step", *MOMENTS}
                if unknown:
                    raise CheckpointError(f"{self.manifest.tag_dir}: optimizer state of {name!r} holds "
                                          f"{sorted(unknown)}, which Adam's state in DeepSpeed has no place for")
                moments.update(k for k in entry["state"] if k in MOMENTS)
                if "step" in entry["state"]:
                    steps.setdefault(float(entry["state"]["step"]), name)
        if len(steps) > 1:
            raise CheckpointError(f"{self.manifest.tag_dir}: parameters of one param group stand at different "
                                  f"optimizer steps ({dict((v, k) for k, v in steps.items())}); a DeepSpeed flat "
                                  "group has one step")
        step = torch.tensor(next(iter(steps)), dtype=torch.float32) if steps else None
        return step, [k for k in MOMENTS if k in moments]

    def read(self, name: str, start: int, end: int, moments: bool = True) -> dict[str, torch.Tensor]:
        """Elements [start, end) of ``name``'s flattened fp32 value ("fp32") and, if ``moments``, of its Adam
        moments (zeros where a piece has none yet)."""
        keys = ["fp32"] + (self.moments[self.group_of[name]] if moments else [])
        out = {k: torch.zeros(end - start, dtype=torch.float32) for k in keys}
        for e, entry in self._pieces(name, start, end):
            lo, hi = max(start, e.start), min(end, e.end)
            out["fp32"][lo - start:hi - start] = entry["value"].reshape(-1)[lo - e.start:hi - e.start]
            for k in keys[1:]:
                if k in entry["state"]:
                    out[k][lo - start:hi - start] = entry["state"][k].reshape(-1)[lo - e.start:hi - e.start]
        return out

    def _extras(self) -> OrderedDict:
        """Buffers and frozen parameters by state_dict name (rank 0's and every later pipeline stage's)."""
        extras = OrderedDict(self.common["module_extras"])
        for file, info in self.manifest.data["files"].items():
            if info.get("module_extras"):
                extras.update(self.open(file)["module_extras"])
        return extras

    def state_extras(self, dtype: torch.dtype, frozen_only: bool = False) -> OrderedDict:
        """``module_extras`` as DeepSpeed's module holds them: frozen parameters in the training dtype."""
        return OrderedDict((n, v.to(dtype) if n in self.frozen and v.is_floating_point() else v)
                           for n, v in self.extras.items() if n in self.frozen or not frozen_only)


def _parameter_order(manifest: mf.Manifest, given: list[str] | None) -> list[str]:
    """The trained parameters' names in the model's order (see the note: parameter order)."""
    params = manifest.params
    if given is not None:
        order, source = list(given), "the parameter order given"
    elif "param_order" in manifest.data:
        order, source = manifest.data["param_order"], f"{manifest.tag_dir}'s manifest param_order"
    elif manifest.data.get("zero_stage") == 0:
        # stage 0 writes every parameter whole, in the optimizer's order
        order = [entry[0] for info in manifest.data["files"].values() for entry in info.get("entries", [])]
        source = f"{manifest.tag_dir}'s pieces"
    else:
        raise CheckpointError(f"{manifest.tag_dir} does not record the model's parameter order, which DeepSpeed's "
                              "flat groups follow: pass it (--param-order FILE: the names of "
                              "model.named_parameters() one per line, or a state_dict file saved from the model)")
    known = [n for n in dict.fromkeys(order) if n in params]
    missing = [n for n in params if n not in set(known)]
    if missing:
        raise CheckpointError(f"{source} lacks parameters of {manifest.tag_dir}: {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}")
    return known


# -- the target -------------------------------------------------------------------
@dataclass
class _Target:
    world: int
    stage: int
    universal: bool
    dtype: torch.dtype
    ds_config: dict
    clip_grad: float | None = None  # None: the files leave DeepSpeed's own gradient_clipping in place
    fp16: dict = field(default_factory=dict)
    sub_group_size: int = layout_ds.DEFAULT_SUB_GROUP_SIZE

    def optim_file(self, rank: int) -> str:
        return f"{'bf16_' if self.dtype == torch.bfloat16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _target(world: int, stage: int, universal: bool, dtype, stored_dtype: str, ds_config) -> _Target:
    if isinstance(ds_config, (str, os.PathLike)):
        try:
            with open(ds_config) as f:
                ds_config = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise CheckpointError(f"cannot read the DeepSpeed config {ds_config}: {err}") from None
    if isinstance(dtype, str) and dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}: one of fp32, bf16, fp16")
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    config = dict(ds_config or {})
    zero = config.get("zero_optimization") or {}
    enabled = {key: bool((config.get(key) or {}).get("enabled", False)) for key in ("bf16", "bfloat16", "fp16")}
    configured = torch.float16 if enabled["fp16"] else torch.bfloat16 if enabled["bf16"] or enabled["bfloat16"] \
        else torch.float32
    if ds_config is not None and dtype is not None and dtype != configured:
        raise CheckpointError(f"dtype {dtype} disagrees with the DeepSpeed config, which trains in {configured}")
    dtype = dtype or (configured if ds_config is not None else DTYPES.get(stored_dtype, torch.float32))
    if ds_config is not None:
        if int(zero.get("stage", 0)) != stage:
            raise CheckpointError(f"the DeepSpeed config's zero_optimization.stage is {zero.get('stage', 0)}, not "
                                  f"the stage {stage} to write")
        for key in ("round_robin_gradients", "parameter_alignment"):
            if zero.get(key):
                raise CheckpointError(f"zero_optimization.{key}=true changes DeepSpeed's flat layout, which "
                                      "ze_to_deepspeed writes with it off: turn it off in the DeepSpeed config")
        if (zero.get("offload_optimizer") or {}).get("device") == "nvme":
            raise CheckpointError("zero_optimization.offload_optimizer.device 'nvme' keeps DeepSpeed's optimizer "
                                  "state in swap files, which ze_to_deepspeed does not write")
        accum = str((config.get("data_types") or {}).get("grad_accum_dtype", "")).lower()
        if dtype == torch.bfloat16 and stage == 1 and accum in ("fp32", "float32", "float"):
            raise CheckpointError("bf16 with data_types.grad_accum_dtype fp32 at stage 1 runs DeepSpeed's "
                                  "BF16_Optimizer, whose files ze_to_deepspeed does not write")
    else:
        config = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == torch.bfloat16},
                  "fp16": {"enabled": dtype == torch.float16}}
    fp16 = dict(config.get("fp16") or {})
    clip = config.get("gradient_clipping")
    return _Target(world, stage, universal, dtype, config, None if clip is None else float(clip),
                   {"window": int(fp16.get("loss_scale_window", 1000)), "hysteresis": int(fp16.get("hysteresis", 2)),
                    "consecutive": bool(fp16.get("consecutive_hysteresis", False)),
                    "min_scale": fp16.get("min_loss_scale", 1), "static": float(fp16.get("loss_scale", 0) or 0),
                    "configured": ds_config is not None},
                   int(zero.get("sub_group_size", layout_ds.DEFAULT_SUB_GROUP_SIZE)))


# -- what every layout shares ---------------------------------------------------
def _scaler_state(src: _Source, target: _Target) -> dict:
    """zeroengine's loss-scaler state read as DeepSpeed's: scale, iteration, last overflow, hysteresis."""
    state = src.common.get("loss_scaler")
    if target.dtype != torch.float16:
        return {"dynamic": False, "cur_scale": 1.0, "cur_iter": int(src.common["counters"]["global_steps"])}
    if state is None:
        raise CheckpointError(f"{src.manifest.tag_dir} was trained without fp16 loss scaling (dtype "
                              f"{src.manifest.data.get('dtype')}): it has no loss-scaler state for fp16")
    dynamic = state.get("kind") == "dynamic"
    if target.fp16["configured"] and dynamic != (target.fp16["static"] == 0):
        raise CheckpointError(f"{src.manifest.tag_dir} has a {state.get('kind')} loss scale; the DeepSpeed config's "
                              f"fp16.loss_scale ({target.fp16['static']}) asks for the other kind")
    return {"dynamic": dynamic, "cur_scale": state["cur_scale"], "cur_iter": int(state.get("cur_iter", 0)),
            "last_overflow_iter": int(state.get("last_overflow_iter", -1)),
            "cur_hysteresis": int(state.get("cur_hysteresis", target.fp16["hysteresis"]))}


def _zero_globals(src: _Source, target: _Target) -> dict:
    """The loss-scale and clipping entries of a ZeRO optimizer's state_dict: the loss-scaler object DeepSpeed
    pickles (and replaces its own with on load), and clip_grad when the config gives it."""
    s, f = _scaler_state(src, target), target.fp16
    scaler = LossScaler(cur_scale=s["cur_scale"], dynamic=False) if not s["dynamic"] else DynamicLossScaler(
        cur_scale=s["cur_scale"], dynamic=True, cur_iter=s["cur_iter"], last_overflow_iter=s["last_overflow_iter"],
        scale_factor=2.0, scale_window=f["window"], min_scale=f["min_scale"], delayed_shift=f["hysteresis"],
        cur_hysteresis=s["cur_hysteresis"], consecutive_hysteresis=f["consecutive"], raise_error_at_min_scale=True,
        dtype=torch.float16)
    out = {"loss_scaler": scaler, "dynamic_loss_scale": s["dynamic"], "overflow": False}
    if target.clip_grad is not None:
        out["clip_grad"] = target.clip_grad
    return out


def _group_state(src: _Source, g: int, index: int, moments: dict[str, torch.Tensor]) -> dict:
    """{index: torch Adam state} of one flat group or parameter: step, then the moments; {} before any step."""
    if src.steps[g] is None and not src.moments[g]:
        return {}
    return {index: {**({"step": src.steps[g].clone()} if src.steps[g] is not None else {}),
                    **{k: moments[k] for k in src.moments[g]}}}


def _param_groups(src: _Source, params: list[list[int]]) -> list[dict]:
    return [{**hyper, "params": list(ids)} for hyper, ids in zip(src.hyper, params)]


def _module(src: _Source, target: _Target, full: bool, masters: dict | None = None) -> OrderedDict:
    """The model's state_dict in the training dtype: parameters whole (``full``; from ``masters`` when read
    already) or empty (stage 3's)."""
    module = OrderedDict()
    for name in src.order:
        if full:
            master = masters[name] if masters is not None else src.read(name, 0, src.numel(name), False)["fp32"]
            module[name] = master.view(src.shape(name)).to(target.dtype)
        else:
            module[name] = torch.empty(0, dtype=target.dtype)
    extras = src.state_extras(target.dtype)
    for name, value in extras.items():
        module[name] = value if full or name not in src.frozen else torch.empty(0, dtype=value.dtype)
    for alias, name in src.manifest.data.get("aliases", {}).items():
        if name in module:
            module[alias] = module[name]
    return module


def _model_states(src: _Source, target: _Target, module, *, stage: int, optimizer=None, param_shapes=None,
                  frozen_fragments=None) -> dict:
    counters = src.common["counters"]
    aliases = dict(src.manifest.data.get("aliases", {}))
    frozen_shapes = OrderedDict((n, src.extras[n].shape) for n in src.frozen)
    state = {
        "module": module, "buffer_names": [n for n in src.extras if n not in src.frozen], "optimizer": optimizer,
        # (at stage 0 too, where DeepSpeed writes None and ignores it on loading: its optimizer state names
        # parameters by position only, and the list tells a reader which of the module's are not among them)
        "param_shapes": param_shapes, "frozen_param_shapes": frozen_shapes if stage in (0, 2, 3) else None,
        "shared_params": aliases if stage >= 1 else None,
        "frozen_param_fragments": frozen_fragments if stage >= 2 else None,
        "lr_scheduler": src.common.get("lr_scheduler"), "data_sampler": None, "random_ltd": None,
        "skipped_steps": counters["skipped_steps"], "global_steps": counters["global_steps"],
        "global_samples": counters["global_samples"], "dp_world_size": target.world, "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": target.ds_config, "ds_version": DS_VERSION,
    }
    client = src.common.get("client_state") or {}
    clash = sorted(set(client) & set(state))
    if clash:
        raise CheckpointError(f"client_state keys {clash} are names DeepSpeed's model-states file uses itself")
    state.update(client)
    return state


def _shapes(src: _Source, groups: list[list[str]]) -> list[OrderedDict]:
    return [OrderedDict((n, src.shape(n)) for n in names) for names in groups]


def _save(obj, folder: str, *parts: str) -> None:
    path = os.path.join(folder, *parts)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_for_deepspeed(obj, path)


def _save_optim(target: _Target, optimizer_state: dict, out: str, rank: int) -> None:
    _save({"optimizer_state_dict": optimizer_state, "ds_config": target.ds_config, "ds_version": DS_VERSION},
          out, target.optim_file(rank))


# -- the layouts ------------------------------------------------------------------
def _write_stage0(src: _Source, target: _Target, out: str) -> None:
    """One model-states file; its optimizer is the torch optimizer's state_dict (16-bit: inside DeepSpeed's
    FP16_UnfusedOptimizer's, with the fp32 masters)."""
    state, ids, fp32_groups, index = {}, [], [], 0
    for g, names in enumerate(src.groups):
        ids.append([]), fp32_groups.append([])
        for name in names:
            values = src.read(name, 0, src.numel(name))
            shaped = {k: v.view(src.shape(name)) for k, v in values.items()}
            state.update(_group_state(src, g, index, shaped))
            ids[-1].append(index)
            fp32_groups[-1].append(shaped["fp32"])
            index += 1
    optimizer = {"state": state, "param_groups": _param_groups(src, ids)}
    if target.dtype != torch.float32:
        s = _scaler_state(src, target)
        wrapped = {"dynamic_loss_scale": s["dynamic"], "cur_scale": s["cur_scale"], "cur_iter": s["cur_iter"]}
        if s["dynamic"]:
            wrapped.update(last_overflow_iter=s["last_overflow_iter"], scale_factor=2.0,
                           scale_window=target.fp16["window"])
        optimizer = {**wrapped, "optimizer_state_dict": optimizer, "fp32_groups": fp32_groups}
    masters = dict(zip([n for names in src.groups for n in names], [v for vs in fp32_groups for v in vs]))
    module = _module(src, target, True, masters)
    _save(_model_states(src, target, module, stage=0, optimizer=optimizer), out, "mp_rank_00_model_states.pt")


def _write_stage12(src: _Source, target: _Target, out: str) -> None:
    """One model-states file (the whole model in the training dtype) and one optimizer file per rank: its
    partition of every param group's flat fp32 values (without the trailing padding) and moments (with it)."""
    frozen = src.state_extras(target.dtype, frozen_only=True)
    _save(_model_states(src, target, _module(src, target, True), stage=target.stage,
                        param_shapes=_shapes(src, src.groups), frozen_fragments=frozen),
          out, "mp_rank_00_model_states.pt")
    partitions = [layout_ds.flat_group_partitions([src.numel(n) for n in names], target.world)
                  for names in src.groups]
    for rank in range(target.world):
        states, fp32s, paddings, mappings = {}, [], [], []
        for g, names in enumerate(src.groups):
            part = partitions[g][rank]
            flat = {k: torch.zeros(part.size, dtype=torch.float32) for k in ["fp32", *src.moments[g]]}
            mapping = OrderedDict()
            for f in part.fragments:
                piece = src.read(names[f.index], f.param_start, f.param_start + f.numel)
                for k, v in piece.items():
                    flat[k][f.flat_start:f.flat_start + f.numel] = v
                mapping[names[f.index]] = fragment_address(numel=f.numel, start=f.flat_start)
            states.update(_group_state(src, g, g, flat))
            fp32s.append(flat["fp32"][:part.size - part.padding].clone())
            paddings.append(part.padding)
            mappings.append(mapping)
        optimizer_state = {
            **_zero_globals(src, target),
            "base_optimizer_state": {"state": states, "param_groups": _param_groups(src, [[g] for g in
                                                                                        range(len(src.groups))])},
            "single_partition_of_fp32_groups": fp32s, "zero_stage": ZeroStageEnum(target.stage),
            "group_paddings": paddings, "param_alignment_paddings": [[0] * len(names) for names in src.groups],
            "partition_count": [target.world] * len(src.groups), "ds_version": DS_VERSION,
            "param_slice_mappings": mappings,
        }
        _save_optim(target, optimizer_state, out, rank)


def _write_stage3(src: _Source, target: _Target, out: str) -> None:
    """Per rank: a model-states file (parameters empty, buffers whole, its pieces of frozen parameters) and an
    optimizer file with its piece of every parameter, flat per sub-group, and the moments alike."""
    world = target.world
    sub_groups, owner = [], []  # names per sub-group; the param group of each
    for g, names in enumerate(src.groups):
        for indices in layout_ds.stage3_sub_groups([src.numel(n) for n in names], world, target.sub_group_size):
            sub_groups.append([names[i] for i in indices])
            owner.append(g)
    module = _module(src, target, False)
    extras = src.state_extras(target.dtype)
    for rank in range(world):
        frozen = OrderedDict()
        for name in src.frozen:
            value = extras[name].reshape(-1)
            start, real = layout_ds.stage3_piece(value.numel(), world, rank)
            piece = torch.zeros(layout_ds.stage3_partition_numel(value.numel(), world), dtype=value.dtype)
            piece[:real] = value[start:start + real]
            frozen[name] = piece
        _save(_model_states(src, target, module, stage=3, param_shapes=_shapes(src, sub_groups),
                            frozen_fragments=frozen), out, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        states, flats = {}, []
        for s, names in enumerate(sub_groups):
            g = owner[s]
            size = sum(layout_ds.stage3_partition_numel(src.numel(n), world) for n in names)
            flat = {k: torch.zeros(size, dtype=torch.float32) for k in ["fp32", *src.moments[g]]}
            offset = 0
            for name in names:
                start, real = layout_ds.stage3_piece(src.numel(name), world, rank)
                for k, v in src.read(name, start, start + real).items():
                    flat[k][offset:offset + real] = v
                offset += layout_ds.stage3_partition_numel(src.numel(name), world)
            states.update(_group_state(src, g, s, flat))
            flats.append(flat["fp32"])
        scaler = _zero_globals(src, target)
        optimizer_state = {
            "zero_stage": ZeroStageEnum.weights, "loss_scaler": scaler["loss_scaler"],
            "dynamic_loss_scale": scaler["dynamic_loss_scale"], "overflow": False, "partition_count": world,
            "optimizer_state_dict": {"state": states, "param_groups": _param_groups(
                src, [[s for s in range(len(sub_groups)) if owner[s] == g] for g in range(len(src.groups))])},
            "fp32_flat_groups": flats,
        }
        _save_optim(target, optimizer_state, out, rank)


def _write_universal(src: _Source, target: _Target, out: str) -> None:
    """ds_to_universal's layout: each parameter's full fp32 value and moments in zero/<name>/, the optimizer's
    common state in zero/optimizer_state.pt, and model-states files for stages 1-2 and stage 3 alike."""
    for name in src.order:
        g = src.group_of[name]
        values = src.read(name, 0, src.numel(name))
        for key, value in values.items():
            _save({"cat_dim": 0, "param": value.view(src.shape(name))}, out, "zero", name, f"{key}.pt")
        if src.steps[g] is not None:
            _save(src.steps[g].clone(), out, "zero", name, "step.pt")
    groups = _param_groups(src, [[g] for g in range(len(src.groups))])
    first_step = next((s for s in src.steps if s is not None), None)
    optimizer_state = {
        **_zero_globals(src, target), "zero_stage": ZeroStageEnum(target.stage), "ds_version": DS_VERSION,
        "param_groups": groups,
        # stage 3's universal loader reads the step and the settings from here
        "optimizer_state_dict": {"state": {0: {"step": first_step}} if first_step is not None else {},
                                 "param_groups": groups},
    }
    _save(optimizer_state, out, "zero", "optimizer_state.pt")
    frozen = src.state_extras(target.dtype, frozen_only=True)
    shapes = _shapes(src, src.groups)
    _save(_model_states(src, target, _module(src, target, True), stage=2, param_shapes=shapes,
                        frozen_fragments=frozen), out, "mp_rank_00_model_states.pt")
    _save(_model_states(src, target, _module(src, target, False), stage=3, param_shapes=shapes,
                        frozen_fragments=frozen), out, "zero_pp_rank_0_mp_rank_00_model_states.pt")


def _move_into_place(staging: str, final: str) -> None:
    """Rename the complete staging folder to the tag (an existing one, which --force allowed, swapped out)."""
    fsync_dir(staging)
    old = f"{staging}-replaced" if os.path.exists(final) else None
    if old is not None:
        os.replace(final, old)
    os.replace(staging, final)
    fsync_dir(os.path.dirname(final) or ".")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- the command ------------------------------------------------------------------
def _read_order(path: str) -> list[str]:
    """Names from a text file (one a line; blank lines and '#' comments skipped) or a torch state_dict file."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PK\x03\x04":  # torch.save's zip format: a state_dict saved from the model
        loaded = load_tensors(path, mmap=False)
        return list(loaded.keys() if isinstance(loaded, dict) else loaded)
    with open(path) as f:
        return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ze_to_deepspeed",
        description="Rewrite a zeroengine checkpoint in DeepSpeed 0.19's layout (ZeRO stage S at data-parallel "
                    "world size N, or universal), for DeepSpeed's engine.load_checkpoint to resume from.")
    parser.add_argument("src", help="the save_dir given to save_checkpoint, or one tag folder")
    parser.add_argument("dst", help="the DeepSpeed checkpoint folder to write (DST/<tag>, then DST/latest)")
    parser.add_argument("--world", type=int, required=True, help="DeepSpeed's data-parallel world size")
    parser.add_argument("--stage", type=int, required=True, choices=(0, 1, 2, 3), help="DeepSpeed's ZeRO stage")
    parser.add_argument("-t", "--tag", default=None, help="the tag to convert and write (default: SRC's latest)")
    parser.add_argument("--universal", action="store_true",
                        help="write DeepSpeed's universal layout (load with checkpoint.load_universal, any world)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                        help="DeepSpeed's training precision (default: --config's, else the checkpoint's)")
    parser.add_argument("--config", default=None, help="the DeepSpeed config (JSON) that will load the checkpoint")
    parser.add_argument("--param-order", default=None,
                        help="the model's parameter names in order: a text file (one a line) or a state_dict file")
    parser.add_argument("--force", action="store_true", help="replace DST/<tag> if it exists")
    args = parser.parse_args(argv)
    try:
        order = _read_order(args.param_order) if args.param_order else None
        written = write_deepspeed_checkpoint(args.src, args.dst, args.world, args.stage, tag=args.tag,
                                             universal=args.universal, dtype=args.dtype, ds_config=args.config,
                                             param_order=order, force=args.force)
    except (CheckpointError, OSError) as err:
        print(f"ze_to_deepspeed: {err}", file=sys.stderr)
        return 1
    kind = "universal" if args.universal else f"ZeRO stage {args.stage}, data-parallel world size {args.world}"
    print(f"ze_to_deepspeed: wrote {written} (DeepSpeed {DS_VERSION} layout, {kind})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
