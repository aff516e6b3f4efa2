"""``kvpage simulate``: the real scheduler and KV manager on a trace, with a step-time model instead of a model."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import itertools
import json
import math
from pathlib import Path
from typing import Any

from kvpage.capacity import KVShape, canonical_dtype, dtype_bytes, kv_heads_per_rank
from kvpage.distributed.shard import check_tensor_parallel
from kvpage.envs import kernel_config
from kvpage.kv import ALLOCATORS
from kvpage.kv.specs import KVLayout, group_layers, with_residual_keys
from kvpage.kv.static import RESERVE_POLICIES
from kvpage.model.config import ModelConfig
from kvpage.model.registry import DEFAULT_MODEL, load_model_config
from kvpage.sim.cost import MACHINE_PROFILES, CostModel, ModelSpec, RooflineCost, load_calibration, load_machine
from kvpage.sim.report import render_run, render_sweep
from kvpage.sim.simulator import SimConfig, Simulator
from kvpage.sim.tp_cost import LINKS, rank_spec, tensor_parallel_cost
from kvpage.sim.workloads import WORKLOADS, SimRequest, WorkloadSpec, generate, load_trace, write_trace
from kvpage.units import format_bytes, parse_size

SWEEPABLE = (
    "allocator", "static_reserve", "block_size", "kv_memory", "num_blocks", "max_model_len",
    "enable_prefix_caching", "watermark", "preemption", "swap_space", "max_num_seqs", "max_num_batched_tokens",
    "num_requests", "rate", "prefix_len", "num_prefixes", "n", "beam_width", "beam_prune", "sigma",
    "prompt_median", "output_median", "seed", "kv_cache_dtype", "scheduling_policy", "enable_chunked_prefill",
    "tensor_parallel_size", "kv_offload_memory", "int8_keys",
)
_D = SimConfig()  # the flags' defaults are the configuration's


def _rate(text: str) -> float:
    r = float(text)
    if not r > 0:
        raise argparse.ArgumentTypeError(f"rate must be > 0 requests/s (or 'inf'), got {text}")
    return r


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="run the real scheduler and KV manager on a workload with a step-time model (no model weights)",
        description=(
            "Drive kvpage's own Scheduler and KV cache manager with a synthetic workload or a JSONL trace, "
            "timing each step with a roofline (or calibrated) cost model instead of running the model. "
            "Reports utilization, waste (last-block tail, reserved-unused, external), concurrency, preemptions, "
            "prefix reuse, throughput and latency. See docs/simulate.md."
        ),
    )
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="lognormal", choices=WORKLOADS)
    w.add_argument("--trace", help="JSONL trace: arrival, prompt_len, output_len[, prefix_id, prefix_len, n, "
                                   "beam_width, priority, ignore_eos] per line (overrides --workload)")
    w.add_argument("--num-requests", type=int, default=512)
    w.add_argument("--rate", type=_rate, default=math.inf, help="Poisson arrivals per second (default: all at t=0)")
    w.add_argument("--prompt-median", type=float, help="lognormal median prompt length")
    w.add_argument("--output-median", type=float, help="lognormal median output length")
    w.add_argument("--sigma", type=float, default=0.8, help="lognormal log-space standard deviation")
    w.add_argument("--max-prompt", type=int)
    w.add_argument("--max-output", type=int)
    w.add_argument("--prefix-len", type=int, default=1000, help="shared-prefix: system prompt tokens")
    w.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct system prompts")
    w.add_argument("--n", type=int, default=4, help="parallel: samples per request")
    w.add_argument("--beam-width", type=int, default=4, help="beam: candidates per request")
    w.add_argument("--beam-prune", type=float, default=_D.beam_prune,
                   help="beam: chance per step a candidate is replaced")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--save-trace", help="write the generated requests as a JSONL trace")

    k = p.add_argument_group("KV cache and scheduler")
    k.add_argument("--allocator", default=_D.kv.allocator, choices=ALLOCATORS)
    k.add_argument("--static-reserve", default=_D.kv.static_reserve, choices=RESERVE_POLICIES,
                   help="static: reserve max_model_len, the next power of two of prompt+output, or exactly it")
    k.add_argument("--block-size", type=int, default=_D.block_size)
    k.add_argument("--kv-memory", "--kv-cache-memory", dest="kv_memory", default="1GiB",
                   help="KV pool size with units (default 1GiB); serve's and generate's name works too")
    k.add_argument("--num-blocks", type=int, help="pool size in blocks (overrides --kv-memory)")
    k.add_argument("--max-model-len", type=int, default=_D.max_model_len)
    k.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_D.kv.enable_prefix_caching)
    k.add_argument("--watermark", type=float, default=_D.kv.watermark)
    k.add_argument("--preemption", default=_D.scheduler.preemption_mode, choices=["recompute", "swap"])
    k.add_argument("--swap-space", default="0", help="host pool for swap preemption, with units")
    k.add_argument("--kv-offload-memory", default="0",
                   help="host tier for prefix blocks the pool evicts, with units (docs/kv_offload.md); their "
                        "copies are charged at memory bandwidth like swaps")
    k.add_argument("--max-num-seqs", type=int, default=_D.scheduler.max_num_seqs)
    k.add_argument("--max-num-batched-tokens", type=int, default=_D.scheduler.max_num_batched_tokens)
    k.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=_D.scheduler.enable_chunked_prefill)
    k.add_argument("--scheduling-policy", default=_D.scheduler.policy, choices=["fcfs", "priority"],
                   help="priority: lower trace 'priority' values run first (as the engine's)")
    k.add_argument("--reserve-certain-growth", action=argparse.BooleanOptionalAction,
                   default=_D.scheduler.reserve_certain_growth,
                   help="admission keeps room for growth running requests are certain of (as the engine's)")

    c = p.add_argument_group("cost model")
    c.add_argument("--model", default=DEFAULT_MODEL, help="model name, preset, .gguf or HF directory (config only)")
    c.add_argument("--dtype", default="bfloat16", help="weights dtype, and the KV's unless --kv-cache-dtype "
                                                       "(bfloat16, float32, fp8, ...)")
    c.add_argument("--kv-cache-dtype", default="auto",
                   help="KV cache dtype when it differs from --dtype, as the engine's flag (e.g. bfloat16 under "
                        "float32 weights: half the KV bytes per token)")
    c.add_argument("--int8-keys", choices=("rows", "channel"), default=None,
                   help="int8 pages' keys, as the engine's KVPAGE_INT8_KEYS (default: that variable's value)")
    c.add_argument("--calibrate", help="step log or coefficients from benchmarks/sim_calibration.py")
    c.add_argument("--machine", default="xeon-amx",
                   help=f"machine profile for the roofline: {', '.join(MACHINE_PROFILES)}, or a JSON file from "
                        "benchmarks/sim_calibration.py --machine-out (default: xeon-amx)")
    c.add_argument("--gemm-tflops", type=float, help="matrix-multiply rate (default: the machine profile's)")
    c.add_argument("--mem-bandwidth", type=float, help="KV read bandwidth in GB/s (default: the machine profile's)")
    c.add_argument("--step-overhead-ms", type=float)
    c.add_argument("--seq-overhead-ms", type=float)
    c.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks sharing heads and MLP (kvpage/distributed): each rank's share of the work plus two "
                        "all-reduces per layer; --kv-memory is then per rank, as for `kvpage plan -tp`")
    c.add_argument("--link", default="loopback", choices=sorted(LINKS),
                   help="the links between ranks (default loopback: processes on one host)")
    c.add_argument("--link-gb-s", type=float, help="all-reduce bandwidth per link in GB/s (default: the link's)")
    c.add_argument("--link-latency-us", type=float, help="all-reduce latency per hop in microseconds")

    o = p.add_argument_group("output")
    o.add_argument("--sweep", action="append", default=[], metavar="PARAM=V1,V2,...",
                   help=f"run once per value and print a table (repeat for a grid); PARAM is one of "
                        f"{', '.join(s.replace('_', '-') for s in SWEEPABLE)}")
    o.add_argument("--json", action="store_true", help="print the report as JSON")
    o.add_argument("--html", metavar="FILE", help="write the run under static reservation and under paging, side by "
                                                  "side, as a self-contained page with a step slider")
    o.add_argument("--png", metavar="DIR", help="write memory-over-time, waste-vs-block-size and "
                                                "hit-rate-vs-sharing pictures into DIR")
    p.set_defaults(func=run, _parser=p)


# ----------------------------------------------------------------- building
def build_requests(args: argparse.Namespace) -> list[SimRequest]:
    if args.trace:
        return load_trace(args.trace)
    return generate(WorkloadSpec(
        args.workload, args.num_requests, args.seed, args.rate, args.prompt_median, args.output_median, args.sigma,
        args.max_prompt, args.max_output, args.prefix_len, args.num_prefixes, args.n, args.beam_width,
    ))


@functools.lru_cache(maxsize=8)
def _model_config(model: str) -> ModelConfig:
    """Read once per process: a sweep builds many runs from the same model (GGUF metadata is not free)."""
    return load_model_config(model)


def kv_shape(args: argparse.Namespace) -> KVShape:
    """The model's KV as the planner prices it (scales included; int8 keys as KVPAGE_INT8_KEYS says, as the
    engine's)."""
    cfg = _model_config(args.model)
    kv_name = canonical_dtype(args.dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype)
    return KVShape(cfg.name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_name, v_head_dim=cfg.value_head_dim,
                   int8_keys=args.int8_keys or kernel_config().int8_keys)


