"""The simulator under tensor parallelism: per-rank work and KV pool, the ring all-reduce term, and the same
blocks per rank as `kvpage plan -tp` for the same per-rank budget."""

from __future__ import annotations

import json

import pytest

from kvpage.core.step import StepFeatures
from kvpage.entrypoints.cli import main
from kvpage.sim.cost import ModelSpec, RooflineCost, load_machine
from kvpage.sim.tp_cost import LINKS, LinkSpec, allreduce_seconds, gather_seconds, rank_spec, tensor_parallel_cost

LLAMA8B = ModelSpec("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, 2.0, 131072)


def test_rank_spec_shares_heads_mlp_and_kv():
    r = rank_spec(LLAMA8B, 4)
    assert (r.num_attention_heads, r.num_kv_heads, r.intermediate_size) == (8, 2, 3584)
    assert r.kv_bytes_per_token == 131072 // 4 and r.head_params == LLAMA8B.head_params // 4  # vocabulary slice
    rep = rank_spec(ModelSpec("x", 2, 64, 6, 3, 16, 128, 100, 4.0, 384), 2)  # 3 KV heads over 2: replicated
    assert rep.num_kv_heads == 3 and rep.kv_bytes_per_token == 384


def test_ring_allreduce_time():
    link = LinkSpec(100e9, 5e-6)
    assert allreduce_seconds(1e6, 1, link) == 0
    assert allreduce_seconds(1e6, 4, link) == pytest.approx(6 * 5e-6 + 1.5 * 1e6 / 100e9)


def test_step_is_the_rank_share_plus_two_allreduces_per_layer():
    machine = load_machine("a100-sxm", 2.0)
    f = StepFeatures(num_tokens=64, num_seqs=64, context_tokens=64 * 1000, attn_pairs=64 * 1000, logit_rows=64)
    one = RooflineCost(LLAMA8B, machine).parts(f)
    tp = tensor_parallel_cost(LLAMA8B, machine, 16, 4, LINKS["nvlink3"]).parts(f)
    assert tp["linear"] < one["linear"] and tp["attention"] == pytest.approx(one["attention"] / 4)
    assert tp["lm_head"] == pytest.approx(one["lm_head"] / 4)
    assert tp["allreduce"] == pytest.approx(2 * 32 * allreduce_seconds(64 * 4096 * 2, 4, LINKS["nvlink3"]))
    assert tp["gather"] == pytest.approx(gather_seconds(64 * 128256 * 2, 4, LINKS["nvlink3"]))


def test_cli_pool_per_rank_equals_the_planners(capsys):
    argv = ["--model", "Llama-3-8B", "--kv-memory", "2GiB", "--dtype", "bfloat16"]
    assert main(["plan", *argv[:4], "--kv-memory", "2GiB", "-tp", "4", "--json", "--context-len", "2048"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert main(["simulate", "--num-requests", "20", "--json", "--machine", "a100-sxm", "--link", "nvlink3",
                 "-tp", "4", *argv]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["config"]["num_blocks"] == plan["num_blocks"] and rep["tensor_parallel_size"] == 4
    assert rep["kv_bytes_per_token"] == plan["bytes_per_token_per_rank"]
    assert "tensor parallel x4 over NVLink 3" in rep["cost_model"]
    assert main(["simulate", "--num-requests", "5", "-tp", "2"]) == 2  # SmolLM2's 9 heads
    assert "9 attention heads do not divide over 2 ranks" in capsys.readouterr().err
