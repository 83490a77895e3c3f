"""``ze_to_deepspeed``: real DeepSpeed 0.19.8 resumes a converted zeroengine checkpoint exactly where zeroengine goes on.

zeroengine trains a small model on 2 ranks for 3 steps, saves, and goes on for 3 more, recording losses, lr
and parameters. Its checkpoint is converted to DeepSpeed's layout at several (world size, ZeRO stage,
precision) targets and to the universal layout; real DeepSpeed (the ``.deepspeed_anchor`` scripts/install.sh
installs) loads each and trains the same 3 steps on the same global batches (tests/migration/ds_resume.py:
one launch per world size, a fresh engine per checkpoint). fp32: losses equal to 1e-5 relative, lr equal,
parameters within 1e-5. bf16 and fp16: the two frameworks round their 16-bit arithmetic differently (in which
precision a buffer is kept), so they agree to 16-bit precision.

Note: DeepSpeed's stage-0 fp16 step (FP16_UnfusedOptimizer, which its CPU accelerator refuses; ds_resume.py
lets it run) trains differently from its own stages 1-3 on the same data: from scratch its losses part from
stage 1's within 3 steps and its Adam moments come out ~200x smaller, while resuming its own checkpoint is
exact. So at stage 0 fp16 only the resumed starting point is compared (the first loss, from the converted
weights, and the lr); its layout (FP16_UnfusedOptimizer's state with the dynamic loss scale) loads.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
from migration.ds_resume import batch, config, loss_of, make_model, param_groups

import zeroengine
from zeroengine.checkpoint import CheckpointError, get_fp32_state_dict_from_zero_checkpoint
from zeroengine.checkpoint.deepspeed.pickles import load_deepspeed_file
from zeroengine.checkpoint.deepspeed.to_deepspeed import main as ze_to_deepspeed
from zeroengine.checkpoint.deepspeed.to_deepspeed import write_deepspeed_checkpoint
from zeroengine.testing import free_port, run_distributed
from zeroengine.zero import GatheredParameters

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ANCHOR = os.path.join(REPO, ".deepspeed_anchor")
DS_SCRIPT = os.path.join(REPO, "tests", "migration", "ds_resume.py")
SAVE_AT, MORE, WORLD = 3, 3, 2
SOURCE_STAGE = {"fp32": 3, "bf16": 0, "fp16": 1}  # zeroengine's stage for each precision's run
# 16-bit: DeepSpeed keeps the model's buffer in fp32 where zeroengine casts it to the training dtype, so the
# output is rounded differently from the first forward on (measured: bf16 ~1.5e-3 relative loss, ~1e-3 parameter
# difference, one bf16 step near 0.25; fp16 ~2e-4 and ~1e-4); fp32 agrees to rounding (measured <= 1.1e-7, 3e-8).
LOSS_RTOL = {"fp32": 1e-5, "bf16": 5e-3, "fp16": 1e-3}
PARAM_ATOL = {"fp32": 1e-5, "bf16": 4e-3, "fp16": 1e-3}
pytestmark = pytest.mark.timeout(600)


def _train(engine, rank, world, first, count):
    losses, lrs = [], []
    dtype = next(engine.module.parameters()).dtype
    for step in range(first, first + count):
        loss = loss_of(engine(batch(step, rank, world, dtype)))
        engine.backward(loss)
        engine.step()
        losses.append(zeroengine.comm.all_reduce_scalar(loss.item()) / world)
        lrs.append(engine.get_lr()[0])
    return losses, lrs


def _zeroengine_runs(rank, world, root):
    """Per precision: train, save at step 3, go on to step 6; what zeroengine's own continuation gives."""
    runs = {}
    for dtype, stage in SOURCE_STAGE.items():
        model = make_model()
        engine, _, _, _ = zeroengine.initialize(model=model, model_parameters=param_groups(model),
                                                config=config(world, stage, dtype))
        _train(engine, rank, world, 0, SAVE_AT)
        engine.save_checkpoint(os.path.join(root, dtype), client_state={"epoch": 1, "note": "hi"})
        losses, lrs = _train(engine, rank, world, SAVE_AT, MORE)
        with GatheredParameters(list(engine.module.parameters())):
            params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
        runs[dtype] = {"losses": losses, "lr": lrs, "params": params}
        engine.destroy()
    return runs


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ze_to_ds"))
    return root, run_distributed(_zeroengine_runs, WORLD, root)[0]


