"""KV cache manager: per-sequence block tables over a shared block pool.

The scheduler asks; the manager answers in block ids and copy instructions; the worker moves bytes.
Within one engine step the worker must apply the instructions in this order, because a block released
by one instruction can be handed out by the next:

1. swap-out copies (device -> host), 2. swap-in copies (host -> device),
3. copy-on-write copies (device -> device), 4. the forward pass, which writes new K/V at their slots.

Prefix-cache registration happens after a step (``cache_computed_blocks``), so a cached block always
holds K/V that was really computed.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from kvpage.kv.block import KVBlock
from kvpage.kv.block_pool import BlockPool
from kvpage.kv.prefix_hash import BlockHash, HashFn, block_hash, root_hash, sha256_digest
from kvpage.kv.sequence import SequenceLike
from kvpage.kv.stats import KVCounters, KVStats


@dataclass(frozen=True)
class PrefixHit:
    """The longest run of cached full blocks matching a sequence's tokens."""

    blocks: tuple[KVBlock, ...]
    hashes: tuple[BlockHash, ...]
    num_tokens: int

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


NO_HIT = PrefixHit((), (), 0)


@dataclass(frozen=True)
class Allocation:
    """What one successful allocation changed.

    ``copies`` are (src, dst) device-block copies the worker must perform before writing
    (copy-on-write of a shared partial block, or a static-reservation fork).
    """

    new_blocks: tuple[int, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()
    num_cached_tokens: int = 0


_NOTHING = Allocation()


def _sid(seq: SequenceLike | str) -> str:
    return seq if isinstance(seq, str) else seq.seq_id


class _SeqState:
    __slots__ = ("hashes", "num_tokens", "root", "table")

    def __init__(self, table: list[KVBlock], num_tokens: int, hashes: list[BlockHash], root: BlockHash) -> None:
        self.table = table
        self.num_tokens = num_tokens  # tokens that have a slot
        self.hashes = hashes  # chained hashes of the leading full blocks
        self.root = root


@dataclass
class _SwappedState:
    host_blocks: list[int]
    num_tokens: int
    hashes: list[BlockHash]
    root: BlockHash


class KVCacheManager:
    """Paged allocation: a sequence holds ceil(tokens / block_size) blocks, shared where possible.

    ``watermark`` is a fraction of the pool kept free when *admitting* a sequence (a new one, or a
    swapped one coming back) while others are running, so admissions cannot starve running sequences into
    preemption; growing a running sequence may use every block.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
        num_swap_blocks: int = 0,
        max_model_len: int | None = None,
        model_id: str = "",
        hash_fn: HashFn = sha256_digest,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {watermark}")
        if num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be >= 0, got {num_swap_blocks}")
        if max_model_len is not None and max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.num_blocks = num_blocks
        self.watermark = watermark
        self.watermark_blocks = int(num_blocks * watermark)
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = max_model_len
        self.model_id = model_id
        self.hash_fn = hash_fn
        self.num_swap_blocks = num_swap_blocks
        self._host_free = list(range(num_swap_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._seqs: dict[str, _SeqState] = {}
        self._swapped: dict[str, _SwappedState] = {}
        self.counters = KVCounters()

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_free_swap_blocks(self) -> int:
        return len(self._host_free)

    def has_seq(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def is_swapped(self, seq_id: str) -> bool:
        return seq_id in self._swapped

    def seq_ids(self) -> list[str]:
        return list(self._seqs)

    def swapped_seq_ids(self) -> list[str]:
        return list(self._swapped)

    def block_table(self, seq_id: str) -> list[int]:
        return [b.block_id for b in self._state(seq_id).table]

    def host_block_table(self, seq_id: str) -> list[int]:
        return list(self._swapped_state(seq_id).host_blocks)

    def num_tokens(self, seq_id: str) -> int:
        """Tokens of the sequence that have a slot (computed or being computed)."""
        return self._state(seq_id).num_tokens

    def ref_count(self, block_id: int) -> int:
        return self.pool.blocks[block_id].ref_count

    def slot_mapping(self, seq_id: str, start: int, num_tokens: int) -> list[int]:
        """Slots of positions start .. start+num_tokens-1 (``physical_block * block_size + offset``)."""
        state = self._state(seq_id)
        bs, table = self.block_size, state.table
        if start < 0 or num_tokens < 0 or start + num_tokens > state.num_tokens:
            raise IndexError(
                f"{seq_id}: positions {start}..{start + num_tokens - 1} outside its {state.num_tokens} slotted tokens"
            )
        return [table[p // bs].block_id * bs + p % bs for p in range(start, start + num_tokens)]

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens occupies under this policy."""
        if self.max_model_len is not None and num_tokens > self.max_model_len:
            raise ValueError(f"sequence of {num_tokens} tokens exceeds max_model_len={self.max_model_len}")
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------ prefix cache
    def _root(self, seq: SequenceLike) -> BlockHash:
        return root_hash(
            self.model_id, getattr(seq, "adapter_id", None), getattr(seq, "cache_salt", None), self.hash_fn
        )

    def _root_key(self, seq: SequenceLike) -> tuple:
        """The exact isolation keys a chain starts from (its hash, the root, may collide; these cannot)."""
        return "root", self.model_id, getattr(seq, "adapter_id", None), getattr(seq, "cache_salt", None)

    def lookup_prefix(self, seq: SequenceLike) -> PrefixHit:
        """Longest run of cached full blocks for ``seq.token_ids``, leaving >= 1 token to compute.

        Pure: takes no references. Pass the result straight to ``allocate_slots``.
        """
        if not self.enable_prefix_caching:
            return NO_HIT
        tokens = seq.token_ids
        bs = self.block_size
        max_blocks = (len(tokens) - 1) // bs
        parent = self._root(seq)
        ident: object = self._root_key(seq)
        blocks: list[KVBlock] = []
        hashes: list[BlockHash] = []
        for i in range(max_blocks):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk, self.hash_fn)
            block = self.pool.lookup(h, ident, chunk)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
            parent, ident = h, block.identity
        return PrefixHit(tuple(blocks), tuple(hashes), len(blocks) * bs)

    def cache_computed_blocks(self, seq: SequenceLike, num_computed_tokens: int | None = None) -> int:
        """Register the sequence's newly full, computed blocks in the prefix cache; returns how many."""
        if not self.enable_prefix_caching:
            return 0
        state = self._state(seq.seq_id)
        n = state.num_tokens if num_computed_tokens is None else min(num_computed_tokens, state.num_tokens)
        tokens = seq.token_ids
        bs = self.block_size
        full = min(n, len(tokens)) // bs
        hashes = state.hashes
        start = len(hashes)
        if full <= start:
            return 0
        parent = hashes[-1] if hashes else state.root
        pool, table, hash_fn = self.pool, state.table, self.hash_fn
        for i in range(start, full):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk, hash_fn)
            pool.cache_block(table[i], h, table[i - 1].identity if i else self._root_key(seq), chunk)
            hashes.append(h)
            parent = h
        return full - start

    def reset_prefix_cache(self) -> int:
        """Forget all cached hashes; running sequences keep their blocks. Returns the count dropped."""
        for state in self._seqs.values():
            state.hashes.clear()
        for swapped in self._swapped.values():
            swapped.hashes.clear()
        return self.pool.reset_prefix_cache()

    # -------------------------------------------------------------- allocation
    def allocate_slots(
        self, seq: SequenceLike, num_new_tokens: int, prefix_hit: PrefixHit | None = None
    ) -> Allocation | None:
        """Give ``seq`` slots for ``num_new_tokens`` more tokens, or return None ("not now").

        For a sequence the manager does not hold yet, ``prefix_hit`` (from ``lookup_prefix``) supplies
        its leading cached blocks and ``num_new_tokens`` counts the tokens after them. None leaves every
        piece of state untouched: there is no partial allocation.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        state = self._seqs.get(seq.seq_id)
        if state is None:
            return self._admit(seq, num_new_tokens, prefix_hit or NO_HIT)
        if prefix_hit is not None and prefix_hit.num_tokens:
            raise ValueError(f"sequence {seq.seq_id!r} is already running: a prefix hit only applies at admission")
        if num_new_tokens == 0:
            return _NOTHING
        table = state.table
        n = state.num_tokens
        total = n + num_new_tokens
        need = self.blocks_needed(total) - len(table)
        # The first new token lands in table[n // bs]; if that block exists, holds earlier tokens and is
        # shared, it must be copied before anyone writes into it.
        write_idx = n // self.block_size
        cow = write_idx < len(table) and table[write_idx].ref_count > 1
        if need + cow > self.pool.num_free_blocks:
            return None
        copies: tuple[tuple[int, int], ...] = ()
        if cow:
            src = table[write_idx]
            if write_idx == len(table) - 1:
                self.pool.release_ahead(seq.seq_id, src)  # what lay ahead of the replaced last block
            (dst,) = self.pool.get_new_blocks(1, after=table[write_idx - 1] if write_idx else None)
            self.pool.release((src,))
            table[write_idx] = dst
            copies = ((src.block_id, dst.block_id),)
            self.counters.cow_copies += 1
        state.num_tokens = total
        if need <= 0:
            return Allocation((), copies) if copies else _NOTHING
        new = self.pool.get_new_blocks(need, after=table[-1] if table else None, owner=seq.seq_id)
        table.extend(new)
        return Allocation(tuple(b.block_id for b in new), copies)

    def _admit(self, seq: SequenceLike, num_new_tokens: int, hit: PrefixHit) -> Allocation | None:
        sid = seq.seq_id
        if sid in self._swapped:
            raise RuntimeError(f"sequence {sid!r} is swapped out: swap_in before allocating")
        for block, h in zip(hit.blocks, hit.hashes, strict=True):
            if block.block_hash != h:
                raise RuntimeError("stale prefix hit: a block was evicted between lookup and allocation")
        total = hit.num_tokens + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(hit.blocks)
        revived = sum(1 for b in hit.blocks if b.ref_count == 0)
        if self.pool.num_free_blocks - num_new_blocks - revived < self._admission_reserve():
            return None
        self.pool.touch(hit.blocks)
        new = self.pool.get_new_blocks(max(num_new_blocks, 0), after=hit.blocks[-1] if hit.blocks else None,
                                       owner=sid)
        self._seqs[sid] = _SeqState(list(hit.blocks) + new, total, list(hit.hashes), self._root(seq))
        if self.enable_prefix_caching:
            self.counters.prefix_query_tokens += len(seq.token_ids)
            self.counters.prefix_hit_tokens += hit.num_tokens
        return Allocation(tuple(b.block_id for b in new), (), hit.num_tokens)

    def _admission_reserve(self) -> int:
        """Blocks an admission must leave free. With nothing running there is nothing to protect, and
        keeping the reserve would stop a lone long sequence from ever coming back after a preemption."""
        return self.watermark_blocks if self._seqs else 0

    def free(self, seq: SequenceLike | str) -> None:
        """Return every block of a finished, aborted or preempted sequence (device or host)."""
        sid = _sid(seq)
        state = self._seqs.pop(sid, None)
        if state is not None:
            self._release_table(sid, state)
            return
        swapped = self._swapped.pop(sid, None)
        if swapped is not None:
            self._host_free.extend(reversed(swapped.host_blocks))
            return
        raise KeyError(f"unknown sequence {sid!r}: not running and not swapped out")

    def _release_table(self, sid: str, state: _SeqState) -> None:
        """Drop a departing sequence's references, deepest block first (tails are evicted before heads), and
        give back the blocks set aside behind its last one."""
        self.pool.release_ahead(sid, state.table[-1] if state.table else None)
        self.pool.release(state.table[::-1])

    def fork(self, parent: SequenceLike | str, child: SequenceLike | str) -> Allocation | None:
        """Make ``child`` share every block of ``parent`` (parallel sampling, beam candidates).

        Paged: no block moves now; the first write into a shared partial block copies it.
        """
        pstate, cid = self._fork_ids(parent, child)
        self.pool.touch(pstate.table)
        self._seqs[cid] = _SeqState(list(pstate.table), pstate.num_tokens, list(pstate.hashes), pstate.root)
        return _NOTHING

    # -------------------------------------------------------------------- swap
    def swap_out(self, seq: SequenceLike | str) -> list[tuple[int, int]] | None:
        """Move a running sequence to the host pool: (device, host) copies, or None if it is full."""
        sid = _sid(seq)
        state = self._state(sid)
        n = len(state.table)
        if n > len(self._host_free):
            return None
        host = [self._host_free.pop() for _ in range(n)]
        mapping = [(b.block_id, h) for b, h in zip(state.table, host, strict=True)]
        del self._seqs[sid]
        self._release_table(sid, state)  # shared blocks stay with their other owners
        self._swapped[sid] = _SwappedState(host, state.num_tokens, state.hashes, state.root)
        self.counters.blocks_swapped_out += n
        return mapping

    def swap_in(self, seq: SequenceLike) -> list[tuple[int, int]] | None:
        """Bring a swapped sequence back: (host, device) copies, or None if the device lacks room."""
        sid = seq.seq_id
        swapped = self._swapped_state(sid)
        host = swapped.host_blocks
        # Full blocks whose cached copy is still on the device need no transfer: share them instead.
        # Only a run from the first block can be verified (each block names its exact parent).
        resident: dict[int, KVBlock] = {}
        ident, bs, tokens = self._root_key(seq), self.block_size, seq.token_ids
        for i, h in enumerate(swapped.hashes):
            block = self.pool.lookup(h, ident, tuple(tokens[i * bs : (i + 1) * bs]))
            if block is None:
                break
            resident[i] = block
            ident = block.identity
        n_copy = len(host) - len(resident)
        revived = sum(1 for b in resident.values() if b.ref_count == 0)
        if self.pool.num_free_blocks - n_copy - revived < self._admission_reserve():
            return None
        self.pool.touch(resident.values())
        fresh = iter(self.pool.get_new_blocks(n_copy))
        table = [resident[i] if i in resident else next(fresh) for i in range(len(host))]
        del self._swapped[sid]
        self._host_free.extend(reversed(host))
        mapping = [(h, b.block_id) for i, (h, b) in enumerate(zip(host, table, strict=True)) if i not in resident]
        self._seqs[sid] = _SeqState(table, swapped.num_tokens, [], swapped.root)
        # Copied full blocks become findable again (their K/V arrives before any read of this step).
        self.cache_computed_blocks(seq, len(swapped.hashes) * self.block_size)
        self.counters.blocks_swapped_in += n_copy
        return mapping

    # ------------------------------------------------------------------- stats
    def stats(self) -> KVStats:
        bs = self.block_size
        fill: dict[int, int] = {}
        logical = 0
        for state in self._seqs.values():
            logical += state.num_tokens
            for i, block in enumerate(state.table):
                f = min(bs, max(0, state.num_tokens - i * bs))
                if f > fill.get(block.block_id, -1):
                    fill[block.block_id] = f
        used = self.num_blocks - self.pool.num_free_blocks
        cached_free = sum(1 for b in self.pool.cached.values() if b.ref_count == 0)
        c = self.counters
        return KVStats(
            num_blocks=self.num_blocks,
            block_size=bs,
            used_blocks=used,
            free_blocks=self.pool.num_free_blocks,
            cached_free_blocks=cached_free,
            num_seqs=len(self._seqs),
            num_swapped_seqs=len(self._swapped),
            live_tokens=sum(fill.values()),
            logical_tokens=logical,
            allocated_slots=used * bs,
            prefix_query_tokens=c.prefix_query_tokens,
            prefix_hit_tokens=c.prefix_hit_tokens,
            evictions=self.pool.num_evictions,
            cow_copies=c.cow_copies,
            blocks_swapped_out=c.blocks_swapped_out,
            blocks_swapped_in=c.blocks_swapped_in,
            swap_blocks_total=self.num_swap_blocks,
            swap_blocks_used=self.num_swap_blocks - len(self._host_free),
            tail_waste_slots=sum(bs - f for f in fill.values() if f),
            reserved_unused_slots=bs * sum(1 for f in fill.values() if not f),
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if any bookkeeping invariant of ARCHITECTURE.md is broken."""
        pool, bs = self.pool, self.block_size
        queued = pool.free_blocks()
        assert len(queued) == pool.num_free_blocks, "free queue length disagrees with its counter"
        for b in pool.ahead_queue:
            assert b.ahead_of is not None and b.block_hash is None, f"block {b.block_id} set aside wrongly"
            assert b.ahead_of in self._seqs, f"block {b.block_id} set aside for {b.ahead_of!r}, which holds no blocks"
        for b in pool.free_queue:
            assert b.ahead_of is None, f"block {b.block_id} in the free queue but set aside"
        assert len({b.block_id for b in queued}) == len(queued), "a block is queued twice"
        for b in queued:
            assert b.ref_count == 0, f"free block {b.block_id} has ref_count {b.ref_count}"
        refs: dict[int, int] = {}
        for sid, state in self._seqs.items():
            assert self._table_len_ok(len(state.table), state.num_tokens), (
                f"{sid}: {len(state.table)} blocks for {state.num_tokens} tokens"
            )
            assert len(state.hashes) <= state.num_tokens // bs, f"{sid}: hashed a partial block"
            assert len({b.block_id for b in state.table}) == len(state.table), f"{sid}: block listed twice"
            for i, b in enumerate(state.table):
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
                if b.block_hash is not None:
                    assert (i + 1) * bs <= state.num_tokens, f"{sid}: cached block {b.block_id} is not full"
                    if i < len(state.hashes):
                        assert b.block_hash == state.hashes[i], f"{sid}: block {b.block_id} hash mismatch"
            waste = len(state.table) * bs - state.num_tokens
            assert self._max_waste_ok(waste), f"{sid}: internal waste {waste} slots"
        for b in pool.blocks:
            assert b.ref_count == refs.get(b.block_id, 0), (
                f"block {b.block_id}: ref_count {b.ref_count} but in {refs.get(b.block_id, 0)} block tables"
            )
        assert len(refs) + len(queued) == self.num_blocks, "free + in-use != total"
        for h, b in pool.cached.items():
            assert b.block_hash == h, f"cache map entry for block {b.block_id} is stale"
        hashed = sum(1 for b in pool.blocks if b.block_hash is not None)
        assert hashed == len(pool.cached), "a block carries a hash the cache map does not know"
        host_used = [h for s in self._swapped.values() for h in s.host_blocks]
        assert len(set(host_used)) == len(host_used), "a host block is owned twice"
        assert not set(host_used) & set(self._host_free), "a host block is both free and owned"
        assert len(host_used) + len(self._host_free) == self.num_swap_blocks, "host free + used != total"
        assert not set(self._seqs) & set(self._swapped), "a sequence is both running and swapped"

    def _max_waste_ok(self, waste: int) -> bool:
        return 0 <= waste < self.block_size

    def _table_len_ok(self, table_len: int, num_tokens: int) -> bool:
        return table_len == self.blocks_needed(num_tokens)

    def reservation_blocks(self, seq: SequenceLike) -> int:
        """Blocks ``seq`` takes when admitted now, without a prefix hit."""
        return -(-len(seq.token_ids) // self.block_size)

    def stranded_free_blocks(self, need_blocks: int) -> int:
        """Free blocks a request needing ``need_blocks`` cannot use: none, since any block will do."""
        return 0

    def _fork_ids(self, parent: SequenceLike | str, child: SequenceLike | str) -> tuple[_SeqState, str]:
        """The running parent's state and the child's id (which must hold nothing yet)."""
        pstate, cid = self._state(_sid(parent)), _sid(child)
        if cid in self._seqs or cid in self._swapped:
            raise ValueError(f"cannot fork into {cid!r}: that sequence already holds blocks")
        return pstate, cid

    # ----------------------------------------------------------------- helpers
    def _state(self, seq_id: str) -> _SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            where = "swapped out" if seq_id in self._swapped else "unknown"
            raise KeyError(f"sequence {seq_id!r} is {where}, not running") from None

    def _swapped_state(self, seq_id: str) -> _SwappedState:
        try:
            return self._swapped[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} is not swapped out") from None


RESERVE_POLICIES = ("max", "pow2", "oracle")


class StaticReservationManager(KVCacheManager):
    """The baseline paging is measured against: each request gets one contiguous run of blocks at
    admission, sized up front, as contiguous per-request allocators do. No prefix sharing; forks copy.

    ``reserve`` picks the size, after the vLLM paper's Orca variants: ``max`` reserves max_model_len,
    ``pow2`` the next power of two >= prompt + max_tokens, ``oracle`` exactly prompt + max_tokens (as if
    the output length were known). Runs are placed first-fit by block id, so variable sizes leave holes
    between reservations: external fragmentation, which ``stranded_free_blocks`` measures.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, *, max_model_len: int, reserve: str = "max",
                 **kwargs: object) -> None:
        kwargs.pop("enable_prefix_caching", None)
        super().__init__(
            num_blocks, block_size, max_model_len=max_model_len, enable_prefix_caching=False, **kwargs  # type: ignore[arg-type]
        )
        if reserve not in RESERVE_POLICIES:
            raise ValueError(f"unknown reservation policy {reserve!r}: choose one of {', '.join(RESERVE_POLICIES)}")
        self.reserve = reserve
        self.reserved_blocks = math.ceil(max_model_len / block_size)  # the largest reservation
        if self.reserved_blocks > num_blocks:
            raise ValueError(
                f"one reservation of max_model_len={max_model_len} needs {self.reserved_blocks} blocks "
                f"but the pool has {num_blocks}"
            )
        self._extents: list[list[int]] = [[0, num_blocks]]  # free runs [start, length], sorted by start

    # ------------------------------------------------------------ sizing
    def reservation_blocks(self, seq: SequenceLike) -> int:
        """Blocks reserved for ``seq`` at admission (never fewer than its tokens already need)."""
        limit = self.max_model_len or 0
        total = getattr(seq, "max_total_tokens", None)
        if self.reserve == "max" or total is None:
            tokens = limit
        elif self.reserve == "oracle":
            tokens = min(limit, total)
        else:
            tokens = min(limit, 1 << max(0, total - 1).bit_length())
        return max(-(-tokens // self.block_size), -(-len(seq.token_ids) // self.block_size), 1)

    def _admission_reserve(self) -> int:
        """No reserve: the watermark protects running sequences' growth, and a reservation already holds
        everything its sequence will ever need, so keeping blocks back would only cost the baseline a slot
        (a pool of 16 reservations would admit 15)."""
        return 0

    def stranded_free_blocks(self, need_blocks: int) -> int:
        """Free blocks in runs too short for a reservation of ``need_blocks``."""
        return sum(n for _, n in self._extents if n < need_blocks)

    @property
    def largest_free_run(self) -> int:
        return max((n for _, n in self._extents), default=0)

    # ------------------------------------------------------- placement
    def _take_run(self, n: int) -> list[KVBlock] | None:
        """First fit: the lowest-addressed free run of ``n`` blocks, or None."""
        for i, (start, length) in enumerate(self._extents):
            if length >= n:
                if length == n:
                    del self._extents[i]
                else:
                    self._extents[i] = [start + n, length - n]
                blocks = self.pool.blocks[start : start + n]
                self.pool.touch(blocks)
                return blocks
        return None

    def _give_back(self, table: list[KVBlock]) -> None:
        """Return a run to the extent list, merging it with free neighbours."""
        start, n = table[0].block_id, len(table)
        ext = self._extents
        i = bisect.bisect_left(ext, [start, 0])
        if i < len(ext) and start + n == ext[i][0]:
            n += ext[i][1]
            del ext[i]
        if i > 0 and ext[i - 1][0] + ext[i - 1][1] == start:
            ext[i - 1][1] += n
        else:
            ext.insert(i, [start, n])

    def _place(self, sid: str, n_blocks: int, num_tokens: int, root: BlockHash) -> list[KVBlock] | None:
        if self.pool.num_free_blocks - n_blocks < self._admission_reserve():
            return None
        table = self._take_run(n_blocks)
        if table is not None:
            self._seqs[sid] = _SeqState(table, num_tokens, [], root)
        return table

    # ------------------------------------------------------- allocation
    def _admit(self, seq: SequenceLike, num_new_tokens: int, hit: PrefixHit) -> Allocation | None:
        if seq.seq_id in self._swapped:
            raise RuntimeError(f"sequence {seq.seq_id!r} is swapped out: swap_in before allocating")
        super().blocks_needed(num_new_tokens)  # validates against max_model_len
        table = self._place(seq.seq_id, self.reservation_blocks(seq), num_new_tokens, self._root(seq))
        if table is None:
            return None
        return Allocation(tuple(b.block_id for b in table))

    def allocate_slots(
        self, seq: SequenceLike, num_new_tokens: int, prefix_hit: PrefixHit | None = None
    ) -> Allocation | None:
        state = self._seqs.get(seq.seq_id)
        if state is not None and num_new_tokens > 0:
            total = state.num_tokens + num_new_tokens
            super().blocks_needed(total)  # validates against max_model_len
            if total > len(state.table) * self.block_size:
                raise RuntimeError(
                    f"sequence {seq.seq_id!r} outgrew its {self.reserve!r} reservation of "
                    f"{len(state.table) * self.block_size} tokens (max_tokens was too small a promise)"
                )
            state.num_tokens = total
            return _NOTHING
        return super().allocate_slots(seq, num_new_tokens, prefix_hit)

    def free(self, seq: SequenceLike | str) -> None:
        state = self._seqs.get(_sid(seq))
        super().free(seq)
        if state is not None:
            self._give_back(state.table)

    def fork(self, parent: SequenceLike | str, child: SequenceLike | str) -> Allocation | None:
        """No sharing: the child gets its own reservation and a copy of every filled block."""
        pstate, cid = self._fork_ids(parent, child)
        new = self._place(cid, len(pstate.table), pstate.num_tokens, pstate.root)
        if new is None:
            return None
        filled = -(-pstate.num_tokens // self.block_size)
        copies = tuple((pstate.table[i].block_id, new[i].block_id) for i in range(filled))
        return Allocation(tuple(b.block_id for b in new), copies)

    def swap_out(self, seq: SequenceLike | str) -> list[tuple[int, int]] | None:
        state = self._seqs.get(_sid(seq))
        mapping = super().swap_out(seq)
        if mapping is not None and state is not None:
            self._give_back(state.table)
        return mapping

    def swap_in(self, seq: SequenceLike) -> list[tuple[int, int]] | None:
        sid = seq.seq_id
        swapped = self._swapped_state(sid)
        host = swapped.host_blocks
        table = self._place(sid, len(host), swapped.num_tokens, swapped.root)
        if table is None:
            return None
        del self._swapped[sid]
        self._host_free.extend(reversed(host))
        self.counters.blocks_swapped_in += len(host)
        return [(h, b.block_id) for h, b in zip(host, table, strict=True)]

    # ------------------------------------------------------- invariants
    def _max_waste_ok(self, waste: int) -> bool:
        return waste >= 0

    def _table_len_ok(self, table_len: int, num_tokens: int) -> bool:
        return -(-num_tokens // self.block_size) <= table_len <= self.reserved_blocks

    def check_invariants(self) -> None:
        super().check_invariants()
        free_ids = sorted(b.block_id for b in self.pool.free_blocks())
        runs = [i for start, n in self._extents for i in range(start, start + n)]
        assert runs == free_ids, "the free runs disagree with the free queue"
        for a, b in zip(self._extents, self._extents[1:], strict=False):
            assert a[0] + a[1] < b[0], f"free runs {a} and {b} overlap or should have merged"
        for sid, state in self._seqs.items():
            ids = [b.block_id for b in state.table]
            assert ids == list(range(ids[0], ids[0] + len(ids))), f"{sid}: reservation is not contiguous"


def make_kv_manager(
    policy: str, num_blocks: int, block_size: int = 16, *, max_model_len: int | None = None, **kwargs: object
) -> KVCacheManager:
    """``paged`` or ``static`` by name (for the CLI, the simulator and benchmarks)."""
    if policy == "paged":
        return KVCacheManager(num_blocks, block_size, max_model_len=max_model_len, **kwargs)  # type: ignore[arg-type]
    if policy == "static":
        if max_model_len is None:
            raise ValueError("the static reservation policy needs max_model_len")
        return StaticReservationManager(num_blocks, block_size, max_model_len=max_model_len, **kwargs)  # type: ignore[arg-type]
    raise ValueError(f"unknown KV policy {policy!r}: choose 'paged' or 'static'")


__all__ = [
    "NO_HIT",
    "Allocation",
    "KVCacheManager",
    "PrefixHit",
    "StaticReservationManager",
    "make_kv_manager",
]
