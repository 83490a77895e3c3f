"""Command lines: the per-rank user command and the per-node remote launches.

Multi-node runs are built from one idea: every node runs this same launcher
with ``--launcher local``, told the whole ``--world_layout`` and which node it
is, and starts its own ranks (see ``local.py``). The transports differ only in
how that command reaches the nodes:

* ``ssh``: one ``ssh host 'cd CWD && export ... && python -m zeroengine.launcher.main ...'``
  per node, each with an explicit ``--node_rank``. ssh's stdin is a pipe held
  open by the launching node and the remote launcher runs with
  ``--watch_stdin``: when the local launcher or its ssh client dies, the
  remote stdin closes and the remote ranks are stopped.
* ``pdsh``: one command for all nodes. pdsh substitutes ``%h`` with each target
  host name in the remote command, so nodes find their rank with
  ``--node_host %h`` (a literal ``%`` is written ``%%``). pdsh gives the remote
  launchers no stdin to watch, and killing pdsh does not reach them (its ssh
  children run in their own sessions), so the job gets a ``--job_id`` and a
  second pdsh stops it: ``pkill -TERM -f`` on every node, matching that id
  (``stop_argv``). The launcher also reads pdsh's stderr: pdsh reports a node
  whose command failed (``... exited with exit code N``) as it happens, while
  it goes on waiting for the others; that line ends the job (``failure_marker``).
* ``slurm``: ``srun`` starts the user script itself, one task per rank; the
  script reads its rank from SLURM's variables (``rank_env.py``).

Everything here is pure: functions take the environment and file contents they
need as arguments and return argv lists, so the exact output is unit tested.
"""
from __future__ import annotations

import os
import re
import shlex
import sys
import uuid
from dataclasses import dataclass, field, replace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .hostfile import format_layout, is_uniform

ENV_FILE_NAME = ".zeroengine_env"
# Exported to remote nodes besides the env-file entries: the import path, the --as_deepspeed switch and
# the socket/transport settings that multi-node collectives commonly need.
EXPORT_NAMES = ("PYTHONPATH", "ZEROENGINE_AS_DEEPSPEED")
EXPORT_PREFIXES = ("NCCL_", "GLOO_")
SSH_OPTIONS = ("-o", "BatchMode=yes")
PDSH_FANOUT = 1024
_PDSH_HOST = "ZEROENGINE_PDSH_TARGET_HOST"  # stands for %h until escaping is done
# What pdsh writes to stderr when a node's remote command exits non-zero (its ssh rcmd module).
PDSH_FAILURE_MARKER = " exited with exit code "


@dataclass(frozen=True)
class JobSpec:
    """What to run and where the world meets, shared by every transport."""
    script: str
    script_args: Tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    pass_local_rank: bool = False
    master_addr: Optional[str] = None  # None: ranks find it themselves (srun only)
    master_port: int = 29500
    cwd: str = "."
    python: str = sys.executable
    exports: Mapping[str, str] = field(default_factory=dict)
    grace_period: Optional[float] = None
    job_id: Optional[str] = None  # on the node launchers' command lines, for pdsh's stop command


@dataclass(frozen=True)
class LaunchCommand:
    """One process for the launcher to start and supervise."""
    name: str
    argv: Tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # added to os.environ
    # Give it a pipe we never write to, so its stdin closes exactly when we
    # exit (however we die): the remote end of an ssh sees that EOF.
    hold_stdin: bool = False
    # Run (to completion, bounded) when the job stops before this command ended by itself: reaches
    # what signalling the command's process group cannot (pdsh's remote node launchers).
    stop_argv: Optional[Tuple[str, ...]] = None
    # A line of the command's stderr containing this, followed by a non-zero code, is a failure of the
    # job even while the command runs on (pdsh: one node failed, the others still run).
    failure_marker: Optional[str] = None


def user_argv(job: JobSpec, local_rank: Optional[int] = None) -> List[str]:
    """The command one rank runs: ``python -u script args`` (or ``-m``, or bare)."""
    if job.no_python:
        argv = [job.script]
    elif job.module:
        argv = [job.python, "-u", "-m", job.script]
    else:
        argv = [job.python, "-u", job.script]
    if job.pass_local_rank and local_rank is not None:
        argv.append(f"--local_rank={local_rank}")
    return argv + list(job.script_args)


def parse_env_file(text: str, source: str = ENV_FILE_NAME) -> Dict[str, str]:
    """``KEY=VALUE`` lines (optionally ``export KEY=VALUE``; ``#`` comments).

    A value is read as a shell would read a ``.deepspeed_env`` line: quotes are removed
    (``K="eth0"`` is ``eth0``, ``K='a b'`` is ``a b``) and `` # ...`` after the value is a comment.
    An unquoted value with spaces is kept whole (``K=a b`` is ``a b``).
    """
    values: Dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].strip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"{source}, line {lineno}: expected KEY=VALUE, got {raw.strip()!r}")
        values[key] = _env_value(value.strip(), f"{source}, line {lineno}")
    return values


