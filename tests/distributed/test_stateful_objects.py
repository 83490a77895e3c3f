"""The script's own stateful objects (a torchdata-style loader) in checkpoints, per rank: registered ones are loaded
back by load_checkpoint, client_state ones come back in the client_state each rank gets; at another world size
they are not restored (and the engine says so)."""
import os

import pytest
from parity import make_model
from test_checkpoint_reshard import config, train

import zeroengine
from zeroengine.testing import run_distributed


class ShardReader:
    """A rank's own reader of its share of 40 items, in order; its position is its state."""

    def __init__(self, rank, world):
        self.items, self.pos = list(range(rank, 40, world)), 0

    def __next__(self):
        self.pos += 1
        return self.items[self.pos - 1]

    def state_dict(self):
        return {"pos": self.pos, "seen": self.items[:self.pos]}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def _engine(rank, world):
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=config(world, 2))
    reader, other = ShardReader(rank, world), ShardReader(rank, world)
    engine.register_stateful("reader", reader)
    return engine, reader, other


def save(rank, world, save_dirs):
    """One save of each kind: synchronous into save_dirs[0], asynchronous into save_dirs[1]."""
    engine, reader, other = _engine(rank, world)
    train(engine, rank, world, 0, 1)
    for _ in range(3 + rank):  # every rank at its own position
        next(reader)
    next(other)
    for save_dir, async_save in zip(save_dirs, (False, True)):
        engine.save_checkpoint(save_dir, client_state={"epoch": 2, "other": other}, async_save=async_save)
    next(reader)  # moves on after the saves: not saved
    engine.destroy()
    return reader.pos


def load(rank, world, save_dirs):
    import logging

    from zeroengine.progress import get_logger

    results = []
    for save_dir in save_dirs:
        engine, reader, _ = _engine(rank, world)
        said = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: said.append(record.getMessage())
        get_logger().addHandler(handler)
        _, client_state = engine.load_checkpoint(save_dir)
        get_logger().removeHandler(handler)
        results.append((reader.pos, client_state, said))
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stateful")
    save_dirs = [str(folder / "sync"), str(folder / "async")]
    assert run_distributed(save, 2, save_dirs) == [4, 5]
    return save_dirs


def test_stateful_objects_come_back_to_the_rank_that_saved_them(saved):
    for rank, per_save in enumerate(run_distributed(load, 2, saved)):
        for pos, client_state, said in per_save:  # the synchronous save's, then the asynchronous one's
            assert not said
            assert pos == 3 + rank  # the registered reader, loaded back
            assert client_state["epoch"] == 2
            assert client_state["other"] == {"pos": 1, "seen": [rank]}  # this rank's state of the client_state object


def test_at_another_world_size_rank_local_states_are_not_restored(saved):
    pos, client_state, said = run_distributed(load, 1, saved[:1])[0][0]
    assert pos == 0 and "other" not in client_state and client_state["epoch"] == 2
    assert said == ["load_checkpoint: not restored: 'reader' (saved by 2 ranks, loaded by 1: rank-local states do not "
                    "carry over to another world size); client_state['other'] (idem)"]


def refuse(rank, world):
    engine, _, _ = _engine(rank, world)
    with pytest.raises(TypeError, match=r"register_stateful\('x', \.\.\.\): a list has no state_dict"):
        engine.register_stateful("x", [1, 2])
    unreadable = ShardReader(rank, world)
    unreadable.state_dict = lambda: {"f": open(os.devnull)}
    with pytest.raises(zeroengine.checkpoint.CheckpointError, match=r"client_state\['bad'\]\.state_dict\(\)"):
        engine.save_checkpoint(os.devnull + "-never", client_state={"bad": unreadable})


def test_bad_stateful_objects_are_refused_by_name():
    run_distributed(refuse, 1)
