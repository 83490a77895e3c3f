"""accelerate's own loop on zeroengine (scripts/accelerate_loop.py, 2 ranks under torchrun with the switch):
``DeepSpeedPlugin(zero_stage=2)`` with the script's torch optimizer and scheduler, and with ``DummyOptim`` /
``DummyScheduler`` (the config builds them). It trains; ``save_state`` then ``load_state`` in a fresh process
gives the same next steps exactly; ``get_state_dict`` gives the full weights. ``accelerate launch`` runs it too."""
import pytest
from runner import for_module, launch, read, script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(780)]  # a test waits for up to 3 runs in a row, 240 s each
FLAGS = {"torch-optimizer": [], "dummy-optimizer": ["--dummy"]}


def _torchrun(runs, tmp, optimizer, name, *extra):
    """The script under torchrun (2 ranks), saving its state to (or, with --resume, loading it from) tmp/<optimizer>."""
    report = tmp / optimizer / f"{name}.json"
    runs.start(launch("torchrun", 2, [script("accelerate_loop.py"), *FLAGS[optimizer], "--state_dir",
                                      str(tmp / optimizer / "state"), *extra, "--report", str(report)])).wait()
    return read(report)


def _accelerate_launch(runs, tmp):
    """`accelerate launch` starts the same job (it imports deepspeed.launcher.runner on the way)."""
    runs.start(launch("accelerate", 2, [script("accelerate_loop.py"), "--state_dir", str(tmp / "launched"),
                                        "--report", str(tmp / "launched.json")])).wait()
    return read(tmp / "launched.json")


# Every run of the module, by name: (what it runs after, the run). Runs overlap (a good part of one is a single
# process importing torch and accelerate): those the selected tests need are all scheduled at the first test, the
# resumed ones once the state they load is saved; each test waits for its own.
RUNS = {"launched": ((), _accelerate_launch)}
for _optimizer in FLAGS:
    RUNS[f"{_optimizer}/first"] = ((), lambda r, t, o=_optimizer: _torchrun(r, t, o, "first"))
    RUNS[f"{_optimizer}/resumed"] = ((f"{_optimizer}/first",),
                                     lambda r, t, o=_optimizer: _torchrun(r, t, o, "resumed", "--resume"))


def _needs(item):
    optimizer = item.callspec.params["optimizer"]
    return (f"{optimizer}/first", f"{optimizer}/resumed") + (("launched",) if optimizer == "torch-optimizer" else ())


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    scheduled = for_module(request, RUNS, _needs, tmp_path_factory.mktemp("accelerate"))
    yield scheduled
    scheduled.close()


@pytest.mark.parametrize("optimizer", list(FLAGS))
def test_accelerate_deepspeed_plugin_trains_saves_and_loads(runs, optimizer):
    first, resumed = runs(f"{optimizer}/first"), runs(f"{optimizer}/resumed")
    assert first["engine"] == "zeroengine.engine.Engine" and first["world"] == 2
    assert first["optimizer"] == "ShardedOptimizer"  # (zeroengine's stage-2 optimizer, under accelerate's wrapper)
    assert first["after_save"] != first["first"]  # it trained (the same four batches again, other losses)
    assert resumed["resumed"] == first["after_save"]  # load_state restored weights, optimizer and schedule
    assert set(first["state_dict"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert {"latest", "pytorch_model"} <= set(first["state_dir"])
    if optimizer == "torch-optimizer":  # `accelerate launch` starts the same job
        launched = runs("launched")
        assert launched["first"] == first["first"] and launched["after_save"] == first["after_save"]
