/* Products of rows by weights kept in quantized blocks, with integer dot products
 * (quant_kernel.py beside this folder).
 *
 * Weights arrive repacked at load (engine/backends/cpu/quant.py: repack) from any GGUF format
 * into one layout: tiles of TILE = 16 weight rows, each tile the input's blocks of 32 in order;
 * a tile's block is a header (per scale group of 32 or 16 inputs: 16 scales, then 16 offsets,
 * fp16 or fp32) and the 16 x 32 weights as unsigned integers (4 or 8 bits) interleaved so that
 * 64 bytes hold 4 consecutive inputs of each of the 16 rows: one vpdpbusd multiplies them by 4
 * bytes of an input row broadcast. 4-bit weights hold inputs 0..15 of the block in the low
 * nibbles and 16..31 in the high ones. A weight is scale * u + offset.
 *
 * Each input row is quantized once per call, as llama.cpp's Q8 activations: per block of 32, to
 * int8 at scale dx = max|x| / 127, with the scaled sums dx * sum(q) of the block and of its
 * halves. An output then sums, block after block in order, scale * dx * sum(u q) + offset * dx *
 * sum(q) in fp32, sum(u q) exact in integers. A row of the input is quantized from itself alone
 * and every output lane accumulates alone, so a row's result does not depend on how many rows
 * come with it: speculation over quantized weights equals plain decoding of them bit for bit.
 * Up to ROWS input rows share each pass over a tile (the tile stays in L1 for the next rows),
 * so extra rows cost arithmetic, not memory traffic; their quantized inputs sit side by side
 * (Prepared), the weights ahead are prefetched while a tile is multiplied, and tiles are split
 * between OpenMP threads.
 *
 * Built per variant (quant_kernel.py: QUANT): AVX512-VNNI, AVX-VNNI and AVX2 (vpmaddubsw,
 * vpmaddwd) give the same integers; a portable C loop elsewhere.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "layer_step.h"

#define QK 32
#define TILE 16
#define AHEAD 4096 /* bytes of weights requested ahead of the block at hand, on a tile's first pass (they
                      * stream from memory; a prefetch never faults) */
#if defined(__AVX512VNNI__)
#define ROWS 8
#else
#define ROWS 2
#endif

/* Static functions only: the vectors never cross a library boundary. */
#pragma GCC diagnostic ignored "-Wpsabi"
#define VECTOR static inline __attribute__((always_inline))
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef int8_t v16b __attribute__((vector_size(16)));

/* One repacked weight: 4 or 8 bits a weight, 1 or 2 scale groups a block, fp32 (wide) or fp16
 * header; blocks of 32 inputs a tile holds, bytes of its header and of a whole block. */
typedef struct {
  int bits, groups, wide;
  int64_t blocks, header, bytes;
} Layout;

/* Input rows in Q8 blocks, laid out for the passes over a tile: the rows in groups of ROWS and,
 * per group and block of 32 inputs (a slab), q [8][ROWS][4] (4 consecutive inputs of each row
 * side by side, what a vpdpbusd broadcasts), dx [ROWS] and sums [3][ROWS] (dx * sum(q) of the
 * block, of its first 16 and of its last 16). */
typedef struct {
  int8_t *q;
  float *dx, *sums;
  int64_t blocks;
} Prepared;

/* One slab: row r's inputs 4j .. 4j + 3 of the block at q + 4 * (ROWS * j + r), its scale at
 * dx[r], its sums at sums[r], sums[ROWS + r] and sums[2 * ROWS + r]. */
typedef struct {
  int8_t *q;
  float *dx, *sums;
} Slab;

/* The slab of the group of rows from r0 (a multiple of ROWS) and of block b. */
static inline Slab slab(const Prepared *P, int64_t r0, int64_t b) {
  const int64_t at = r0 / ROWS * P->blocks + b;
  return (Slab){P->q + at * QK * ROWS, P->dx + at * ROWS, P->sums + at * 3 * ROWS};
}

