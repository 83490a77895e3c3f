"""``engine.save_checkpoint``: every rank writes its slices; the tag counts only once all have.

The protocol (Note: crash-safe, collective-safe saves):

1. *arrive*: every rank posts the tag it is saving (and any client_state
   error) through a store handshake with a deadline, so a save called on
   rank 0 only fails with a message naming the missing ranks instead of
   hanging, and all ranks agree on the tag and a staging directory;
2. *write*: each rank writes ``shard_<rank>.pt`` (its fp32 values and
   optimizer state by parameter name and flat range, its RNG state) into the
   staging directory, rank 0 also ``common.pt``; every file atomically;
3. *report*: every rank posts its files' checksums, or its error;
4. *commit* (rank 0, only if every rank reported success): the manifest is
   written, the staging directory renamed to the tag, then ``latest`` updated.
   Any failure before that leaves ``latest`` and the previous tags untouched.
"""
from __future__ import annotations

import glob
import os
import shutil
import time
import uuid
from dataclasses import dataclass

import torch

from zeroengine import comm
from zeroengine.progress import get_logger
from zeroengine.tensor_parallel.layers import split_of
from zeroengine.zero.gathered import GatheredParameters
from zeroengine.zero.optimizer import reduced_elsewhere

from . import manifest as mf
from .agreement import exchange, gather_to_rank0, raise_failures
from .files import CheckpointError, fsync_dir, save_json, save_tensors, save_text
from .state import (
    WHOLE_PARAMETER,
    capture_rng,
    check_plain,
    numbers_as_python,
    parameter_aliases,
    parameter_names,
    parameter_places,
    stored_shape,
    whole_parameter_keys,
)
from .stateful import registered_states, split_client_state


@dataclass
class SaveJob:
    """One rank's part of a save once its collective part is done: the payloads it writes (tensors still the
    live ones; an asynchronous save replaces them by a host snapshot) and what rank 0 commits. Writing and
    committing (:func:`write_and_commit`) only meet through the store, so they may run in a background thread."""
    save_dir: str
    tag: str
    staging: str
    rank: int
    shard: dict  # shard_<rank>.pt's payload
    shard_index: dict  # its entry in the manifest's file table, less the checksum
    common: dict | None  # rank 0: common.pt's payload
    params: dict
    order: list
    manifest_fields: dict  # what the manifest says about the run (world size, stage, ...), frozen parameters
    save_latest: bool


