"""A DeepSpeed checkpoint read as a zeroengine manifest: parameter names and flat ranges over DeepSpeed's files.

zeroengine's loader addresses every value by (parameter name, range of the
flattened parameter), which is what lets a checkpoint load at any world size
and stage. DeepSpeed's files address them by rank instead, so this module
computes, from the metadata DeepSpeed stores, which range of which parameter
each piece of each rank's file holds:

* stages 1-2: each rank's partition of a flat param group, with
  ``param_slice_mappings`` giving each parameter's slice in it;
* stage 3: each parameter cut into ``ceil(numel / N)`` pieces, rank R's piece
  of every parameter concatenated (in ``param_shapes`` order) into its flat
  sub-groups;
* stage 0: whole parameters, the optimizer's state by parameter index;
* universal folders: one file per parameter and state.

:class:`DeepSpeedManifest` then serves "files" in zeroengine's shape (entries of
fp32 values and optimizer state; a common part with counters, scheduler, loss
scaler, buffers and client_state), built from DeepSpeed's memory-mapped files
on demand, so the loader, ``ze_to_fp32`` and ``ze_from_deepspeed`` read both
formats through one path.
"""
from __future__ import annotations

import math
import os

import torch

from ..files import CheckpointError
from ..manifest import COMMON, Entry, Manifest
from .layout import UNIVERSAL_DIR, DeepSpeedFiles
from .pickles import DynamicLossScaler, load_deepspeed_file

# keys DeepSpeed's load_checkpoint keeps for itself; the rest of the model-states file is client_state
_ENGINE_KEYS = {"module", "optimizer", "lr_scheduler", "skipped_steps", "global_steps", "dp_world_size",
                "mp_world_size", "data_sampler", "random_ltd"}
_OPTIMIZER_NAMES = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "cpuadam": "Adam", "fusedadam": "Adam"}
_STATE_FILE = "state"  # the virtual file of a stage-0 or universal checkpoint's values


