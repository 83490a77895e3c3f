"""Hostfiles, ``--include``/``--exclude`` specs and the world layout.

A *world layout* is the answer to "which processes run where": an ordered
mapping ``{host: [slot, ...]}``. Dict order is node order, so node ``i`` is
the ``i``-th key and its ranks follow those of the nodes before it. A slot is a
device index on that host (a GPU, or just a process number on CPU).

Everything here is a pure function of its inputs; errors are ``ValueError``
(``HostfileError`` for the file itself) with a message fit for the CLI.
"""
from __future__ import annotations

import re
from typing import Dict, List, Mapping, Optional

Layout = Dict[str, List[int]]

# Anything a hostname, an alias from ~/.ssh/config or an IPv4 address can be.
_HOST_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_SLOTS_RE = re.compile(r"^slots=(\d+)$")
# OpenMPI's hostfile fields after slots= (``max_slots=N``, ...), which DeepSpeed's parser also lets
# through: one hostfile can serve mpirun and this launcher. They say nothing to it.
_EXTRA_FIELD_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*=\S+$")


class HostfileError(ValueError):
    """The hostfile is missing or malformed (the message names file and line)."""


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> Dict[str, int]:
    """Parse hostfile text into an ordered ``{host: slot count}``.

    One ``hostname slots=N`` per line; ``#`` starts a comment (whole line or
    trailing); blank lines are skipped. ``N`` must be a positive integer and a
    host may appear only once. Further ``key=value`` fields (OpenMPI's
    ``max_slots=N``) are allowed and have no effect.
    """
    hosts: Dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        where = f"{source}, line {lineno}"
        if len(fields) < 2 or not _SLOTS_RE.match(fields[1]) or \
                not all(_EXTRA_FIELD_RE.match(f) and not f.startswith("slots=") for f in fields[2:]):
            raise HostfileError(
                f"{where}: expected 'hostname slots=N', got {raw.strip()!r}")
        host, slots = fields[0], int(_SLOTS_RE.match(fields[1]).group(1))
        if not _HOST_RE.match(host):
            raise HostfileError(f"{where}: invalid hostname {host!r}")
        if slots < 1:
            raise HostfileError(f"{where}: {host} must have slots >= 1, got {slots}")
        if host in hosts:
            raise HostfileError(f"{where}: host {host!r} is listed twice")
        hosts[host] = slots
    if not hosts:
        raise HostfileError(f"{source}: no hosts listed")
    return hosts


