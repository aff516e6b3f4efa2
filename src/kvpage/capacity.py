"""KV cache sizing: bytes per token and block, blocks in a budget, concurrency paged vs static.

Formulas (tensor payload only; weights, activations and runtime buffers are budgeted elsewhere):

* bytes/token = layers x KV heads x (key dim + value dim) x bytes per value  (= 2·L·H·d·b when K and V
  have the same width), plus, for a quantized cache (int8, fp8), its float16 scale per K and per V row:
  + 2·L·H·2 bytes
* under tensor parallelism the KV heads are split evenly over the ranks when they divide; otherwise every
  rank keeps all of them (the conservative replicated budget)
* bytes/block = bytes/token (per rank) x block_size; blocks = floor(budget / bytes/block)
* int8 pages with keys per channel (``KVPAGE_INT8_KEYS=channel``, attention/kv_channel.py) are priced by the
  block: per layer and KV head n·D key codes + D zero codes + D step codes + 4 bytes of units, then n value
  rows of D + 2 bytes; each sequence also holds one block per KV group for its filling block's unrounded keys
  (the residual group, kv/residual.py)
* paged: a request of C tokens holds ceil(C / block_size) blocks -> max concurrency floor(blocks / that)
* static reservation: every request holds ceil(max_model_len / block_size) blocks whatever its length
* tail-waste estimate (the paper's "under 4%" figure): floor(budget / (C x bytes/token x (1 + tail)))
* workload mix: a request averages prompt + output/2 live tokens over its life, plus (block_size-1)/2
  slots of tail waste on average; the peak case holds prompt + output.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpage.dtypes import DTYPES, lookup
from kvpage.kv import DEFAULT_BLOCK_SIZE


def dtype_bytes(dtype: str) -> float:
    try:
        return lookup(dtype).bytes
    except ValueError:
        raise ValueError(f"unknown KV dtype {dtype!r}: choose one of {', '.join(sorted(_names()))}") from None


def canonical_dtype(dtype: str) -> str:
    dtype_bytes(dtype)
    return lookup(dtype).name


def _names() -> list[str]:
    return [n for d in DTYPES for n in (d.name, *d.aliases)]


@dataclass(frozen=True)
class KVShape:
    """The part of a model that decides KV memory."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    v_head_dim: int | None = None
    num_attention_heads: int | None = None
    max_model_len: int | None = None
    source: str = "explicit"
    # per layer: its sliding window in positions, None for full attention (None: every layer full)
    windows: tuple[int | None, ...] | None = None
    # int8 pages' keys (KVPAGE_INT8_KEYS): "rows" (a scale per token and head) or "channel" (per channel)
    int8_keys: str = "rows"

    def __post_init__(self) -> None:
        for n in ("num_layers", "num_kv_heads", "head_dim"):
            v = getattr(self, n)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{n} must be a positive integer, got {v!r}")
        dtype_bytes(self.dtype)
        if self.windows is not None and len(self.windows) != self.num_layers:
            raise ValueError(f"windows must give one entry per layer ({self.num_layers}), got {len(self.windows)}")
        if self.int8_keys not in ("rows", "channel"):
            raise ValueError(f"int8_keys must be 'rows' or 'channel', got {self.int8_keys!r}")
        if self.channel_keys and self.v_head_dim not in (None, self.head_dim):
            raise ValueError("int8 pages with keys per channel need values as wide as keys")

    @property
    def channel_keys(self) -> bool:
        """int8 pages whose keys are rounded per channel (the other dtypes ignore ``int8_keys``)."""
        return self.int8_keys == "channel" and lookup(self.dtype).name == "int8"

    @property
    def residual_blocks(self) -> int:
        """Blocks each running sequence holds per KV group beyond its tokens' own: its residual block."""
        return 1 if self.channel_keys else 0

    @property
    def hybrid(self) -> bool:
        return self.windows is not None and any(w is not None for w in self.windows)

    @property
    def dtype_bytes(self) -> float:
        return dtype_bytes(self.dtype)

    def bytes_per_token(self, num_kv_heads: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE) -> float:
        """Every layer's K and V of one token, a quantized cache's scales included (an int: rows are whole
        bytes per token); for keys per channel a block's bytes shared by its ``block_size`` tokens."""
        if self.channel_keys:
            return self.bytes_per_block(block_size, num_kv_heads) / block_size
        heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        width = self.head_dim + (self.v_head_dim or self.head_dim)
        scales = 2 * lookup(self.dtype).scale_bytes
        return int(self.num_layers * heads * (width * self.dtype_bytes + scales))

    def bytes_per_block(self, block_size: int, num_kv_heads: int | None = None, num_layers: int | None = None) -> int:
        """One pool block over ``num_layers`` layers (default: all of them): what the engine's pool, the
        planner and the simulator divide a budget by."""
        heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        layers = self.num_layers if num_layers is None else num_layers
        if self.channel_keys:
            return layers * channel_page_bytes(block_size, heads, self.head_dim)
        return layers * int(self.bytes_per_token(heads)) // self.num_layers * block_size