static inline float half_to_float(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, sizeof h);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent == 0) {
    float f = ldexpf((float)mantissa, -24);
    memcpy(&bits, &f, sizeof bits);
    bits |= sign;
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

/* Header value c of table t (scales of group g: t = g; offsets: t = groups + g). */
static inline float header_value(const uint8_t *block, const Layout *L, int t, int c) {
  if (L->wide) {
    float f;
    memcpy(&f, block + (t * TILE + c) * 4, sizeof f);
    return f;
  }
  return half_to_float(block + (t * TILE + c) * 2);
}

/* ---- the input rows: widened, normed or gated, quantized (GCC vectors: one source for every
 * variant, each the width its instruction set has) ---- */

VECTOR v16f load16(const void *p, int64_t i, int bf16) {
  v16f v;
  if (!bf16) {
    memcpy(&v, (const float *)p + i, sizeof v);
    return v;
  }
  v16h h;
  memcpy(&h, (const uint16_t *)p + i, sizeof h);
  const v16i bits = __builtin_convertvector(h, v16i) << 16;
  memcpy(&v, &bits, sizeof v);
  return v;
}

VECTOR v16f vabs(v16f v) {
  v16i bits;
  memcpy(&bits, &v, sizeof bits);
  bits &= 0x7fffffff;
  memcpy(&v, &bits, sizeof v);
  return v;
}

/* Lanes of a where `take` is set, else of b. */
VECTOR v16f blend(v16i take, v16f a, v16f b) {
  v16i x, y;
  memcpy(&x, &a, sizeof x);
  memcpy(&y, &b, sizeof y);
  x = (x & take) | (y & ~take);
  memcpy(&a, &x, sizeof a);
  return a;
}

/* exp(x), x clamped to [-87, 88] (Cephes' expf: 2^n times a degree-6 polynomial, within 2 ulp). */
VECTOR v16f vexp(v16f x) {
  const v16f magic = (v16f){} + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
  x = blend(x < -87.0f, (v16f){} - 87.0f, x);
  x = blend(x > 88.0f, (v16f){} + 88.0f, x);
  const v16f n = (x * 1.44269504088896341f + magic) - magic;
  const v16f r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16f p = (v16f){} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const v16i scale = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16f two_n;
  memcpy(&two_n, &scale, sizeof two_n);
  return p * two_n;
}

/* v with its two halves swapped, its quarters within each half, and so on down to lanes:
 * `width` lanes move. */
VECTOR v16i swap_lanes(v16i v, int width) {
  switch (width) {
    case 8:
      return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    case 4:
      return __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    case 2:
      return __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    default:
      return __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  }
}

/* The largest lane of v, which holds no negative numbers (compared as integers: the same order). */
VECTOR int32_t lanes_max(v16i v) {
  for (int width = 8; width >= 1; width /= 2) {
    const v16i other = swap_lanes(v, width), larger = other > v;
    v = (other & larger) | (v & ~larger);
  }
  return v[0];
}

VECTOR int32_t lanes_total(v16i v) {
  for (int width = 8; width >= 1; width /= 2) v += swap_lanes(v, width);
  return v[0];
}

VECTOR float lanes_sum(v16f v) {
  float s = 0.0f;
  for (int i = 0; i < 16; i++) s += v[i];
  return s;
}

/* Row r of the product's input in fp32 into `row` [k]: x itself, RMSNorm(x) * norm_weight
 * (epsilon eps), or silu(gate) * up with x's row [2k] holding gate then up; from this row alone. */
static void input_row(const void *x, int64_t r, int64_t k, int bf16, const void *norm_weight, float eps, int gated,
                      float *row) {
  for (int64_t j = 0; j < k; j += 16) {
    v16f v;
    if (gated) {
      const v16f gate = load16(x, r * 2 * k + j, bf16), up = load16(x, r * 2 * k + k + j, bf16);
      v = gate / (1.0f + vexp(-gate)) * up;
    } else {
      v = load16(x, r * k + j, bf16);
    }
    memcpy(row + j, &v, sizeof v);
  }
  if (!norm_weight) return;
  v16f squares = {};
  for (int64_t j = 0; j < k; j += 16) {
    v16f v;
    memcpy(&v, row + j, sizeof v);
    squares += v * v;
  }
  const float scale = 1.0f / sqrtf(lanes_sum(squares) / (float)k + eps);
  for (int64_t j = 0; j < k; j += 16) {
    v16f v;
    memcpy(&v, row + j, sizeof v);
    v = v * scale * load16(norm_weight, j, bf16);
    memcpy(row + j, &v, sizeof v);
  }
}

/* Row r [k] of the input in Q8 blocks, into its place in P. */
static void quantize_row(const float *row, int64_t k, const Prepared *P, int64_t r) {
  const v16f magic = (v16f){} + 12582912.0f;
  const int64_t r0 = r - r % ROWS, at = r % ROWS;
  for (int64_t b = 0; b < k / QK; b++) {
    v16f halves[2];
    memcpy(halves, row + b * QK, sizeof halves);
    v16i a, c;
    const v16f absolute[2] = {vabs(halves[0]), vabs(halves[1])};
    memcpy(&a, &absolute[0], sizeof a);
    memcpy(&c, &absolute[1], sizeof c);
    const v16i larger = c > a;
    const int32_t top_bits = lanes_max((c & larger) | (a & ~larger));
    float top;
    memcpy(&top, &top_bits, sizeof top);
    const float scale = top / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    const Slab s = slab(P, r0, b);
    int8_t *q = s.q + 4 * at;
    int32_t part[2];
    for (int h = 0; h < 2; h++) {
      const v16i ints = __builtin_convertvector((halves[h] * inverse + magic) - magic, v16i);
      const v16b bytes = __builtin_convertvector(ints, v16b);
      for (int j = 0; j < 4; j++) memcpy(q + 4 * ROWS * (4 * h + j), (const int8_t *)&bytes + 4 * j, 4);
      part[h] = lanes_total(ints);
    }
    s.dx[at] = scale;
    s.sums[at] = scale * (float)(part[0] + part[1]);
    s.sums[ROWS + at] = scale * (float)part[0];
    s.sums[2 * ROWS + at] = scale * (float)part[1];
  }
}

/* ---- one pass over a tile for R rows of the input from row r0: out[r][c] = W[c] . x[r0 + r] ---- */

#if defined(__AVX2__)
/* The weights AHEAD bytes past a tile's block, requested into L1 on the tile's first pass (the
 * later passes find the tile there). */
static inline __attribute__((always_inline)) void fetch_ahead(const uint8_t *block, const Layout *L, int64_t r0) {
  if (r0 != 0) return;
  for (int64_t line = 0; line < L->bytes; line += 64) _mm_prefetch((const char *)block + line + AHEAD, _MM_HINT_T0);
}
#endif

#if defined(__AVX512VNNI__)
static inline __m512 header16(const uint8_t *block, const Layout *L, int t) {
  if (L->wide) return _mm512_loadu_ps(block + t * TILE * 4);
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + t * TILE * 2)));
}

