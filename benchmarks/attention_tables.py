"""The paged decode kernel over block tables the engine really builds, vs the same tables with blocks shuffled.

benchmarks/kernels.py scatters every block at random; the engine's block pool keeps a sequence's blocks
consecutive where it can (docs/kv.md), and the kernels read consecutive blocks as one stream. This script runs
benchmarks/throughput.py's sharegpt requests through the engine, snapshots every running sequence's block table
and length at a few steps, and times kvpage's paged decode op (one query per sequence, SmolLM2's shape, bf16,
the engine's KV layout) over those tables: as built, and with the physical blocks randomly renumbered (the
same lengths and batch, no contiguity). Six caches are rotated so that every call reads its K/V from memory,
as each layer of a step does. Reported: share of a table's neighbouring blocks that are consecutive, and the
effective KV read bandwidth (median of --reps calls, --rounds rounds alternating the two variants).

    python benchmarks/attention_tables.py [--steps 60 150 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics

import torch

from _common import median_seconds
from kvpage.attention.backends.cpu import CpuPagedAttention
from kvpage.engine.llm import LLM
from kvpage.ops import PARTITION_SIZE, kernels, load_kernels, pack_kv_rows
from kvpage.sampling_params import SamplingParams
from kvpage.worker.kv_cache import as_block_major
from throughput import build_workload


def snapshots(steps: list[int]) -> list[dict]:
    """Block tables and lengths of the running sequences after each of ``steps`` engine steps."""
    reqs = build_workload("sharegpt")
    llm = LLM(kv_cache_memory="4GiB", max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048)
    eng = llm.engine
    for i, r in enumerate(reqs):
        eng.add_request(f"r{i}", r["prompt_token_ids"],
                        SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True))
    out, step = [], 0
    while eng.has_unfinished_requests() and step < max(steps):
        eng.step()
        step += 1
        if step in steps:
            kv = eng.kv
            ids = kv.seq_ids()
            out.append({"step": step, "num_blocks": kv.num_blocks, "tables": [kv.block_table(s) for s in ids],
                        "lens": [kv.num_tokens(s) for s in ids]})
    return out


def adjacency(tables: list[list[int]]) -> float:
    pairs = sum(max(len(t) - 1, 0) for t in tables)
    return sum(b == a + 1 for t in tables for a, b in itertools.pairwise(t)) / max(pairs, 1)


def decode_call(ops, q, caches, tables, lens, packed: bool):
    """One decode query per sequence over ``tables``, each call on the next of ``caches`` (from memory)."""
    qsl = torch.arange(q.shape[0] + 1)
    turn = [0]

    def call():
        turn[0] = (turn[0] + 1) % len(caches)
        return ops.paged_attention(q, caches[turn[0]], tables, qsl, lens, q.shape[-1] ** -0.5, PARTITION_SIZE,
                                   packed)

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, nargs="+", default=[60, 150, 300])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    ops = load_kernels()
    if ops is None:
        raise SystemExit("compiled kernels unavailable: nothing to measure")
    hq, hkv, d, bs = 9, 3, 64, 16
    snaps = snapshots(args.steps)
    gen = torch.Generator().manual_seed(0)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
    print("step  seqs  mean len  consecutive  as built GB/s  shuffled GB/s  built/shuffled")
    for sn in snaps:
        nb = sn["num_blocks"]
        rows = torch.randn(2, nb, bs, hkv, d, generator=gen).bfloat16()
        packed = CpuPagedAttention(kernels()).packed_layout(rows, torch.bfloat16)
        renumber = torch.randperm(nb, generator=gen)
        moved = torch.empty_like(rows)
        moved[:, renumber] = rows  # block i's data now lives at block renumber[i]: same attention, other places
        layout = (lambda c: as_block_major(pack_kv_rows(c))) if packed else as_block_major  # the engine's storage
        caches = {"built": [layout(rows) for _ in range(6)], "shuffled": [layout(moved) for _ in range(6)]}
        del rows, moved
        renumber = renumber.tolist()
        variants = {"built": sn["tables"], "shuffled": [[renumber[b] for b in t] for t in sn["tables"]]}
        lens = torch.tensor(sn["lens"])
        b = len(sn["tables"])
        width = max(len(t) for t in sn["tables"])
        q = torch.randn(b, hq, d, generator=gen).bfloat16()
        kv_bytes = 2 * sum(sn["lens"]) * hkv * d * 2
        calls = {}
        for name, tabs in variants.items():
            tables = torch.zeros(b, width, dtype=torch.int64)
            for i, t in enumerate(tabs):
                tables[i, : len(t)] = torch.tensor(t)
            calls[name] = decode_call(ops, q, caches[name], tables, lens, packed)
        assert torch.equal(calls["built"](), calls["shuffled"]()), "renumbered blocks changed the result"
        bw = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                bw[name].append(kv_bytes / median_seconds(call, args.reps) / 1e9)
        built, shuffled = statistics.median(bw["built"]), statistics.median(bw["shuffled"])
        print(f"{sn['step']:>4} {b:>5} {statistics.mean(sn['lens']):>9.0f} {adjacency(sn['tables']):>11.1%} "
              f"{built:>14.1f} {shuffled:>14.1f} {built / shuffled:>15.2f}")


if __name__ == "__main__":
    main()
