"""The tiers below the pool on the embedded model (float32): prompts whose blocks the pool evicted come back
from host memory or disk with the same greedy tokens as without any cache, a new engine on the same directory
is served from disk, salts stay apart in every tier, damaged files are never served, and the KV event stream
(in-process and over ZeroMQ) rebuilds what each tier holds."""

from __future__ import annotations

import random

import pytest

from kvpage.engine.kv_events import decode_batch
from kvpage.engine.llm import LLM
from kvpage.kv.events import BlockRemoved, BlockStored
from kvpage.sampling_params import SamplingParams

BLOCK_FP32 = 30 * 16 * 3 * 128 * 4  # SmolLM2: layers x block 16 x KV heads x (K+V dims) x 4 bytes
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
rng = random.Random(7)
SYSTEM = [[rng.randrange(200, 40000) for _ in range(100)] for _ in range(5)]  # 6 full blocks each
PROMPTS = [s + [rng.randrange(200, 40000) for _ in range(5)] for s in SYSTEM]


def engine(**kw) -> LLM:
    # 16 blocks: one request (7 blocks) at a time, and two prompts' blocks at most stay cached
    return LLM(kv_cache_memory=16 * BLOCK_FP32, max_model_len=128, dtype="float32", **kw)


def run(llm: LLM, prompts, salt=None) -> list[tuple[list[int], int]]:
    out = []
    for p in prompts:
        o = llm.generate({"prompt_token_ids": p, **({"cache_salt": salt} if salt else {})}, GREEDY, use_tqdm=False)[0]
        out.append((o.outputs[0].token_ids, o.num_cached_tokens))
    return out


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = engine(enable_prefix_caching=False)
    return [t for t, _ in run(llm, PROMPTS)]


def test_host_tier_hits_give_the_uncached_tokens(reference):
    llm = engine(kv_offload_memory=64 * BLOCK_FP32)
    first = run(llm, PROMPTS)
    again = run(llm, PROMPTS)  # the pool kept the last two; the others come back from the host tier
    assert [t for t, _ in first] == reference and [t for t, _ in again] == reference
    assert all(c == 96 for _, c in again)
    s = llm.engine.stats()
    assert s["host_hit_tokens"] >= 3 * 96 and s["blocks_loaded_host"] >= 18
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_disk_tier_survives_a_restart_and_keeps_salts_apart(tmp_path, reference):
    d = str(tmp_path / "kv")
    llm = engine(kv_offload_dir=d)
    assert [t for t, _ in run(llm, PROMPTS, salt="alice")] == reference
    llm.shutdown()
    llm = engine(kv_offload_dir=d)  # a new engine: nothing in its pool
    bob = run(llm, PROMPTS[:2], salt="bob")
    assert [t for t, _ in bob] == reference[:2] and all(c == 0 for _, c in bob)
    alice = run(llm, PROMPTS[:3], salt="alice")
    assert [t for t, _ in alice] == reference[:3] and all(c == 96 for _, c in alice)
    assert llm.engine.stats()["disk_hit_tokens"] == 3 * 96
    llm.shutdown()


def test_a_damaged_file_is_never_served(tmp_path, reference):
    d = tmp_path / "kv"
    llm = engine(kv_offload_dir=str(d))
    run(llm, PROMPTS)
    llm.shutdown()
    files = sorted(d.glob("*.kvblock"))
    assert len(files) >= 18
    for f in files:  # flip a byte in every payload: checksums fail, the prompts are computed afresh
        data = bytearray(f.read_bytes())
        data[-100] ^= 0x55
        f.write_bytes(bytes(data))
    llm = engine(kv_offload_dir=str(d))
    out = run(llm, PROMPTS[:3])
    assert [t for t, _ in out] == reference[:3]
    s = llm.engine.stats()
    assert s["disk_hit_tokens"] == 0 and s["disk_corrupt_blocks"] >= 3
    llm.shutdown()


def test_two_engines_on_one_directory(tmp_path, reference):
    d = str(tmp_path / "kv")
    a = engine(kv_offload_dir=d)
    b = engine(kv_offload_dir=d)
    assert "in use by another kvpage engine" in b.engine.stats()["disk_tier_status"]
    assert [t for t, _ in run(b, PROMPTS[:3])] == reference[:3]
    a.shutdown()
    b.shutdown()


