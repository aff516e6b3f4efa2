"""Forced tool calls against vLLM's server: the same chat requests with tools and a named or "required"
tool_choice to `kvpage serve` and `vllm serve`, and how many come back as calls whose arguments a client can use.

    python benchmarks/tool_calls.py --kvpage-url http://127.0.0.1:8013 --vllm-url http://127.0.0.1:8001 \\
        --model smol [--requests 12] [--seed 3]

Start both servers first, serving the same model under the same name; vLLM 0.32 takes named and required tool
choices only with a tool-call parser, e.g. `vllm serve <smollm2-hf> --served-model-name smol --port 8001 --dtype
bfloat16 --max-model-len 2048 --enable-auto-tool-choice --tool-call-parser hermes` (../shared/PEERS.md), and
`kvpage serve --port 8013 --served-model-name smol`. Each request asks one of a few questions with three tools,
greedy or sampled (temperature 1.0, a seed each), named (one of the tools) or required; max_tokens 96.
A call counts as usable when its function is one of the request's (the named one, if named) and its arguments
parse as a JSON object that holds the function's required parameters with their declared JSON types and no
others (the tools' schemas forbid others). Reported per server and kind: answered (2xx), calls returned, usable
calls, and finish reasons.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import urllib.error
import urllib.request

TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "Current weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 32},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 64}},
        "required": ["query"], "additionalProperties": False}}},
]
QUESTIONS = ["What is the weather in Paris, in celsius?", "What is 17 plus 25?", "Find recent news about otters.",
             "Is it raining in Tokyo? Use fahrenheit.", "Add 3 and 4 for me.", "Look up the tallest building."]
JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}
    except OSError:
        return -1, {}


def usable(call: dict, allowed: set[str]) -> bool:
    fn = call.get("function") or {}
    schema = next((t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == fn.get("name")), None)
    if schema is None or fn.get("name") not in allowed:
        return False
    try:
        args = json.loads(fn.get("arguments") or "")
    except json.JSONDecodeError:
        return False
    if not isinstance(args, dict) or set(args) - set(schema["properties"]) or set(schema["required"]) - set(args):
        return False
    for key, value in args.items():
        kind = schema["properties"][key]["type"]
        if not isinstance(value, JSON_TYPES[kind]) or (kind == "integer" and isinstance(value, bool)):
            return False
        if "enum" in schema["properties"][key] and value not in schema["properties"][key]["enum"]:
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvpage-url", default="http://127.0.0.1:8013")
    ap.add_argument("--vllm-url", default="http://127.0.0.1:8001")
    ap.add_argument("--model", default="smol", help="the model name both servers answer to")
    ap.add_argument("--requests", type=int, default=12, help="requests per kind (named / required, greedy / sampled)")
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    bodies = []
    for kind in ("named", "required"):
        for mode in ("greedy", "sampled"):
            for i in range(args.requests):
                question = rng.choice(QUESTIONS)
                name = rng.choice(TOOLS)["function"]["name"]
                choice = {"type": "function", "function": {"name": name}} if kind == "named" else "required"
                body = {"model": args.model, "messages": [{"role": "user", "content": question}], "tools": TOOLS,
                        "tool_choice": choice, "max_tokens": 96}
                body.update({"temperature": 0} if mode == "greedy" else {"temperature": 1.0, "seed": 1000 + i})
                bodies.append((f"{kind} {mode}", {name} if kind == "named" else {t["function"]["name"] for t in TOOLS},
                               body))
    print(f"{args.requests} requests per kind, seed {args.seed}")
    print("| server | kind | answered | calls | usable calls | finish reasons |\n|---|---|---:|---:|---:|---|")
    for server, url in (("kvpage", args.kvpage_url), ("vLLM", args.vllm_url)):
        tally: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        example: dict[str, str] = {}
        for label, allowed, body in bodies:
            status, out = post(url, body)
            t = tally[label]
            t["answered"] += 200 <= status < 300
            for choice in out.get("choices", []):
                t[f"finish {choice.get('finish_reason')}"] += 1
                for call in choice.get("message", {}).get("tool_calls") or []:
                    t["calls"] += 1
                    t["usable"] += usable(call, allowed)
                    if not usable(call, allowed):
                        example.setdefault(label, json.dumps(call.get("function"))[:160])
        for label, t in tally.items():
            reasons = ", ".join(f"{k[7:]} {v}" for k, v in sorted(t.items()) if k.startswith("finish "))
            print(f"| {server} | {label} | {t['answered']} | {t['calls']} | {t['usable']} | {reasons} |")
        for label, text in example.items():
            print(f"  {server} {label}, an unusable call: {text}")


if __name__ == "__main__":
    main()
