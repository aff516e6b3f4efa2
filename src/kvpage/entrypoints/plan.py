"""``kvpage plan``: how many requests a KV budget holds, paged vs static, for a model."""

from __future__ import annotations

import argparse
import json

from kvpage.capacity import CapacityPlan, KVShape, canonical_dtype, plan_capacity
from kvpage.envs import kernel_config
from kvpage.kv import DEFAULT_BLOCK_SIZE
from kvpage.model.registry import DEFAULT_MODEL, PRESETS, load_model_config
from kvpage.units import format_bytes, parse_size


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="KV cache capacity planner",
        description=(
            "Size the KV cache of a model: bytes per token and block, blocks in a memory budget, and how "
            "many requests fit paged vs statically reserved. The model is the embedded default, a preset, "
            "a .gguf file or a Hugging Face directory; --layers/--kv-heads/--head-dim override or replace it."
        ),
    )
    p.add_argument("--model", default=None,
                   help=f"model name, preset or path (default: {DEFAULT_MODEL}; presets: "
                        f"{', '.join(c.name for c in PRESETS.values())})")
    p.add_argument("--layers", type=int, help="number of layers holding a KV cache")
    p.add_argument("--kv-heads", type=int, help="KV heads per layer (== query heads for MHA)")
    p.add_argument("--head-dim", type=int, help="width of one K (and V) head")
    p.add_argument("--dtype", "--kv-cache-dtype", dest="dtype", default=None,
                   help="KV cache dtype: float32, float16/fp16, bfloat16/bf16, fp8 (fp8_e4m3), fp8_e5m2, int8 "
                        "(default: the model's dtype)")
    p.add_argument("--int8-keys", choices=("rows", "channel"), default=None,
                   help="int8 pages' keys, as the engine's KVPAGE_INT8_KEYS (default: that variable's value)")
    p.add_argument("--kv-memory", "--kv-cache-memory", dest="kv_memory", default="4GiB",
                   help="KV budget per rank, with units (default: 4GiB); serve's and generate's name works too")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help=f"tokens per block (default: {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--context-len", type=int, help="tokens per request (default: max model length)")
    p.add_argument("--max-model-len", type=int, help="longest sequence served (default: the model's)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks sharing the KV heads")
    p.add_argument("--tail-waste", type=float, default=None,
                   help="also estimate concurrency with this tail-waste fraction (e.g. 0.04, the paper's bound)")
    p.add_argument("--mean-prompt-len", type=int, help="workload mix: mean prompt tokens")
    p.add_argument("--mean-output-len", type=int, help="workload mix: mean output tokens")
    p.add_argument("--list-presets", action="store_true", help="list the preset architectures and exit")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def shape_from_args(args: argparse.Namespace) -> KVShape:
    explicit = (args.layers, args.kv_heads, args.head_dim)
    if args.model is None and all(v is not None for v in explicit):
        return KVShape(name="explicit", num_layers=args.layers, num_kv_heads=args.kv_heads,
                       head_dim=args.head_dim, dtype=canonical_dtype(args.dtype or "float16"),
                       int8_keys=args.int8_keys or kernel_config().int8_keys)
    if args.model is None and any(v is not None for v in explicit):
        raise ValueError("an explicit spec needs all of --layers, --kv-heads and --head-dim (or a --model to override)")
    cfg = load_model_config(args.model or DEFAULT_MODEL)
    overridden = any(v is not None and v != getattr(cfg, k)
                     for v, k in zip(explicit, ("num_layers", "num_kv_heads", "head_dim"), strict=True))
    windows = None
    if cfg.layer_types is not None and not overridden:
        windows = tuple(cfg.layer_window(i) for i in range(cfg.num_layers))
    return KVShape(
        name=cfg.name + (" (overridden)" if overridden else ""),
        num_layers=args.layers or cfg.num_layers,
        num_kv_heads=args.kv_heads or cfg.num_kv_heads,
        head_dim=args.head_dim or cfg.head_dim,
        v_head_dim=None if args.head_dim else cfg.v_head_dim,
        dtype=canonical_dtype(args.dtype or cfg.dtype),
        num_attention_heads=cfg.num_attention_heads,
        max_model_len=cfg.max_position_embeddings or None,
        source=cfg.source,
        windows=windows,
        int8_keys=args.int8_keys or kernel_config().int8_keys,  # as the engine reads KVPAGE_INT8_KEYS
    )


def run(args: argparse.Namespace) -> int:
    if args.list_presets:
        for c in PRESETS.values():
            print(f"{c.name:<16} layers {c.num_layers:>3}  heads {c.num_attention_heads:>3}  KV heads "
                  f"{c.num_kv_heads:>3}  head dim {c.head_dim:>3}  context {c.max_position_embeddings}")
        return 0
    shape = shape_from_args(args)
    plan = plan_capacity(
        shape,
        parse_size(args.kv_memory),
        block_size=args.block_size,
        context_len=args.context_len,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
        tail_waste=args.tail_waste,
        mean_prompt_len=args.mean_prompt_len,
        mean_output_len=args.mean_output_len,
    )
    print(json.dumps(plan.as_dict(), indent=2) if args.json else render(plan))
    return 0


def _row(label: str, value: str) -> str:
    return f"  {label:<48} {value}"


