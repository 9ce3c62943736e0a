/* Products of fp32 rows by weights in GGUF's block formats, with integer dot products
 * (quant_kernel.py beside this folder).
 *
 * y = x W^T (+ bias), W [n][k] stored as ggml writes it: each row is k / 32 blocks of an fp16
 * scale d (Q4_1: and an fp16 offset m) and 32 integers (Q8_0: int8; Q4_0 and Q4_1: 4-bit, the
 * low nibbles of 16 bytes first, then the high ones). As llama.cpp does, each row of x is
 * quantized first, per block of 32, to int8 with an fp32 scale dx (its largest magnitude maps to
 * 127) and the block's sum sx = dx * sum(q). A block's contribution is then
 *   Q8_0: d dx sum(w q)      Q4_0: d dx sum(w q) - 8 d sx      Q4_1: d dx sum(w q) + m sx
 * with sum(w q) exact in integers. Every output accumulates its blocks in order (in eight fp32
 * lanes with AVX2, then summed lane by lane), and a row of x is quantized from itself alone, so a
 * row's result does not depend on how many rows come with it: speculation over quantized
 * weights equals plain decoding of them bit for bit. Output rows are split between OpenMP
 * threads; each weight row is read once per call for every row of x.
 *
 * Built per variant (quant_kernel.py: VARIANTS): AVX2 (vpmaddubsw, vpmaddwd) where the CPU has it,
 * a portable C loop elsewhere.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define QK 32
enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 }; /* quant_kernel.py: CODES */
static const int64_t BLOCK_BYTES[] = {34, 18, 20};
#define ROWS 4 /* rows of x that share one decoded weight block */

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

/* One row of x in int8 blocks: q [k], scales d and scaled sums s [k / 32]. */
static void quantize_row(const float *x, int64_t k, int8_t *q, float *d, float *s) {
  for (int64_t b = 0; b < k / QK; b++) {
    const float *xb = x + b * QK;
    float top = 0.0f;
    for (int j = 0; j < QK; j++) top = fabsf(xb[j]) > top ? fabsf(xb[j]) : top;
    const float scale = top / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK; j++) {
      const int v = (int)nearbyintf(xb[j] * inverse);
      q[b * QK + j] = (int8_t)v;
      sum += v;
    }
    d[b] = scale;
    s[b] = scale * (float)sum;
  }
}

#if defined(__AVX2__)
/* A block's 32 weights as bytes: int8 for Q8_0, the nibbles 0..15 for Q4_0 and Q4_1. */
static inline __m256i block_weights(const uint8_t *block, int format) {
  if (format == Q8_0) return _mm256_loadu_si256((const __m256i *)(block + 2));
  const __m128i packed = _mm_loadu_si128((const __m128i *)(block + (format == Q4_1 ? 4 : 2)));
  const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0f));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0f));
  return _mm256_set_m128i(high, low);
}

/* sum(w q) of a block in eight int32 lanes, as floats: unsigned weights multiply int8 inputs
 * directly; int8 weights take the inputs' signs so that vpmaddubsw sees |q| (at most 127: no
 * pair of products saturates int16). */
static inline __m256 block_dot(__m256i w, const int8_t *q, int format) {
  __m256i x = _mm256_loadu_si256((const __m256i *)q);
  if (format == Q8_0) {
    w = _mm256_sign_epi8(w, x);
    x = _mm256_sign_epi8(x, x);
    const __m256i pairs = _mm256_maddubs_epi16(x, w);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  const __m256i pairs = _mm256_maddubs_epi16(w, x);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

static inline float lanes_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

/* Output j of `rows` (at most ROWS) rows of x from row r0: y[r][j] = W[j] . x[r] + bias[j]. */
static void output_rows(const uint8_t *wrow, int format, const int8_t *xq, const float *xd, const float *xs,
                        int64_t rows, int64_t r0, int64_t k, float start, float *y, int64_t n, int64_t j) {
  const int64_t blocks = k / QK, size = BLOCK_BYTES[format];
  float offset[ROWS] = {0};
#if defined(__AVX2__)
  __m256 acc[ROWS];
  for (int64_t r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
#else
  float acc[ROWS] = {0};
#endif
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t *block = wrow + b * size;
    const float d = half_to_float(block);
    const float shift = format == Q4_1 ? half_to_float(block + 2) : format == Q4_0 ? -8.0f * d : 0.0f;
#if defined(__AVX2__)
    const __m256i w = block_weights(block, format);
#else
    int8_t w[QK];
    for (int i = 0; i < QK; i++) {
      if (format == Q8_0)
        w[i] = (int8_t)block[2 + i];
      else
        w[i] = (int8_t)(i < 16 ? block[size - 16 + i] & 0x0f : block[size - 32 + i] >> 4);
    }
#endif
    for (int64_t r = 0; r < rows; r++) {
      const int64_t at = (r0 + r) * blocks + b;
#if defined(__AVX2__)
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[at]), block_dot(w, xq + at * QK, format), acc[r]);
#else
      int32_t dot = 0;
      for (int i = 0; i < QK; i++) dot += (int32_t)w[i] * xq[at * QK + i];
      acc[r] += d * xd[at] * (float)dot;
#endif
      offset[r] += shift * xs[at];
    }
  }
  for (int64_t r = 0; r < rows; r++) {
#if defined(__AVX2__)
    const float sum = lanes_sum(acc[r]);
#else
    const float sum = acc[r];
#endif
    y[(r0 + r) * n + j] = start + sum + offset[r];
  }
}

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