/* acc + the products of w's bytes by the 4 bytes at x, broadcast: vpdpbusd reads x itself
 * ({1to16}), where from the intrinsics GCC broadcasts it first, one more vector instruction for
 * every product (docs/ENGINE.md: Kernels and exactness, quantized weights). */
static inline __attribute__((always_inline)) __m512i dot_broadcast(__m512i acc, __m512i w, const int8_t *x) {
  __asm__("vpdpbusd %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*(const int32_t *)x), "v"(w));
  return acc;
}

/* Each row keeps two integer sums a block (inputs 0..15 and 16..31: two chains of vpdpbusd)
 * and one fp32 sum over the blocks, so 8 rows fit the 32 registers beside the tile's weights,
 * which are loaded and split into nibbles once for all of them. */
static inline __attribute__((always_inline)) void tile_pass(const uint8_t *tile, const Layout *L,
                                                            const Prepared *P, int64_t r0, const int R,
                                                            float out[][TILE]) {
  __m512 f[ROWS];
  for (int r = 0; r < R; r++) f[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < L->blocks; b++) {
    const uint8_t *block = tile + b * L->bytes, *w = block + L->header;
    fetch_ahead(block, L, r0);
    const Slab s = slab(P, r0, b);
    __m512i lo[ROWS], hi[ROWS];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm512_setzero_si512();
    for (int p = 0; p < 4; p++) {
      __m512i wl, wh;
      if (L->bits == 4) {
        const __m512i raw = _mm512_loadu_si512(w + 64 * p);
        wl = _mm512_and_si512(raw, nibble);
        wh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
      } else {
        wl = _mm512_loadu_si512(w + 64 * p);
        wh = _mm512_loadu_si512(w + 64 * (p + 4));
      }
      for (int r = 0; r < R; r++) {
        lo[r] = dot_broadcast(lo[r], wl, s.q + 4 * (ROWS * p + r));
        hi[r] = dot_broadcast(hi[r], wh, s.q + 4 * (ROWS * (p + 4) + r));
      }
    }
    if (L->groups == 1) {
      const __m512 scale = header16(block, L, 0), offset = header16(block, L, 1);
      for (int r = 0; r < R; r++) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(lo[r], hi[r]));
        f[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(s.dx[r])), f[r]);
        f[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(s.sums[r]), f[r]);
      }
    } else {
      const __m512 scale_lo = header16(block, L, 0), scale_hi = header16(block, L, 1);
      const __m512 offset_lo = header16(block, L, 2), offset_hi = header16(block, L, 3);
      for (int r = 0; r < R; r++) {
        const __m512 d = _mm512_set1_ps(s.dx[r]);
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[r]), _mm512_mul_ps(scale_lo, d), f[r]);
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[r]), _mm512_mul_ps(scale_hi, d), f[r]);
        f[r] = _mm512_fmadd_ps(offset_lo, _mm512_set1_ps(s.sums[ROWS + r]), f[r]);
        f[r] = _mm512_fmadd_ps(offset_hi, _mm512_set1_ps(s.sums[2 * ROWS + r]), f[r]);
      }
    }
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], f[r]);
}

