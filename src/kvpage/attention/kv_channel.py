"""Keys rounded per channel over a complete block: the int8 key page issue #31's accuracy target asks for
(``KVPAGE_INT8_KEYS=channel``), its torch oracle, and the pages the reference backend reads and writes with it
(the compiled write, csrc/attention/paged_attention_channel.cpp, equals ``write_pages`` byte for byte).

Why per channel: one scale per (token, head) row spends its 255 codes on the row's largest entry, and Gemma 3's
keys keep a few channels far wider than the rest at every position; rows reach 98.69% top-1 agreement with the
float32 cache over 3,200 positions, under the 99% target. A scale and a zero point per channel, over the keys of
one complete block, fit each channel's own range (KIVI's choice): 99.25% over the same positions with the
one-byte parameters below (`python benchmarks/kv_quant.py --models gemma-3-270m --skip capacity accuracy speed
--split --positions 3200 --split-cases "once, one-byte"`). A block is rounded once, when it is complete:
re-rounding a filling block's stored values as each key widens a channel's range lost ~0.45 points there.

One block of ``n`` keys and one KV head, ``n * D + 2 * D + 4`` bytes (``block_bytes``):

* ``n * D`` codes, token-major: code = round((k - zero) / step), 0..255;
* ``D`` zero codes (int8) and ``D`` step codes (uint8), one each per channel;
* two bfloat16 units per block and head: ``zero_unit`` = bf16(max |channel minimum| x (1 + 2^-7)), and
  ``step_unit`` = bf16(widest channel range / 255).

A channel's zero point is ``z x zero_unit / 127`` with z = floor(minimum / (zero_unit / 127)) (so it sits at or
under the minimum), and its step ``largest x (m + 1) / 256`` with largest = ``step_unit x (1 + 2^-7)`` (at or
over every channel's range / 255, whatever bf16's rounding did) and m + 1 = ceil(range_from_zero / 255 /
largest x 256): every key lies within half a step of its value, and the parameters cost 2 bytes per channel, not
4 as two bfloat16s would (1.93x bf16's tokens per GiB for Gemma 3 and 1.91x for SmolLM2 at 32-key blocks with
row-rounded values, against 1.88x and 1.86x; the target is 1.9x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpage.attention.kv_quant import dequantize_rows, quantize_rows
from kvpage.capacity import channel_block_bytes, channel_page_bytes

_WIDEN = 1 + 2**-7  # past bf16's rounding (at most 2^-9 relative), so a unit never falls short of what it covers
_TINY = 1e-30


@dataclass(frozen=True)
class ChannelKeys:
    """One block's keys per channel: ``codes`` uint8 ``[n, *heads, D]``; ``zero_codes`` int8 and ``step_codes``
    uint8 (step code m stands for m + 1 256ths) ``[*heads, D]``; ``zero_unit`` and ``step_unit`` bfloat16
    ``[*heads, 1]``."""

    codes: torch.Tensor
    zero_codes: torch.Tensor
    step_codes: torch.Tensor
    zero_unit: torch.Tensor
    step_unit: torch.Tensor

    def params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each channel's zero point and step (float32 ``[*heads, D]``), from the stored bytes alone."""
        return _params(self.zero_codes, self.step_codes, self.zero_unit, self.step_unit)