def build_model(args: argparse.Namespace) -> ModelSpec:
    cfg = _model_config(args.model)
    b = dtype_bytes(canonical_dtype(args.dtype))
    kv_bpt = kv_shape(args).bytes_per_token(block_size=args.block_size)
    return ModelSpec(cfg.name, cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads,
                     cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, max(b, 1.0), kv_bpt)


def build_cost(args: argparse.Namespace, model: ModelSpec) -> CostModel:
    if args.calibrate:
        return load_calibration(args.calibrate)
    overrides: dict[str, float] = {}
    for flag, field, scale in (("gemm_tflops", "gemm_flops", 1e12), ("mem_bandwidth", "mem_bandwidth", 1e9),
                               ("step_overhead_ms", "step_overhead", 1e-3), ("seq_overhead_ms", "seq_overhead", 1e-3)):
        v = getattr(args, flag)
        if v is not None:
            if v < 0 or (v == 0 and field in ("gemm_flops", "mem_bandwidth")):
                raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {v}")
            overrides[field] = v * scale
    base = load_machine(args.machine, model.dtype_bytes, overrides.get("gemm_flops"))
    machine = dataclasses.replace(base, **overrides)
    if args.tensor_parallel_size == 1:
        return RooflineCost(model, machine, args.block_size)
    link = LINKS[args.link]
    for flag, value in (("link_gb_s", args.link_gb_s), ("link_latency_us", args.link_latency_us)):
        if value is not None and not value > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    link = dataclasses.replace(link, bandwidth=(args.link_gb_s or link.bandwidth / 1e9) * 1e9,
                               latency=(args.link_latency_us or link.latency * 1e6) * 1e-6)
    return tensor_parallel_cost(model, machine, args.block_size, args.tensor_parallel_size, link)


