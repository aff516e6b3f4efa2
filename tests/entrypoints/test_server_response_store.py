"""Stored responses (/v1/responses with previous_response_id, background runs, GET / DELETE / cancel /
input_items) through a live server and the official client, and the store's own rules; no block is left in
use, and a cancelled background run frees its blocks."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from tests.helpers.server_util import KEY, metric, request, server, wait_idle

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from kvpage.entrypoints.openai.protocol import APIError  # noqa: E402
from kvpage.entrypoints.openai.response_store import (  # noqa: E402
    ResponseStore,
    StoredResponse,
    input_items,
    json_size,
)

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def srv() -> Iterator[int]:
    with server("--api-key", KEY, "--responses-store-size", "64") as port:
        yield port


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv}/v1", api_key=KEY, max_retries=0)


def _record(rid: str, status: str = "completed") -> StoredResponse:
    shape = SimpleNamespace(status=status, body=lambda: {"id": rid, "status": shape.status})
    return StoredResponse(rid, shape, [], input_items("x"), conversation=[] if status == "completed" else None)


def test_the_store_drops_the_oldest_finished_response_first():
    store = ResponseStore(3)
    for rid, status in (("a", "completed"), ("b", "in_progress"), ("c", "completed")):
        store.put(_record(rid, status))
    store.put(_record("d"))  # full: "a" (the oldest finished) goes, the running "b" stays
    with pytest.raises(APIError) as e:
        store.get("a")
    assert e.value.status == 404
    assert store.get("b") and store.get("c") and len(store) == 3
    with pytest.raises(APIError) as e:
        store.room("c", False)
    assert e.value.status == 409 and e.value.param == "request_id"
    full = ResponseStore(2)
    full.put(_record("x", "in_progress"))
    full.put(_record("y", "queued"))
    with pytest.raises(APIError) as e:
        full.room("z", True)  # a background run is refused before anything is submitted
    assert e.value.status == 429
    full.room("z", False)  # one whose client waits is not
    full.put(_record("z"))  # already running when it comes: kept beyond the capacity until others end
    assert len(full) == 3


def test_the_store_keeps_its_text_within_the_byte_budget():
    store = ResponseStore(100, max_bytes=1000)
    a, b = _record("a"), _record("b", "in_progress")
    store.put(a)
    store.put(b)
    assert a.nbytes == json_size(a.inputs) > 0 and store.nbytes == a.nbytes + b.nbytes
    asyncio.run(b.publish("x" * 900))  # a running background run's frames: over budget, "a" (finished) goes
    assert len(store) == 1 and store.get("b") and store.nbytes == b.nbytes > 900
    asyncio.run(b.publish("y" * 200))  # still running: kept past the budget, never dropped
    assert store.nbytes == b.nbytes > 1000 and store.get("b")
    b.shape.status = "completed"
    b.settle([{"role": "assistant", "content": "done"}])  # finished and over budget: the oldest finished goes
    with pytest.raises(APIError) as e:
        store.get("b")
    assert e.value.status == 404 and "within 1000 bytes" in e.value.message
    c = _record("c")
    store.put(c)
    assert store.nbytes == c.nbytes
    c.settle([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}])
    assert c.nbytes == json_size(c.inputs) + json_size(c.conversation) and store.nbytes == c.nbytes
    store.delete("c")
    assert store.nbytes == 0 and len(store) == 0
    asyncio.run(b.publish("z"))  # a dropped response no longer counts against the store
    assert store.nbytes == 0


def test_a_store_over_budget_with_every_response_running_drops_once_one_ends():
    store = ResponseStore(100, max_bytes=500)
    runs = [_record(rid, "in_progress") for rid in "pqr"]
    for r in runs:
        store.put(r)
        asyncio.run(r.publish("e" * 300))  # every one running: all kept past the budget
    assert len(store) == 3 and store.nbytes > 900
    runs[0].shape.status = "failed"  # ended without a conversation to keep (a failure, a cancel)
    store.put(_record("s", "in_progress"))  # the next put drops it
    assert len(store) == 3 and store.nbytes == sum(store.get(rid).nbytes for rid in "qrs")
    runs[1].shape.status = "completed"
    runs[1].settle([{"role": "assistant", "content": "ok"}])  # a settle drops the oldest finished: itself
    assert [rid for rid in "pqrs" if rid in store._by_id] == ["r", "s"]


def test_the_byte_budget_flag_is_checked_before_the_model_loads():
    for value, words in (("lots", "cannot read size 'lots'"), ("0", "more than 0 bytes")):
        done = subprocess.run([sys.executable, "-m", "kvpage.entrypoints.cli", "serve", "--responses-store-memory",
                               value], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "--responses-store-memory" in done.stderr and words in done.stderr, done


def test_a_live_store_drops_what_passes_its_byte_budget():
    with server("--api-key", KEY, "--responses-store-memory", "4KiB") as port:
        ids = []
        for i in range(3):  # each keeps its ~1 KB input twice (input items, conversation)
            status, r = request(port, "POST", "/v1/responses", {"input": f"{i} " + "word " * 200,
                                                                 "max_output_tokens": 4})
            assert status == 200, r
            ids.append(r["id"])
        status, err = request(port, "GET", f"/v1/responses/{ids[0]}")
        assert status == 404 and f"within {4 * 1024} bytes" in err["error"]["message"], err
        assert request(port, "GET", f"/v1/responses/{ids[-1]}")[0] == 200
        status, r = request(port, "POST", "/v1/responses", {"input": "and?", "max_output_tokens": 4,
                                                             "previous_response_id": ids[-1]})
        assert status == 200, r
        wait_idle(port)
        assert metric(port, "kvpage:kv_cache_blocks_used") == 0


def test_what_a_next_turn_may_continue():
    store = ResponseStore(4)
    store.put(_record("done"))
    store.put(_record("running", "in_progress"))
    store.put(_record("gone", "failed"))
    assert store.earlier(None) == [] and store.earlier("done") == []
    for rid, status in (("running", 400), ("gone", 400), ("nope", 404)):
        with pytest.raises(APIError) as e:
            store.earlier(rid)
        assert e.value.status == status and e.value.param == "previous_response_id", e.value.message
    with pytest.raises(APIError) as e:
        ResponseStore(0).earlier("done")
    assert e.value.status == 400 and "--responses-store-size 0" in e.value.message


def test_input_items_pages():
    rec = StoredResponse("r", SimpleNamespace(status="completed"), [], input_items(
        [{"role": "user", "content": str(i)} for i in range(5)]))
    first = rec.input_list(2, "asc", None)
    assert [it["content"] for it in first["data"]] == ["0", "1"] and first["has_more"]
    rest = rec.input_list(10, "asc", first["last_id"])
    assert [it["content"] for it in rest["data"]] == ["2", "3", "4"] and not rest["has_more"]
    assert [it["content"] for it in rec.input_list(2, "desc", None)["data"]] == ["4", "3"]
    with pytest.raises(APIError) as e:
        rec.input_list(2, "asc", "msg_nope")
    assert e.value.param == "after"
    assert input_items("hi")[0]["content"] == [{"type": "input_text", "text": "hi"}]


def test_a_follower_sees_every_frame_and_the_end():
    async def go() -> list[str]:
        shape = SimpleNamespace(status="in_progress")
        rec = StoredResponse("r", shape, [], [], background=True)
        seen: list[str] = []

        async def follow() -> None:
            async for f in rec.follow(0):
                seen.append(f)
        reader = asyncio.create_task(follow())
        for i in range(4):
            await rec.publish(f"f{i}")
            await asyncio.sleep(0)
        shape.status = "completed"  # settled before its last frame is out: a follower woken now must wait on
        async with rec._changed:
            rec._changed.notify_all()
        await asyncio.sleep(0.01)
        await rec.publish("f4")
        await rec.end()
        await asyncio.wait_for(reader, 5)
        return seen
    assert asyncio.run(go()) == ["f1", "f2", "f3", "f4"]


def test_a_next_turn_reads_the_stored_conversation(client):
    first = client.responses.create(model=MODEL, input="My name is Ada. Say hello.", temperature=0,
                                    instructions="Answer in one short sentence.", max_output_tokens=16)
    assert first.store is True and client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=16)
    assert second.previous_response_id == first.id
    # the same conversation sent whole: the same prompt (the first turn's instructions are not carried over)
    whole = client.responses.create(model=MODEL, temperature=0, max_output_tokens=16, store=False, input=[
        {"role": "user", "content": "My name is Ada. Say hello."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert second.output_text == whole.output_text
    assert whole.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)
    items = client.responses.input_items.list(second.id, order="asc")
    assert [it.role for it in items.data] == ["user"] and items.data[0].content[0].text == "What is my name?"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)


def test_a_background_response_runs_without_its_client(client):
    r = client.responses.create(model=MODEL, input="What is the capital of France?", temperature=0,
                                max_output_tokens=24, background=True)
    assert r.status in ("queued", "in_progress") and r.background is True
    deadline = time.monotonic() + 60
    while r.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.1)
        r = client.responses.retrieve(r.id)
    plain = client.responses.create(model=MODEL, input="What is the capital of France?", temperature=0,
                                    max_output_tokens=24)
    assert r.status == plain.status and r.output_text == plain.output_text and r.usage.output_tokens > 0
    # streamed: every event kept, to read again from any point
    events = list(client.responses.create(model=MODEL, input="Name three colours.", temperature=0,
                                          max_output_tokens=16, background=True, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.background  # cut at 16 tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))
    again = list(client.responses.retrieve(events[0].response.id, stream=True, starting_after=2))
    assert [e.sequence_number for e in again] == [e.sequence_number for e in events[3:]]
    assert again[-1].response.output_text == events[-1].response.output_text


def test_a_cancelled_background_run_frees_its_blocks(srv, client):
    r = client.responses.create(model=MODEL, input="Tell me a very long story about a ship.", max_output_tokens=900,
                                background=True, extra_body={"ignore_eos": True})
    time.sleep(1.0)
    c = client.responses.cancel(r.id)
    assert c.status == "cancelled"
    assert client.responses.retrieve(r.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):  # a cancelled response has no reply to continue
        client.responses.create(model=MODEL, input="x", previous_response_id=r.id)
    done = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):  # only a background run can be cancelled
        client.responses.cancel(done.id)
    wait_idle(srv)
    assert metric(srv, "kvpage:kv_cache_blocks_used") == 0


def test_refusals(srv):
    for body, param in (({"input": "x", "background": True, "store": False}, "background"),
                        ({"input": "x", "conversation": "conv_1", "previous_response_id": "r"}, "conversation")):
        status, err = request(srv, "POST", "/v1/responses", body)
        assert status == 400 and err["error"]["param"] == param, err
    status, err = request(srv, "POST", "/v1/responses", {"input": "x", "conversation": "conv_1"})
    assert status == 404 and err["error"]["param"] == "conversation", err
    for path in ("/v1/responses/nope", "/v1/responses/nope/input_items"):
        status, err = request(srv, "GET", path)
        assert status == 404 and f"within {256 * 2**20} bytes" in err["error"]["message"], err  # the default
    r = request(srv, "POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 2})[1]
    for query, param in (("limit=0", "limit"), ("limit=x", "limit"), ("order=up", "order")):
        status, err = request(srv, "GET", f"/v1/responses/{r['id']}/input_items?{query}")
        assert status == 400 and err["error"]["param"] == param, err
    status, err = request(srv, "GET", f"/v1/responses/{r['id']}?stream=true")
    assert status == 400 and err["error"]["param"] == "stream"
    assert request(srv, "GET", f"/v1/responses/{r['id']}", key=None)[0] == 401
    wait_idle(srv)
    assert metric(srv, "kvpage:kv_cache_blocks_used") == 0


def _chat(items):
    from kvpage.entrypoints.openai.responses import messages
    return messages(None, items)


def test_the_conversation_store_keeps_the_most_recently_used_within_its_limits():
    from kvpage.entrypoints.openai.conversations import ConversationStore, check_items

    store = ConversationStore(2, max_bytes=3000)
    text = lambda s: [{"role": "user", "content": s}]  # noqa: E731
    a = store.create(check_items(text("a" * 500), _chat), {})
    b = store.create(check_items(text("b" * 500), _chat), {"k": "v"})
    store.get(a.id)  # a is now the most recently used: a third conversation drops b
    c = store.create([], {})
    assert len(store) == 2 and store.get(a.id) is a and store.get(c.id) is c
    with pytest.raises(APIError) as e:
        store.get(b.id)
    assert e.value.status == 404 and "2 most recently used within 3000 bytes" in e.value.message
    store.append(c, check_items(text("c" * 2500), _chat))  # over the bytes: a goes, never c itself
    assert [conv.id for conv in store._by_id.values()] == [c.id]
    assert store.nbytes == c.nbytes == json_size({}) + json_size(c.items)
    store.remove_item(c, c.items[0]["id"])
    store.delete(c.id)
    assert len(store) == 0 and store.nbytes == 0
    store.append(b, text("late"))  # a turn that ends after its conversation was dropped: nothing counted
    assert store.nbytes == 0
    with pytest.raises(APIError) as e:
        check_items([{"role": "user", "content": "x"}, {"type": "reasoning"}], _chat)
    assert e.value.param == "items" and "items[1]" in e.value.message
    with pytest.raises(APIError, match="at most 20"):
        check_items(text("x") * 21, _chat)
    with pytest.raises(APIError, match=r"items\[0\]: a message's role"):
        check_items([{"role": "wizard", "content": "x"}], _chat)


def stored(srv: int, name: str, kind: str) -> float:
    """A /metrics gauge of what the stores keep, for one kind (responses or conversations)."""
    text = request(srv, "GET", "/metrics")[1]
    return float(re.search(rf'^kvpage:{name}{{.*kind="{kind}".*}} (\S+)$', text, re.M).group(1))


def test_conversations_through_the_official_client(srv, client):
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."},
                                              {"type": "message", "role": "assistant", "content": "Hello Ada!"}],
                                       metadata={"topic": "names"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}
    assert client.conversations.retrieve(conv.id).created_at == conv.created_at
    assert client.conversations.update(conv.id, metadata={"topic": "x"}).metadata == {"topic": "x"}
    r = client.responses.create(model=MODEL, input="What is my name?", conversation=conv.id, temperature=0,
                                max_output_tokens=12)
    assert r.conversation.id == conv.id
    whole = client.responses.create(model=MODEL, temperature=0, max_output_tokens=12, store=False, input=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Hello Ada!"},
        {"role": "user", "content": "What is my name?"}])
    assert (r.usage.input_tokens, r.output_text) == (whole.usage.input_tokens, whole.output_text)
    items = list(client.conversations.items.list(conv.id, order="asc", limit=2))  # pages of two, followed
    assert [it.role for it in items] == ["user", "assistant", "user", "assistant"]
    assert items[3].id == r.output[0].id and items[3].content[0].text == r.output_text
    added = client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "Hi"}])
    assert client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id).id == added.data[0].id
    client.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    assert len(list(client.conversations.items.list(conv.id))) == 4
    for path, body, param in ((f"/v1/conversations/{conv.id}/items", {"items": [{"type": "web_search_call"}]},
                               "items"),
                              ("/v1/conversations", {"metadata": {"k": 1}}, "metadata"),
                              (f"/v1/conversations/{conv.id}", {}, "metadata")):
        status, err = request(srv, "POST", path, body)
        assert status == 400 and err["error"]["param"] == param, err
    assert request(srv, "GET", f"/v1/conversations/{conv.id}/items/msg_nope")[0] == 404
    assert request(srv, "GET", f"/v1/conversations/{conv.id}", key=None)[0] == 401
    kept = stored(srv, "responses_stored", "conversations")
    assert stored(srv, "responses_stored_bytes", "conversations") > len(r.output_text) and kept >= 1
    assert stored(srv, "responses_stored_bytes", "responses") > 0
    assert client.conversations.delete(conv.id).deleted
    assert stored(srv, "responses_stored", "conversations") == kept - 1
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", conversation=conv.id)
    assert e.value.body["param"] == "conversation"
    wait_idle(srv)
    assert metric(srv, "kvpage:kv_cache_blocks_used") == 0