def _params(zero_codes: torch.Tensor, step_codes: torch.Tensor, zero_unit: torch.Tensor,
            step_unit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero points and steps from the parameter codes and units: the one computation writer and reader share."""
    zero = zero_codes.float() * (zero_unit.float().clamp_min(_TINY) / 127)
    largest = step_unit.float().clamp_min(_TINY) * _WIDEN
    return zero, largest * (step_codes.float() + 1) / 256


def quantize_block_keys(keys: torch.Tensor) -> ChannelKeys:
    """A complete block's keys ``[n, *heads, D]`` (any float dtype) rounded per channel over the n tokens."""
    x = keys.float()
    lo, hi = x.amin(0), x.amax(0)
    zero_unit = (lo.abs().amax(-1, keepdim=True) * _WIDEN).bfloat16()
    unit = zero_unit.float().clamp_min(_TINY) / 127
    zero_codes = torch.floor(lo / unit).clamp(-127, 127)
    span = hi - zero_codes * unit
    step_unit = (span.amax(-1, keepdim=True) / 255).bfloat16()
    largest = step_unit.float().clamp_min(_TINY) * _WIDEN
    zero_codes = zero_codes.to(torch.int8)
    step_codes = (torch.ceil(span / 255 / largest * 256).clamp(1, 256) - 1).to(torch.uint8)
    zero, step = _params(zero_codes, step_codes, zero_unit, step_unit)
    codes = torch.round((x - zero) / step).clamp(0, 255).to(torch.uint8)
    return ChannelKeys(codes, zero_codes, step_codes, zero_unit, step_unit)


def dequantize_block_keys(c: ChannelKeys) -> torch.Tensor:
    """float32 keys ``[n, *heads, D]``."""
    zero, step = c.params()
    return c.codes.float() * step + zero


block_bytes = channel_block_bytes  # one block's keys for one KV head, parameters included
page_bytes = channel_page_bytes  # one block of one layer: every head's keys, then the value rows


def capacity_vs_bf16(block_size: int, head_dim: int) -> float:
    """Tokens per GiB against a bf16 cache, with keys per channel and values as int8 rows (kv_quant.py)."""
    return 2 * block_size * head_dim * 2 / page_bytes(block_size, 1, head_dim)


def to_bytes(c: ChannelKeys) -> torch.Tensor:
    """The page bytes ``[*heads, block_bytes(n, D)]``: per head, the codes token-major, the zero codes, the step
    codes, then the two units."""
    n, d = c.codes.shape[0], c.codes.shape[-1]
    codes = c.codes.movedim(0, -2).reshape(*c.codes.shape[1:-1], n * d)
    units = torch.cat([c.zero_unit, c.step_unit], -1).contiguous().view(torch.uint8)
    return torch.cat([codes, c.zero_codes.view(torch.uint8), c.step_codes, units], -1)


def from_bytes(raw: torch.Tensor, block_size: int, head_dim: int) -> ChannelKeys:
    """The inverse of ``to_bytes``."""
    n, d = block_size, head_dim
    if raw.shape[-1] != block_bytes(n, d):
        raise ValueError(f"a block of {n} keys of head size {d} is {block_bytes(n, d)} bytes, not {raw.shape[-1]}")
    codes = raw[..., : n * d].reshape(*raw.shape[:-1], n, d).movedim(-2, 0)
    zero_codes = raw[..., n * d : n * d + d].contiguous().view(torch.int8)
    step_codes = raw[..., n * d + d : n * d + 2 * d]
    units = raw[..., n * d + 2 * d :].contiguous().view(torch.bfloat16)
    return ChannelKeys(codes.contiguous(), zero_codes, step_codes.contiguous(), units[..., :1], units[..., 1:])


# ---------------------------------------------------------------------------------------------------- pages
# One block of one layer is ``page_bytes`` bytes: the keys of every KV head in the format above (head after
# head), then the values as int8 rows ``[block_size, heads, D + 2]`` (kv_quant.py). A block of the residual-key
# group (kv/residual.py) holds instead its sequence's unrounded keys, bfloat16 ``[block_size, heads, D]``, at
# the start of the same bytes.


def is_channel_pages(kv_cache: torch.Tensor) -> bool:
    """Whether a layer's cache tensor holds these pages (``[num_blocks, page_bytes]`` bytes), not the
    ``[2, num_blocks, block_size, heads, width]`` rows of every other cache."""
    return kv_cache.dim() == 2


def _views(pages: torch.Tensor, block_size: int, kv_heads: int, head_dim: int):
    """(keys [blocks, heads, block_bytes] uint8, value rows [blocks, n, heads, D + 2] int8, residual keys
    [blocks, n, heads, D] bfloat16) over ``pages`` ``[blocks, page_bytes]`` uint8."""
    nb, n, h, d = pages.shape[0], block_size, kv_heads, head_dim
    kb = h * block_bytes(n, d)
    keys = pages[:, :kb].view(nb, h, block_bytes(n, d))
    values = pages[:, kb:].view(torch.int8).view(nb, n, h, d + 2)
    residual = pages[:, : 2 * n * h * d].view(torch.bfloat16).view(nb, n, h, d)
    return keys, values, residual


def write_pages(key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor,
                residual_slots: torch.Tensor, block_size: int) -> None:
    """Each new token's value as an int8 row at its slot and its key, unrounded, at its residual slot; then
    every block whose last key this write brought is rounded per channel from its residual block into its
    page (a prompt chunk rounds all the blocks it completes)."""
    bs = block_size
    keys, values, residual = _views(pages, bs, key.shape[1], key.shape[2])
    blocks, offs = slots // bs, slots % bs
    values[blocks, offs] = quantize_rows(value, torch.int8)
    rblocks, roffs = residual_slots // bs, residual_slots % bs
    if not bool((roffs == offs).all()):
        raise ValueError("a token's residual slot must sit at its offset in the block")
    residual[rblocks, roffs] = key.to(torch.bfloat16)
    done = (offs == bs - 1).nonzero().flatten()
    if done.numel():
        keys[blocks[done]] = to_bytes(quantize_block_keys(residual[rblocks[done]].movedim(1, 0)))


def read_keys(pages: torch.Tensor, table: torch.Tensor, residual_block: int, num_keys: int, block_size: int,
              kv_heads: int, head_dim: int) -> torch.Tensor:
    """A sequence's first ``num_keys`` keys, float32 ``[num_keys, heads, D]``: its complete blocks (``table``
    entries) dequantized, the filling one's keys from its residual block as they were written."""
    bs = block_size
    keys, _, residual = _views(pages, bs, kv_heads, head_dim)
    full = num_keys // bs
    k = dequantize_block_keys(from_bytes(keys[table[:full]], bs, head_dim))  # [n, full, heads, D]
    k = k.movedim(0, 1).reshape(full * bs, kv_heads, head_dim)
    if num_keys % bs:
        k = torch.cat([k, residual[residual_block, : num_keys % bs].float()])
    return k


def read_values(pages: torch.Tensor, table: torch.Tensor, num_keys: int, block_size: int, kv_heads: int,
                head_dim: int) -> torch.Tensor:
    """A sequence's first ``num_keys`` values, float32 ``[num_keys, heads, D]``."""
    _, values, _ = _views(pages, block_size, kv_heads, head_dim)
    n = -(-num_keys // block_size)
    return dequantize_rows(values[table[:n]]).reshape(n * block_size, kv_heads, head_dim)[:num_keys]
