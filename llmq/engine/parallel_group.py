"""ParallelGroup: the processes of one tensor x pipeline parallel engine, and how they talk.

Rank 0 is the engine's own process: it schedules, samples, and starts the other ranks as processes of
their own (`python -m llmq.engine.rank_main`), which load their shards and then follow the steps rank
0 broadcasts (llmq/engine/model_runner.py: `ModelRunner.follow`). torch.distributed carries
everything: gloo on CPU; on CUDA, NCCL for the tensors and gloo for the step broadcasts, which are
small Python objects. A rank whose parent is gone exits, so no rank outlives its engine; a rank that
dies ends rank 0's process, so no engine runs on without one of its shards.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from llmq.engine.config import EngineConfig
from llmq.model.tensor_parallel import Communicator

log = logging.getLogger(__name__)

STOP = "stop"
REPORT = "report"
_INIT_TIMEOUT = timedelta(minutes=10)  # the slowest rank's load; then a step that waits this long fails


@dataclass(frozen=True)
class Launch:
    """What a rank process is told on its standard input."""

    config: EngineConfig
    rank: int
    init_method: str
    parent_pid: int


@dataclass
class ParallelGroup:
    """This rank's view of the group. `comm` is its tensor-parallel group's; `control` carries the
    step broadcasts; `followers` are the processes rank 0 started."""

    rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    comm: Communicator
    control: dist.ProcessGroup | None
    followers: list[subprocess.Popen] = field(default_factory=list)
    _closing: threading.Event = field(default_factory=threading.Event)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def rank_of(self, stage: int) -> int:
        """This rank's counterpart (same tensor rank) on `stage`."""
        return stage * self.tensor_parallel_size + self.rank % self.tensor_parallel_size

    # ---- start -------------------------------------------------------------------------------

    @classmethod
    def launch(cls, config: EngineConfig) -> "ParallelGroup":
        """Rank 0: start the other ranks and join them."""
        if dist.is_initialized():
            raise RuntimeError("this process already drives a parallel engine; close it (LLM.close()) first")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        followers = []
        for rank in range(1, config.tensor_parallel_size * config.pipeline_parallel_size):
            process = subprocess.Popen([sys.executable, "-m", "llmq.engine.rank_main"], stdin=subprocess.PIPE)
            process.stdin.write(pickle.dumps(Launch(config, rank, init_method, os.getpid())))
            process.stdin.close()
            followers.append(process)
        log.info("started %d rank process(es) for tensor_parallel_size %d x pipeline_parallel_size %d",
                 len(followers), config.tensor_parallel_size, config.pipeline_parallel_size)
        joined = threading.Event()
        watcher = threading.Thread(target=_watch_while_joining, args=(followers, joined), daemon=True,
                                   name="llmq-rank-watch-join")
        watcher.start()
        group = cls.join(config, 0, init_method)
        joined.set()
        group.followers = followers
        return group

    def watch(self, interval: float = 0.5) -> None:
        """Rank 0, once every rank has loaded: from now on a rank that ends ends the engine (abandon)."""
        def run() -> None:
            while not self._closing.wait(interval):
                if any(process.poll() is not None for process in self.followers) and not self._closing.is_set():
                    self.abandon("a rank process ended")

        threading.Thread(target=run, name="llmq-rank-watch", daemon=True).start()

    def abandon(self, reason: str) -> None:
        """End this process now. A rank that died, or a step some rank could not finish, leaves the
        ranks out of step and a shard's weights and KV cache gone: no step can run again. Ending at
        once, before the requests in flight are failed (as a dead engine process ends its worker),
        gives them back to the broker, for another worker to resume from their checkpoints."""
        _exit_for(reason, self.followers)

    @classmethod
    def join(cls, config: EngineConfig, rank: int, init_method: str) -> "ParallelGroup":
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        cuda = config.device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(device_of(config, rank))
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank,
                                world_size=tp * pp, timeout=_INIT_TIMEOUT)
        control = dist.new_group(backend="gloo") if cuda else None
        tensor_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]  # every rank makes all
        return cls(rank, tp, pp, Communicator(tensor_groups[rank // tp], rank % tp, tp), control)

    # ---- steps -------------------------------------------------------------------------------

    def broadcast(self, message=None):
        """Rank 0 sends `message` (a step's StepInputs, REPORT or STOP); the others return it."""
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_reports(self, report: dict) -> list[dict] | None:
        """Every rank's report, on rank 0 (None elsewhere)."""
        reports = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(report, reports, dst=0, group=self.control)
        return reports

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV blocks each can hold)."""
        tensor = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control)
        return int(tensor.item())

    def close(self, timeout: float = 30.0, stop_ranks: bool = True) -> None:
        """Rank 0: tell the other ranks to stop (or, when they may be mid-collective, kill them),
        wait for them, leave the group."""
        self._closing.set()
        if not stop_ranks:
            for process in self.followers:
                process.kill()
        elif self.rank == 0 and dist.is_initialized():
            try:
                self.broadcast(STOP)
            except RuntimeError:  # a rank is already gone
                log.warning("a rank process had already ended")
        deadline = time.monotonic() + timeout
        for process in self.followers:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def device_of(config: EngineConfig, rank: int) -> torch.device:
    """Rank r runs on the r-th GPU from the configured one; on CPU every rank shares the host."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def exit_with_parent(parent_pid: int, interval: float = 0.5) -> None:
    """End this process as soon as the process that started it is gone, however it ended."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os._exit(0)

    threading.Thread(target=watch, name="llmq-rank-parent-watch", daemon=True).start()


def _watch_while_joining(followers: list[subprocess.Popen], joined: threading.Event) -> None:
    """A rank that ends before every rank has joined would leave rank 0 waiting for it until the
    timeout: end instead, saying so (the rank's own log says why)."""
    while not joined.wait(0.5):
        if any(process.poll() is not None for process in followers):
            _exit_for("a rank process ended before the ranks had joined", followers)


def _exit_for(reason: str, followers: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 1.0  # a rank killed a moment ago may not have its exit code yet
    while not any(p.poll() is not None for p in followers) and time.monotonic() < deadline:
        time.sleep(0.05)
    ended = [f"rank {rank} (pid {p.pid}) exit code {p.returncode}"
             for rank, p in enumerate(followers, start=1) if p.poll() is not None]
    log.critical("%s (%s); the engine cannot go on without all its ranks", reason,
                 ", ".join(ended) or "every rank process is still running")
    logging.shutdown()
    os._exit(1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