class DeepSpeedManifest(Manifest):
    """A DeepSpeed tag directory as a :class:`Manifest`: ``data`` in zeroengine's manifest shape, ``open`` builds
    each virtual file from DeepSpeed's."""

    @classmethod
    def read(cls, tag_dir: str) -> "DeepSpeedManifest":
        found = DeepSpeedFiles.find(tag_dir)
        self = cls(tag_dir, {})
        self._found = found
        self._loaded: dict[str, dict] = {}
        self._models = {part: self._load(found.model_states[part][0]) for part in found.parts}
        self._model = self._models[0]  # counters, scheduler, config, client_state: the first part's
        stage = _zero_stage(self._model, found)
        dp = int(self._model.get("dp_world_size", 1))
        found.check_ranks(dp, stage)
        self._builders: dict[str, tuple] = {}  # virtual file -> how to build its entries
        self.stage, self.dp = stage, dp
        self._part_shapes = {part: self._parameters(part) for part in found.parts}
        shapes, groups = {}, {}
        for part_shapes, part_groups in self._part_shapes.values():
            for name in part_shapes:  # a tied weight held by several pipeline stages: the first one's
                shapes.setdefault(name, part_shapes[name])
                groups.setdefault(name, part_groups[name])
        self._shapes = shapes
        aliases = {alias: source for model in self._models.values()
                   for alias, source in (model.get("shared_params") or {}).items() if source in shapes}
        owner: dict[str, int] = {}
        for part in found.parts:
            mine = {n: s for n, s in self._part_shapes[part][0].items() if owner.setdefault(n, part) == part}
            if found.universal:
                self._index_universal(mine)
            elif stage == 0:
                self._index_stage0(part, mine)
            elif stage == 3:
                self._index_stage3(part, mine)
            else:
                self._index_stage12(part, mine)
        for entries in self._entries.values():
            entries.sort(key=lambda e: e.start)
        config = self._model.get("ds_config") or {}
        self.data = {
            "format": "deepspeed", "version": 1, "tag": os.path.basename(os.path.normpath(tag_dir)),
            "created": os.path.getmtime(found.model_states[0][0]), "world_size": dp, "zero_stage": stage,
            "dtype": _dtype_name(config, self._model), "optimizer": self._optimizer_name(config),
            "params": {name: {"shape": list(shape), "dtype": _dtype_name(config, self._model), "group": groups[name]}
                       for name, shape in shapes.items()},
            "param_order": list(shapes), "aliases": aliases, "files": {COMMON: {}, **{file: {"entries": index} for file, (index, _) in
                                                         self._builders.items()}},
            "frozen_params": sorted(self._frozen_names()), "frozen_params_excluded": False,
        }
        return self

    # -- what the loader calls --------------------------------------------------------------------------------
    def verify_file(self, file: str) -> str:
        return self.tag_dir  # DeepSpeed records no checksums; each file is checked as it is read

    def open(self, file: str) -> dict:
        if file == COMMON:
            return self._common()
        index, build = self._builders[file]
        return {"entries": build(), "index": index}

    # -- reading DeepSpeed's files ------------------------------------------------------------------------------
    def _load(self, path: str) -> dict:
        if path not in self._loaded:
            self._loaded[path] = load_deepspeed_file(path)
        return self._loaded[path]

    def _optim(self, rank: int, part: int = 0) -> dict:
        path = self._found.optim_states[part][rank]
        state = self._load(path)
        if "optimizer_state_dict" not in state:
            raise CheckpointError(f"{path} has no 'optimizer_state_dict': not a DeepSpeed 0.19 optimizer-state file")
        return state["optimizer_state_dict"]

    def _module(self) -> dict[str, torch.Tensor]:
        """The whole module's state_dict: the model-states file's, or a pipeline's layer files merged (each
        layer's names prefixed with its index, as PipelineModule names them)."""
        if not self._found.layers:
            return self._model["module"]
        if not hasattr(self, "_layers_module"):
            merged = {}
            for index, path in sorted(self._found.layers.items()):
                merged.update({f"{index}.{name}": value for name, value in self._load(path).items()})
            self._layers_module = merged
        return self._layers_module

    def _buffer_names(self) -> set[str]:
        return {name for model in self._models.values() for name in (model.get("buffer_names") or [])}

    def _parameters(self, part: int) -> tuple[dict[str, list], dict[str, int]]:
        """A part's trained parameters in DeepSpeed's order: name -> shape, name -> param group."""
        shapes, groups = {}, {}
        model = self._models[part]
        if self.stage == 0 and not self._found.universal:
            for name in self._stage0_names(part):
                shapes[name] = list(self._module()[name].shape)
            order = [len(g["params"]) for g in _stage0_optimizer(model, self._path(part))["param_groups"]]
            for g, count in enumerate(order):
                for name in list(shapes)[sum(order[:g]):sum(order[:g]) + count]:
                    groups[name] = g
            return shapes, groups
        param_shapes = model.get("param_shapes")
        if not param_shapes:
            raise CheckpointError(f"{self._path(part)} has no 'param_shapes': not a DeepSpeed 0.19 ZeRO checkpoint")
        for g, group in enumerate(param_shapes):
            for name, shape in group.items():
                shapes[name], groups[name] = list(shape), g
        return shapes, groups

    def _path(self, part: int) -> str:
        return self._found.model_states[part][0]

    def _stage0_names(self, part: int) -> list[str]:
        """Stage 0 names the optimizer's parameters by position only (torch numbers them group after group). They
        are the module's parameters (buffers, second names of tied weights and listed frozen ones left out; a
        pipeline stage takes the next ones after the stages before it), each group's in the module's order; with
        several groups, which parameter is in which group is found from the shapes of its state, and must be
        the only assignment that fits."""
        # (frozen_param_shapes: DeepSpeed leaves it None at stage 0; ze_to_deepspeed lists the frozen ones there)
        frozen = {n for model in self._models.values() for n in (model.get("frozen_param_shapes") or {})}
        names = _parameter_names(self._module(), self._buffer_names() | frozen)
        optimizers = [_stage0_optimizer(self._models[p], self._path(p)) for p in self._found.parts]
        counts = [sum(len(g["params"]) for g in o["param_groups"]) for o in optimizers]
        if sum(counts) != len(names):
            raise CheckpointError(f"{self._path(part)}: a stage-0 DeepSpeed checkpoint names no parameters in its "
                                  f"optimizer state (it holds {sum(counts)} by position) and the module has "
                                  f"{len(names)} parameters, so which is which is unknown (frozen parameters?); load "
                                  "it with load_optimizer_states=False, or consolidate it with zero_to_fp32")
        index = self._found.parts.index(part)
        mine = names[sum(counts[:index]):sum(counts[:index]) + counts[index]]
        groups = optimizers[index]["param_groups"]
        if len(groups) == 1:
            return mine
        wrapper = self._models[part]["optimizer"] or {}
        slots = [[_stage0_slot_shape(optimizers[index], wrapper, g, position, i, self._path(part))
                  for position, i in enumerate(group["params"])] for g, group in enumerate(groups)]
        module = self._module()
        split = _split_by_shapes(mine, {n: list(module[n].shape) for n in mine}, slots, self._path(part))
        return [name for group in split for name in group]

    def _optimizer_name(self, config: dict) -> str | None:
        configured = (config.get("optimizer") or {}).get("type")
        if configured:
            return _OPTIMIZER_NAMES.get(str(configured).lower(), str(configured))
        state = self._some_optimizer_state()
        if "exp_avg_sq" in state:
            return "Adam"
        if "momentum_buffer" in state:
            return "SGD"
        return None

    def _some_optimizer_state(self) -> dict:
        if self._found.universal:
            folder = os.path.join(self.tag_dir, UNIVERSAL_DIR, next(iter(self._shapes)))
            return {f[:-3]: None for f in os.listdir(folder) if f.endswith(".pt")}
        if self.stage == 0:
            return next(iter(_stage0_optimizer(self._model, self._path(0))["state"].values()), {})
        return next(iter(_base_state(self._optim(0))["state"].values()), {})

    # -- indexing: which (name, range) each piece of each file holds ------------------------------------------------
    def _add(self, file: str, index: list, build) -> None:
        self._builders[file] = (index, build)
        for i, (name, start, end) in enumerate(index):
            self._entries.setdefault(name, []).append(Entry(start, end, file, i))

    def _index_stage12(self, part: int, shapes: dict) -> None:
        seen: dict[str, int] = {}
        for rank in range(self.dp):
            optim, path = self._optim(rank, part), self._found.optim_states[part][rank]
            mappings = optim.get("param_slice_mappings")
            if mappings is None:
                raise CheckpointError(f"{path} has no 'param_slice_mappings' (written by a DeepSpeed older than "
                                      "0.9?): re-save it with DeepSpeed 0.19, or consolidate it with zero_to_fp32")
            index, pieces = [], []
            for g, mapping in enumerate(mappings):
                for name, where in mapping.items():
                    if name not in self._part_shapes[part][0]:
                        raise CheckpointError(f"{path} holds parameter {name!r}, which param_shapes does not list")
                    if name not in shapes:
                        continue  # a tied weight another pipeline stage's files provide
                    start = seen.get(name, 0)
                    seen[name] = start + where.numel
                    index.append([name, start, start + where.numel])
                    pieces.append((g, where.start, where.numel))
            self._add(os.path.basename(path), index,
                      lambda rank=rank, pieces=pieces: self._stage12_entries(rank, part, pieces))
        self._check_complete(shapes, seen)

    def _stage12_entries(self, rank: int, part: int, pieces: list) -> list[dict]:
        optim = self._optim(rank, part)
        flats = optim["single_partition_of_fp32_groups"]
        state = _base_state(optim)["state"]
        out = []
        for g, start, numel in pieces:
            group_state = state.get(g, {})
            out.append({"value": flats[g][start:start + numel].float(),
                        "state": _slice_state(group_state, start, numel)})
        return out

    def _index_stage3(self, part: int, shapes: dict) -> None:
        seen: dict[str, int] = {}
        for rank in range(self.dp):
            optim, path = self._optim(rank, part), self._found.optim_states[part][rank]
            flats = optim.get("fp32_flat_groups")
            if flats is None:
                raise CheckpointError(f"{path} has no 'fp32_flat_groups': not a DeepSpeed 0.19 stage-3 optimizer-state "
                                      "file")
            index, pieces = [], []
            sub_group, offset = 0, 0
            for name, shape in shapes.items():
                numel = math.prod(shape)
                per_rank = -(-numel // self.dp)
                while sub_group < len(flats) and offset == flats[sub_group].numel():
                    sub_group, offset = sub_group + 1, 0
                if sub_group == len(flats):
                    raise CheckpointError(f"{path}: its flat groups end before parameter {name!r}; param_shapes and "
                                          "the optimizer state disagree")
                start = min(rank * per_rank, numel)
                count = max(0, min(numel, (rank + 1) * per_rank) - start)
                if count:
                    index.append([name, start, start + count])
                    pieces.append((sub_group, offset, count))
                    seen[name] = seen.get(name, 0) + count
                offset += per_rank
            if sub_group != len(flats) - 1 or offset != flats[-1].numel():
                raise CheckpointError(f"{path}: its flat groups hold more elements than param_shapes lists; the files "
                                      "do not belong together")
            self._add(os.path.basename(path), index,
                      lambda rank=rank, pieces=pieces: self._stage3_entries(rank, part, pieces))
        self._check_complete(shapes, seen)

    def _stage3_entries(self, rank: int, part: int, pieces: list) -> list[dict]:
        optim = self._optim(rank, part)
        flats = optim["fp32_flat_groups"]
        state = _base_state(optim)["state"]
        return [{"value": flats[g][start:start + numel].float(), "state": _slice_state(state.get(g, {}), start, numel)}
                for g, start, numel in pieces]

    def _index_stage0(self, part: int, shapes: dict) -> None:
        index = [[name, 0, math.prod(shape)] for name, shape in shapes.items()]
        self._add(f"{_STATE_FILE}-{part}", index, lambda: self._stage0_entries(part, list(shapes)))

    def _stage0_entries(self, part: int, wanted: list[str]) -> list[dict]:
        """Stage 0: the fp32 masters (the module itself in fp32; the optimizer wrapper's fp32 copies in 16-bit
        training) and the torch optimizer's per-parameter state, by position."""
        model = self._models[part]
        wrapper = model["optimizer"] or {}
        optimizer = _stage0_optimizer(model, self._path(part))
        shapes = self._part_shapes[part][0]
        names = list(shapes)
        masters = _stage0_masters(wrapper, shapes)
        ids = [i for g in optimizer["param_groups"] for i in g["params"]]
        out = []
        for position, name in enumerate(names):
            if name not in wanted:
                continue
            value = masters[position] if masters is not None else self._module()[name]
            state = optimizer["state"].get(ids[position], {})
            out.append({"value": value.reshape(-1).float(),
                        "state": {k: (v.reshape(-1) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                                  for k, v in state.items()}})
        return out

    def _index_universal(self, shapes: dict) -> None:
        """One virtual file per parameter (its folder), so a rank reads only the parameters it holds."""
        for name, shape in shapes.items():
            self._add(f"{UNIVERSAL_DIR}/{name}", [[name, 0, math.prod(shape)]],
                      lambda name=name: self._universal_entries(name))

    def _universal_entries(self, name: str) -> list[dict]:
        folder = os.path.join(self.tag_dir, UNIVERSAL_DIR, name)
        if not os.path.isdir(folder):
            raise CheckpointError(f"universal checkpoint {self.tag_dir} has no folder {UNIVERSAL_DIR}/{name} for "
                                  "that parameter: it is incomplete")
        state = {}
        for file in sorted(os.listdir(folder)):
            if file.endswith(".pt"):
                loaded = load_deepspeed_file(os.path.join(folder, file))
                tensor = loaded["param"] if isinstance(loaded, dict) else loaded
                state[file[:-3]] = tensor.reshape(-1) if tensor.dim() > 0 else tensor
        if "fp32" not in state:
            raise CheckpointError(f"universal checkpoint folder {folder} has no fp32.pt")
        return [{"value": state.pop("fp32").float(), "state": state}]

    def _check_complete(self, shapes: dict, seen: dict) -> None:
        for name, shape in shapes.items():
            if seen.get(name, 0) != math.prod(shape):
                raise CheckpointError(f"DeepSpeed checkpoint {self.tag_dir} holds {seen.get(name, 0)} of the "
                                      f"{math.prod(shape)} elements of parameter {name!r} across its rank files: "
                                      "they are from different saves or a file is damaged")

    # -- the common part --------------------------------------------------------------------------------------------
    def _frozen_names(self) -> set[str]:
        if self.stage == 3:
            return set(self._model.get("frozen_param_shapes") or {})
        buffers = self._buffer_names()
        aliases = {alias for model in self._models.values() for alias in (model.get("shared_params") or {})}
        return {n for n in self._module() if n not in self._shapes and n not in buffers and n not in aliases}

    def _module_extras(self) -> dict[str, torch.Tensor]:
        """Buffers and frozen parameters, full, by state_dict name."""
        module = self._module()
        extras = {name: module[name] for name in module if name in self._buffer_names()}
        if self.stage != 3:
            for name in self._frozen_names():
                extras[name] = module[name]
            return extras
        for name, shape in (self._model.get("frozen_param_shapes") or {}).items():
            pieces = [self._load(self._found.model_states[0][r])["frozen_param_fragments"][name]
                      for r in range(self.dp)]
            extras[name] = torch.cat([p.reshape(-1) for p in pieces])[:math.prod(shape)].view(shape)
        return extras

    def _common(self) -> dict:
        model = self._model
        config = model.get("ds_config") or {}
        steps = int(model.get("global_steps", 0))
        accumulation = config.get("gradient_accumulation_steps", 1)
        groups, scaler = self._groups_and_scaler()
        return {
            "counters": {"global_steps": steps, "global_samples": int(model.get("global_samples", 0)),
                         "micro_steps": steps * (accumulation if isinstance(accumulation, int) else 1),
                         "skipped_steps": int(model.get("skipped_steps", 0))},
            "param_groups": groups,
            "lr_scheduler": model.get("lr_scheduler"),
            "loss_scaler": scaler,
            "module_extras": self._module_extras(),
            "client_state": {k: v for k, v in model.items() if k not in _ENGINE_KEYS},
        }

    def _groups_and_scaler(self) -> tuple[list[dict], dict | None]:
        if self._found.universal:
            common = load_deepspeed_file(os.path.join(self.tag_dir, UNIVERSAL_DIR, "optimizer_state.pt"))
            groups, scaler_state = common.get("param_groups", []), common
        elif self.stage == 0:
            wrapper = self._model["optimizer"] or {}
            groups = _stage0_optimizer(self._model, self._path(0))["param_groups"]
            scaler_state = wrapper
        else:
            optim = self._optim(0)
            groups, scaler_state = _base_state(optim)["param_groups"], optim
        settings = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        return settings, _loss_scaler(scaler_state, self._model.get("ds_config") or {})


# -- helpers ------------------------------------------------------------------------------------------------------
def _zero_stage(model: dict, found: DeepSpeedFiles) -> int:
    config = model.get("ds_config") or {}
    stage = (config.get("zero_optimization") or {}).get("stage")
    if isinstance(stage, int):
        return stage
    if not found.optim_states:
        return 0
    return 3 if len(found.model_states[0]) > 1 or "zero_pp_rank_0" in found.model_states[0][0] else 1


def _dtype_name(config: dict, model: dict) -> str:
    if (config.get("bf16") or config.get("bfloat16") or {}).get("enabled"):
        return "bfloat16"
    if (config.get("fp16") or {}).get("enabled"):
        return "float16"
    return "float32"


def _parameter_names(module: dict, buffers: set) -> list[str]:
    """A module state_dict's parameters in order: buffers and second names of tied weights (which share the
    first name's storage in the file) left out."""
    names, storages = [], set()
    for name, tensor in module.items():
        if name in buffers:
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset()) if tensor.numel() else None
        if key is not None and key in storages:
            continue
        storages.add(key)
        names.append(name)
    return names


def _stage0_optimizer(model: dict, path: str) -> dict:
    optimizer = model.get("optimizer")
    if not optimizer:
        raise CheckpointError(f"{path} has no optimizer state (saved without it?): load it with "
                              "load_optimizer_states=False")
    inner = optimizer.get("optimizer_state_dict", optimizer)  # fp16/bf16 wrappers hold torch's state inside
    if "state" not in inner or "param_groups" not in inner:
        raise CheckpointError(f"{path}: its 'optimizer' entry is not a torch optimizer state_dict")
    return inner


def _stage0_slot_shape(optimizer: dict, wrapper: dict, group: int, position: int, index: int, path: str) -> list:
    """The shape of the parameter at ``position`` of param group ``group`` (torch index ``index``): its moment's,
    or its fp32 master's in a 16-bit wrapper."""
    moment = optimizer["state"].get(index, {}).get("exp_avg")
    if isinstance(moment, torch.Tensor) and moment.dim() > 0:
        return list(moment.shape)
    masters = wrapper.get("fp32_groups")
    if masters is not None:
        return list(masters[group][position].shape)
    raise CheckpointError(f"{path}: parameter {index} of param group {group} has no optimizer state, so its shape, "
                          "and which of the module's parameters it is, is unknown; load with "
                          "load_optimizer_states=False")


def _split_by_shapes(names: list[str], shapes: dict, slots: list[list], path: str,
                     limit: int = 1_000_000) -> list[list[str]]:
    """``names`` (in order) dealt into the param groups whose parameter shapes ``slots`` lists, each group's in
    order: the one assignment that fits, or an error when none or several do (or the search runs past
    ``limit`` states)."""
    # forward over the names: the ways (capped at 2) to reach each (positions in the groups), and one way there
    layer: dict[tuple, tuple[int, tuple | None, int | None]] = {(0,) * len(slots): (1, None, None)}
    history = []
    for name in names:
        following: dict[tuple, tuple[int, tuple | None, int | None]] = {}
        for positions, (count, _, _) in layer.items():
            for g, slot in enumerate(slots):
                if positions[g] < len(slot) and slot[positions[g]] == shapes[name]:
                    after = _advance(positions, g)
                    known = following.get(after, (0, positions, g))
                    following[after] = (min(2, known[0] + count), known[1], known[2])
        if sum(len(s) for s in history) + len(following) > limit:
            raise CheckpointError(f"{path}: too many ways to match the module's parameters to the stage-0 "
                                  "optimizer's param groups by shape; load with load_optimizer_states=False")
        history.append(layer)
        layer = following
    end = tuple(len(slot) for slot in slots)
    count = layer.get(end, (0, None, None))[0]
    if count != 1:
        why = "no assignment fits" if count == 0 else "several assignments fit (same shapes in different groups)"
        raise CheckpointError(f"{path}: a stage-0 DeepSpeed optimizer names its parameters by position only, and "
                              f"matching the module's to its {len(slots)} param groups by shape fails: {why}; load "
                              "with load_optimizer_states=False (the weights alone), or re-save at ZeRO stage 1+")
    picks, positions = [], end
    for back in reversed(history + [layer]):
        _, before, g = back[positions]
        if before is None:
            break
        picks.append(g)
        positions = before
    picks.reverse()
    out: list[list[str]] = [[] for _ in slots]
    for name, g in zip(names, picks):
        out[g].append(name)
    return out


def _advance(positions: tuple, group: int) -> tuple:
    return positions[:group] + (positions[group] + 1,) + positions[group + 1:]


def _stage0_masters(wrapper: dict, shapes: dict) -> list[torch.Tensor] | None:
    """The fp32 master copies a 16-bit stage-0 DeepSpeed optimizer keeps, one per parameter in order."""
    if "fp32_groups" in wrapper:
        return [t for group in wrapper["fp32_groups"] for t in group]
    if "fp32_groups_flat" in wrapper:
        out, flats = [], list(wrapper["fp32_groups_flat"])
        names, g, offset = list(shapes), 0, 0
        for name in names:
            numel = math.prod(shapes[name])
            while offset >= flats[g].numel():
                g, offset = g + 1, 0
            out.append(flats[g][offset:offset + numel])
            offset += numel
        return out
    return None


def _base_state(optim: dict) -> dict:
    """The torch optimizer state_dict inside a ZeRO optimizer's (stage 1-2: base_optimizer_state)."""
    return optim.get("base_optimizer_state") or optim["optimizer_state_dict"]


def _slice_state(state: dict, start: int, numel: int) -> dict:
    return {k: (v[start:start + numel] if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
            for k, v in state.items()}


def _loss_scaler(holder: dict, config: dict) -> dict | None:
    """DeepSpeed's loss-scaler state as zeroengine's (fp16 only: fp32 and bf16 have none in zeroengine)."""
    if not (config.get("fp16") or {}).get("enabled"):
        return None
    scaler = holder.get("loss_scaler")
    if isinstance(scaler, DynamicLossScaler) or (scaler is None and holder.get("dynamic_loss_scale")):
        source = vars(scaler) if scaler is not None else holder
        return {"kind": "dynamic", "cur_scale": float(source["cur_scale"]), "cur_iter": int(source["cur_iter"]),
                "last_overflow_iter": int(source.get("last_overflow_iter", -1)),
                "cur_hysteresis": int(source.get("cur_hysteresis", source.get("delayed_shift", 1)))}
    source = vars(scaler) if scaler is not None else holder
    return {"kind": "static", "cur_scale": float(source.get("cur_scale", 1.0))}
