/* bf16 kernels for a decode step on CPUs with AVX512-BF16 (bf16_kernel.py beside this folder).
 *
 * multiguess_bf16_matmul: y = x W^T (+ bias) with fp32 accumulation, optionally of RMSNorm(x)
 * or of silu(gate) * up, and plus a residual: the small ops around a decode step's
 * projections, done here instead of as a dozen framework calls each.
 *
 * The weight is packed once into panels of 64 output rows, [panels][K/2][64][2]: one panel is
 * one contiguous stream and each step of the inner loop reads 256 bytes of it, the pairs of
 * inputs that vdpbf16ps multiplies. Every output accumulates its input pairs in order, in one
 * fp32 lane, from its bias (or zero); rows of x are independent of each other, so a row's
 * result does not depend on how many rows are computed with it. Panels are split between
 * OpenMP threads (the runtime torch itself uses when both link libgomp.so.1).
 *
 * Where the CPU has AMX tiles (amx_bf16), the same panels also feed tdpbf16ps, 16 rows of x at
 * a time: a decode step streams the weights as fast as vdpbf16ps, and a tree's extra rows ride
 * on the same loads nearly free, where vdpbf16ps pays for every row. Which of the two a process
 * uses is chosen once (bf16_kernel.py: matrix_units), so a row has one arithmetic everywhere.
 */
#include <immintrin.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

#define PANEL 64
#define ROWS 6 /* rows of x per pass over a panel: 24 accumulators in registers */
/* Weights requested into L2 32 KiB ahead of the loads: 8-12% faster streaming than the
 * hardware prefetcher alone on the 2-core EPYC measured (docs/ENGINE.md); never faults. */
#define PREFETCH 16384

static inline float widen(uint16_t v) {
  uint32_t bits = (uint32_t)v << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* Round to nearest even, as torch converts float to bfloat16 (NaN stays NaN). */
static inline uint16_t narrow(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline __mmask16 lanes(int64_t live) {
  return live >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << live) - 1);
}

/* transformers' RMSNorm in bf16: weight * bf16(x * rsqrt(mean(x^2) + eps)), in fp32 inside. */
static void rms_norm_row(const uint16_t *x, const uint16_t *weight, float eps, int64_t k, uint16_t *out) {
  float partial[16] = {0};
  for (int64_t j = 0; j < k; j++) partial[j % 16] += widen(x[j]) * widen(x[j]);
  for (int width = 8; width > 0; width /= 2)
    for (int j = 0; j < width; j++) partial[j] += partial[j + width];
  const float scale = 1.0f / sqrtf(partial[0] / (float)k + eps);
  for (int64_t j = 0; j < k; j++) out[j] = narrow(widen(weight[j]) * widen(narrow(widen(x[j]) * scale)));
}

/* e^x in fp32 lanes: 2^n * p(r), r = x - n ln2, |r| <= ln2/2, a degree-6 polynomial (relative
 * error ~2e-7); 0 below -87, +inf past the fp32 range (scalef saturates). */
static inline __m512 exp_lanes(__m512 x) {
  const __m512 tiny = _mm512_set1_ps(-87.0f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, tiny, _CMP_LT_OQ);
  x = _mm512_max_ps(x, tiny);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 poly = _mm512_set1_ps(1.0f / 720);
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 120));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 24));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 6));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(0.5f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps((__mmask16)~underflow, _mm512_scalef_ps(poly, n));
}

