"""Replay a small allocation scenario through the real KVCacheManager and record every step.

Scenario format (JSON or YAML): a mapping with pool settings and a list of ``steps``; each step is a
mapping whose first key names the operation::

    block_size: 4          # tokens per block
    num_blocks: 12
    watermark: 0.0         # fraction of blocks kept free at admission (default 0 here)
    swap_blocks: 4         # host pool for swap_out / swap_in (default 0)
    prefix_caching: true   # default true
    policy: paged          # or static (then max_model_len is required)
    max_model_len: 64
    window: 6              # optional: a sliding-window layer's cache (blocks leave as the window passes)
    steps:
      - arrive: A          # new request; prompt is a list of token ids, or a string (its UTF-8 bytes)
        prompt: [11, 12, 13, 14, 15, 16]
        chunk: 4           # optional: prefill only this many prompt tokens now
        cache_salt: t1     # optional isolation key
      - prefill: A         # compute the next prompt chunk (optional ``chunk``)
      - decode: A          # or [A, B]: one new token each; ``tokens: [..]`` or ``count: n`` repeats
      - fork: A            # child shares every block
        child: B
      - finish: A          # free
      - swap_out: B
      - swap_in: B

Each step computes its tokens immediately (as one engine step would) and then registers newly full
blocks in the prefix cache, exactly like the engine's update phase.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpage.kv import KVCacheManager, KVPoolConfig, KVSequence, make_kv_manager, token_location
from kvpage.kv.snapshot import pool_snapshot
from kvpage.kv.specs import single_group
from kvpage.kv.stats import KVStats

BUILTIN_SCENARIO: dict[str, Any] = {
    "block_size": 4,
    "num_blocks": 12,
    "watermark": 0.0,
    "swap_blocks": 4,
    "steps": [
        {"arrive": "A", "prompt": [11, 12, 13, 14, 15, 16], "note": "prompt of 6 tokens: 2 blocks"},
        {"decode": "A", "tokens": [17, 18, 19], "note": "growth past a block boundary at token 8"},
        {"fork": "A", "child": "B", "note": "parallel sample: B shares all of A's blocks"},
        {"decode": "B", "tokens": [90], "note": "B writes into the shared partial block: copy-on-write"},
        {"decode": "A", "tokens": [20], "note": "A is now the sole owner: writes in place"},
        {"arrive": "C", "prompt": [11, 12, 13, 14, 15, 16, 17, 18, 50, 51],
         "note": "same first 8 tokens as A: prefix-cache hit on 2 full blocks"},
        {"finish": "A", "note": "A's unshared blocks return to the free queue"},
        {"arrive": "D", "prompt": [70, 71, 72, 73, 74, 75], "note": "a new request reuses freed blocks"},
        {"swap_out": "B", "note": "B moves to the host pool"},
        {"swap_in": "B", "note": "B comes back; full blocks still cached on device are shared, not copied"},
        {"finish": ["B", "C", "D"]},
    ],
}

SLIDING_SCENARIO: dict[str, Any] = {
    "name": "sliding window",
    "block_size": 4,
    "num_blocks": 12,
    "window": 6,
    "steps": [
        {"arrive": "A", "prompt": [11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
         "note": "10 tokens; the next query (position 10) sees positions 5..10: block 0 (0..3) is never read again"},
        {"decode": "A", "tokens": [21, 22],
         "note": "position 12 sees 7..12: block 1 (4..7) is still read; it leaves one token later"},
        {"arrive": "B", "prompt": [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 40],
         "note": "same 12 tokens: a hit needs only the blocks the window covers at the hit point"},
        {"decode": ["A", "B"], "count": 6, "note": "each holds at most ceil((6 - 1) / 4) + 1 = 3 blocks"},
        {"finish": ["A", "B"], "note": "every block back; the full ones stay findable in the prefix cache"},
    ],
}
SCENARIOS = {"default": BUILTIN_SCENARIO, "sliding": SLIDING_SCENARIO}

OPS = ("arrive", "prefill", "decode", "fork", "finish", "swap_out", "swap_in")


@dataclass
class BlockView:
    owners: tuple[str, ...]  # sequences whose block table holds this block
    ref_count: int
    cached: bool  # holds a prefix hash (possibly while free)


@dataclass
class StepRecord:
    index: int
    op: str
    description: str
    note: str = ""
    events: list[str] = field(default_factory=list)
    placements: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)  # seq -> (pos, block, off)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    host_tables: dict[str, list[int]] = field(default_factory=dict)
    pool: list[BlockView] = field(default_factory=list)
    stats: KVStats | None = None
    frame: dict[str, Any] | None = None  # the pool as the dashboard draws it (kv/snapshot.py)


class ScenarioError(ValueError):
    pass


def load_scenario(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"scenario file not found: {path}")
    text = path.read_text()
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:
        raise ScenarioError(f"{path}: cannot parse scenario ({e})") from e
    if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
        raise ScenarioError(f"{path}: a scenario is a mapping with a 'steps' list")
    return data


class TraceRunner:
    def __init__(self, scenario: dict[str, Any]) -> None:
        known = {"block_size", "num_blocks", "watermark", "swap_blocks", "prefix_caching", "policy",
                 "max_model_len", "steps", "name", "window"}
        unknown = set(scenario) - known
        if unknown:
            raise ScenarioError(f"unknown scenario settings: {', '.join(sorted(unknown))}")
        self.scenario = scenario
        window = scenario.get("window")
        layout = single_group(1, int(window)) if window is not None else None
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ScenarioError(f"window must be a positive number of positions, got {window!r}")
        self.m: KVCacheManager = KVPoolConfig(
            int(scenario.get("num_blocks", 12)), int(scenario.get("block_size", 4)),
            str(scenario.get("policy", "paged")), num_swap_blocks=int(scenario.get("swap_blocks", 0)),
            enable_prefix_caching=bool(scenario.get("prefix_caching", True)),
            watermark=float(scenario.get("watermark", 0.0)),
        ).build(scenario.get("max_model_len"), layout) if window is not None else make_kv_manager(
            str(scenario.get("policy", "paged")),
            int(scenario.get("num_blocks", 12)),
            int(scenario.get("block_size", 4)),
            max_model_len=scenario.get("max_model_len"),
            watermark=float(scenario.get("watermark", 0.0)),
            num_swap_blocks=int(scenario.get("swap_blocks", 0)),
            enable_prefix_caching=bool(scenario.get("prefix_caching", True)),
        )
        self.seqs: dict[str, KVSequence] = {}
        self.prompt_len: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.records: list[StepRecord] = []

    def run(self) -> list[StepRecord]:
        for i, step in enumerate(self.scenario["steps"], start=1):
            try:
                self._step(i, step)
            except ScenarioError as e:
                raise ScenarioError(f"step {i} ({_describe(step)}): {e}") from None
            self.m.check_invariants()
        return self.records

    # ----------------------------------------------------------------- steps
    def _step(self, index: int, step: Any) -> None:
        if not isinstance(step, dict) or not step:
            raise ScenarioError("a step is a mapping such as {arrive: A, prompt: [1, 2, 3]}")
        op = next(iter(step))
        if op not in OPS:
            raise ScenarioError(f"unknown operation {op!r}: choose one of {', '.join(OPS)}")
        rec = StepRecord(index, op, _describe(step), str(step.get("note", "")))
        names = step[op] if isinstance(step[op], list) else [step[op]]
        names = [str(n) for n in names]
        getattr(self, f"_op_{op}")(rec, step, names)
        self._snapshot(rec)
        self.records.append(rec)

    def _seq(self, name: str) -> KVSequence:
        if name not in self.seqs:
            raise ScenarioError(f"no request named {name!r} (known: {', '.join(self.seqs) or 'none'})")
        return self.seqs[name]

    def _compute(self, rec: StepRecord, seq: KVSequence, n: int, alloc: Any) -> None:
        for src, dst in alloc.copies:
            rec.events.append(f"{seq.seq_id}: copy-on-write, copy block {src} -> block {dst} before writing")
        start = self.computed[seq.seq_id]
        table = self.m.block_table(seq.seq_id)
        rec.placements.setdefault(seq.seq_id, []).extend(
            (p, *token_location(table, self.m.block_size, p)) for p in range(start, start + n)
        )
        self.computed[seq.seq_id] = start + n
        self.m.cache_computed_blocks(seq)
        left = [b for b, now in zip(table, self.m.block_table(seq.seq_id), strict=True) if b >= 0 > now]
        if left:
            rec.events.append(f"{seq.seq_id}: the window passed block{'s' if len(left) > 1 else ''} "
                              f"{', '.join(map(str, left))}: released (full blocks stay in the prefix cache)")

    def _op_arrive(self, rec: StepRecord, step: dict[str, Any], names: list[str]) -> None:
        prompt = step.get("prompt")
        if isinstance(prompt, str):
            prompt = list(prompt.encode())
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt):
            raise ScenarioError("arrive needs a non-empty 'prompt': a list of token ids or a string")
        for name in names:
            if name in self.seqs:
                raise ScenarioError(f"request {name!r} already exists")
            seq = KVSequence(name, list(prompt), cache_salt=step.get("cache_salt"))
            hit = self.m.lookup_prefix(seq)
            n = len(prompt) - hit.num_tokens
            if step.get("chunk"):
                n = min(n, int(step["chunk"]))
            alloc = self.m.allocate_slots(seq, n, hit)
            if alloc is None:
                rec.events.append(f"{name}: not admitted now (needs more free blocks than the "
                                  f"{self.m.num_free_blocks} free, watermark {self.m.watermark_blocks})")
                continue
            self.seqs[name] = seq
            self.prompt_len[name] = len(prompt)
            self.computed[name] = hit.num_tokens
            if hit.num_tokens:
                rec.events.append(f"{name}: prefix-cache hit, {hit.num_tokens} tokens in blocks {hit.block_ids}")
            self._compute(rec, seq, n, alloc)

    def _op_prefill(self, rec: StepRecord, step: dict[str, Any], names: list[str]) -> None:
        for name in names:
            seq = self._seq(name)
            left = self.prompt_len[name] - self.computed[name]
            if left <= 0:
                raise ScenarioError(f"{name} has no prompt tokens left to prefill")
            n = min(left, int(step.get("chunk") or left))
            alloc = self.m.allocate_slots(seq, n)
            if alloc is None:
                rec.events.append(f"{name}: not now: no free block for the next chunk")
                continue
            self._compute(rec, seq, n, alloc)

    def _op_decode(self, rec: StepRecord, step: dict[str, Any], names: list[str]) -> None:
        tokens = step.get("tokens")
        count = len(tokens) if isinstance(tokens, list) else int(step.get("count", 1))
        for k in range(count):
            for name in names:
                seq = self._seq(name)
                if self.computed[name] < self.prompt_len[name]:
                    raise ScenarioError(f"{name} is still prefilling its prompt: prefill it first")
                tok = tokens[k] if isinstance(tokens, list) else 1000 + len(seq.token_ids)
                seq.token_ids.append(int(tok))
                alloc = self.m.allocate_slots(seq, 1)
                if alloc is None:
                    seq.token_ids.pop()
                    rec.events.append(f"{name}: not now: pool exhausted (the scheduler would preempt)")
                    continue
                self._compute(rec, seq, 1, alloc)

    def _op_fork(self, rec: StepRecord, step: dict[str, Any], names: list[str]) -> None:
        if len(names) != 1 or "child" not in step:
            raise ScenarioError("fork takes one parent and a 'child' name")
        parent, child = self._seq(names[0]), str(step["child"])
        if child in self.seqs:
            raise ScenarioError(f"request {child!r} already exists")
        alloc = self.m.fork(parent, child)
        if alloc is None:
            rec.events.append(f"{child}: fork refused: no room for a copy")
            return
        for src, dst in alloc.copies:
            rec.events.append(f"{child}: copy block {src} -> block {dst} (no sharing under this policy)")
        self.seqs[child] = KVSequence(child, list(parent.token_ids), parent.cache_salt)
        self.prompt_len[child] = self.prompt_len[parent.seq_id]
        self.computed[child] = self.computed[parent.seq_id]

    def _op_finish(self, rec: StepRecord, step: dict[str, Any], names: list[str]) -> None:
        for name in names:
            self._seq(name)
            self.m.free(name)
            del self.seqs[name]

    def _op_swap_out(self, rec: StepRecord, step: dict[str, Any], names: list[str]) -> None:
        for name in names:
            self._seq(name)
            if not self.m.has_seq(name):
                raise ScenarioError(f"{name} is not on the device")
            mapping = self.m.swap_out(name)
            if mapping is None:
                rec.events.append(f"{name}: swap-out refused: host pool full ({self.m.num_free_swap_blocks} free)")
                continue
            rec.events.append(f"{name}: copy device->host " + ", ".join(f"{d}->h{h}" for d, h in mapping))

    def _op_swap_in(self, rec: StepRecord, step: dict[str, Any], names: list[str]) -> None:
        for name in names:
            seq = self._seq(name)
            if not self.m.is_swapped(name):
                raise ScenarioError(f"{name} is not swapped out")
            mapping = self.m.swap_in(seq)
            if mapping is None:
                rec.events.append(f"{name}: swap-in refused: not enough free device blocks")
                continue
            moved = ", ".join(f"h{h}->{d}" for h, d in mapping) or "nothing (all blocks still cached)"
            rec.events.append(f"{name}: copy host->device {moved}")

    # --------------------------------------------------------------- record
    def _snapshot(self, rec: StepRecord) -> None:
        owners: dict[int, list[str]] = {}
        for sid in self.m.seq_ids():
            table = self.m.block_table(sid)
            rec.block_tables[sid] = table
            for b in table:
                if b >= 0:  # -1: an entry a sliding window dropped
                    owners.setdefault(b, []).append(sid)
        for sid in self.m.swapped_seq_ids():
            rec.host_tables[sid] = self.m.host_block_table(sid)
        rec.pool = [
            BlockView(tuple(owners.get(b.block_id, ())), b.ref_count, b.block_hash is not None)
            for b in self.m.pool.blocks
        ]
        rec.stats = self.m.stats()
        rec.frame = pool_snapshot(self.m)


def _describe(step: Any) -> str:
    if not isinstance(step, dict) or not step:
        return repr(step)
    op = next(iter(step))
    target = step[op]
    target = ", ".join(map(str, target)) if isinstance(target, list) else str(target)
    extra = ""
    if op == "arrive" and isinstance(step.get("prompt"), list | str):
        extra = f" ({len(step['prompt'])} prompt tokens)"
    elif op == "decode":
        n = len(step["tokens"]) if isinstance(step.get("tokens"), list) else int(step.get("count", 1))
        extra = f" (+{n} token{'s' if n != 1 else ''})"
    elif op == "fork":
        extra = f" -> {step.get('child')}"
    return f"{op} {target}{extra}"


def render_text(records: list[StepRecord], block_size: int) -> str:
    out: list[str] = []
    for rec in records:
        out.append(f"step {rec.index}: {rec.description}" + (f"  -- {rec.note}" if rec.note else ""))
        for ev in rec.events:
            out.append(f"  ! {ev}")
        for sid, places in rec.placements.items():
            cells = " ".join(f"{p}:({b},{o})" for p, b, o in places)
            out.append(f"  {sid} tokens pos:(block,offset)  {cells}")
        tables = "  ".join(f"{sid}=[{', '.join(str(b) if b >= 0 else '-' for b in t)}]"
                           for sid, t in rec.block_tables.items()) or "(none)"
        out.append(f"  block tables   {tables}")
        if rec.host_tables:
            out.append("  host tables    " + "  ".join(f"{sid}={t}" for sid, t in rec.host_tables.items()))
        refs = " ".join(f"{i}:{v.ref_count}" for i, v in enumerate(rec.pool) if v.ref_count)
        out.append(f"  ref counts     {refs or '(all free)'}")
        st = rec.stats
        assert st is not None
        out.append(
            f"  free blocks    {st.free_blocks}/{st.num_blocks} (holding cached prefixes: {st.cached_free_blocks})"
            f" | live tokens {st.live_tokens} in {st.allocated_slots} slots | prefix hits "
            f"{st.prefix_hit_tokens} tokens | CoW copies {st.cow_copies} | evictions {st.evictions}"
        )
        out.append("")
    return "\n".join(out).rstrip() + "\n"
