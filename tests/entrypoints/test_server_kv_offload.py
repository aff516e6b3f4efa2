"""`kvpage serve` with tiers below the pool: cached_tokens counts host and disk hits, the per-tier metrics move,
/reset_prefix_cache sits behind the key and empties every tier, and a restarted server is served from disk."""

from __future__ import annotations

import random
import sys

import pytest

from tests.helpers.server_util import KEY, metric, request, server_proc

pytest.importorskip("fastapi")

BLOCK = 30 * 16 * 3 * 128 * 4  # SmolLM2: bytes of one 16-token block in float32 (the exact path: hits or not,
# the same tokens; in bf16 a prompt read after cached keys rounds differently from a fresh one, in any tier)
rng = random.Random(3)
PROMPTS = [[rng.randrange(200, 40000) for _ in range(100)] for _ in range(5)]


def cmd(port: int, *extra: str) -> list[str]:
    # 16 blocks: room for about two of the 7-block prompts
    return [sys.executable, "-m", "kvpage.entrypoints.cli", "serve", "--port", str(port), "--kv-cache-memory",
            f"{16 * BLOCK}B", "--max-model-len", "128", "--dtype", "float32", "--api-key", KEY, *extra]


def complete(port: int, prompt: list[int]) -> tuple[list[int] | str, int]:
    status, body = request(port, "POST", "/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": prompt,
                                                             "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.slow  # ~35 s on the slowest machine; the tiers' default-run cases: tests/engine/test_kv_offload.py
def test_tiers_through_the_server(tmp_path):
    d = str(tmp_path / "kv")
    flags = ("--kv-offload-memory", f"{40 * BLOCK}B", "--kv-offload-dir", d)
    with server_proc(cmd, *flags) as (port, _):
        first = [complete(port, p) for p in PROMPTS]
        again = [complete(port, p) for p in PROMPTS]
        assert [t for t, _ in again] == [t for t, _ in first]
        assert all(c == 96 for _, c in again)
        assert metric(port, "kvpage:prefix_cache_hits_by_tier_total") > 0
        _, text = request(port, "GET", "/metrics")
        assert 'tier="host"' in text and "kvpage:kv_offload_disk_bytes" in text
        assert request(port, "POST", "/reset_prefix_cache", key=None)[0] == 401
        status, body = request(port, "POST", "/reset_prefix_cache")
        assert status == 200 and body["entries_cleared"] > 0
        assert complete(port, PROMPTS[0])[1] == 0  # nothing left in any tier
        complete(port, PROMPTS[1])
    with server_proc(cmd, *flags) as (port, _):  # a new server on the same directory
        text, cached = complete(port, PROMPTS[1])
        assert cached == 96 and text == first[1][0]
