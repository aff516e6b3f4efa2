// The instruction sets this build was compiled for (-march=native), as kvpage's kernels test them.
//
// Every macro here is always defined, as 0 or 1, and is tested with #if (never #ifdef):
//   KVPAGE_ISA_AVX512      AVX-512 F + BW + VL (masked 16-bit loads need BW and VL on top of F)
//   KVPAGE_ISA_AVX512BF16  AVX-512 with the bf16 dot product (dpbf16)
//   KVPAGE_ISA_AMX         AMX tiles with bf16 products (on top of AVX512BF16); the OS must still permit
//                          them at run time (attention/amx_rows.h: amx_permitted)
//   KVPAGE_ISA_AVX2        AVX2 + FMA (1 on AVX-512 builds as well)
//   KVPAGE_ISA_AVX2_ONLY   AVX2 + FMA without AVX-512 (Zen 3 and older): the 8-lane paths that exist for
//                          machines without AVX-512; an AVX-512 build takes its own path instead
//   KVPAGE_PACKED          the packed bf16 KV layout (attention/packed_kv.h): its kernels need AVX512BF16
//   KVPAGE_PACKED_INT8     the packed int8 KV layout (attention/packed_int8.h): on top of KVPAGE_PACKED, VNNI's
//                          byte dot product (vpdpbusd)
//   KVPAGE_AMX_INT8        AMX byte tile products (tdpbusd) on top of KVPAGE_ISA_AMX and KVPAGE_PACKED_INT8,
//                          with VBMI's byte permutes (every AMX CPU has them): decode over packed int8 pages
//                          (attention/amx_int8.h)
// A kernel with a path per instruction set picks one with
//   #if KVPAGE_ISA_AVX512 ... #elif KVPAGE_ISA_AVX2 ... #else (scalar) #endif
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVPAGE_ISA_AVX512 1
#else
#define KVPAGE_ISA_AVX512 0
#endif

#if KVPAGE_ISA_AVX512 && defined(__AVX512BF16__)
#define KVPAGE_ISA_AVX512BF16 1
#else
#define KVPAGE_ISA_AVX512BF16 0
#endif

#if KVPAGE_ISA_AVX512BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVPAGE_ISA_AMX 1
#else
#define KVPAGE_ISA_AMX 0
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define KVPAGE_ISA_AVX2 1
#else
#define KVPAGE_ISA_AVX2 0
#endif

#define KVPAGE_ISA_AVX2_ONLY (KVPAGE_ISA_AVX2 && !KVPAGE_ISA_AVX512)
#define KVPAGE_PACKED KVPAGE_ISA_AVX512BF16

#if KVPAGE_PACKED && defined(__AVX512VNNI__)
#define KVPAGE_PACKED_INT8 1
#else
#define KVPAGE_PACKED_INT8 0
#endif

#if KVPAGE_ISA_AMX && KVPAGE_PACKED_INT8 && defined(__AMX_INT8__) && defined(__AVX512VBMI__)
#define KVPAGE_AMX_INT8 1
#else
#define KVPAGE_AMX_INT8 0
#endif

#if KVPAGE_ISA_AVX512 || KVPAGE_ISA_AVX2
#include <immintrin.h>
#endif
