"""Projections of a few-token step: the GGUF-block kernel (quant_linear) vs the packed bf16 GEMM (oneDNN).

Uses the default model's real weights (Q4_1 layers, Q8_0 output matrix): for each token count M, the 120
layer projections of one forward pass (every layer's q|k|v, o, gate|up and down, so the weights stream from
memory as in a real step) plus the output (lm head) projection, timed with each path, side by side in one
process (two loads of the model: KernelConfig.quant_max_tokens above every M, and 0). The crossover sets
the default of KernelConfig.quant_max_tokens (KVPAGE_QUANT_MAX_TOKENS).

    python benchmarks/quant_linear.py [--tokens 1 2 3 4 6 8 16] [--rounds 7]

With --float32 (AVX2 builds, where float32 models run the float32 panel GEMM): the blocks as panels (the
default: the panel GEMM's sums, model/quant.py) against rows of blocks with 16-bit activation codes and with
float32 ones (KVPAGE_QUANT_PANELS=0, with and without KVPAGE_QUANT_INT16), and the panel GEMM itself.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from _common import alternating_medians
from kvpage.envs import KernelConfig
from kvpage.model.loader import load_model


def projections(model):
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        yield from (attn.qkv, attn.o_packed, mlp.gate_up, mlp.down)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--float32", action="store_true", help="the float32 path's forms (AVX2 builds)")
    args = ap.parse_args()
    if args.float32:
        float32_forms(args)
        return
    lm = load_model(dtype="bfloat16", kernel_config=KernelConfig(quant_max_tokens=max(args.tokens)))
    model = lm.model
    dense = load_model(dtype="bfloat16", kernel_config=KernelConfig(quant_max_tokens=0)).model
    if model.fast is None or model.fast.lm_quant is None:
        raise SystemExit("needs the compiled kernels, AVX512_BF16 and a GGUF model with Q4/Q8 blocks")
    layers = list(projections(model))
    weight_bytes = sum(p.quant.nbytes for p in layers) + model.fast.lm_quant.nbytes
    dense_bytes = sum(2 * p.quant.shape[0] * p.quant.shape[1] for p in layers) + 2 * model.fast.lm_quant.shape[0] * \
        model.fast.lm_quant.shape[1]
    hidden = lm.config.hidden_size
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; SmolLM2-135M-Instruct")
    print(f"bytes read per pass: quantized {weight_bytes / 1e6:.1f} MB, bf16 {dense_bytes / 1e6:.1f} MB")
    print("| tokens | quantized (ms) | bf16 GEMM (ms) | bf16 / quantized |")
    print("|---:|---:|---:|---:|")
    dense_layers = list(projections(dense))
    for m in args.tokens:
        g = torch.Generator().manual_seed(m)
        inputs = {}
        for p in layers:
            k = p.quant.shape[1]
            if k not in inputs:
                inputs[k] = torch.randn(m, k, generator=g).bfloat16()
        h = torch.randn(m, hidden, generator=g)

        def one_pass(net, linears, inputs=inputs, h=h) -> float:
            t = time.perf_counter()
            with torch.inference_mode():
                for p in linears:
                    p(inputs[p.quant.shape[1]])
                net.fast.compute_logits_ex(h)
            return time.perf_counter() - t

        q, d = (x * 1e3 for x in alternating_medians(lambda: one_pass(model, layers),
                                                     lambda: one_pass(dense, dense_layers), args.rounds))
        print(f"| {m} | {q:.2f} | {d:.2f} | {d / q:.2f}x |")


def float32_forms(args) -> None:
    forms = {"panels": KernelConfig(quant_max_tokens=max(args.tokens)),
             "rows, int16": KernelConfig(quant_max_tokens=max(args.tokens), quant_panels=False),
             "rows, float32": KernelConfig(quant_max_tokens=max(args.tokens), quant_panels=False, quant_int16=False),
             "panel GEMM": KernelConfig(quant_max_tokens=0)}
    models = {name: load_model(dtype="float32", fast=True, kernel_config=cfg).model for name, cfg in forms.items()}
    if not all(m.fast is not None and m.fast.ops.f32_gemm_ok for m in models.values()):
        raise SystemExit("needs the compiled kernels with the float32 panel GEMM (an AVX2 build)")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; SmolLM2-135M-Instruct, float32; ms per pass of the 120 layer "
          f"projections and the lm head (medians of {args.rounds}, the forms alternating)")
    print("| tokens | " + " | ".join(forms) + " | panels, time against rows, int16 |")
    print("|---:|" + "---:|" * (len(forms) + 1))
    for m in args.tokens:
        g = torch.Generator().manual_seed(m)
        inputs = {k: torch.randn(m, k, generator=g) for k in {p.quant.shape[1] for p in projections(models["panels"])}}
        h = torch.randn(m, models["panels"].norm.weight.shape[0], generator=g)

        def one_pass(net, inputs=inputs, h=h) -> float:
            t = time.perf_counter()
            with torch.inference_mode():
                for p in projections(net):
                    p(inputs[p.quant.shape[1]])
                net.fast.compute_logits_ex(h)
            return time.perf_counter() - t

        times: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(args.rounds):
            for name, net in models.items():
                times[name].append(one_pass(net) * 1e3)
        med = {name: statistics.median(v) for name, v in times.items()}
        print(f"| {m} | " + " | ".join(f"{v:.2f}" for v in med.values()) +
              f" | {med['panels'] / med['rows, int16']:.2f}x |")


if __name__ == "__main__":
    main()
