"""Checkpoints that do not stall: ``save_checkpoint(async_save=True)`` / ``checkpoint.async_save``.

The writes are held back (each rank's writer waits on an event) while the training loop goes on, so the test
knows the save is in flight: training two more steps and changing the client_state meanwhile must not reach
the checkpoint, which must equal, tensor for tensor, a synchronous save of the same moment, and resume alike;
``latest`` moves only once the background commit is done. A rank killed during the background write leaves
the previous checkpoint the latest and loadable; a failed background write is raised by the next wait."""
import os
import threading

import pytest
import torch
from parity import make_model
from test_checkpoint_reshard import config, full_state, train
from test_checkpoint_safety import die_in_the_next_write

import zeroengine
from zeroengine.checkpoint import CheckpointError
from zeroengine.checkpoint import save as save_module
from zeroengine.testing import DistributedTestError, run_distributed


def _latest(save_dir):
    with open(os.path.join(save_dir, "latest")) as f:
        return f.read().strip()


def _hold_writes():
    """Make this rank's checkpoint writes wait until the returned event is set."""
    release, real = threading.Event(), save_module.save_tensors

    def held(obj, path):
        assert release.wait(60), "the test never released the writer"
        return real(obj, path)

    save_module.save_tensors = held
    return release, real


def save_async_while_training(rank, world, save_dir):
    results = {}
    for stage in range(4):
        cfg = config(world, stage)
        cfg["checkpoint"] = {"async_save": stage == 0}  # the config key at stage 0, the argument elsewhere
        engine, _, _, _ = zeroengine.initialize(model=make_model(), config=cfg)
        train(engine, rank, world, 0, 2)
        folder = os.path.join(save_dir, f"stage{stage}")
        engine.save_checkpoint(folder, tag="sync", client_state={"t": torch.ones(3), "n": 1}, async_save=False)
        release, real = _hold_writes()
        client_state = {"t": torch.ones(3), "n": 1}
        tag_dir = engine.save_checkpoint(folder, tag="async", client_state=client_state,
                                         async_save=None if stage == 0 else True)
        in_flight = engine._background_saves.in_flight
        snapshot_bytes = engine.memory_breakdown()["buffers"]
        train(engine, rank, world, 2, 2)  # the weights and optimizer state change under the save in flight
        client_state["t"].mul_(5)
        client_state["n"] = 99
        latest_meanwhile = _latest(folder)
        release.set()
        engine.wait_for_checkpoint()
        save_module.save_tensors = real
        results[stage] = {"in_flight": in_flight, "latest_meanwhile": latest_meanwhile, "latest": _latest(folder),
                          "tag_dir": tag_dir, "snapshot_bytes": snapshot_bytes}
        engine.destroy()
    return results


def resume(rank, world, save_dir, stage, tag):
    engine, _, _, _ = zeroengine.initialize(model=make_model(seed=5), config=config(world, stage))
    _, client_state = engine.load_checkpoint(os.path.join(save_dir, f"stage{stage}"), tag=tag)
    losses = train(engine, rank, world, 2, 2)
    return client_state, engine.global_steps, losses, full_state(engine)


def _load_files(tag_dir):
    return {name: torch.load(os.path.join(tag_dir, name), weights_only=True)
            for name in sorted(os.listdir(tag_dir)) if name.endswith(".pt")}


