"""The planner must reproduce the seeds' figures exactly."""

from __future__ import annotations

import json

import pytest

from kvpage.capacity import KVShape, canonical_dtype, kv_heads_per_rank, num_blocks_for_budget, plan_capacity
from kvpage.units import format_bytes, parse_size

KiB, MiB, GiB = 1024, 1024**2, 1024**3


def shape(layers=80, kv_heads=8, head_dim=128, dtype="fp16", **kw) -> KVShape:
    return KVShape("t", layers, kv_heads, head_dim, canonical_dtype(dtype), **kw)


def test_bytes_per_token_matches_the_seed_table():
    assert shape().bytes_per_token() == 320 * KiB
    assert shape(kv_heads=64).bytes_per_token() == int(2.5 * MiB)
    assert shape(kv_heads=1).bytes_per_token() == 40 * KiB
    assert shape(layers=32).bytes_per_token() == 128 * KiB
    assert shape(layers=96, kv_heads=96).bytes_per_token() == int(4.5 * MiB)
    assert format_bytes(shape().bytes_per_token()) == "320 KiB"
    assert format_bytes(shape(kv_heads=64).bytes_per_token()) == "2.5 MiB"
    assert format_bytes(shape(kv_heads=1).bytes_per_token()) == "40 KiB"


@pytest.mark.parametrize(
    ("layers", "kv_heads", "tokens", "expected"),
    [
        (80, 8, 4096, "1.25 GiB"),
        (80, 8, 32768, "10 GiB"),
        (80, 8, 131072, "40 GiB"),
        (32, 8, 4096, "512 MiB"),
        (32, 8, 32768, "4 GiB"),
        (96, 96, 4096, "18 GiB"),
        (96, 96, 32768, "144 GiB"),
        (80, 64, 4096, "10 GiB"),
    ],
)
def test_request_size_at_context(layers, kv_heads, tokens, expected):
    p = plan_capacity(shape(layers, kv_heads), 200 * GiB, context_len=tokens, max_model_len=131072)
    assert format_bytes(p.request_bytes_per_rank) == expected


def test_tp2_8gib_8k_with_4pct_tail_admits_six():
    p = plan_capacity(shape(), 8 * GiB, context_len=8192, tensor_parallel_size=2, tail_waste=0.04)
    assert p.kv_heads_per_rank == 4 and p.tp_layout == "sharded"
    assert p.request_bytes_per_rank == int(1.25 * GiB)
    assert round(p.request_bytes_per_rank_tail_estimate / GiB, 2) == 1.30
    assert p.paged_max_requests_tail_estimate == 6
    assert p.paged_max_requests == 6  # exact block rounding agrees
    assert p.bytes_per_block == int(2.5 * MiB) and p.num_blocks == 3276


def test_tp_sharding_and_replication():
    assert kv_heads_per_rank(8, 2) == (4, "sharded")
    assert kv_heads_per_rank(8, 3) == (8, "replicated")
    assert kv_heads_per_rank(1, 4) == (1, "replicated")
    p = plan_capacity(shape(), 8 * GiB, context_len=8192, tensor_parallel_size=3)
    assert p.tp_layout == "replicated" and p.bytes_per_token_per_rank == 320 * KiB
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        kv_heads_per_rank(8, 0)


def test_static_vs_paged_and_workload_mix():
    s = shape(layers=32)  # 128 KiB/token, 2 MiB blocks
    p = plan_capacity(s, 8 * GiB, context_len=1000, max_model_len=4096, mean_prompt_len=600, mean_output_len=400)
    assert p.num_blocks == 4096
    assert p.blocks_per_request == 63 and p.paged_max_requests == 4096 // 63
    assert p.static_blocks_per_request == 256 and p.static_max_requests == 16
    w = p.workload
    assert w.mean_live_tokens == 800
    assert w.paged_average == int(4096 * 16 / (800 + 7.5))
    assert w.paged_peak == 4096 // 63
    assert w.static == 16
    assert w.static_utilization == pytest.approx(800 / 4096)


def test_plan_rejects_bad_input_with_named_values():
    with pytest.raises(ValueError, match="holds no block"):
        plan_capacity(shape(), 100, context_len=10)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        plan_capacity(shape(), GiB, context_len=9000, max_model_len=8192)
    with pytest.raises(ValueError, match="no context length"):
        plan_capacity(shape(), GiB)
    with pytest.raises(ValueError, match="context_len must be positive, got 0"):  # not read as "the default"
        plan_capacity(shape(), GiB, context_len=0, max_model_len=8192)
    with pytest.raises(ValueError, match="max_model_len must be positive, got 0"):
        plan_capacity(shape(), GiB, context_len=10, max_model_len=0)
    with pytest.raises(ValueError, match="tail waste"):
        plan_capacity(shape(), GiB, context_len=10, tail_waste=1.5)
    with pytest.raises(ValueError, match="unknown KV dtype 'int3'"):
        KVShape("x", 1, 1, 1, "int3")
    with pytest.raises(ValueError, match="num_layers"):
        KVShape("x", 0, 1, 1)