def save_checkpoint(engine, save_dir: str, tag=None, client_state=None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> str:
    """Write a checkpoint of ``engine`` under ``save_dir/tag``; every rank must call it. Returns the tag dir.

    ``exclude_frozen_parameters`` (DeepSpeed's; adapters over a frozen base model) leaves out parameters that
    do not require grad; loading such a checkpoint takes ``load_module_strict=False``, which keeps the loading
    model's own values for them. The manifest names them either way (``frozen_params``)."""
    return write_and_commit(prepare_save(engine, save_dir, tag, client_state, save_latest, exclude_frozen_parameters))


def prepare_save(engine, save_dir: str, tag, client_state, save_latest: bool,
                 exclude_frozen_parameters: bool) -> SaveJob:
    """The collective part of a save (steps 1 and what needs the engine): agree on the tag, land offload's
    delayed update, gather what the optimizer does not hold, and collect this rank's payloads."""
    rank = comm.get_rank()
    tag = mf.check_tag(f"global_step{engine.global_steps}" if tag is None else tag)
    problem, training_state, rank_states = None, None, {}
    try:
        client_state, client_states = split_client_state(client_state)
        rank_states = {"client_state": client_states,
                       "registered": registered_states(getattr(engine, "stateful_objects", {}))}
        training_state = _training_state(engine)
    except CheckpointError as err:
        problem = str(err)
    arrival = _exchange("save_checkpoint", {"tag": tag, "nonce": uuid.uuid4().hex[:12], "error": problem})
    raise_failures({r: p["error"] for r, p in enumerate(arrival) if p["error"]}, "save_checkpoint refused")
    tag = _agreed_tag(engine, arrival)
    # offload's delayed update reaches the weights (collective: after the exchange that names a missing rank),
    # so what is saved is every update applied, and resuming equals going on
    engine.optimizer.land_delayed_update()
    staging = mf.staging_dir(save_dir, tag) + "-" + arrival[0]["nonce"]
    # collective under stage 3: before any rank can fail alone
    module_extras, frozen = _module_extras(engine, exclude_frozen_parameters)
    shard, shard_index = _shard_payload(engine, rank, module_extras if rank != 0 else None)
    if any(rank_states.values()):
        shard["stateful"] = rank_states  # the script's own objects, this rank's (zeroengine.checkpoint.stateful)
    return SaveJob(
        save_dir=save_dir, tag=tag, staging=staging, rank=rank, shard=shard, shard_index=shard_index,
        common=_common_state(engine, training_state, module_extras, client_state) if rank == 0 else None,
        params=_param_table(engine), order=_parameter_order(engine),
        manifest_fields=_manifest_fields(engine, frozen, exclude_frozen_parameters), save_latest=save_latest)


def write_and_commit(job: SaveJob) -> str:
    """Steps 2-4: write this rank's files into the staging directory, report, and (rank 0, when every rank
    wrote) commit. Every rank learns the outcome; a failure leaves ``latest`` and the previous tags as they
    were. Returns the tag directory."""
    rank, tag = job.rank, job.tag
    report = {"files": {}, "params": job.params, "order": job.order, "error": None}
    try:
        os.makedirs(job.staging, exist_ok=True)
        name = mf.shard_file(rank)
        report["files"][name] = {**save_tensors(job.shard, os.path.join(job.staging, name)), **job.shard_index}
        if job.common is not None:
            report["files"][mf.COMMON] = save_tensors(job.common, os.path.join(job.staging, mf.COMMON))
    except Exception as err:  # noqa: BLE001 - reported to every rank, then re-raised below
        report["error"] = f"{type(err).__name__}: {err}"
    # Only rank 0 commits, so only it reads the file and parameter tables; every rank learns of failures.
    reports = gather_to_rank0("save_checkpoint/report", report, first=False)
    errors = _exchange("save_checkpoint/errors", {"error": report["error"]}, first=False)
    failed = {r: rep["error"] for r, rep in enumerate(errors) if rep["error"]}

    outcome = {"error": None}
    if rank == 0:
        try:
            if failed:
                shutil.rmtree(job.staging, ignore_errors=True)
            else:
                _commit(job, reports)
        except Exception as err:  # noqa: BLE001
            outcome["error"] = f"{type(err).__name__}: {err}"
    outcome = _exchange("save_checkpoint/commit", outcome if rank == 0 else {"error": None}, first=False)[0]
    raise_failures(failed, f"checkpoint {tag!r} was not saved (latest still names the previous one); writing failed")
    if outcome["error"]:
        shutil.rmtree(job.staging, ignore_errors=True)  # every rank: on an unshared save_dir each has its own
        raise CheckpointError(f"checkpoint {tag!r} was not committed by rank 0: {outcome['error']}")
    tag_dir = os.path.join(job.save_dir, tag)
    if rank == 0:
        get_logger().info(f"saved checkpoint {tag_dir}")
    return tag_dir


_SAVE_ADVICE = (". Call engine.save_checkpoint on all ranks, not under `if rank == 0:` "
                "(only rank 0 writes the shared files anyway)")


def _exchange(name: str, payload: dict, first: bool = True) -> list[dict]:
    return exchange(name, payload, _SAVE_ADVICE if first else "", first)


def _agreed_tag(engine, arrival: list[dict]) -> str:
    tags = {p["tag"] for p in arrival}
    if len(tags) == 1:
        return arrival[0]["tag"]
    by_rank = ", ".join(f"rank {r}: {p['tag']!r}" for r, p in enumerate(arrival))
    mode = engine.config.checkpoint.tag_validation
    if mode == "Fail":
        raise CheckpointError(f"ranks are saving under different tags ({by_rank}); checkpoint.tag_validation "
                              "is 'Fail'")
    if mode == "Warn" and comm.get_rank() == 0:
        get_logger().warning(f"ranks are saving under different tags ({by_rank}); using rank 0's")
    return arrival[0]["tag"]


def _shard_payload(engine, rank: int, module_extras: dict | None = None) -> tuple[dict, dict]:
    """This rank's slices: every piece it owns (stage 0: one replica writes), with its optimizer state; and
    a later pipeline stage's buffers and frozen parameters (``module_extras``; rank 0's go in common.pt).
    Returns the payload and its entry in the manifest's file table (less what writing it adds)."""
    places = parameter_places(engine.module)
    state = engine.optimizer.state
    whole_keys = whole_parameter_keys(engine.optimizer)
    entries, index = [], []
    replicated_over_tp = engine.mesh.tp_rank > 0  # what every tensor rank holds alike: the first one writes
    for piece in engine.optimizer.checkpoint_pieces():
        if piece.replicated and comm.get_rank_in(piece.group) != 0:
            continue
        if replicated_over_tp and split_of(piece.param) is None:
            continue
        value = piece.value.detach().reshape(-1)
        if value.untyped_storage().nbytes() > value.numel() * value.element_size():
            value = value.clone()  # a view into a larger flat buffer: torch.save would write all of it
        opt_state = {k: (v.detach().reshape(-1) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                     for k, v in state.get(piece.opt_param, {}).items() if k not in whole_keys}
        whole = {k: v.detach().cpu().clone() for k, v in state.get(piece.opt_param, {}).items() if k in whole_keys}
        if whole:  # (statistics of the whole parameter, the same on every rank holding a piece: kept whole)
            opt_state[WHOLE_PARAMETER] = whole
        entries.append({"value": value.float() if value.dtype != torch.float32 else value, "state": opt_state})
        place = places[id(piece.param)]
        index.append([place.name, place.offset + piece.start, place.offset + piece.end])
    payload = {"rank": rank, "rng": capture_rng(), "entries": entries}
    if module_extras:
        payload["module_extras"] = module_extras
    return payload, {"rank": rank, "entries": index, "module_extras": bool(module_extras)}


def _module_extras(engine, exclude_frozen: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Buffers and parameters the optimizer does not hold (frozen ones), full, by state_dict name, without the
    frozen parameters if ``exclude_frozen``; and the frozen parameters' names. Written by rank 0 and, under
    model parallelism, by the first data- and tensor-parallel rank of every pipeline stage (each holds other
    layers); empty on the others. A pipeline stage's copy of a tied weight is its owner's, stored there."""
    managed = {id(p) for p in engine.optimizer.checkpoint_params()}
    named = engine.module.state_dict(keep_vars=True)
    extras = {name: t for name, t in named.items() if id(t) not in managed
              and not (isinstance(t, torch.nn.Parameter) and reduced_elsewhere(t))}
    frozen = sorted(name for name, t in extras.items() if isinstance(t, torch.nn.Parameter))
    if exclude_frozen:
        extras = {name: t for name, t in extras.items() if name not in frozen}
    params = [t for t in extras.values() if isinstance(t, torch.nn.Parameter)]
    mesh = engine.mesh
    writes = comm.get_rank() == 0 or (mesh.model_parallel and mesh.dp_rank == 0 and mesh.tp_rank == 0)
    with GatheredParameters(params):
        if not writes:
            return {}, frozen
        return {name: t.detach().clone() for name, t in extras.items()}, frozen


def _training_state(engine) -> dict:
    """Param-group settings, scheduler and loss-scaler state, as they will be written: numpy scalars
    become Python numbers, and anything else a weights-only load could not read is refused now, by
    every rank, rather than found when the checkpoint fails to load."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    scheduler = engine.lr_scheduler
    scaler = engine.optimizer.loss_scaler
    loader = getattr(engine, "training_dataloader", None)
    state = numbers_as_python({
        "data_loader": loader.state_dict() if hasattr(loader, "state_dict") else None,
        "param_groups": groups,
        "lr_scheduler": scheduler.state_dict() if scheduler is not None and hasattr(scheduler, "state_dict")
        else None,
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
    })
    for key, where in (("param_groups", "the optimizer's param_groups"), ("lr_scheduler", "the lr scheduler's "
                       "state_dict()"), ("loss_scaler", "the loss scaler's state_dict()")):
        check_plain(state[key], where)
    return state


def _common_state(engine, training_state, module_extras, client_state) -> dict:
    return {
        "counters": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                     "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps},
        **training_state,
        "module_extras": module_extras,
        "client_state": client_state if client_state is not None else {},
    }


def _param_table(engine) -> dict:
    """Name -> full shape and param-group index of the parameters this rank knows (merged over ranks)."""
    places = parameter_places(engine.module)
    group_of = {id(p): i for i, g in enumerate(engine.optimizer.param_groups) for p in g["params"]}
    groups = {}
    for piece in engine.optimizer.checkpoint_pieces():
        groups.setdefault(places[id(piece.param)].name, group_of.get(id(piece.opt_param)))
    dtype = str(engine.policy.param_dtype).replace("torch.", "")  # the model's; stored values are fp32
    table = {}
    for p in engine.optimizer.checkpoint_params():
        place = places[id(p)]
        table[place.name] = {"shape": stored_shape(place, p), "dtype": dtype, "group": groups.get(place.name)}
        if split_of(p) is not None:
            table[place.name]["split"] = split_of(p).as_dict()
    return table


def _parameter_order(engine) -> list[str]:
    """This rank's parameters' stored names in the model's order (named_parameters): the manifest's
    ``param_order`` (the params table is a JSON object, whose key order is not kept), which DeepSpeed's flat
    groups follow when ze_to_deepspeed writes them."""
    places = parameter_places(engine.module)
    held = {places[id(p)].name for p in engine.optimizer.checkpoint_params()}
    return [name for name in dict.fromkeys(places[id(p)].name for p in engine.module.parameters()) if name in held]


def _manifest_fields(engine, frozen: list[str], exclude_frozen: bool) -> dict:
    """What the manifest says about the run, read from the engine when the save is called."""
    return {
        "world_size": comm.get_world_size(), "zero_stage": engine.zero_stage,
        "dtype": str(engine.policy.param_dtype).replace("torch.", ""),
        "optimizer": type(engine.optimizer.optimizer).__name__,
        "aliases": parameter_aliases(engine.module, parameter_names(engine.module)),
        "frozen_params": frozen, "frozen_params_excluded": bool(exclude_frozen),
    }


def _commit(job: SaveJob, reports: list[dict]) -> None:
    save_dir, tag, staging = job.save_dir, job.tag, job.staging
    files, params = {}, {}
    for rank, report in enumerate(reports):
        files.update(report["files"])
        for file, info in report["files"].items():
            # Rank 0 commits every rank's files by renaming one directory: they must all be there for it.
            path = os.path.join(staging, file)
            if not os.path.isfile(path) or os.path.getsize(path) != info["bytes"]:
                raise CheckpointError(f"rank {rank} wrote {file} but rank 0 does not see it in {staging}: "
                                      f"save_dir must be a filesystem every rank shares (the previous "
                                      f"checkpoint and 'latest' are unchanged)")
        for name, info in report["params"].items():
            known = params.setdefault(name, info)
            if known["group"] is None:
                known["group"] = info["group"]
    data = {
        "format": mf.FORMAT, "version": mf.VERSION, "tag": tag, "created": time.time(), **job.manifest_fields,
        "params": params, "files": files,
        # every rank's in rank order (later pipeline stages hold later layers)
        "param_order": list(dict.fromkeys(name for report in reports for name in report.get("order", [])
                                          if name in params)),
    }
    save_json(data, os.path.join(staging, mf.MANIFEST))
    fsync_dir(staging)
    final = os.path.join(save_dir, tag)
    old = mf.replaced_dir(save_dir, tag)
    if os.path.isdir(final):  # saving again under an existing tag: swap, never overwrite in place
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    fsync_dir(save_dir)
    if job.save_latest:
        save_text(tag + "\n", os.path.join(save_dir, mf.LATEST))
    shutil.rmtree(old, ignore_errors=True)
    # Staging directories of any tag are left only by saves that crashed: saves are collective, so none
    # other than this one (committed above) is being written now.
    for stale in glob.glob(os.path.join(glob.escape(save_dir), ".staging-*")):
        shutil.rmtree(stale, ignore_errors=True)
