"""Which heads each tensor-parallel rank holds, the settings' validation, and a shard read from the checkpoint
equal to the same slice of the whole tensor (GGUF quantized blocks and safetensors)."""

from __future__ import annotations

import pytest
import torch

from kvpage.distributed.config import ParallelConfig
from kvpage.distributed.shard import check_tensor_parallel, head_shard
from kvpage.model.tp_weights import Take, take_gguf, take_tensor


def test_sharded_heads_split_evenly():
    shards = [head_shard(r, 3, 9, 3, 1536) for r in range(3)]
    assert [s.query_slots for s in shards] == [(0, 1, 2), (3, 4, 5), (6, 7, 8)]
    assert [s.kv_heads for s in shards] == [(0,), (1,), (2,)]
    assert all(s.layout == "sharded" for s in shards)
    assert [s.inter_range for s in shards] == [(0, 512), (512, 1024), (1024, 1536)]


@pytest.mark.parametrize("heads,kv,size", [(4, 1, 2), (6, 3, 2), (8, 2, 4), (12, 3, 4), (8, 8, 8)])
def test_every_query_head_once_with_its_own_kv_head(heads, kv, size):
    group = heads // kv
    seen = []
    for r in range(size):
        s = head_shard(r, size, heads, kv, 64 * size)
        assert s.local_heads % s.local_kv_heads == 0  # an even grouped-query ratio for the kernels
        local_group = s.local_heads // s.local_kv_heads
        for slot, q in enumerate(s.query_slots):
            if q is not None:
                assert s.kv_heads[slot // local_group] == q // group  # the slot reads its head's KV head
                seen.append(q)
        if kv % size:
            assert s.layout == "replicated" and s.kv_heads == tuple(range(kv))
    assert sorted(seen) == list(range(heads))


def test_replicated_pads_uneven_groups():
    s = head_shard(0, 2, 6, 3, 128)  # rank 0: heads 0, 1 read KV head 0, head 2 reads KV head 1
    assert s.layout == "replicated" and s.kv_heads == (0, 1, 2)
    assert s.query_slots == (0, 1, 2, None, None, None)


def test_sizes_the_model_cannot_take_are_refused_by_name():
    with pytest.raises(ValueError, match="9 attention heads do not divide over 2 ranks"):
        check_tensor_parallel(9, 3, 1536, 2, "SmolLM2")
    with pytest.raises(ValueError, match="MLP width 100 does not divide over 3"):
        check_tensor_parallel(9, 3, 100, 3)
    with pytest.raises(ValueError, match="positive integer"):
        check_tensor_parallel(9, 3, 1536, 0)


def test_parallel_config_validation_and_torchrun():
    with pytest.raises(ValueError, match="does not split evenly over nnodes=2"):
        ParallelConfig(3, nnodes=2, master_port=1234)
    with pytest.raises(ValueError, match=r"node_rank must be in 0\.\.1"):
        ParallelConfig(2, nnodes=2, node_rank=2, master_port=1234)
    with pytest.raises(ValueError, match="same --master-port"):
        ParallelConfig(2, nnodes=2)
    c = ParallelConfig(4, nnodes=2, node_rank=1, master_port=29511)
    assert c.local_ranks == [2, 3] and not c.leads
    assert ParallelConfig(3).with_port().master_port is not None
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    t = ParallelConfig.from_torchrun(4, env)
    assert t is not None and t.local_ranks == [3] and (t.nnodes, t.node_rank) == (2, 1) and not t.leads
    assert ParallelConfig.from_torchrun(4, {}) is None
    with pytest.raises(ValueError, match="torchrun started 4 processes"):
        ParallelConfig.from_torchrun(2, env)


def test_take_reads_rows_and_block_aligned_columns_of_a_quantized_tensor():
    from gguf import GGML_QUANT_SIZES, quants
    from gguf import GGMLQuantizationType as Q

    from kvpage.model.dequant import dequantize

    g = torch.Generator().manual_seed(0)
    full = torch.randn(6, 128, generator=g).numpy()
    data = quants.quantize(full, Q.Q8_0)  # (rows, bytes)
    whole = dequantize(data, Q.Q8_0, (6, 128))
    take = Take(rows=(4, None, 1, 2), cols=tuple(range(32, 96)) + (None,) * 32)
    got = take_gguf(data, GGML_QUANT_SIZES[Q.Q8_0], (6, 128), take, lambda d, sh: dequantize(d, Q.Q8_0, sh))
    expect = torch.zeros(4, 96)  # one column per entry of take.cols: 64 kept, 32 zeros
    expect[:, :64] = whole[[4, 0, 1, 2]][:, 32:96]
    expect[1] = 0
    assert torch.equal(got, expect)
    with pytest.raises(ValueError, match="32-element quantization blocks"):
        take_gguf(data, GGML_QUANT_SIZES[Q.Q8_0], (6, 128), Take(cols=tuple(range(16, 48))),
                  lambda d, sh: dequantize(d, Q.Q8_0, sh))
    # the same Take over a sliceable tensor (safetensors' get_slice)
    t = torch.randn(6, 128, generator=g)
    expect = torch.zeros(4, 96)
    expect[:, :64] = t[[4, 0, 1, 2]][:, 32:96]
    expect[1] = 0
    assert torch.equal(take_tensor(t, t.shape, take), expect)
    assert torch.equal(take_tensor(t, t.shape, Take(rows=(None, None))), torch.zeros(2, 128))
