"""int8 pages with keys per channel (KVPAGE_INT8_KEYS=channel) through the engine, on the compiled and the
reference backends: the filling block's keys live in the residual-key group (kv/residual.py), so preemption by
swap, forks with copy-on-write and prefix hits must give the tokens of a run that never needed them, and
nothing leaks."""

from __future__ import annotations

import random

import pytest

from kvpage.attention.kv_channel import page_bytes
from kvpage.engine.llm import LLM
from kvpage.envs import KernelConfig
from kvpage.sampling_params import SamplingParams
from tests.helpers.kernels import have_cxx

CHANNEL = KernelConfig(int8_keys="channel")
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "mistral"])
def tiny(request, tmp_path_factory) -> str:
    """A tiny random Llama (one full group) and a Mistral with a 24-position window (one sliding group)."""
    from tests.helpers.tiny_models import make_hf_model

    path = tmp_path_factory.mktemp(request.param)
    make_hf_model(path, request.param, kv_heads=2, window=24 if request.param == "mistral" else None)
    return str(path)


def engine(model: str, blocks: int, backend: str, **kw) -> LLM:
    return LLM(model=model, dtype="float32", kv_cache_dtype="int8", attention_backend=backend, block_size=8,
               kv_cache_memory=blocks * _page(model), max_model_len=128, kernels=CHANNEL, **kw)


def _page(model: str) -> int:
    """Bytes of one pool block: the tiny models' two layers of 2 KV heads of size 16 (tests/helpers/tiny_models)."""
    return 2 * page_bytes(8, 2, 16)


def drained(llm: LLM) -> None:
    kv = llm.engine.kv
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_swaps_forks_and_hits_read_the_keys_a_roomy_run_reads(tiny, backend):
    if backend == "cpu" and not have_cxx():
        pytest.skip("no C++ compiler: kernels cannot be built")
    r = random.Random(3)
    prompts = [{"prompt_token_ids": [r.randrange(3, 300) for _ in range(r.randrange(5, 30))]} for _ in range(6)]
    roomy = engine(tiny, 400, backend)
    worker = roomy.engine.worker
    assert worker.lm.model.layers[0].self_attn.backend.name == backend and worker.bytes_per_block == _page(tiny)
    # calibrated under the dtype its layers look their transform up by: the cache tensors' (bytes)
    pages = worker.kv_cache.tensors[0].dtype
    assert all(pages in layer.self_attn.attend.transforms for layer in worker.lm.model.layers)
    assert [g.spec.kind for g in roomy.engine.worker.layout.groups][-1] == "residual"
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, GREEDY, use_tqdm=False)]
    assert roomy.engine.stats()["preemptions"] == 0
    tight = engine(tiny, 26, backend, swap_space=80 * _page(tiny), preemption_mode="swap",
                   reserve_certain_growth=False)  # admission into room the outputs need: swaps
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, GREEDY, use_tqdm=False)]
    assert tight.engine.stats()["preemptions"] > 0
    assert got == expected  # swapped residual blocks come back with the keys they held
    twins = roomy.generate(prompts[0], SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True),
                           use_tqdm=False)[0]
    assert all(c.token_ids == expected[0][:20] for c in twins.outputs)  # forked residual blocks, copied on write
    hit = roomy.generate(prompts[1], GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0 and hit.outputs[0].token_ids == expected[1]
    drained(roomy)
    drained(tight)


def test_planner_worker_and_simulator_price_the_pages_alike(tiny):
    """`kvpage plan`, `kvpage simulate` and the engine's pool: the same bytes per block, blocks in a budget,
    KV groups (the residual's included) and blocks a max_model_len sequence holds."""
    from argparse import Namespace

    from kvpage.capacity import plan_capacity
    from kvpage.entrypoints.plan import shape_from_args
    from kvpage.entrypoints.simulate import kv_pool_layout, load_model_config

    worker = engine(tiny, 100, "reference").engine.worker
    budget = 100 * _page(tiny) + 7
    shape = shape_from_args(Namespace(model=tiny, layers=None, kv_heads=None, head_dim=None, dtype="int8",
                                      int8_keys="channel"))
    plan = plan_capacity(shape, budget, block_size=8, context_len=128, max_model_len=128)
    per_seq = sum(g.spec.max_blocks(8, 128) for g in worker.layout.groups)
    # the plan's block spans every layer, the pool's one group's
    assert plan.bytes_per_block * worker.layout.layers_per_group == worker.bytes_per_block * shape.num_layers
    if plan.hybrid:  # the window's group and its residual
        assert (plan.hybrid.bytes_per_block, plan.hybrid.num_blocks) == (worker.bytes_per_block, worker.num_blocks)
        assert plan.hybrid.blocks_per_request_hybrid == per_seq
    else:
        assert (plan.num_blocks, plan.blocks_per_request) == (worker.num_blocks, per_seq)
    args = Namespace(model=tiny, dtype="float32", kv_cache_dtype="int8", int8_keys="channel", block_size=8,
                     tensor_parallel_size=1)
    layout, block_bytes = kv_pool_layout(args, load_model_config(tiny))
    assert layout == worker.layout and block_bytes == worker.bytes_per_block
    rows = kv_pool_layout(Namespace(**{**vars(args), "int8_keys": "rows"}), load_model_config(tiny))[1]
    assert rows < block_bytes  # the channel parameters and nothing else: no residual block inside a page
