"""Ulysses sequence parallelism as transformers' Trainer and accelerate drive it (DeepSpeed's ALST path, opened by
``ParallelismConfig(sp_backend="deepspeed")`` and the reported DeepSpeed version >= 0.18.2), unchanged under the
alias, on two processes through the zeroengine launcher (sp = 2, so each rank runs the model on half of every
sequence), against the same script on one process without sequence parallelism.

The model is a small random Llama saved locally (sdpa attention, grouped-query: 4 heads, 2 key/value heads); the
data fixed random sequences of 16 tokens with ``position_ids`` and a -100 prompt of 5, so the two halves of a
sequence score different numbers of tokens (4 and 7: the gathered loss must weigh them). SGD at a rate of 0.5, where a
mis-scaled gradient shows (Adam's normalisation would hide a constant factor); clipping at 1.0 stays inactive.

* Trainer (scripts/hf_trainer_sp.py), ZeRO 2 and 3 from its ``deepspeed=`` config, against the plain Trainer on
  one process (no DeepSpeed, no alias): per-step losses and gradient norms, the evaluation loss after training
  (evaluation runs without sequence parallelism: the eval loader is not adapted, and the attention falls back to
  the model's, accelerate registering with ``disable_in_eval``), and the saved weights, within 1e-5.
* accelerate (scripts/accelerate_sp.py), ZeRO 3 from a ``DeepSpeedPlugin``, accumulation 2: per-micro-batch losses
  and ``get_state_dict``'s weights against the same script on one process without ``parallelism_config``.
"""
from __future__ import annotations

import json

import pytest
import runner
import torch

from zeroengine.testing import free_port

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]  # a test waits for up to two runs in a row, 150 s each

MODEL = "llama"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ulysses_hf")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path / MODEL)
    return path


def _max_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _trainer(runs, workdir, name: str, how: str, procs: int, stage: int | None = None, sp: int = 1):
    out, report = workdir / name, workdir / f"{name}.json"
    argv = [runner.script("hf_trainer_sp.py"), "--model", str(workdir / MODEL), "--output_dir", str(out),
            "--report", str(report), "--sp", str(sp)]
    if stage is not None:
        config = {"zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
                  "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                  "train_batch_size": "auto", "gradient_clipping": "auto"}
        (workdir / f"{name}_config.json").write_text(json.dumps(config))
        argv += ["--deepspeed", str(workdir / f"{name}_config.json")]
    runs.start(runner.launch(how, procs, argv, port=free_port() if how == "zeroengine" else None),
               switch=stage is not None and how != "zeroengine", timeout=150).wait()
    return runner.read(report), safetensors_torch.load_file(str(out / "model.safetensors"))


def _accelerate(runs, workdir, name: str, procs: int, sp: int):
    report = workdir / f"{name}.json"
    runs.start(runner.launch("zeroengine", procs, [runner.script("accelerate_sp.py"), "--model", str(workdir / MODEL),
                                                   "--stage", "3", "--sp", str(sp), "--report", str(report)],
                             port=free_port()), timeout=150).wait()
    return runner.read(report), torch.load(f"{report}.weights.pt")


# Every run of the module, by name: (what it runs after, the run). None reads another's output: those the selected
# tests need all start at the first test and overlap (a good part of each is one process importing torch and
# transformers); each test waits for its own.
RUNS = {
    "plain": ((), lambda r, w: _trainer(r, w, "plain", "python", 1)),
    "sp_zero2": ((), lambda r, w: _trainer(r, w, "sp_zero2", "zeroengine", 2, stage=2, sp=2)),
    "sp_zero3": ((), lambda r, w: _trainer(r, w, "sp_zero3", "zeroengine", 2, stage=3, sp=2)),
    "accelerate_one": ((), lambda r, w: _accelerate(r, w, "accelerate_one", 1, 1)),
    "accelerate_sp": ((), lambda r, w: _accelerate(r, w, "accelerate_sp", 2, 2)),
}


def _needs(item):
    if item.originalname == "test_the_trainer_with_sequence_parallelism_trains_as_one_plain_process":
        return "plain", f"sp_zero{item.callspec.params['stage']}"
    if item.originalname == "test_accelerate_with_sequence_parallelism_trains_as_one_process":
        return "accelerate_one", "accelerate_sp"
    return ()


@pytest.fixture(scope="module")
def runs(request, workdir):
    scheduled = runner.for_module(request, RUNS, _needs, workdir)
    yield scheduled
    scheduled.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_the_trainer_with_sequence_parallelism_trains_as_one_plain_process(runs, stage):
    plain, plain_weights = runs("plain")  # one process, no DeepSpeed, no alias
    report, weights = runs(f"sp_zero{stage}")  # 2 processes through the launcher, sp = 2
    assert report["world"] == 2 and report["wrapped"] == "zeroengine.engine.Engine"
    assert report["train_loader"] == "UlyssesSPDataLoaderAdapter"  # the Trainer adapted its loader
    assert plain["train_loader"] == "DataLoaderShard" and len(plain["loss"]) == 3
    assert report["loss"] == pytest.approx(plain["loss"], abs=TOLERANCE)
    assert report["grad_norm"] == pytest.approx(plain["grad_norm"], abs=TOLERANCE)
    assert report["eval_loss"] == pytest.approx(plain["eval_loss"], abs=TOLERANCE)
    assert _max_difference(weights, plain_weights) < TOLERANCE


def test_accelerate_with_sequence_parallelism_trains_as_one_process(runs):
    one, one_weights = runs("accelerate_one")  # one process without parallelism_config
    two, two_weights = runs("accelerate_sp")  # 2 processes, sp = 2
    assert one["world"] == 1 and two["world"] == 2
    assert one["engine"] == two["engine"] == "zeroengine.engine.Engine"
    assert two["loader"] == "UlyssesSPDataLoaderAdapter" and len(two["loss"]) == 6
    assert two["loss"] == pytest.approx(one["loss"], abs=TOLERANCE)
    assert _max_difference(two_weights, one_weights) < TOLERANCE