def channel_block_bytes(block_size: int, head_dim: int) -> int:
    """One block's keys per channel for one KV head: the codes, a zero and a step code per channel, two
    bfloat16 units (attention/kv_channel.py)."""
    return block_size * head_dim + 2 * head_dim + 4


def channel_page_bytes(block_size: int, kv_heads: int, head_dim: int) -> int:
    """One block of one layer with keys per channel: every head's keys, then the values as int8 rows (a bfloat16
    scale each)."""
    return kv_heads * (channel_block_bytes(block_size, head_dim) + block_size * lookup("int8").kv_row_bytes(head_dim))


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> tuple[int, str]:
    """(KV heads each rank stores, "sharded" | "replicated")."""
    if tensor_parallel_size <= 0:
        raise ValueError(f"tensor_parallel_size must be positive, got {tensor_parallel_size}")
    if num_kv_heads % tensor_parallel_size == 0:
        return num_kv_heads // tensor_parallel_size, "sharded"
    return num_kv_heads, "replicated"


@dataclass(frozen=True)
class WorkloadCapacity:
    mean_prompt_len: int
    mean_output_len: int
    mean_live_tokens: float
    mean_slots_paged: float
    paged_average: int  # concurrent requests, average case
    paged_peak: int  # every request at prompt + output
    static: int
    static_utilization: float  # live tokens / reserved slots under static reservation
    paged_utilization: float


@dataclass(frozen=True)
class HybridCapacity:
    """Per-layer-type allocation (KV groups, kv/specs.py) against keeping every layer's whole history."""

    groups: str  # e.g. "5 sliding(512) groups, 1 full group of 3 layers"
    full_layers: int
    sliding_layers: int
    window: int
    bytes_per_token_full_layers: int  # what grows with the context
    window_bytes_per_request: int  # the sliding layers' fixed cost: the window's blocks (at most)
    bytes_per_block: int  # one pool block spans a group's layers
    num_blocks: int
    request_bytes_full: int  # every layer keeps the whole context (exact, whole blocks)
    request_bytes_hybrid: int
    blocks_per_request_full: int  # in this pool's blocks
    blocks_per_request_hybrid: int
    max_requests_full: int
    max_requests_hybrid: int

    @property
    def ratio(self) -> float:
        return self.max_requests_hybrid / self.max_requests_full if self.max_requests_full else math.inf


