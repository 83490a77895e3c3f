"""``engine.load_checkpoint``: any tag, written by any world size and ZeRO stage, into this engine.

Each rank asks the manifest which files hold the (parameter, range) pieces it
owns in *its* layout and copies just those ranges, so resharding is a by-product
of addressing values by name and range. Loading happens in two phases: first
every rank checks everything it will read (the manifest, names and shapes,
checksums of the files it needs) with no collective in flight; the ranks agree
that all succeeded; only then are values written and parameters refreshed
(collectives). A bad file therefore fails every rank with the same named
error, and never leaves some ranks waiting in a collective.
"""
from __future__ import annotations

import os
import time

import torch

from zeroengine import comm
from zeroengine.progress import get_logger
from zeroengine.tensor_parallel.layers import split_of
from zeroengine.zero.gathered import GatheredParameters
from zeroengine.zero.optimizer import reduced_elsewhere
from zeroengine.zero.param_guard import full_shape

from . import manifest as mf
from . import stateful
from . import tensor_split as ts
from .agreement import exchange, raise_failures
from .files import CheckpointError
from .formats import read_manifest
from .state import WHOLE_PARAMETER, parameter_places, restore_rng, stored_shape


def load_checkpoint(engine, load_dir: str, tag=None, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False, strict: bool = True,
                    report_unmatched: bool = True):
    """Returns ``(tag_dir, client_state)``, or ``(None, None)`` when ``load_dir`` holds no checkpoint.

    ``strict`` (DeepSpeed's ``load_module_strict``), as in ``load_state_dict``: every value of the model
    comes from the checkpoint and every stored value goes into the model. Without it, what the checkpoint
    lacks keeps the model's own value (a trainable one starts with a fresh optimizer state) and what the
    model lacks is skipped; ``report_unmatched`` says so in a warning (off when the caller loads the weights
    its own way next: ``custom_load_fn``)."""
    rank = comm.get_rank()
    plan, problem = None, None
    optimizer_states = load_optimizer_states and not load_module_only
    try:
        plan = _Plan(engine, load_dir, tag, optimizer_states, strict)
    except CheckpointError as err:
        problem = str(err)
    if plan is not None and plan.tag_dir is None and problem is None:
        if rank == 0:
            get_logger().warning(f"no checkpoint to load in {load_dir} (no 'latest' file there, and no tag given)")
    # A stored parameter no rank's model claims is one this model does not have (strict, as load_state_dict).
    # Ranks claim different ones under expert parallelism, so only what every rank leaves unclaimed counts.
    # Every rank must also be about to load the same save: different tags, or different 'latest' files (a
    # save_dir that is not shared), would otherwise mix two checkpoints into one model without a word.
    found = plan is not None and problem is None
    mine = {"unclaimed": sorted(plan.unclaimed) if found and plan.tag_dir else None,
            "checkpoint": _identity(plan) if found else "unreadable"}
    everyone = exchange("load_checkpoint/unclaimed", mine)
    unclaimed = [r["unclaimed"] for r in everyone]
    lists = [set(u) for u in unclaimed if u is not None]
    nobody = sorted(set.intersection(*lists)) if lists and len(lists) == len(unclaimed) else []
    if nobody and problem is None and strict:
        problem = (f"checkpoint {plan.tag_dir} has parameter(s) {nobody[:8]}{' ...' if len(nobody) > 8 else ''} "
                   "that this model does not have")
    identities = [r["checkpoint"] for r in everyone if r["checkpoint"] != "unreadable"]
    if problem is None and any(i != identities[0] for i in identities):
        lines = "; ".join(f"rank {r}: {_describe(e['checkpoint'])}" for r, e in enumerate(everyone))
        problem = (f"the ranks would load different checkpoints ({lines}). Pass the same tag on every rank, and "
                   "give every rank the same load_dir on a shared filesystem (a node-local copy with its own "
                   "'latest' file resolves to another tag)")
    reports = exchange("load_checkpoint", problem, first=False)
    raise_failures({r: msg for r, msg in enumerate(reports) if msg},
                   f"cannot load the checkpoint from {load_dir}; nothing was changed: it failed")
    if plan.tag_dir is None:
        return None, None

    common = plan.common
    plan.apply_pieces(optimizer_states)
    _load_module_extras(engine, plan.module_values, strict)
    client_state = dict(common["client_state"])
    if not load_module_only:
        _load_training_state(engine, common, optimizer_states, load_lr_scheduler_states, plan.group_order)
        plan.restore_rng()
        own = plan.files.get(mf.shard_file(rank))
        unrestored = stateful.restore(own.get("stateful") if isinstance(own, dict) else None,
                                      getattr(engine, "stateful_objects", {}), client_state,
                                      plan.manifest.data["world_size"], comm.get_world_size())
        if unrestored and rank == 0:
            get_logger().warning(f"load_checkpoint: not restored: {'; '.join(unrestored)}")
    if rank == 0:
        which = "DeepSpeed checkpoint" if plan.manifest.data["format"] == "deepspeed" else "checkpoint"
        get_logger().info(f"loaded {which} {plan.tag_dir} (written by {plan.manifest.data['world_size']} "
                          f"rank(s) at ZeRO stage {plan.manifest.data['zero_stage']})")
        if not strict and report_unmatched and (plan.missing or nobody):
            get_logger().warning(f"load_module_strict=False: {_some(plan.missing)} kept this model's values (not in "
                                 f"the checkpoint); {_some(nobody)} of the checkpoint skipped (not in this model)")
    return plan.tag_dir, client_state


