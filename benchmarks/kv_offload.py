"""KV tiers below the pool, measured through `kvpage serve`: 20 rotating system prompts of 1,000 tokens over a
device pool that holds only 4 of them, with no tier, the host tier, the disk tier, and the disk tier after a
restart of the server.

    python benchmarks/kv_offload.py [--prompts 20] [--prompt-tokens 1000] [--rotations 2] [--model M]

Each request is a system prompt (request k uses prompt k mod 20) followed by its own 24-token question, sent
one at a time as a streaming completion (max_tokens 8, temperature 0), as a chat client does; TTFT is measured
at the client (first streamed token). One warm-up rotation fills the tiers, then ``--rotations`` rotations are
measured: prefix hit rate = cached prompt tokens (``usage.prompt_tokens_details.cached_tokens``) / prompt
tokens over the measured requests. The restart case stops the disk-tier server and starts a new one on the
same directory, then measures one rotation with no warm-up (every prefix comes from disk). Figures are medians.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model, median_seconds
from online import launch, wait_healthy

PORT = 8010


def block_bytes(model: str, dtype: str) -> int:
    from kvpage.model.registry import load_model_config

    cfg = load_model_config(model)
    width = 2 if dtype in ("bfloat16", "auto") else 4
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * width * 16


def request(prompt: list[int]) -> tuple[float, int, int]:
    """(TTFT seconds, cached tokens, prompt tokens) of one streamed completion."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    usage = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return ttft or float("nan"), cached, usage["prompt_tokens"]


def serve(args, extra: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvpage.entrypoints.cli", "serve", "--port", str(PORT), "--served-model-name", "m",
           "--model", args.model, "--max-model-len", "2048", "--kv-cache-memory", f"{args.pool_bytes}B", *extra]
    proc = launch(cmd, log)
    wait_healthy(PORT, proc)
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def measure(requests: list[list[int]]) -> dict:
    rows = [request(p) for p in requests]
    ttfts = [r[0] for r in rows]
    return {"ttft_p50_ms": 1000 * statistics.median(ttfts), "ttft_mean_ms": 1000 * statistics.mean(ttfts),
            "hit_rate": sum(r[1] for r in rows) / sum(r[2] for r in rows), "requests": len(rows)}


def copy_costs(model: str, blocks: int = 63, reps: int = 9) -> dict[str, float]:
    """Milliseconds to move one prompt's blocks (63 = a 1,000-token prompt) between the pool and the tiers, as
    the worker does inside a step: device -> host, host -> device, device -> bytes for the disk writer, bytes ->
    device (in the same process as a server's step, so run it when nothing else is)."""
    import torch

    from kvpage.model.registry import load_model_config
    from kvpage.worker.kv_cache import KVCache

    cfg = load_model_config(model)
    cache = KVCache(cfg, 4 * blocks, 16, torch.bfloat16, num_host_blocks=2 * blocks)
    for t in cache.tensors + cache.host_tensors:
        t.normal_()
    dev = list(range(blocks, 2 * blocks))
    pairs = list(zip(dev, range(blocks), strict=True))
    payloads = cache.read_blocks(dev)
    ops = {"device -> host": lambda: cache.swap_out(pairs),
           "host -> device": lambda: cache.swap_in([(h, d) for d, h in pairs]),
           "device -> bytes (disk writer)": lambda: cache.read_blocks(dev),
           "bytes -> device (disk load)": lambda: cache.write_blocks(list(zip(payloads, dev, strict=True)))}
    return {name: 1000 * median_seconds(fn, reps) for name, fn in ops.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--pool-prompts", type=int, default=4, help="system prompts the device pool holds")
    p.add_argument("--rotations", type=int, default=2)
    p.add_argument("--cases", nargs="+", default=["none", "host", "disk", "restart"])
    p.add_argument("--json", type=Path)
    p.add_argument("--copies-only", action="store_true", help="only the block copy costs")
    args = p.parse_args()
    nbytes = block_bytes(args.model, "auto") * 63
    copies = copy_costs(args.model)
    print(f"moving 63 blocks ({nbytes / 2**20:.1f} MiB, bf16):",
          ", ".join(f"{k} {v:.2f} ms" for k, v in copies.items()), flush=True)
    if args.copies_only:
        return
    rng = random.Random(0)
    bb = block_bytes(args.model, "auto")
    blocks_per_prompt = -(-(args.prompt_tokens + 24 + 8) // 16)
    args.pool_bytes = args.pool_prompts * blocks_per_prompt * bb
    systems = [[rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]

    def rotation(k0: int) -> list[list[int]]:
        return [systems[i] + [rng.randrange(1000, 40000) for _ in range(24)] for i in range(args.prompts)]

    offload = f"{args.prompts * blocks_per_prompt * bb * 5 // 4}B"
    work = Path(tempfile.mkdtemp(prefix="kvpage-offload-"))
    cases = {"none": [], "host": ["--kv-offload-memory", offload],
             "disk": ["--kv-offload-dir", str(work / "disk"), "--kv-offload-disk", offload]}
    print(f"{cpu_model()}; {args.model}; pool {args.pool_bytes / 2**20:.0f} MiB = {args.pool_prompts} prompts of "
          f"{blocks_per_prompt} blocks; {args.prompts} system prompts x {args.prompt_tokens} tokens; "
          f"{args.rotations} measured rotations", flush=True)
    results = {}
    try:
        for case in [c for c in ("none", "host", "disk") if c in args.cases]:
            proc = serve(args, cases[case], work / f"{case}.log")
            try:
                for warm in rotation(0):
                    request(warm)
                reqs = [r for k in range(args.rotations) for r in rotation(k)]
                results[case] = measure(reqs)
            finally:
                stop(proc)
            print(f"{case:8s} {results[case]}", flush=True)
        if "restart" in args.cases and "disk" in args.cases:
            proc = serve(args, cases["disk"], work / "restart.log")
            try:
                results["restart"] = measure(rotation(0))
            finally:
                stop(proc)
            print(f"{'restart':8s} {results['restart']}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = results.get("none", {}).get("ttft_p50_ms")
    print("\n| tier | prefix hit rate | TTFT p50 ms | TTFT mean ms | vs no tier |")
    print("|---|---|---|---|---|")
    for case, r in results.items():
        ratio = f"{base / r['ttft_p50_ms']:.1f}x lower" if base and case != "none" else ""
        print(f"| {case} | {100 * r['hit_rate']:.1f}% | {r['ttft_p50_ms']:.1f} | {r['ttft_mean_ms']:.1f} | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_model(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
