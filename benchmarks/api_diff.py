"""Request-level compatibility with vLLM's OpenAI server: the same random requests to `kvpage serve` and to
`vllm serve`, and every request one of them answers (2xx) while the other refuses (4xx), or where either fails
(5xx, no answer).

    python benchmarks/api_diff.py --kvpage-url http://127.0.0.1:8013 --vllm-url http://127.0.0.1:8001 \\
        --model smol [--requests 300] [--seed 5]

Start both servers first, serving the same model under the same name, e.g.
`kvpage serve --port 8013 --served-model-name smol --max-model-len 2048` and (../shared/PEERS.md)
`vllm serve <smollm2-hf> --served-model-name smol --port 8001 --dtype bfloat16 --max-model-len 2048`.
The requests: chat and plain completions with a random handful of the API's and vLLM's sampling fields, each
drawn from valid, edge and invalid values (nulls, out-of-range numbers, empty lists, huge seeds), short outputs.
The two engines' texts differ (different weights' rounding); only the answer's class is compared. A
difference is not a defect by itself: the report lists each kind once for a person to judge.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import urllib.error
import urllib.request

VALUES: dict[str, list] = {
    "temperature": [0, 0.5, 1.0, 2.0, -1, 100.0, None, 1e-9], "top_p": [0.0, 1e-9, 0.5, 1.0, 1.5, None, -0.1],
    "top_k": [-1, 0, 1, 50, 10**9, -5, None], "min_p": [0, 0.1, 1.0, -0.1, 1.5, None],
    "presence_penalty": [-2, 0, 2, 3, -3, None], "frequency_penalty": [-2, 2, 2.5, None],
    "repetition_penalty": [0.5, 1, 2, 0, -1, None], "seed": [0, 1, -1, 2**63, 2**64, None], "n": [1, 2, 0, -1, None],
    "stop": ["\n", ["a", "b"], [], "", ["x"] * 5, None, 5], "stop_token_ids": [[0], [], [10**9], [-1], None],
    "logit_bias": [{"1": 100}, {"abc": 1}, {"99999999": 5}, {"2": 1000}, {"2": -101}, None, {}],
    "min_tokens": [0, 2, -1, 100], "ignore_eos": [True, False], "max_tokens": [1, 4, 0, -1, None, 10**6],
    "user": ["u", None, 5], "best_of": [1, 2, None, 0], "echo": [True, False, None],
    "completion_logprobs": [0, 1, 5, 21, -1, None], "top_logprobs": [0, 3, 20, 21, -1, None],
    "logprobs": [True, False, None], "stream": [False, None, True], "skip_special_tokens": [True, False],
    "include_stop_str_in_output": [True, False], "truncate_prompt_tokens": [1, 5, -1, 0, 10**6, None],
    "prompt_logprobs": [0, 1, 5, -1, 21, None], "max_completion_tokens": [1, 4, 0, None],
    "response_format": [{"type": "text"}, None], "stream_options": [None, {"include_usage": True}],
    "chat_echo": [True, False, None], "add_generation_prompt": [True, False, None],
    "continue_final_message": [True, False, None], "chat_template": ["{{ messages[0].content }}", "{% if %}", None],
    "chat_template_kwargs": [{"x": 1}, {}, None, {"chat_template": "{{ 1 }}"}],
    "documents": [[{"title": "t", "text": "d"}], [], None],
    "request_id": ["r-1", "", None], "return_token_ids": [True, False, None], "add_special_tokens": [True, False],
    "truncation_side": ["left", "right", "middle", None], "priority": [0, 1, None],
}
COMMON = ["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "seed", "n", "stop", "stop_token_ids", "logit_bias", "min_tokens", "ignore_eos", "user",
          "skip_special_tokens", "include_stop_str_in_output", "truncate_prompt_tokens", "prompt_logprobs", "stream",
          "request_id", "return_token_ids", "add_special_tokens", "truncation_side", "priority"]
CHAT = [*COMMON, "max_tokens", "top_logprobs", "logprobs", "max_completion_tokens", "response_format", "chat_echo",
        "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "documents"]
COMPLETION = [*COMMON, "max_tokens", "best_of", "echo", "completion_logprobs"]
MESSAGES = [[{"role": "user", "content": "Name a color."}], [{"role": "user", "content": ""}],
            [{"role": "system", "content": "x"}], [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            [{"role": "assistant", "content": "hi"}], [{"role": "user", "content": None}]]
PROMPTS = ["Once upon a time", [1, 2, 3], [[1, 2], [3, 4]], ["a", "b"], [], "", [10**9], [-1]]


def post(url: str, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except Exception as e:  # no answer at all
        return -1, repr(e)


def random_request(rng: random.Random, model: str) -> tuple[str, dict]:
    chat = rng.random() < 0.5
    body = {k: rng.choice(VALUES[k]) for k in (CHAT if chat else COMPLETION) if rng.random() < 0.25}
    if "completion_logprobs" in body:
        body["logprobs"] = body.pop("completion_logprobs")
    if "chat_echo" in body:
        body["echo"] = body.pop("chat_echo")
    if chat:
        body["messages"] = rng.choice(MESSAGES)
    else:
        body["prompt"] = rng.choice(PROMPTS)
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 3
    elif chat and body.get("max_tokens", 0) is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 3  # a chat without a limit runs to the context's end: keep the run short
    body["model"] = model
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvpage-url", default="http://127.0.0.1:8013")
    ap.add_argument("--vllm-url", default="http://127.0.0.1:8001")
    ap.add_argument("--model", default="smol", help="the model name both servers answer to")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    classes: collections.Counter = collections.Counter()
    kinds: dict[tuple, tuple] = {}
    for _ in range(args.requests):
        path, body = random_request(rng, args.model)
        (a, ta), (b, tb) = post(args.kvpage_url, path, body), post(args.vllm_url, path, body)
        classes[(path, a // 100, b // 100)] += 1
        if a // 100 != b // 100 or a >= 500 or b >= 500 or a < 0 or b < 0:
            refused = ta if a // 100 != 2 else tb
            try:
                why = json.loads(refused)["error"]["message"][:90]
            except (ValueError, KeyError, TypeError):
                why = refused[:90]
            kinds.setdefault((path, a, b, why), ({k: v for k, v in body.items() if k != "model"},))
    print(f"{args.requests} requests, seed {args.seed}")
    print("| route | kvpage | vLLM | requests |\n|---|---|---|---:|")
    for (path, a, b), count in sorted(classes.items()):
        print(f"| {path} | {a}xx | {b}xx | {count} |")
    print("\nEach kind of difference once (the refusing server's message, then the request):")
    for (path, a, b, why), (body,) in kinds.items():
        print(f"- {path}: kvpage {a}, vLLM {b}: {why!r}\n    {json.dumps(body)[:300]}")


if __name__ == "__main__":
    main()