def _assert_same(a, b, where):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_an_async_save_is_the_state_of_its_call_and_resumes_as_a_sync_one(tmp_path):
    save_dir = str(tmp_path)
    results = run_distributed(save_async_while_training, 2, save_dir)[0]
    for stage in range(4):
        r = results[stage]
        assert r["in_flight"], stage
        assert r["latest_meanwhile"] == "sync", stage  # not committed while a rank's writes were held
        assert r["latest"] == "async" and r["tag_dir"] == os.path.join(save_dir, f"stage{stage}", "async")
        assert r["snapshot_bytes"] > 0  # the host snapshot is memory the rank holds, counted as buffers
        folder = os.path.join(save_dir, f"stage{stage}")
        _assert_same(_load_files(os.path.join(folder, "sync")), _load_files(os.path.join(folder, "async")),
                     f"stage {stage}")
    for stage in (3,):
        from_sync = run_distributed(resume, 2, save_dir, stage, "sync")[0]
        from_async = run_distributed(resume, 2, save_dir, stage, "async")[0]
        assert from_async[0]["n"] == 1 and torch.equal(from_async[0]["t"], torch.ones(3))
        assert from_async[1] == from_sync[1] == 4  # resumed at 2, trained 2
        assert from_async[2] == from_sync[2]
        _assert_same(from_async[3], from_sync[3], f"resumed at stage {stage}")


def die_during_the_background_write(rank, world, save_dir, victim, where):
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=config(world, 2))
    train(engine, rank, world, 0, 1)
    engine.save_checkpoint(save_dir, tag="good", async_save=True)
    engine.wait_for_checkpoint()
    train(engine, rank, world, 1, 1)
    if rank == victim:
        die_in_the_next_write(where)  # in the background writer this time
    engine.save_checkpoint(save_dir, tag="doomed", async_save=True)
    train(engine, rank, world, 2, 1)  # training goes on while the writer dies
    engine.wait_for_checkpoint()


def load_latest(rank, world, save_dir):
    engine, _, _, _ = zeroengine.initialize(model=make_model(seed=3), config=config(world, 0))
    path, _ = engine.load_checkpoint(save_dir)
    return path, engine.global_steps


@pytest.mark.parametrize("victim,where", [(1, "shard"), (0, "commit")])
def test_a_rank_killed_during_the_background_write_leaves_the_previous_checkpoint(tmp_path, victim, where):
    save_dir = str(tmp_path / "run")
    died = (rf"--- rank {victim} ---\nprocess died with exit code -9|rank 0 has died|the store \(hosted by rank 0\) "
            rf"is gone|rank {victim}: gone: its connection closed")
    with pytest.raises(DistributedTestError, match=died):
        run_distributed(die_during_the_background_write, 2, save_dir, victim, where, timeout_s=120,
                        env={"ZEROENGINE_COMM_TIMEOUT": "20"})
    assert _latest(save_dir) == "good"
    assert not os.path.exists(os.path.join(save_dir, "doomed"))
    path, steps = run_distributed(load_latest, 1, save_dir)[0]
    assert path == os.path.join(save_dir, "good") and steps == 1


def a_failed_background_write(rank, world, save_dir):
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=config(world, 1))
    train(engine, rank, world, 0, 1)
    engine.save_checkpoint(save_dir, tag="good")
    if rank == 1:
        real = save_module.save_tensors

        def disk_full(obj, path):
            raise OSError(28, "No space left on device")

        save_module.save_tensors = disk_full
    engine.save_checkpoint(save_dir, tag="full", async_save=True)
    train(engine, rank, world, 1, 1)
    try:
        engine.wait_for_checkpoint()
        raised = None
    except CheckpointError as err:
        raised = str(err)
    if rank == 1:
        save_module.save_tensors = real
    engine.save_checkpoint(save_dir, tag="after", async_save=True)  # the next save works
    engine.destroy()  # and destroy drains it
    return raised, _latest(save_dir)


def test_a_failed_background_write_is_raised_by_the_next_wait_and_the_next_save_works(tmp_path):
    save_dir = str(tmp_path / "run")
    for raised, latest in run_distributed(a_failed_background_write, 2, save_dir):
        assert "background save of checkpoint 'full'" in raised and "latest still names the previous one" in raised
        assert "rank 1: OSError: [Errno 28] No space left on device" in raised
        assert latest == "after"
    assert not os.path.exists(os.path.join(save_dir, "full"))
