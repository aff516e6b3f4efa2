"""The prompt loop over bf16 rows (ops/csrc/attention/prompt_bf16.h): a prompt attended in chunks gives the very
outputs of the prompt attended at once, and matches torch's causal attention at head sizes 64 and 128."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpage.ops import PARTITION_SIZE, load_kernels
from tests.helpers.kernels import have_cxx

pytestmark = pytest.mark.skipif(not have_cxx(), reason="no C++ compiler: kernels cannot be built")


def row_cache(k: torch.Tensor, v: torch.Tensor, block_size: int, perm: torch.Tensor):
    """k, v [n, kv_heads, D] in a bf16 row cache of randomly placed blocks, and the block table."""
    n, kv_heads, dim = k.shape
    nb = -(-n // block_size)
    flat = torch.zeros(2, nb * block_size, kv_heads, dim, dtype=torch.bfloat16)
    flat[0, :n], flat[1, :n] = k, v
    cache = torch.zeros(2, nb, block_size, kv_heads, dim, dtype=torch.bfloat16)
    cache[:, perm] = flat.view(2, nb, block_size, kv_heads, dim)
    return cache, perm.view(1, nb)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 128), (5, 5, 64)])
@pytest.mark.parametrize("cut", [1, 37, 160])
def test_prompt_in_chunks_equals_prompt_at_once(heads, kv_heads, dim, cut):
    """A row's sums do not depend on the tile (or block of rows) it lands in: the later chunk of a prompt,
    attended after the earlier chunk's keys are cached, is bit-equal to the same rows of the whole prompt."""
    ops = load_kernels()
    if not ops.has_packed_layout():
        pytest.skip("no AVX512-BF16 loops in this build")
    g = torch.Generator().manual_seed(heads * dim + cut)
    n, bs = 300, 16
    q = torch.randn(n, heads, dim, generator=g).bfloat16()
    k = torch.randn(n, kv_heads, dim, generator=g).bfloat16()
    v = torch.randn(n, kv_heads, dim, generator=g).bfloat16()
    cache, table = row_cache(k, v, bs, torch.randperm(-(-n // bs), generator=g))
    scale = dim**-0.5
    whole = ops.paged_attention(q, cache, table, torch.tensor([0, n]), torch.tensor([n]), scale, PARTITION_SIZE,
                                False)
    first = ops.paged_attention(q[:cut], cache, table, torch.tensor([0, cut]), torch.tensor([cut]), scale,
                                PARTITION_SIZE, False)
    rest = ops.paged_attention(q[cut:], cache, table, torch.tensor([0, n - cut]), torch.tensor([n]), scale,
                               PARTITION_SIZE, False)
    assert torch.equal(first, whole[:cut])
    assert torch.equal(rest, whole[cut:])
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                         v.float().transpose(0, 1)[None], is_causal=True, scale=scale,
                                         enable_gqa=heads != kv_heads)[0].transpose(0, 1)
    torch.testing.assert_close(whole.float(), ref, rtol=2e-2, atol=2e-2)