def _require_anchor():
    if not os.path.isfile(os.path.join(ANCHOR, "deepspeed", "__init__.py")):
        pytest.fail(f"DeepSpeed 0.19.8, the anchor these tests compare with, is not installed in {ANCHOR}: run "
                    "scripts/install.sh (it installs it there)")


class _DeepSpeed:
    """Real DeepSpeed at ``world`` ranks resuming every case, started in the background (the launches at each
    world size are independent: they run side by side, overlapping their interpreters' imports); ``result()``:
    {name: result}."""

    def __init__(self, tmp_path, world, cases):
        spec = {"world": world, "port": free_port(), "first_step": SAVE_AT, "steps": MORE, "cases": cases}
        spec_path, self.out = tmp_path / f"spec_{world}.json", tmp_path / f"ds_{world}.pt"
        spec_path.write_text(json.dumps(spec))
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                "MASTER_PORT", "ZEROENGINE_AS_DEEPSPEED")}
        env.update(PYTHONPATH=ANCHOR, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        self.log = tempfile.TemporaryFile(mode="w+")  # (a file: a pipe nobody reads yet could fill and block it)
        self.proc = subprocess.Popen([sys.executable, DS_SCRIPT, str(spec_path), str(self.out)], stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)

    def result(self) -> dict:
        try:
            self.proc.wait(timeout=400)
        except subprocess.TimeoutExpired:
            self.stop()
        self.log.seek(0)
        assert self.proc.returncode == 0, self.log.read()[-6000:]
        return torch.load(self.out, weights_only=True)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _case(root, name, source, world, stage, dtype=None, universal=False, **kwargs):
    dst = os.path.join(root, "ds", name)
    write_deepspeed_checkpoint(os.path.join(root, source), dst, world, stage, universal=universal, dtype=dtype,
                               **kwargs)
    return {"name": name, "dir": dst, "stage": stage, "dtype": dtype or source, "universal": universal}


def _agreement(ours, theirs, dtype):
    """(largest relative loss difference, largest parameter difference); asserts lr equal and the bounds."""
    assert theirs["lr"] == pytest.approx(ours["lr"], rel=1e-12)
    loss = max(abs(a - b) / abs(a) for a, b in zip(ours["losses"], theirs["losses"]))
    assert set(theirs["params"]) == set(ours["params"])
    param = max((ours["params"][n] - theirs["params"][n]).abs().max().item() for n in ours["params"])
    assert loss <= LOSS_RTOL[dtype] and param <= PARAM_ATOL[dtype], (loss, param, ours["losses"], theirs["losses"])
    return loss, param


def test_deepspeed_resumes_where_zeroengine_goes_on(trained, tmp_path):
    _require_anchor()
    root, runs = trained
    order = tmp_path / "order.txt"
    order.write_text("".join(f"{n}\n" for n, _ in make_model().named_parameters()))
    ds_config = tmp_path / "ds_config.json"
    ds_config.write_text(json.dumps(config(WORLD, 1)))
    # the command line, with the config (clip_grad written) and the order from a file (what a checkpoint saved
    # before manifests recorded param_order needs); the others use the order the manifest records
    assert ze_to_deepspeed([os.path.join(root, "fp32"), os.path.join(root, "ds", "fp32_w2_s1"), "--world", "2",
                            "--stage", "1", "--config", str(ds_config), "--param-order", str(order)]) == 0
    two = [{"name": "fp32_w2_s1", "dir": os.path.join(root, "ds", "fp32_w2_s1"), "stage": 1, "dtype": "fp32",
            "universal": False}]
    two += [_case(root, f"fp32_w2_s{s}", "fp32", 2, s) for s in (0, 2, 3)]
    two.append(_case(root, "fp32_universal", "fp32", 2, 2, universal=True))
    two.append(_case(root, "bf16_w2_s2", "bf16", 2, 2, ds_config=config(WORLD, 2, "bf16")))
    two.append(_case(root, "bf16_w2_s0", "bf16", 2, 0))
    two += [_case(root, f"fp16_w2_s{s}", "fp16", 2, s) for s in (0, 2)]
    one = [_case(root, "fp32_w1_s3", "fp32", 1, 3),
           {**two[4], "name": "fp32_universal_w1_s1", "stage": 1}]  # the universal folder at another world
    launched = [_DeepSpeed(tmp_path, 2, two), _DeepSpeed(tmp_path, 1, one)]
    try:
        results = {name: result for run in launched for name, result in run.result().items()}
    finally:
        for run in launched:
            run.stop()

    consolidated = {dtype: get_fp32_state_dict_from_zero_checkpoint(os.path.join(root, dtype)) for dtype in runs}
    report = []
    for case in two + one:
        theirs = results[case["name"]]
        if case["name"] == "fp16_w2_s0":  # see the note: DeepSpeed's own stage-0 fp16 step trains otherwise
            ours = runs["fp16"]
            assert theirs["lr"] == pytest.approx(ours["lr"], rel=1e-12)
            assert theirs["losses"][0] == pytest.approx(ours["losses"][0], rel=LOSS_RTOL["fp16"])
            continue
        loss, param = _agreement(runs[case["dtype"]], theirs, case["dtype"])
        report.append(f"{case['name']:<22} max rel loss diff {loss:.2e}  max param diff {param:.2e}")
        if theirs["zero_to_fp32"] is not None:  # DeepSpeed's own reader sees zeroengine's fp32 values exactly
            expected = consolidated[case["dtype"]]
            for name, value in theirs["zero_to_fp32"].items():
                assert torch.equal(value.float(), expected[name].float()), (case["name"], name)
    print("\n".join(report))


def test_missing_anchor_fails_naming_it(monkeypatch, tmp_path):
    monkeypatch.setitem(globals(), "ANCHOR", str(tmp_path / "no_anchor"))
    with pytest.raises(pytest.fail.Exception, match="no_anchor: run scripts/install.sh"):
        _require_anchor()


def test_fp16_loss_scaler_state_reads_back(trained, tmp_path):
    """The dynamic loss scaler as DeepSpeed pickles it, from zeroengine's state and the config's settings."""
    root, _ = trained
    fp16 = config(WORLD, 2, "fp16")
    fp16["fp16"].update(loss_scale_window=500, hysteresis=3, min_loss_scale=0.5)
    tag = write_deepspeed_checkpoint(os.path.join(root, "fp16"), str(tmp_path / "ds"), 2, 2, ds_config=fp16,
                                     param_order=[n for n, _ in make_model().named_parameters()])
    saved = torch.load(os.path.join(root, "fp16", "global_step3", "common.pt"), weights_only=True)["loss_scaler"]
    for rank in range(2):
        state = load_deepspeed_file(os.path.join(tag, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
        scaler = state["optimizer_state_dict"]["loss_scaler"]
        assert type(scaler).__name__ == "DynamicLossScaler" and state["optimizer_state_dict"]["dynamic_loss_scale"]
        assert (scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis) == (
            saved["cur_scale"], saved["cur_iter"], saved["last_overflow_iter"], saved["cur_hysteresis"])
        assert (scaler.scale_window, scaler.delayed_shift, scaler.min_scale, scaler.dtype) == (
            500, 3, 0.5, torch.float16)
        assert state["optimizer_state_dict"]["clip_grad"] == 1.0


def test_refusals(trained, tmp_path):
    root, _ = trained
    ordered = {"param_order": [n for n, _ in make_model().named_parameters()]}
    dst = str(tmp_path / "ds")
    write_deepspeed_checkpoint(os.path.join(root, "fp32"), dst, 2, 1, **ordered)
    with pytest.raises(CheckpointError, match="already exists.*global_step3"):
        write_deepspeed_checkpoint(os.path.join(root, "fp32"), dst, 2, 2, **ordered)
    write_deepspeed_checkpoint(os.path.join(root, "fp32"), dst, 2, 2, force=True, **ordered)
    assert os.path.isfile(os.path.join(dst, "global_step3", "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    assert [n for n in os.listdir(dst) if n.startswith(".")] == []  # no staging folder left behind
    # a stage-3 checkpoint from before manifests recorded the model's order: it must be given
    old = tmp_path / "old"
    shutil.copytree(os.path.join(root, "fp32", "global_step3"), old / "global_step3")
    manifest = old / "global_step3" / "manifest.json"
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items() if k != "param_order"}))
    with pytest.raises(CheckpointError, match="--param-order"):
        write_deepspeed_checkpoint(str(old / "global_step3"), str(tmp_path / "x"), 2, 1)
    with pytest.raises(CheckpointError, match=r"lacks parameters .*b\.bias"):
        write_deepspeed_checkpoint(os.path.join(root, "fp32"), str(tmp_path / "x"), 2, 1,
                                   param_order=ordered["param_order"][:-1])
    with pytest.raises(CheckpointError, match="zero_optimization.stage is 1, not the stage 2"):
        write_deepspeed_checkpoint(os.path.join(root, "fp32"), str(tmp_path / "x"), 2, 2,
                                   ds_config=config(WORLD, 1), **ordered)
    # an optimizer whose state DeepSpeed's Adam files have no place for, named
    sgd = tmp_path / "sgd"
    shutil.copytree(os.path.join(root, "fp32", "global_step3"), sgd / "global_step3")
    manifest = sgd / "global_step3" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"optimizer": "AdamW"', '"optimizer": "SGD"'))
    with pytest.raises(CheckpointError, match="holds SGD optimizer state"):
        write_deepspeed_checkpoint(str(sgd), str(tmp_path / "x"), 2, 1, tag="global_step3", **ordered)
    assert ze_to_deepspeed([str(sgd), str(tmp_path / "x"), "--world", "2", "--stage", "1", "-t", "global_step3"]) == 1
    assert not os.path.exists(tmp_path / "x" / "global_step3")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_any_layout_written_reads_back_exactly(trained, tmp_path, dtype):
    """ze_to_deepspeed's partitions at data-parallel sizes the DeepSpeed runs above do not reach (3: uneven
    padding; 4), at every stage, read back through zeroengine's DeepSpeed reader: every parameter's fp32 value
    and Adam moments, the counters, the scheduler and client_state as saved (the two partition maths agree)."""
    from zeroengine.checkpoint.formats import read_manifest

    root, _ = trained
    source = read_manifest(os.path.join(root, dtype, f"global_step{SAVE_AT}"))

    def full(manifest, name, key):
        numel = int(torch.Size(manifest.params[name]["shape"]).numel())
        out = torch.empty(numel)
        for e in manifest.entries_overlapping(name, 0, numel):
            entry = manifest.open(e.file)["entries"][e.index]
            out[e.start:e.end] = entry["value"] if key == "value" else entry["state"][key]
        return out

    for world, stage in [(3, 1), (4, 2), (3, 3), (4, 3), (3, 0)]:
        tag = write_deepspeed_checkpoint(os.path.join(root, dtype), str(tmp_path / f"w{world}s{stage}"), world, stage)
        back = read_manifest(tag)
        assert (back.data["world_size"], back.data["zero_stage"]) == (world, stage)
        for name in source.params:
            for key in ("value", "exp_avg", "exp_avg_sq"):
                assert torch.equal(full(back, name, key), full(source, name, key)), (world, stage, name, key)
        ours, theirs = back.open("common.pt"), source.open("common.pt")
        assert ours["counters"]["global_steps"] == theirs["counters"]["global_steps"] == SAVE_AT
        assert ours["lr_scheduler"] == theirs["lr_scheduler"]
        assert ours["client_state"]["note"] == "hi"
