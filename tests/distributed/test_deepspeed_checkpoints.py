"""A run moves from real DeepSpeed to zeroengine with nothing lost.

DeepSpeed 0.19.8 (the test anchor scripts/install.sh puts in .deepspeed_anchor, never on this process's
path) trains a small model 3 steps on 2 ranks at ZeRO stage s, saves, and - the reference - loads its own
checkpoint back and trains 3 more steps. zeroengine loads the same folder at 1 and 2 ranks
and ZeRO stages 1-3 and trains the same 3 steps: the losses, the lr and the parameters must equal
DeepSpeed's continuation (fp32: 1e-5; 16-bit: see _TOLERANCE). zero_to_fp32 of DeepSpeed's folders must
equal DeepSpeed's own function exactly.
"""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import zeroengine
from zeroengine.checkpoint import CheckpointError, get_fp32_state_dict_from_zero_checkpoint
from zeroengine.checkpoint import manifest as mf
from zeroengine.checkpoint.deepspeed import from_deepspeed
from zeroengine.checkpoint.formats import read_manifest
from zeroengine.testing import run_distributed
from zeroengine.zero import GatheredParameters
from zeroengine.zero.full_values import safe_get_full_fp32_param

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIGRATION = os.path.join(REPO, "tests", "migration")
ANCHOR = os.path.join(REPO, ".deepspeed_anchor")
sys.path.insert(0, MIGRATION)
import ds_checkpoint_common as common  # noqa: E402

# stage:precision of DeepSpeed's saves: every ZeRO stage in fp32; 16-bit where its layout differs (stage 0's
# fp32 copies in the optimizer wrapper, the bf16_ file names, fp16's loss scaler); stage 3 keeps its fp32 masters
# alike in every precision
CASES = ["0:fp32", "1:fp32", "2:fp32", "3:fp32", "0:bf16", "2:bf16", "2:fp16"]
# The loaded state (fp32 masters, Adam's moments) must be exact in every precision. The continuation after
# it: fp32 1e-5 (measured: 2e-7 at one rank, 0 at two); 16-bit forward and backward round differently in the
# two engines (measured, 3 steps: bf16 2.1e-3 relative loss / 4.9e-4 in parameters, about one bf16 rounding;
# fp16 4.1e-3 / 3.7e-3), so 16-bit continuations get 2.5x those margins.
_TOLERANCE = {"fp32": 1e-5, "bf16": 5e-3, "fp16": 1e-2}
pytestmark = pytest.mark.timeout(900)


def deepspeed_env() -> dict:
    if not os.path.isfile(os.path.join(ANCHOR, "deepspeed", "__init__.py")):
        pytest.fail(f"the DeepSpeed 0.19.8 test anchor is missing from {ANCHOR}: scripts/install.sh installs it")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ANCHOR, MIGRATION]), DS_ACCELERATOR="cpu",
                OMP_NUM_THREADS="1", ZEROENGINE_AS_DEEPSPEED="0")


def run_deepspeed(script: str, *args, timeout: int = 600) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, os.path.join(MIGRATION, script), *map(str, args)], env=deepspeed_env(),
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        pytest.fail(f"DeepSpeed ({script} {' '.join(map(str, args))}) failed:\n{done.stderr[-4000:]}")
    return done


ZERO_CASES = [c for c in CASES if not c.startswith("0:")]  # the ones DeepSpeed's zero_to_fp32 reads
UNIVERSAL = "2:fp32"  # converted by DeepSpeed's ds_to_universal into <tag>_universal: loaded as a case of its own


@pytest.fixture(scope="module")
def deepspeed_saves(tmp_path_factory):
    """DeepSpeed's saves and continuations, and its own zero_to_fp32 of each ZeRO save (ROOT/fp32/CASE.pt)."""
    root = tmp_path_factory.mktemp("deepspeed")
    run_deepspeed("ds_checkpoint_save.py", root, 2, *CASES)  # (also writes ROOT/fp32/CASE.pt: zero_to_fp32's)
    tag_dir = os.path.join(_folder(root, UNIVERSAL), f"global_step{common.TRAIN_STEPS}")
    done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag_dir,
                           "--output_folder", tag_dir + "_universal", "--num_extract_workers", "1",
                           "--num_merge_workers", "1"], env=deepspeed_env(), capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        pytest.fail(f"DeepSpeed's ds_to_universal failed:\n{done.stderr[-4000:]}")
    return root