static inline __m512 widen_lanes(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* act(gate) * up in bf16, gate and up the two halves of a row: bf16(bf16(silu(gate)) * up),
 * silu(g) = g / (1 + e^-g) in fp32 as torch computes it (its exp may differ in the last bit). */
static void silu_mul_row(const uint16_t *gate_up, int64_t k, uint16_t *out) {
  for (int64_t j = 0; j < k; j += 16) {
    const __mmask16 live = lanes(k - j);
    const __m512 gate = widen_lanes(_mm256_maskz_loadu_epi16(live, gate_up + j));
    const __m512 up = widen_lanes(_mm256_maskz_loadu_epi16(live, gate_up + k + j));
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(one, exp_lanes(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
    const __m512 product = _mm512_mul_ps(widen_lanes((__m256i)_mm512_cvtneps_pbh(silu)), up);
    _mm256_mask_storeu_epi16(out + j, live, (__m256i)_mm512_cvtneps_pbh(product));
  }
}

/* One output row's 64 (`live`) fp32 sums of a panel, rounded to bf16 at y + at, plus the
 * residual there when given: bf16(residual + bf16(product)), as torch adds two bf16 tensors. */
static inline void store_row(const __m512 acc[4], const uint16_t *residual, uint16_t *y, int64_t at,
                             int64_t live) {
  for (int j = 0; j < 4 && 16 * j < live; j++) {
    const __mmask16 mask = lanes(live - 16 * j);
    __m256i out = (__m256i)_mm512_cvtneps_pbh(acc[j]);
    if (residual) {
      const __m256i kept = _mm256_maskz_loadu_epi16(mask, residual + at + 16 * j);
      out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(widen_lanes(out), widen_lanes(kept)));
    }
    _mm256_mask_storeu_epi16(y + at + 16 * j, mask, out);
  }
}

static void panel_product(const uint16_t *panel, const uint16_t *x, const uint16_t *bias,
                          const uint16_t *residual, uint16_t *y, int64_t m, int64_t k, int64_t n,
                          int64_t first) {
  const int64_t pairs = k / 2;
  int64_t live = n - first < PANEL ? n - first : PANEL;
  __m512 start[4];
  for (int j = 0; j < 4; j++) {
    start[j] = _mm512_setzero_ps();
    int64_t lane0 = first + 16 * j;
    if (bias && lane0 < n) {
      start[j] = widen_lanes(_mm256_maskz_loadu_epi16(lanes(live - 16 * j), bias + lane0));
    }
  }
  for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
    const int64_t rows = m - r0 < ROWS ? m - r0 : ROWS;
    __m512 acc[ROWS][4];
    const uint32_t *xr[ROWS];
    for (int i = 0; i < ROWS; i++) {
      for (int j = 0; j < 4; j++) acc[i][j] = start[j];
      xr[i] = (const uint32_t *)(x + (r0 + (i < rows ? i : 0)) * k);
    }
    const uint16_t *w = panel;
    for (int64_t p = 0; p < pairs; p++, w += 2 * PANEL) {
      _mm_prefetch((const char *)(w + PREFETCH), _MM_HINT_T1);
      _mm_prefetch((const char *)(w + PREFETCH + 64), _MM_HINT_T1);
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
      const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
      const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 96);
      for (int i = 0; i < ROWS; i++) {
        if (i < rows) {
          const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xr[i][p]);
          acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, w0);
          acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, w1);
          acc[i][2] = _mm512_dpbf16_ps(acc[i][2], xv, w2);
          acc[i][3] = _mm512_dpbf16_ps(acc[i][3], xv, w3);
        }
      }
    }
    for (int64_t i = 0; i < rows; i++) store_row(acc[i], residual, y, (r0 + i) * n + first, live);
  }
}

/* The same panel product on AMX tiles, for x already padded to `padded` rows (a multiple of
 * 16, zero past m) and k a multiple of 32. Each pass takes 16 rows: four 16x16 fp32 tiles for
 * the panel's 64 outputs start from the bias (a zero-stride load repeats it on every row) and
 * accumulate tdpbf16ps over 32 inputs at a time; a B tile is 16 pairs of one 16-output slice of
 * the panel, whose pairs lie 256 bytes apart, so the panels need no other packing. Each output
 * sums its own row's products in a fixed order: a row does not depend on the others either. */
