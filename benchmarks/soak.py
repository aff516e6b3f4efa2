"""Soak test of `kvpage serve`: minutes of mixed traffic from careful and careless clients at a bounded rate.

    python benchmarks/soak.py [--duration 300] [--rate 4] [--concurrency 48] [--url http://127.0.0.1:8000]
                              [--serve-args "--max-queue 64"] [--pauses] [--json-out soak.json]

Without --url it starts its own server (default model, --kv-cache-memory 256MiB, --max-model-len 1024). The
traffic: streamed and plain completions and chats, sampled and greedy, n > 1, clients that disconnect
mid-stream, malformed and hostile bodies, prompts over the context length, degenerate sampling settings,
scoring requests (echo, logprobs, prompt_logprobs), beam search, stop strings and ids, allowed tokens, bad
words, structured outputs (JSON, choices, regexes), forced tool calls, prompt truncation and cache salts,
/v1/responses turns (streamed, in the background, continuing stored ones with previous_response_id), Conversations
API calls (conversations created, edited, listed, deleted and continued by responses), Anthropic
Messages API turns (/v1/messages: streamed or not, forced tool use, stop sequences), and /tokenize calls, as
Poisson arrivals (chats, messages and responses are expected to be refused by name when the model has no chat
template).
It reports requests by kind and outcome (a 5xx, a timeout or a broken stream is a failure), the KV blocks still in
use once the server is idle (must be 0), and the server's memory growth (resident set size after warm-up, as the
traffic ends, and idle 3 s later, once the server has handed freed heap back).
--serve-args "--model gemma-3-270m" soaks another model. --pauses adds an operator who, every 5-15 s, pauses
generation (POST /pause, mode abort, wait or keep at random) for 0.5-3 s and resumes it: every request must still
end (an aborted one with finish reason "abort"), none may hang, and the pool must still empty.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model

TIMEOUT = 120.0
CHAT_PATHS = ("/v1/chat/completions", "/v1/messages", "/v1/responses")  # refused by name without a chat template
WORDS = ["paged", "memory", "block", "table", "cache", "prefix", "request", "token", "decode", "schedule", "pool",
         "share", "fork", "copy", "write", "river", "mountain", "story", "lighthouse", "winter", "market", "garden",
         "kernel", "vector"]


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 20}}, "required": ["q"]}}},
         {"type": "function", "function": {"name": "now"}}]


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


BAD_BODIES = [
    '{"prompt": ' + "[" * 3000 + "]" * 3000 + "}",
    '{"prompt": "hi", "max_tokens": ' + "9" * 3000 + "}",
    '{"prompt": "hi", "temperature": NaN}',
    '{"prompt": "hi", "top_p": Infinity}',
    '{"prompt": "\\ud800 lone surrogate"}',
    '{"messages": [{"role": "user", "content": "\\udfff"}]}',
    '{"prompt": "hi", "response_format": {"type": "json_schema"}}',
    '{"prompt": "hi", "guided_regex": "(("}',
    '{"prompt": "hi", "tools": [{"type": "function"}]}',
    '{"prompt": "hi", "max_tokens": "many"}',
    '{"prompt": [1, 2, -5]}',
    '{"prompt": "hi", "n": 1000}',
    '{"prompt": "hi", "logit_bias": {"abc": 1}}',
    "{not json",
    "[1, 2, 3]",
    '{"messages": []}',
]


class Soak:
    def __init__(self, host: str, port: int, key: str | None, rng: random.Random, max_len: int) -> None:
        self.host, self.port, self.key, self.rng, self.max_len = host, port, key, rng, max_len
        self.outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.failures: list[str] = []
        self.rss: list[tuple[float, float | None]] = []  # (seconds into the run, server RSS in MiB)
        self.chats = True  # False: the model has no chat template, and the server refuses chats by name
        self.responses: collections.deque[str] = collections.deque(maxlen=32)  # stored ids a next turn may continue
        self.conversations: collections.deque[str] = collections.deque(maxlen=8)  # Conversations API ids
        self.pauses = False  # an operator pauses and resumes generation now and then (operate())

    async def http(self, path: str, body: str | bytes, read_limit: int | None = None,
                   progress: list[float] | None = None, method: str = "POST") -> tuple[int, bytes]:
        """POST with Connection: close; the status and the whole body (or its first ``read_limit`` bytes, then
        the connection is dropped, as a client that goes away). ``progress`` gets [bytes read, time of the last
        read] as they come, so a timeout can tell a slow answer from a silent one."""
        data = body.encode() if isinstance(body, str) else body
        reader, writer = await asyncio.open_connection(self.host, self.port)
        auth = f"Authorization: Bearer {self.key}\r\n" if self.key else ""
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n{auth}"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()
        got = b""
        try:
            while chunk := await reader.read(65536):
                got += chunk
                if progress is not None:
                    progress[:] = [len(got), time.monotonic()]
                if read_limit is not None and got.count(b"data: ") >= read_limit:
                    break
        finally:
            writer.close()
        status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else 0
        return status, got

    def conversation_call(self, rng: random.Random, sampling: dict) -> tuple[str, str, dict | str, set[int]]:
        """One Conversations API call: a new conversation (sometimes with items), items added or listed, a
        deletion, or most often a /v1/responses turn that continues one (a 404 if another client deleted it, a
        400 once the conversation outgrows the context: responses here do not truncate)."""
        say = {"type": "message", "role": "user", "content": text(rng, rng.randint(3, 40))}
        cid = rng.choice(self.conversations) if self.conversations else None
        pick = rng.random()
        if cid is None or pick < 0.15:
            return "POST", "/v1/conversations", {"items": [say] if rng.random() < 0.5 else [],
                                                 "metadata": {"soak": "yes"}}, {200}
        if pick < 0.25:
            return "POST", f"/v1/conversations/{cid}/items", {"items": [say]}, {200, 404}
        if pick < 0.3:
            return "GET", f"/v1/conversations/{cid}/items?limit=5", "", {200, 404}
        if pick < 0.35:
            self.conversations.remove(cid)
            return "DELETE", f"/v1/conversations/{cid}", "", {200, 404}
        return "POST", "/v1/responses", {"input": say["content"], "conversation": cid, "stream": rng.random() < 0.4,
                                         "max_output_tokens": rng.randint(8, 48), **sampling}, {200, 400, 404}

    async def one(self) -> None:
        rng = self.rng
        kind = rng.choices(["stream", "chat", "n>1", "disconnect", "bad", "too-long", "degenerate", "tokenize",
                            "scoring", "shaped", "responses", "messages", "conversation"],
                           [25, 20, 10, 10, 15, 5, 10, 5, 10, 10, 8, 6, 6])[0]
        sampled = rng.random() < 0.7
        sampling = {} if sampled else {"temperature": 0}
        path, body, expect, limit = "/v1/completions", None, {200}, None
        method = "POST"
        if kind == "stream":
            body = {"prompt": text(rng, rng.randint(5, 200)), "max_tokens": rng.randint(8, 128), "stream": True,
                    **sampling}
        elif kind == "chat":
            path = "/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": text(rng, rng.randint(3, 60))}],
                    "max_tokens": rng.randint(8, 96), "stream": rng.random() < 0.5, **sampling}
            if rng.random() < 0.3:  # tool calls: forced ones, held to the tools' schemas ("auto" needs a parser)
                body.update(tools=TOOLS, parallel_tool_calls=rng.random() < 0.5, tool_choice=rng.choice(
                    [{"type": "function", "function": {"name": "lookup"}}, "required", "none"]))
        elif kind == "responses":  # OpenAI's Responses API: turns that continue stored ones, background runs
            path = "/v1/responses"
            body = {"input": text(rng, rng.randint(3, 60)), "max_output_tokens": rng.randint(8, 64),
                    "stream": rng.random() < 0.4, "background": rng.random() < 0.2, **sampling}
            if self.responses and rng.random() < 0.5:
                body["previous_response_id"] = rng.choice(self.responses)
        elif kind == "conversation":  # OpenAI's Conversations API: created, edited, continued, deleted
            method, path, body, expect = self.conversation_call(rng, sampling)
        elif kind == "messages":  # Anthropic's Messages API: text turns, forced tool use, stop sequences
            path = "/v1/messages"
            body = {"messages": [{"role": "user", "content": text(rng, rng.randint(3, 60))}],
                    "max_tokens": rng.randint(8, 64), "stream": rng.random() < 0.5, **sampling}
            if rng.random() < 0.3:
                body.update(tools=[{"name": "lookup", "input_schema": TOOLS[0]["function"]["parameters"]}],
                            tool_choice=rng.choice([{"type": "tool", "name": "lookup"}, {"type": "any"},
                                                    {"type": "none"}]))
            elif rng.random() < 0.3:
                body["stop_sequences"] = rng.sample(WORDS, 2)
        elif kind == "n>1":
            body = {"prompt": text(rng, rng.randint(5, 80)), "max_tokens": rng.randint(8, 48), "stream": True,
                    "n": rng.randint(2, 4), "seed": rng.randint(0, 1000)}
        elif kind == "disconnect":
            body = {"prompt": text(rng, rng.randint(5, 120)), "max_tokens": 400, "ignore_eos": True,
                    "stream": True, **sampling}
            limit = rng.randint(1, 30)
        elif kind == "bad":
            path = rng.choice(["/v1/completions", "/v1/chat/completions"])
            body, expect = rng.choice(BAD_BODIES), {400, 404, 413, 422}
        elif kind == "too-long":
            body, expect = {"prompt": text(rng, self.max_len + 50), "max_tokens": 8}, {400}  # context_length_exceeded
        elif kind == "degenerate":
            body = {"prompt": text(rng, rng.randint(3, 40)), "max_tokens": rng.randint(4, 32),
                    **rng.choice([{"top_p": 1e-300}, {"temperature": 1e-300}, {"repetition_penalty": 1e-300},
                                  {"repetition_penalty": 1e300}, {"min_p": 1.0}, {"temperature": 1e30},
                                  {"presence_penalty": -2, "frequency_penalty": 2, "temperature": 3e-5},
                                  {"logit_bias": {"2": 100}, "min_tokens": 4}])}
        elif kind == "scoring":  # what evaluation harnesses send: echoed prompts with their logprobs
            prompt = text(rng, rng.randint(2, 300))
            body = rng.choice([
                {"prompt": prompt, "echo": True, "logprobs": rng.randint(0, 5), "max_tokens": rng.choice([0, 1])},
                {"prompt": prompt, "prompt_logprobs": rng.randint(0, 20), "max_tokens": rng.randint(1, 8),
                 "n": rng.randint(1, 3), **sampling},
                {"prompt": prompt, "echo": True, "max_tokens": 0, "stream": True, "logprobs": 1},
                {"prompt": prompt, "logprobs": rng.randint(0, 20), "max_tokens": rng.randint(1, 16), "stream": True,
                 **sampling},
            ])
            if rng.random() < 0.3:
                path = "/v1/chat/completions"
                body = {"messages": [{"role": "user", "content": prompt}], "logprobs": True,
                        "top_logprobs": rng.randint(0, 20), "max_tokens": rng.randint(1, 16),
                        "prompt_logprobs": rng.choice([None, 2]), **sampling}
        elif kind == "shaped":  # settings that change how a request runs: beams, stops, masks, truncation
            prompt = text(rng, rng.randint(3, 120))
            body = {"prompt": prompt, "max_tokens": rng.randint(4, 48), **rng.choice([
                {"use_beam_search": True, "n": rng.randint(1, 3), "best_of": 4, "temperature": 0,
                 "length_penalty": rng.choice([0.5, 1.0, 2.0])},
                {"stop": rng.sample(WORDS, 3), "include_stop_str_in_output": rng.random() < 0.5, "stream": True},
                {"stop_token_ids": [rng.randint(0, 2000) for _ in range(4)], "min_tokens": 2},
                {"allowed_token_ids": [rng.randint(0, 40000) for _ in range(rng.randint(1, 6))]},
                {"truncate_prompt_tokens": rng.choice([-1, 1, 16])},
                {"cache_salt": rng.choice(["a", "b"]), "n": 2, "seed": 7},
                {"best_of": rng.randint(2, 4), "n": rng.randint(1, 2)},  # the n best of best_of samples
                {"bad_words": rng.sample(WORDS, 2), "stream": rng.random() < 0.5},
                rng.choice([{"response_format": {"type": "json_object"}}, {"guided_choice": rng.sample(WORDS, 3)},
                            {"guided_regex": "[a-z]{1,8}( [a-z]{1,8}){2,6}", "n": 2, "stream": True},
                            {"guided_json": {"type": "object", "properties": {"n": {"type": "integer"}},
                                             "required": ["n"]}}]),  # structured outputs
            ]), **sampling}
            if rng.random() < 0.1:  # refused by name
                refused = rng.choice([{"best_of": 1, "n": 2}, {"suffix": "."}])
                body, expect = {"prompt": prompt, **refused}, {400}
        else:
            path, body = "/tokenize", {"prompt": text(rng, rng.randint(1, 300))}
        if path in CHAT_PATHS and not isinstance(body, str) and not self.chats:
            expect = {400, *(expect - {200})}
        raw = body if isinstance(body, str) else json.dumps(body)
        progress = [0, time.monotonic()]
        try:
            status, got = await asyncio.wait_for(self.http(path, raw, limit, progress, method), TIMEOUT)
        except TimeoutError:  # still a failure; the outcome says whether the answer was coming or had stopped
            silent = time.monotonic() - progress[1]
            how = "timeout, still answering" if progress[0] and silent < 10 else "timeout, silent"
            self.record(kind, how, f"{kind}: not finished in {TIMEOUT:g} s ({progress[0]} bytes read, the last "
                                   f"{silent:.0f} s ago): {raw[:120]}")
            return
        except OSError as e:
            self.record(kind, "connection error", f"{kind}: {e}")
            return
        if kind == "disconnect":
            self.record(kind, "dropped" if status == 200 else f"http {status}",
                        None if status == 200 else got[-300:].decode("utf-8", "replace"))
            return
        outcome = f"http {status}"
        problem = None
        if status >= 500 or status not in expect:
            problem = f"{kind}: {status} for {raw[:120]}: {got[-300:].decode('utf-8', 'replace')}"
        elif status == 200 and path == "/v1/responses":
            if b"text/event-stream" in got[:400]:
                last = got.rstrip().rsplit(b"event: ", 1)[-1]
                if not last.startswith((b"response.completed", b"response.incomplete")):
                    outcome, problem = "stream not completed", f"{kind}: {got[-300:]!r}"
            else:
                doc = json.loads(got.split(b"\r\n\r\n", 1)[1])
                if doc.get("status") == "completed" and not doc.get("background"):  # a turn to continue
                    self.responses.append(doc["id"])
        elif status == 200 and path == "/v1/conversations":
            self.conversations.append(json.loads(got.split(b"\r\n\r\n", 1)[1])["id"])
        elif status == 200 and path == "/v1/messages" and b"text/event-stream" in got[:400]:
            if not got.rstrip().rsplit(b"event: ", 1)[-1].startswith(b"message_stop"):
                outcome, problem = "stream not stopped", f"{kind}: {got[-300:]!r}"
        elif status == 200 and b"text/event-stream" in got[:400]:
            if b"data: [DONE]" not in got:
                outcome, problem = "stream without [DONE]", f"{kind}: {got[-300:]!r}"
            elif b'data: {"error"' in got:
                outcome, problem = "stream error event", f"{kind}: {got[-300:]!r}"
        self.record(kind, outcome, problem)

    async def operate(self, end: float) -> None:
        """Pause (a random mode) for 0.5-3 s every 5-15 s until ``end``, then resume; each call must answer 200."""
        while time.monotonic() + 20 < end:
            await asyncio.sleep(self.rng.uniform(5, 15))
            mode = self.rng.choice(["abort", "wait", "keep"])
            for path, hold in ((f"/pause?mode={mode}", self.rng.uniform(0.5, 3.0)), ("/resume", 0.0)):
                try:
                    status, got = await asyncio.wait_for(self.http(path, b""), TIMEOUT)
                except TimeoutError:
                    status, got = 0, b"timeout"
                ok = status == 200
                self.record("pause", f"{path.split('?')[0][1:]} {status}", None if ok else
                            f"{path}: {status} {got[-200:]!r}")
                await asyncio.sleep(hold)

    def record(self, kind: str, outcome: str, problem: str | None) -> None:
        self.outcomes[(kind, outcome)] += 1
        if problem is not None:
            self.failures.append(problem)

    async def run(self, duration: float, rate: float, concurrency: int, pid: int | None = None) -> None:
        gate = asyncio.Semaphore(concurrency)
        start = time.monotonic()
        next_sample = start
        tasks: set[asyncio.Task] = set()

        async def guarded() -> None:
            async with gate:
                await self.one()

        end = time.monotonic() + duration
        operator = asyncio.ensure_future(self.operate(end)) if self.pauses else None
        while time.monotonic() < end:
            task = asyncio.ensure_future(guarded())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(self.rng.expovariate(rate))
            if pid is not None and time.monotonic() >= next_sample:
                self.rss.append((time.monotonic() - start, rss_mib(pid)))
                next_sample += 30.0
        if operator is not None:
            await operator
        if tasks:
            await asyncio.gather(*tasks)


def get(host: str, port: int, path: str) -> str:
    import http.client

    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", path)
    return conn.getresponse().read().decode()


def gauge(host: str, port: int, name: str) -> float:
    m = re.search(rf"^kvpage:{name}\{{[^}}]*\}} ([0-9.e+-]+)$", get(host, port, "/metrics"), re.M)
    return float(m.group(1)) if m else float("nan")


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of traffic (default 300)")
    ap.add_argument("--rate", type=float, default=4.0, help="mean requests per second (default 4)")
    ap.add_argument("--concurrency", type=int, default=48, help="most requests in flight (default 48)")
    ap.add_argument("--url", help="an already running server (default: start one)")
    ap.add_argument("--api-key")
    ap.add_argument("--serve-args", default="--max-queue 64", help="extra `kvpage serve` arguments")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pauses", action="store_true", help="an operator pauses and resumes generation now and then")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    proc = None
    if args.url:
        m = re.match(r"https?://([^:/]+):(\d+)", args.url)
        if not m:
            raise SystemExit(f"--url: cannot read host and port from {args.url!r}")
        host, port = m.group(1), int(m.group(2))
    else:
        host, port = "127.0.0.1", 8517
        cmd = [sys.executable, "-m", "kvpage.entrypoints.cli", "serve", "--port", str(port), "--kv-cache-memory",
               "256MiB", "--max-model-len", str(args.max_model_len), *shlex.split(args.serve_args)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 300
        while True:
            try:
                get(host, port, "/health")
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    why = proc.stderr.read() if proc.stderr else ""
                    raise SystemExit(f"the server did not start: {why}") from None
                time.sleep(0.5)
    pid = proc.pid if proc else None
    soak = Soak(host, port, args.api_key, random.Random(args.seed), args.max_model_len)
    model = json.loads(get(host, port, "/v1/models"))["data"][0]["id"]
    status, got = asyncio.run(soak.http("/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})))
    soak.chats = not (status == 400 and b"no chat template" in got)
    asyncio.run(soak.run(10.0, args.rate, args.concurrency))  # warm-up: allocator and caches settle
    rss0 = rss_mib(pid)
    soak.outcomes.clear()
    t0 = time.time()
    soak.pauses = args.pauses
    asyncio.run(soak.run(args.duration, args.rate, args.concurrency, pid))
    wall = time.time() - t0
    deadline = time.time() + 60
    while time.time() < deadline and (gauge(host, port, "num_requests_running") or gauge(host, port,
                                                                                         "kv_cache_blocks_used")):
        time.sleep(0.5)
    leaked = gauge(host, port, "kv_cache_blocks_used")
    rss_busy = rss_mib(pid)
    time.sleep(3.0)  # the server hands freed heap back after a second of idleness (engine_client.IDLE_TRIM_SECONDS)
    rss1 = rss_mib(pid)
    healthy = '"error"' not in get(host, port, "/health")
    total = sum(soak.outcomes.values())
    chats = "" if soak.chats else " (no chat template: chats must be refused)"
    print(f"machine: {cpu_model()}; kvpage serve, {model}{chats}; {wall:.0f} s of traffic at "
          f"{args.rate:g} req/s (concurrency cap {args.concurrency}); {total} requests")
    for (kind, outcome), n in sorted(soak.outcomes.items()):
        print(f"  {kind:<11} {outcome:<22} {n}")
    print(f"failures (5xx, timeouts, unexpected statuses, broken streams): {len(soak.failures)}")
    for f in soak.failures[:10]:
        print(f"  {f}")
    print(f"KV blocks in use once idle: {leaked:g} (must be 0); server healthy after: {healthy}")
    if rss0 is not None and rss1 is not None:
        print(f"server resident memory: {rss0:.0f} MiB after warm-up, {rss_busy:.0f} MiB as the traffic ended, "
              f"{rss1:.0f} MiB idle 3 s later "
              f"({rss1 - rss0:+.0f} MiB); every 30 s: " + ", ".join(f"{r:.0f}" for _, r in soak.rss if r))
    if args.json_out:
        args.json_out.write_text(json.dumps({
            "machine": cpu_model(), "model": model, "chats": soak.chats, "seconds": wall, "rate": args.rate,
            "requests": total,
            "outcomes": {f"{k} / {o}": n for (k, o), n in sorted(soak.outcomes.items())},
            "failures": soak.failures, "leaked_blocks": leaked, "rss_mib": [rss0, rss1], "rss_every_30s": soak.rss,
            "healthy": healthy},
            indent=1))
    if proc is not None:
        proc.terminate()
        proc.wait(timeout=60)
    return 0 if not soak.failures and leaked == 0 and healthy else 1


if __name__ == "__main__":
    sys.exit(main())
