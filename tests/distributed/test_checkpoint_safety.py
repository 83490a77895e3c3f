"""Nothing is lost: killed saves, failing ranks, damaged files, one-rank saves and untrusted checkpoints."""
import json
import os
import signal
import time

import pytest
import torch
from parity import make_model
from test_checkpoint_reshard import config, full_state, train

import zeroengine
from zeroengine.checkpoint import CheckpointError
from zeroengine.checkpoint import save as save_module
from zeroengine.testing import DistributedTestError, run_distributed


def _engine(world, stage=2):
    engine, _, _, _ = zeroengine.initialize(model=make_model(), config=config(world, stage))
    return engine


def save_twice_dying_in_the_second(rank, world, save_dir, victim, where):
    engine = _engine(world)
    train(engine, rank, world, 0, 1)
    engine.save_checkpoint(save_dir, tag="good")
    train(engine, rank, world, 1, 1)
    if rank == victim:
        die_in_the_next_write(where)
    engine.save_checkpoint(save_dir, tag="doomed")


def die_in_the_next_write(where: str) -> None:
    """Make this process SIGKILL itself in the next save: halfway through its shard (``where`` "shard"), or, on
    rank 0, after writing the manifest and before the rename that commits the tag ("commit")."""
    real = save_module.save_tensors if where == "shard" else save_module.save_json

    def die_halfway(obj, path):
        if where == "shard":  # a partly written temporary file, then the process is gone
            with open(path + ".partial", "wb") as f:
                f.write(b"PK\x03\x04 half a zip")
        else:  # rank 0 wrote every shard and the manifest, and dies before the rename
            real(obj, path)
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(save_module, "save_tensors" if where == "shard" else "save_json", die_halfway)


def load_world1(rank, world, load_dir, tag=None):
    engine = _engine(world, stage=0)
    path, _ = engine.load_checkpoint(load_dir, tag=tag)
    return path, engine.global_steps, full_state(engine)


def save_and_report(rank, world, save_dir):
    engine = _engine(world)
    train(engine, rank, world, 0, 1)
    engine.save_checkpoint(save_dir, tag="good")
    return full_state(engine)


@pytest.mark.parametrize("victim,where", [(1, "shard"), (0, "commit")])
def test_sigkill_during_a_save_leaves_the_previous_tag_loadable(tmp_path, victim, where):
    save_dir = str(tmp_path / "run")
    # Either the harness sees the victim die first, or a peer reports it gone (rank 0 hosts the store).
    died = rf"--- rank {victim} ---\nprocess died with exit code -9|rank 0 has died"
    with pytest.raises(DistributedTestError, match=died):
        run_distributed(save_twice_dying_in_the_second, 2, save_dir, victim, where)
    with open(os.path.join(save_dir, "latest")) as f:
        assert f.read().strip() == "good"
    assert not os.path.exists(os.path.join(save_dir, "doomed"))  # never renamed into place
    path, steps, _ = run_distributed(load_world1, 1, save_dir)[0]
    assert path == os.path.join(save_dir, "good") and steps == 1
    assert any(name.startswith(".staging-doomed") for name in os.listdir(save_dir))
    run_distributed(load_and_save_as, 1, save_dir, "after")  # the next save, under another tag ...
    assert sorted(os.listdir(save_dir)) == ["after", "good", "latest"]  # ... removes the crashed one's staging


def load_and_save_as(rank, world, save_dir, tag):
    engine = _engine(world, stage=0)
    engine.load_checkpoint(save_dir)
    engine.save_checkpoint(save_dir, tag=tag)