def build_config(args: argparse.Namespace, model: ModelSpec) -> SimConfig:
    if args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    cfg = _model_config(args.model)
    check_tensor_parallel(cfg.num_attention_heads, cfg.num_kv_heads, cfg.intermediate_size,
                          args.tensor_parallel_size, cfg.name)
    model = rank_spec(model, args.tensor_parallel_size)  # the pool is per rank, as the engine's
    layout, block_bytes = kv_pool_layout(args, cfg)
    num_blocks = args.num_blocks or parse_size(args.kv_memory) // block_bytes
    if num_blocks < 1:
        raise ValueError(f"--kv-memory {args.kv_memory} holds no block of {format_bytes(block_bytes)}")
    swap = parse_size(args.swap_space) // block_bytes if str(args.swap_space) != "0" else 0
    if args.preemption == "swap" and not swap:
        raise ValueError("--preemption swap needs a host pool: give --swap-space (e.g. 1GiB)")
    offload = parse_size(args.kv_offload_memory) // block_bytes if str(args.kv_offload_memory) != "0" else 0
    if str(args.kv_offload_memory) != "0" and not offload:
        raise ValueError(f"--kv-offload-memory {args.kv_offload_memory} holds no block of {format_bytes(block_bytes)}")
    return SimConfig.of(
        allocator=args.allocator, static_reserve=args.static_reserve, block_size=args.block_size,
        num_blocks=num_blocks, max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
        watermark=args.watermark, preemption_mode=args.preemption, num_swap_blocks=swap, offload_blocks=offload,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill, scheduling_policy=args.scheduling_policy,
        reserve_certain_growth=args.reserve_certain_growth, beam_prune=args.beam_prune, seed=args.seed, layout=layout,
    )


