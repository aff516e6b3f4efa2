"""Projections of a step: kvpage's AMX tile GEMM (amx_linear) vs oneDNN's pre-packed bf16 GEMM, or with
--dtype float32 kvpage's float32 panel GEMM (f32_linear, AVX2 builds) vs oneDNN's pre-packed float32 GEMM, or
with --i8 kvpage's int8 GEMM on the GGUF's quantized blocks (i8_linear, AVX-512 VNNI builds; what bf16 models
run on CPUs without AMX) vs oneDNN's pre-packed bf16 GEMM, or with --bf16 kvpage's bf16 panel GEMM (bf16_linear,
AVX512_BF16 builds; what bf16 layer projections run above the int8 GEMM's rows on CPUs without AMX) vs oneDNN's.

Uses the default model's real bf16 weights: for each row count M, the 120 layer projections of one forward
pass (every layer's q|k|v, o, gate|up with its SiLU gating and down, so the ~210 MB of weights stream from
memory as in a real step), then separately the output projection (lm head, 57 MB), timed with each path side
by side in one process, alternating rounds, medians reported. gate|up runs as the engine runs it: the AMX
kernel's (or the bf16 panel GEMM's) gated epilogue against oneDNN followed by silu_mul. PackedLinear uses the
kernel for every layer projection and for the lm head up to kvpage.model.fast_path.AMX_LOGITS_MAX_ROWS rows.

    python benchmarks/linear.py [--rows 8 16 64 128 512 2048] [--rounds 7] [--dtype float32 | --i8 | --bf16]

With float32, gate|up runs as the engine runs it there: either product followed by silu_mul.

--hot instead times the tile GEMM's 120-projection pass with the weights streaming from memory (cold) against
layer 0's four projections each repeated 30 times (the same FLOPs, weights in cache: hot), so the difference
is what the weights' read adds on top of the products.

    python benchmarks/linear.py --hot [--rows 32 64 96 128 256]

--pages instead times the tile GEMM's pass (layers, then the lm head) with the packed weights on the allocator's
4 KiB pages against the same weights gathered into one arena on 2 MiB pages (what the fast path does: kvpage/pages.py,
KVPAGE_WEIGHT_HUGE_PAGES), each pass after a 600 MB read that evicts them from cache, as a step's KV reads do.

    python benchmarks/linear.py --pages [--rows 16 64 128 256]

--stream instead times the lm head as the fast path runs it on the tile GEMM (by slices of 32,768 vocabulary
rows, from the 2 MiB arena, after a 600 MB read) with its logits written by plain stores against streamed ones
(non-temporal: PackedLinear's stream_out, what the fast path's head does), the same bits either way; with --i8
the same for the int8 GEMM's head (whole, as the fast path runs it there).

    python benchmarks/linear.py --stream [--i8] [--rows 64 128 192 256 512 1024]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from _common import alternating_medians
from kvpage.model.loader import load_model
from kvpage.ops import ACT_NONE, ACT_SILU, load_kernels
from kvpage.pages import gather_on_huge_pages, thp_mode


def dense_weights(model) -> list[torch.Tensor]:
    out = []
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        out.append(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        out.append(a.o_proj.weight)
        out.append(torch.cat([m.gate_proj.weight, m.up_proj.weight]))
        out.append(m.down_proj.weight)
    out.append(model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight)
    return [w.detach().contiguous() for w in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128, 192, 256, 384, 512, 1024, 2048])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--hot", action="store_true", help="cold vs hot weights for the tile GEMM (see above)")
    ap.add_argument("--pages", action="store_true", help="4 KiB pages vs the 2 MiB-page arena (see above)")
    ap.add_argument("--stream", action="store_true", help="the lm head's plain vs streamed stores (see above)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--i8", action="store_true", help="the int8 GEMM on the quantized blocks against oneDNN bf16")
    ap.add_argument("--bf16", action="store_true", help="kvpage's bf16 panel GEMM against oneDNN bf16")
    args = ap.parse_args()
    ops = load_kernels()
    f32 = args.dtype == "float32"
    amx_only = args.hot or args.pages
    if f32 and (ops is None or not ops.f32_gemm_available() or amx_only or args.stream):
        raise SystemExit("--dtype float32 needs the compiled kernels built for AVX2 without AVX-512 (and none of "
                         "--hot, --pages, --stream)")
    if args.i8 and (f32 or amx_only or ops is None or not ops.i8_gemm_available()):
        raise SystemExit("--i8 needs the compiled kernels built for AVX-512 VNNI (bf16, neither --hot nor --pages)")
    if args.bf16 and (f32 or args.i8 or amx_only or args.stream or ops is None or not ops.bf16_gemm_available()):
        raise SystemExit("--bf16 needs the compiled kernels built for AVX512_BF16 (and none of --dtype float32, "
                         "--i8, --hot, --pages, --stream)")
    if not f32 and not args.i8 and not args.bf16 and (ops is None or not ops.amx_linear_available()):
        raise SystemExit("needs the compiled kernels and AMX tile products (CPU with AMX-BF16, Linux >= 5.16)")
    dtype = torch.float32 if f32 else torch.bfloat16
    lm = load_model(dtype=args.dtype, attention_backend="reference")  # plain layers: the dense weights
    weights = dense_weights(lm.model)
    layers, head = weights[:-1], weights[-1:]
    gated = [i % 4 == 2 for i in range(len(layers))]  # q|k|v, o, gate|up, down per layer
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; SmolLM2-135M-Instruct {args.dtype}, "
          f"{sum(w.numel() * w.element_size() for w in layers) / 1e6:.0f} MB of layer weights + "
          f"{head[0].numel() * head[0].element_size() / 1e6:.0f} MB lm head per pass")
    if args.hot:
        cold_vs_hot(ops, layers, gated, args.rows, args.rounds)
        return
    if args.pages:
        small_vs_huge_pages(ops, weights, [*gated, False], args.rows, args.rounds)
        return
    if args.stream:
        plain_vs_streamed_head(ops, head[0], args.rows, args.rounds, i8_weights(True)[-1] if args.i8 else None)
        return
    i8_packs = i8_weights(args.i8)
    name = "kvpage f32" if f32 else "i8" if args.i8 else "bf16" if args.bf16 else "amx"
    print(f"| rows | layers oneDNN (ms) | layers {name} (ms) | oneDNN / {name} | {name} TFLOP/s | "
          f"lm head oneDNN (ms) | lm head {name} (ms) | oneDNN / {name} |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in args.rows:
        g = torch.Generator().manual_seed(m)
        inputs = {k: torch.randn(m, k, generator=g).to(dtype) for k in {w.shape[1] for w in weights}}
        cells = []
        for group, flags in ((layers, gated), (head, [False])):
            onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in group]
            if f32:
                mine = [(ops.f32_pack_weight(w), w.shape[0]) for w in group]
            elif args.i8:
                mine = i8_packs[: len(group)] if group is layers else i8_packs[-1:]
            elif args.bf16:  # gate|up packed for the gated epilogue, as the fast path packs it
                mine = [(ops.bf16_pack_weight(w, f), w.shape[0]) for w, f in zip(group, flags, strict=True)]
            else:
                mine = [ops.amx_pack_gate_up(w) if f else ops.amx_pack_weight(w)
                        for w, f in zip(group, flags, strict=True)]

            def pass_onednn(group=group, flags=flags, onednn=onednn, inputs=inputs) -> float:
                t = time.perf_counter()
                for w, f, p in zip(group, flags, onednn, strict=True):
                    y = torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")
                    if f:
                        ops.silu_mul(y)
                return time.perf_counter() - t

            def pass_kvpage(group=group, flags=flags, mine=mine, inputs=inputs) -> float:
                t = time.perf_counter()
                for w, f, p in zip(group, flags, mine, strict=True):
                    if f32:
                        y = ops.f32_linear(inputs[w.shape[1]], *p, None)
                        if f:
                            ops.silu_mul(y)
                    elif args.bf16:  # gate|up with SiLU in the epilogue
                        ops.bf16_linear(inputs[w.shape[1]], *p, None, ACT_SILU if f else ACT_NONE)
                    elif args.i8:  # the head's logits streamed, as the fast path writes them
                        ops.i8_linear(inputs[w.shape[1]], *p, None, group is head)
                    else:  # the head's logits streamed, as the fast path writes them
                        ops.amx_linear(inputs[w.shape[1]], p, None, ACT_SILU if f else ACT_NONE, group is head)
                return time.perf_counter() - t

            a, b = alternating_medians(pass_onednn, pass_kvpage, args.rounds)
            cells.append((a, b, sum(2 * w.numel() for w in group) * m / b / 1e12))
        (la, lb, ltf), (ha, hb, _) = cells
        print(f"| {m} | {la * 1e3:.2f} | {lb * 1e3:.2f} | {la / lb:.2f}x | {ltf:.2f} | {ha * 1e3:.2f} | "
              f"{hb * 1e3:.2f} | {ha / hb:.2f}x |", flush=True)


def i8_weights(on: bool) -> list[tuple]:
    """(codes, scales, N, gated) of every layer projection and the lm head, as the bf16 fast path packs them for
    the int8 GEMM, in dense_weights' order."""
    if not on:
        return []
    from kvpage.envs import KernelConfig

    lm = load_model(dtype="bfloat16", fast=True, kernel_config=KernelConfig(i8_gemm="1", amx_linear=False))
    out = []
    for layer in lm.model.layers:
        a, m = layer.self_attn, layer.mlp
        out += [(*p.i8, p.n, p.gated) for p in (a.qkv, a.o_packed, m.gate_up, m.down)]
    head = lm.model.fast.lm_packed
    return [*out, (*head.i8, head.n, False)]


