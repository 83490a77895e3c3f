"""Hostfile parsing, --include/--exclude specs and world-layout limits."""
import pytest

from zeroengine.launcher.hostfile import (
    HostfileError,
    filter_hosts,
    format_layout,
    is_uniform,
    limit_layout,
    node_offsets,
    parse_hostfile_text,
    parse_layout,
    parse_spec,
    read_hostfile,
    world_layout,
)

SAMPLE = """\
# cluster
worker-0 slots=4

worker-1 slots=4   # trailing comment
worker-2 slots=2
"""
HOSTS = {"worker-0": 4, "worker-1": 4, "worker-2": 2}


def test_parse_good_hostfile_keeps_order():
    hosts = parse_hostfile_text(SAMPLE)
    assert hosts == HOSTS
    assert list(hosts) == ["worker-0", "worker-1", "worker-2"]


def test_read_hostfile(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text(SAMPLE)
    assert read_hostfile(str(path)) == HOSTS


def test_missing_hostfile(tmp_path):
    with pytest.raises(HostfileError, match="hostfile .*nope not found"):
        read_hostfile(str(tmp_path / "nope"))


@pytest.mark.parametrize("line, message", [
    ("worker-3", "expected 'hostname slots=N'"),
    ("worker-3 slots=", "expected 'hostname slots=N'"),
    ("worker-3 slots=two", "expected 'hostname slots=N'"),
    ("worker-3 slots=2 extra", "expected 'hostname slots=N'"),
    ("worker-3 slots=2 slots=3", "expected 'hostname slots=N'"),
    ("worker-3 gpus=2", "expected 'hostname slots=N'"),
    ("worker-3 slots=0", "must have slots >= 1"),
    ("bad/host slots=1", "invalid hostname"),
    ("worker-0 slots=1", "listed twice"),
])
def test_malformed_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "hf"
    path.write_text(SAMPLE + line + "\n")
    with pytest.raises(HostfileError, match=message) as info:
        read_hostfile(str(path))
    assert f"{path}, line 6" in str(info.value)


def test_openmpi_fields_after_slots_are_accepted_as_deepspeed_does():
    # one hostfile for mpirun and the launcher: max_slots says nothing here
    assert parse_hostfile_text("worker-0 slots=8 max_slots=8\nworker-1 slots=4 max-slots=4\n") == \
        {"worker-0": 8, "worker-1": 4}


def test_a_hostfile_that_is_not_text_is_named(tmp_path):
    path = tmp_path / "hf"
    path.write_bytes(b"worker-0 slots=2\n\xff\xfe\n")
    with pytest.raises(HostfileError, match=f"hostfile {path} is not UTF-8 text"):
        read_hostfile(str(path))


def test_empty_hostfile():
    with pytest.raises(HostfileError, match="no hosts"):
        parse_hostfile_text("# nothing\n\n", "hf")


def test_parse_spec():
    assert parse_spec("worker-0@worker-1:2,0,2") == {"worker-0": None, "worker-1": [0, 2]}
    for bad in ("", "worker-0:a", "worker-0@worker-0", "worker-0:-1", "a b"):
        with pytest.raises(ValueError):
            parse_spec(bad)


def test_include_hosts_and_slots_keeps_hostfile_order():
    assert filter_hosts(HOSTS, include="worker-2@worker-0:1,3") == {
        "worker-0": [1, 3], "worker-2": [0, 1]}


def test_exclude_slots_and_hosts():
    assert filter_hosts(HOSTS, exclude="worker-1@worker-0:0,2") == {
        "worker-0": [1, 3], "worker-2": [0, 1]}
    assert filter_hosts(HOSTS, exclude="worker-2:0,1") == {
        "worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}


@pytest.mark.parametrize("include, exclude, message", [
    ("worker-0", "worker-1", "mutually exclusive"),
    ("worker-9", None, "unknown host 'worker-9'"),
    ("worker-2:2", None, "slot 2 does not exist"),
    (None, "worker-9", "unknown host"),
    (None, "worker-0@worker-1@worker-2", "no hosts or slots left"),
])
def test_filter_errors(include, exclude, message):
    with pytest.raises(ValueError, match=message):
        filter_hosts(HOSTS, include, exclude)


def test_limits():
    layout = filter_hosts(HOSTS)
    assert limit_layout(layout, num_nodes=2) == {"worker-0": [0, 1, 2, 3],
                                                 "worker-1": [0, 1, 2, 3]}
    assert limit_layout(layout, num_procs=2) == {"worker-0": [0, 1], "worker-1": [0, 1],
                                                 "worker-2": [0, 1]}
    assert world_layout(HOSTS, include="worker-0:1,2,3@worker-1", num_nodes=1,
                        num_procs=2) == {"worker-0": [1, 2]}
    with pytest.raises(ValueError, match="--num_nodes 4 requested but only 3"):
        limit_layout(layout, num_nodes=4)
    with pytest.raises(ValueError, match="worker-2 has only 2 slot"):
        limit_layout(layout, num_procs=3)


def test_layout_round_trip_and_offsets():
    layout = world_layout(HOSTS, exclude="worker-0:0")
    spec = format_layout(layout)
    assert spec == "worker-0:1,2,3@worker-1:0,1,2,3@worker-2:0,1"
    assert parse_layout(spec) == layout
    assert node_offsets(layout) == [0, 3, 7]
    assert not is_uniform(layout) and is_uniform(limit_layout(layout, num_procs=2))
    with pytest.raises(ValueError, match="no slot list"):
        parse_layout("worker-0:0@worker-1")
