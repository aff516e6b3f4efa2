"""The paged KV manager: per-sequence block tables over a shared block pool.

The scheduler asks; the manager answers in block ids and copy instructions; the worker moves bytes.
Within one engine step the worker must apply the instructions in this order, because a block released
by one instruction can be handed out by the next:

1. swap-out copies (device -> host), 2. swap-in copies (host -> device),
3. copy-on-write copies (device -> device), 4. the forward pass, which writes new K/V at their slots.

Prefix-cache registration happens after a step (``cache_computed_blocks``), so a cached block always
holds K/V that was really computed.
"""

from __future__ import annotations

from kvpage.kv.block import DEFAULT_BLOCK_SIZE, KVBlock
from kvpage.kv.block_pool import BlockPool
from kvpage.kv.host_tier import HostTier
from kvpage.kv.invariants import check_invariants
from kvpage.kv.offload import PrefixTiers, TierOps
from kvpage.kv.paged_seqs import PagedSeqs, _SeqState, _sid, _SwappedState
from kvpage.kv.prefix_hash import BlockHash, HashFn, block_hash, root_hash, sha256_digest
from kvpage.kv.protocol import NO_HIT, NOTHING, Allocation, PrefixHit
from kvpage.kv.sequence import SequenceLike
from kvpage.kv.slot_mapping import cdiv, slot_mapping
from kvpage.kv.stats import KVCounters