static void panel_product_amx(const uint16_t *panel, const uint16_t *x, const uint16_t *bias,
                              const uint16_t *residual, uint16_t *y, int64_t m, int64_t padded, int64_t k,
                              int64_t n, int64_t first) {
  const int64_t live = n - first < PANEL ? n - first : PANEL;
  float start[PANEL] __attribute__((aligned(64))) = {0};
  float sums[4][16][16] __attribute__((aligned(64)));
  for (int64_t j = 0; bias && j < live; j++) start[j] = widen(bias[first + j]);
  for (int64_t r0 = 0; r0 < padded; r0 += 16) {
    _tile_loadd(0, start, 0);
    _tile_loadd(1, start + 16, 0);
    _tile_loadd(2, start + 32, 0);
    _tile_loadd(3, start + 48, 0);
    const uint16_t *w = panel;
    for (int64_t c = 0; c < k; c += 32, w += 16 * 2 * PANEL) {
      _tile_loadd(4, x + r0 * k + c, 2 * k);
      _tile_loadd(5, w, 4 * PANEL);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, w + 32, 4 * PANEL);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, w + 64, 4 * PANEL);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, w + 96, 4 * PANEL);
      _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
    for (int64_t i = 0; i < 16 && r0 + i < m; i++) {
      const __m512 acc[4] = {_mm512_load_ps(sums[0][i]), _mm512_load_ps(sums[1][i]), _mm512_load_ps(sums[2][i]),
                             _mm512_load_ps(sums[3][i])};
      store_row(acc, residual, y, (r0 + i) * n + first, live);
    }
  }
}

/* Tiles 0-3 hold sums, 4 a block of x, 5 and 6 weights: 16 rows of 64 bytes each. The
 * configuration is per thread, and torch's own AMX kernels may change it between calls. */