def test_events_rebuild_the_pool_and_tiers_and_reset_clears_them(tmp_path):
    batches = []
    llm = engine(kv_offload_memory=8 * BLOCK_FP32, kv_offload_dir=str(tmp_path / "kv"),
                 kv_events_callback=batches.append)
    run(llm, PROMPTS)
    run(llm, PROMPTS[:2])
    llm.engine.worker.kv.tiers.disk.flush()
    llm.engine.step()  # the disk writer's events reach the next batch
    held: dict[str, set[bytes]] = {"device": set(), "host": set(), "disk": set()}
    for batch in batches:
        for e in batch:
            if isinstance(e, BlockStored):
                held[e.medium].update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                held[e.medium].difference_update(e.block_hashes)
    kv = llm.engine.kv
    assert held["device"] == set(kv.pool.cached) and held["device"]
    assert held["host"] == set(kv.tiers.host.cached) and held["host"]
    assert held["disk"] == set(kv.tiers.disk.hashes()) and held["disk"]
    assert llm.reset_prefix_cache() > 0
    assert type(batches[-1][-1]).__name__ == "AllBlocksCleared"
    assert run(llm, PROMPTS[:1])[0][1] == 0
    llm.shutdown()


def test_events_over_zeromq(tmp_path):
    zmq = pytest.importorskip("zmq")
    endpoint = f"ipc://{tmp_path}/events"
    llm = engine(kv_events_endpoint=endpoint)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    import time

    time.sleep(0.3)  # a PUB socket drops what it sends before the subscriber joined
    run(llm, PROMPTS[:1])
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"kv-events" and int.from_bytes(seq, "big") >= 0
    _, events = decode_batch(payload)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and all(len(h) == 32 for e in stored for h in e.block_hashes)
    assert stored[0].parent_block_hash is None and len(stored[0].token_ids) == 16 and stored[0].block_size == 16
    sub.close()
    llm.shutdown()


def test_offload_flags_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="prefix caching"):
        engine(kv_offload_memory="1GiB", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="give its directory"):
        engine(kv_offload_disk="1GiB")
    with pytest.raises(ValueError, match="holds no block"):
        engine(kv_offload_memory=1000)
    with pytest.raises(ValueError, match="paged KV policy"):
        engine(kv_offload_memory="64MiB", kv_policy="static")


@pytest.fixture(scope="module")
def tiny_window(tmp_path_factory):
    """A tiny random Mistral with a 24-position sliding window: its one KV group drops blocks as it slides."""
    from tests.helpers.tiny_models import make_hf_model

    path = tmp_path_factory.mktemp("mistral-window")
    make_hf_model(path, "mistral", kv_heads=2, window=24)
    return str(path)


def test_sliding_window_group_loads_its_window_from_the_tiers(tiny_window, tmp_path):
    """Only the blocks the window at the hit point still reads are loaded; tokens equal the uncached run's."""
    r = random.Random(1)
    prompts = [[r.randrange(3, 300) for _ in range(60)] for _ in range(6)]
    kw = dict(model=tiny_window, dtype="float32", block_size=4, max_model_len=128, kv_cache_memory=60 * 1024)
    ref = [t for t, _ in run(LLM(enable_prefix_caching=False, **kw), prompts)]
    d = str(tmp_path / "kv")
    llm = LLM(kv_offload_memory=200 * 1024, kv_offload_dir=d, **kw)
    assert [t for t, _ in run(llm, prompts)] == ref
    again = run(llm, prompts)
    assert [t for t, _ in again] == ref and all(c == 56 for _, c in again)
    s = llm.engine.stats()
    assert s["host_hit_tokens"] > 0 and s["blocks_loaded_host"] <= 6 * 7  # the window's blocks, not all 14
    llm.engine.kv.check_invariants()
    llm.shutdown()
    llm = LLM(kv_offload_dir=d, **kw)  # restarted: the window's blocks come from disk
    out = run(llm, prompts)
    assert [t for t, _ in out] == ref and all(c == 56 for _, c in out)
    assert llm.engine.stats()["disk_hit_tokens"] > 0
    llm.shutdown()


@pytest.mark.slow
def test_gemma3_hybrid_groups_through_the_tiers(tmp_path):
    """Gemma 3 (five sliding-window layers to one global): prompts longer than the 512-position window come back
    from the host tier and, after a restart, from disk, with the uncached run's greedy tokens (float32)."""
    r = random.Random(5)
    prompts = [[2] + [r.randrange(1000, 200000) for _ in range(620)] for _ in range(4)]
    kw = dict(model="gemma-3-270m", dtype="float32", max_model_len=768, kv_cache_memory="64MiB")
    ref = [t for t, _ in run(LLM(enable_prefix_caching=False, **kw), prompts)]
    d = str(tmp_path / "kv")
    llm = LLM(kv_offload_memory="256MiB", kv_offload_dir=d, **kw)
    run(llm, prompts)
    again = run(llm, prompts)
    assert [t for t, _ in again] == ref and all(c == 608 for _, c in again)
    assert llm.engine.stats()["host_hit_tokens"] >= 3 * 608
    llm.shutdown()
    llm = LLM(kv_offload_dir=d, **kw)
    out = run(llm, prompts)
    assert [t for t, _ in out] == ref and all(c == 608 for _, c in out)
    llm.engine.kv.check_invariants()
    llm.shutdown()
