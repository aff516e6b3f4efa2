"""Plain-text renderings of simulation summaries: one run in detail, or a sweep as a table."""

from __future__ import annotations

from typing import Any


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _ms(d: dict[str, float], key: str) -> str:
    return f"{1000 * d[key]:.0f}" if key in d else "-"


def render_run(s: dict[str, Any]) -> str:
    bs = s["block_size"]
    tail_blocks = s["tail_waste_per_seq_tokens"] / bs
    lines = [
        f"memory       utilization (live / allocated slots)  {_pct(s['utilization'])}",
        f"             waste, last-block tail                {_pct(s['waste_tail'])}   "
        f"({s['tail_waste_per_seq_tokens']:.1f} tokens = {tail_blocks:.2f} block per running sequence)",
        f"             waste, reserved but unused            {_pct(s['waste_reserved_unused'])}",
        f"             waste, external (stranded free runs)  {_pct(s['waste_external'])}",
        f"concurrency  peak {s['peak_concurrency']}, mean {s['mean_concurrency']:.1f} running sequences; "
        f"peak KV usage {_pct(s['peak_kv_usage'])} of the pool",
        f"preemptions  {s['preemptions']} (by swap: {s['swap_preemptions']})"
        + (f"; {s['fork_failures']} forks refused for lack of room" if s["fork_failures"] else ""),
        f"prefix cache hit rate {_pct(s['prefix_hit_rate'])} of prompt tokens; shared-prefix blocks saved "
        f"{s['prefix_blocks_saved']} of {s['prefix_blocks_total']}"
        + (f" ({_pct(s['prefix_blocks_saved_fraction'])})" if s["prefix_blocks_total"] else "")
        + (f"; from the host tier {_pct(s['host_tier_hit_rate'])}" if s.get("host_tier_hit_rate") else ""),
        f"sharing      {_pct(s['sharing_saved_fraction'])} of logical token slots stored once "
        f"(prefix hits and forks); copy-on-write copies {s['cow_copies']}; evictions {s['evictions']}",
        f"throughput   {s['throughput_tok_s']:.1f} output tok/s, {s['requests_per_s']:.2f} req/s; "
        f"makespan {s['makespan_s']:.1f} s simulated over {s['steps']} steps",
    ]
    t, e, n = s["ttft_s"], s["latency_s"], s["latency_per_output_token_s"]
    if t:
        lines.append(f"latency ms   TTFT p50 {_ms(t, 'p50')} p90 {_ms(t, 'p90')} p99 {_ms(t, 'p99')} | "
                     f"end-to-end p50 {_ms(e, 'p50')} p90 {_ms(e, 'p90')} p99 {_ms(e, 'p99')} | "
                     f"per output token p50 {_ms(n, 'p50')} p90 {_ms(n, 'p90')}")
    lines.append(f"requests     {s['finished']} finished of {s['requests']}"
                 + (f"; {s['rejected']} rejected (cannot fit max_model_len or the pool)" if s["rejected"] else ""))
    return "\n".join(lines) + "\n"


SWEEP_COLUMNS = (
    ("util", lambda s: _pct(s["utilization"])),
    ("tail", lambda s: _pct(s["waste_tail"])),
    ("reserved", lambda s: _pct(s["waste_reserved_unused"])),
    ("external", lambda s: _pct(s["waste_external"])),
    ("peak seqs", lambda s: str(s["peak_concurrency"])),
    ("mean seqs", lambda s: f"{s['mean_concurrency']:.1f}"),
    ("preempt", lambda s: str(s["preemptions"])),
    ("prefix hit", lambda s: _pct(s["prefix_hit_rate"])),
    ("prefix saved", lambda s: _pct(s["prefix_blocks_saved_fraction"]) if s["prefix_blocks_total"] else "-"),
    ("tok/s", lambda s: f"{s['throughput_tok_s']:.1f}"),
    ("TTFT p50 ms", lambda s: _ms(s["ttft_s"], "p50")),
    ("e2e p50 s", lambda s: f"{s['latency_s']['p50']:.2f}" if s["latency_s"] else "-"),
)


def render_sweep(rows: list[tuple[str, dict[str, Any]]], label: str) -> str:
    columns = list(SWEEP_COLUMNS)
    if any(s["fork_failures"] for _, s in rows):  # samples lost for lack of room change what was served
        columns.append(("forks refused", lambda s: str(s["fork_failures"])))
    if any(s["rejected"] for _, s in rows):
        columns.append(("rejected", lambda s: str(s["rejected"])))
    head = [label] + [c for c, _ in columns]
    body = [[value] + [f(s) for _, f in columns] for value, s in rows]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join(fmt.format(*r) for r in [head, *body]) + "\n"