/* Row r of the product's input in fp32 into `row` [k]: x itself, RMSNorm(x) * norm_weight
 * (epsilon eps), or silu(gate) * up with x's row [2k] holding gate then up. In fp32 throughout,
 * from this row alone. */
static void input_row(const void *x, int64_t r, int64_t k, int bf16, const void *norm_weight, float eps, int gated,
                      float *row) {
  if (gated) {
    for (int64_t j = 0; j < k; j++) {
      const float gate = widen(x, r * 2 * k + j, bf16), up = widen(x, r * 2 * k + k + j, bf16);
      row[j] = gate / (1.0f + expf(-gate)) * up;
    }
    return;
  }
  for (int64_t j = 0; j < k; j++) row[j] = widen(x, r * k + j, bf16);
  if (!norm_weight) return;
  float squares = 0.0f;
  for (int64_t j = 0; j < k; j++) squares += row[j] * row[j];
  const float scale = 1.0f / sqrtf(squares / (float)k + eps);
  for (int64_t j = 0; j < k; j++) row[j] = row[j] * scale * widen(norm_weight, j, bf16);
}

/* x: [m][k] (or [m][2k] when gated), norm_weight [k], residual and y [m][n]: bf16 when `bf16`
 * is set, else fp32 (k a multiple of 32); w: [n] rows of k / 32 blocks of `format`; bias [n]
 * fp32 or NULL. y = input @ W^T + bias (+ residual), the input being x, RMSNorm(x) * norm_weight
 * or silu(gate) * up (input_row). Returns -1 when out of memory. */
int multiguess_quant_matmul(const uint8_t *w, int format, const void *x, const float *bias, void *y, int64_t m,
                            int64_t k, int64_t n, int threads, int bf16, const void *norm_weight, float eps,
                            int gated, const void *residual) {
  if (m == 0) return 0;
  const int64_t blocks = k / QK, row = blocks * BLOCK_BYTES[format];
  int8_t *xq = malloc((size_t)(m * k));
  float *xd = malloc((size_t)(m * blocks) * sizeof *xd), *xs = malloc((size_t)(m * blocks) * sizeof *xs);
  float *prepared = malloc((size_t)k * sizeof *prepared), *sums = malloc((size_t)(m * n) * sizeof *sums);
  if (!xq || !xd || !xs || !prepared || !sums) {
    free(xq), free(xd), free(xs), free(prepared), free(sums);
    return -1;
  }
  for (int64_t r = 0; r < m; r++) {
    input_row(x, r, k, bf16, norm_weight, eps, gated, prepared);
    quantize_row(prepared, k, xq + r * k, xd + r * blocks, xs + r * blocks);
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t j = 0; j < n; j++) {
    const float start = bias ? bias[j] : 0.0f;
    for (int64_t r0 = 0; r0 < m; r0 += ROWS)
      output_rows(w + j * row, format, xq, xd, xs, m - r0 < ROWS ? m - r0 : ROWS, r0, k, start, sums, n, j);
  }
  for (int64_t i = 0; i < m * n; i++) {
    store(y, i, residual ? widen(residual, i, bf16) + sums[i] : sums[i], bf16);
  }
  free(xq), free(xd), free(xs), free(prepared), free(sums);
  return 0;
}