def _n(x: float) -> str:
    return f"{x:,}" if x == int(x) else f"{x:,.2f}"


def render(plan: CapacityPlan) -> str:
    s = plan.shape
    heads = f"{s.num_kv_heads} KV heads"
    if s.num_attention_heads:
        kind = "MHA" if s.num_attention_heads == s.num_kv_heads else (
            "MQA" if s.num_kv_heads == 1 else f"GQA {s.num_attention_heads // s.num_kv_heads}:1")
        heads += f" ({s.num_attention_heads} query heads, {kind})"
    vdim = f"/{s.v_head_dim}" if s.v_head_dim else ""
    tp = plan.tensor_parallel_size
    lines = [
        f"Model            {s.name}  [{s.source}]",
        f"KV shape         {s.num_layers} layers x {heads} x head dim {s.head_dim}{vdim}, "
        f"{s.dtype} ({s.dtype_bytes:g} B/value" + (", keys per channel over each block, values as rows; each "
                                                     "request holds one block more for its filling block's keys)"
                                                     if s.channel_keys else ")"),
    ]
    if tp > 1:
        how = ("sharded evenly" if plan.tp_layout == "sharded"
               else f"replicated: {s.num_kv_heads} heads do not divide over {tp} ranks")
        lines.append(f"Tensor parallel  {tp} ranks: {plan.kv_heads_per_rank} KV heads per rank ({how})")
    per_rank = " per rank" if tp > 1 else ""
    lines += [
        f"KV per token     {format_bytes(plan.bytes_per_token_per_rank)}{per_rank} "
        f"({_n(plan.bytes_per_token_per_rank)} B)" + (f"; {format_bytes(plan.bytes_per_token)} for the unsharded model"
                                                       if tp > 1 else ""),
        f"KV per block     {format_bytes(plan.bytes_per_block)}{per_rank} ({plan.block_size} tokens)",
        f"Budget           {format_bytes(plan.kv_memory_bytes)}{per_rank} -> {_n(plan.num_blocks)} blocks = "
        f"{_n(plan.token_slots)} token slots",
        f"One request      {_n(plan.context_len)} tokens = {format_bytes(plan.request_bytes_per_rank)}{per_rank}, "
        f"{_n(plan.blocks_per_request)} blocks",
        "",
        f"Max concurrent requests at {_n(plan.context_len)} tokens:",
        _row("paged (whole blocks, tail < 1 block)", _n(plan.paged_max_requests)),
    ]
    if plan.paged_max_requests_tail_estimate is not None:
        lines.append(_row(
            f"paged (tail estimate {plan.tail_waste:.0%}: "
            f"{format_bytes(plan.request_bytes_per_rank_tail_estimate or 0)}/request)",
            _n(plan.paged_max_requests_tail_estimate),
        ))
    lines.append(_row(f"static reservation (max_model_len {_n(plan.max_model_len)})", _n(plan.static_max_requests)))
    w = plan.workload
    if w is not None:
        gain = f"{w.paged_average / w.static:.1f}x" if w.static else "n/a (static admits none)"
        lines += [
            "",
            f"Workload mix: mean prompt {_n(w.mean_prompt_len)} + mean output {_n(w.mean_output_len)} tokens "
            f"({w.mean_live_tokens:,.0f} live tokens per request on average)",
            _row("paged, average case", f"{_n(w.paged_average)}  (utilization {w.paged_utilization:.1%})"),
            _row("paged, every request at its last token", _n(w.paged_peak)),
            _row("static reservation", f"{_n(w.static)}  (utilization {w.static_utilization:.1%})"),
            _row("paged / static", gain),
        ]
    h = plan.hybrid
    if h is not None:
        lines += [
            "",
            f"Layer types      {h.sliding_layers} sliding-window layers (window {_n(h.window)}) and {h.full_layers} "
            f"full-attention layers: {h.groups}",
            _row("KV per token that grows with the context", f"{format_bytes(h.bytes_per_token_full_layers)}"
                 f" ({h.full_layers} full layers)"),
            _row("the window's fixed cost per request", format_bytes(h.window_bytes_per_request)),
            _row(f"one request at {_n(plan.context_len)} tokens, every layer full", format_bytes(h.request_bytes_full)),
            _row(f"one request at {_n(plan.context_len)} tokens, by layer type", format_bytes(h.request_bytes_hybrid)),
            _row(f"max concurrent requests (pool of {_n(h.num_blocks)} blocks of "
                 f"{format_bytes(h.bytes_per_block)})", f"{_n(h.max_requests_hybrid)} by layer type vs "
                 f"{_n(h.max_requests_full)} every layer full ({h.ratio:.2f}x)"),
        ]
    if plan.context_table:
        hyb = plan.hybrid is not None
        lines += ["", f"{'context':>9}  {'KV / request' + per_rank:>22}  {'paged max requests':>18}"
                  + (f"  {'by layer type':>16}  {'max requests':>12}" if hyb else "")]
        for row in plan.context_table:
            lines.append(f"{_n(row['context_len']):>9}  {format_bytes(row['request_bytes_per_rank']):>22}  "
                         f"{_n(row['paged_max_requests']):>18}"
                         + (f"  {format_bytes(row['hybrid_request_bytes_per_rank']):>16}  "
                            f"{_n(row['hybrid_max_requests']):>12}" if hyb else ""))
    return "\n".join(lines)
