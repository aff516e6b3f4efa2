"""The compiled CPU kernels against the reference backend: random shapes, block sizes, ragged lengths,
GQA ratios, float32, bfloat16 and float16 caches, contexts longer than one partition."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from kvpage.attention.backends.cpu import CpuPagedAttention
from kvpage.attention.backends.reference import ReferenceAttention
from kvpage.attention.metadata import AttentionMetadata
from kvpage.envs import KernelConfig
from kvpage.ops import PARTITION_SIZE, kernels, kernels_error, load_kernels, pack_kv_rows
from tests.helpers.kernels import have_cxx, scatter_tables
from tests.helpers.paged_cases import LAYOUTS, dense_reference, make_case

pytestmark = pytest.mark.skipif(not have_cxx(), reason="no C++ compiler: kernels cannot be built")


def test_kernels_build_where_a_compiler_exists():
    assert load_kernels() is not None, kernels_error()


def test_precompiled_header_is_compiled_with_the_sources_flags():
    """GCC takes the precompiled ATen headers only from a compile with the sources' own options and parses the
    text otherwise (correct, ~2x slower): the header's flags are the ones torch's build.ninja gave the sources."""
    from kvpage.ops import build

    assert load_kernels() is not None, kernels_error()
    name = f"kvpage_kernels_{build.build_tag()}"
    with build._build_lock(name) as build_dir:
        ninja = (build_dir / "build.ninja").read_text()
        cflags = next(line for line in ninja.splitlines() if line.startswith("cflags = ")).split()[2:]
        assert cflags == [*build._compile_flags(name), "-include", str(build_dir / build._PCH)]
        assert (build_dir / build._PCH).read_text().endswith("#include <ATen/ATen.h>\n")
        assert not (build_dir / f"{build._PCH}.gch").exists()  # deleted after the build: ~0.4 GB


@pytest.mark.parametrize("block_size", [1, 4, 16, 32, 128])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 16), (9, 3, 64), (8, 1, 128), (6, 2, 32)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_matches_reference_fp32(block_size, heads, kv_heads, dim, layout):
    """Both storage orders the kernels take: a plain contiguous [2, blocks, ...] tensor and the engine's
    block-major view (a block's K and V adjacent)."""
    rng = random.Random(block_size * 100 + heads * 10 + dim)
    ops = load_kernels()
    for _ in range(3):
        q, k, v, cache, meta = make_case(rng, block_size, heads, kv_heads, dim, torch.float32, torch.float32)
        ref_cache, ker_cache = cache.clone(), LAYOUTS[layout](cache)
        ref = ReferenceAttention().forward(q, k, v, ref_cache, meta, dim**-0.5)
        ops.reshape_and_cache(k, v, ker_cache, meta.slot_mapping)
        assert torch.equal(ker_cache, ref_cache), "the slot write must be exact"
        out = ops.paged_attention(q, ker_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, dim**-0.5,
                                  PARTITION_SIZE)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("kv_dtype", "q_dtype"), [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                   (torch.float32, torch.bfloat16), (torch.float16, torch.float32),
                                                   (torch.float16, torch.bfloat16)])
