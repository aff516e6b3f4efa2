"""Online serving benchmark: Poisson arrivals against a running `kvpage serve` (or any OpenAI-compatible server).

Each request streams a completion for a ShareGPT-like prompt (random token ids; prompt and output lengths
lognormal, medians --prompt-median / --output-median, capped), EOS ignored so every request produces exactly
its output length. Reported: time to first token and inter-token latency p50/p99 (from the arrival time of
each streamed chunk), end-to-end latency, request and output-token throughput.

    python benchmarks/serve.py --launch --rate 4 --num-requests 100        # starts kvpage serve itself
    python benchmarks/serve.py --port 8000 --rate 2 --num-requests 50      # against a server already up

Plain asyncio sockets: no client library in the measurement path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field


@dataclass
class Result:
    prompt_len: int
    output_len: int
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


def workload(n: int, seed: int, prompt_median: int, output_median: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        p = min(1024, max(4, int(math.exp(rng.gauss(math.log(prompt_median), 0.8)))))
        o = min(512, max(4, int(math.exp(rng.gauss(math.log(output_median), 0.8)))))
        reqs.append(([rng.randrange(100, vocab) for _ in range(p)], o))
    return reqs


async def one(host: str, port: int, model: str, key: str | None, prompt: list[int], max_tokens: int,
              res: Result) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    res.start = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        status = (await reader.readline()).decode()
        if " 200 " not in status:
            res.error = status.strip()
            writer.close()
            return
        while True:
            line = await reader.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                res.chunk_times.append(time.perf_counter())
                res.tokens += 1
        writer.close()
    except OSError as e:
        res.error = f"{type(e).__name__}: {e}"


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


async def run(args: argparse.Namespace, model: str, vocab: int) -> list[Result]:
    reqs = workload(args.num_requests, args.seed, args.prompt_median, args.output_median, vocab)
    rng = random.Random(args.seed + 1)
    results = [Result(len(p), o) for p, o in reqs]
    tasks = []
    for (prompt, out), res in zip(reqs, results, strict=True):
        tasks.append(asyncio.create_task(one(args.host, args.port, model, args.api_key, prompt, out, res)))
        await asyncio.sleep(rng.expovariate(args.rate))
    await asyncio.gather(*tasks)
    return results


def get_json(url: str, key: str | None) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key")
    ap.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second (Poisson)")
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--prompt-median", type=int, default=160)
    ap.add_argument("--output-median", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=32000, help="prompt token ids are drawn below this")
    ap.add_argument("--launch", action="store_true", help="start `kvpage serve` on --port first (extra flags "
                                                          "after --)")
    ap.add_argument("server_args", nargs="*", help="flags for the launched server, after --")
    args = ap.parse_args()
    if args.rate <= 0 or args.num_requests < 1:
        raise SystemExit("--rate must be > 0 and --num-requests >= 1")
    proc = None
    if args.launch:
        proc = subprocess.Popen([sys.executable, "-m", "kvpage.entrypoints.cli", "serve", "--port", str(args.port),
                                 *(["--api-key", args.api_key] if args.api_key else []), *args.server_args])
    try:
        base = f"http://{args.host}:{args.port}"
        deadline = time.time() + 180
        while True:
            try:
                models = get_json(f"{base}/v1/models", args.api_key)
                break
            except OSError:
                if time.time() > deadline or (proc is not None and proc.poll() is not None):
                    raise SystemExit(f"no server at {base}") from None
                time.sleep(0.3)
        model = models["data"][0]["id"]
        vocab = args.vocab_size
        t0 = time.perf_counter()
        results = asyncio.run(run(args, model, vocab))
        wall = time.perf_counter() - t0
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    ok = [r for r in results if r.error is None and r.chunk_times]
    ttft = [(r.chunk_times[0] - r.start) * 1e3 for r in ok]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    e2e = [(r.chunk_times[-1] - r.start) for r in ok]
    tokens = sum(r.tokens for r in ok)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; model {model}; rate {args.rate}/s, "
          f"{args.num_requests} requests, prompt/output medians {args.prompt_median}/{args.output_median}")
    print(f"completed {len(ok)}/{len(results)} ({len(results) - len(ok)} failed) in {wall:.1f} s: "
          f"{len(ok) / wall:.2f} req/s, {tokens / wall:.1f} output tok/s")
    print(f"TTFT ms      p50 {pct(ttft, 50):8.1f}   p99 {pct(ttft, 99):8.1f}   mean {statistics.fmean(ttft):8.1f}")
    print(f"ITL ms       p50 {pct(itl, 50):8.1f}   p99 {pct(itl, 99):8.1f}   mean {statistics.fmean(itl):8.1f}")
    print(f"E2E s        p50 {pct(e2e, 50):8.2f}   p99 {pct(e2e, 99):8.2f}")
    errors = {r.error for r in results if r.error}
    if errors:
        print("errors:", "; ".join(sorted(errors))[:500])


if __name__ == "__main__":
    main()
