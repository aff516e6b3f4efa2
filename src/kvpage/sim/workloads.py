"""Synthetic and recorded request streams for the simulator (lengths only; token ids are made up).

Every generator is seeded, so a workload is reproducible and two allocator settings see the same requests.
Token ids matter only for prefix caching: requests that share a ``prefix_id`` get identical leading
``prefix_len`` tokens; every other token is unique, so nothing else can hit the cache by accident.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

WORKLOADS = ("lognormal", "sharegpt", "shared-prefix", "parallel", "beam")


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival: float  # seconds from the start
    prompt_len: int
    output_len: int  # tokens each sample generates (it stops there, as at an EOS)
    prefix_id: str | None = None  # requests with the same id share their first prefix_len tokens
    prefix_len: int = 0
    n: int = 1  # parallel samples forked from the prompt
    beam_width: int = 0  # > 0: beam-like candidates that get pruned and re-forked while decoding
    priority: int = 0  # lower runs first, under the priority scheduling policy (as the engine's requests)
    # the engine knows output_len ahead (ignore_eos with max_tokens, as benchmark clients send): admission
    # keeps room for it (core/admission.py); otherwise the output may end at any token, as with EOS
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"request {self.request_id}: prompt_len must be >= 1, got {self.prompt_len}")
        if self.output_len < 1:
            raise ValueError(f"request {self.request_id}: output_len must be >= 1, got {self.output_len}")
        if self.arrival < 0 or not math.isfinite(self.arrival):
            raise ValueError(f"request {self.request_id}: arrival must be a finite time >= 0, got {self.arrival}")
        if not 0 <= self.prefix_len <= self.prompt_len:
            raise ValueError(
                f"request {self.request_id}: prefix_len must be in [0, prompt_len={self.prompt_len}], "
                f"got {self.prefix_len}"
            )
        if self.n < 1 or self.beam_width < 0:
            raise ValueError(f"request {self.request_id}: n must be >= 1 and beam_width >= 0")

    @property
    def num_samples(self) -> int:
        return self.beam_width or self.n


@dataclass(frozen=True)
class WorkloadSpec:
    """Knobs of the synthetic workloads (the defaults are the ones the docs and tests use)."""

    kind: str = "sharegpt"
    num_requests: int = 256
    seed: int = 0
    rate: float = math.inf  # requests per second (Poisson); inf = all arrive at t=0
    prompt_median: float | None = None
    output_median: float | None = None
    sigma: float = 0.8  # lognormal shape (log-space standard deviation)
    max_prompt: int | None = None
    max_output: int | None = None
    prefix_len: int = 1000  # shared-prefix: the common system prompt
    num_prefixes: int = 1  # shared-prefix: how many distinct system prompts
    n: int = 4  # parallel
    beam_width: int = 4  # beam

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"unknown workload {self.kind!r}: choose one of {', '.join(WORKLOADS)} (or --trace FILE)")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s (inf = all at once), got {self.rate}")
        if self.sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {self.sigma}")
        if self.num_prefixes < 1 or self.prefix_len < 0:
            raise ValueError("num_prefixes must be >= 1 and prefix_len >= 0")


# (prompt median, output median, prompt cap, output cap) per kind
_DEFAULTS = {
    # ShareGPT as the vLLM paper reports it (mean prompt 161, output 338 tokens): means here ~167 and ~316
    "lognormal": (117, 245, 1024, 1024),
    "sharegpt": (160, 200, 1024, 512),  # issue #5's ShareGPT-like trace
    "shared-prefix": (64, 128, 1024, 512),  # the user part after the system prompt
    "parallel": (160, 128, 1024, 512),
    "beam": (160, 64, 1024, 256),
}


def _lognormal(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    return max(1, min(cap, round(math.exp(rng.gauss(math.log(median), sigma)))))


def generate(spec: WorkloadSpec) -> list[SimRequest]:
    rng = random.Random(spec.seed)
    pm, om, pcap, ocap = _DEFAULTS[spec.kind]
    pm = spec.prompt_median or pm
    om = spec.output_median or om
    pcap = spec.max_prompt or pcap
    ocap = spec.max_output or ocap
    t = 0.0
    out = []
    for i in range(spec.num_requests):
        if math.isfinite(spec.rate):
            t += rng.expovariate(spec.rate)
        arrival = t if math.isfinite(spec.rate) else 0.0
        prompt = _lognormal(rng, pm, spec.sigma, pcap)
        output = _lognormal(rng, om, spec.sigma, ocap)
        kw: dict = {}
        if spec.kind == "shared-prefix":
            kw = {"prefix_id": f"p{i % spec.num_prefixes}", "prefix_len": spec.prefix_len}
            prompt += spec.prefix_len
        elif spec.kind == "parallel":
            kw = {"n": spec.n}
        elif spec.kind == "beam":
            kw = {"beam_width": spec.beam_width}
        out.append(SimRequest(f"r{i}", arrival, prompt, output, **kw))
    return out


TRACE_FIELDS = ("request_id", "arrival", "prompt_len", "output_len", "prefix_id", "prefix_len", "n", "beam_width",
                "priority", "ignore_eos")


def load_trace(path: str | Path) -> list[SimRequest]:
    """JSONL, one request per line: ``arrival`` (s), ``prompt_len``, ``output_len``, optional ``prefix_id``,
    ``prefix_len``, ``n``, ``beam_width``, ``priority``, ``request_id``, ``ignore_eos`` (true: the engine knows the
    output's length ahead). A prefix_id without prefix_len shares the shortest prompt among the requests carrying
    that id."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: each line is a JSON object")
        unknown = set(row) - set(TRACE_FIELDS)
        if unknown:
            raise ValueError(f"{path}:{lineno}: unknown fields {sorted(unknown)} (known: {', '.join(TRACE_FIELDS)})")
        for key in ("arrival", "prompt_len", "output_len"):
            if key not in row:
                raise ValueError(f"{path}:{lineno}: missing {key!r}")
        for key in ("prompt_len", "output_len", "prefix_len", "n", "beam_width", "priority"):
            if key in row and (not isinstance(row[key], int) or isinstance(row[key], bool)):
                raise ValueError(f"{path}:{lineno}: {key} must be an integer, got {row[key]!r}")
        if not isinstance(row.get("ignore_eos", False), bool):
            raise ValueError(f"{path}:{lineno}: ignore_eos must be true or false, got {row['ignore_eos']!r}")
        if not isinstance(row["arrival"], int | float) or isinstance(row["arrival"], bool):
            raise ValueError(f"{path}:{lineno}: arrival must be a number of seconds, got {row['arrival']!r}")
        rows.append((lineno, row))
    if not rows:
        raise ValueError(f"{path}: the trace has no requests")
    shortest: dict[str, int] = {}
    for _, row in rows:
        if row.get("prefix_id") is not None:
            pid = str(row["prefix_id"])
            shortest[pid] = min(shortest.get(pid, row["prompt_len"]), row["prompt_len"])
    out = []
    for lineno, row in rows:
        pid = None if row.get("prefix_id") is None else str(row["prefix_id"])
        try:
            out.append(SimRequest(
                str(row.get("request_id", f"line{lineno}")), float(row["arrival"]), row["prompt_len"],
                row["output_len"], pid, row.get("prefix_len", shortest[pid] if pid else 0),
                row.get("n", 1), row.get("beam_width", 0), row.get("priority", 0), row.get("ignore_eos", False),
            ))
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: {e}") from None
    ids = [r.request_id for r in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: request_id values must be unique")
    return sorted(out, key=lambda r: r.arrival)


def write_trace(requests: list[SimRequest], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in requests:
            row = {k: v for k, v in asdict(r).items() if v not in (None, 0) or k in ("arrival",)}
            if row.get("n") == 1:
                del row["n"]
            f.write(json.dumps(row) + "\n")


class TokenSource:
    """Token ids for simulated prompts and outputs: shared prefixes identical, everything else unique."""

    def __init__(self) -> None:
        self._next = 1
        self._prefix_base: dict[str, int] = {}

    def fresh(self, n: int) -> list[int]:
        start = self._next
        self._next += n
        return list(range(start, start + n))

    def prompt(self, req: SimRequest) -> list[int]:
        ids: list[int] = []
        if req.prefix_id is not None and req.prefix_len:
            base = self._prefix_base.setdefault(req.prefix_id, (len(self._prefix_base) + 1) << 40)
            ids = list(range(base, base + req.prefix_len))
        return ids + self.fresh(req.prompt_len - len(ids))