def deepspeed_fp32(root, case: str) -> dict:
    return torch.load(os.path.join(str(root), "fp32", os.path.basename(_folder(root, case)) + ".pt"))


def _folder(root, case: str) -> str:
    return os.path.join(str(root), case.replace(":", "_"))


def _continue(rank, world, root, cases, stages):
    """zeroengine at ``world`` ranks loads each DeepSpeed save at each stage and trains the same steps."""
    out = {}
    for case in cases:
        precision = case.split(":")[1]
        universal = case.endswith(":universal")
        tag = f"global_step{common.TRAIN_STEPS}_universal" if universal else None
        for stage in stages:
            torch.manual_seed(1)  # another initialization: everything must come from the checkpoint
            model = common.Net()
            engine, _, _, _ = zeroengine.initialize(model=model, model_parameters=common.param_groups(model),
                                                    config=common.config(stage, precision, world))
            _, client_state = engine.load_checkpoint(_folder(root, case.removesuffix(":universal")), tag=tag)
            record = {"global_steps": engine.global_steps, "note": client_state["note"],
                      "seen": client_state["seen"].tolist(),
                      "masters": common.loaded_masters(engine, safe_get_full_fp32_param)}
            record.update(common.train(engine, common.TRAIN_STEPS, common.CONTINUE_STEPS, rank, world))
            record["params"] = common.full_parameters(engine, GatheredParameters)
            engine.destroy()
            out[f"{case}@{stage}"] = record
    return out


def _differences(ours: dict, theirs: dict, precision: str, masters: dict | None) -> list[str]:
    """What differs between zeroengine's continuation and DeepSpeed's (empty: they agree); ``masters``:
    DeepSpeed's zero_to_fp32 of the checkpoint, which zeroengine's fp32 masters must equal once loaded."""
    tol, found = _TOLERANCE[precision], []
    for name, value in (masters or {}).items():
        if name in ours["masters"] and ours["masters"][name] != value.reshape(-1).tolist():
            found.append(f"the fp32 master of {name} is not DeepSpeed's right after loading")
    if ours["global_steps"] != common.TRAIN_STEPS:
        found.append(f"global_steps {ours['global_steps']} after loading, not {common.TRAIN_STEPS}")
    if ours["note"] != "from deepspeed" or ours["seen"] != [0, 1, 2, 3]:
        found.append(f"client_state {ours['note']!r} {ours['seen']}")
    if ours["lrs"] != pytest.approx(theirs["lrs"], rel=1e-12):
        found.append(f"lrs {ours['lrs']} vs {theirs['lrs']}")
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], theirs["losses"]))
    if loss_rel > tol:
        found.append(f"losses differ by {loss_rel:.2e} relative: {ours['losses']} vs {theirs['losses']}")
    for name, values in theirs["params"].items():
        diff = (torch.tensor(ours["params"][name]) - torch.tensor(values)).abs().max().item()
        if diff > tol:
            found.append(f"parameter {name} differs by {diff:.2e}")
    return found


@pytest.mark.parametrize("world", [1, 2])
def test_zeroengine_continues_deepspeed_runs(deepspeed_saves, world):
    results = run_distributed(_continue, world, str(deepspeed_saves), CASES + [UNIVERSAL + ":universal"], [1, 2, 3],
                              timeout_s=600)[0]
    failures = []
    for key, ours in results.items():
        case, stage = key.split("@")
        case = case.removesuffix(":universal")  # (a universal folder continues as the save it came from)
        with open(_folder(deepspeed_saves, case) + ".json") as f:
            theirs = json.load(f)
        masters = deepspeed_fp32(deepspeed_saves, case) if case in ZERO_CASES else None
        failures += [f"DeepSpeed {case} loaded by {world} rank(s) at stage {stage}: {d}"
                     for d in _differences(ours, theirs, case.split(":")[1], masters)]
    assert not failures, "\n".join(failures)


def test_zero_to_fp32_equals_deepspeeds(deepspeed_saves):
    """zeroengine's get_fp32_state_dict_from_zero_checkpoint on DeepSpeed's folders: DeepSpeed's own result,
    bit for bit (names and their order, dtypes, values), at every ZeRO stage DeepSpeed's function reads."""
    for case in ZERO_CASES:
        theirs = deepspeed_fp32(deepspeed_saves, case)
        ours = get_fp32_state_dict_from_zero_checkpoint(_folder(deepspeed_saves, case))
        assert list(ours) == list(theirs), case
        for name, value in theirs.items():
            assert ours[name].dtype == value.dtype and torch.equal(ours[name], value), f"{case}: {name}"