def test_num_blocks_for_budget():
    assert num_blocks_for_budget(shape(), 8 * GiB, 16, tensor_parallel_size=2) == 3276


def test_units():
    assert parse_size("8GiB") == 8 * GiB
    assert parse_size("512MiB") == 512 * MiB
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("2g") == 2 * GiB
    assert parse_size("4096") == 4096
    for bad in ("8 parsecs", "", "GiB", "-1GiB"):
        with pytest.raises(ValueError, match="cannot read size"):
            parse_size(bad)
    assert format_bytes(1.25 * GiB) == "1.25 GiB" and format_bytes(100) == "100 B"


def test_plan_json_is_complete():
    p = plan_capacity(shape(), 8 * GiB, context_len=8192)
    d = json.loads(json.dumps(p.as_dict()))
    assert d["bytes_per_token"] == 327680 and d["shape"]["dtype_bytes"] == 2


def test_layer_types_gemma3_270m_at_32k():
    """Gemma 3 270M in bf16 at 32K tokens: every layer full is 18 x 32768 x 1 KiB = 576 MiB per request; by
    layer type, the 3 global layers keep 96 MiB and the 15 sliding layers their window's 33 blocks of 16."""
    from kvpage.model.registry import PRESETS

    cfg = PRESETS["gemma-3-270m"]
    windows = tuple(cfg.layer_window(i) for i in range(cfg.num_layers))
    shape = KVShape("gemma", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "bfloat16", windows=windows)
    plan = plan_capacity(shape, 4 * 2**30, context_len=32768)
    h = plan.hybrid
    assert h is not None and (h.full_layers, h.sliding_layers, h.window) == (3, 15, 512)
    assert h.request_bytes_full == 576 * 2**20 == plan.request_bytes_per_rank
    assert h.request_bytes_hybrid == 96 * 2**20 + 15 * 33 * 16 * 1024  # 103.7 MiB
    assert h.blocks_per_request_full == 6 * 2048 and h.blocks_per_request_hybrid == 2048 + 5 * 33
    assert h.ratio > 5
    at_8k = next(r for r in plan.context_table if r["context_len"] == 8192)
    assert at_8k["hybrid_request_bytes_per_rank"] == 24 * 2**20 + 15 * 33 * 16 * 1024


def test_int8_pages_with_keys_per_channel_are_priced_by_the_block_with_the_residual_block():
    shape = KVShape("s", 30, 3, 64, "int8", int8_keys="channel")
    page = 3 * (32 * 64 + 2 * 64 + 4 + 32 * 66)  # per head: key codes, zero + step codes, units; value rows
    assert shape.bytes_per_block(32) == 30 * page and shape.bytes_per_block(32, 1, 2) == 2 * page // 3
    assert shape.bytes_per_token(block_size=32) == 30 * page / 32
    plan = plan_capacity(shape, 1000 * 30 * page + 5, block_size=32, context_len=4096, max_model_len=8192)
    assert (plan.num_blocks, plan.blocks_per_request) == (1000, 4096 // 32 + 1)  # + the filling block's keys
    assert plan.paged_max_requests == 1000 // 129 and plan.request_bytes_per_rank == 129 * 30 * page
    # the other dtypes ignore the choice; an unknown one is an error
    assert KVShape("s", 30, 3, 64, "bfloat16", int8_keys="channel").bytes_per_block(32) == 30 * 3 * 2 * 128 * 32
    with pytest.raises(ValueError, match="int8_keys"):
        KVShape("s", 30, 3, 64, "int8", int8_keys="columns")


def test_hybrid_plan_with_keys_per_channel_counts_each_groups_residual_block():
    windows = tuple(512 if i % 6 != 5 else None for i in range(18))  # Gemma 3's five sliding to one global
    shape = KVShape("g", 18, 1, 256, "int8", windows=windows, int8_keys="channel")
    h = plan_capacity(shape, 2**30, block_size=32, context_len=8192, max_model_len=8192).hybrid
    # 6 groups of 3 layers: 5 sliding (ceil(511 / 32) + 1 = 17 blocks), 1 full (256), and 6 residual blocks
    assert h.blocks_per_request_hybrid == 5 * 17 + 256 + 6 and h.blocks_per_request_full == 6 * 256 + 6
    assert h.bytes_per_block == shape.bytes_per_block(32, 1, 3)