def test_kernel_bf16_paths(kv_dtype, q_dtype):
    rng = random.Random(7)
    ops = load_kernels()
    for _ in range(4):
        q, k, v, cache, meta = make_case(rng, 16, 9, 3, 64, kv_dtype, q_dtype)
        ref_cache, ker_cache = cache.clone(), cache.clone()
        # The reference upcasts to float32 here so both compute in float32 from the same bf16 inputs.
        ref = ReferenceAttention().forward(q.float(), k.float(), v.float(), ref_cache, meta, 0.125)
        ops.reshape_and_cache(k, v, ker_cache, meta.slot_mapping)
        assert torch.equal(ker_cache, ref_cache)
        out = ops.paged_attention(q, ker_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.125,
                                  PARTITION_SIZE)
        assert out.dtype == q_dtype
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 1, 128), (4, 4, 64)])
@pytest.mark.parametrize("long", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_half_size_cache_vectorized_path_matches_reference(block_size, heads, kv_heads, dim, long, layout, q_dtype,
                                                           kv_dtype):
    """A bf16 or float16 cache with head size 64/128 takes a vectorized path: every block size (chunks shorter
    and longer than 16 keys), masked tails, GQA groups and context partitions that cut blocks. On AVX2 builds
    that is the row kernel widening 16-bit values to float32 in registers (named avx2-bf16 / avx2-f16), for bf16
    and float32 queries alike; with float32 queries it computes exactly what the reference does in float32 on
    the same rounded cache, so the tolerance is float32's."""
    rng = random.Random(block_size * 1000 + heads * 10 + dim + long)
    ops = load_kernels()
    exact = q_dtype == torch.float32
    for _ in range(3):
        q, k, v, cache, meta = make_case(rng, block_size, heads, kv_heads, dim, kv_dtype, q_dtype, long=long)
        ref_cache, ker_cache = cache.clone(), LAYOUTS[layout](cache)
        ref = ReferenceAttention().forward(q.float(), k.float(), v.float(), ref_cache, meta, dim**-0.5)
        ops.reshape_and_cache(k, v, ker_cache, meta.slot_mapping)
        for part in (PARTITION_SIZE, 17) if long else (PARTITION_SIZE,):
            out = ops.paged_attention(q, ker_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                      dim**-0.5, part)
            if ops.f32_gemm_available():  # an AVX2 + FMA build without AVX-512
                assert ops.last_decode_kernel() == {torch.bfloat16: "avx2-bf16", torch.float16: "avx2-f16"}[kv_dtype]
            if exact:
                torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
            else:
                torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_long_contexts_split_into_partitions():
    rng = random.Random(3)
    ops = load_kernels()
    for _ in range(3):
        q, k, v, cache, meta = make_case(rng, 16, 8, 2, 64, torch.float32, torch.float32, long=True)
        ref_cache, ker_cache = cache.clone(), cache.clone()
        ref = ReferenceAttention().forward(q, k, v, ref_cache, meta, 0.125)
        ops.reshape_and_cache(k, v, ker_cache, meta.slot_mapping)
        for part in (PARTITION_SIZE, 64, 17):
            out = ops.paged_attention(q, ker_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.125,
                                      part)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize("block_size", [1, 7, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_stream_splits_its_context_over_the_threads(threads, block_size, dtype):
    """Fewer decode sequences than threads (one stream): contexts shorter than a partition are cut into one
    part per thread (at least 64 keys, multiples of 16, cuts inside blocks for odd block sizes) and merged;
    results match the dense reference at every context length around the cuts."""
    ops = load_kernels()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(block_size)
        for ctx in (1, 63, 64, 65, 127, 129, 200, 333):
            nblocks = -(-ctx // block_size)
            cache = torch.full((2, nblocks + 3, block_size, 2, 64), float("nan"), dtype=dtype)
            table = torch.randperm(nblocks + 3, generator=g)[:nblocks]
            for p in range(ctx):
                cache[:, table[p // block_size], p % block_size] = torch.randn(2, 2, 64, generator=g).to(dtype)
            q_dtype = torch.float32 if dtype == torch.float16 else dtype  # float16 is a cache dtype only
            q = torch.randn(1, 6, 64, generator=g).to(q_dtype)
            tables, lens = table[None].clone(), torch.tensor([ctx])
            ref = dense_reference(q, cache, tables, lens, 0.125)
            tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
            for split in (True, False):  # KernelConfig.split_short: both ways give the reference
                out = ops.paged_attention(q, cache, tables, torch.arange(2), lens, 0.125, PARTITION_SIZE, False, split)
                torch.testing.assert_close(out.float(), ref, **tol)
    finally:
        torch.set_num_threads(before)


def test_kernel_rejects_bad_input():
    ops = load_kernels()
    cache = torch.zeros(2, 4, 16, 2, 8)
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        ops.reshape_and_cache(torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), cache, torch.tensor([64]))
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        ops.paged_attention(torch.zeros(1, 3, 8), cache, torch.zeros(1, 1, dtype=torch.long),
                            torch.tensor([0, 1]), torch.tensor([1]), 1.0, 512)
    q, table = torch.zeros(3, 2, 8), torch.tensor([[0, 1], [2, 3]])
    bad_batches = [  # (query_start_loc, seq_lens, block_tables, error): each would read outside query or cache
        (torch.tensor([0, 1]), torch.tensor([1, 2]), table, "seqs \\+ 1"),
        (torch.tensor([0, 1, 2]), torch.tensor([1, 2]), table, "from 0 to the 3 query rows"),
        (torch.tensor([0, 2, 1, 3]), torch.tensor([2, 1, 1]), torch.zeros(3, 1, dtype=torch.long), "decreases"),
        (torch.tensor([0, 1, 3]), torch.tensor([1, 1]), table, "fewer keys"),
        (torch.tensor([0, 1, 3]), torch.tensor([1, 40]), table, "more blocks than its table row"),
        (torch.tensor([0, 1, 3]), torch.tensor([1, 20]), torch.tensor([[0, 1], [2, 4]]), "block 4 outside"),
        (torch.tensor([0, 1, 3]), torch.tensor([1, 20]), table[:1], "a row per sequence"),
        (torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([1, 20]), table, "int64 tensor of seqs"),
    ]
    for qsl, lens, tables, error in bad_batches:
        with pytest.raises(RuntimeError, match=error):
            ops.paged_attention(q, cache, tables, qsl, lens, 1.0, 512)
    ops.paged_attention(q, cache, table, torch.tensor([0, 1, 3]), torch.tensor([1, 20]), 1.0, 512)  # the valid one
    # cache dtypes the kernels do not read: refused by name, not misread; an int8 cache without its rows' scales
    # (head_dim + 2 bytes) is refused by its width
    for bad, error in ((torch.float64, "kv_cache must be float32, bfloat16, float16, int8"),
                       (torch.int8, "head_dim of query and cache differ")):
        with pytest.raises(RuntimeError, match=error):
            ops.paged_attention(q, cache.to(bad), table, torch.tensor([0, 1, 3]), torch.tensor([1, 20]), 1.0, 512)
    one = (torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
    with pytest.raises(RuntimeError, match="dense"):  # a block's interior must be [block_size, heads, dim]
        ops.reshape_and_cache(*one, torch.zeros(2, 4, 2, 16, 8).transpose(2, 3), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="block-major"):  # blocks 3 apart: neither storage order
        ops.reshape_and_cache(*one, torch.zeros(4, 3, 16, 2, 8)[:, :2].transpose(0, 1), torch.tensor([0]))


def test_orphaned_build_lock_is_removed_and_a_live_build_waited_for(tmp_path, monkeypatch, caplog):
    """A process killed during a build leaves torch's lock file behind, and torch would wait for it forever;
    a live build holds the flock, and a second process waits for it (and only for it)."""
    import fcntl
    import subprocess
    import sys

    import torch.utils.cpp_extension as cpp

    from kvpage.ops import build

    monkeypatch.setattr(cpp, "_get_build_directory", lambda name, verbose: str(tmp_path))
    (tmp_path / "lock").touch()  # torch's file, its writer gone
    with build._build_lock("x"):
        assert not (tmp_path / "lock").exists() and "orphaned kernel build lock" in caplog.text
        # a live holder: another process cannot take the flock until this one lets go
        probe = ("import fcntl, sys; f = open(sys.argv[1], 'w')\n"
                 "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)")
        held = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "kvpage.flock")], check=False)
        assert held.returncode == 3
    with open(tmp_path / "kvpage.flock") as f:  # released on exit
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(f, fcntl.LOCK_UN)
    # a holder that dies without letting go: the kernel drops its lock, so the next build goes ahead
    subprocess.run([sys.executable, "-c", "import fcntl, os, sys; f = open(sys.argv[1], 'w'); "
                    "fcntl.flock(f, fcntl.LOCK_EX); open(sys.argv[2], 'w'); os._exit(9)",
                    str(tmp_path / "kvpage.flock"), str(tmp_path / "lock")], check=False)
    with build._build_lock("x"):
        assert not (tmp_path / "lock").exists()


@pytest.mark.parametrize("kv_layout", ["packed", "rows"])
def test_cpu_metadata_is_built_once_per_step_and_serves_every_layer(kv_layout):
    """The CPU backend's builder splits the step (decodes and short chunks for the paged kernel, long chunks
    after cached keys, whole fresh prompts) and plans the paged kernel's tasks once; every layer's forward then
    consumes that metadata, and equals the reference backend on each layer's own cache."""
    ops = kernels(KernelConfig(kv_layout=kv_layout, paged_prompts=False, batch_invariant="0"))
    backend = CpuPagedAttention(ops)
    heads, kv_heads, dim, bs = 8, 2, 64, 16
    # runner order: decodes and short chunks, then long chunks after cached keys, then fresh prompts
    q_lens, seq_lens = [1, 1, 3, 70, 80], [40, 300, 20, 100, 80]
    blocks = [-(-c // bs) for c in seq_lens]
    num_blocks = sum(blocks) + 2
    tables = torch.zeros(len(q_lens), max(blocks), dtype=torch.long)
    at = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.arange(at, at + n)
        at += n
    slots, qsl = [], [0]
    for i, (ql, ctx) in enumerate(zip(q_lens, seq_lens, strict=True)):
        slots += [int(tables[i, p // bs]) * bs + p % bs for p in range(ctx - ql, ctx)]
        qsl.append(qsl[-1] + ql)
    common = AttentionMetadata(torch.tensor(slots), tables, torch.tensor(qsl), torch.tensor(seq_lens), bs, q_lens,
                               seq_lens)
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn(2, num_blocks, bs, kv_heads, dim, generator=g).bfloat16() for _ in range(3)]
    builder = backend.metadata_builder(caches[0], torch.bfloat16, heads)
    meta = builder.build(common)
    assert meta.paged_seqs == 3 and meta.paged_rows == 5
    assert meta.cached_prefills == ((5, 70),) and meta.fresh_prefills == ((75, 80),) and not meta.decode_only
    assert meta.plan.num_rows == 5 and meta.plan.num_heads == heads and meta.plan.num_tasks >= 3
    assert meta.packed == (kv_layout == "packed" and ops.packed_layout)
    assert (meta.cached_plan is None) == meta.prompts_read_cache
    for cache in caches:  # one metadata, three layers
        q = torch.randn(sum(q_lens), heads, dim, generator=g).bfloat16()
        k = torch.randn(sum(q_lens), kv_heads, dim, generator=g).bfloat16()
        v = torch.randn(sum(q_lens), kv_heads, dim, generator=g).bfloat16()
        ref_cache = cache.clone()
        ref = ReferenceAttention().forward(q.float(), k.float(), v.float(), ref_cache, common, dim**-0.5)
        layer_cache = pack_kv_rows(cache) if meta.packed else cache.clone()
        out = backend.forward(q, k, v, layer_cache, meta, dim**-0.5)
        torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)
    # Without the AMX prompt kernel (and paged_prompts on, the default), or with batch-invariant attention (the
    # default on AVX2 builds), every row goes to the paged kernel.
    plain = CpuPagedAttention(kernels(KernelConfig(kv_layout=kv_layout)))
    if not plain.amx_prefill and (plain.paged_prompts or plain.invariant):
        all_paged = plain.metadata_builder(caches[0], torch.bfloat16, heads).build(common)
        assert all_paged.paged_seqs == 5 and all_paged.decode_only and all_paged.plan.num_rows == sum(q_lens)
        layer_cache = pack_kv_rows(caches[0]) if all_paged.packed else caches[0].clone()
        ref = ReferenceAttention().forward(q.float(), k.float(), v.float(), caches[0].clone(), common, dim**-0.5)
        out = plain.forward(q, k, v, layer_cache, all_paged, dim**-0.5)
        torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)
    decode = AttentionMetadata(torch.tensor(slots[:2]), tables[:2], torch.tensor(qsl[:3]), torch.tensor(seq_lens[:2]),
                               bs, q_lens[:2], seq_lens[:2])
    assert builder.build(decode).decode_only
    with pytest.raises(RuntimeError, match="the plan was checked against"):
        ops.paged_attention(torch.zeros(2, heads, dim).bfloat16(), caches[0][:, :4].contiguous(),
                            builder.build(decode).plan, 1.0, False)


@pytest.mark.parametrize("ctx", [300, 700])
def test_batch_invariant_plans_give_a_row_the_same_bits_alone_and_in_a_batch(ctx):
    """KVPAGE_BATCH_INVARIANT: a decode row alone (one stream: its context would be cut over the threads, or into
    partitions the batch does not get) and among eleven other sequences, and a prompt's rows in one chunk or
    in two: equal bit for bit."""
    ops = kernels(KernelConfig(batch_invariant="1"))
    rng = random.Random(ctx)
    bs, heads, kv_heads, dim = 16, 6, 2, 64
    lens = [ctx] + [rng.randint(40, 900) for _ in range(11)]
    blocks = [-(-c // bs) for c in lens]
    tables = scatter_tables(rng, blocks, list(range(sum(blocks))))
    cache = torch.randn(2, sum(blocks), bs, kv_heads, dim)
    q = torch.randn(len(lens), heads, dim)

    def run(rows: list[int], q_lens: list[int], seq_lens: list[int], query: torch.Tensor) -> torch.Tensor:
        qsl = torch.tensor([0, *itertools.accumulate(q_lens)])
        plan = ops.plan_attention(tables[rows], qsl, torch.tensor(seq_lens), heads, cache.shape[1], bs)
        return ops.paged_attention(query, cache, plan, 0.125, False)

    alone = run([0], [1], [ctx], q[:1])
    busy = run(list(range(len(lens))), [1] * len(lens), lens, q)
    assert torch.equal(alone[0], busy[0])
    prompt = torch.randn(ctx, heads, dim)  # the same sequence's whole prompt, then in two chunks
    whole = run([0], [ctx], [ctx], prompt)
    cut = ctx // 2 + 5
    first, second = run([0], [cut], [cut], prompt[:cut]), run([0], [ctx - cut], [ctx], prompt[cut:])
    assert torch.equal(whole, torch.cat([first, second]))