def cold_vs_hot(ops, layers, gated, rows: list[int], rounds: int) -> None:
    packed = [ops.amx_pack_gate_up(w) if f else ops.amx_pack_weight(w) for w, f in zip(layers, gated, strict=True)]
    flops = sum(2 * w.numel() for w in layers)
    print("| rows | weights cold (ms) | TFLOP/s | weights hot (ms) | TFLOP/s | cold - hot (ms) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for m in rows:
        g = torch.Generator().manual_seed(m)
        inputs = {k: torch.randn(m, k, generator=g).bfloat16() for k in {w.shape[1] for w in layers}}

        def cold(m=m, inputs=inputs) -> float:
            t = time.perf_counter()
            for w, f, p in zip(layers, gated, packed, strict=True):
                ops.amx_linear(inputs[w.shape[1]], p, None, ACT_SILU if f else ACT_NONE)
            return time.perf_counter() - t

        def hot(m=m, inputs=inputs) -> float:
            t = time.perf_counter()
            for w, f, p in zip(layers[:4], gated[:4], packed[:4], strict=True):
                for _ in range(len(layers) // 4):
                    ops.amx_linear(inputs[w.shape[1]], p, None, ACT_SILU if f else ACT_NONE)
            return time.perf_counter() - t

        c, h = alternating_medians(cold, hot, rounds)
        print(f"| {m} | {c * 1e3:.2f} | {flops * m / c / 1e12:.2f} | {h * 1e3:.2f} | {flops * m / h / 1e12:.2f} | "
              f"{(c - h) * 1e3:.1f} |", flush=True)


def small_vs_huge_pages(ops, weights, gated, rows: list[int], rounds: int) -> None:
    small = [ops.amx_pack_gate_up(w) if f else ops.amx_pack_weight(w) for w, f in zip(weights, gated, strict=True)]
    huge, advised = gather_on_huge_pages(small)
    print(f"arena: {sum(p.numel() * p.element_size() for p in huge) / 1e6:.0f} MB, {advised / 1e6:.0f} MB advised "
          f"onto 2 MiB pages (transparent huge pages: {thp_mode() or 'unknown'})")
    flush = torch.ones(150 * 2**20, dtype=torch.float32)  # 600 MB
    print("| rows | layers 4 KiB (ms) | layers 2 MiB (ms) | 2 MiB / 4 KiB | lm head 4 KiB (ms) | lm head 2 MiB (ms) | "
          "2 MiB / 4 KiB |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for m in rows:
        g = torch.Generator().manual_seed(m)
        inputs = {k: torch.randn(m, k, generator=g).bfloat16() for k in {w.shape[1] for w in weights}}

        def one_pass(packs, part: slice, inputs=inputs) -> float:
            flush.sum()
            t = time.perf_counter()
            for w, f, p in zip(weights[part], gated[part], packs[part], strict=True):
                ops.amx_linear(inputs[w.shape[1]], p, None, ACT_SILU if f else ACT_NONE)
            return time.perf_counter() - t

        cells = []
        for part in (slice(0, -1), slice(-1, None)):
            cells += alternating_medians(lambda part=part: one_pass(small, part),
                                         lambda part=part: one_pass(huge, part), rounds)
        a, b, c, d = (x * 1e3 for x in cells)
        print(f"| {m} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {c:.2f} | {d:.2f} | {d / c:.2f}x |", flush=True)


def plain_vs_streamed_head(ops, weight: torch.Tensor, rows: list[int], rounds: int, i8: tuple | None) -> None:
    from kvpage.model.fast_path import LOGITS_SPLIT_ROWS

    if i8 is not None:  # (codes, scales, N, gated): the int8 GEMM's head, one product
        (codes, scales), advised = gather_on_huge_pages(list(i8[:2]))
        print(f"lm head on the int8 GEMM: one product, {advised / 1e6:.0f} MB on 2 MiB pages")

        def product(x: torch.Tensor, stream: bool) -> list[torch.Tensor]:
            return [ops.i8_linear(x, codes, scales, i8[2], False, None, stream)]
    else:
        slices, advised = gather_on_huge_pages([ops.amx_pack_weight(weight[i : i + LOGITS_SPLIT_ROWS].contiguous())
                                                for i in range(0, weight.shape[0], LOGITS_SPLIT_ROWS)])
        print(f"lm head on the tile GEMM: {len(slices)} slices of at most {LOGITS_SPLIT_ROWS} rows, "
              f"{advised / 1e6:.0f} MB on 2 MiB pages")

        def product(x: torch.Tensor, stream: bool) -> list[torch.Tensor]:
            return [ops.amx_linear(x, p, None, ACT_NONE, stream) for p in slices]
    flush = torch.ones(150 * 2**20, dtype=torch.float32)  # 600 MB
    print("| rows | plain stores (ms) | streamed (ms) | streamed / plain |")
    print("|---:|---:|---:|---:|")
    for m in rows:
        x = torch.randn(m, weight.shape[1], generator=torch.Generator().manual_seed(m)).bfloat16()
        outs = {}

        def one_pass(stream: bool, x=x, outs=outs) -> float:
            flush.sum()
            t = time.perf_counter()
            outs[stream] = product(x, stream)
            return time.perf_counter() - t

        a, b = alternating_medians(lambda: one_pass(False), lambda: one_pass(True), rounds)
        if not all(torch.equal(u, v) for u, v in zip(outs[False], outs[True], strict=True)):
            raise SystemExit(f"streamed logits differ from plain stores at {m} rows")
        print(f"| {m} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