def _full(manifest, name: str, key: str) -> torch.Tensor:
    """Parameter ``name``'s stored ``key`` ("value" or an optimizer moment), whole and flat."""
    numel = math.prod(manifest.params[name]["shape"])
    out = torch.empty(numel)
    for e in manifest.entries_overlapping(name, 0, numel):
        entry = manifest.open(e.file)["entries"][e.index]
        out[e.start:e.end] = entry["value"] if key == "value" else entry["state"][key]
    return out


def test_ze_from_deepspeed_converts_everything(deepspeed_saves, tmp_path):
    """ze_from_deepspeed (output shards of one tensor each: the smallest memory bound) writes a zeroengine
    checkpoint holding DeepSpeed's values, moments, steps, counters, scheduler, loss scaler and client_state
    exactly, with a sha256 manifest that verifies."""
    for case in CASES:
        out = tmp_path / case.replace(":", "_")
        assert from_deepspeed.main([_folder(deepspeed_saves, case), str(out), "--shard_mb", "0"]) == 0
        theirs = read_manifest(mf.resolve_tag_dir(_folder(deepspeed_saves, case), None))
        ours = read_manifest(mf.resolve_tag_dir(str(out), None))
        assert ours.data["format"] == mf.FORMAT and ours.data["zero_stage"] == int(case[0]), case
        for file in ours.data["files"]:
            ours.verify_file(file)  # sizes and checksums
        for name in theirs.params:
            for key in ("value", "exp_avg", "exp_avg_sq"):
                assert torch.equal(_full(ours, name, key), _full(theirs, name, key)), f"{case}: {key} of {name}"
        common_ours, common_theirs = ours.open(mf.COMMON), theirs.open(mf.COMMON)
        for key in ("counters", "lr_scheduler", "param_groups", "loss_scaler"):
            assert common_ours[key] == common_theirs[key], f"{case}: {key}"
        assert common_ours["client_state"]["note"] == "from deepspeed", case
    assert from_deepspeed.main([_folder(deepspeed_saves, CASES[0]), str(tmp_path / "0_fp32")]) == 1  # exists


def _copy(deepspeed_saves, case, tmp_path) -> str:
    folder = str(tmp_path / case.replace(":", "_"))
    shutil.copytree(_folder(deepspeed_saves, case), folder)
    return os.path.join(folder, "global_step3")


class Smuggled:
    """Not one of the types DeepSpeed writes: a pickle holding it must not load."""


def test_refusals_name_the_file(deepspeed_saves, tmp_path):
    # a pickle with a type outside the allowlist: refused by name, and its code never runs
    tag_dir = _copy(deepspeed_saves, "2:fp32", tmp_path / "pickle")
    path = os.path.join(tag_dir, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with open(path, "wb") as f:
        torch.save({"optimizer_state_dict": {"payload": Smuggled()}}, f)
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: it holds type "
                                              r".*Smuggled.*nothing was loaded"):
        get_fp32_state_dict_from_zero_checkpoint(tag_dir)
    # a missing rank file
    tag_dir = _copy(deepspeed_saves, "3:fp32", tmp_path / "missing")
    os.remove(os.path.join(tag_dir, "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    with pytest.raises(CheckpointError, match=r"saved by 2 data-parallel rank\(s\) but lacks the optimizer-state "
                                              r"file\(s\) of rank\(s\) \[1\]"):
        read_manifest(tag_dir)
    # a truncated file
    tag_dir = _copy(deepspeed_saves, "1:fp32", tmp_path / "truncated")
    path = os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_0_mp_rank_00_optim_states\.pt \(\d+ bytes\): it is "
                                              "truncated or corrupted"):
        get_fp32_state_dict_from_zero_checkpoint(tag_dir)
    # DeepSpeed's file helpers (which Lightning's converter calls) on a zeroengine checkpoint: there are none
    from zeroengine.integrations.ds_compat.utils import zero_to_fp32

    converted = tmp_path / "converted"
    assert from_deepspeed.main([_folder(deepspeed_saves, "2:fp32"), str(converted)]) == 0
    with pytest.raises(CheckpointError, match="is a zeroengine checkpoint, which has no DeepSpeed rank files"):
        zero_to_fp32.get_optim_files(str(converted / "global_step3"))


