"""What tensor parallelism costs here: time per decode step at 1 to N ranks (processes on this host, gloo over
loopback), split into rank 0's compute and its all-reduces (the wait for the slowest rank included), with the
all-reduce count and bytes per step.

    python benchmarks/tp.py [--model SmolLM2-135M-Instruct] [--sizes 1 3] [--seqs 32] [--steps 24]
    python benchmarks/tp.py --model gemma-3-270m --sizes 1 2

SmolLM2's 9 query heads split over 1, 3 or 9 ranks only (2 is refused, as vLLM refuses it); Gemma 3's 4 over
1, 2 or 4.

On a 2-core machine more ranks cannot be faster: every rank gets the cores divided, and each layer adds two
all-reduces. Every size runs the plain path (tensor-parallel ranks do not use the fast path); the one-rank
fast path is printed for reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _common import cpu_model
from kvpage.engine.llm import LLM
from kvpage.sampling_params import SamplingParams


def measure(model: str, size: int, dtype: str, seqs: int, steps: int, prompt_len: int) -> dict:
    with LLM(model, dtype=dtype, tensor_parallel_size=size, kv_cache_memory="512MiB", max_model_len=512,
             max_num_seqs=seqs) as llm:
        engine = llm.engine
        comm = engine.worker.comm
        params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
        for i in range(seqs):
            engine.add_request(f"r{i}", {"prompt_token_ids": [(7 * i + j) % 4000 + 100 for j in range(prompt_len)]},
                               params)
        while engine.num_generated_tokens < seqs:  # every prompt done (its first token drawn)
            engine.step()
        times, comm_s, calls, nbytes = [], [], [], []
        for _ in range(steps):
            comm.reset()
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
            comm_s.append(comm.seconds)
            calls.append(comm.calls)
            nbytes.append(comm.bytes)
        while engine.has_unfinished_requests():
            engine.step()
    step = statistics.median(times)
    allreduce = statistics.median(comm_s)
    return {"ranks": size, "step_ms": step * 1e3, "compute_ms": (step - allreduce) * 1e3,
            "allreduce_ms": allreduce * 1e3, "allreduces_per_step": statistics.median(calls),
            "allreduce_bytes_per_step": statistics.median(nbytes),
            "bytes_per_allreduce": statistics.median(nbytes) / max(1, statistics.median(calls))}


def _link_rank(rank: int, size: int, port: int, sizes: list[int], out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    res = {}
    for n in sizes:
        x = torch.ones(n // 4)
        for _ in range(3):
            dist.all_reduce(x)
        ts = []
        for _ in range(15):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            ts.append(time.perf_counter() - t)
        res[n] = statistics.median(ts)
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def measure_link(size: int) -> dict[int, float]:
    """gloo all-reduce time over loopback at several buffer sizes, ranks alone (no model running)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    sizes = [4096, 65536, 1 << 20, 8 << 20]
    procs = [ctx.Process(target=_link_rank, args=(r, size, port, sizes, q)) for r in range(size)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join()
    return res


def fit_link(size: int, res: dict[int, float]) -> tuple[float, float]:
    """(bytes/s, seconds per hop) of the ring model 2(N-1) hops + 2(N-1)/N bytes / bandwidth: latency from the
    fastest buffer of at most 64 KiB (small ones are all latency), bandwidth from there to the largest."""
    small = min((n for n in res if n <= 65536), key=lambda n: res[n])
    large = max(res)
    hops, share = 2 * (size - 1), 2 * (size - 1) / size
    bandwidth = share * (large - small) / max(res[large] - res[small], 1e-9)
    latency = max(0.0, (res[small] - share * small / bandwidth) / hops)
    return bandwidth, latency


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--seqs", type=int, default=32, help="sequences decoding together")
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--dtype", default="float32", help="float32 (the plain path at every size) or bfloat16")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    print(f"machine: {cpu_model()}; {args.model} {args.dtype}, {args.seqs} sequences x {args.prompt_len}-token "
          f"prompts, median of {args.steps} decode steps")
    rows = [measure(args.model, s, args.dtype, args.seqs, args.steps, args.prompt_len) for s in args.sizes]
    print(f"{'ranks':>5} {'step ms':>8} {'compute':>8} {'all-red.':>8} {'calls':>6} {'bytes/step':>11} {'B/call':>7}")
    for r in rows:
        print(f"{r['ranks']:>5} {r['step_ms']:8.1f} {r['compute_ms']:8.1f} {r['allreduce_ms']:8.1f} "
              f"{r['allreduces_per_step']:6.0f} {r['allreduce_bytes_per_step']:11.0f} {r['bytes_per_allreduce']:7.0f}")
    if args.dtype != "auto":
        ref = measure(args.model, 1, "auto", args.seqs, args.steps, args.prompt_len)
        print(f"one rank on the fast path (dtype auto): {ref['step_ms']:.1f} ms per step")
        rows.append({**ref, "fast_path": True})
    links = {}
    for size in sorted({s for s in args.sizes if s > 1}):
        res = measure_link(size)
        bw, lat = fit_link(size, res)
        links[size] = {"seconds_by_bytes": res, "bandwidth_gb_s": bw / 1e9, "latency_us": lat * 1e6}
        print(f"gloo all-reduce alone, {size} ranks: " + ", ".join(f"{n // 1024} KiB {t * 1e3:.2f} ms"
                                                                   for n, t in res.items())
              + f"; ring fit {bw / 1e9:.2f} GB/s, {lat * 1e6:.0f} us per hop")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "links": links}, f, indent=2)


if __name__ == "__main__":
    main()
