"""How fast this machine reads KV blocks scattered over a pool, against reading memory in order: the floor under
paged decode attention's time, and so under the time int8 pages can save against bf16 ones.

    python benchmarks/block_reads.py [--rounds 7] [--threads 2] [--block-tokens 32 64]

A small C program, compiled here with gcc for this CPU (-march=native, OpenMP; 512-bit loads on AVX-512 builds,
256-bit ones on AVX2 builds), allocates a pool as the engine's
prefaulted one is (2 MiB pages where Linux grants them) and times, medians of --rounds passes with a 1 GiB
write between passes so that every pass starts from DRAM:
  sequential     one pass over 1 GiB in address order (the hardware prefetchers' best case);
  bf16-blocks / int8-blocks   64 sequences x 8,192 tokens of SmolLM2's KV (3 KV heads of 64) on 16-token
                 blocks in a random order, each block's K and V read whole in address order, each line read asking
                 for the same line two blocks on (a steady stream of prefetches): 12,288 bytes a block for bf16,
                 6,336 for int8 rows or packed int8 (bf16 scales included);
  int8-order     the same int8 pool read as kvpage's AMX int8 decode reads it (spans of eight 16-key groups, KV
                 head by KV head, K groups then V groups, each group's lines prefetched four groups ahead);
  int8-order+work   the same with a fixed run of vector arithmetic after each (span, KV head), its length set
                 (--work) so that with the pool in cache the pass takes about what the int8 tiles take there.
The last two say how much of the arithmetic's time the reads hide: if none, the kernel's time is the reads' plus
the arithmetic's (kvpage's int8 tiles hide about half of theirs: docs/kv.md).
  bf16-blocks-T / int8-blocks-T   the same whole-block reads on T-token blocks (--block-tokens): the same bytes in
                 fewer, longer runs, which DRAM delivers faster per byte.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model, run_c

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}
static uint8_t* pool_alloc(size_t bytes) {
  size_t huge = (size_t)2 << 20, n = (bytes + huge - 1) / huge * huge;
  uint8_t* p = aligned_alloc(huge, n);
  madvise(p, n, 14);  /* MADV_HUGEPAGE */
  memset(p, 1, n);
  return p;
}
/* 512-bit lanes where the build has AVX-512, else two 256-bit loads a line (AVX2) */
#if defined(__AVX512F__)
typedef __m512i vi;
typedef __m512 vf;
#define V_ZERO() _mm512_setzero_si512()
#define V_LINE(acc, p) _mm512_add_epi32((acc), _mm512_loadu_si512(p))
#define V_SUM(acc) _mm512_reduce_add_epi32(acc)
#define V_ADD _mm512_add_epi32
#define V_TOF _mm512_castsi512_ps
#define VF_TOI _mm512_castps_si512
#define VF_SET1 _mm512_set1_ps
#define VF_FMA _mm512_fmadd_ps
#define VF_ADD _mm512_add_ps
#else
typedef __m256i vi;
typedef __m256 vf;
#define V_ZERO() _mm256_setzero_si256()
#define V_LINE(acc, p)                                                            \
  _mm256_add_epi32(_mm256_add_epi32((acc), _mm256_loadu_si256((const __m256i*)(p))), \
                   _mm256_loadu_si256((const __m256i*)((p) + 32)))
static int V_SUM(__m256i a) {
  int32_t t[8], s = 0;
  _mm256_storeu_si256((__m256i*)t, a);
  for (int i = 0; i < 8; ++i) s += t[i];
  return s;
}
#define V_ADD _mm256_add_epi32
#define V_TOF _mm256_castsi256_ps
#define VF_TOI _mm256_castps_si256
#define VF_SET1 _mm256_set1_ps
#define VF_FMA _mm256_fmadd_ps
#define VF_ADD _mm256_add_ps
#endif

static vi read_run(const uint8_t* p, int64_t n, vi acc) {
  for (int64_t i = 0; i < n; i += 64) acc = V_LINE(acc, p + i);
  return acc;
}
static void prefetch_run(const uint8_t* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64) _mm_prefetch((const char*)p + i, _MM_HINT_T1);
}
static vi work(vi acc, int n) {
  vf x0 = V_TOF(acc), x1 = x0, x2 = x0, x3 = x0;
  const vf c = VF_SET1(0.999f);
  for (int i = 0; i < n; ++i) {
    x0 = VF_FMA(x0, c, c);
    x1 = VF_FMA(x1, c, c);
    x2 = VF_FMA(x2, c, c);
    x3 = VF_FMA(x3, c, c);
  }
  return V_ADD(acc, VF_TOI(VF_ADD(VF_ADD(x0, x1), VF_ADD(x2, x3))));
}

enum { SEQS = 64, HEADS = 3, GROUP = 16 * 66 };
static int64_t PER = 512; /* blocks per sequence: 8,192 tokens of 16-token blocks */

/* mode 0: whole blocks of `bb` bytes in table order; 1: the int8 tiles' order, `spin` work per (span, head) */
static double pass(const uint8_t* pool, const int64_t* tab, int64_t bb, int mode, int spin) {
  double t0 = now();
  long long sink = 0;
#pragma omp parallel reduction(+ : sink)
  {
    vi acc = V_ZERO();
#pragma omp for schedule(static)
    for (int64_t s = 0; s < SEQS; ++s) {
      const int64_t* t = tab + s * PER;
      if (mode == 0) {
        for (int64_t b = 0; b < PER; ++b) {  /* each line read asks for the same line two blocks on */
          const uint8_t *p = pool + t[b] * bb, *f = pool + t[b + 2 < PER ? b + 2 : b] * bb;
          for (int64_t i = 0; i < bb; i += 64) {
            _mm_prefetch((const char*)f + i, _MM_HINT_T1);
            acc = V_LINE(acc, p + i);
          }
        }
        continue;
      }
      for (int64_t b0 = 0; b0 < PER; b0 += 8)
        for (int64_t h = 0; h < HEADS; ++h) {
          for (int64_t u = 0; u < 8; ++u) {
            if (b0 + u + 4 < PER) {
              const uint8_t* q = pool + t[b0 + u + 4] * bb + h * GROUP;
              prefetch_run(q, GROUP);
              prefetch_run(q + HEADS * GROUP, GROUP);
            }
            acc = read_run(pool + t[b0 + u] * bb + h * GROUP, GROUP, acc);
          }
          for (int64_t u = 0; u < 8; ++u) acc = read_run(pool + t[b0 + u] * bb + (HEADS + h) * GROUP, GROUP, acc);
          if (spin) acc = work(acc, spin);
        }
    }
    sink += V_SUM(acc);
  }
  if (sink == 42) puts("");
  return now() - t0;
}

/* block ids 0..n-1 in a random order: blocks placed as a long-running pool scatters them */
static void random_table(int64_t* tab, int64_t n) {
  for (int64_t i = 0; i < n; ++i) tab[i] = i;
  for (int64_t i = n - 1; i > 0; --i) {
    int64_t j = rand() % (i + 1), x = tab[i];
    tab[i] = tab[j];
    tab[j] = x;
  }
}

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  int rounds = atoi(argv[1]), spin = atoi(argv[2]);
  size_t evict_bytes = (size_t)1 << 30;
  uint8_t* evict = pool_alloc(evict_bytes);
  double ts[64];
  /* sequential */
  for (int r = 0; r < rounds; ++r) {
    memset(evict, r, evict_bytes);
    double t0 = now();
    long long sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
      vi acc = V_ZERO();
#pragma omp for schedule(static)
      for (int64_t i = 0; i < (int64_t)(evict_bytes / 65536); ++i) acc = read_run(evict + i * 65536, 65536, acc);
      sink += V_SUM(acc);
    }
    if (sink == 42) puts("");
    ts[r] = now() - t0;
  }
  qsort(ts, rounds, sizeof(double), cmp);
  printf("sequential %zu %.6f\n", evict_bytes, ts[rounds / 2]);
  int64_t nb = (int64_t)SEQS * PER, sizes[2] = {16 * HEADS * 64 * 2 * 2, 2 * HEADS * GROUP};
  int64_t* tab = malloc(nb * sizeof(int64_t));
  srand(0);
  random_table(tab, nb);
  for (int k = 0; k < 2; ++k) {
    int64_t bb = sizes[k];
    uint8_t* pool = pool_alloc(nb * bb);
    int cases = k == 0 ? 1 : 3;
    for (int c = 0; c < cases; ++c) {
      for (int r = 0; r < rounds; ++r) {
        memset(evict, r, evict_bytes);
        ts[r] = pass(pool, tab, bb, c == 0 ? 0 : 1, c == 2 ? spin : 0);
      }
      qsort(ts, rounds, sizeof(double), cmp);
      const char* name = c == 0 ? (k == 0 ? "bf16-blocks" : "int8-blocks") : c == 1 ? "int8-order" : "int8-order+work";
      printf("%s %lld %.6f\n", name, (long long)(nb * bb), ts[rounds / 2]);
    }
    /* the same passes with every block id folded into the first 48 (in cache): what the work alone adds */
    if (k == 1) {
      int64_t* folded = malloc(nb * sizeof(int64_t));
      for (int64_t i = 0; i < nb; ++i) folded[i] = tab[i] % 48;
      for (int c = 1; c < 3; ++c) {
        for (int r = 0; r < rounds; ++r) ts[r] = pass(pool, folded, bb, 1, c == 2 ? spin : 0);
        qsort(ts, rounds, sizeof(double), cmp);
        printf("%s-in-cache %lld %.6f\n", c == 1 ? "int8-order" : "int8-order+work", (long long)(nb * bb),
               ts[rounds / 2]);
      }
      free(folded);
    }
    free(pool);
  }
  /* larger blocks (argv[3...]: tokens per block), whole blocks in a random order: bf16 then int8 */
  for (int a = 3; a < argc; ++a) {
    int64_t tokens = atoi(argv[a]);
    PER = 8192 / tokens;
    int64_t nbt = (int64_t)SEQS * PER;
    random_table(tab, nbt);
    for (int k = 0; k < 2; ++k) {
      int64_t bb = tokens * (k == 0 ? HEADS * 64 * 2 * 2 : HEADS * 66 * 2);
      uint8_t* pool = pool_alloc(nbt * bb);
      for (int r = 0; r < rounds; ++r) {
        memset(evict, r, evict_bytes);
        ts[r] = pass(pool, tab, bb, 0, 0);
      }
      qsort(ts, rounds, sizeof(double), cmp);
      printf("%s-blocks-%lld %lld %.6f\n", k == 0 ? "bf16" : "int8", (long long)tokens, (long long)(nbt * bb),
             ts[rounds / 2]);
      free(pool);
    }
  }
  return 0;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--block-tokens", type=int, nargs="*", default=[32, 64],
                    help="also read whole bf16 and int8 blocks of these many tokens (the pool's bytes are the same; "
                         "longer runs of contiguous bytes read faster, int8's 6 KiB blocks of 16 tokens most of all)")
    ap.add_argument("--work", type=int, default=400,
                    help="iterations of four FMA chains after each (span, KV head): 400 add ~2.7 ms in cache on "
                         "the AMX Xeon at 2 threads, so that the pass in cache takes about the int8 tiles' 3.9-4.6 ms")
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if any(t < 16 or t > 8192 or 8192 % t for t in args.block_tokens):
        ap.error(f"--block-tokens must divide 8192 and be at least 16, got {args.block_tokens}")
    extra = [str(t) for t in args.block_tokens]
    out = run_c(SOURCE, "block_reads", [str(args.rounds), str(args.work), *extra], ("-fopenmp",), env)[0]
    rows = [line.split() for line in out.splitlines() if line.strip()]
    res = {name: (int(size), float(sec)) for name, size, sec in rows}
    print(f"machine: {cpu_model()}; {args.threads} threads, medians of {args.rounds} passes")
    print("| read | bytes | ms | GB/s |")
    print("|---|---:|---:|---:|")
    for name, (size, sec) in res.items():
        print(f"| {name} | {size:,} | {sec * 1e3:.2f} | {size / sec / 1e9:.1f} |")
    bf16 = res["bf16-blocks"][1]
    floor = res["int8-order"][1] / bf16
    add = (res["int8-order+work"][1] - res["int8-order"][1]) * 1e3
    cache_add = (res["int8-order+work-in-cache"][1] - res["int8-order-in-cache"][1]) * 1e3
    print(f"int8 pages read in the tiles' order take {floor:.2f}x the bf16 blocks' read (the floor of the int8/bf16 "
          f"decode ratio on this machine); the work adds {add:.2f} ms from DRAM against {cache_add:.2f} ms in cache "
          f"({add / cache_add:.0%} of it unhidden)")
    for t in args.block_tokens:
        i8, b16 = res[f"int8-blocks-{t}"][1], res[f"bf16-blocks-{t}"][1]
        print(f"{t}-token blocks: int8 {i8 / b16:.2f}x bf16's read at the same block size, {i8 / bf16:.2f}x bf16's "
              f"16-token blocks")


if __name__ == "__main__":
    main()
