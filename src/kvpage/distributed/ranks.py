"""Rank 0's hold on the other tensor-parallel ranks: starting this node's, sending each step's plan, and
shutting every rank down, on a normal exit and on a failure (a rank that dies, hangs past the timeout, or
never starts): no hang, no orphan process.

Every rank keeps its own KV tensors and its own copy of the model's shard; rank 0 alone schedules and
allocates, and its plan (the step's sequences with their tokens, positions and block tables, and the block
copies and swaps before it) is what every rank executes, so block tables agree by construction.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kvpage.distributed.config import ParallelConfig
from kvpage.distributed.group import init_group, leave_group, open_store

logger = logging.getLogger(__name__)


class RankFailure(RuntimeError):
    """A tensor-parallel rank stopped answering: the group is shut down, its requests fail."""


@dataclass(frozen=True)
class StepPlan:
    kind: str  # "step" (forward pass), "ops" (block operations alone), "trim" (idle: free heap to the OS), "stop"
    batch: list | None = None  # the step's ScheduledSeq entries
    ops: Any = None  # the step's BlockOps


def threads_per_rank(config: ParallelConfig) -> int:
    """This host's cores shared evenly by the ranks it runs."""
    return max(1, (os.cpu_count() or 1) // config.per_node)


def die_with_parent(poll_s: float = 0.2) -> None:
    """This process exits when the process that started it is gone (no orphans), polled from a daemon thread.
    Not PR_SET_PDEATHSIG: that fires when the parent's *thread* that started us exits, and the server starts
    the ranks on its engine thread, which ends before the engine's shutdown has stopped them in order."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="kvpage-parent-watch", daemon=True).start()


def exchange_ready(rank: int, size: int, status: dict) -> list[dict]:
    """Every rank's start-up status ({"error": ...} or {"blocks": n}); raises naming the first failed rank."""
    got: list[Any] = [None] * size
    dist.all_gather_object(got, status)
    for r, st in enumerate(got):
        if st.get("error"):
            raise RuntimeError(f"tensor-parallel rank {r} failed to start: {st['error']}")
    blocks = {st["blocks"] for st in got}
    if len(blocks) != 1:
        raise RuntimeError(f"tensor-parallel ranks disagree on their KV pools: blocks per rank {got}")
    return got


def start_rank(rank: int, config: ParallelConfig, follower_args: tuple) -> subprocess.Popen:
    """A follower rank as a fresh Python process (``python -m kvpage.worker.follower``; its settings
    pickled on stdin): no re-import of the caller's main module, as multiprocessing's spawn would do."""
    proc = subprocess.Popen([sys.executable, "-m", "kvpage.worker.follower"], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps((rank, config, *follower_args)))
    proc.stdin.close()
    return proc


class RankGroup:
    """Started by rank 0's process: this node's other ranks, the rendezvous, the group."""

    def __init__(self, config: ParallelConfig, follower_args: tuple) -> None:
        self.config = config = config.with_port()
        self.size = config.tensor_parallel_size
        self.alive = False
        self._threads_before: int | None = None  # the process's torch threads while the group holds a share
        self.procs: dict[int, subprocess.Popen] = {r: start_rank(r, config, follower_args)
                                                    for r in config.local_ranks if r != 0}
        try:
            self.store = open_store(config, 0)
            self._wait_joined()
            init_group(config, 0, self.store)
        except BaseException:
            self._kill()
            raise
        self.alive = True
        atexit.register(self.shutdown)  # a script that never closes its LLM still stops its ranks in order
        # rank 0 takes its share of the cores while the group lives; the process's own count comes back when it
        # stops, or every later engine in the process (a script's next LLM, a test run's next test) ran on one core
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(threads_per_rank(config))

    def _wait_joined(self) -> None:
        """Until every other rank has reached the store; a local rank that exits first fails start-up at once."""
        deadline = time.monotonic() + self.config.timeout_s
        while self.store.add("joined", 0) < self.size - 1:
            for r, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"tensor-parallel rank {r} exited (code {p.returncode}) before joining")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks did not all join {self.config.master_addr}:"
                                   f"{self.config.master_port} within {self.config.timeout_s:.0f} s")
            time.sleep(0.02)

    def ready(self, status: dict) -> None:
        try:
            exchange_ready(0, self.size, status)
        except BaseException:
            self.fail()
            raise

    def send(self, plan: StepPlan) -> None:
        """The plan to every rank (before rank 0 runs it itself)."""
        if not self.alive:
            raise RankFailure("the tensor-parallel group is down")
        try:
            dist.broadcast_object_list([plan], src=0)
        except Exception as e:
            self.fail()
            raise RankFailure(f"a tensor-parallel rank failed: {e}") from e

    def lost(self) -> str | None:
        """A rank of this node that has exited while the group was up (polled between steps, so that an idle
        server notices it too); a rank on another node is noticed by the next collective. None: all run."""
        if not self.alive:
            return None
        for r, p in self.procs.items():
            if p.poll() is not None:
                return f"tensor-parallel rank {r} exited (code {p.returncode})"
        return None

    def guard(self, error: BaseException) -> RankFailure:
        """A collective inside rank 0's step failed: shut the group down and say so."""
        self.fail()
        return RankFailure(f"a tensor-parallel rank failed during the step: {error}")

    def fail(self) -> None:
        self.alive = False
        self._kill()
        leave_group()
        self._restore_threads()

    def _restore_threads(self) -> None:
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def _kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait(5)

    def shutdown(self) -> None:
        """Stop every rank; idempotent."""
        atexit.unregister(self.shutdown)
        if self.alive:
            self.alive = False
            with contextlib.suppress(Exception):  # a broken group: the ranks are killed below
                dist.broadcast_object_list([StepPlan("stop")], src=0)
            for p in self.procs.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
            leave_group()
        self._kill()
        self._restore_threads()
