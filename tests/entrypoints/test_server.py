"""The OpenAI-compatible server as a real process on 127.0.0.1: the official client, streaming, concurrency,
disconnects, metrics, and every refusal the server promises."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import time
from collections.abc import Iterator

import pytest

import kvpage
from tests.helpers.server_util import KEY, metric, request, server, stream_raw, wait_idle

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def srv() -> Iterator[int]:
    with server("--api-key", KEY, "--max-n", "4", huge_pages=True) as port:  # the server as users start it
        yield port


@pytest.fixture(scope="module")
def model_id(srv) -> str:
    status, body = request(srv, "GET", "/v1/models")
    assert status == 200
    return body["data"][0]["id"]


@pytest.fixture(scope="module")
def offline():
    from kvpage.engine.llm import LLM

    return LLM(kv_cache_memory="128MiB", max_model_len=1024)


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)


PROMPT = ("Here is a short list of facts about the primary colors of paint, written for a child. "
          "The three primary colors are")


def test_models_health_metrics(srv, model_id):
    assert request(srv, "GET", "/health")[0] == 200
    assert request(srv, "GET", "/version", key=None) == (200, {"version": kvpage.__version__})  # open, as /health
    _, body = request(srv, "GET", "/v1/models")
    assert body["data"][0]["max_model_len"] == 1024
    assert model_id == client(srv).models.list().data[0].id
    _, text = request(srv, "GET", "/metrics")
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "kv_cache_blocks_shared", "kv_cache_blocks_per_request",
                 "kv_cache_cow_copies_total"):
        assert f"kvpage:{name}" in text, name


def test_model_labelled_metrics_are_exported_at_zero_before_their_first_event():
    from kvpage.entrypoints.openai.metrics import ServerMetrics

    text = ServerMetrics("m").render().decode()
    for name in ("num_preemptions_total", "kv_cache_cow_copies_total", "generation_tokens_total",
                 "num_requests_running", "time_to_first_token_seconds_count"):
        assert f'kvpage:{name}{{model_name="m"}} 0.0' in text, name
    assert "kvpage:kv_offload_disk_bytes{" not in text  # no disk tier, no figure for one


def test_completions_match_offline_generate_streamed_or_not(srv, model_id, offline):
    from kvpage.sampling_params import SamplingParams

    expect = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    c = client(srv)
    full = c.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0)
    assert full.choices[0].text == expect.outputs[0].text
    assert full.usage.prompt_tokens == len(expect.prompt_token_ids)
    assert full.usage.completion_tokens == len(expect.outputs[0].token_ids)
    pieces, usage = [], None
    for chunk in c.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                      stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == expect.outputs[0].text
    assert usage is not None and usage.completion_tokens == 24
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: its full blocks were cached


def test_chat_matches_offline_chat_streamed_or_not(srv, model_id, offline):
    from kvpage.sampling_params import SamplingParams

    msgs = [{"role": "user", "content": "Name a fruit that is yellow."}]
    expect = offline.chat(msgs, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0].text
    c = client(srv)
    full = c.chat.completions.create(model=model_id, messages=msgs, max_tokens=20, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == expect
    text, finish = "", None
    for chunk in c.chat.completions.create(model=model_id, messages=msgs, max_tokens=20, temperature=0,
                                           stream=True):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert text == expect
    assert finish in ("stop", "length")


def test_sampling_extras_logprobs_n_and_stop(srv, model_id):
    status, body = request(srv, "POST", "/v1/completions", {
        "model": model_id, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.8, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "seed": 7, "n": 2, "logprobs": 2})
    assert status == 200, body
    assert sorted(ch["index"] for ch in body["choices"]) == [0, 1]
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 6
    assert all(len(t) <= 3 for t in lp["top_logprobs"])  # top 2 (+ the sampled token when outside them)
    again = request(srv, "POST", "/v1/completions", {
        "model": model_id, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.8, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "seed": 7, "n": 2, "logprobs": 2})[1]
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in body["choices"]]  # seeded
    status, body = request(srv, "POST", "/v1/chat/completions", {
        "model": model_id, "messages": [{"role": "user", "content": "Count: one, two, three, four"}],
        "max_tokens": 30, "temperature": 0, "stop": [","], "logprobs": True, "top_logprobs": 3})
    assert status == 200, body
    ch = body["choices"][0]
    assert "," not in ch["message"]["content"]
    assert ch["logprobs"]["content"] and len(ch["logprobs"]["content"][0]["top_logprobs"]) == 3
    status, body = request(srv, "POST", "/v1/completions", {
        "model": model_id, "prompt": [PROMPT, "Once upon a time"], "max_tokens": 3, "temperature": 0,
        "ignore_eos": True, "cache_salt": "tenant-a"})
    assert status == 200 and len(body["choices"]) == 2
    assert body["usage"]["completion_tokens"] == 6
    greedy = {"model": model_id, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    first = request(srv, "POST", "/v1/completions", greedy)[1]["choices"][0]["text"].split()[0]
    status, body = request(srv, "POST", "/v1/completions", {**greedy, "bad_words": [first]})
    assert status == 200 and body["choices"][0]["text"].split()[0] != first


def test_logprobs_name_tokens_by_id_when_asked(srv, model_id):
    """vLLM's return_tokens_as_token_ids: every token of the logprobs is "token_id:{id}" (completions, chat,
    streamed chat), the same ids the response's token ids list; text_offset still counts the text."""
    base = {"model": model_id, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "return_token_ids": True}
    plain = request(srv, "POST", "/v1/completions", base)[1]["choices"][0]
    status, body = request(srv, "POST", "/v1/completions", {**base, "return_tokens_as_token_ids": True})
    assert status == 200, body
    ch = body["choices"][0]
    lp = ch["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ch["token_ids"]]
    assert lp["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert lp["text_offset"] == plain["logprobs"]["text_offset"]
    assert all(re.fullmatch(r"token_id:\d+", k) for top in lp["top_logprobs"] for k in top)
    chat = {"model": model_id, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
            "temperature": 0, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True,
            "return_token_ids": True}
    status, body = request(srv, "POST", "/v1/chat/completions", chat)
    assert status == 200, body
    ch = body["choices"][0]
    content = ch["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in ch["token_ids"]]
    assert all(c["bytes"] == list(c["token"].encode()) for c in content)
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])
    stream = client(srv).chat.completions.create(
        model=model_id, messages=chat["messages"], max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
        stream=True, extra_body={"return_tokens_as_token_ids": True})
    streamed = [c.token for chunk in stream for x in chunk.choices if x.logprobs and x.logprobs.content
                for c in x.logprobs.content]
    assert streamed == [c["token"] for c in content]


def test_best_of_returns_the_n_samples_with_the_highest_logprob_sums(srv, model_id):
    ask = {"model": model_id, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    status, every = request(srv, "POST", "/v1/completions", ask | {"n": 4, "logprobs": 0})
    assert status == 200, every
    sums = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in every["choices"]}
    assert len(sums) == 4  # four different samples, so the ranking means something
    best_two = sorted(sums, key=sums.get, reverse=True)[:2]
    for logprobs in (None, 0):
        status, body = request(srv, "POST", "/v1/completions",
                               ask | {"n": 2, "best_of": 4} | ({} if logprobs is None else {"logprobs": logprobs}))
        assert status == 200, body
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert [c["text"] for c in body["choices"]] == best_two
        assert all((c["logprobs"] is None) == (logprobs is None) for c in body["choices"])
        assert body["usage"]["completion_tokens"] == every["usage"]["completion_tokens"]  # all four were run
    assert request(srv, "POST", "/v1/completions", ask | {"n": 3, "best_of": 2})[0] == 400
    assert request(srv, "POST", "/v1/completions", ask | {"best_of": 2, "stream": True})[0] == 400
    assert request(srv, "POST", "/v1/completions", ask | {"best_of": 5})[0] == 400  # over --max-n


def test_echo_and_prompt_logprobs_as_scoring_harnesses_send_them(srv, model_id, offline):
    """lm-eval's loglikelihood request (token ids, echo, logprobs 1, max_tokens 1): every prompt token's logprob
    after the first, equal to the offline engine's prompt logprobs; echo with max_tokens 0 returns the prompt
    alone; prompt_logprobs as vLLM's extra field, on completions and chat."""
    from kvpage.sampling_params import SamplingParams

    ids = request(srv, "POST", "/tokenize", {"prompt": PROMPT})[1]["tokens"]
    status, body = request(srv, "POST", "/v1/completions", {
        "model": model_id, "prompt": [ids], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True,
        "seed": 1234})
    assert status == 200, body
    ch = body["choices"][0]
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert ch["text"].startswith(offline.get_tokenizer().decode(ids))
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    ref = offline.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    want = [ref.prompt_logprobs[p][t].logprob for p, t in enumerate(ids) if p > 0]
    assert lp["token_logprobs"][1:-1] == pytest.approx(want, abs=1e-3)
    assert all(len(t) == 1 for t in lp["top_logprobs"][1:])
    status, body = request(srv, "POST", "/v1/completions", {
        "model": model_id, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert status == 200, body
    ch = body["choices"][0]
    assert ch["text"] == PROMPT and len(ch["logprobs"]["tokens"]) == len(ids)
    assert body["usage"]["completion_tokens"] == 0
    status, body = request(srv, "POST", "/v1/completions", {
        "model": model_id, "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2})
    assert status == 200, body
    pl = body["choices"][0]["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    assert all(str(t) in e and 2 <= len(e) <= 3 for t, e in zip(ids[1:], pl[1:], strict=True))
    status, body = request(srv, "POST", "/v1/chat/completions", {
        "model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0})
    assert status == 200 and body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) > 2, body
    chunks = list(client(srv).completions.create(model=model_id, prompt=PROMPT, max_tokens=2, temperature=0,
                                                 echo=True, stream=True, logprobs=0))
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT) and len(first.logprobs.tokens) == len(ids) + 1
    assert "".join(c.choices[0].text for c in chunks).startswith(PROMPT)
    for bad, words in [({"max_tokens": 0}, "max_tokens"), ({"prompt_logprobs": 1, "stream": True}, "stream"),
                       ({"prompt_logprobs": 21}, "prompt_logprobs"),
                       ({"echo": True, "use_beam_search": True, "n": 2}, "echo")]:
        status, err = request(srv, "POST", "/v1/completions", {"model": model_id, "prompt": PROMPT, **bad})
        assert status == 400 and words in err["error"]["message"], (bad, err)
    wait_idle(srv, 10)
    assert metric(srv, "kvpage:kv_cache_blocks_used") == 0


def test_beam_search_matches_offline_beam_search(srv, model_id, offline):
    """use_beam_search with best_of 4, n 2: the same two best beams as LLM.beam_search, best first."""
    from kvpage.sampling_params import BeamSearchParams

    want = offline.beam_search([PROMPT], BeamSearchParams(beam_width=4, n=2, max_tokens=8))[0].sequences
    status, body = request(srv, "POST", "/v1/completions", {
        "model": model_id, "prompt": PROMPT, "max_tokens": 8, "use_beam_search": True, "n": 2, "best_of": 4})
    assert status == 200, body
    assert [c["text"] for c in body["choices"]] == [s.output_text for s in want]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == sum(len(s.output_token_ids) for s in want)
    msgs = [{"role": "user", "content": "Name a fruit that is yellow."}]
    prompt = offline.get_tokenizer().apply_chat_template(msgs)
    ids = offline.get_tokenizer().encode(prompt, add_special_tokens=False)
    want = offline.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=3, max_tokens=12,
                                                                             length_penalty=0.5))[0].sequences
    status, body = request(srv, "POST", "/v1/chat/completions", {
        "model": model_id, "messages": msgs, "max_tokens": 12, "use_beam_search": True, "n": 3,
        "length_penalty": 0.5})
    assert status == 200, body
    assert [c["message"]["content"] for c in body["choices"]] == [s.output_text for s in want]
    assert [c["finish_reason"] for c in body["choices"]] == [s.finish_reason for s in want]


def test_tokenize_detokenize(srv, model_id):
    status, body = request(srv, "POST", "/tokenize", {"model": model_id, "prompt": "Hello world"})
    assert status == 200 and body["count"] == len(body["tokens"]) > 0
    status, back = request(srv, "POST", "/detokenize", {"model": model_id, "tokens": body["tokens"]})
    assert status == 200 and back["prompt"].endswith("Hello world")
    status, chat = request(srv, "POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and chat["count"] > body["count"]
    assert request(srv, "POST", "/detokenize", {"tokens": [-1]})[0] == 400


def test_64_concurrent_streams_then_disconnect_burst_frees_everything(srv, model_id):
    async def one(ac, i):
        text = ""
        stream = await ac.completions.create(model=model_id, prompt=f"Story {i}: once upon a time", max_tokens=16,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True})
        finish = None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        ac = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{srv}/v1", api_key=KEY, max_retries=0, timeout=300)
        return await asyncio.gather(*(one(ac, i) for i in range(64)))

    results = asyncio.run(main())
    assert len(results) == 64 and all(f == "length" and t for t, f in results)
    wait_idle(srv)
    # A burst of clients that vanish mid-stream: their requests must be aborted and their blocks freed.
    socks = [stream_raw(srv, "/v1/completions", {"model": model_id, "prompt": f"Tell me about {i}",
                                                 "max_tokens": 400, "ignore_eos": True, "stream": True})[0]
             for i in range(12)]
    assert metric(srv, "kvpage:kv_cache_blocks_used") > 0
    for s in socks:
        s.close()
    wait_idle(srv, 10)
    _, text = request(srv, "GET", "/metrics")
    aborted = re.search(r'^kvpage:request_success_total\{[^}]*finished_reason="abort"[^}]*\} ([0-9.e+]+)$', text, re.M)
    assert aborted and float(aborted.group(1)) >= 12


@pytest.mark.parametrize(("body", "status", "words"), [
    ("{not json", 400, "malformed JSON"),
    ({"model": "gpt-17", "prompt": "hi"}, 404, "does not exist"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**9}, 400, "max_model_len"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "hi", "n": 1000}, 400, "n=1000"),
    ({"prompt": "hi " * 3000}, 400, "max_model_len"),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": [10**9]}, 400, "token ids"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "hi", "bad_words": ["ok", ""]}, 400, "bad_words"),
])
def test_bad_completion_requests_get_openai_errors(srv, body, status, words):
    got, err = request(srv, "POST", "/v1/completions", body)
    assert got == status, err
    assert words in err["error"]["message"]
    assert {"message", "type", "code"} <= set(err["error"])


def test_a_prompt_that_fills_the_context_is_openais_400(srv):
    # OpenAI and vLLM answer 400 with this code, which clients' context-overflow handling looks for
    for path, body in (("/v1/completions", {"prompt": "hi " * 3000}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 3000}]})):
        got, err = request(srv, "POST", path, body)
        assert got == 400, err
        assert err["error"]["code"] == "context_length_exceeded"
        assert err["error"]["type"] == "invalid_request_error"


