"""accelerate's own loop on zeroengine (scripts/accelerate_loop.py, 2 ranks under torchrun with the switch):
``DeepSpeedPlugin(zero_stage=2)`` with the script's torch optimizer and scheduler, and with ``DummyOptim`` /
``DummyScheduler`` (the config builds them). It trains; ``save_state`` then ``load_state`` in a fresh process
gives the same next steps exactly; ``get_state_dict`` gives the full weights. ``accelerate launch`` runs it too."""
import pytest
from runner import launch, read, run, script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(780)]  # 3 runs, runner.run's 240 s each


@pytest.mark.parametrize("dummy", [False, True], ids=["torch-optimizer", "dummy-optimizer"])
def test_accelerate_deepspeed_plugin_trains_saves_and_loads(tmp_path, dummy):
    flags = ["--dummy"] if dummy else []
    common = [script("accelerate_loop.py"), *flags, "--state_dir", str(tmp_path / "state")]
    run(launch("torchrun", 2, [*common, "--report", str(tmp_path / "first.json")]))
    run(launch("torchrun", 2, [*common, "--resume", "--report", str(tmp_path / "resumed.json")]))
    first, resumed = read(tmp_path / "first.json"), read(tmp_path / "resumed.json")
    assert first["engine"] == "zeroengine.engine.Engine" and first["world"] == 2
    assert first["optimizer"] == "ShardedOptimizer"  # (zeroengine's stage-2 optimizer, under accelerate's wrapper)
    assert first["after_save"] != first["first"]  # it trained (the same four batches again, other losses)
    assert resumed["resumed"] == first["after_save"]  # load_state restored weights, optimizer and schedule
    assert set(first["state_dict"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert {"latest", "pytorch_model"} <= set(first["state_dir"])
    if not dummy:  # `accelerate launch` starts the same job (it imports deepspeed.launcher.runner on the way)
        run(launch("accelerate", 2, [script("accelerate_loop.py"), "--state_dir", str(tmp_path / "launched"),
                                     "--report", str(tmp_path / "launched.json")]))
        launched = read(tmp_path / "launched.json")
        assert launched["first"] == first["first"] and launched["after_save"] == first["after_save"]
