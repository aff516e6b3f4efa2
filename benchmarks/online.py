"""Online serving, measured the way users meet it: vLLM's own benchmark client (`vllm bench serve`) against
`kvpage serve` and `vllm serve`, same weights, same requests, in one run.

    python benchmarks/online.py --vllm-python /root/peers/vllm/bin/python --vllm-model /root/peers/smollm2-hf \\
        [--rates 10 inf] [--modes sampled greedy] [--rounds 2] [--num-prompts 200] [--engines kvpage vllm] \
        [--max-concurrency 16]

Requests: the client's random dataset, 256 prompt / 128 output tokens, EOS ignored; a new seed for every
measurement, the same for both engines, so no run finds its prompts in a prefix cache. "sampled" sends no
temperature (each server's default applies: 1.0 for both, as the OpenAI API); "greedy" sends temperature 0.
Both servers get the same KV memory (--kv-gib: vLLM's VLLM_CPU_KVCACHE_SPACE, kvpage's --kv-cache-memory; with
a float32 cache, as on AVX2-only machines, kvpage's 2 GiB default holds 121 of the 200 requests at full length).
Both servers stay up for the whole run (each idles while the other is measured); the engines alternate
within each round, and medians over the rounds are reported with their ratio. The client runs in vLLM's
Python (../shared/peers/vllm_cli.py wraps its CLI); a peer that is not installed is skipped, never estimated.
Each kvpage measurement also reports where its server's CPU went (per thread, from /proc): the event loop that
serves HTTP against the engine's threads. The summary gives the machine's memory read rate before the servers
start and after they stop: both engines' figures move with it from one hour to the next.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model, memory_read_gbps

ROOT = Path(__file__).resolve().parent.parent
VLLM_CLI = ROOT.parent / "shared" / "peers" / "vllm_cli.py"
NAME = "SmolLM2-135M-Instruct"
METRICS = {"output_throughput": "output tok/s", "mean_tpot_ms": "TPOT mean ms", "median_ttft_ms": "TTFT p50 ms",
           "p99_ttft_ms": "TTFT p99 ms"}


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server on :{port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"server on :{port} not healthy after {timeout:g} s")


def launch(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A server process writing to ``log`` (the child keeps the file open; this process closes its copy)."""
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


def start_servers(args: argparse.Namespace, logdir: Path) -> dict[str, tuple[int, subprocess.Popen]]:
    servers = {}
    if "kvpage" in args.engines:
        cmd = [sys.executable, "-m", "kvpage.entrypoints.cli", "serve", "--port", "8000",
               "--served-model-name", NAME, "--kv-cache-memory", f"{args.kv_gib}GiB", *args.kvpage_args.split()]
        servers["kvpage"] = (8000, launch(cmd, logdir / "kvpage.log"))
    if "vllm" in args.engines:
        if not (args.vllm_python and args.vllm_model):
            print("vllm: skipped (not installed: give --vllm-python and --vllm-model)")
        else:
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib), "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                   "VLLM_CACHE_ROOT": str(logdir / "vllm-cache")}
            cmd = [args.vllm_python, str(VLLM_CLI), "serve", args.vllm_model, "--served-model-name", NAME,
                   "--port", "8001", "--dtype", args.vllm_dtype, "--max-model-len", "2048"]
            servers["vllm"] = (8001, launch(cmd, logdir / "vllm.log", env))
    for port, proc in servers.values():
        wait_healthy(port, proc)
    return servers


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) each thread of a process has used so far, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def cpu_split(pid: int, before: dict[int, float], wall: float) -> str:
    """Where kvpage's server spent the run's CPU: its main thread (the event loop: HTTP, SSE, the output queues)
    against its other threads (the engine thread and its OpenMP workers)."""
    used = {t: c - before.get(t, 0.0) for t, c in thread_cpu(pid).items()}
    loop = used.get(pid, 0.0)
    others = sorted((c for t, c in used.items() if t != pid and c > 0.05), reverse=True)
    return (f"server CPU over {wall:.1f} s: event loop {loop:.2f} s, other threads "
            + ", ".join(f"{c:.2f}" for c in others) + " s")


