"""Quantized KV pages (int8, fp8_e4m3, fp8_e5m2) against float32, bfloat16 and float16 caches: what they hold,
how well the model predicts from them, and how fast the paged kernel reads them.

* capacity: tokens per GiB of KV memory for each cache dtype (the worker's sizing, scales included) and the
  ratio to bfloat16;
* accuracy: one fixed text (benchmarks/data/kv_quant_text.txt: README.md, docs/kv.md and a Python module of
  kvpage as of 2026-12-02, for prose, markup and code),
  teacher-forced in chunks of 32 tokens so that every position attends through the cache (the paged kernel
  reads each chunk's keys back from the pages it just wrote): top-1 agreement with the float32-cache run, the
  mean KL divergence from its next-token distribution (which near ties do not make noisy) and the perplexity,
  float32 weights throughout, so only the cache differs (--untransformed, --without-feedback: the engine's
  transforms left out, or only the keys' rounding feedback);
* write: the quantizing write of one layer's new rows, plain against keys rounded with feedback;
* speed: one layer's paged decode attention over 64 sequences x 8K tokens of context, median of rounds,
  every cache dtype side by side in each round, the caches allocated as the engine's pool is (2 MiB pages
  where the OS allows; --small-pages for 4 KiB pages); where decode over packed int8 pages runs on AMX byte
  tiles, "int8-vnni" times the same pages on the VNNI loop;
* split (--split, kv_split.py): where int8's disagreement comes from. A float32 cache is written with keys and/or values
  that went through int8 rows and back (the oracle's rounding: row scales, keys rotated), on all layers or on
  some (e.g. only a hybrid model's sliding-window layers), with one scale per 64 values instead of per row,
  and with keys quantized per channel (a scale and a zero point per channel over each complete 16-key
  block, as KIVI does; the text is written in chunks of 32, so every block is complete when it is rounded);
  last, a candidate page format for keys: per channel over a 32-key block, the block's codes rounded again
  from their stored values whenever a key that arrives widens a channel's range (a filling block as the
  engine would hold it), the scale and zero point stored in one byte each per channel (units of a bf16 per
  block and head), or exact, against the same keys rounded once over the complete block (exact parameters,
  or the one-byte ones); values centred and rotated as the engine's int8 pages keep them;
* channel (--channel): the same agreement through the engine's own int8 pages with keys per channel
  (KVPAGE_INT8_KEYS=channel: complete blocks rounded once, the filling block's keys read unrounded from the
  residual-key group), beside int8 rows, on the compiled kernels (--channel-backend reference: the torch
  oracle's pages), the text fed in chunks of --channel-chunks tokens (chunks shorter than a block make
  queries read filling blocks).

    python benchmarks/kv_quant.py                       # SmolLM2-135M (and Gemma 3 270M when installed)
    python benchmarks/kv_quant.py --positions 1000 --speed-seqs 64 --speed-context 8192 --rounds 5
    python benchmarks/kv_quant.py --skip capacity accuracy --speed-block-size 32   # decode over 32-token blocks
    python benchmarks/kv_quant.py --models gemma-3-270m --skip capacity speed --kv-dtypes int8 --split
    python benchmarks/kv_quant.py --models gemma-3-270m --skip capacity accuracy speed --channel --positions 3200
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kv_split import split
from kvpage.attention.kv_quant import is_quantized
from kvpage.model.loader import load_model
from kvpage.model.registry import packaged_model_path
from kvpage.worker.kv_cache import kv_bytes_per_block, kv_torch_dtype
from kvpage.worker.kv_calibration import calibrate_kv_transforms
from kvpage.worker.scoring import chunked_logits

ROOT = Path(__file__).resolve().parents[1]
CACHE_DTYPES = ("float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2")


def fixed_text() -> str:
    """README.md, docs/kv.md and kv/block_pool.py as they were at 6355c47 (2026-12-02), kept in a file: read from
    the working tree, the text (and the agreement, by a few tenths of a point) moved whenever those files did."""
    return (ROOT / "benchmarks" / "data" / "kv_quant_text.txt").read_text()


def accuracy(model: str, positions: int, dtypes: tuple[str, ...] = CACHE_DTYPES, windows: int = 1,
             untransformed: bool = False, without_feedback: bool = False) -> list[dict]:
    """Top-1 agreement, the mean KL divergence of the next-token distribution from the float32 cache's (a measure
    that near ties do not make noisy, as they make top-1) and the perplexity of each cache dtype over ``windows``
    consecutive windows of ``positions`` tokens of the text (each window scored from an empty cache). Quantized
    caches run with the engine's transforms (attention/kv_transform.py); ``untransformed`` adds each quantized
    dtype without them, ``without_feedback`` with them but without the keys' rounding feedback."""
    lm = load_model(model, dtype="float32")
    attends = [layer.self_attn.attend for layer in lm.model.layers]
    quantized = [d for d in dtypes if is_quantized(kv_torch_dtype(d))]
    for d in quantized:
        calibrate_kv_transforms(lm, kv_torch_dtype(d))
    saved = [dict(a.transforms) for a in attends]
    ids = lm.tokenizer.encode(fixed_text())
    # every window starts as a prompt does: with the BOS token where the tokenizer adds one (Gemma 3), since a
    # Gemma 3 sequence without it makes its first token an attention sink of its own and runs off the model's
    # range (one window of 800 so scored flipped 46 argmaxes between two runs whose attention outputs differed
    # by 1e-4); the windows' predictions are the same positions of the text either way
    bos = [ids[0]] if lm.tokenizer.add_bos_token and ids[:1] == [lm.tokenizer.bos_token_id] else []
    spans = [ids[: positions + 1]] + [bos + ids[w * positions + len(bos) : (w + 1) * positions + 1]
                                      for w in range(1, windows)]
    if len(spans[-1]) < positions + 1:
        raise SystemExit(f"the text has {len(ids)} tokens: fewer than {windows} windows of {positions}")
    refs = [chunked_logits(lm, span, torch.float32) for span in spans]
    cases = [("float32", "")]
    for d in dtypes:
        if d != "float32":
            cases.append((d, ""))
            if untransformed and d in quantized:
                cases.append((d, "untransformed"))
            if without_feedback and d in quantized:
                cases.append((d, "no key feedback"))
    rows = []
    for name, variant in cases:
        for a, t in zip(attends, saved, strict=True):
            a.transforms = {} if variant == "untransformed" else dict(t)
            if variant == "no key feedback":
                a.transforms = {k: None if v is None else v.parts(v.keys is not None, v.values is not None)
                                for k, v in t.items()}
        agree, nll, kl, n = 0, 0.0, 0.0, 0
        per_window = []
        for span, ref in zip(spans, refs, strict=True):
            logits = ref if name == "float32" else chunked_logits(lm, span, kv_torch_dtype(name))
            same = int((logits[:-1].argmax(-1) == ref[:-1].argmax(-1)).sum())
            per_window.append(same / (len(span) - 1))
            agree += same
            n += len(span) - 1
            nll += float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(span[1:]), reduction="sum"))
            lp, lq = ref[:-1].log_softmax(-1), logits[:-1].log_softmax(-1)
            kl += float((lp.exp() * (lp - lq)).sum())
        label = f"{name} ({variant})" if variant else name
        rows.append({"model": lm.config.name, "kv_dtype": label, "positions": n, "top1_agreement": agree / n,
                     "kl": kl / n, "per_window": per_window, "perplexity": float(torch.exp(torch.tensor(nll / n)))})
    for a, t in zip(attends, saved, strict=True):
        a.transforms = t
    return rows


