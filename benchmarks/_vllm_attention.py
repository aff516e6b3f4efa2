"""vLLM CPU's paged decode attention op timed on given shapes; run by kernels.py under vLLM's own Python.

Needs no kvpage (vLLM's environment does not have it). Reads a JSON job on stdin:
``{"cases": [[batch, context], ...], "block_size": 128, "heads": [9, 3, 64], "threads": 2}`` and prints one
JSON object: ``{"isa": ..., "results": [[batch, context, median_ms], ...]}``. The K/V cache is laid out as
vLLM's CPU backend allocates it ([blocks, kv_heads, 2 * block_size, head_dim], keys then values per head) with
the blocks of every sequence randomly permuted, bf16, one decode query per sequence.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
from vllm import _custom_ops as ops


def _load_common():
    """benchmarks/_common.py (stdlib only) by path: kernels.py runs this script with -I, so that the benchmarks
    directory, whose kernels.py transformers would take for the "kernels" package, stays off sys.path."""
    spec = importlib.util.spec_from_file_location("_common", Path(__file__).with_name("_common.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


median_seconds = _load_common().median_seconds


def time_case(b: int, ctx: int, bs: int, hq: int, hkv: int, d: int, isa: str) -> float:
    nblk = -(-ctx // bs)
    cache = torch.randn(b * nblk, hkv, 2 * bs, d).bfloat16()
    key_cache, value_cache = cache.chunk(2, dim=2)  # the views vLLM's backend makes of its cache tensor
    tables = torch.randperm(b * nblk).to(torch.int32).view(b, nblk)
    qsl = torch.arange(b + 1, dtype=torch.int32)
    lens = torch.full((b,), ctx, dtype=torch.int32)
    q = torch.randn(b, hq, d).bfloat16()
    out = torch.empty_like(q)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=b, num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=lens, dtype=torch.bfloat16,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True)

    def call() -> None:
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl, seq_lens=lens,
            scale=d**-0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=tables, softcap=0.0,
            scheduler_metadata=meta, s_aux=None)

    kv_bytes = 2 * b * ctx * hkv * d * 2
    return median_seconds(call, 20 if kv_bytes < 2**28 else 5) * 1e3


def main() -> None:
    job = json.load(sys.stdin)
    torch.set_num_threads(job["threads"])
    torch._C._cpu._init_amx()  # the tile-state permission vLLM's CPU worker asks for at startup
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    hq, hkv, d = job["heads"]
    bs = job["block_size"]
    isa = _get_attn_isa(torch.bfloat16, bs, d)
    results = [[b, ctx, time_case(b, ctx, bs, hq, hkv, d, isa)] for b, ctx in job["cases"]]
    print(json.dumps({"isa": isa, "results": results}))


if __name__ == "__main__":
    main()
