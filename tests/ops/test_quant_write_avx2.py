"""The quantizing row write as AVX2-only builds run it (attention/quant_codes.h quantize_row8), compiled here
with -mno-avx512f so that machines with AVX-512 test it too: the same bytes as the torch oracle for every code
type, head sizes 8 to 256, float32 and bfloat16 sources, rotated (key) rows or not, with subnormal codes, ties
and all-zero rows; key rows rounded with feedback (attention/key_feedback.h, 8 rows side by side). The key/value
transform's rows (attention/kv_affine.cpp) on the same 8-lane build: the
bits of kv_transform.affine_rows. On a CPU without AVX-512 the machine's own build is that build: the same cases
run through its write (NativeWrite) instead of a second build of the same code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpage.attention.kv_quant import hadamard, keys_feedback, quantize_rows
from kvpage.cpuinfo import cpuinfo_field
from tests.helpers.kernels import have_cxx

HARNESS = Path(__file__).parent.parent / "helpers" / "csrc" / "avx2_write.cpp"


class NativeWrite:
    """The harness's calls through this machine's own build (reshape_and_cache into one KV head's pages: keys
    are the rotated rows, values the others), where that build is the AVX2-only one."""

    def __init__(self, ops) -> None:
        self.ops = ops
        self.kv_affine_rows = ops.kv_affine_rows

    def _write(self, x: torch.Tensor, code: torch.dtype, key: bool, fb: torch.Tensor | None = None) -> torch.Tensor:
        from kvpage.worker.kv_cache import as_block_major

        n, dim = x.shape
        bs = 16
        cache = as_block_major(torch.zeros(2, -(-n // bs), bs, 1, dim + 2, dtype=torch.uint8).view(code))
        rows = x.view(n, 1, dim)
        other = torch.zeros_like(rows)
        self.ops.reshape_and_cache(rows if key else other, other if key else rows, cache, torch.arange(n), False, fb)
        return cache[0 if key else 1].view(torch.uint8).reshape(-1, dim + 2)[:n]

    def quantize(self, x: torch.Tensor, code: torch.dtype, rotate: bool) -> torch.Tensor:
        return self._write(x, code, rotate)

    def quantize_feedback(self, x: torch.Tensor, code: torch.dtype, fb: torch.Tensor) -> torch.Tensor:
        return self._write(x, code, True, fb[None].contiguous())


@pytest.fixture(scope="module")
def avx2_write():
    if not have_cxx():
        pytest.skip("no C++ compiler")
    flags = (cpuinfo_field("flags") or "").split()
    if "avx2" not in flags:
        pytest.skip("this CPU has no AVX2")
    if "avx512f" not in flags:  # this machine's build is the AVX2 one: ~100 s less than building it again
        from kvpage.ops import load_kernels

        return NativeWrite(load_kernels())
    from torch.utils.cpp_extension import load

    from kvpage.ops.build import _CSRC, build_tag

    sources = [str(HARNESS), str(_CSRC / "attention" / "kv_affine.cpp")]
    return load(name=f"kvpage_avx2_write_{build_tag()}", sources=sources,
                extra_include_paths=[str(_CSRC)], extra_cflags=["-O3", "-march=native", "-mno-avx512f", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_avx2_row_write_equals_the_torch_oracle_byte_for_byte(avx2_write, dtype):
    torch.manual_seed(3)
    n = 96
    for dim in (8, 16, 64, 256):
        for case in range(3):
            # magnitudes over many binades (fp8 subnormal codes), a row scale of its own per row
            x = torch.randn(n, dim) * torch.exp(torch.randn(n, dim) * 2) * torch.exp(torch.randn(n, 1) * 3)
            if case == 1:
                x = torch.round(x * 8) / 8  # ties
                x[::7] = 0  # all-zero rows (scale 0)
            for src in (torch.float32, torch.bfloat16):
                xs = x.to(src)
                for rotate in (False, True):
                    ours = avx2_write.quantize(xs.contiguous(), dtype, rotate)
                    ref_in = hadamard(xs.float()) if rotate else xs.float()
                    ref = quantize_rows(ref_in.view(n, 1, dim), dtype).view(torch.uint8).view(n, dim + 2)
                    assert torch.equal(ours, ref), (dim, case, src, rotate)


def test_avx2_transform_rows_give_the_oracles_bits(avx2_write):
    from tests.ops.test_kv_affine import check_affine_rows

    check_affine_rows(avx2_write.kv_affine_rows)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_avx2_feedback_write_equals_the_torch_oracle_byte_for_byte(avx2_write, dtype):
    torch.manual_seed(4)
    for dim in (8, 16, 64, 96, 256):  # 96: one row at a time, scalar
        fb = keys_feedback(torch.randn(300, 2, dim) * torch.exp(torch.linspace(1, -1, dim)), 1)
        n = 75  # two calls of four groups of 8 rows, then two groups with idle lanes
        x = torch.randn(n, dim) * torch.exp(torch.randn(n, 1) * 2)
        x[3] = 0
        for src in (torch.float32, torch.bfloat16):
            xs = x.to(src)
            ours = avx2_write.quantize_feedback(xs.contiguous(), dtype, fb[0].contiguous())
            ref = quantize_rows(hadamard(xs.float()).view(n, 1, dim), dtype, fb).view(torch.uint8).view(n, dim + 2)
            assert torch.equal(ours, ref), (dim, src)
            one = avx2_write.quantize_feedback(xs[5:6].contiguous(), dtype, fb[0].contiguous())  # a lone row's path
            assert torch.equal(one, ref[5:6]), (dim, src)


def test_avx2_allowed_token_mask(avx2_write):
    """row_mask.h's 8-lane path: the disallowed entries at -inf, and the first index of the largest allowed one,
    over vocabularies that end inside a vector and inside a word, masks shorter than the row, ties across lanes."""
    import numpy as np

    if isinstance(avx2_write, NativeWrite):
        pytest.skip("this machine's own build is the AVX2 one: tests/ops/test_fused_ops.py runs its mask")
    g = torch.Generator().manual_seed(5)
    for vocab in (7, 8, 31, 32, 100, 3001):
        for density in (0.0, 0.03, 0.5, 1.0):
            for short in (False, True):
                words = (vocab + 31) // 32 - (1 if short and vocab > 32 else 0)
                keep = torch.rand(words * 32, generator=g) < density
                bits = torch.from_numpy(np.packbits(keep.numpy(), bitorder="little").view(np.int32).copy())
                x = torch.round(torch.randn(vocab, generator=g) * 2)  # many ties
                ours = x.clone()
                at = avx2_write.mask_row(ours, bits)
                allowed = torch.zeros(vocab, dtype=torch.bool)
                allowed[: min(vocab, words * 32)] = keep[: min(vocab, words * 32)]
                ref = torch.where(allowed, x, torch.tensor(float("-inf")))
                assert torch.equal(ours, ref), (vocab, density, short)
                want = -1 if not bool(allowed.any()) else int(ref.argmax())
                assert at == want, (vocab, density, short)