def channel(model: str, positions: int, chunks: tuple[int, ...], block_size: int = 32,
            backend: str = "auto") -> list[dict]:
    """Top-1 agreement with the float32 cache of int8 pages with keys per channel and of int8 rows, both through
    the engine's pages (each with the transforms calibrated for it), per chunk size."""
    lm = load_model(model, dtype="float32", attention_backend=backend)
    ids = lm.tokenizer.encode(fixed_text())[: positions + 1]
    ref = chunked_logits(lm, ids, torch.float32, block_size=block_size)[:-1].argmax(-1)
    rows = []
    for keys in ("rows", "channel"):
        calibrate_kv_transforms(lm, torch.int8, channel_keys=keys == "channel")
        for chunk in chunks:
            top = chunked_logits(lm, ids, torch.int8, chunk=chunk, block_size=block_size,
                                 channel_keys=keys == "channel")[:-1].argmax(-1)
            rows.append({"model": lm.config.name, "int8 keys": keys, "chunk": chunk, "block_size": block_size,
                         "backend": lm.model.layers[0].self_attn.backend.name,
                         "positions": len(top), "top1_agreement": float((top == ref).float().mean())})
    return rows


def write_speed(rounds: int) -> list[dict]:
    """The quantizing write (reshape_and_cache) of one layer's new keys and values, plain rounding against the
    keys rounded with feedback (keys_feedback's matrices from random queries: the work does not depend on them),
    SmolLM2's shape (3 KV heads of 64) and Gemma 3's (1 of 256), at 1 token (one sequence's decode step), 128
    (a batch's) and 2048 (a prompt step's); median of rounds, each case alternating."""
    from kvpage.attention.kv_quant import keys_feedback
    from kvpage.ops import load_kernels

    ops = load_kernels()
    rows = []
    for kv_heads, dim, heads in ((3, 64, 9), (1, 256, 4)):
        fb = keys_feedback(torch.randn(400, heads, dim), kv_heads)
        for n in (1, 128, 2048):
            for dtype in (torch.int8, torch.float8_e4m3fn):
                k, v = torch.randn(n, kv_heads, dim).bfloat16(), torch.randn(n, kv_heads, dim).bfloat16()
                cache = torch.zeros(2, n // 16 + 2, 16, kv_heads, dim + 2, dtype=dtype)
                slots = torch.arange(n)
                times: dict[str, list[float]] = {"plain": [], "feedback": []}
                for _ in range(max(rounds, 5)):
                    for name, f in (("plain", None), ("feedback", fb)):
                        t0 = time.perf_counter()
                        ops.reshape_and_cache(k, v, cache, slots, False, f)
                        times[name].append(time.perf_counter() - t0)
                plain, fed = (statistics.median(times[x]) * 1e6 for x in ("plain", "feedback"))
                rows.append({"kv_heads": kv_heads, "head_dim": dim, "tokens": n, "kv_dtype": str(dtype).split(".")[1],
                             "plain_us": plain, "feedback_us": fed})
    return rows


def capacity(model: str) -> list[dict]:
    lm = load_model(model, dtype="float32")
    out = []
    bf16 = kv_bytes_per_block(lm.config, 16, torch.bfloat16)
    for name in CACHE_DTYPES:
        b = kv_bytes_per_block(lm.config, 16, kv_torch_dtype(name))
        out.append({"model": lm.config.name, "kv_dtype": name, "bytes_per_block": b,
                    "tokens_per_gib": 2**30 // b * 16, "vs_bfloat16": bf16 / b})
    return out


def channel_pages(ops, seqs: int, context: int, tables: torch.Tensor, kv_heads: int, dim: int, bs: int,
                  gen: torch.Generator, huge_pages: bool) -> torch.Tensor:
    """int8 pages with keys per channel holding every sequence's context, written by the engine's own write
    (each sequence as one prompt, its residual keys in scratch blocks past the pool's end)."""
    from kvpage.attention.kv_channel import page_bytes
    from kvpage.pages import advise_huge_pages

    per = tables.shape[1]
    nb = int(tables.max()) + 1
    pages = torch.empty(nb + per, page_bytes(bs, kv_heads, dim), dtype=torch.uint8)
    if huge_pages:
        advise_huge_pages([pages])
    pos = torch.arange(context)
    scratch = (nb + pos // bs) * bs + pos % bs
    for s in range(tables.shape[0]):
        k = torch.randn(context, kv_heads, dim, generator=gen)
        v = torch.randn(context, kv_heads, dim, generator=gen)
        ops.reshape_and_cache_channel(k, v, pages, tables[s, pos // bs] * bs + pos % bs, scratch, bs)
    return pages


def speed(seqs: int, context: int, rounds: int, heads: int = 9, kv_heads: int = 3, dim: int = 64,
          huge_pages: bool = True, fold: int = 0, bs: int = 16, layout: str = "auto") -> list[dict]:
    """One layer's decode attention: `seqs` sequences of `context` keys on scattered `bs`-token blocks, in
    caches allocated as the engine allocates its pool (2 MiB pages where the OS allows, unless huge_pages=False),
    under the KV layout setting `layout` (KVPAGE_KV_LAYOUT's values)."""
    from kvpage.attention.kv_quant import quantize_rows
    from kvpage.envs import KernelConfig
    from kvpage.ops import kernels, pack_kv_rows
    from kvpage.worker.kv_cache import as_block_major

    ops = kernels(KernelConfig(kv_layout=layout))
    per = -(-context // bs)
    nb = seqs * per
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(nb, generator=gen).reshape(seqs, per)
    if fold:  # every block id into the first `fold` blocks: the same work on K/V that stays in cache
        tables = tables % fold
    qsl = torch.arange(seqs + 1)
    lens = torch.full((seqs,), context)
    plan = ops.plan_attention(tables, qsl, lens, heads, nb, bs)
    q = torch.randn(seqs, heads, dim, generator=gen).to(torch.bfloat16)
    caches = {}
    # each dtype in the row layout and, where the engine stores it so (KVPAGE_KV_LAYOUT auto or packed on
    # AVX512_BF16 builds; int8 and fp8 with VNNI too), the packed one: the ratios are taken against the bf16
    # cache the engine runs here ("bfloat16" is that one, "int8" the int8 one, and so on)
    packed_names = {"bfloat16"} if ops.packed_layout else set()
    if ops.packed_int8_layout:
        packed_names.add("int8")
    if ops.packed_fp8_layout:
        packed_names |= {"fp8_e4m3", "fp8_e5m2"}
    names = [v for n in ("bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2")
             for v in ((f"{n}-rows", n) if n in packed_names else (n,))]
    for name in names:
        dt = kv_torch_dtype(name.removesuffix("-rows"))
        base = torch.randn(2, nb, bs, kv_heads, dim, generator=gen)
        rows = quantize_rows(base, dt) if name.startswith(("int", "fp8")) else base.to(dt)
        if name in packed_names:
            rows = pack_kv_rows(rows)
        caches[name] = as_block_major(rows, huge_pages)  # as the engine's prefaulted pool is stored
        del base, rows
    caches["int8-channel"] = channel_pages(ops, seqs, context, tables, kv_heads, dim, bs, gen, huge_pages)
    # where decode over packed int8 pages runs on AMX byte tiles, the same pages through the VNNI loop beside it
    vnni_ops = None
    if "int8" in packed_names and ops.amx_int8_decode_available():
        vnni_ops = kernels(KernelConfig(amx_decode=False, kv_layout=layout))
        caches["int8-vnni"] = caches["int8"]
    residual = torch.zeros_like(tables)  # contexts of whole blocks: no sequence reads a residual block
    channel_plan = ops.plan_attention(tables, qsl, lens, heads, caches["int8-channel"].shape[0], bs)

    def run(name: str, cache: torch.Tensor) -> None:
        if name == "int8-channel":
            ops.paged_attention_channel(q, cache, channel_plan, residual, dim**-0.5)
        elif name == "int8-vnni":
            vnni_ops.paged_attention(q, cache, plan, dim**-0.5, True)
        else:
            ops.paged_attention(q, cache, plan, dim**-0.5, name in packed_names)

    times: dict[str, list[float]] = {n: [] for n in caches}
    kernel: dict[str, str] = {}
    for _ in range(rounds):
        for name, cache in caches.items():
            run(name, cache)  # warm
            kernel[name] = (vnni_ops if name == "int8-vnni" else ops).last_decode_kernel()
            t0 = time.perf_counter()
            for _ in range(3):
                run(name, cache)
            times[name].append((time.perf_counter() - t0) / 3)
    base = statistics.median(times["bfloat16"])
    return [{"kv_dtype": n, "seqs": seqs, "context": context, "ms": statistics.median(t) * 1e3,
             "vs_bfloat16": statistics.median(t) / base, "kernel": kernel[n]} for n, t in times.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=None, help="default: SmolLM2-135M-Instruct (+ gemma-3-270m)")
    ap.add_argument("--positions", type=int, default=800)
    ap.add_argument("--windows", type=int, default=1, help="accuracy: consecutive windows of --positions tokens")
    ap.add_argument("--untransformed", action="store_true",
                    help="accuracy: also each quantized dtype without its key/value transforms")
    ap.add_argument("--without-feedback", action="store_true",
                    help="accuracy: also each quantized dtype with its transforms but not the keys' rounding feedback")
    ap.add_argument("--speed-seqs", type=int, default=64)
    ap.add_argument("--speed-context", type=int, default=8192)
    ap.add_argument("--speed-block-size", type=int, default=16, help="speed: tokens per KV block")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip", nargs="*", default=(), choices=("capacity", "accuracy", "speed", "write"))
    ap.add_argument("--kv-dtypes", nargs="*", default=list(CACHE_DTYPES), choices=CACHE_DTYPES,
                    help="the cache dtypes of the accuracy part (float32 always runs: the reference)")
    ap.add_argument("--split", action="store_true", help="also run the int8 error split (module doc)")
    ap.add_argument("--split-cases", default="", help="split: only the cases whose name contains this")
    ap.add_argument("--channel", action="store_true", help="also the engine's int8 pages with keys per channel")
    ap.add_argument("--channel-chunks", nargs="*", type=int, default=[32, 8], help="channel: chunk sizes")
    ap.add_argument("--channel-backend", default="auto", choices=("auto", "cpu", "reference"),
                    help="channel: the attention backend")
    ap.add_argument("--small-pages", action="store_true",
                    help="speed: caches on 4 KiB pages (the engine's --no-kv-huge-pages) instead of 2 MiB pages")
    ap.add_argument("--fold-blocks", type=int, default=0,
                    help="speed: read only the first N blocks (the same work on K/V that stays in cache)")
    ap.add_argument("--kv-layout", default="auto", choices=("auto", "packed", "rows"),
                    help="speed: the KV layout setting (KVPAGE_KV_LAYOUT) the caches take")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    models = a.models or ["SmolLM2-135M-Instruct"] + (["gemma-3-270m"] if packaged_model_path("gemma-3-270m") else [])
    torch.set_num_threads(a.threads or torch.get_num_threads())
    result: dict[str, list] = {}
    if "capacity" not in a.skip:
        result["capacity"] = [r for m in models for r in capacity(m)]
        for r in result["capacity"]:
            print(f"capacity {r['model']:<24} {r['kv_dtype']:<9} {r['bytes_per_block']:>7} B/block "
                  f"{r['tokens_per_gib']:>9} tokens/GiB  {r['vs_bfloat16']:.3f}x bf16")
    if "accuracy" not in a.skip:
        result["accuracy"] = [r for m in models for r in accuracy(m, a.positions, tuple(a.kv_dtypes), a.windows,
                                                                       a.untransformed, a.without_feedback)]
        for r in result["accuracy"]:
            windows = " ".join(f"{w:.2%}" for w in r["per_window"]) if len(r["per_window"]) > 1 else ""
            print(f"accuracy {r['model']:<24} {r['kv_dtype']:<28} top-1 vs float32 cache {r['top1_agreement']:.2%} "
                  f"over {r['positions']} positions, KL {r['kl']:.2e}, perplexity {r['perplexity']:.3f} {windows}",
                  flush=True)
    if a.split:
        result["split"] = [r for m in models for r in split(m, a.positions, fixed_text(), a.split_cases)]
        for r in result["split"]:
            print(f"split    {r['model']:<24} int8 rounding on {r['int8 rounding on']:<54} top-1 "
                  f"{r['top1_agreement']:.2%} over {r['positions']} positions")
    if a.channel:
        result["channel"] = [r for m in models for r in channel(m, a.positions, tuple(a.channel_chunks),
                                                                 backend=a.channel_backend)]
        for r in result["channel"]:
            print(f"channel  {r['model']:<24} int8 {r['int8 keys']:<8} chunks of {r['chunk']:>3}, "
                  f"{r['block_size']}-token blocks ({r['backend']}): top-1 {r['top1_agreement']:.2%} over "
                  f"{r['positions']} positions")
    if "speed" not in a.skip:
        result["speed"] = speed(a.speed_seqs, a.speed_context, a.rounds, huge_pages=not a.small_pages,
                                fold=a.fold_blocks, bs=a.speed_block_size, layout=a.kv_layout)
        for r in result["speed"]:
            print(f"speed    {r['kv_dtype']:<9} {r['seqs']} seqs x {r['context']} keys, {a.speed_block_size}-token "
                  f"blocks: {r['ms']:.2f} ms "
                  f"({r['vs_bfloat16']:.2f}x bf16) [{r['kernel']}]")
    if "write" not in a.skip:
        result["write"] = write_speed(a.rounds)
        for r in result["write"]:
            print(f"write    {r['kv_heads']} KV heads of {r['head_dim']:<3} {r['tokens']:>5} tokens {r['kv_dtype']:<14}"
                  f" plain {r['plain_us']:8.1f} us, keys with feedback {r['feedback_us']:8.1f} us "
                  f"({r['feedback_us'] / r['plain_us']:.1f}x)")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
