"""Restarts of a job of several nodes (``--hostfile`` with ssh or pdsh): the nodes that cannot be reached are left
out when ``--min_nodes`` allows it, and the job resumes at the smaller world.

After a failure the launching node asks every node of the job, over ssh, to answer (``ssh host true``, bounded by
``ConnectTimeout``). Reachable nodes are restarted whatever failed on them (a rank's crash); unreachable ones (a
rebooted or lost machine) are dropped when at least ``--min_nodes`` remain, else the job gives up naming them.
The ranks are numbered afresh over the remaining nodes; a checkpoint loads at any world size, and the engine's
data loader shares out the rest of its epoch among the new ranks. The first remaining node hosts the rendezvous
(``MASTER_ADDR``) unless ``--master_addr`` was given.
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, TextIO

from .commands import SSH_OPTIONS, JobSpec, LaunchCommand, pdsh_command, ssh_commands
from .restarts import RESTART_VARIABLES

CONNECT_TIMEOUT_S = 10


@dataclass
class RemoteLaunch:
    """A job started on its nodes by ssh or pdsh: the nodes (host → slots) and what to run."""
    layout: Dict[str, List[int]]
    transport: str  # "ssh" or "pdsh"
    job: JobSpec

    def commands(self, restart: int = 0) -> List[LaunchCommand]:
        # a new port (the old store may linger), and the attempt's number for the node launchers to pass on
        job = replace(self.job, master_port=self.job.master_port + restart,
                      exports={**self.job.exports, **{name: str(restart) for name in RESTART_VARIABLES}})
        return ssh_commands(self.layout, job) if self.transport == "ssh" else [pdsh_command(self.layout, job)]


def answers(host: str) -> bool:
    """Whether ``host`` answers over ssh within the connect timeout."""
    try:
        done = subprocess.run(["ssh", *SSH_OPTIONS, "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}", host, "true"],
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=CONNECT_TIMEOUT_S + 20)
        return done.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class NodeRestarts:
    """Before each restart: drop the nodes that do not answer, down to ``min_nodes`` (see the module doc)."""

    def __init__(self, launch: RemoteLaunch, min_nodes: Optional[int], master_given: bool,
                 master_of: Callable[[str], str], probe: Callable[[str], bool] = answers,
                 log: Optional[TextIO] = None):
        self.launch, self.master_given, self.master_of, self.probe = launch, master_given, master_of, probe
        self.min_nodes = len(launch.layout) if min_nodes is None else min_nodes
        self.log = log if log is not None else sys.stderr

    def commands_for(self, restart: int) -> List[LaunchCommand]:
        return self.launch.commands(restart)

    def before_restart(self, restart: int) -> Optional[str]:
        """Shrink the job to the nodes that answer; a reason to give up instead, or None."""
        layout = self.launch.layout
        lost = [host for host in layout if not self.probe(host)]
        if not lost:
            return None
        left = {host: slots for host, slots in layout.items() if host not in lost}
        if len(left) < self.min_nodes:
            return (f"node(s) {', '.join(lost)} cannot be reached (ssh {lost[0]} true failed); "
                    f"{len(left)} node(s) left, fewer than --min_nodes {self.min_nodes}")
        job = self.launch.job
        if not self.master_given and next(iter(layout)) in lost:
            job = replace(job, master_addr=self.master_of(next(iter(left))))
        self.launch = replace(self.launch, layout=left, job=job)
        ranks = sum(len(slots) for slots in left.values())
        print(f"zeroengine: node(s) {', '.join(lost)} cannot be reached: left out; restart {restart} runs on "
              f"{len(left)} node(s), {ranks} rank(s) (--min_nodes {self.min_nodes})", file=self.log, flush=True)
        return None