def hybrid_capacity(shape: KVShape, kv_memory_bytes: int, block_size: int, context_len: int,
                    heads: int) -> HybridCapacity:
    """Blocks and bytes a request holds at ``context_len`` when sliding layers keep only their window."""
    from kvpage.kv.specs import KVSpec, group_layers, with_residual_keys

    layout = group_layers(list(shape.windows or ()))
    if shape.channel_keys:
        layout = with_residual_keys(layout)
    per_layer = shape.bytes_per_block(block_size, heads, 1) / block_size
    bpb = shape.bytes_per_block(block_size, heads, layout.layers_per_group)
    num_blocks = kv_memory_bytes // bpb
    full = KVSpec()
    blocks_full = sum((g.spec if g.spec.residual else full).max_blocks(block_size, context_len) for g in layout.groups)
    blocks_hybrid = sum(g.spec.max_blocks(block_size, context_len) for g in layout.groups)
    windows = {w for w in shape.windows or () if w is not None}
    sliding = sum(1 for w in shape.windows or () if w is not None)
    window_blocks = sum(g.spec.max_blocks(block_size, context_len) for g in layout.groups if g.spec.window)
    return HybridCapacity(
        groups=layout.describe(), full_layers=shape.num_layers - sliding, sliding_layers=sliding,
        window=max(windows), bytes_per_token_full_layers=round(per_layer * (shape.num_layers - sliding)),
        window_bytes_per_request=window_blocks * bpb, bytes_per_block=bpb, num_blocks=num_blocks,
        request_bytes_full=blocks_full * bpb, request_bytes_hybrid=blocks_hybrid * bpb,
        blocks_per_request_full=blocks_full, blocks_per_request_hybrid=blocks_hybrid,
        max_requests_full=num_blocks // blocks_full, max_requests_hybrid=num_blocks // blocks_hybrid,
    )


@dataclass(frozen=True)
class CapacityPlan:
    shape: KVShape
    block_size: int
    kv_memory_bytes: int  # per rank
    tensor_parallel_size: int
    kv_heads_per_rank: int
    tp_layout: str
    bytes_per_token: float  # whole model, all ranks together (replicated heads counted once)
    bytes_per_token_per_rank: float  # keys per channel: a block's bytes over its tokens
    bytes_per_block: int  # per rank
    num_blocks: int
    token_slots: int
    context_len: int
    max_model_len: int
    request_bytes_per_rank: int  # one request at context_len, exact (keys per channel: whole blocks)
    blocks_per_request: int  # with keys per channel, the residual group's block too
    paged_max_requests: int
    static_blocks_per_request: int
    static_max_requests: int
    tail_waste: float | None
    paged_max_requests_tail_estimate: int | None
    request_bytes_per_rank_tail_estimate: float | None
    workload: WorkloadCapacity | None = None
    context_table: list[dict[str, int]] = field(default_factory=list)
    hybrid: HybridCapacity | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"]["dtype_bytes"] = self.shape.dtype_bytes
        if self.hybrid is not None:
            d["hybrid"]["ratio"] = self.hybrid.ratio
        return d