#elif defined(__AVX2__)
static inline __m256 header8(const uint8_t *block, const Layout *L, int t, int half) {
  if (L->wide) return _mm256_loadu_ps((const float *)(block + (t * TILE + 8 * half) * 4));
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + (t * TILE + 8 * half) * 2)));
}

/* acc + sum of 4 products per lane: unsigned weights w by signed inputs x. 8-bit weights are
 * split into nibbles on AVX2, whose vpmaddubsw saturates a pair of products at 32767. */
static inline __m256i dot(__m256i acc, __m256i w, __m256i x, int bits) {
#if defined(__AVXVNNI__)
  (void)bits;
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if (bits == 4) return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m256i low = _mm256_maddubs_epi16(_mm256_and_si256(w, nibble), x);
  const __m256i high = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), nibble), x);
  const __m256i both = _mm256_add_epi32(_mm256_madd_epi16(low, ones), _mm256_madd_epi16(high, _mm256_set1_epi16(16)));
  return _mm256_add_epi32(acc, both);
#endif
}

static inline __attribute__((always_inline)) void tile_pass(const uint8_t *tile, const Layout *L,
                                                            const Prepared *P, int64_t r0, const int R,
                                                            float out[][TILE]) {
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  for (int half = 0; half < 2; half++) {
    __m256 f[ROWS], o[ROWS];
    for (int r = 0; r < R; r++) f[r] = o[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < L->blocks; b++) {
      const uint8_t *block = tile + b * L->bytes, *w = block + L->header + 32 * half;
      if (half == 0) fetch_ahead(block, L, r0);
      const Slab s = slab(P, r0, b);
      __m256i lo[ROWS], hi[ROWS];
      for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_si256();
      for (int p = 0; p < 4; p++) {
        __m256i wl, wh;
        if (L->bits == 4) {
          const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + 64 * p));
          wl = _mm256_and_si256(raw, nibble);
          wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        } else {
          wl = _mm256_loadu_si256((const __m256i *)(w + 64 * p));
          wh = _mm256_loadu_si256((const __m256i *)(w + 64 * (p + 4)));
        }
        for (int r = 0; r < R; r++) {
          int32_t xl, xh;
          memcpy(&xl, s.q + 4 * (ROWS * p + r), 4);
          memcpy(&xh, s.q + 4 * (ROWS * (p + 4) + r), 4);
          lo[r] = dot(lo[r], wl, _mm256_set1_epi32(xl), L->bits);
          hi[r] = dot(hi[r], wh, _mm256_set1_epi32(xh), L->bits);
        }
      }
      for (int r = 0; r < R; r++) {
        const __m256 d = _mm256_set1_ps(s.dx[r]);
        if (L->groups == 1) {
          const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(lo[r], hi[r]));
          f[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(header8(block, L, 0, half), d), f[r]);
          o[r] = _mm256_fmadd_ps(header8(block, L, 1, half), _mm256_set1_ps(s.sums[r]), o[r]);
        } else {
          f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[r]), _mm256_mul_ps(header8(block, L, 0, half), d), f[r]);
          f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[r]), _mm256_mul_ps(header8(block, L, 1, half), d), f[r]);
          o[r] = _mm256_fmadd_ps(header8(block, L, 2, half), _mm256_set1_ps(s.sums[ROWS + r]), o[r]);
          o[r] = _mm256_fmadd_ps(header8(block, L, 3, half), _mm256_set1_ps(s.sums[2 * ROWS + r]), o[r]);
        }
      }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r] + 8 * half, _mm256_add_ps(f[r], o[r]));
  }
}