def kv_pool_layout(args: argparse.Namespace, cfg: ModelConfig) -> tuple[KVLayout | None, int]:
    """The engine's KV groups (None: one full-attention group) and the bytes of one pool block, per rank: a
    block spans one group's layers; int8 keys per channel add each group's residual group."""
    shape = kv_shape(args)
    layout = None
    if cfg.layer_types is not None or shape.channel_keys:
        layout = group_layers([cfg.layer_window(i) for i in range(cfg.num_layers)])
        layout = with_residual_keys(layout) if shape.channel_keys else layout
    heads, _ = kv_heads_per_rank(cfg.num_kv_heads, args.tensor_parallel_size)
    layers = layout.layers_per_group if layout is not None else cfg.num_layers
    return layout, shape.bytes_per_block(args.block_size, heads, layers)


@dataclasses.dataclass(frozen=True)
class Setup:
    model: ModelSpec
    config: SimConfig
    cost: CostModel
    requests: list[SimRequest]


def build(args: argparse.Namespace) -> Setup:
    model = build_model(args)
    return Setup(model, build_config(args, model), build_cost(args, model), build_requests(args))


def simulate(args: argparse.Namespace) -> tuple[dict[str, Any], Setup]:
    setup = build(args)
    model, config, cost = setup.model, setup.config, setup.cost
    result = Simulator(config, setup.requests, cost).run()
    rank = rank_spec(model, args.tensor_parallel_size)  # KV figures are per rank, as the engine's pools
    report = {
        "workload": args.trace or args.workload,
        "model": model.name,
        "tensor_parallel_size": args.tensor_parallel_size,
        "kv_bytes_per_token": rank.kv_bytes_per_token,
        "kv_memory_bytes": config.num_blocks * kv_pool_layout(args, _model_config(args.model))[1],
        "config": config.flat(),
        "cost_model": cost.describe(),
        "summary": result.summary(),
    }
    return report, setup