def _some(names: list[str]) -> str:
    """``3 entries (a, b, c)``, at most five named."""
    if not names:
        return "no entries"
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return f"{len(names)} entr{'y' if len(names) == 1 else 'ies'} ({shown})"


def _identity(plan) -> list | None:
    """Which save this rank will load: [tag, creation time] from its manifest, None when there is none."""
    if plan.tag_dir is None:
        return None
    return [plan.manifest.data.get("tag", os.path.basename(plan.tag_dir)), plan.manifest.data.get("created")]


def _describe(identity) -> str:
    if identity == "unreadable":
        return "could not read its checkpoint"
    if identity is None:
        return "no checkpoint (no 'latest' file)"
    tag, created = identity
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created)) if created is not None else "?"
    return f"tag {tag!r} saved {when}"


# Optimizers whose per-parameter state is the same (step, exp_avg, exp_avg_sq): offload swaps torch's
# Adam/AdamW for CPUAdam, a GPU run may use FusedAdam, and a checkpoint moves between them.
_STATE_FAMILY = {name: "Adam" for name in ("Adam", "AdamW", "CPUAdam", "FusedAdam", "LeanAdam")}


class _Plan:
    """Everything this rank will read, checked before anything is written."""

    def __init__(self, engine, load_dir: str, tag, optimizer_states: bool, strict: bool = True):
        self.engine, self.strict = engine, strict
        self.tag_dir = mf.resolve_tag_dir(load_dir, tag)
        if self.tag_dir is None:
            return
        self.manifest = read_manifest(self.tag_dir)
        self.places = parameter_places(engine.module)
        self.pieces = engine.optimizer.checkpoint_pieces()
        if mf.COMMON not in self.manifest.data["files"]:
            raise CheckpointError(f"{self.tag_dir}: the manifest does not list {mf.COMMON}")
        self.files = {mf.COMMON: self.manifest.open(mf.COMMON)}
        self.common = self.files[mf.COMMON]
        loader = _loader_to_resume(engine, self.common)
        if loader is not None:
            try:
                loader.check_state(self.common["data_loader"])
            except ValueError as err:
                raise CheckpointError(f"checkpoint {self.tag_dir}: {err}") from None
        # buffers and frozen parameters: rank 0's in common.pt, later pipeline stages' in their shard files
        self.extras = dict(self.common["module_extras"])
        for file, info in self.manifest.data["files"].items():
            if info.get("module_extras"):
                self.files.setdefault(file, self.manifest.open(file))
                self.extras.update(self.files[file]["module_extras"])
        self._full_values: dict[str, dict[str, torch.Tensor]] = {}
        self._match_names()
        # Optimizer settings and state follow parameters into this run's groups; a load without them
        # (load_optimizer_states=False, load_module_only: warm starts) may regroup freely, as in DeepSpeed.
        self.group_order = self._match_groups() if optimizer_states else None
        if optimizer_states:
            self._check_optimizer_type()
        needed = set()
        if os.path.exists(self.manifest.path(mf.shard_file(comm.get_rank()))):
            needed.add(mf.shard_file(comm.get_rank()))
        for piece in self.pieces:
            if id(piece.param) in self.resharded:
                continue
            if id(piece.param) not in self.from_extras and id(piece.param) not in self.kept:
                needed.update(entry.file for entry in self._entries(piece))
        for stored in {n for names in self.resharded.values() for n in names}:
            needed.update(e.file for e in self.manifest.entries_overlapping(stored, 0, ts.numel(self.manifest.params,
                                                                                                   stored)))
        for place, numel in self.from_shards.values():
            needed.update(e.file for e in self.manifest.entries_overlapping(place.name, place.offset,
                                                                            place.offset + numel))
        for file in sorted(needed - set(self.files)):
            if file in self.manifest.data["files"]:
                self.files[file] = self.manifest.open(file)
        self.module_values = dict(self.extras)
        for name, (place, numel) in self.from_shards.items():
            if id(self.module_state[name]) in self.resharded:
                self.module_values[name] = self._local_of(self.module_state[name], "value")
                continue
            self.module_values[name] = self._assemble(place.name, place.offset, place.offset + numel).view(
                full_shape(self.module_state[name]))

    def _stored(self, piece) -> tuple[str, int, int]:
        """(stored name, start, end) of a piece's elements in the checkpoint."""
        place = self.places[id(piece.param)]
        return place.name, place.offset + piece.start, place.offset + piece.end

    def _entries(self, piece):
        return self.manifest.entries_overlapping(*self._stored(piece))

    def _match_names(self) -> None:
        """Where each of this model's values comes from, checked both ways (as a strict load_state_dict):

        * a parameter the optimizer holds: its stored (sharded) values, or, if it was frozen when saved,
          the module extras (``from_extras``: its fp32 values are cut from there, with no optimizer state);
        * a frozen parameter or a buffer: the module extras, or, if it was trained when saved, its
          sharded values (``from_shards``);
        * anything else is missing: an error, unless not strict (``kept``: the model keeps its value);
          stored parameters no model rank claims are refused by the caller, unless not strict.
        """
        saved, extras = self.manifest.params, self.extras
        self.module_state = self.engine.module.state_dict(keep_vars=True)
        names_of: dict[int, list[str]] = {}
        for name, t in self.module_state.items():
            names_of.setdefault(id(t), []).append(name)
        managed = {id(p): p for p in self.engine.optimizer.checkpoint_params()}
        self.from_extras: dict[int, torch.Tensor] = {}
        self.from_shards: dict[str, tuple] = {}
        self.kept: set[int] = set()  # trainable parameters the checkpoint lacks (not strict): left as they are
        # id(parameter) -> the stored names its full tensor is merged from, when it is stored cut another way
        # (tensor parallelism at another size, or none: see tensor_split)
        self.resharded: dict[int, list[str]] = {}
        missing, claimed = [], set()
        for pid, p in managed.items():
            place = self.places[pid]
            claimed.add(place.name)
            if place.name in saved:
                self._check_shape(place.name, stored_shape(place, p), saved[place.name]["shape"])
                continue
            if self._cut_another_way(p, place, claimed):
                continue
            extra = next((extras[n] for n in names_of.get(pid, []) if n in extras), None)
            if extra is None:
                missing.append(place.name)
                self.kept.add(pid)
            else:
                self._check_shape(place.name, list(full_shape(p)), list(extra.shape))
                self.from_extras[pid] = extra
        for name, t in self.module_state.items():
            if id(t) in managed or name in extras:
                continue
            place = self.places.get(id(t)) if isinstance(t, torch.nn.Parameter) else None
            if place is not None and place.name not in saved and self._cut_another_way(t, place, claimed):
                self.from_shards[name] = (place, full_shape(t).numel())
                continue
            if place is not None and place.name in saved:
                claimed.add(place.name)
                self._check_shape(name, list(full_shape(t)),
                                  saved[place.name]["shape"] if place.shape is None else list(full_shape(t)))
                self.from_shards[name] = (place, full_shape(t).numel())
            else:
                missing.append(name)
        if missing and self.strict:
            excluded = set(self.manifest.data.get("frozen_params", [])) \
                if self.manifest.data.get("frozen_params_excluded") else set()
            hint = (": it was saved with exclude_frozen_parameters=True; pass load_module_strict=False to keep "
                    "this model's values for its frozen parameters") if set(missing) <= excluded else \
                " (load_module_strict=False keeps this model's values for what the checkpoint lacks)"
            raise CheckpointError(f"checkpoint {self.tag_dir} has no values for {sorted(missing)[:8]}"
                                  f"{' ...' if len(missing) > 8 else ''} of this model{hint}")
        self.unclaimed = set(saved) - claimed
        self.missing = sorted(missing)  # (only when not strict: kept as the model has them)

    def _cut_another_way(self, p: torch.Tensor, place, claimed: set) -> bool:
        """Whether ``p`` is stored whole or in tensor-parallel pieces other than its own; if so it is read by
        merging them (``resharded``) and they are claimed."""
        if place.offset or place.shape is not None:  # (stacked experts: never tensor-parallel)
            return False
        names = ts.stored_pieces(self.manifest.params, ts.base_name(place.name))
        if names is None:
            return False
        split = split_of(p)
        mine = list(split.full_shape) if split is not None else list(full_shape(p))
        self._check_shape(ts.base_name(place.name), mine, ts.full_shape_of(self.manifest.params, names))
        self.resharded[id(p)] = names
        claimed.update(names)
        return True

    def _full(self, names: list[str], key: str) -> torch.Tensor | None:
        """The whole tensor (``key`` "value", or an optimizer moment) of the parameter stored as ``names``."""
        cache = self._full_values.setdefault(names[0], {})
        if key not in cache:
            flats = []
            for stored in names:
                n = ts.numel(self.manifest.params, stored)
                flat = None
                for e in self.manifest.entries_overlapping(stored, 0, n):
                    src = self.files[e.file]["entries"][e.index]
                    v = src["value"] if key == "value" else src["state"].get(key)
                    if not (isinstance(v, torch.Tensor) and v.dim() > 0):
                        return None
                    flat = torch.empty(n, dtype=v.dtype) if flat is None else flat
                    flat[e.start:e.end] = v
                flats.append(flat)
            cache[key] = ts.merge(self.manifest.params, names, flats)
        return cache[key]

    def _local_of(self, p: torch.Tensor, key: str) -> torch.Tensor | None:
        """This rank's piece of ``p``'s stored ``key`` tensor, flat (None: no such moment stored)."""
        full = self._full(self.resharded[id(p)], key)
        if full is None:
            return None
        split = split_of(p)
        return (split.shard(full) if split is not None else full).reshape(-1)

    def _match_groups(self) -> list[int | None]:
        """For each saved param group, the index of this optimizer's group that holds the same parameters
        (the manifest records each parameter's group), so settings follow parameters, not positions. With as
        many groups as saved, a group none of this rank's pieces tells about goes by position; otherwise a
        saved group with no parameter here (all frozen now) is None: its settings have nothing to apply to."""
        saved = self.manifest.params
        n_saved = len(self.common["param_groups"])
        now = {id(p): i for i, g in enumerate(self.engine.optimizer.param_groups) for p in g["params"]}
        mapping: dict[int, int] = {}
        witness: dict[int, str] = {}  # saved group -> the first parameter that placed it
        for piece in self.pieces:
            name = self.places[id(piece.param)].name
            was, is_now = saved.get(name, {}).get("group"), now.get(id(piece.opt_param))
            if was is None or is_now is None:
                continue
            other = next((g for g, i in mapping.items() if i == is_now and g != was), None)
            if mapping.setdefault(was, is_now) != is_now or other is not None:
                first = witness[was] if other is None else witness[other]
                first_was = was if other is None else other
                raise CheckpointError(
                    f"param groups differ from checkpoint {self.tag_dir}: parameter {name!r} was in saved group "
                    f"{was} and is in group {is_now} now, but {first!r} was in saved group {first_was} and is in "
                    f"group {mapping[first_was]} now. Build the same param groups (in any order) to load the "
                    "optimizer state, or pass load_optimizer_states=False (or load_module_only=True) to load "
                    "the weights alone")
            witness.setdefault(was, name)
        n_now = len(self.engine.optimizer.param_groups)
        free = [i for i in range(n_now) if i not in mapping.values()]
        return [mapping[i] if i in mapping else (free.pop(0) if free and n_saved == n_now else None)
                for i in range(n_saved)]

    def _check_optimizer_type(self) -> None:
        """Optimizer state is loaded only into the optimizer type that wrote it (SGD's momentum buffers are
        not Adam's moments: torch would fail inside the next step)."""
        saved = self.manifest.data.get("optimizer")
        mine = type(self.engine.optimizer.optimizer).__name__
        if saved is not None and _STATE_FAMILY.get(saved, saved) != _STATE_FAMILY.get(mine, mine):
            raise CheckpointError(f"checkpoint {self.tag_dir} holds {saved} optimizer state and this engine's "
                                  f"optimizer is {mine}: pass load_optimizer_states=False to load the weights "
                                  "(and counters and scheduler) with a fresh optimizer state")

    def _check_shape(self, name: str, mine: list, theirs: list) -> None:
        if list(mine) != list(theirs):
            raise CheckpointError(f"parameter {name!r} has shape {list(mine)} in this model but "
                                  f"{list(theirs)} in checkpoint {self.tag_dir}")

    def _assemble(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the stored parameter ``name``, from every file that holds some."""
        out = torch.empty(end - start, dtype=torch.float32)
        for e in self.manifest.entries_overlapping(name, start, end):
            lo, hi = max(start, e.start), min(end, e.end)
            out[lo - start:hi - start] = self.files[e.file]["entries"][e.index]["value"][lo - e.start:hi - e.start]
        return out

    @torch.no_grad()
    def apply_pieces(self, with_optimizer_state: bool) -> None:
        state = self.engine.optimizer.state
        if with_optimizer_state:
            state.clear()
        for piece in self.pieces:
            if id(piece.param) in self.kept:  # not in the checkpoint (a non-strict load): as it is
                continue
            extra = self.from_extras.get(id(piece.param))
            if extra is not None:  # frozen when saved: values only, the optimizer state starts fresh
                piece.value.copy_(extra.reshape(-1)[piece.start:piece.end].view(piece.value.shape))
                continue
            if id(piece.param) in self.resharded:
                self._apply_resharded(piece, with_optimizer_state, state)
                continue
            name, start, end = self._stored(piece)
            entries = self.manifest.entries_overlapping(name, start, end)
            value = self._assemble(name, start, end)
            moments: dict[str, torch.Tensor] = {}
            scalars: dict = {}
            for e in entries:
                src = self.files[e.file]["entries"][e.index]
                lo, hi = max(start, e.start), min(end, e.end)
                for key, v in src["state"].items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        dst = moments.setdefault(key, torch.empty(end - start, dtype=v.dtype))
                        dst[lo - start:hi - start] = v[lo - e.start:hi - e.start]
                    else:
                        scalars.setdefault(key, v)
            piece.value.copy_(value.view(piece.value.shape))
            if with_optimizer_state and (moments or scalars):
                if any(not self.files[e.file]["entries"][e.index]["state"] for e in entries):
                    raise CheckpointError(f"checkpoint {self.tag_dir} has optimizer state for only part of "
                                          f"parameter {name!r}")
                state[piece.opt_param] = self._optimizer_state(piece, moments, scalars)
        self.engine.optimizer.after_checkpoint_load()

    def _apply_resharded(self, piece, with_optimizer_state: bool, state: dict) -> None:
        """A piece of a parameter stored cut another way: its elements of the merged, re-cut tensors."""
        names = self.resharded[id(piece.param)]
        piece.value.copy_(self._local_of(piece.param, "value")[piece.start:piece.end].view(piece.value.shape))
        if not with_optimizer_state:
            return
        first = next(iter(self.manifest.entries_overlapping(names[0], 0, 1)))
        stored_state = self.files[first.file]["entries"][first.index]["state"]
        moments = {key: self._local_of(piece.param, key)[piece.start:piece.end]
                   for key, v in stored_state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        scalars = {key: v for key, v in stored_state.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
        if moments or scalars:
            state[piece.opt_param] = self._optimizer_state(piece, moments, scalars)

    def _optimizer_state(self, piece, moments: dict, scalars: dict) -> dict:
        target = piece.opt_param
        group = next(g for g in self.engine.optimizer.param_groups if any(p is target for p in g["params"]))
        on_device = group.get("fused") or group.get("capturable")
        # per-element state in the dtype this run keeps it in (bf16 moments and fp32 ones load into each other)
        dtype = getattr(getattr(self.engine.optimizer, "optimizer", None), "state_dtype", None) or target.dtype
        out = {key: m.to(device=target.device, dtype=dtype).view(target.shape) for key, m in moments.items()}
        for key, v in scalars.pop(WHOLE_PARAMETER, {}).items():  # whole-parameter statistics: as saved
            out[key] = v.clone().to(target.device)
        for key, v in scalars.items():
            # torch.optim keeps "step" on the CPU unless the step runs fused/captured on the device.
            out[key] = v.clone().to(target.device if on_device else "cpu") if isinstance(v, torch.Tensor) else v
        return out

    def restore_rng(self) -> None:
        own = self.files.get(mf.shard_file(comm.get_rank()))
        if own is not None and "rng" in own:
            restore_rng(own["rng"])


@torch.no_grad()
def _load_module_extras(engine, extras: dict, strict: bool = True) -> None:
    """Frozen parameters and buffers (and parameters frozen when saved: the module copy of their values)."""
    targets = engine.module.state_dict(keep_vars=True)
    unknown = sorted(set(extras) - set(targets))
    if unknown and strict:
        raise CheckpointError(f"the checkpoint has module entries {unknown[:8]} this model does not have")
    extras = {name: value for name, value in extras.items() if name in targets}
    # every rank copies the same values in; a pipeline stage's copy of a tied weight is whole on every rank
    params = [targets[name] for name in extras
              if isinstance(targets[name], torch.nn.Parameter) and not reduced_elsewhere(targets[name])]
    with GatheredParameters(params, modifier_rank=0):
        for name, value in extras.items():
            target = targets[name]
            if tuple(target.shape) != tuple(value.shape):
                raise CheckpointError(f"module entry {name!r} has shape {tuple(target.shape)} in this model but "
                                      f"{tuple(value.shape)} in the checkpoint")
            target.data.copy_(value)


def _loader_to_resume(engine, common: dict):
    """The engine's training loader when the checkpoint holds its position and the config resumes it (checked
    while planning, loaded with the training state), else None."""
    loader = getattr(engine, "training_dataloader", None)
    if common.get("data_loader") is None or not hasattr(loader, "load_state_dict") \
            or not engine.config.checkpoint.resume_data_position:
        return None
    return loader


def _load_training_state(engine, common: dict, optimizer_states: bool, scheduler_states: bool,
                         group_order: list[int]) -> None:
    counters = common["counters"]
    engine.global_steps = counters["global_steps"]
    engine.global_samples = counters["global_samples"]
    engine.micro_steps = counters["micro_steps"]
    engine.skipped_steps = counters["skipped_steps"]
    engine.optimizer.steps_applied = engine.global_steps - engine.skipped_steps
    groups = engine.optimizer.param_groups
    if optimizer_states:  # (group_order was checked before anything was written: _Plan._match_groups)
        for index, values in zip(group_order, common["param_groups"]):
            if index is not None:
                groups[index].update(values)
    loader = _loader_to_resume(engine, common)
    if loader is not None:
        loader.load_state_dict(common["data_loader"])  # the next pass continues where the saved one stopped
    scaler = engine.optimizer.loss_scaler
    if scaler is not None and common["loss_scaler"] is not None:
        scaler.load_state_dict(common["loss_scaler"])
    if scheduler_states and engine.lr_scheduler is not None and common["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(common["lr_scheduler"])