def plan_capacity(
    shape: KVShape,
    kv_memory_bytes: int,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    context_len: int | None = None,
    max_model_len: int | None = None,
    tensor_parallel_size: int = 1,
    tail_waste: float | None = None,
    mean_prompt_len: int | None = None,
    mean_output_len: int | None = None,
) -> CapacityPlan:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if kv_memory_bytes <= 0:
        raise ValueError(f"KV memory budget must be positive, got {kv_memory_bytes} bytes")
    for name, v in (("context_len", context_len), ("max_model_len", max_model_len)):
        if v is not None and v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    max_len = max_model_len or shape.max_model_len
    ctx = context_len or max_len
    if not ctx:
        raise ValueError("no context length: pass --context-len (the model does not state its maximum)")
    max_len = max_len or ctx
    if ctx <= 0 or max_len <= 0:
        raise ValueError(f"context length must be positive, got context_len={ctx}, max_model_len={max_len}")
    if ctx > max_len:
        raise ValueError(f"context_len={ctx} exceeds max_model_len={max_len}")
    if tail_waste is not None and not 0 <= tail_waste < 1:
        raise ValueError(f"tail waste must be a fraction in [0, 1), got {tail_waste}")
    heads, layout = kv_heads_per_rank(shape.num_kv_heads, tensor_parallel_size)
    bpb = shape.bytes_per_block(block_size, heads)
    bpt_rank = shape.bytes_per_token(heads, block_size)
    extra = shape.residual_blocks
    num_blocks = kv_memory_bytes // bpb
    if num_blocks == 0:
        raise ValueError(
            f"a KV budget of {kv_memory_bytes} bytes per rank holds no block of {bpb} bytes "
            f"(block_size {block_size}); did you forget a unit, e.g. 8GiB?"
        )
    blocks_per_req = math.ceil(ctx / block_size) + extra
    static_blocks = math.ceil(max_len / block_size) + extra
    request_bytes = blocks_per_req * bpb if shape.channel_keys else ctx * bpt_rank

    tail_estimate = tail_bytes = None
    if tail_waste is not None:
        tail_bytes = ctx * bpt_rank * (1 + tail_waste)
        tail_estimate = math.floor(kv_memory_bytes / tail_bytes)

    workload = None
    if mean_prompt_len is not None or mean_output_len is not None:
        p, o = mean_prompt_len or 0, mean_output_len or 0
        if p < 0 or o < 0 or p + o == 0:
            raise ValueError(f"workload mix needs non-negative lengths with a positive sum, got {p} + {o}")
        if p + o > max_len:
            raise ValueError(f"mean prompt + output = {p + o} tokens exceeds max_model_len={max_len}")
        live = p + o / 2
        slots = live + (block_size - 1) / 2 + extra * block_size
        workload = WorkloadCapacity(
            mean_prompt_len=p,
            mean_output_len=o,
            mean_live_tokens=live,
            mean_slots_paged=slots,
            paged_average=math.floor(num_blocks * block_size / slots),
            paged_peak=num_blocks // (math.ceil((p + o) / block_size) + extra),
            static=num_blocks // static_blocks,
            static_utilization=live / (static_blocks * block_size),
            paged_utilization=live / slots,  # the residual's block counts as slots here
        )

    table = []
    c = 1024
    while c <= max(max_len, ctx):
        row = {
            "context_len": c,
            "request_bytes_per_rank": round(c * bpt_rank),
            "request_bytes_total": round(c * shape.bytes_per_token(block_size=block_size)),
            "paged_max_requests": num_blocks // (math.ceil(c / block_size) + extra),
        }
        if shape.hybrid:
            h = hybrid_capacity(shape, kv_memory_bytes, block_size, c, heads)
            row |= {"hybrid_request_bytes_per_rank": h.request_bytes_hybrid,
                    "hybrid_max_requests": h.max_requests_hybrid}
        table.append(row)
        c *= 2

    return CapacityPlan(
        shape=shape,
        block_size=block_size,
        kv_memory_bytes=kv_memory_bytes,
        tensor_parallel_size=tensor_parallel_size,
        kv_heads_per_rank=heads,
        tp_layout=layout,
        bytes_per_token=shape.bytes_per_token(block_size=block_size),
        bytes_per_token_per_rank=bpt_rank,
        bytes_per_block=bpb,
        num_blocks=num_blocks,
        token_slots=num_blocks * block_size,
        context_len=ctx,
        max_model_len=max_len,
        request_bytes_per_rank=round(request_bytes),
        blocks_per_request=blocks_per_req,
        paged_max_requests=num_blocks // blocks_per_req,
        static_blocks_per_request=static_blocks,
        static_max_requests=num_blocks // static_blocks,
        tail_waste=tail_waste,
        paged_max_requests_tail_estimate=tail_estimate,
        request_bytes_per_rank_tail_estimate=tail_bytes,
        workload=workload,
        context_table=table,
        hybrid=hybrid_capacity(shape, kv_memory_bytes, block_size, ctx, heads) if shape.hybrid else None,
    )


def num_blocks_for_budget(shape: KVShape, kv_memory_bytes: int, block_size: int, tensor_parallel_size: int = 1) -> int:
    """Blocks a per-rank KV budget holds (what the engine sizes its pool with)."""
    heads, _ = kv_heads_per_rank(shape.num_kv_heads, tensor_parallel_size)
    return kv_memory_bytes // shape.bytes_per_block(block_size, heads)
