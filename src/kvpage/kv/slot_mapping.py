"""Token position -> physical slot, the one formula the attention write relies on."""

from __future__ import annotations

from collections.abc import Sequence


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative integers: blocks for ``a`` tokens of ``b`` per block."""
    return -(-a // b)


def token_location(block_table: Sequence[int], block_size: int, position: int) -> tuple[int, int]:
    """(physical block, offset in block) of the token at ``position``."""
    logical_block, offset = divmod(position, block_size)
    if position < 0 or logical_block >= len(block_table):
        raise IndexError(
            f"position {position} is outside the block table ({len(block_table)} blocks of {block_size})"
        )
    return block_table[logical_block], offset


def slot_mapping(block_table: Sequence[int], block_size: int, start: int, num_tokens: int) -> list[int]:
    """Flat slots ``physical_block * block_size + offset`` for positions start .. start+num_tokens-1."""
    if start < 0 or num_tokens < 0 or start + num_tokens > len(block_table) * block_size:
        raise IndexError(
            f"positions {start}..{start + num_tokens - 1} do not fit a block table of "
            f"{len(block_table)} blocks of {block_size}"
        )
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)]