static void configure_tiles(void) {
  struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes[16];
    uint8_t rows[16];
  } config = {.palette = 1};
  for (int t = 0; t < 7; t++) {
    config.bytes[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

/* Linux hands AMX state to a process only when asked; 0 when this process may use the tiles. */
int multiguess_amx_enable(void) {
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

/* x: [m][k] bf16 ([m][2k], gate then up, when gated), packed: [ceil(n / 64)][k/2][64][2] bf16
 * (zero rows past n), bias and residual: [n] and [m][n] or NULL, y: [m][n] bf16; k even. With
 * norm_weight the product is of RMSNorm(x) (epsilon eps); with gated, of silu(gate) * up. */
int multiguess_bf16_matmul(const uint16_t *packed, const uint16_t *x, const uint16_t *bias,
                           uint16_t *y, int64_t m, int64_t k, int64_t n, int threads,
                           const uint16_t *norm_weight, float eps, int gated, const uint16_t *residual,
                           int amx) {
  uint16_t *prepared = NULL;
  if (m == 0) return 0;
  amx = amx && k % 32 == 0;
  const int64_t padded = amx ? (m + 15) / 16 * 16 : m;
  if (norm_weight || gated || padded != m) {
    prepared = calloc((size_t)(padded * k), sizeof *prepared);
    if (!prepared) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (m > 1)
    for (int64_t r = 0; r < m; r++) {
      if (gated)
        silu_mul_row(x + r * 2 * k, k, prepared + r * k);
      else if (norm_weight)
        rms_norm_row(x + r * k, norm_weight, eps, k, prepared + r * k);
      else
        memcpy(prepared + r * k, x + r * k, (size_t)k * sizeof *x);
    }
    x = prepared;
  }
  const int64_t panels = (n + PANEL - 1) / PANEL;
  if (amx) {
#pragma omp parallel num_threads(threads)
    {
      configure_tiles();
#pragma omp for schedule(static)
      for (int64_t p = 0; p < panels; p++)
        panel_product_amx(packed + p * k * PANEL, x, bias, residual, y, m, padded, k, n, p * PANEL);
      _tile_release();
    }
  } else {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++)
      panel_product(packed + p * k * PANEL, x, bias, residual, y, m, k, n, p * PANEL);
  }
  free(prepared);
  return 0;
}

/* Rotary embedding of queries and keys, bitwise the runner's bf16 ops (x * cos and the
 * half-swapped x * signed sin, each rounded, then their rounded sum), widened to fp32: queries
 * into `queries` [b][t][heads][dim], keys and values into one layer's cache
 * [slots][2 * kv_heads][capacity][dim] at row starts[b] + t of slot slots[b]. qkv is
 * [b][t][heads + 2 * kv_heads][dim]; cos and sin (sign folded) are [b][t][dim]. */
void multiguess_bf16_rope_cache(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin,
                                float *queries, float *cache, const int64_t *slots,
                                const int64_t *starts, int64_t batch, int64_t width, int64_t heads,
                                int64_t kv_heads, int64_t dim, int64_t capacity) {
  const int64_t half = dim / 2, all = heads + 2 * kv_heads;
  for (int64_t b = 0; b < batch; b++) {
    float *slot = cache + slots[b] * 2 * kv_heads * capacity * dim;
    for (int64_t t = 0; t < width; t++) {
      const int64_t row = b * width + t;
      const uint16_t *c = cos + row * dim, *s = sin + row * dim;
      for (int64_t h = 0; h < all; h++) {
        const uint16_t *x = qkv + (row * all + h) * dim;
        float *out = h < heads ? queries + (row * heads + h) * dim
                               : slot + ((h - heads) * capacity + starts[b] + t) * dim;
        if (h >= heads + kv_heads) {
          for (int64_t d = 0; d < dim; d++) out[d] = widen(x[d]);
          continue;
        }
        for (int64_t d = 0; d < dim; d++) {
          const uint16_t other = d < half ? x[d + half] : x[d - half];
          out[d] = widen(narrow(widen(narrow(widen(x[d]) * widen(c[d]))) +
                                widen(narrow(widen(other) * widen(s[d])))));
        }
      }
    }
  }
}

/* One query head's attention over `length` cached keys and values (dim % 16 == 0, dim <= 256),
 * skipping keys its additive mask row hides (-inf). Keys are visited in cache order and hidden
 * ones add nothing, so the result depends only on the visible keys' values and order: a tree
 * node and the same token decoded alone get the same bits. */
static void attend(const float *q, const float *keys, const float *values, const float *mask,
                   int64_t length, int64_t dim, float scale, float *scores, uint16_t *out) {
  const int64_t blocks = dim / 16;
  float top = -INFINITY;
  for (int64_t j = 0; j < length; j++) {
    if (mask[j] == -INFINITY) {
      scores[j] = -INFINITY;
      continue;
    }
    const float *key = keys + j * dim;
    __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(key));
    for (int64_t c = 1; c < blocks; c++)
      dot = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), _mm512_loadu_ps(key + 16 * c), dot);
    scores[j] = _mm512_reduce_add_ps(dot) * scale + mask[j];
    top = scores[j] > top ? scores[j] : top;
  }
  const __m512 shift = _mm512_set1_ps(top);
  for (int64_t j = 0; j < length; j += 16) {
    const __mmask16 live = lanes(length - j);
    const __m512 s = _mm512_maskz_loadu_ps(live, scores + j);
    const __mmask16 shown = _mm512_mask_cmp_ps_mask(live, s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    _mm512_mask_storeu_ps(scores + j, live, _mm512_maskz_mov_ps(shown, exp_lanes(_mm512_sub_ps(s, shift))));
  }
  __m512 acc[16];
  for (int64_t c = 0; c < blocks; c++) acc[c] = _mm512_setzero_ps();
  float total = 0.0f;
  for (int64_t j = 0; j < length; j++) {
    if (scores[j] == 0.0f) continue;
    total += scores[j];
    const __m512 weight = _mm512_set1_ps(scores[j]);
    const float *value = values + j * dim;
    for (int64_t c = 0; c < blocks; c++) acc[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(value + 16 * c), acc[c]);
  }
  const __m512 inverse = _mm512_set1_ps(1.0f / total);
  for (int64_t c = 0; c < blocks; c++)
    _mm256_storeu_si256((__m256i *)(out + 16 * c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[c], inverse)));
}

/* Attention of fp32 queries [b][t][heads][dim] over one layer's cache [slots][2 * kv_heads]
 * [capacity][dim] (keys, then values) for sequence b's slot slots[b], rows [0, length), under
 * an additive mask [b][t][length] (0 or -inf); query head h reads key/value head h / (heads /
 * kv_heads). Output bf16 [b][t][heads * dim], the dtype the o projection takes. Returns -1 when
 * out of memory. */