# ------------------------------------------------------------------- sweeps
def _parse_sweep(parser: argparse.ArgumentParser, spec: str) -> tuple[str, list[tuple[str, Any]]]:
    if "=" not in spec:
        raise ValueError(f"--sweep {spec!r}: expected PARAM=V1,V2,...")
    name, _, values = spec.partition("=")
    dest = name.strip().lstrip("-").replace("-", "_")
    if dest not in SWEEPABLE:
        raise ValueError(f"--sweep: cannot sweep {name!r}; choose one of "
                         f"{', '.join(s.replace('_', '-') for s in SWEEPABLE)}")
    action = next(a for a in parser._actions if a.dest == dest)
    out = []
    for text in (v.strip() for v in values.split(",")):
        if not text:
            raise ValueError(f"--sweep {spec!r}: empty value")
        if isinstance(action, argparse.BooleanOptionalAction):
            if text.lower() not in ("on", "off", "true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"--sweep {name}: {text!r} is not on/off")
            value: Any = text.lower() in ("on", "true", "1", "yes")
        else:
            try:
                value = action.type(text) if action.type else text
            except (ValueError, argparse.ArgumentTypeError) as e:
                raise ValueError(f"--sweep {name}: bad value {text!r} ({e})") from None
            if action.choices and value not in action.choices:
                raise ValueError(f"--sweep {name}: {text!r} is not one of {', '.join(map(str, action.choices))}")
        out.append((text, value))
    return dest, out


def run(args: argparse.Namespace) -> int:
    sweeps = [_parse_sweep(args._parser, s) for s in args.sweep]
    if sweeps and args.html:
        raise ValueError("--html replays one setting (under static reservation and paging, side by side): drop "
                         "--sweep, or run once per setting")
    if args.save_trace:
        write_trace(build_requests(args), args.save_trace)
    if sweeps:
        rows, reports = [], []
        for combo in itertools.product(*(values for _, values in sweeps)):
            ns = copy.copy(args)
            for (dest, _), (_, value) in zip(sweeps, combo, strict=True):
                setattr(ns, dest, value)
            report, _ = simulate(ns)
            report["sweep"] = {dest: value for (dest, _), (_, value) in zip(sweeps, combo, strict=True)}
            reports.append(report)
            rows.append((" ".join(text for text, _ in combo), report["summary"]))
        if args.json:
            print(json.dumps(reports, indent=2, default=str))
        else:
            print(_header(reports[0], args))
            print(render_sweep(rows, ",".join(d.replace("_", "-") for d, _ in sweeps)), end="")
        return 0
    report, setup = simulate(args)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(_header(report, args))
        print(render_run(report["summary"]), end="")
    if args.png:
        _pictures(setup, Path(args.png), args.seed)
    if args.html:
        _replay(setup, Path(args.html), report)
    return 0


def _replay(setup: Setup, path: Path, report: dict[str, Any]) -> None:
    """The same requests under static reservation and paging, recorded and written side by side."""
    from kvpage.sim.replay import FrameRecorder, page_html, side_by_side
    from kvpage.sim.simulator import Simulator

    runs = {}
    for alloc in ("static", "paged"):
        sim = Simulator(setup.config.replace(allocator=alloc), setup.requests, setup.cost)
        sim.recorder = FrameRecorder()
        sim.run()
        runs[alloc] = sim.recorder.frames
    title = f"kvpage simulate: {report['workload']} on {report['model']}, static reservation against paging"
    path.write_text(page_html(side_by_side(runs), title), encoding="utf-8")
    print(f"wrote {path}")


def _header(report: dict[str, Any], args: argparse.Namespace) -> str:
    c, s = report["config"], report["summary"]
    arrivals = f"Poisson {args.rate:g}/s" if math.isfinite(args.rate) and not args.trace else "trace times" \
        if args.trace else "all at t=0"
    alloc = s["allocator"]
    tp = report.get("tensor_parallel_size", 1)
    per_rank = f" per rank ({tp} ranks)" if tp > 1 else ""
    return (
        f"workload   {report['workload']}: {s['requests']} requests, arrivals {arrivals}\n"
        f"model      {report['model']}, {report['kv_bytes_per_token']} B of KV per token{per_rank}\n"
        f"pool       {c['num_blocks']} blocks x {c['block_size']} tokens = {format_bytes(report['kv_memory_bytes'])}"
        f"{per_rank}; "
        f"max_model_len {c['max_model_len']}; allocator {alloc}; prefix caching "
        f"{'on' if c['enable_prefix_caching'] and c['allocator'] == 'paged' else 'off'}; watermark {c['watermark']:g}; "
        f"preemption {c['preemption_mode']}; max_num_seqs {c['max_num_seqs']}, "
        f"max_num_batched_tokens {c['max_num_batched_tokens']}\n"
        f"cost       {report['cost_model']}\n"
    )


def _pictures(setup: Setup, out_dir: Path, seed: int) -> None:
    from kvpage.sim import plots, studies

    out_dir.mkdir(parents=True, exist_ok=True)
    config, cost, requests = setup.config, setup.cost, setup.requests
    pair = studies.allocator_pair(config, requests, cost)
    plots.draw_memory_over_time(pair, out_dir / "memory_over_time.png", setup.model.kv_bytes_per_token)
    plots.draw_waste_vs_block_size(studies.block_size_series(config, requests, cost),
                                   out_dir / "waste_vs_block_size.png")
    plots.draw_hit_rate_vs_sharing(studies.sharing_series(config, cost, seed=seed),
                                   out_dir / "prefix_hit_vs_sharing.png")
    for name in ("memory_over_time.png", "waste_vs_block_size.png", "prefix_hit_vs_sharing.png"):
        print(f"wrote {out_dir / name}")