#else
/* Weight u of row c, input i of a tile's block. */
static inline int32_t weight(const uint8_t *w, int bits, int c, int i) {
  if (bits == 8) return w[64 * (i / 4) + 4 * c + i % 4];
  const uint8_t byte = w[64 * (i % 16 / 4) + 4 * c + i % 4];
  return i < 16 ? byte & 0x0f : byte >> 4;
}

static inline __attribute__((always_inline)) void tile_pass(const uint8_t *tile, const Layout *L,
                                                            const Prepared *P, int64_t r0, const int R,
                                                            float out[][TILE]) {
  for (int r = 0; r < R; r++) {
    for (int c = 0; c < TILE; c++) {
      float f = 0.0f, o = 0.0f;
      for (int64_t b = 0; b < L->blocks; b++) {
        const uint8_t *block = tile + b * L->bytes, *w = block + L->header;
        const Slab s = slab(P, r0, b);
        int32_t dots[2] = {0, 0};
        for (int i = 0; i < QK; i++) dots[i / 16] += weight(w, L->bits, c, i) * s.q[4 * (ROWS * (i / 4) + r) + i % 4];
        if (L->groups == 1) {
          f += (float)(dots[0] + dots[1]) * (header_value(block, L, 0, c) * s.dx[r]);
          o += header_value(block, L, 1, c) * s.sums[r];
        } else {
          for (int g = 0; g < 2; g++) {
            f += (float)dots[g] * (header_value(block, L, g, c) * s.dx[r]);
            o += header_value(block, L, 2 + g, c) * s.sums[ROWS * (1 + g) + r];
          }
        }
      }
      out[r][c] = f + o;
    }
  }
}
#endif

/* tile_pass with the row count a constant, so each count's loops unroll. */
#define PASS(n)                             \
  case n:                                   \
    tile_pass(tile, L, P, r0, n, out);      \
    break;
