"""The loader initialize() returns records its position in every checkpoint (state_dict) and continues from it:
at the same world size each rank gets exactly the batches an uninterrupted run gets; at another world size the
rest of the epoch is shared out with no sample repeated or skipped (zeroengine/data.py)."""
import pytest
import torch

from zeroengine.data import build_dataloader

N, BATCH = 23, 2  # 23 samples: the ranks' shares are padded


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return i


def loaders(world, seed=7):
    return [build_dataloader(Numbers(), BATCH, rank=r, world_size=world, seed=seed) for r in range(world)]


def take(loader_iter, count):
    return [b.tolist() for _, b in zip(range(count), loader_iter)]


def test_same_world_size_resumes_exactly_mid_epoch_and_into_the_next():
    whole = [[b.tolist() for epoch in range(2) for b in loader] for loader in loaders(2)]
    running = loaders(2)
    iters = [iter(loader) for loader in running]
    before = [take(it, 3) for it in iters]  # 3 batches of epoch 0, then a "crash"
    states = [loader.state_dict() for loader in running]
    assert states[0] == states[1] and states[0]["consumed"] == 3 * BATCH * 2
    resumed = loaders(2)
    for loader in resumed:
        loader.load_state_dict(states[0])
    after = [[b.tolist() for b in loader] + [b.tolist() for b in loader] for loader in resumed]  # rest, then epoch 1
    assert [b + a for b, a in zip(before, after)] == whole


def test_another_world_size_continues_the_epoch_without_repeats_or_gaps():
    running = loaders(2)
    seen = [s for loader in running for b in take(iter(loader), 2) for s in b]  # 2 batches each: 8 samples
    state = running[0].state_dict()
    resumed = loaders(3)
    for loader in resumed:
        loader.load_state_dict(state)
    rest = [s for loader in resumed for b in loader for s in b.tolist()]
    assert len(set(seen)) == len(seen) == 8
    assert set(seen) | set(rest) == set(range(N)) and not set(seen) & set(rest)
    assert len(rest) - len(set(rest)) < 3  # only the new world's padding repeats (15 samples over 3 ranks: none)
    # and the pass after it is the next epoch, whole, for the new world
    nxt = [s for loader in resumed for b in loader for s in b.tolist()]
    assert set(nxt) == set(range(N)) and resumed[0].sampler.epoch == 1


def test_a_pass_that_ended_goes_on_to_the_next_epoch():
    running = loaders(1)
    list(running[0])
    state = running[0].state_dict()
    resumed = loaders(1)
    resumed[0].load_state_dict(state)
    list(resumed[0])
    assert resumed[0].sampler.epoch == 1


def test_changed_data_is_refused():
    state = loaders(1)[0].state_dict()
    with pytest.raises(ValueError, match="the data changed"):
        loaders(1, seed=8)[0].load_state_dict(state)


def _skipping_script(rank, world, folder):
    """Train 3 steps with the engine's loader, save; a fresh engine loads and then, as a DeepSpeed script does,
    skips the 3 batches itself before its first forward: the warning names the double skip."""
    import logging

    import zeroengine

    messages = []

    class Catch(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger("zeroengine").addHandler(Catch())
    config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "steps_per_print": 1000}
    for attempt in range(2):
        model = torch.nn.Linear(1, 1)
        engine, _, loader, _ = zeroengine.initialize(model=model, config=config, training_data=Numbers())
        batches = iter(loader)
        if attempt:
            engine.load_checkpoint(folder)
            batches = iter(loader)
            for _ in range(3):  # the script's own skipping
                next(batches)
        for _ in range(3):
            x = next(batches).float().unsqueeze(1)
            engine.backward(engine(x).sum())
            engine.step()
        if not attempt:
            engine.save_checkpoint(folder)
        engine.destroy()
    return messages


def test_a_script_that_skips_consumed_batches_itself_is_warned(tmp_path):
    from zeroengine.testing import run_distributed

    messages = run_distributed(_skipping_script, 1, str(tmp_path))[0]
    warned = [m for m in messages if "the data is skipped twice" in m]
    assert len(warned) == 1 and "took 4 micro-batches before its first forward" in warned[0], messages
    assert "checkpoint.resume_data_position: false" in warned[0]