class KVCacheManager(PagedSeqs):
    """Paged allocation: a sequence holds ceil(tokens / block_size) blocks, shared where possible.

    ``watermark`` is a fraction of the pool kept free when *admitting* a sequence (a new one, or a
    swapped one coming back) while others are running, so admissions cannot starve running sequences into
    preemption; growing a running sequence may use every block.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
        num_swap_blocks: int = 0,
        max_model_len: int | None = None,
        model_id: str = "",
        hash_fn: HashFn = sha256_digest,
        pool: BlockPool | None = None,
        group: int = 0,
        host_free: HostTier | None = None,
        tiers: PrefixTiers | None = None,
    ) -> None:
        """``pool``, ``group`` and ``host_free``: one KV group of a hybrid manager (kv/hybrid.py), sharing the
        device pool and the host tier with the others; its prefix hashes and set-aside blocks are keyed by
        the group so that groups never find each other's blocks. ``tiers``: the host and disk tiers below the
        pool for evicted prefix blocks (its host tier is then the swap space too)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {watermark}")
        if num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be >= 0, got {num_swap_blocks}")
        if max_model_len is not None and max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.block_size = block_size
        self._own_pool = pool is None
        self.pool = pool if pool is not None else BlockPool(num_blocks)
        self.num_blocks = num_blocks = self.pool.num_blocks
        self.group = group
        self._model_key = model_id if group == 0 else f"{model_id}|kv-group-{group}"
        self.watermark = watermark
        self.watermark_blocks = int(num_blocks * watermark)
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = max_model_len
        self.model_id = model_id
        self.hash_fn = hash_fn
        self.num_swap_blocks = num_swap_blocks
        # swap slots (and offloaded prefix blocks); shared by the groups of a hybrid manager
        self.tiers = tiers
        if tiers is not None:
            if not enable_prefix_caching:
                raise ValueError("KV offload tiers keep prefix-cache blocks: enable prefix caching to use them")
            host_free = tiers.host
            if tiers not in self.pool.listeners:  # the groups of a hybrid manager share one
                self.pool.listeners.append(tiers)
        self._host_free = host_free if host_free is not None else HostTier(num_swap_blocks)
        if self._host_free.num_slots != num_swap_blocks:
            raise ValueError(f"the host tier has {self._host_free.num_slots} slots, not num_swap_blocks="
                             f"{num_swap_blocks}")
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
        """Physical block ids; -1 marks an entry a sliding window dropped (never read)."""
        return [b.block_id if b is not None else -1 for b in self._state(seq_id).table]

    def block_tables(self, seq_id: str) -> list[list[int]]:
        """One block table per KV group (here: one group)."""
        return [self.block_table(seq_id)]

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
        return slot_mapping([b.block_id if b is not None else -1 for b in table], bs, start, num_tokens)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens occupies under this policy."""
        if self.max_model_len is not None and num_tokens > self.max_model_len:
            raise ValueError(f"sequence of {num_tokens} tokens exceeds max_model_len={self.max_model_len}")
        return cdiv(num_tokens, self.block_size)

    # ------------------------------------------------------------ prefix cache
    def _root(self, seq: SequenceLike) -> BlockHash:
        return root_hash(self._model_key, seq.adapter_id, seq.cache_salt, self.hash_fn)

    def _root_key(self, seq: SequenceLike) -> tuple:
        """The exact isolation keys a chain starts from (its hash, the root, may collide; these cannot)."""
        return "root", self._model_key, seq.adapter_id, seq.cache_salt

    def _owner(self, seq_id: str) -> str:
        """The name this group's set-aside blocks carry for a sequence (groups share the pool)."""
        return seq_id if self.group == 0 else f"{seq_id}@{self.group}"

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
        i = 0
        for i in range(max_blocks):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk, self.hash_fn)
            block = self.pool.lookup(h, ident, chunk)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
            parent, ident = h, block.identity
        if self.tiers is None or len(blocks) == max_blocks:
            return PrefixHit(tuple(blocks), tuple(hashes), len(blocks) * bs)
        loads = []  # the pool's hit ends at block i: the tiers below may go on
        for j in range(i, max_blocks):
            chunk = tuple(tokens[j * bs : (j + 1) * bs])
            h = block_hash(parent, chunk, self.hash_fn)
            found = self.tiers.find(h, parent, chunk, j)
            found = found and self.tiers.stage(found)
            if found is None:
                break
            loads.append(found)
            parent = h
        return PrefixHit(tuple(blocks), tuple(hashes), (len(blocks) + len(loads)) * bs, loads=tuple(loads))

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
            pool.cache_block(table[i], h, table[i - 1].identity if i else self._root_key(seq), chunk, parent)
            hashes.append(h)
            parent = h
        return full - start

    def reset_prefix_cache(self) -> int:
        """Forget all cached hashes, in the pool and the tiers below it; running sequences keep their blocks.
        Returns the count dropped."""
        for state in self._seqs.values():
            state.hashes.clear()
        for swapped in self._swapped.values():
            swapped.hashes.clear()
        n = self.tiers.clear() if self.tiers is not None else 0
        return self.pool.reset_prefix_cache() + n

    def begin_step(self) -> None:
        """A new engine step: host slots read by the last step's loads and swap-ins may be reused."""
        self._host_free.begin_step()

    def take_tier_ops(self) -> TierOps | None:
        """The tier copies this step's allocations planned (stores of evicted blocks, loads of tier hits)."""
        return self.tiers.take_ops() if self.tiers is not None else None

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
            return NOTHING
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
                self.pool.release_ahead(self._owner(seq.seq_id), src)  # what lay ahead of the replaced last block
            (dst,) = self.pool.get_new_blocks(1, after=table[write_idx - 1] if write_idx else None)
            self.pool.release((src,))
            table[write_idx] = dst
            copies = ((src.block_id, dst.block_id),)
            self.counters.cow_copies += 1
        state.num_tokens = total
        if need <= 0:
            return Allocation((), copies) if copies else NOTHING
        new = self.pool.get_new_blocks(need, after=self._last_block(table), owner=self._owner(seq.seq_id))
        table.extend(new)
        return Allocation(tuple(b.block_id for b in new), copies)

    def blocks_to_allocate(self, seq: SequenceLike, num_new_tokens: int, prefix_hit: PrefixHit | None = None) -> int:
        """The free blocks ``allocate_slots`` would take now: new blocks, cached ones it revives, and a
        copy-on-write copy. Pure: a hybrid manager sums this over its groups before allocating in any."""
        bs = self.block_size
        state = self._seqs.get(seq.seq_id)
        if state is None:
            hit = prefix_hit or NO_HIT
            revived = sum(1 for b in hit.blocks if b is not None and b.ref_count == 0)
            k = hit.num_tokens // bs
            return max(self.blocks_needed(hit.num_tokens + num_new_tokens) - k + len(hit.loads), 0) + revived
        if num_new_tokens == 0:
            return 0
        table, n = state.table, state.num_tokens
        write_idx = n // bs
        cow = write_idx < len(table) and table[write_idx] is not None and table[write_idx].ref_count > 1
        return max(self.blocks_needed(n + num_new_tokens) - len(table), 0) + int(cow)

    def _admit(self, seq: SequenceLike, num_new_tokens: int, hit: PrefixHit) -> Allocation | None:
        sid = seq.seq_id
        if sid in self._swapped:
            raise RuntimeError(f"sequence {sid!r} is swapped out: swap_in before allocating")
        held = [b for b in hit.blocks if b is not None]  # a sliding window's hit skips blocks before it
        for block, h in zip(hit.blocks, hit.hashes, strict=True):
            if block is not None and block.block_hash != h:
                raise RuntimeError("stale prefix hit: a block was evicted between lookup and allocation")
        total = hit.num_tokens + num_new_tokens
        k = hit.num_tokens // self.block_size  # the hit's table: pool blocks, None where dropped or loaded
        num_new_blocks = self.blocks_needed(total) - k + len(hit.loads)
        revived = sum(1 for b in held if b.ref_count == 0)
        if self.pool.num_free_blocks - num_new_blocks - revived < self._admission_reserve():
            return None
        self.pool.touch(held)
        table = list(hit.blocks) + [None] * (k - len(hit.blocks))
        if hit.loads:
            self.tiers.hold(hit.loads)
        new = self.pool.get_new_blocks(max(num_new_blocks, 0), after=self._last_block(hit.blocks),
                                       owner=self._owner(sid))
        loaded, new = new[:len(hit.loads)], new[len(hit.loads):]
        for load, block in zip(hit.loads, loaded, strict=True):
            table[load.index] = block
        hashes = list(hit.hashes)
        self._seqs[sid] = _SeqState(table + new, total, hashes, self._root(seq))
        if hit.loads:  # the loads run before this step's forward pass: findable at once, as swapped-in blocks are
            self.tiers.load(hit.loads, loaded)
            self._register_loads(seq, table, hashes, hit.loads)
            if self._own_pool:  # a hybrid manager counts for all its groups
                self.tiers.count_hit([hit.loads])
        if self.enable_prefix_caching:
            self.counters.prefix_query_tokens += len(seq.token_ids)
            self.counters.prefix_hit_tokens += hit.num_tokens
        return Allocation(tuple(b.block_id for b in loaded + new), (), hit.num_tokens)

    def _register_loads(self, seq: SequenceLike, table: list, hashes: list[BlockHash], loads: tuple) -> None:
        """Loaded blocks enter the pool's prefix cache (a full-attention chain's loads follow its pool blocks)."""
        for load in loads:
            i, e = load.index, load.entry
            self.pool.cache_block(table[i], e.block_hash, table[i - 1].identity if i else self._root_key(seq),
                                  e.token_ids, e.parent_hash)
            hashes.append(e.block_hash)

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
        self.pool.release_ahead(self._owner(sid), self._last_block(state.table))
        self.pool.release([b for b in state.table[::-1] if b is not None])

    def fork(self, parent: SequenceLike | str, child: SequenceLike | str) -> Allocation | None:
        """Make ``child`` share every block of ``parent`` (parallel sampling, beam candidates).

        Paged: no block moves now; the first write into a shared partial block copies it.
        """
        pstate, cid = self._fork_ids(parent, child)
        self.pool.touch(b for b in pstate.table if b is not None)
        self._seqs[cid] = _SeqState(list(pstate.table), pstate.num_tokens, list(pstate.hashes), pstate.root)
        return NOTHING

    # ------------------------------------------------------------------- stats
    def check_invariants(self) -> None:
        """Raise AssertionError if a bookkeeping invariant (docs/architecture.md) is broken."""
        check_invariants(self)

    def _max_waste_ok(self, waste: int) -> bool:
        return 0 <= waste < self.block_size

    def _table_len_ok(self, table_len: int, num_tokens: int) -> bool:
        return table_len == self.blocks_needed(num_tokens)

    def reservation_blocks(self, seq: SequenceLike) -> int:
        """Blocks ``seq`` takes when admitted now, without a prefix hit."""
        return cdiv(len(seq.token_ids), self.block_size)

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
    @staticmethod
    def _last_block(table) -> KVBlock | None:
        """The last block a table holds (a sliding-window table may end in a dropped entry)."""
        for block in reversed(table):
            if block is not None:
                return block
        return None

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