def test_openais_nullable_fields_sent_as_null_mean_their_defaults(srv):
    # clients that serialize every field send null for the ones left unset; OpenAI and vLLM serve them as if absent
    chat = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8, "temperature": 0}
    nulls = {"n": None, "stream": None, "logprobs": None, "top_logprobs": None, "max_completion_tokens": None,
             "stream_options": None, "seed": None, "stop": None}
    plain, nulled = (request(srv, "POST", "/v1/chat/completions", b) for b in (chat, chat | nulls))
    assert plain[0] == nulled[0] == 200, nulled
    assert len(nulled[1]["choices"]) == 1 and nulled[1]["choices"][0]["logprobs"] is None
    assert nulled[1]["choices"][0]["message"] == plain[1]["choices"][0]["message"]
    cmpl = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    nulls = {"n": None, "stream": None, "echo": None, "logprobs": None, "best_of": None, "suffix": None}
    plain, nulled = (request(srv, "POST", "/v1/completions", b) for b in (cmpl, cmpl | nulls))
    assert plain[0] == nulled[0] == 200, nulled
    assert [c["text"] for c in nulled[1]["choices"]] == [c["text"] for c in plain[1]["choices"]]
    # vLLM's own extras are not nullable there either: null is a 400 naming the field
    got, err = request(srv, "POST", "/v1/completions", cmpl | {"ignore_eos": None})
    assert got == 400 and err["error"]["param"] == "ignore_eos"
    # top_logprobs 0 without logprobs is neutral (as in vLLM); asking for some without logprobs is refused
    got, body = request(srv, "POST", "/v1/chat/completions", chat | {"top_logprobs": 0})
    assert got == 200 and body["choices"][0]["logprobs"] is None
    got, err = request(srv, "POST", "/v1/chat/completions", chat | {"top_logprobs": 2})
    assert got == 400 and err["error"]["param"] == "top_logprobs"


