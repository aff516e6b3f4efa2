"""Stored responses and conversations kept across a restart (``kvpage serve --responses-store-file FILE``).

Why: a client continues a response by its id (``previous_response_id``) and a conversation by its id for as long
as it likes, and a server restart (an upgrade, a new flag) would otherwise answer both with 404. The server
writes what its stores hold to FILE when it stops (after draining, so no response is still running; the write
goes to a temporary file renamed over FILE, so a crash mid-write leaves the previous one) and reads it back when
it starts, before the model loads: a file it cannot read stops the start-up with a message naming it, rather
than silently starting empty. What is read back obeys this start's limits (the oldest dropped first). A server
killed without a graceful stop keeps what the last stop wrote.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpage.entrypoints.openai.conversations import Conversation, ConversationStore
from kvpage.entrypoints.openai.response_store import ResponseStore, StoredResponse

VERSION = 1


@dataclass
class SavedShape:
    """A finished response read back from the file: its body as it was when the server stopped."""

    saved: dict[str, Any]

    @property
    def status(self) -> str:
        return self.saved["status"]

    def body(self) -> dict[str, Any]:
        return self.saved


@dataclass
class Saved:
    """What a store file holds, read back: finished responses and conversations, oldest first."""

    responses: list[StoredResponse]
    conversations: list[Conversation]


def read(path: str) -> Saved | None:
    """The file's contents (None: no file yet); a file that is not one of ours is a ValueError naming it."""
    p = Path(path)
    if not p.exists():
        if not p.resolve().parent.is_dir() or not os.access(p.resolve().parent, os.W_OK):
            raise ValueError(f"--responses-store-file {path}: its directory is missing or not writable, so the "
                             "stores could not be written when the server stops")
        return None
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"not a version-{VERSION} kvpage store file")
        return Saved(
            [StoredResponse(r["id"], SavedShape(dict(r["body"])), list(r["before"]), list(r["inputs"]),
                            bool(r["background"]), conversation=r["conversation"], frames=list(r["frames"]),
                            ended=True, nbytes=int(r["nbytes"]), before_bytes=int(r["before_bytes"]),
                            conversation_bytes=int(r["conversation_bytes"])) for r in data["responses"]],
            [Conversation(c["id"], int(c["created_at"]), dict(c["metadata"]), list(c["items"]), int(c["nbytes"]))
             for c in data["conversations"]])
    except (OSError, ValueError, KeyError, TypeError) as e:
        what = f"missing {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"--responses-store-file {path}: cannot read it ({what}); move it away to start empty") \
            from None


def restore(saved: Saved, responses: ResponseStore, conversations: ConversationStore) -> None:
    """Put what ``read`` returned into the stores, oldest first (so that this start's limits keep the newest)."""
    for stored in saved.responses:
        responses.restore(stored)
    for conv in saved.conversations:
        conversations.restore(conv)


def write(path: str, responses: ResponseStore, conversations: ConversationStore) -> tuple[int, int]:
    """Write the stores' finished responses and their conversations to ``path`` (through a temporary file);
    returns how many of each."""
    saved = [{"id": s.id, "body": s.shape.body(), "before": s.before, "inputs": s.inputs, "background": s.background,
              "conversation": s.conversation, "frames": s.frames, "nbytes": s.nbytes, "before_bytes": s.before_bytes,
              "conversation_bytes": s.conversation_bytes} for s in responses.values() if not s.running]
    convs = [{"id": c.id, "created_at": c.created_at, "metadata": c.metadata, "items": c.items, "nbytes": c.nbytes}
             for c in conversations.values()]
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"version": VERSION, "responses": saved, "conversations": convs}, f, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(saved), len(convs)
