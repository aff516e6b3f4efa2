"""Quantized KV pages on real models: the engine runs int8 and fp8 caches end to end (prefix hits, forks with
copy-on-write, swap preemption, nothing leaked), what it sizes equals the planner and the simulator, and the
teacher-forced accuracy against the float32 cache stays where benchmarks/kv_quant.py measured it (a guard on the
quantization with some margin for other CPUs' summation order; BENCHMARKS.md has the figures against the 99% target)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpage.capacity import KVShape
from kvpage.engine.llm import LLM
from kvpage.envs import KernelConfig
from kvpage.model.loader import load_model
from kvpage.sampling_params import SamplingParams
from kvpage.worker.kv_cache import kv_bytes_per_block, kv_torch_dtype
from kvpage.worker.kv_calibration import calibrate_kv_transforms
from kvpage.worker.scoring import chunked_logits
from tests.helpers.marks import slow

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "def fibonacci(n):\n    ", "Paged attention splits the KV cache into blocks"]


def assert_drained(llm: LLM) -> None:
    kv = llm.engine.kv
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"


@pytest.mark.parametrize("kv_dtype", ["int8", slow("fp8"), slow("fp8_e5m2")])
def test_engine_runs_quantized_pages_with_hits_forks_and_swaps(kv_dtype):
    block = kv_bytes_per_block(load_model().config, 16, kv_torch_dtype(kv_dtype))
    # Every step on one product path (no few-token quantized kernel): a row's arithmetic then does not depend on
    # how many others share its step, so a preempted run must give the roomy run's tokens exactly
    same_path = KernelConfig(quant_max_tokens=0)
    llm = LLM(kv_cache_dtype=kv_dtype, kv_cache_memory=24 * block, max_model_len=256, swap_space=48 * block,
              preemption_mode="swap", kernels=same_path, reserve_certain_growth=False)
    assert llm.engine.worker.kv_cache.tensors[0].dtype == kv_torch_dtype(kv_dtype)
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = [f"{p} ({i})" for i in range(2) for p in PROMPTS]
    outs = llm.generate(prompts, greedy, use_tqdm=False)  # 8 x ~70 tokens (5 blocks each) in 24 blocks: preemptions
    assert all(len(o.outputs[0].token_ids) == 60 for o in outs)
    assert llm.engine.stats()["preemptions"] > 0
    # swapped pages come back with their scales: the same tokens as an engine that never preempts
    roomy = LLM(kv_cache_dtype=kv_dtype, kv_cache_memory=200 * block, max_model_len=256, kernels=same_path)
    expected = roomy.generate(prompts, greedy, use_tqdm=False)
    assert roomy.engine.stats()["preemptions"] == 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    twins = llm.generate(PROMPTS[1], SamplingParams(n=2, temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert twins.outputs[0].token_ids == twins.outputs[1].token_ids  # forked pages, copied on write
    again = llm.generate(PROMPTS[1] * 3, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    hit = llm.generate(PROMPTS[1] * 3, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0 and hit.outputs[0].token_ids == again.outputs[0].token_ids
    assert_drained(llm)
    ops = llm.engine.worker.runner.model.layers[0].self_attn.backend.ops
    if kv_dtype == "int8" and ops.packed_int8_layout:  # SmolLM2's int8 pages in the packed layout (VNNI builds)
        on_tiles = ops.config.amx_decode and ops.amx_int8_decode_available()  # AMX byte tiles
        assert ops.last_decode_kernel() == ("amx-int8-packed" if on_tiles else "avx512-int8-packed")
    if kv_dtype.startswith("fp8") and ops.packed_fp8_layout:  # fp8 pages packed (where kv_layout auto says so)
        assert ops.last_decode_kernel() == "avx512-fp8-packed"


def test_planner_worker_and_simulator_agree_on_bytes_per_block():
    from argparse import Namespace

    from kvpage.entrypoints.simulate import build_model, kv_pool_layout

    cfg = load_model().config
    for name, keys, size in [(n, "rows", 16) for n in ("bfloat16", "float32", "int8", "fp8_e4m3", "fp8_e5m2")] + \
            [("int8", "channel", 16), ("int8", "channel", 32)]:
        shape = KVShape(cfg.name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, name, int8_keys=keys)
        worker = kv_bytes_per_block(cfg, size, kv_torch_dtype(name), channel_keys=keys == "channel")
        args = Namespace(model="SmolLM2-135M-Instruct", dtype="bfloat16", kv_cache_dtype=name, int8_keys=keys,
                         block_size=size, tensor_parallel_size=1)
        sim = build_model(args)
        assert shape.bytes_per_block(size) == worker == kv_pool_layout(args, cfg)[1], (name, keys)
        assert sim.kv_bytes_per_token * size == worker, (name, keys)
    # one byte per value and a 2-byte scale per K and per V row: 30 layers x 3 heads x 2 x (64 + 2) bytes
    assert kv_bytes_per_block(cfg, 16, torch.int8) == 30 * 3 * 2 * 66 * 16
    # keys per channel: 32 x 64 codes, 64 zero and 64 step codes, 4 bytes of units, then 32 value rows of 66
    assert kv_bytes_per_block(cfg, 32, torch.int8, channel_keys=True) == 30 * 3 * (32 * 64 + 128 + 4 + 32 * 66)


@pytest.mark.slow
def test_teacher_forced_accuracy_against_the_float32_cache():
    lm = load_model(dtype="float32")
    for name in ("int8", "fp8_e4m3"):  # the engine's quantized caches run with their transforms
        calibrate_kv_transforms(lm, kv_torch_dtype(name))
    text = "\n\n".join((ROOT / p).read_text() for p in ("README.md", "docs/kv.md"))
    ids = lm.tokenizer.encode(text)[:601]
    ref = chunked_logits(lm, ids, torch.float32)[:-1]
    target = torch.tensor(ids[1:])
    ppl_ref = torch.exp(torch.nn.functional.cross_entropy(ref, target))
    agree = {}
    for name in ("int8", "fp8_e4m3"):
        got = chunked_logits(lm, ids, kv_torch_dtype(name))[:-1]
        agree[name] = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
        ppl = torch.exp(torch.nn.functional.cross_entropy(got, target))
        assert abs(float(ppl / ppl_ref) - 1) < (0.01 if name == "int8" else 0.03), (name, ppl, ppl_ref)
    print(f"teacher-forced top-1 agreement with the float32 cache over 600 positions: {agree}")
    assert agree["int8"] >= 0.98 and agree["fp8_e4m3"] >= 0.94, agree
