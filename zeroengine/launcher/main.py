"""``zeroengine``: the command-line launcher (DeepSpeed's ``deepspeed`` equivalent).

Decides what to start from the flags, then hands over to ``local.run_node``
(this node's ranks) or to the supervisor with per-node ssh/pdsh/srun commands:

* no hostfile (or ``--launcher local``): start this node's ranks here; with
  ``--num_nodes N --node_rank I`` each node is started by hand;
* a hostfile selecting one host and no ``--launcher``: also local;
* otherwise: ``--launcher`` (default ssh; pdsh or slurm on request) starts the
  same launcher on every node with ``--world_layout``.

User errors print one line and exit 2; see ``docs/cli.md``.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import socket
import subprocess
import sys
from dataclasses import replace
from typing import List, Optional

from .commands import (
    SSH_OPTIONS,
    JobSpec,
    LaunchCommand,
    collect_exports,
    find_env_files,
    slurm_command,
    slurm_command_for_layout,
)
from .hostfile import parse_layout, read_hostfile, world_layout
from .local import NodePlan, plan_from_layout, plan_uniform, rank_commands
from .node_restarts import NodeRestarts, RemoteLaunch
from .rank_env import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT
from .restarts import RESTART_VARIABLES, run_with_restarts
from .supervisor import supervise

LAUNCHERS = ("local", "ssh", "pdsh", "slurm")
DEFAULT_GRACE_PERIOD = 5.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zeroengine", allow_abbrev=False,
                description="Start one process per rank of a zeroengine (or any "
                            "torch.distributed) script, on this node or on many.")
    size = p.add_argument_group("world size")
    size.add_argument("--num_gpus", "--num_accelerators", type=int, metavar="N",
                      help="processes per node (alias of --num_procs; default: the "
                           "number of CUDA devices, or 1 without any)")
    size.add_argument("--num_procs", "--nproc_per_node", type=int, metavar="N",
                      help="processes per node")
    size.add_argument("--num_nodes", type=int, metavar="N",
                      help="number of nodes (with --hostfile: use the first N hosts)")
    size.add_argument("--node_rank", type=int, metavar="I",
                      help="this node's index when nodes are started by hand "
                           "(--launcher local); default 0")
    hosts = p.add_argument_group("hosts")
    hosts.add_argument("-H", "--hostfile", metavar="FILE",
                       help="lines of 'hostname slots=N'")
    hosts.add_argument("-i", "--include", metavar="SPEC",
                       help="hosts/slots to use, e.g. 'host1@host2:0,2'")
    hosts.add_argument("-e", "--exclude", metavar="SPEC",
                       help="hosts/slots to leave out, e.g. 'host1:0@host3'")
    hosts.add_argument("--master_addr", metavar="ADDR",
                       help="rendezvous address (default 127.0.0.1 on one node, "
                            "the first host of the hostfile on many)")
    hosts.add_argument("--master_port", type=int, default=None, metavar="PORT",
                       help=f"rendezvous port (default {DEFAULT_MASTER_PORT}; under --launcher slurm an "
                            "exported MASTER_PORT)")
    hosts.add_argument("--launcher", choices=LAUNCHERS,
                       help="how to start the nodes (default: local on one node, "
                            "ssh for a multi-host hostfile)")
    run = p.add_argument_group("what to run")
    run.add_argument("--module", action="store_true",
                     help="SCRIPT is a module name, run with 'python -m'")
    run.add_argument("--no_python", action="store_true",
                     help="SCRIPT is an executable, run without 'python'")
    run.add_argument("--pass_local_rank", action="store_true",
                     help="append --local_rank=I to the script arguments "
                          "(old DeepSpeed/torch.distributed.launch scripts)")
    run.add_argument("--no_local_rank", action="store_true",
                     help="accepted for DeepSpeed compatibility; this is the default")
    run.add_argument("--grace_period", type=float, default=DEFAULT_GRACE_PERIOD, metavar="SECONDS",
                     help="after a failure or a signal, how long the other ranks get "
                          "to exit before SIGKILL (default %(default)s)")
    run.add_argument("--max_restarts", "--max-restarts", type=int, default=0, metavar="N",
                     help="when a rank fails, stop every rank and start the job again, up to N times (torchrun's "
                          "flag; ranks see ZEROENGINE_RESTART_COUNT / TORCHELASTIC_RESTART_COUNT and resume from "
                          "their checkpoint)")
    run.add_argument("--min_nodes", type=int, default=None, metavar="M",
                     help="with --max_restarts and a hostfile of several nodes: a restart leaves out the nodes "
                          "that cannot be reached (ssh) as long as M remain (default: every node must answer)")
    run.add_argument("--as_deepspeed", action="store_true",
                     help="run the script with ZEROENGINE_AS_DEEPSPEED=1: its 'import deepspeed' (and "
                          "transformers' and accelerate's) gets zeroengine (docs/integrations.md)")
    run.add_argument("--dry_run", action="store_true",
                     help="print the commands that would run, and exit")
    internal = p.add_argument_group("internal (written by the ssh/pdsh launchers)")
    internal.add_argument("--world_layout", metavar="SPEC",
                          help="all nodes and their slots, 'host1:0,1@host2:0,1'")
    internal.add_argument("--node_host", metavar="HOST",
                          help="this node's name in --world_layout")
    internal.add_argument("--watch_stdin", action="store_true",
                          help="stop the ranks when stdin closes")
    internal.add_argument("--job_id", metavar="ID",
                          help="marks this node launcher's command line, for pdsh's stop command")
    p.add_argument("script", metavar="SCRIPT", help="training script (or module, or program)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...",
                   help="passed to the script untouched")
    return p


class UsageError(ValueError):
    """A problem with the command line: printed on one line, exit code 2."""


def _procs_per_node(args) -> Optional[int]:
    if args.num_gpus is not None and args.num_procs is not None \
            and args.num_gpus != args.num_procs:
        raise UsageError(f"--num_gpus {args.num_gpus} and --num_procs {args.num_procs} "
                         "disagree; pass one of them")
    procs = args.num_procs if args.num_procs is not None else args.num_gpus
    if procs is not None and procs < 1:
        raise UsageError(f"--num_procs must be >= 1, got {procs}")
    return procs


def _device_count() -> int:
    """CUDA devices on this node (torch is imported only when this is needed)."""
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:  # no torch, or a broken CUDA install: run on CPU
        return 0


def _check_args(args) -> None:
    if args.num_nodes is not None and args.num_nodes < 1:
        raise UsageError(f"--num_nodes must be >= 1, got {args.num_nodes}")
    if args.node_rank is not None and not args.world_layout:
        if args.node_rank < 0:
            raise UsageError(f"--node_rank must be >= 0, got {args.node_rank}")
        nodes = args.num_nodes if args.num_nodes is not None else 1
        if not args.hostfile and args.node_rank >= nodes:
            raise UsageError(f"--node_rank {args.node_rank} must be < --num_nodes {nodes}")
    if args.include and args.exclude:
        raise UsageError("--include and --exclude are mutually exclusive")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise UsageError(f"--master_port {args.master_port} is not a valid TCP port")
    if args.grace_period < 0:
        raise UsageError("--grace_period must be >= 0")
    if args.max_restarts < 0:
        raise UsageError("--max_restarts must be >= 0")
    if args.min_nodes is not None and args.min_nodes < 1:
        raise UsageError(f"--min_nodes must be >= 1, got {args.min_nodes}")
    if args.module and args.no_python:
        raise UsageError("--module and --no_python are mutually exclusive")
    if args.module:
        return  # resolved by the child's own import path
    if args.no_python:  # run as a shell would: a bare name is looked up on PATH, a path is a file
        if os.sep in args.script:
            if not os.path.isfile(args.script):
                raise UsageError(f"program not found: {args.script}")
        elif not shutil.which(args.script):
            here = f" (to run the file {args.script} in this folder, write ./{args.script})" \
                if os.path.isfile(args.script) else ""
            raise UsageError(f"program not found on PATH: {args.script}{here}")
    elif not os.path.isfile(args.script):
        raise UsageError(f"script not found: {args.script}")


def _job(args, master_addr: Optional[str]) -> JobSpec:
    return JobSpec(script=args.script, script_args=tuple(args.script_args),
                   module=args.module, no_python=args.no_python,
                   pass_local_rank=args.pass_local_rank, master_addr=master_addr,
                   master_port=DEFAULT_MASTER_PORT if args.master_port is None else args.master_port,
                   cwd=os.getcwd(),
                   python=sys.executable,
                   grace_period=None if args.grace_period == DEFAULT_GRACE_PERIOD
                   else args.grace_period)


def _with_exports(job: JobSpec) -> JobSpec:
    files = find_env_files(os.getcwd(), os.path.expanduser("~"))
    return replace(job, exports=collect_exports(os.environ, files))


def _node_from_host(layout, host: str) -> int:
    if host not in layout:
        raise UsageError(f"--node_host {host!r} is not in --world_layout "
                         f"({', '.join(layout)})")
    return list(layout).index(host)


def _plan_layout_node(args):
    """One node of a launch started by ssh/pdsh: ``--world_layout`` says it all."""
    layout = parse_layout(args.world_layout)
    if args.node_rank is None and args.node_host is None:
        raise UsageError("--world_layout needs --node_rank or --node_host")
    node = args.node_rank if args.node_rank is not None else \
        _node_from_host(layout, args.node_host)
    job = _job(args, args.master_addr or next(iter(layout)))
    return plan_from_layout(layout, node, job.master_addr, job.master_port), job


def _plan_hostfile(args, procs: Optional[int]):
    hosts = read_hostfile(os.path.expanduser(args.hostfile))
    layout = world_layout(hosts, args.include, args.exclude, args.num_nodes, procs)
    multi = len(layout) > 1
    # ssh, not pdsh, by default even where pdsh is installed (DeepSpeed prefers pdsh): with ssh each
    # node's launcher watches its session, so a failure or a stop reaches every node at once.
    launcher = args.launcher or ("ssh" if multi else "local")
    remote_master = multi or launcher != "local"
    job = _job(args, args.master_addr
               or (next(iter(layout)) if remote_master else DEFAULT_MASTER_ADDR))
    if launcher == "local":
        host = next(iter(layout))
        if not multi and args.launcher is None and not _is_this_machine(host):
            print(f"zeroengine: warning: the hostfile selects one host, {host}; its ranks run here, on this "
                  "machine (pass --launcher ssh to start them there)", file=sys.stderr)
        if multi and args.node_rank is None:
            raise UsageError(f"--launcher local with {len(layout)} hosts: pass "
                             "--node_rank to say which one this node is")
        return plan_from_layout(layout, args.node_rank or 0, job.master_addr,
                                job.master_port), job
    if args.node_rank is not None:
        raise UsageError(f"--node_rank is for --launcher local, not {launcher}")
    if not args.master_addr and launcher in ("ssh", "pdsh") and not args.dry_run:
        job = replace(job, master_addr=_reachable_address(job.master_addr))
    job = _with_exports(job)
    if launcher == "slurm":
        return [slurm_command_for_layout(layout, _slurm_job(args, job))], job
    if args.min_nodes is not None and args.min_nodes > len(layout):
        raise UsageError(f"--min_nodes {args.min_nodes} is more than the job's {len(layout)} node(s)")
    return RemoteLaunch(dict(layout), launcher, job), job


def _reachable_address(host: str) -> str:
    """The first host as every rank's ``MASTER_ADDR``: its name where that resolves here, else the first
    address the host reports for itself over ssh (a hostfile may name hosts by ssh aliases, which only
    ssh's own config knows; DeepSpeed's runner asks the same way, ``hostname -I``)."""
    try:
        socket.getaddrinfo(host, None)
        return host
    except OSError:
        pass
    try:
        found = subprocess.run(["ssh", *SSH_OPTIONS, host, "hostname -I"], capture_output=True, text=True,
                               timeout=30, stdin=subprocess.DEVNULL)
        words = found.stdout.split() if found.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        words = []
    if not words:
        raise UsageError(f"the first host, {host}, is where the ranks meet (MASTER_ADDR), but its name does not "
                         f"resolve here and 'ssh {host} hostname -I' gave no address: pass --master_addr with an "
                         "address every node can reach")
    return words[0]


def _is_this_machine(host: str) -> bool:
    return host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn())


def _slurm_job(args, job: JobSpec) -> JobSpec:
    """srun starts the script itself, so the ranks read their place from SLURM's variables: there is no
    --local_rank to pass, and an exported MASTER_PORT stands unless --master_port is given."""
    if args.pass_local_rank:
        raise UsageError("--pass_local_rank with --launcher slurm: srun starts the script directly, so the "
                         "local rank is known only inside each task (read LOCAL_RANK or SLURM_LOCALID)")
    if args.master_port is None and "MASTER_PORT" in os.environ:
        return replace(job, master_port=int(os.environ["MASTER_PORT"]))
    return job


def _plan_no_hostfile(args, procs: Optional[int]):
    launcher = args.launcher or "local"
    if launcher in ("ssh", "pdsh"):
        raise UsageError(f"--launcher {launcher} needs --hostfile")
    num_nodes = args.num_nodes or 1
    if launcher == "slurm":
        if args.include or args.exclude or args.node_rank is not None:
            raise UsageError("--include/--exclude/--node_rank with --launcher slurm "
                             "need --hostfile (srun places the ranks)")
        job = _slurm_job(args, _with_exports(_job(args, args.master_addr)))
        return [slurm_command(job, num_nodes, procs or _device_count() or 1)], job
    if args.include or args.exclude:
        pool = {"localhost": _device_count() or procs or 1}
        slots = world_layout(pool, args.include, args.exclude, None, procs)["localhost"]
    else:
        slots = list(range(procs or _device_count() or 1))
    if num_nodes > 1 and not args.master_addr:
        print(f"zeroengine: warning: --num_nodes {num_nodes} without --master_addr; "
              f"using {DEFAULT_MASTER_ADDR}, which only works if all nodes are this "
              "machine", file=sys.stderr)
    job = _job(args, args.master_addr or DEFAULT_MASTER_ADDR)
    return plan_uniform(num_nodes, args.node_rank or 0, len(slots), job.master_addr,
                        job.master_port, slots), job


def plan(args):
    """``(node_plan, job)`` for a local run, or ``(commands, job)`` for a remote one."""
    procs = _procs_per_node(args)
    _check_args(args)
    if args.world_layout:
        return _plan_layout_node(args)
    if args.hostfile:
        return _plan_hostfile(args, procs)
    return _plan_no_hostfile(args, procs)


def _print_commands(commands: List[LaunchCommand]) -> None:
    for command in commands:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in command.env.items())
        print(f"{command.name}: {env + ' ' if env else ''}{shlex.join(command.argv)}")


def _switch_on_as_deepspeed() -> Optional[str]:
    """--as_deepspeed: the ranks inherit ZEROENGINE_AS_DEEPSPEED=1 (remote nodes get it exported with the
    job). The variable acts through the start-up hook pip installs; without it nothing would switch."""
    from zeroengine.integrations import as_deepspeed

    if as_deepspeed.startup_hook_installed() is None:
        return ("--as_deepspeed: zeroengine's start-up hook (zeroengine_as_deepspeed.pth) is not in this "
                "Python's site-packages, so the variable would switch nothing; reinstall zeroengine "
                "(pip install -e . or bash scripts/install.sh)")
    os.environ[as_deepspeed.ENV_VAR] = "1"
    return None


def _announce_mesh(script_args: List[str], world: int) -> None:
    """The process mesh the ranks will form, when the script's config (``--zeroengine_config`` / ``--deepspeed_config``
    / ``--deepspeed``'s file) asks for tensor parallelism or a number of pipeline stages: printed before they start,
    so a world that does not divide shows here, not in every rank's traceback. Anything unreadable is left to the
    ranks, which check the config properly."""
    path = None
    for i, arg in enumerate(script_args):
        for flag in ("--zeroengine_config", "--deepspeed_config", "--deepscale_config"):
            if arg == flag and i + 1 < len(script_args):
                path = script_args[i + 1]
            elif arg.startswith(flag + "="):
                path = arg.split("=", 1)[1]
    if path is None or not os.path.isfile(path):
        return
    try:
        from zeroengine.config import read_config_file

        data = read_config_file(path)
        tp = (data.get("tensor_parallel") or {}).get("autotp_size") or 1
        pp = (data.get("pipeline") or {}).get("stages", 1)
        pp = pp if isinstance(pp, int) else 1
        if tp > 1 or pp > 1:
            from zeroengine.parallel.mesh import describe_layout

            print("zeroengine: " + describe_layout(world, pp=pp, tp=tp), file=sys.stderr, flush=True)
    except Exception as error:  # noqa: BLE001 - the ranks report config problems themselves
        print(f"zeroengine: note: the process mesh for {path} is not shown ({error})", file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the launcher; returns the exit code (0 only if every rank succeeded)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed
        return e.code if isinstance(e.code, int) else 2
    if args.as_deepspeed:
        error = _switch_on_as_deepspeed()
        if error:
            print(f"zeroengine: error: {error}", file=sys.stderr)
            return 2
    try:
        what, job = plan(args)
        if isinstance(what, NodePlan):
            commands = rank_commands(what, job, os.environ)
        elif isinstance(what, RemoteLaunch):
            commands = what.commands()
        else:
            commands = what
    except ValueError as e:  # UsageError, HostfileError, bad include spec, ...
        print(f"zeroengine: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        _print_commands(commands)
        return 0
    if isinstance(what, NodePlan):
        if what.node_rank == 0:
            _announce_mesh(args.script_args, what.world_size)
        if args.max_restarts and what.num_nodes > 1:
            print("zeroengine: error: --max_restarts restarts one node's launch; a job of several nodes cannot be "
                  "restarted by one node's launcher yet (restart it from the top)", file=sys.stderr)
            return 2

        def commands_for(restart: int) -> List[LaunchCommand]:  # a new port: the old store may linger
            return rank_commands(replace(what, master_port=what.master_port + restart), job, os.environ)

        # (with no restarts too: ranks always see the attempt, 0, as under torchrun)
        # a node of a job of several nodes: the job's attempt comes from the launching node
        first = int(os.environ.get(RESTART_VARIABLES[0], "0")) if args.world_layout else 0
        return run_with_restarts(commands_for, args.max_restarts, noun="ranks", grace_period=args.grace_period,
                                 watch_stdin=args.watch_stdin, first_count=first)
    if isinstance(what, RemoteLaunch):
        restarts = NodeRestarts(what, args.min_nodes, master_given=bool(args.master_addr), master_of=_reachable_address)

        def announced(restart: int) -> List[LaunchCommand]:
            commands = restarts.commands_for(restart)
            for command in commands:
                print(f"zeroengine: starting {command.name}: {shlex.join(command.argv)}", file=sys.stderr,
                      flush=True)
            return commands

        return run_with_restarts(announced, args.max_restarts, noun="nodes", grace_period=args.grace_period,
                                 before_restart=restarts.before_restart)
    if args.max_restarts:
        print("zeroengine: error: --max_restarts with --launcher slurm: srun starts the ranks itself, so this "
              "launcher cannot restart them (use srun's own --requeue)", file=sys.stderr)
        return 2
    for command in commands:
        print(f"zeroengine: starting {command.name}: {shlex.join(command.argv)}",
              file=sys.stderr, flush=True)
    return supervise(commands, noun="nodes", grace_period=args.grace_period)


if __name__ == "__main__":
    sys.exit(main())
