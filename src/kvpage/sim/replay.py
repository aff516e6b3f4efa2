"""The dashboard page (sim/dashboard.html) and the frames it draws: live from `kvpage serve`, or a recorded
run written as one self-contained HTML file (`kvpage trace --html`, `kvpage simulate --html`) with a slider.

A frame is ``{"stats": {...engine stats names...}, "pool": kv.snapshot.pool_snapshot(...)}``, optionally with
``label``, ``events`` and ``t``; a frame with ``panels`` (each ``{"name", "pool", "stats"}``) shows runs side by
side (static reservation against paging).
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from kvpage.kv.snapshot import pool_snapshot
from kvpage.kv.stats import KVStats

MAX_FRAMES = 400


def page_html(frames: list[dict[str, Any]] | None = None, title: str = "kvpage: KV pool") -> str:
    """The dashboard page; with ``frames`` a self-contained replay of them."""
    html = resources.files("kvpage.sim").joinpath("dashboard.html").read_text(encoding="utf-8")
    data = "null" if frames is None else json.dumps(frames, separators=(",", ":")).replace("</", "<\\/")
    return html.replace("__KVPAGE_TITLE__", title).replace("__KVPAGE_FRAMES__", data)


def stats_fields(s: KVStats, running: int, waiting: int = 0, swapped: int | None = None, preemptions: int = 0,
                 swap_preemptions: int = 0) -> dict[str, Any]:
    """A KV manager's stats under the engine's names (LLMEngine.stats), as the page reads them."""
    return {"running": running, "waiting": waiting, "swapped": s.num_swapped_seqs if swapped is None else swapped,
            "kv_blocks_total": s.num_blocks, "kv_blocks_used": s.used_blocks, "kv_blocks_shared": s.shared_blocks,
            "kv_blocks_cached_free": s.cached_free_blocks, "kv_utilization": s.utilization,
            "kv_tail_waste_slots": s.tail_waste_slots, "kv_reserved_unused_slots": s.reserved_unused_slots,
            "prefix_cache_hit_rate": s.prefix_hit_rate, "prefix_cache_hit_tokens": s.prefix_hit_tokens,
            "prefix_cache_query_tokens": s.prefix_query_tokens, "preemptions": preemptions,
            "swap_preemptions": swap_preemptions, "kv_blocks_swapped_out": s.blocks_swapped_out,
            "kv_blocks_swapped_in": s.blocks_swapped_in}


class FrameRecorder:
    """Frames of a simulated run, at most ``MAX_FRAMES``: when full, every other frame goes and the recorder
    keeps one step in twice as many from then on (evenly spread over the whole run)."""

    def __init__(self, limit: int = MAX_FRAMES) -> None:
        self.limit = limit
        self.frames: list[dict[str, Any]] = []
        self.every = 1
        self._n = 0

    def record(self, kv: Any, sched: Any, now: float) -> None:
        self._n += 1
        if (self._n - 1) % self.every:
            return
        self.frames.append({"t": now, "label": f"step {self._n}, t = {now:.2f} s",
                            "stats": stats_fields(kv.stats(), len(sched.running), len(sched.waiting),
                                                  len(sched.swapped), sched.num_preemptions,
                                                  sched.num_swap_preemptions),
                            "pool": pool_snapshot(kv)})
        if len(self.frames) >= 2 * self.limit:
            self.frames = self.frames[::2]
            self.every *= 2


def side_by_side(runs: dict[str, list[dict[str, Any]]], limit: int = MAX_FRAMES) -> list[dict[str, Any]]:
    """Several runs' frames as one replay: frame k shows each run at the same fraction of its length."""
    n = min(limit, max(len(f) for f in runs.values()))
    out = []
    for k in range(n):
        panels = []
        for name, frames in runs.items():
            f = frames[min(len(frames) - 1, k * len(frames) // n)]
            panels.append({"name": name, "pool": f["pool"], "stats": f["stats"], "label": f.get("label", "")})
        first = panels[0]
        out.append({"label": "; ".join(f"{p['name']}: {p['label']}" for p in panels), "stats": first["stats"],
                    "pool": first["pool"], "panels": panels,
                    "events": [f"{p['name']}: {p['stats']['running']} running, {p['stats']['waiting']} waiting, "
                               f"{p['stats']['kv_blocks_used']} blocks in use, utilization "
                               f"{100 * p['stats']['kv_utilization']:.1f}%" for p in panels]})
    return out