class ExpandedValue(str):
    """An env-file value whose ``$NAME`` / ``${NAME}`` references the shell expands (written unquoted or
    in double quotes, as a shell reads a ``.deepspeed_env`` line: ``PATH=/opt/bin:$PATH``). Expanded on
    each node by its own shell (ssh, pdsh; :func:`shell_word`) or, with slurm, on the launching node
    (:func:`expand_here`). Other shell syntax (``$(...)``, backticks) stays literal."""


# A variable reference, or an escaped dollar (``\$``: a literal ``$``, as in a shell).
_REFERENCE = re.compile(r"\\\$|\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def _parts(value: str):
    """``value`` as (literal text, variable name or None) pairs."""
    last = 0
    for m in _REFERENCE.finditer(value):
        name = m.group(1) or m.group(2)
        yield value[last:m.start()] + ("$" if name is None else ""), name
        last = m.end()
    yield value[last:], None


def _env_value(value: str, where: str) -> str:
    if value[:1] in ("'", '"'):
        try:
            words = shlex.split(value, comments=True)
        except ValueError as e:  # an unclosed quote
            raise ValueError(f"{where}: {e} in {value!r}") from None
        if len(words) != 1:
            raise ValueError(f"{where}: expected one quoted value, got {value!r}")
        return words[0] if value[0] == "'" else ExpandedValue(words[0])
    before_comment, _, _ = value.partition(" #")
    return ExpandedValue(before_comment.rstrip())


def shell_word(value: str) -> str:
    """``value`` as one POSIX shell word: literal, except an :class:`ExpandedValue`'s variable references."""
    if not isinstance(value, ExpandedValue) or not _REFERENCE.search(value):
        return shlex.quote(value)
    return '"' + "".join(_in_double_quotes(text) + (f"${{{name}}}" if name else "")
                         for text, name in _parts(value)) + '"'


def _in_double_quotes(text: str) -> str:
    for special in ("\\", '"', "$", "`"):
        text = text.replace(special, "\\" + special)
    return text


def expand_here(value: str, environ: Mapping[str, str]) -> str:
    """An :class:`ExpandedValue` with its references replaced from ``environ`` (unset: empty, as in a shell)."""
    if not isinstance(value, ExpandedValue):
        return value
    return "".join(text + (environ.get(name, "") if name else "") for text, name in _parts(value))


def expand_exports_here(exports: Mapping[str, str], environ: Mapping[str, str]) -> Dict[str, str]:
    """Every export expanded in order, each seeing those before it (as a shell running one ``export`` per
    line does: ``PATH=$CUDA_HOME/bin:$PATH`` after ``CUDA_HOME=...``)."""
    seen, out = dict(environ), {}
    for key, value in exports.items():
        out[key] = seen[key] = expand_here(value, seen)
    return out


def collect_exports(environ: Mapping[str, str],
                    env_files: Sequence[Tuple[str, str]] = ()) -> Dict[str, str]:
    """Variables to set on remote nodes: PYTHONPATH, ZEROENGINE_AS_DEEPSPEED, NCCL_*/GLOO_*, then the
    entries of each ``(path, text)`` env file in order (later files win)."""
    exports = {n: environ[n] for n in EXPORT_NAMES if n in environ}
    for name in sorted(environ):
        if name.startswith(EXPORT_PREFIXES):
            exports[name] = environ[name]
    for path, text in env_files:
        exports.update(parse_env_file(text, path))
    return exports


def find_env_files(cwd: str, home: str) -> List[Tuple[str, str]]:
    """Read ``.zeroengine_env`` from home, then cwd (so the project's file wins)."""
    found, seen = [], set()
    for folder in (home, cwd):
        path = os.path.join(folder, ENV_FILE_NAME)
        real = os.path.realpath(path)
        if real in seen or not os.path.isfile(path):
            continue
        seen.add(real)
        with open(path, encoding="utf-8") as f:
            found.append((path, f.read()))
    return found


def node_launcher_argv(job: JobSpec, layout: Mapping[str, List[int]],
                       node_flag: Sequence[str], watch_stdin: bool) -> List[str]:
    """``python -u -m zeroengine.launcher.main --launcher local ...`` for one node."""
    if not job.master_addr:
        raise ValueError("a multi-node launch needs a master address")
    argv = [job.python, "-u", "-m", "zeroengine.launcher.main", "--launcher", "local",
            "--world_layout", format_layout(layout), *node_flag,
            "--master_addr", job.master_addr, "--master_port", str(job.master_port)]
    if job.grace_period is not None:
        argv += ["--grace_period", f"{job.grace_period:g}"]
    if job.job_id is not None:
        argv += ["--job_id", job.job_id]
    if watch_stdin:
        argv.append("--watch_stdin")
    for flag in ("module", "no_python", "pass_local_rank"):
        if getattr(job, flag):
            argv.append(f"--{flag}")
    # The node launcher's parser drops one leading "--" after the script, as ours did: give it one to drop.
    guard = ["--"] if job.script_args[:1] == ("--",) else []
    return argv + [job.script, *guard, *job.script_args]


def remote_shell_command(job: JobSpec, argv: Sequence[str]) -> str:
    """``cd CWD && export K=V && ... && argv``, every word quoted for a POSIX shell."""
    parts = [f"cd {shlex.quote(job.cwd)}"]
    if job.exports:
        # one export per variable: a shell expands all words of one command before running it, so a value
        # naming a variable set earlier in the file must come in a later command
        parts += [f"export {k}={shell_word(v)}" for k, v in job.exports.items()]
    parts.append(shlex.join(argv))
    return " && ".join(parts)


def ssh_commands(layout: Mapping[str, List[int]], job: JobSpec) -> List[LaunchCommand]:
    """One ``ssh`` per node; node ``i`` runs ranks after those of nodes ``< i``."""
    commands = []
    for node_rank, host in enumerate(layout):
        argv = node_launcher_argv(job, layout, ["--node_rank", str(node_rank)],
                                  watch_stdin=True)
        commands.append(LaunchCommand(
            name=f"node {node_rank} ({host})",
            argv=("ssh", *SSH_OPTIONS, host, remote_shell_command(job, argv)),
            hold_stdin=True))
    return commands


def pdsh_command(layout: Mapping[str, List[int]], job: JobSpec) -> LaunchCommand:
    """One ``pdsh`` for all nodes; each finds its node rank from ``%h``. Its stop command and
    failure marker are explained in the module docstring."""
    if job.job_id is None:
        job = replace(job, job_id=uuid.uuid4().hex[:16])
    argv = node_launcher_argv(job, layout, ["--node_host", _PDSH_HOST], watch_stdin=False)
    # pdsh expands %h/%u/%n in the remote command; keep every other % literal.
    remote = remote_shell_command(job, argv).replace("%", "%%").replace(_PDSH_HOST, "%h")
    hosts = ("pdsh", "-f", str(PDSH_FANOUT), "-w", ",".join(layout))
    # "[-]-job_id" matches "--job_id" but not the text of this pattern, so pkill spares the shell running it.
    stop = f"pkill -TERM -f -- '[-]-job_id {job.job_id}( |$)'"
    return LaunchCommand(
        name="pdsh",
        argv=(hosts[0], "-S", *hosts[1:], remote),
        env={"PDSH_RCMD_TYPE": "ssh"},
        stop_argv=(*hosts, stop),
        failure_marker=PDSH_FAILURE_MARKER)


def slurm_command(job: JobSpec, num_nodes: int, procs_per_node: int,
                  hosts: Optional[Sequence[str]] = None) -> LaunchCommand:
    """``srun`` starting ``num_nodes * procs_per_node`` copies of the user script.

    ``--kill-on-bad-exit=1`` gives the same contract as the local launcher:
    one failed rank ends the whole step. The exports and the master address go
    through srun's environment (srun propagates it to the tasks by default).
    """
    argv = ["srun", "--nodes", str(num_nodes), "--ntasks-per-node", str(procs_per_node),
            "--kill-on-bad-exit=1"]
    if hosts:
        argv += ["--nodelist", ",".join(hosts)]
    env = expand_exports_here(job.exports, os.environ)
    if job.master_addr:
        env["MASTER_ADDR"] = job.master_addr
    env["MASTER_PORT"] = str(job.master_port)
    return LaunchCommand(name="srun", argv=tuple(argv + user_argv(job)), env=env)


def slurm_command_for_layout(layout: Mapping[str, List[int]], job: JobSpec) -> LaunchCommand:
    """``slurm_command`` for a hostfile layout (needs equal slots per node, from 0: srun places ranks on
    devices itself, so slots picked with --include/--exclude could not be honoured)."""
    if not is_uniform(layout):
        raise ValueError("--launcher slurm needs the same number of processes on every "
                         "node; got " + ", ".join(f"{h}={len(s)}" for h, s in layout.items())
                         + " (use --num_procs to even them out)")
    picked = {h: s for h, s in layout.items() if list(s) != list(range(len(s)))}
    if picked:
        raise ValueError("--launcher slurm cannot select devices (srun places the ranks); got slots "
                         + ", ".join(f"{h}:{','.join(map(str, s))}" for h, s in picked.items())
                         + ": select whole hosts, or use --launcher ssh/pdsh")
    return slurm_command(job, len(layout), len(next(iter(layout.values()))), list(layout))
