"""A rank other than 0: join the group, load its shard and KV pool, then run every step plan rank 0 sends
until it says stop (or the group breaks: then it exits, never outliving rank 0)."""

from __future__ import annotations

import logging
import pickle
import sys
import traceback

import torch
import torch.distributed as dist

from kvpage.config import CacheConfig, ModelRunConfig
from kvpage.distributed.config import ParallelConfig
from kvpage.distributed.group import init_group, leave_group, open_store
from kvpage.distributed.ranks import StepPlan, die_with_parent, exchange_ready, start_rank, threads_per_rank
from kvpage.worker.worker import Worker

logger = logging.getLogger(__name__)


def follower_main(rank: int, config: ParallelConfig, model_config: ModelRunConfig, cache_config: CacheConfig,
                  spawned: bool = True) -> int:
    """Exit code 0 after a stop, 1 when the group broke or start-up failed."""
    if spawned:
        die_with_parent()
    torch.set_num_threads(threads_per_rank(config))
    store = open_store(config, rank)
    store.add("joined", 1)
    init_group(config, rank, store)

    try:
        worker = Worker(model_config, cache_config, tp=(rank, config.tensor_parallel_size))
        status = {"blocks": worker.num_blocks}
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        worker, status = None, {"error": f"{type(e).__name__}: {e}"}
    try:
        exchange_ready(rank, config.tensor_parallel_size, status)
        assert worker is not None
        while True:
            got: list = [None]
            dist.broadcast_object_list(got, src=0)
            plan: StepPlan = got[0]
            if plan.kind == "stop":
                return 0
            worker.follow(plan)
    except Exception as e:  # rank 0 gone, a peer gone, a timeout, or start-up failed somewhere
        logger.error("tensor-parallel rank %d stops: %s", rank, e)
        return 1
    finally:
        leave_group()


def run_node(config: ParallelConfig, model_config: ModelRunConfig, cache_config: CacheConfig) -> int:
    """A node (or a torchrun process) without rank 0: its ranks follow until rank 0 stops them."""
    ranks = config.local_ranks
    procs = [start_rank(r, config, (model_config, cache_config)) for r in ranks[1:]]
    code = follower_main(ranks[0], config, model_config, cache_config, spawned=False)
    for p in procs:
        code = code or p.wait()
    return code


if __name__ == "__main__":  # a rank started by start_rank: its settings come pickled on stdin
    sys.exit(follower_main(*pickle.loads(sys.stdin.buffer.read())))