def bench(args: argparse.Namespace, port: int, rate: str, mode: str, out: Path, seed: int) -> dict:
    cmd = [args.vllm_python or sys.executable, str(VLLM_CLI), "bench", "serve", "--backend", "openai",
           "--base-url", f"http://127.0.0.1:{port}", "--model", NAME, "--tokenizer", args.vllm_model,
           "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "128",
           "--num-prompts", str(args.num_prompts), "--request-rate", rate, "--ignore-eos", "--seed", str(seed),
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm"]
    if mode == "greedy":
        cmd += ["--temperature", "0"]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=["kvpage", "vllm"], choices=["kvpage", "vllm"])
    ap.add_argument("--rates", nargs="+", default=["10", "inf"])
    ap.add_argument("--modes", nargs="+", default=["sampled", "greedy"], choices=["sampled", "greedy"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--max-concurrency", type=int, default=0,
                    help="at most this many requests in flight (the client's --max-concurrency: a moderately loaded "
                         "server); 0: no limit")
    ap.add_argument("--vllm-python", default=os.environ.get("KVPAGE_VLLM_PYTHON"))
    ap.add_argument("--vllm-model", default=os.environ.get("KVPAGE_VLLM_MODEL"),
                    help="the converted HF directory (also the client's tokenizer)")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--kv-gib", type=int, default=4, help="KV memory of each server, GiB")
    ap.add_argument("--kvpage-args", default="", help="extra `kvpage serve` arguments")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    if not args.vllm_python or not args.vllm_model:
        raise SystemExit("the client is vLLM's: give --vllm-python and --vllm-model (see ../shared/PEERS.md)")
    logdir = Path(tempfile.mkdtemp(prefix="kvpage-online-"))
    memory = [memory_read_gbps()]  # before the servers start and after they stop: the hour's memory speed
    servers = start_servers(args, logdir)
    results: dict[tuple[str, str, str], list[dict]] = {}
    try:
        seed = 100
        for r in range(args.rounds):
            for rate in args.rates:
                for mode in args.modes:
                    seed += 1  # new prompts for every measurement (no prefix-cache hits from an earlier one) ...
                    for eng in (list(servers) if r % 2 == 0 else list(reversed(servers))):  # ... the same for both
                        pid = servers[eng][1].pid
                        before, t0 = (thread_cpu(pid), time.time()) if eng == "kvpage" else ({}, 0.0)
                        res = bench(args, servers[eng][0], rate, mode, logdir / f"{eng}-{rate}-{mode}-{r}.json", seed)
                        results.setdefault((eng, rate, mode), []).append(res)
                        split = f"; {cpu_split(pid, before, time.time() - t0)}" if eng == "kvpage" else ""
                        print(f"round {r + 1} {eng:<7} rate {rate:>4} {mode:<8} " + ", ".join(
                            f"{label} {res[key]:.1f}" for key, label in METRICS.items()) + split, flush=True)
    finally:
        for _, proc in servers.values():
            proc.terminate()
        for _, proc in servers.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    memory.append(memory_read_gbps())
    limit = f", at most {args.max_concurrency} in flight" if args.max_concurrency else ""
    print(f"\nmachine: {cpu_model()}, {os.cpu_count()} cores; {NAME}; vllm bench serve, random 256/128, "
          f"{args.num_prompts} prompts, ignore_eos{limit}; medians of {args.rounds} rounds; memory read "
          f"{memory[0]:.1f} GB/s before, {memory[1]:.1f} after (a float32 sum over 1 GiB)")
    print("| rate | requests | engine | " + " | ".join(METRICS.values()) + " |")
    print("|---" * (3 + len(METRICS)) + "|")
    table = {}
    for rate in args.rates:
        for mode in args.modes:
            for eng in servers:
                runs = results.get((eng, rate, mode), [])
                med = {k: statistics.median(x[k] for x in runs) for k in METRICS} if runs else {}
                table[f"{eng} {rate} {mode}"] = med
                print(f"| {rate} | {mode} | {eng} | " + " | ".join(f"{med[k]:.1f}" for k in METRICS) + " |")
            if "kvpage" in servers and "vllm" in servers:
                a, b = table[f"kvpage {rate} {mode}"], table[f"vllm {rate} {mode}"]
                print(f"| {rate} | {mode} | kvpage / vLLM | {a['output_throughput'] / b['output_throughput']:.2f}x | "
                      f"{a['mean_tpot_ms'] / b['mean_tpot_ms']:.2f}x | | |")
    if args.json_out:
        runs = {" ".join(k): [{m: x[m] for m in METRICS} for x in v] for k, v in results.items()}
        args.json_out.write_text(json.dumps({"machine": cpu_model(), "memory_read_gbps": memory, "medians": table,
                                             "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
