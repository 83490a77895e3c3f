"""ZeRO-3 through Hugging Face (scripts/hf_zero3_load.py on 2 ranks): ``from_pretrained`` under
``HfDeepSpeedConfig`` loads the exact weights into a model built under zero.Init; ``trainer.save_model()`` at
stage 3 writes the real trained weights, none empty; ``from_pretrained`` of that folder under ZeRO-3 gives them
back bit for bit."""
import sys

import pytest
from runner import SCRIPTS, config, launch, read, run, script

pytestmark = pytest.mark.slow


def test_save_model_and_from_pretrained_round_trip_bit_exactly_at_stage3(tmp_path):
    sys.path.insert(0, SCRIPTS)
    from hf_trainer_run import tiny_gpt2

    source = tmp_path / "source"
    tiny_gpt2().save_pretrained(source)
    report_path = tmp_path / "report.json"
    run(launch("torchrun", 2, [script("hf_zero3_load.py"), "--model_dir", str(source), "--out_dir",
                               str(tmp_path / "saved"), "--report", str(report_path),
                               "--deepspeed", config("hf_zero3.json")]))
    report = read(report_path)
    assert report["partitioned"] == report["params"] > 0  # built under zero.Init: every parameter partitioned
    assert report["load_differs"] == []  # from_pretrained loaded the exact weights
    assert report["trained_moved"]  # the save below is of trained weights, not of what was loaded
    assert report["saved_empty"] == [] and report["saved_wrong_shape"] == []  # no empty or placeholder weight
    assert report["saved_differs_from_trained"] == []
    assert report["saved_names"] == report["reloaded_params"]
    assert report["reload_differs"] == []
