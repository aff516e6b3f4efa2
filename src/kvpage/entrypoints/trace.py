"""``kvpage trace``: watch the paged allocator work, step by step."""

from __future__ import annotations

import argparse
import json

from kvpage.sim.trace import SCENARIOS, TraceRunner, load_scenario, render_text


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace",
        help="replay a block-allocation scenario and show every block table",
        description=(
            "Replay a scenario through the real KV cache manager and print, per step, each token's "
            "(physical block, offset), the block tables, ref counts and free blocks. Without --scenario "
            "the built-in one runs: arrival, growth past a block boundary, fork with copy-on-write, "
            "prefix-cache hit, finish, reuse of freed blocks, swap out and in. See docs/trace.md."
        ),
    )
    p.add_argument("--scenario", help="scenario file (.json, .yaml or .yml)")
    p.add_argument("--builtin", choices=list(SCENARIOS), default="default",
                   help="the built-in scenario to run without --scenario: default, or sliding (a sliding-window "
                        "layer's cache: blocks leave as the window passes them)")
    p.add_argument("--block-size", type=int, help="override the scenario's block size")
    p.add_argument("--num-blocks", type=int, help="override the scenario's pool size")
    p.add_argument("--policy", choices=["paged", "static"], help="override the allocation policy")
    p.add_argument("--max-model-len", type=int, help="needed by --policy static")
    p.add_argument("--png", help="also draw the pool over time to this PNG file")
    p.add_argument("--html", help="also write the run as a self-contained page with a step slider (the dashboard "
                                  "of `kvpage serve`, replaying each step's pool and block tables)")
    p.add_argument("--dump-scenario", action="store_true", help="print the built-in scenario as JSON and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.dump_scenario:
        print(json.dumps(SCENARIOS[args.builtin], indent=2))
        return 0
    scenario = load_scenario(args.scenario) if args.scenario else dict(SCENARIOS[args.builtin])
    for key, value in (("block_size", args.block_size), ("num_blocks", args.num_blocks),
                       ("policy", args.policy), ("max_model_len", args.max_model_len)):
        if value is not None:
            scenario[key] = value
    runner = TraceRunner(scenario)
    records = runner.run()
    m = runner.m
    window = f", sliding window {scenario['window']} positions" if scenario.get("window") else ""
    print(f"pool: {m.num_blocks} blocks of {m.block_size} tokens, policy {scenario.get('policy', 'paged')}{window}, "
          f"watermark {m.watermark_blocks} blocks, host swap pool {m.num_swap_blocks} blocks\n")
    print(render_text(records, m.block_size), end="")
    if args.png:
        from kvpage.sim.plots import draw_pool_timeline

        draw_pool_timeline(records, args.png)
        print(f"\nwrote {args.png}")
    if args.html:
        name = scenario.get("name") or args.scenario or f"the built-in {args.builtin} scenario"
        write_trace_html(records, args.html, f"kvpage trace: {name}")
        print(f"\nwrote {args.html}")
    return 0


def write_trace_html(records, path: str, title: str) -> None:
    from pathlib import Path

    from kvpage.sim.replay import page_html, stats_fields

    frames = [{"label": f"{rec.index}. {rec.description}", "events": ([rec.note] if rec.note else []) + rec.events,
               "stats": stats_fields(rec.stats, running=len(rec.block_tables), swapped=len(rec.host_tables)),
               "pool": rec.frame} for rec in records]
    Path(path).write_text(page_html(frames, title), encoding="utf-8")