def test_bad_chat_auth_and_routes(srv, model_id):
    assert request(srv, "POST", "/v1/chat/completions", {"messages": []})[0] == 400
    assert request(srv, "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]})[0] == 400
    assert request(srv, "POST", "/v1/chat/completions",
                   {"messages": [{"role": "user", "content": "x"}], "temperature": -1})[0] == 400
    status, err = request(srv, "POST", "/v1/chat/completions",  # a client's own template needs the server's trust
                          {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 'x' }}"})
    assert status == 400 and "--trust-request-chat-template" in err["error"]["message"]
    status, err = request(srv, "GET", "/v1/models", key=None)
    assert status == 401 and "missing API key" in err["error"]["message"]
    status, err = request(srv, "POST", "/v1/completions", {"prompt": "hi"}, key="nope")
    assert status == 401 and "wrong API key" in err["error"]["message"]
    status, err = request(srv, "GET", "/v1/nothing")
    assert status == 404 and "error" in err
    # ... and the server still serves correctly, with nothing leaked
    status, body = request(srv, "POST", "/v1/completions", {"model": model_id, "prompt": PROMPT, "max_tokens": 4})
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    wait_idle(srv)


def test_queue_full_is_429_and_the_queue_recovers():
    with server("--max-num-seqs", "1", "--max-queue", "1") as port:
        first, _ = stream_raw(port, "/v1/completions", {"prompt": "A long story", "max_tokens": 300,
                                                         "ignore_eos": True, "stream": True})
        # The running request holds the only slot; one more may wait, the next is refused.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "queued", "max_tokens": 2}),
                     headers={"Content-Type": "application/json"})
        deadline = time.time() + 10
        while metric(port, "kvpage:num_requests_waiting") < 1 and time.time() < deadline:
            time.sleep(0.05)
        status, err = request(port, "POST", "/v1/completions", {"prompt": "refused", "max_tokens": 2})
        assert status == 429 and "queue is full" in err["error"]["message"]
        first.close()  # frees the slot: the queued request runs
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 2
        wait_idle(port)
        assert request(port, "POST", "/v1/completions", {"prompt": "after", "max_tokens": 2})[0] == 200


def test_readme_curl_call_works(srv):
    """The chat request the README shows right under its first command."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    m = re.search(r"curl -s http://127\.0\.0\.1:8000(/v1/chat/completions) .*?-d '(\{.*?\})'", readme)
    assert m, "README's curl example not found"
    status, body = request(srv, "POST", m.group(1), m.group(2))
    assert status == 200, body
    assert body["choices"][0]["message"]["content"]
