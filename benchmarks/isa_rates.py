"""How many multiply-adds per nanosecond one core does with each product instruction kvpage's kernels could use:
the ceiling that decides whether an integer kernel can beat a float one on this CPU.

    python benchmarks/isa_rates.py [--rounds 5]

A small C program, compiled here with gcc for this CPU (-march=native), runs twelve independent chains of one
instruction (enough to cover its latency) and reports, per instruction, nanoseconds and products per ns:
  fma       vfmadd ps, 256 bits: 8 float32 products
  madd      vpmaddwd, 256 bits: 16 int16 products into int32 pairs (kvpage's int8 KV loop on AVX2)
  maddubs   vpmaddubsw, 256 bits: 32 uint8 x int8 products into int16 pairs (one byte per operand)
and on AVX-512 builds the 512-bit fma, vpdpbusd (64 byte products, VNNI) and vdpbf16ps (32 bf16 products).
Every chain is an operand of the loop's empty asm barrier, so that gcc keeps all twelve in registers and the loop is
those twelve instructions and its counter (until 2026-12-07 only the invariant operand was: gcc then compiled the
integer loops with a register move or a stack reload per product, which halved vpmaddwd's rate on a Zen 3).
One thread; medians over --rounds runs (pin it, `taskset -c 1`, on a busy host). Where a byte kernel needs two
codes per value to keep its accuracy (kvpage's int8 GEMM does: a high and a low byte per activation), it gets half
the products per ns shown.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model, run_c

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define N 240000000L
#define R12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define OUT12(v) "+x"(v##0), "+x"(v##1), "+x"(v##2), "+x"(v##3), "+x"(v##4), "+x"(v##5), "+x"(v##6), \
                 "+x"(v##7), "+x"(v##8), "+x"(v##9), "+x"(v##10), "+x"(v##11)
#define TIME(name, products, DECL, STEP, V, SINK)                                           \
  {                                                                                         \
    R12(DECL)                                                                               \
    double t = now();                                                                       \
    for (long n = 0; n < N / 12; n++) { R12(STEP) __asm__ volatile("" : OUT12(V)); }      \
    t = now() - t;                                                                          \
    long sink = 0; R12(SINK)                                                                \
    printf("%s %d %.5f %ld\n", name, products, t / N * 1e9, sink & 1);                      \
  }
int main(void) {
  __m256 x = _mm256_set1_ps(1.0001f), y = _mm256_set1_ps(0.9999f);
  __m256i b = _mm256_set1_epi16(3), c = _mm256_set1_epi8(2);
#define DF(i) __m256 f##i = _mm256_set1_ps(i * 1e-3f);
#define SF(i) sink += (long)f##i[0];
#define FM(i) f##i = _mm256_fmadd_ps(f##i, x, y);
  TIME("fma", 8, DF, FM, f, SF)
#define DI(i) __m256i a##i = _mm256_set1_epi16(i);
#define SI(i) sink += _mm256_extract_epi32(a##i, 0);
#define MA(i) a##i = _mm256_madd_epi16(a##i, b);
  TIME("madd", 16, DI, MA, a, SI)
#define MU(i) a##i = _mm256_maddubs_epi16(a##i, c);
  TIME("maddubs", 32, DI, MU, a, SI)
#if defined(__AVX512F__)
  __m512 x5 = _mm512_set1_ps(1.0001f), y5 = _mm512_set1_ps(0.9999f);
  __m512i b5 = _mm512_set1_epi8(2);
#define DF5(i) __m512 g##i = _mm512_set1_ps(i * 1e-3f);
#define SF5(i) sink += (long)g##i[0];
#define FM5(i) g##i = _mm512_fmadd_ps(g##i, x5, y5);
  TIME("fma512", 16, DF5, FM5, g, SF5)
#endif
#if defined(__AVX512VNNI__)
#define DI5(i) __m512i e##i = _mm512_set1_epi32(i);
#define SI5(i) sink += _mm_cvtsi128_si32(_mm512_castsi512_si128(e##i));
#define DP(i) e##i = _mm512_dpbusd_epi32(e##i, b5, b5);
  TIME("dpbusd512", 64, DI5, DP, e, SI5)
#endif
#if defined(__AVX512BF16__)
  __m512bh one_bh = (__m512bh)_mm512_set1_epi16(0x3f80);
#define DB(i) __m512 p##i = _mm512_set1_ps(i * 1e-3f);
#define SB(i) sink += (long)p##i[0];
#define BF(i) p##i = _mm512_dpbf16_ps(p##i, one_bh, one_bh);
  TIME("dpbf16512", 32, DB, BF, p, SB)
#endif
  return 0;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    runs: dict[str, list[float]] = {}
    products: dict[str, int] = {}
    for out in run_c(SOURCE, "isa_rates", [], runs=args.rounds):
        for line in out.splitlines():
            name, prod, ns, _ = line.split()
            runs.setdefault(name, []).append(float(ns))
            products[name] = int(prod)
    print(f"machine: {cpu_model()}; one thread, medians of {args.rounds} runs")
    print("| instruction | products each | ns each | products per ns | vs 256-bit fma |")
    print("|---|---:|---:|---:|---:|")
    fma = products["fma"] / statistics.median(runs["fma"])
    for name, ns in runs.items():
        rate = products[name] / statistics.median(ns)
        print(f"| {name} | {products[name]} | {statistics.median(ns):.3f} | {rate:.1f} | {rate / fma:.2f}x |")


if __name__ == "__main__":
    main()