def test_truncated_or_corrupted_shard_is_refused_by_name(tmp_path):
    save_dir = str(tmp_path / "run")
    run_distributed(save_and_report, 2, save_dir)
    shard = os.path.join(save_dir, "good", "shard_00001.pt")
    original = open(shard, "rb").read()
    with open(shard, "wb") as f:
        f.write(original[: len(original) // 2])
    with pytest.raises(DistributedTestError, match=r"shard_00001\.pt is \d+ bytes.*truncated"):
        run_distributed(load_world1, 1, save_dir)
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0xFF
    with open(shard, "wb") as f:
        f.write(bytes(damaged))
    with pytest.raises(DistributedTestError, match=r"shard_00001\.pt fails its sha256 checksum"):
        run_distributed(load_world1, 1, save_dir)


def test_an_incomplete_tag_is_named(tmp_path):
    save_dir = str(tmp_path / "run")
    run_distributed(save_and_report, 2, save_dir)
    os.remove(os.path.join(save_dir, "good", "manifest.json"))
    with pytest.raises(DistributedTestError, match="incomplete.*manifest.json"):
        run_distributed(load_world1, 1, save_dir)


def fail_on_rank1(rank, world, save_dir):
    engine = _engine(world)
    train(engine, rank, world, 0, 1)
    engine.save_checkpoint(save_dir, tag="good")
    if rank == 1:
        def disk_full(obj, path):
            raise OSError(28, "No space left on device")

        save_module.save_tensors = disk_full
    try:
        engine.save_checkpoint(save_dir, tag="bad")
    except CheckpointError as err:
        return str(err)
    return None


def test_a_rank_failing_to_write_fails_the_save_on_every_rank(tmp_path):
    save_dir = str(tmp_path / "run")
    messages = run_distributed(fail_on_rank1, 2, save_dir)
    for message in messages:
        assert message is not None and "rank(s) [1]" in message and "No space left" in message
    assert open(os.path.join(save_dir, "latest")).read().strip() == "good"
    assert sorted(os.listdir(save_dir)) == ["good", "latest"]  # the staging directory is gone too


def save_on_rank0_only(rank, world, save_dir, what="save_checkpoint"):
    os.environ["ZEROENGINE_HANDSHAKE_TIMEOUT"] = "3"
    engine = _engine(world)
    if rank != 0:
        time.sleep(6)  # busy elsewhere, never calling save
        return None
    started = time.monotonic()
    try:
        getattr(engine, what)(save_dir)
    except CheckpointError as err:
        return str(err), time.monotonic() - started
    return "saved", 0.0


@pytest.mark.parametrize("what", ["save_checkpoint", "save_16bit_model"])
def test_save_called_on_rank0_only_fails_clearly_instead_of_hanging(tmp_path, what):
    message, waited = run_distributed(save_on_rank0_only, 2, str(tmp_path / "run"), what)[0]
    assert f"{what} is collective: every rank must call it" in message and "rank(s) [1]" in message
    assert "if rank == 0" in message
    assert waited < 30
    assert not os.path.exists(tmp_path / "run" / "latest")


def bad_client_state(rank, world, save_dir):
    engine = _engine(world)
    try:
        engine.save_checkpoint(save_dir, client_state={"ok": [1, 2.0], "sampler": object()})
    except CheckpointError as err:
        return str(err)
    return None


def test_client_state_must_be_plain_data(tmp_path):
    for message in run_distributed(bad_client_state, 2, str(tmp_path / "run")):
        assert "client_state['sampler'] is a builtins.object" in message


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/zeroengine_pwned",))


def test_a_checkpoint_that_carries_code_is_refused(tmp_path):
    save_dir = str(tmp_path / "run")
    run_distributed(save_and_report, 1, save_dir)
    common = os.path.join(save_dir, "good", "common.pt")
    torch.save({"client_state": Payload()}, common)
    manifest_path = os.path.join(save_dir, "good", "manifest.json")
    manifest = json.load(open(manifest_path))
    from zeroengine.checkpoint.files import sha256_of
    manifest["files"]["common.pt"] = {"sha256": sha256_of(common), "bytes": os.path.getsize(common)}
    json.dump(manifest, open(manifest_path, "w"))
    with pytest.raises(DistributedTestError, match=r"cannot read checkpoint file .*common\.pt"):
        run_distributed(load_world1, 1, save_dir)
    assert not os.path.exists("/tmp/zeroengine_pwned")


def load_missing(rank, world, load_dir):
    return _engine(world).load_checkpoint(load_dir)


def test_loading_where_nothing_was_saved_returns_none(tmp_path):
    assert run_distributed(load_missing, 1, str(tmp_path)) == [(None, None)]


def save_twice(rank, world, save_dir, first, second):
    """Train a step, save under ``first``, train another, save under ``second``."""
    engine = _engine(world)
    train(engine, rank, world, 0, 1)
    engine.save_checkpoint(save_dir, tag=first)
    train(engine, rank, world, 1, 1)
    engine.save_checkpoint(save_dir, tag=second)
    return full_state(engine)


def test_saving_again_under_a_tag_replaces_it_whole(tmp_path):
    save_dir = str(tmp_path / "run")
    latest_state = run_distributed(save_twice, 2, save_dir, "t", "t")[0]
    _, steps, loaded = run_distributed(load_world1, 1, save_dir)[0]
    assert steps == 2 and all(torch.equal(loaded[k], v) for k, v in latest_state.items())
    assert sorted(os.listdir(save_dir)) == ["latest", "t"]


def save_to_a_folder_of_its_own(rank, world, root):
    os.makedirs(os.path.join(root, f"node{rank}"), exist_ok=True)
    os.chdir(os.path.join(root, f"node{rank}"))  # as if each rank had its own local disk
    engine = _engine(world)
    try:
        engine.save_checkpoint("ckpt", tag="t")
    except CheckpointError as err:
        return str(err), sorted(os.listdir("ckpt")) if os.path.isdir("ckpt") else []
    return None, None


def test_a_save_dir_the_ranks_do_not_share_fails_instead_of_committing_a_broken_checkpoint(tmp_path):
    for message, left in run_distributed(save_to_a_folder_of_its_own, 2, str(tmp_path)):
        assert "rank 1 wrote shard_00001.pt but rank 0 does not see it" in message
        assert "every rank shares" in message
        assert left == []  # no 'latest', no tag, no staging left behind on either "node"


@pytest.mark.parametrize("tag", ["latest", ".staging-x", ".replaced-x"])
def test_tags_that_name_save_dirs_own_entries_are_refused(tag):
    from zeroengine.checkpoint.manifest import check_tag
    with pytest.raises(CheckpointError, match="is reserved"):
        check_tag(tag)


def test_load_dir_edge_cases_get_named_answers(tmp_path):
    from zeroengine.checkpoint import manifest as mf
    from zeroengine.checkpoint.formats import read_manifest
    ds = tmp_path / "ds"
    (ds / "global_step5").mkdir(parents=True)
    (ds / "global_step5" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (ds / "latest").write_text("global_step5")
    # an empty DeepSpeed model-states file: read as DeepSpeed's (tests/distributed/test_deepspeed_checkpoints.py),
    # and refused, naming the file
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states\.pt \(0 bytes\): it is truncated"):
        read_manifest(mf.resolve_tag_dir(str(ds), None))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "latest").write_text("\n")
    with pytest.raises(CheckpointError, match="latest is empty: pass the tag"):
        mf.resolve_tag_dir(str(empty), None)
    one_tag = tmp_path / "run" / "t"
    one_tag.mkdir(parents=True)
    (one_tag / "manifest.json").write_text("{}")
    assert mf.resolve_tag_dir(str(one_tag), None) == str(one_tag)  # a tag directory given as load_dir
    assert mf.resolve_tag_dir(str(tmp_path / "nothing"), None) is None  # nothing there: (None, None), as DeepSpeed


def load_by_rank(rank, world, load_dirs, tags):
    engine = _engine(world)
    before = full_state(engine)
    try:
        engine.load_checkpoint(load_dirs[rank], tag=tags[rank])
    except CheckpointError as err:
        after = full_state(engine)
        return str(err), all(torch.equal(after[k], v) for k, v in before.items()), engine.global_steps
    return "", None, engine.global_steps


@pytest.mark.parametrize("case", ["tags differ", "latest differs", "one rank sees none"])
def test_ranks_loading_different_checkpoints_is_refused_by_every_rank(tmp_path, case):
    # Before, each rank silently loaded its own tag and the next step mixed two checkpoints into one model.
    save_dir, empty = str(tmp_path / "run"), str(tmp_path / "empty")
    os.makedirs(empty)
    run_distributed(save_twice, 2, save_dir, "A", "B")
    dirs, tags, rank1 = {
        "tags differ": ([save_dir, save_dir], ["A", "B"], "tag 'B' saved"),
        "latest differs": ([save_dir, save_dir], ["A", None], "tag 'B' saved"),  # rank 1 follows 'latest'
        "one rank sees none": ([save_dir, empty], ["A", None], "no checkpoint (no 'latest' file)"),
    }[case]
    for message, untouched, steps in run_distributed(load_by_rank, 2, dirs, tags):
        assert "the ranks would load different checkpoints" in message, message
        assert "rank 0: tag 'A' saved" in message and f"rank 1: {rank1}" in message, message
        assert untouched and steps == 0  # nothing was loaded anywhere


def stall_after_writing(rank, world, save_dir):
    os.environ["ZEROENGINE_HANDSHAKE_TIMEOUT"] = "3"
    engine = _engine(world)
    if rank == 1:  # enters the save with rank 0, writes its shard, then stalls (as if hung or dying)
        real = save_module.save_tensors

        def write_then_stall(*args):
            files = real(*args)
            time.sleep(6)
            return files

        save_module.save_tensors = write_then_stall
    message = ""
    try:
        engine.save_checkpoint(save_dir, tag="t")
    except CheckpointError as err:
        message = str(err)
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()  # rank 0 hosts it: it must outlive rank 1's last read
    store.set(f"stall_done/{rank}", b"1")
    store.wait([f"stall_done/{r}" for r in range(world)], __import__("datetime").timedelta(seconds=30))
    return message


def test_a_rank_that_stops_inside_a_save_is_not_blamed_for_skipping_the_call(tmp_path):
    message = run_distributed(stall_after_writing, 2, str(tmp_path / "run"))[0]
    assert "save_checkpoint: rank(s) [1] called it with the others but did not reach its next step" in message
    assert "crashed, were killed, or hang" in message
    assert "if rank == 0" not in message  # the advice for a missing call would mislead here
    assert not os.path.exists(tmp_path / "run" / "latest")