def read_hostfile(path: str) -> Dict[str, int]:
    """Read and parse the hostfile at ``path`` (see ``parse_hostfile_text``)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise HostfileError(f"hostfile {path} not found") from None
    except OSError as e:
        raise HostfileError(f"cannot read hostfile {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise HostfileError(f"hostfile {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    return parse_hostfile_text(text, source=path)


def parse_spec(spec: str, flag: str = "--include") -> Dict[str, Optional[List[int]]]:
    """Parse DeepSpeed's host spec: ``host1@host2:0,2`` → ``{host1: None, host2: [0, 2]}``.

    ``None`` means "all slots of that host". ``flag`` only names the option in
    error messages.
    """
    result: Dict[str, Optional[List[int]]] = {}
    if not spec or not spec.strip():
        raise ValueError(f"{flag}: empty host spec")
    for part in spec.strip().split("@"):
        host, sep, slot_text = part.partition(":")
        if not _HOST_RE.match(host):
            raise ValueError(f"{flag}: invalid host {host!r} in {spec!r} "
                             "(expected 'host1@host2:0,2')")
        slots: Optional[List[int]] = None
        if sep:
            try:
                slots = sorted({int(s) for s in slot_text.split(",")})
            except ValueError:
                raise ValueError(f"{flag}: invalid slot list {slot_text!r} for "
                                 f"{host} in {spec!r} (expected e.g. 'host:0,2')") from None
            if slots[0] < 0:
                raise ValueError(f"{flag}: negative slot for {host} in {spec!r}")
        if host in result:
            raise ValueError(f"{flag}: host {host!r} appears twice in {spec!r}")
        result[host] = slots
    return result


def format_layout(layout: Mapping[str, List[int]]) -> str:
    """The spec string for a layout (``parse_layout`` reads it back)."""
    return "@".join(f"{h}:{','.join(map(str, s))}" for h, s in layout.items())


def parse_layout(spec: str, flag: str = "--world_layout") -> Layout:
    """Read a layout written by ``format_layout``: every host needs its slots."""
    parsed = parse_spec(spec, flag)
    missing = [h for h, s in parsed.items() if s is None]
    if missing:
        raise ValueError(f"{flag}: host {missing[0]!r} has no slot list in {spec!r}")
    return {h: list(s) for h, s in parsed.items()}


def _check_known(hosts: Mapping[str, int], spec: Mapping[str, Optional[List[int]]],
                 flag: str) -> None:
    for host, slots in spec.items():
        if host not in hosts:
            raise ValueError(f"{flag}: unknown host {host!r} "
                             f"(hosts: {', '.join(hosts)})")
        bad = [s for s in slots or () if s >= hosts[host]]
        if bad:
            raise ValueError(f"{flag}: {host} has slots 0-{hosts[host] - 1}, "
                             f"slot {bad[0]} does not exist")


def filter_hosts(hosts: Mapping[str, int], include: Optional[str] = None,
                 exclude: Optional[str] = None) -> Layout:
    """Apply ``--include`` or ``--exclude`` to ``{host: slot count}``.

    Hostfile order is kept whatever the spec order; hosts left without slots
    are dropped. Passing both specs is an error, as in DeepSpeed.
    """
    if include and exclude:
        raise ValueError("--include and --exclude are mutually exclusive")
    layout: Layout = {h: list(range(n)) for h, n in hosts.items()}
    if include:
        chosen = parse_spec(include, "--include")
        _check_known(hosts, chosen, "--include")
        layout = {h: (chosen[h] if chosen[h] is not None else s)
                  for h, s in layout.items() if h in chosen}
    elif exclude:
        dropped = parse_spec(exclude, "--exclude")
        _check_known(hosts, dropped, "--exclude")
        for host, slots in dropped.items():
            layout[host] = [] if slots is None else [s for s in layout[host]
                                                     if s not in slots]
        layout = {h: s for h, s in layout.items() if s}
    if not layout:
        raise ValueError("no hosts or slots left after --include/--exclude")
    return layout


def limit_layout(layout: Mapping[str, List[int]], num_nodes: Optional[int] = None,
                 num_procs: Optional[int] = None) -> Layout:
    """Keep the first ``num_nodes`` hosts and the first ``num_procs`` slots of each.

    Asking for more nodes or processes than are available is an error rather
    than a silent shrink: a job of the wrong size is worse than no job.
    """
    hosts = list(layout)
    if num_nodes is not None:
        if num_nodes < 1:
            raise ValueError(f"--num_nodes must be >= 1, got {num_nodes}")
        if num_nodes > len(hosts):
            raise ValueError(f"--num_nodes {num_nodes} requested but only "
                             f"{len(hosts)} host(s) available: {', '.join(hosts)}")
        hosts = hosts[:num_nodes]
    result: Layout = {}
    for host in hosts:
        slots = list(layout[host])
        if num_procs is not None:
            if num_procs < 1:
                raise ValueError(f"--num_procs must be >= 1, got {num_procs}")
            if num_procs > len(slots):
                raise ValueError(f"--num_procs {num_procs} requested but {host} has "
                                 f"only {len(slots)} slot(s) available")
            slots = slots[:num_procs]
        result[host] = slots
    return result


def world_layout(hosts: Mapping[str, int], include: Optional[str] = None,
                 exclude: Optional[str] = None, num_nodes: Optional[int] = None,
                 num_procs: Optional[int] = None) -> Layout:
    """Hostfile contents + CLI selection → the ordered world layout."""
    return limit_layout(filter_hosts(hosts, include, exclude), num_nodes, num_procs)


def node_offsets(layout: Mapping[str, List[int]]) -> List[int]:
    """The global rank of each node's first process (ranks are packed by node)."""
    offsets, total = [], 0
    for slots in layout.values():
        offsets.append(total)
        total += len(slots)
    return offsets


def is_uniform(layout: Mapping[str, List[int]]) -> bool:
    """Whether every node runs the same number of processes."""
    return len({len(s) for s in layout.values()}) <= 1

