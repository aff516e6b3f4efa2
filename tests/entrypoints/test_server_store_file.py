"""--responses-store-file: stored responses and conversations written when the server stops and read back when it
starts (a live server stopped and started again, both continued afterwards), within the new start's limits; a
file that is not one of ours stops start-up before the model loads."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.helpers.server_util import KEY, request, server

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from kvpage.entrypoints.openai.conversations import Conversation, ConversationStore  # noqa: E402
from kvpage.entrypoints.openai.response_store import ResponseStore, StoredResponse  # noqa: E402
from kvpage.entrypoints.openai.store_file import SavedShape, read, restore, write  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def _response(rid: str, text: str) -> StoredResponse:
    body = {"id": rid, "object": "response", "status": "completed", "output": [{"type": "message", "content": text}]}
    turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]
    return StoredResponse(rid, SavedShape(body), [], [{"id": "msg_1", "type": "message", "role": "user"}],
                          conversation=turn, nbytes=100 + len(text), conversation_bytes=50 + len(text))


def test_a_file_round_trip_keeps_sizes_order_and_obeys_the_new_limits(tmp_path):
    path = str(tmp_path / "store.json")
    assert read(path) is None  # no file yet: start empty
    with pytest.raises(ValueError, match="directory is missing"):
        read(str(tmp_path / "nowhere" / "store.json"))
    responses, conversations = ResponseStore(8), ConversationStore(8)
    for i in range(3):
        responses.restore(_response(f"resp-{i}", "x" * (10 * i)))
    conversations.restore(Conversation("conv_a", 1, {"k": "v"}, [{"id": "msg_2", "type": "message"}], 77))
    assert write(path, responses, conversations) == (3, 1)
    again_r, again_c = ResponseStore(8), ConversationStore(8)
    restore(read(path), again_r, again_c)
    assert [s.id for s in again_r.values()] == ["resp-0", "resp-1", "resp-2"] and again_r.nbytes == responses.nbytes
    assert again_r.earlier("resp-2")[-1]["content"] == "x" * 20 and again_r.get("resp-1").shape.body()["id"] == "resp-1"
    assert again_c.get("conv_a").metadata == {"k": "v"} and again_c.nbytes == 77
    small = ResponseStore(2)  # a start with a smaller store keeps the newest
    restore(read(path), small, ConversationStore(8))
    assert [s.id for s in small.values()] == ["resp-1", "resp-2"]
    for text, words in (("{", "cannot read it"), ('{"version": 9}', "not a version-1"),
                        ('{"version": 1, "responses": [{}], "conversations": []}', "missing 'id'")):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match="--responses-store-file") as e:
            read(str(tmp_path / "bad.json"))
        assert words in str(e.value)


def test_a_bad_file_stops_start_up_before_the_model_loads(tmp_path):
    (tmp_path / "bad.json").write_text("not json")
    done = subprocess.run([sys.executable, "-m", "kvpage.entrypoints.cli", "serve", "--responses-store-file",
                           str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--responses-store-file" in done.stderr and "move it away" in done.stderr, done


def test_responses_and_conversations_outlive_a_restart(tmp_path):
    path = str(tmp_path / "store.json")
    with server("--api-key", KEY, "--responses-store-file", path) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        first = client.responses.create(model=MODEL, input="My name is Ada. Say hello.", temperature=0,
                                        max_output_tokens=12)
        conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "I like tea."}])
        client.responses.create(model=MODEL, input="What do I like?", conversation=conv.id, temperature=0,
                                max_output_tokens=8)
    with open(path) as f:
        saved = json.load(f)
    assert len(saved["responses"]) == 2 and [c["id"] for c in saved["conversations"]] == [conv.id]
    with server("--api-key", KEY, "--responses-store-file", path) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        assert client.responses.retrieve(first.id).output_text == first.output_text
        nxt = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                      temperature=0, max_output_tokens=12)
        assert nxt.status in ("completed", "incomplete") and nxt.usage.input_tokens > first.usage.input_tokens
        assert [it.role for it in client.conversations.items.list(conv.id, order="asc")] == \
            ["user", "user", "assistant"]
        body = request(port, "GET", "/metrics")[1]
        assert re.search(r'^kvpage:responses_stored\{[^}]*kind="conversations"[^}]*\} 1\.0$', body, re.M), body