int multiguess_attention(const float *queries, const float *cache, const int64_t *slots,
                         const float *mask, uint16_t *out, int64_t batch, int64_t width,
                         int64_t heads, int64_t kv_heads, int64_t dim, int64_t capacity,
                         int64_t length, float scale, int threads) {
  const int64_t group = heads / kv_heads, items = batch * width * heads;
  bool failed = false;
#pragma omp parallel num_threads(threads)
  {
    float *scores = malloc((size_t)(length + 16) * sizeof *scores);
    if (!scores) {
#pragma omp atomic write
      failed = true;
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; item++) {
      if (!scores) continue;
      const int64_t row = item / heads, h = item % heads, b = row / width;
      const float *slot = cache + slots[b] * 2 * kv_heads * capacity * dim;
      const float *keys = slot + (h / group) * capacity * dim;
      const float *values = slot + (kv_heads + h / group) * capacity * dim;
      attend(queries + item * dim, keys, values, mask + row * length, length, dim, scale, scores,
             out + item * dim);
    }
    free(scores);
  }
  return failed ? -1 : 0;
}

/* One decoder layer's packed weights and cache (bf16_kernel.py builds it once per layer). */
typedef struct {
  const uint16_t *input_norm, *post_norm; /* RMSNorm weights [d] */
  const uint16_t *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
  float *cache; /* [slots][2 * kv_heads][capacity][dim] */
  int64_t qkv_n, inter; /* q/k/v outputs, MLP intermediate size */
  float eps, post_eps, scale; /* the two norms' epsilons, the attention scale */
} multiguess_layer;

/* What the layers of one forward share: shapes, rotary tables, cache places, mask, scratch. */
typedef struct {
  const uint16_t *cos, *sin;
  const int64_t *slots, *starts;
  const float *mask;
  uint16_t *qkv, *attn, *gate_up, *h; /* [m][qkv_n], [m][heads * dim], [m][2 * inter], [m][d] */
  float *queries; /* [m][heads * dim] */
  int64_t batch, width, d, heads, kv_heads, dim, capacity, length;
  int threads;
  int amx; /* products on AMX tiles (multiguess_bf16_matmul) */
} multiguess_step;

/* A whole pre-norm SiLU-gated decoder layer on the residual stream x [m][d] (bf16, updated in
 * place), as the runner's per-op path computes it: the same kernels in the same order, so the
 * same bits, in one call instead of six (each call from Python costs more than a small
 * product's arithmetic). Returns -1 when out of memory. */
int multiguess_bf16_layer(const multiguess_layer *layer, const multiguess_step *step, uint16_t *x) {
  const int64_t m = step->batch * step->width, inner = step->heads * step->dim;
  const int threads = step->threads;
  if (multiguess_bf16_matmul(layer->qkv, x, layer->qkv_bias, step->qkv, m, step->d, layer->qkv_n, threads,
                             layer->input_norm, layer->eps, 0, NULL, step->amx))
    return -1;
  multiguess_bf16_rope_cache(step->qkv, step->cos, step->sin, step->queries, layer->cache, step->slots,
                             step->starts, step->batch, step->width, step->heads, step->kv_heads, step->dim,
                             step->capacity);
  if (multiguess_attention(step->queries, layer->cache, step->slots, step->mask, step->attn, step->batch,
                           step->width, step->heads, step->kv_heads, step->dim, step->capacity, step->length,
                           layer->scale, threads))
    return -1;
  if (multiguess_bf16_matmul(layer->o, step->attn, layer->o_bias, step->h, m, inner, step->d, threads, NULL, 0.0f,
                             0, x, step->amx))
    return -1;
  if (multiguess_bf16_matmul(layer->gate_up, step->h, layer->gate_up_bias, step->gate_up, m, step->d,
                             2 * layer->inter, threads, layer->post_norm, layer->post_eps, 0, NULL, step->amx))
    return -1;
  return multiguess_bf16_matmul(layer->down, step->gate_up, layer->down_bias, x, m, layer->inter, step->d, threads,
                                NULL, 0.0f, 1, step->h, step->amx);
}
