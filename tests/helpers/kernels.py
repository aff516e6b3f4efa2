"""Whether the compiled kernels (or one AMX kernel of theirs) can run here: a build error fails, never skips."""

from __future__ import annotations

import pytest


def have_cxx() -> bool:
    """A C++ compiler is present, so the kernels must build: a build error fails the kernel tests, never skips."""
    import shutil

    return any(shutil.which(c) for c in ("c++", "g++", "clang++"))


def amx_ops(available: str):
    """The compiled kernels when `ops.<available>()` says its AMX kernel can run here; the test is skipped
    otherwise (no compiler, or a CPU/OS without AMX tiles)."""
    if not have_cxx():
        pytest.skip("no C++ compiler: kernels cannot be built")
    from kvpage.ops import load_kernels

    ops = load_kernels()
    if ops is None or not getattr(ops, available)():
        pytest.skip("AMX tile products unavailable on this CPU/OS")
    return ops


def scatter_tables(rng, blocks_per_seq: list[int], ids: list[int]):
    """Block tables [num_seqs, max blocks] that hand each sequence its blocks from ``ids`` (shuffled by ``rng``),
    so a sequence's blocks lie scattered over the cache as the engine's do."""
    import torch

    rng.shuffle(ids)
    tables = torch.zeros((len(blocks_per_seq), max(blocks_per_seq)), dtype=torch.long)
    at = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor(ids[at : at + n])
        at += n
    return tables


def step_metadata(tables, q_lens: list[int], seq_lens: list[int], block_size: int, window: int | None = None):
    """The runner's metadata for a batch whose sequence i computes its last q_lens[i] of seq_lens[i] positions."""
    import torch

    from kvpage.attention.metadata import AttentionMetadata

    slots, qsl = [], [0]
    for i, (ql, ctx) in enumerate(zip(q_lens, seq_lens, strict=True)):
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(ctx - ql, ctx)]
        qsl.append(qsl[-1] + ql)
    return AttentionMetadata(torch.tensor(slots), tables, torch.tensor(qsl), torch.tensor(seq_lens), block_size,
                             q_lens, seq_lens, window=window)
