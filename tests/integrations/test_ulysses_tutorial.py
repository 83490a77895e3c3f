"""DeepSpeed's Ulysses / ALST tutorial script (scripts/ulysses_tutorial.py, verbatim) under the alias, on two
processes through the zeroengine launcher, against one process running the same model on whole sequences.

The tutorial loads 'hf-internal-testing/tiny-random-LlamaForCausalLM'; a local folder of that name (a small
random Llama, sdpa attention) stands in for the hub. Its plain DataLoader gives both ranks the same two
sequences, and the adapter has the group train on each rank's batch in turn: sequences 0, 0, 1, 1.

* Verbatim (ZeRO 3, Adam, no optimizer step): the printed losses are one process's, to their 4 printed decimals.
* Training variants, the script's text with only its config's stage and optimizer changed and two lines added
  (``model.step()`` after the backward, and a line writing the losses at full precision): at ZeRO 1 and 3 with
  SGD and ZeRO 2 with Adam, every loss equals one process's within 1e-5 after the same steps (SGD shows a
  mis-scaled gradient, which Adam's normalisation hides: DeepSpeed 0.19.8 is sp-times off at stages 1-2). The
  config sets no gradient_clipping, so both clip at 1.0, the default of zeroengine and of DeepSpeed >= 0.19.3.
"""
from __future__ import annotations

import json
import os
import re

import pytest
import runner
import torch

from zeroengine.testing import free_port

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(700)  # a test waits for one launcher run of up to 150 s

MODEL = os.path.join("hf-internal-testing", "tiny-random-LlamaForCausalLM")
SEQUENCES = [[1, 10, 10, 10, 2, 2], [1, 20, 20, 20, 2, 2]]  # the tutorial's
ORDER = [0, 0, 1, 1]  # what the adapter trains on (each rank's DataLoader yields both sequences)


def _tiny_llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ulysses")
    _tiny_llama().save_pretrained(path / MODEL)
    return path


def one_process(workdir, optimizer: str | None, lr: float = 1e-3) -> list[float]:
    model = transformers.AutoModelForCausalLM.from_pretrained(workdir / MODEL)
    opt = None
    if optimizer == "SGD":
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    elif optimizer == "Adam":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for i in ORDER:
        ids = torch.tensor([SEQUENCES[i]])
        loss = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], labels=ids).loss
        losses.append(loss.item())
        if opt is not None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the config's default (DeepSpeed >= 0.19.3)
            opt.step()
            opt.zero_grad()
    return losses


def _run_tutorial(runs, workdir, text: str, name: str) -> str:
    path = workdir / name
    path.write_text(text)
    return runs.start(runner.launch("zeroengine", 2, [str(path)], port=free_port()), cwd=str(workdir),
                      timeout=150).wait()


def _verbatim(runs, workdir) -> str:
    with open(runner.script("ulysses_tutorial.py")) as f:
        return _run_tutorial(runs, workdir, f.read(), "train.py")


VARIANTS = [(1, "SGD"), (2, "Adam"), (3, "SGD")]


def _lr(optimizer):
    return 0.5 if optimizer == "SGD" else 1e-3  # SGD: a step that moves the weights enough for a mistake to show


def _variant(runs, workdir, stage, optimizer) -> list[float]:
    with open(runner.script("ulysses_tutorial.py")) as f:
        text = f.read()
    lr = _lr(optimizer)
    text = text.replace('"stage": 3,', f'"stage": {stage},').replace('"type": "Adam"', f'"type": "{optimizer}"')
    text = text.replace('"lr": 1e-3', f'"lr": {lr}, "weight_decay": 0.0' if optimizer == "Adam" else f'"lr": {lr}')
    report = workdir / f"losses_{stage}_{optimizer}.json"
    text = text.replace("    model.backward(loss)\n", "    model.backward(loss)\n    model.step()\n"
                        f"    reported.append(loss.item())\nif dist.get_rank() == 0:\n    json.dump(reported, open({str(report)!r}, 'w'))\n")
    text = text.replace("# Normal training loop\n", "# Normal training loop\nimport json\nreported = []\n")
    _run_tutorial(runs, workdir, text, f"train_{stage}_{optimizer}.py")
    with open(report) as f:
        return json.load(f)


# The module's launcher runs, by name: (what they run after, the run). None reads another's output: those the
# selected tests need all start at the first test and overlap; each test waits for its own.
RUNS = {"verbatim": ((), _verbatim)}
RUNS.update({f"{stage}-{optimizer}": ((), lambda r, w, s=stage, o=optimizer: _variant(r, w, s, o))
             for stage, optimizer in VARIANTS})


def _needs(item):
    if item.originalname == "test_the_verbatim_tutorial_prints_one_process_losses":
        return ("verbatim",)
    if item.originalname == "test_the_tutorial_trains_as_one_process":
        return (f"{item.callspec.params['stage']}-{item.callspec.params['optimizer']}",)
    return ()


@pytest.fixture(scope="module")
def runs(request, workdir):
    scheduled = runner.for_module(request, RUNS, _needs, workdir)
    yield scheduled
    scheduled.close()


def test_the_verbatim_tutorial_prints_one_process_losses(workdir, runs):
    stdout = runs("verbatim")
    printed = [float(v) for v in re.findall(r"^\d+: loss=tensor\(([-0-9.e]+)", stdout, re.MULTILINE)]
    assert printed == pytest.approx(one_process(workdir, None), abs=5e-5), stdout[-3000:]


@pytest.mark.parametrize("stage,optimizer", VARIANTS)
def test_the_tutorial_trains_as_one_process(workdir, runs, stage, optimizer):
    losses = runs(f"{stage}-{optimizer}")
    assert losses == pytest.approx(one_process(workdir, optimizer, _lr(optimizer)), abs=1e-5)
