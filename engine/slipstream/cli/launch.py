"""`slipstream train --nproc-per-node N`: start the run's processes through
torch.distributed.run's own API (its elastic agent), as ``torchrun`` would.

The launching process has validated the configuration already; each worker runs
``python -m slipstream train`` with the same arguments minus the launcher's, under
the environment torchrun gives it (RANK, WORLD_SIZE, MASTER_ADDR, ...).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from slipstream.errors import ConfigError


@dataclass
class LaunchOptions:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    def validate(self) -> LaunchOptions:
        if self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank must be from 0 to {self.nnodes - 1} (--nnodes {self.nnodes}), "
                f"got {self.node_rank}"
            )
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"--master-port must be a TCP port (1-65535), got {self.master_port}")
        if self.nnodes > 1 and self.master_addr is None:
            raise ConfigError(
                "--nnodes > 1 needs --master-addr (the host of node 0, which every node can "
                "reach) and --master-port"
            )
        if self.master_port is not None and self.node_rank == 0 and not port_free(self.master_port):
            # Node 0 listens there: torchrun would fail after starting, with a traceback
            # per process.
            raise ConfigError(
                f"--master-port {self.master_port} is already in use on this machine; choose "
                "another port, or leave it out (one machine) for a free one"
            )
        return self

    def torchrun_args(self) -> list[str]:
        """The same launch as torchrun's command line."""
        args = [f"--nproc-per-node={self.nproc_per_node}", f"--nnodes={self.nnodes}"]
        # One machine without a port: torchrun rendezvouses on a free local port.
        args.append(f"--node-rank={self.node_rank}")
        if self.master_addr is not None:
            args.append(f"--master-addr={self.master_addr}")
        if self.master_port is not None:
            args.append(f"--master-port={self.master_port}")
        return args


def threads_per_process(nproc_per_node: int) -> int:
    """Cores shared out among one node's processes (at least one each)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // nproc_per_node)


def launch(options: LaunchOptions, train_args: Sequence[str]) -> int:
    """Run ``slipstream train *train_args`` in ``options.nproc_per_node`` processes on
    this node; returns the exit code (the first failed worker's, 0 when all succeed).
    A worker's error is printed by the worker itself (rank 0), so nothing is added."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    options.validate()
    # Processes x threads = cores, unless the user chose (torchrun's default is 1 thread).
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(options.nproc_per_node)))
    # The agent logs each failed worker with a traceback of its own; the worker has
    # already said what went wrong.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        # torchrun's own entry (rendezvous choice, config_from_args, elastic_launch).
        run(parse_args([*options.torchrun_args(), "-m", "slipstream", "train", *train_args]))
    except ChildFailedError as exc:
        _, failure = exc.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as exc:
        # SIGINT or SIGTERM to the launcher: the agent has passed it on and the workers
        # have stopped with their checkpoint. The shell's code for the signal (130, 143),
        # as one process exits with, so a requeue script can tell; not the agent's traceback.
        return 128 + int(exc.sigval)
    return 0


def port_free(port: int) -> bool:
    """Whether a TCP port can be listened on here (on every interface, as torchrun's
    store listens)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # A port left in TIME_WAIT by an earlier run is free to listen on again.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True