_ALIAS_SCRIPT = """
import sys, torch, torch.nn as nn
import deepspeed
from deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                          get_fp32_state_dict_from_zero_checkpoint,
                                          load_state_dict_from_zero_checkpoint)
assert "zeroengine" in deepspeed.__file__, deepspeed.__file__  # the alias, not a real DeepSpeed
folder, out_dir, model_file = sys.argv[1:]
state = get_fp32_state_dict_from_zero_checkpoint(folder)
written = convert_zero_checkpoint_to_fp32_state_dict(folder, out_dir)  # DeepSpeed's positional order
import ds_checkpoint_common as common  # (tests/migration is on PYTHONPATH)
model = load_state_dict_from_zero_checkpoint(common.Net(), folder)
# Lightning's helper reads DeepSpeed's files itself (get_optim_files, get_model_state_file, torch.load of them)
from pytorch_lightning.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict as lightning_convert
lightning = lightning_convert(folder, model_file + ".lightning")
torch.save({"state": state, "written": torch.load(written), "model": model.state_dict(),
            "lightning": lightning["state_dict"], "lightning_note": lightning["note"]}, model_file)
"""


def test_zero_to_fp32_module_under_the_alias(deepspeed_saves, tmp_path):
    """``deepspeed.utils.zero_to_fp32`` as Lightning's and the HF docs' helpers import it, under
    ZEROENGINE_AS_DEEPSPEED=1, on a DeepSpeed folder: DeepSpeed's own result (Lightning's converter, which
    unpickles DeepSpeed's files itself, included)."""
    env = dict(os.environ, ZEROENGINE_AS_DEEPSPEED="1", PYTHONPATH=MIGRATION)
    case = "2:bf16"
    done = subprocess.run([sys.executable, "-c", _ALIAS_SCRIPT, _folder(deepspeed_saves, case),
                           str(tmp_path / "out") + os.sep, str(tmp_path / "all.pt")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got, theirs = torch.load(tmp_path / "all.pt"), deepspeed_fp32(deepspeed_saves, case)
    assert got["lightning_note"] == "from deepspeed"
    for result in ("state", "written", "lightning"):
        assert list(got[result]) == list(theirs), result
        assert all(torch.equal(got[result][k], v) for k, v in theirs.items()), result
    assert all(torch.equal(got["model"][k], v) for k, v in theirs.items())


def _continue_pipeline(rank, world, root, zero_stages, num_stages):
    from zeroengine.pipe import LayerSpec, PipelineModule

    out = {}
    for zero_stage in zero_stages:
        torch.manual_seed(1)
        module = PipelineModule(layers=common.pipeline_layers(LayerSpec), num_stages=num_stages,
                                loss_fn=common.pipeline_loss, partition_method="uniform")
        engine, _, _, _ = zeroengine.initialize(model=module, config=common.pipeline_config(zero_stage))
        engine.load_checkpoint(os.path.join(root, f"pipe_{zero_stage}"))
        out[zero_stage] = {"losses": common.pipeline_train(engine, common.TRAIN_STEPS, common.CONTINUE_STEPS),
                           "params": common.pipeline_parameters(engine)}
        engine.destroy()
    return out


def test_zeroengine_continues_deepspeed_pipeline_runs(tmp_path):
    """A DeepSpeed pipeline run (2 stages: per-layer files, one mp_rank file set per stage; ZeRO 0 and 1, the
    stages DeepSpeed's pipelines support) continues under zeroengine's PipelineModule at 2 stages, and at 1
    (the same layer names, another layout), as DeepSpeed continues it."""
    run_deepspeed("ds_pipeline_save.py", tmp_path, 0, 1)
    for num_stages in (2, 1):
        results = run_distributed(_continue_pipeline, 2, str(tmp_path), [0, 1], num_stages, timeout_s=300)[0]
        for zero_stage, ours in results.items():
            with open(tmp_path / f"pipe_{zero_stage}.json") as f:
                theirs = json.load(f)
            what = f"DeepSpeed pipeline at ZeRO {zero_stage} loaded by {num_stages} zeroengine stage(s)"
            assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5), what
            assert sorted(ours["params"]) == sorted(theirs["params"]), what
            for name, values in theirs["params"].items():
                assert torch.tensor(ours["params"][name]) == pytest.approx(torch.tensor(values), abs=1e-5), \
                    f"{what}: {name}"
