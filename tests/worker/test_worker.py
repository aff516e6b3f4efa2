"""KV sizing from a memory budget, dtype options and bad settings."""

from __future__ import annotations

import logging

import pytest

from kvpage.capacity import KVShape, num_blocks_for_budget
from kvpage.config import CacheConfig, ModelRunConfig
from kvpage.kv import KVSequence
from kvpage.pages import thp_mode
from kvpage.units import parse_size
from kvpage.worker.model_runner import ScheduledSeq
from kvpage.worker.worker import Worker


def test_worker_sizes_the_pool_like_the_planner(caplog):
    with caplog.at_level(logging.INFO, logger="kvpage.worker.worker"):
        w = Worker(ModelRunConfig(dtype="bfloat16"), CacheConfig(kv_cache_memory="256MiB", swap_space="32MiB"))
    cfg = w.lm.config
    shape = KVShape("smol", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "bfloat16")
    assert w.num_blocks == num_blocks_for_budget(shape, parse_size("256MiB"), 16) == 728
    assert w.num_swap_blocks == 91
    assert "728 blocks x 16 tokens = 11648 tokens" in caplog.text and "max concurrency" in caplog.text
    k = w.kv_cache.layers[0]
    assert tuple(k.shape) == (2, 728, 16, cfg.num_kv_heads, cfg.head_dim) and len(w.kv_cache.layers) == 30
    m = w.make_kv_manager()
    assert m.num_blocks == 728 and m.num_swap_blocks == 91 and m.max_model_len == 8192


def test_kv_cache_dtype_can_differ_from_the_run_dtype():
    w = Worker(ModelRunConfig(dtype="bfloat16", max_model_len=512),
               CacheConfig(kv_cache_memory="64MiB", kv_cache_dtype="float32"))
    assert w.kv_cache.layers[0].dtype.is_floating_point and w.kv_cache.dtype.itemsize == 4
    ids = w.lm.tokenizer.encode("The capital of France is")
    m = w.make_kv_manager()
    m.allocate_slots(KVSequence("a", ids), len(ids))
    logits = w.runner.execute([ScheduledSeq("a", ids, 0, m.block_table("a"))])["a"]
    assert w.lm.tokenizer.decode([int(logits.argmax())]).strip() == "Paris"


@pytest.mark.parametrize(
    ("model_kw", "cache_kw", "message"),
    [
        ({}, {"kv_cache_memory": "16MiB"}, "less than one sequence of max_model_len=8192"),
        ({"max_model_len": 100000}, {}, "exceeds SmolLM2-135M-Instruct's context length 8192"),
        ({"dtype": "int8"}, {}, "dtype must be one of auto, float32, bfloat16"),
        ({}, {"kv_cache_dtype": "fp4"}, "kv_cache_dtype must be one of"),
        ({}, {"block_size": 0}, "block_size must be an integer in"),
        ({}, {"kv_cache_memory": "lots"}, "cannot read size 'lots'"),
        ({}, {"watermark": 2.0}, "watermark must be a fraction"),
    ],
)
def test_bad_settings_are_named(model_kw, cache_kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Worker(ModelRunConfig(**model_kw), CacheConfig(**cache_kw))



def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_prefault_makes_the_pages_resident():
    import mmap

    import torch

    from kvpage.pages import prefault_pages

    # A fresh anonymous mapping is never resident before it is touched (a torch.empty of the same size may
    # reuse memory the allocator already holds after other tests).
    buf = mmap.mmap(-1, 64 * 2**20)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    before = _rss_bytes()
    how = prefault_pages([t, torch.empty(0)])
    assert how in ("madvise", "zero-fill")
    assert _rss_bytes() - before >= 60 * 2**20


def test_kv_prefault_option_reaches_the_cache(caplog):
    with caplog.at_level(logging.INFO, logger="kvpage.worker.kv_cache"):
        Worker(ModelRunConfig(dtype="bfloat16"), CacheConfig(kv_cache_memory="256MiB", kv_prefault=True))
    assert "KV pages faulted in" in caplog.text


def _thp_eligible(addr: int) -> bool | None:
    """The THPeligible flag of the mapping holding ``addr`` (None where smaps does not report it)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "THPeligible:":
                return line.split()[1] == "1"
    return None


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off here")
def test_kv_cache_asks_for_huge_pages():
    import mmap

    import torch

    from kvpage.pages import advise_huge_pages

    # a fresh private mapping of its own (as the allocator's), so its flags are this test's
    buf = mmap.mmap(-1, 8 * 2**20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    advised = advise_huge_pages([t, torch.empty(0)])
    assert 6 * 2**20 <= advised <= 8 * 2**20  # the whole 2 MiB pages inside the buffer
    eligible = _thp_eligible(-(-t.data_ptr() // 2**21) * 2**21)
    if eligible is None:
        pytest.skip("smaps has no THPeligible field")
    assert eligible


def test_kv_huge_pages_option_reaches_the_cache():
    on = Worker(ModelRunConfig(dtype="bfloat16"), CacheConfig(kv_cache_memory="256MiB", kv_huge_pages=True))
    off = Worker(ModelRunConfig(dtype="bfloat16"), CacheConfig(kv_cache_memory="256MiB", kv_prefault=True,
                                                               kv_huge_pages=False))
    assert off.kv_cache.huge_page_bytes == 0 and "2 MiB pages" not in off.describe()
    assert CacheConfig().huge_pages is False and CacheConfig(kv_prefault=True).huge_pages is True
    if thp_mode() in ("madvise", "always"):
        assert on.kv_cache.huge_page_bytes > 0 and "2 MiB pages advised" in on.describe()


def test_channel_pages_move_whole_blocks_with_their_keys_and_residuals():
    """KVCache of int8 pages with keys per channel: one [blocks, page_bytes] tensor per layer of a group; a
    block copy, a swap out and in, and the disk tier's bytes carry every byte of a block (rounded keys, value
    rows, or a residual block's unrounded keys); the worker sizes its pool in those pages."""
    import torch

    from kvpage.attention.kv_channel import page_bytes
    from kvpage.model.loader import load_model
    from kvpage.worker.kv_cache import KVCache, kv_bytes_per_block, model_layout

    cfg = load_model().config
    layout = model_layout(cfg, channel_keys=True)
    assert [g.spec.kind for g in layout.groups] == ["full", "residual"] and layout.residual_of == {0: 1}
    cache = KVCache(cfg, 6, 32, torch.int8, num_host_blocks=3, layout=layout, channel_keys=True)
    page = page_bytes(32, cfg.num_kv_heads, cfg.head_dim)
    assert [tuple(t.shape) for t in cache.tensors] == [(6, page)] * cfg.num_layers
    assert cache.block_nbytes == kv_bytes_per_block(cfg, 32, torch.int8, layout, channel_keys=True)
    for t in cache.tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    before = [t.clone() for t in cache.tensors]
    cache.copy_blocks([(1, 4)])
    cache.swap_out([(2, 0)])
    cache.swap_in([(0, 5)])
    payload = cache.read_blocks([3])[0]
    cache.write_blocks([(payload, 0)])
    for t, b in zip(cache.tensors, before, strict=True):
        assert torch.equal(t[4], b[1]) and torch.equal(t[5], b[2]) and torch.equal(t[0], b[3])
    with pytest.raises(ValueError, match="format of int8 pages"):
        KVCache(cfg, 6, 32, torch.bfloat16, layout=layout, channel_keys=True)
    with pytest.raises(ValueError, match="residual-key groups"):
        KVCache(cfg, 6, 32, torch.int8, channel_keys=True)
