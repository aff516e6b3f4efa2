"""Prometheus metrics under the ``kvpage:`` prefix, named after vLLM's so existing dashboards carry over."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpage.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        lab = ["model_name"]
        r = self.registry

        # A metric labelled by the model alone is exported from the start, at 0: a counter that appears only
        # at its first event (the first preemption, say) reads as "missing" to dashboards and alerts.
        def exported(metric):
            metric.labels(model_name)
            return metric

        def gauge(name: str, doc: str) -> Gauge:
            return exported(Gauge(f"kvpage:{name}", doc, lab, registry=r))

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            made = Counter(f"kvpage:{name}", doc, lab + (extra or []), registry=r)
            return made if extra else exported(made)

        def histogram(name: str, doc: str) -> Histogram:
            return exported(Histogram(f"kvpage:{name}", doc, lab, buckets=_LATENCY_BUCKETS, registry=r))

        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.swapped = gauge("num_requests_swapped", "Requests swapped out to host memory")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)")
        self.kv_blocks_used = gauge("kv_cache_blocks_used", "KV blocks held by sequences")
        self.kv_blocks_total = gauge("kv_cache_blocks_total", "KV blocks in the pool")
        self.kv_utilization = gauge("kv_cache_utilization_perc", "Live token slots / allocated slots")
        self.kv_blocks_shared = gauge("kv_cache_blocks_shared", "KV blocks held by more than one sequence "
                                      "(prefix hits, n > 1 samples, beams)")
        self.kv_blocks_per_request = gauge("kv_cache_blocks_per_request", "KV blocks in use per running request")
        self.cow_copies = counter("kv_cache_cow_copies", "Shared blocks copied before a write (copy-on-write)")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.tier_hits = counter("prefix_cache_hits_by_tier", "Prompt tokens found in the prefix cache, by the tier "
                                 "that held them (device pool, host memory, disk)", ["tier"])
        self.tier_blocks = Gauge("kvpage:kv_offload_blocks", "Prefix blocks held below the pool, by tier",
                                 [*lab, "tier"], registry=r)
        self.disk_bytes = Gauge("kvpage:kv_offload_disk_bytes", "Bytes of the disk tier's block files", lab,
                                registry=r)  # only where there is a disk tier
        self.disk_problems = counter("kv_offload_disk_problems", "Disk tier files ignored (other model, dtype, "
                                     "block size or format), blocks that failed their checksum, failed writes",
                                     ["kind"])
        self.preemptions = counter("num_preemptions", "Sequences preempted (recompute or swap)")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of accepted requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.request_success = counter("request_success", "Finished requests", ["finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token")
        self.itl = histogram("inter_token_latency_seconds", "Time between successive tokens of a request")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token")
        self.step_time = histogram("engine_step_seconds", "Duration of one engine step")
        self.stored = Gauge("kvpage:responses_stored", "What /v1/responses and /v1/conversations keep in memory: "
                            "stored responses and conversations, by kind", [*lab, "kind"], registry=r)
        self.stored_bytes = Gauge("kvpage:responses_stored_bytes", "Their text (JSON) as the stores' memory limits "
                                  "count it, by kind", [*lab, "kind"], registry=r)
        self._stores: dict[str, Any] = {}  # kind -> a store with len() and nbytes (read when scraped)
        self.model = model_name
        self._last: dict[str, Any] = {}
        self._last_tier: dict[str, int] = {}
        self._last_token_time: dict[str, float] = {}

    def on_step(self, client: Any, outs: list[RequestOutput], step_seconds: float) -> None:
        """Engine thread, after each step: gauges from the fresh stats, counters by delta, latencies."""
        m = self.model
        s = client.stats
        self.running.labels(m).set(s["running"])
        self.waiting.labels(m).set(s["waiting"])
        self.swapped.labels(m).set(s["swapped"])
        self.kv_usage.labels(m).set(s["kv_usage"])
        self.kv_blocks_used.labels(m).set(s["kv_blocks_used"])
        self.kv_blocks_total.labels(m).set(s["kv_blocks_total"])
        self.kv_utilization.labels(m).set(s["kv_utilization"])
        self.kv_blocks_shared.labels(m).set(s["kv_blocks_shared"])
        self.kv_blocks_per_request.labels(m).set(s["kv_blocks_per_request"])
        for counter, key in ((self.cow_copies, "cow_copies"), (self.prefix_queries, "prefix_cache_query_tokens"),
                             (self.prefix_hits, "prefix_cache_hit_tokens"), (self.preemptions, "preemptions"),
                             (self.generation_tokens, "generated_tokens")):
            delta = s[key] - self._last.get(key, 0)
            if delta > 0:
                counter.labels(m).inc(delta)
        self._tiers(s)
        self._last = dict(s)
        if step_seconds:
            self.step_time.labels(m).observe(step_seconds)
        now = time.time()
        for out in outs:
            rid = out.request_id
            n_tokens = sum(len(c.token_ids) for c in out.outputs)  # delta outputs: new tokens only
            if n_tokens:
                last = self._last_token_time.get(rid)
                if last is None:
                    arrival = out.metrics.arrival_time if out.metrics else now
                    self.ttft.labels(m).observe(max(0.0, now - arrival))
                else:  # a step adds one token per sample, more only when several arrive at once
                    per_sample = max(1, n_tokens // max(1, len(out.outputs)))
                    for _ in range(per_sample):
                        self.itl.labels(m).observe((now - last) / per_sample)
                self._last_token_time[rid] = now
            if out.finished:
                arrival = out.metrics.arrival_time if out.metrics else now
                self.e2e.labels(m).observe(max(0.0, now - arrival))
                reasons = {c.finish_reason for c in out.outputs if c.finish_reason} or {"abort"}
                for reason in reasons:
                    self.request_success.labels(m, reason).inc()
                self._last_token_time.pop(rid, None)

    def _tiers(self, s: dict[str, Any]) -> None:
        """Per-tier hits and sizes, when the engine has tiers below the pool."""
        if "host_hit_tokens" not in s:
            return
        m = self.model
        below = s["host_hit_tokens"] + s["disk_hit_tokens"]
        for tier, value in (("device", s["prefix_cache_hit_tokens"] - below), ("host", s["host_hit_tokens"]),
                            ("disk", s["disk_hit_tokens"])):
            delta = value - self._last_tier.get(tier, 0)
            if delta > 0:
                self.tier_hits.labels(m, tier).inc(delta)
            self._last_tier[tier] = value
        self.tier_blocks.labels(m, "host").set(s["host_tier_blocks"])
        if "disk_tier_blocks" in s:
            self.tier_blocks.labels(m, "disk").set(s["disk_tier_blocks"])
            self.disk_bytes.labels(m).set(s["disk_tier_bytes"])
            for kind, key in (("ignored_file", "disk_ignored_files"), ("corrupt_block", "disk_corrupt_blocks"),
                              ("write_error", "disk_write_errors")):
                delta = s[key] - self._last.get(key, 0)
                if delta > 0:
                    self.disk_problems.labels(m, kind).inc(delta)

    def add_prompt_tokens(self, n: int) -> None:
        self.prompt_tokens.labels(self.model).inc(n)

    def watch_stores(self, **stores: Any) -> None:
        """Stores (each with len() and nbytes) whose size every scrape reports, by kind."""
        self._stores.update(stores)

    def render(self) -> bytes:
        for kind, store in self._stores.items():
            self.stored.labels(self.model, kind).set(len(store))
            self.stored_bytes.labels(self.model, kind).set(store.nbytes)
        return generate_latest(self.registry)