static void tile_rows(const uint8_t *tile, const Layout *L, const Prepared *P, int64_t r0, int64_t rows,
                      float out[][TILE]) {
  switch (rows) {
#if ROWS == 8
    PASS(8)
    PASS(7)
    PASS(6)
    PASS(5)
    PASS(4)
    PASS(3)
#endif
    PASS(2)
    default:
      tile_pass(tile, L, P, r0, 1, out);
  }
}
#undef PASS

static inline float widen(const void *p, int64_t i, int bf16) {
  if (!bf16) return ((const float *)p)[i];
  const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* Round to nearest even, as torch converts float to bfloat16 (NaN stays NaN). */
static inline void store(void *p, int64_t i, float f, int bf16) {
  if (!bf16) {
    ((float *)p)[i] = f;
    return;
  }
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  ((uint16_t *)p)[i] = (bits & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((bits >> 16) | 0x40)
                                                          : (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* y[i .. i + 16) = v + bias (+ residual), each as `store` writes it. */
static inline void store_tile(void *y, int64_t i, const float *v, const float *bias, const void *residual, int bf16) {
  v16f f;
  memcpy(&f, v, sizeof f);
  if (bias) {
    v16f b;
    memcpy(&b, bias, sizeof b);
    f += b;
  }
  if (residual) f = load16(residual, i, bf16) + f;
  if (!bf16) {
    memcpy((float *)y + i, &f, sizeof f);
    return;
  }
  v16u bits;
  memcpy(&bits, &f, sizeof bits);
  const v16u nan = (v16u)((bits & 0x7fffffffu) > 0x7f800000u);
  const v16u even = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16, quiet = (bits >> 16) | 0x40u;
  const v16h halves = __builtin_convertvector((quiet & nan) | (even & ~nan), v16h);
  memcpy((uint16_t *)y + i, &halves, sizeof halves);
}

/* One repacked weight [n][k] as the kernels read it (quant_kernel.py: QuantWeight): ceil(n / 16)
 * tiles of the layout (bits, groups, wide), its bias [n] fp32 or NULL. */
typedef struct {
  const uint8_t *data;
  const float *bias;
  int64_t n, k;
  int bits, groups, wide;
} multiguess_quant_weight;

/* x: [m][k] (or [m][2k] when gated), norm_weight [k], residual and y [m][n]: bf16 when `bf16`
 * is set, else fp32 (k a multiple of 32). y = input @ W^T + bias (+ residual), the input being
 * x, RMSNorm(x) * norm_weight or silu(gate) * up (input_row). Returns -1 when out of memory. */
int multiguess_quant_matmul(const multiguess_quant_weight *W, const void *x, void *y, int64_t m, int threads,
                            int bf16, const void *norm_weight, float eps, int gated, const void *residual) {
  if (m == 0) return 0;
  const int64_t k = W->k, n = W->n, blocks = k / QK;
  const int64_t header = 2 * W->groups * TILE * (W->wide ? 4 : 2);
  const Layout L = {W->bits, W->groups, W->wide, blocks, header, header + TILE * QK * W->bits / 8};
  const int64_t padded = (m + ROWS - 1) / ROWS * ROWS;
  Prepared P = {malloc((size_t)(padded * k)), malloc((size_t)(padded * blocks) * sizeof(float)),
                malloc((size_t)(padded * blocks * 3) * sizeof(float)), blocks};
  float *rows = malloc((size_t)(threads * k) * sizeof(float));
  if (!P.q || !P.dx || !P.sums || !rows) {
    free(P.q), free(P.dx), free(P.sums), free(rows);
    return -1;
  }
  const int64_t tiles = (n + TILE - 1) / TILE;
#pragma omp parallel num_threads(threads)
  {
#if defined(_OPENMP)
    float *row = rows + (int64_t)omp_get_thread_num() * k;
#else
    float *row = rows;
#endif
#pragma omp for schedule(static, ROWS) /* a group's rows share cache lines: one thread writes them */
    for (int64_t r = 0; r < m; r++) {
      input_row(x, r, k, bf16, norm_weight, eps, gated, row);
      quantize_row(row, k, &P, r);
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
      const uint8_t *tile = W->data + t * blocks * L.bytes;
      const int64_t j0 = t * TILE, columns = n - j0 < TILE ? n - j0 : TILE;
      float out[ROWS][TILE];
      for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
        const int64_t count = m - r0 < ROWS ? m - r0 : ROWS;
        tile_rows(tile, &L, &P, r0, count, out);
        for (int64_t r = 0; r < count; r++) {
          if (columns == TILE) {
            store_tile(y, (r0 + r) * n + j0, out[r], W->bias ? W->bias + j0 : NULL, residual, bf16);
            continue;
          }
          for (int64_t c = 0; c < columns; c++) {
            const int64_t i = (r0 + r) * n + j0 + c;
            const float v = out[r][c] + (W->bias ? W->bias[j0 + c] : 0.0f);
            store(y, i, residual ? widen(residual, i, bf16) + v : v, bf16);
          }
        }
      }
    }
  }
  free(P.q), free(P.dx), free(P.sums), free(rows);
  return 0;
}

/* One decoder layer's repacked weights, norms and cache (quant_kernel.py: QuantLayer). */
typedef struct {
  const uint16_t *input_norm, *post_norm; /* RMSNorm weights [d], bf16 */
  multiguess_quant_weight qkv, o, gate_up, down;
  uint16_t *cache; /* bf16 [slots][2 * kv_heads][capacity][dim] */
  float eps, post_eps, scale; /* the two norms' epsilons, the attention scale */
} multiguess_quant_layer_weights;

/* The bf16 library's rotary-with-cache-write and attention kernels (bf16_kernels.c), passed in
 * by address: the quantized layer runs them between its products. */
typedef void (*rope_cache_fn)(const uint16_t *, const uint16_t *, const uint16_t *, float *, uint16_t *,
                              const int64_t *, const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
typedef int (*attention_fn)(const float *, const uint16_t *, const int64_t *, const float *, uint16_t *, int64_t,
                            int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int);

/* A whole pre-norm SiLU-gated decoder layer on the bf16 residual stream x [m][d], updated in
 * place: the products above with rotary, cache write and attention from the bf16 library, in
 * one call from Python instead of six. Every step is per row, as in multiguess_bf16_layer.
 * Returns -1 when out of memory. */
int multiguess_quant_layer(const multiguess_quant_layer_weights *layer, const multiguess_step *step, uint16_t *x,
                           rope_cache_fn rope_cache, attention_fn attention) {
  const int64_t m = step->batch * step->width;
  const int threads = step->threads;
  if (multiguess_quant_matmul(&layer->qkv, x, step->qkv, m, threads, 1, layer->input_norm, layer->eps, 0, NULL))
    return -1;
  rope_cache(step->qkv, step->cos, step->sin, step->queries, layer->cache, step->slots, step->starts, step->batch,
             step->width, step->heads, step->kv_heads, step->dim, step->capacity);
  if (attention(step->queries, layer->cache, step->slots, step->mask, step->attn, step->batch, step->width,
                step->heads, step->kv_heads, step->dim, step->capacity, step->length, layer->scale, threads))
    return -1;
  if (multiguess_quant_matmul(&layer->o, step->attn, step->h, m, threads, 1, NULL, 0.0f, 0, x)) return -1;
  if (multiguess_quant_matmul(&layer->gate_up, step->h, step->gate_up, m, threads, 1, layer->post_norm,
                              layer->post_eps, 0, NULL))
    return -1;
  return multiguess_quant_matmul(&layer->down, step->gate_up, x, m, threads, 1, NULL, 0.0f, 1, step->h);
}
