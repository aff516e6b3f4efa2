"""KV groups on Gemma 3 270M: what allocating by layer type saves, and what it buys at decode time.

Memory (bookkeeping only, the engine's own managers): each request is prefilled in chunks of 2048 tokens as
the scheduler would, with the prefix cache off; after each chunk the computed blocks are registered, which
is when a sliding-window group lets its passed blocks go. Reported per context length: the blocks and bytes
one request holds by layer type (five sliding groups and one full group of three layers, 48 KiB blocks in
bf16) against every layer keeping its whole history (one group of 18 layers, 288 KiB blocks), and how many
such requests a pool of --kv-memory admits one after another.

Speed (--speed): decode steps of --batch sequences at --context tokens on the model itself (bf16 fast path),
the same weights and cache bytes with the sliding layers reading at most their 512-token window (KV groups)
or every layer reading the whole context (one full-attention group); medians of alternating rounds.

    python benchmarks/kv_groups.py [--kv-memory 4GiB] [--contexts 1024 8192 32768]
    python benchmarks/kv_groups.py --speed [--context 8192] [--batch 1 8 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model
from kvpage.kv import KVPoolConfig, KVSequence
from kvpage.kv.specs import KVLayout, group_layers
from kvpage.model.registry import PRESETS
from kvpage.units import format_bytes, parse_size

CHUNK = 2048


def gemma_windows() -> list[int | None]:
    cfg = PRESETS["gemma-3-270m"]
    return [cfg.layer_window(i) for i in range(cfg.num_layers)]


def layer_bytes(dtype_bytes: int = 2) -> int:
    cfg = PRESETS["gemma-3-270m"]
    return cfg.num_kv_heads * cfg.head_dim * 2 * dtype_bytes  # K and V of one token in one layer


def manager(layout: KVLayout, pool_bytes: int, block_size: int):
    block_bytes = layer_bytes() * layout.layers_per_group * block_size
    cfg = KVPoolConfig(pool_bytes // block_bytes, block_size, enable_prefix_caching=False, watermark=0.0)
    return cfg.build(None, layout), block_bytes


def prefill(m, sid: str, tokens: int) -> bool:
    """Admit and compute a request of ``tokens`` prompt tokens chunk by chunk; False if the pool refuses."""
    seq = KVSequence(sid, list(range(tokens)))
    done = 0
    while done < tokens:
        n = min(CHUNK, tokens - done)
        if m.allocate_slots(seq, n) is None:
            if m.has_seq(sid):
                m.free(sid)
            return False
        done += n
        m.cache_computed_blocks(seq, done)
    return True


def held_blocks(m, sid: str) -> int:
    return sum(sum(1 for b in t if b >= 0) for t in m.block_tables(sid))


def memory(args: argparse.Namespace) -> None:
    pool = parse_size(args.kv_memory)
    layouts = {"by layer type": group_layers(gemma_windows()), "every layer full": group_layers([None] * 18)}
    print(f"Gemma 3 270M (18 layers: 15 sliding, window 512; 3 full), bf16 KV, {args.block_size}-token blocks, "
          f"pool {format_bytes(pool)}; prefill in chunks of {CHUNK}")
    print("| context | by layer type: blocks / request | bytes | every layer full: blocks | bytes | less memory | "
          "requests that fit: by layer type | every layer full | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for ctx in args.contexts:
        row = {}
        for name, layout in layouts.items():
            m, block_bytes = manager(layout, pool, args.block_size)
            assert prefill(m, "probe", ctx), f"{name}: one request of {ctx} tokens does not fit the pool"
            blocks = held_blocks(m, "probe")
            m.free("probe")
            fit = 0
            while prefill(m, f"r{fit}", ctx):
                fit += 1
            m.check_invariants()
            row[name] = (blocks, blocks * block_bytes, fit)
        (hb, hbytes, hfit), (fb, fbytes, ffit) = row["by layer type"], row["every layer full"]
        ratio = f"{hfit / ffit:.2f}x" if ffit else "inf"
        print(f"| {ctx:,} | {hb} | {format_bytes(hbytes)} | {fb} | {format_bytes(fbytes)} | {fbytes / hbytes:.2f}x | "
              f"{hfit} | {ffit} | {ratio} |")


def speed(args: argparse.Namespace) -> None:
    import torch

    from kvpage.model.loader import load_model
    from kvpage.worker.kv_cache import KVCache
    from kvpage.worker.model_runner import ModelRunner, ScheduledSeq

    lm = load_model("gemma-3-270m", dtype=args.dtype)
    pool = parse_size(args.kv_memory)
    setups = {}
    for name, layout in (("by layer type", group_layers(gemma_windows())),
                         ("every layer full", group_layers([None] * 18))):
        m, _ = manager(layout, pool, args.block_size)
        cache = KVCache(lm.config, m.num_blocks, args.block_size, lm.dtype, layout=layout)
        for t in cache.tensors:
            t.zero_()  # the "prefill" is bookkeeping only: finite keys and values for the kernels to read
        setups[name] = (m, ModelRunner(lm.model, cache))
    print(f"machine: {cpu_model()}; Gemma 3 270M {lm.dtype}; decode steps at {args.context:,} tokens of context; "
          f"medians of {args.rounds} rounds x {args.steps} steps")
    print("| sequences | by layer type (ms/step) | every layer full (ms/step) | full / by layer type |")
    print("|---:|---:|---:|---:|")
    for batch in args.batch:
        seqs = {}
        for name, (m, _) in setups.items():
            for sid in list(m.seq_ids()):
                m.free(sid)
            seqs[name] = []
            for i in range(batch):
                sid = f"s{i}"
                if not prefill(m, sid, args.context - 1):
                    raise SystemExit(f"{name}: {batch} sequences of {args.context} tokens do not fit "
                                     f"{args.kv_memory}: raise --kv-memory")
                seqs[name].append(KVSequence(sid, list(range(args.context - 1))))

        def step(name: str, seqs: dict[str, list[KVSequence]] = seqs) -> float:
            m, runner = setups[name]
            work = []
            for seq in seqs[name]:
                pos = len(seq.token_ids)
                seq.token_ids.append(7)
                assert m.allocate_slots(seq, 1) is not None
                tables = m.block_tables(seq.seq_id)
                work.append(ScheduledSeq(seq.seq_id, [7], pos, tables[0], block_tables=tables))
            t0 = time.perf_counter()
            with torch.inference_mode():
                runner.execute(work, argmax_only=True)
            dt = time.perf_counter() - t0
            for seq in seqs[name]:
                m.cache_computed_blocks(seq, len(seq.token_ids))
            return dt

        times: dict[str, list[float]] = {n: [] for n in setups}
        for _ in range(args.rounds):
            for name in setups:
                step(name)  # warm
                times[name].append(statistics.median(step(name) for _ in range(args.steps)))
        h, f = (statistics.median(times[n]) * 1e3 for n in setups)
        print(f"| {batch} | {h:.1f} | {f:.1f} | {f / h:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-memory", default="4GiB")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    speed(args) if args.speed else memory(args)


if __name__ == "__main__":
    main()
