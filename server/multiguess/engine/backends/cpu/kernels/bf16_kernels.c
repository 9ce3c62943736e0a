/* bf16 kernels for a decode step on CPUs (bf16_kernel.py beside this folder).
 *
 * multiguess_bf16_matmul: y = x W^T (+ bias) with fp32 accumulation, optionally of RMSNorm(x)
 * or of silu(gate) * up, and plus a residual: the small ops around a decode step's
 * projections, done here instead of as a dozen framework calls each.
 *
 * The weight is packed once into panels of 64 output rows, [panels][K/2][64][2]: one panel is
 * one contiguous stream and each step of the inner loop reads 256 bytes of it, a pair of inputs
 * for each of 64 outputs. Every output accumulates its input pairs in order, in one fp32 lane,
 * from its bias (or zero); rows of x are independent of each other, so a row's result does not
 * depend on how many rows are computed with it. Panels are split between OpenMP threads (the
 * runtime torch itself uses when both link libgomp.so.1).
 *
 * The vector code is one header per instruction set, and the library is built once per set
 * (bf16_kernel.py: VARIANTS): isa_avx512.h multiplies bf16 pairs with vdpbf16ps and, where the
 * CPU has AMX tiles, with tdpbf16ps; isa_avx2.h widens bf16 to fp32 in registers and multiplies
 * with FMA, for CPUs without AVX512-BF16. Which product a process uses is chosen once, so a row
 * has one arithmetic everywhere in it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "layer_step.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

#define PANEL 64 /* output rows per packed panel (bf16_kernel.py: PANEL) */

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

#if defined(__AVX512BF16__)
#include "isa_avx512.h"
#else
#include "isa_avx2.h"
#endif

/* transformers' RMSNorm in bf16: weight * bf16(x * rsqrt(mean(x^2) + eps)), in fp32 inside. */
static void rms_norm_row(const uint16_t *x, const uint16_t *weight, float eps, int64_t k, uint16_t *out) {
  float partial[16] = {0};
  for (int64_t j = 0; j < k; j++) partial[j % 16] += widen(x[j]) * widen(x[j]);
  for (int width = 8; width > 0; width /= 2)
    for (int j = 0; j < width; j++) partial[j] += partial[j + width];
  const float scale = 1.0f / sqrtf(partial[0] / (float)k + eps);
  for (int64_t j = 0; j < k; j++) out[j] = narrow(widen(weight[j]) * widen(narrow(widen(x[j]) * scale)));
}

/* Linux hands AMX state to a process only when asked; 0 when this process may use the tiles. */
int multiguess_amx_enable(void) {
  if (!HAS_AMX) return -1;
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
  amx = HAS_AMX && amx && k % 32 == 0;
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
#if HAS_AMX
  if (amx) {
#pragma omp parallel num_threads(threads)
    {
      configure_tiles();
#pragma omp for schedule(static)
      for (int64_t p = 0; p < panels; p++)
        panel_product_amx(packed + p * k * PANEL, x, bias, residual, y, m, padded, k, n, p * PANEL);
      _tile_release();
    }
    free(prepared);
    return 0;
  }
#endif
  float *wide = NULL; /* x in fp32, where the product broadcasts fp32 inputs */
  if (widens_inputs(m)) {
    wide = malloc((size_t)(m * k) * sizeof *wide);
    if (!wide) {
      free(prepared);
      return -1;
    }
    for (int64_t i = 0; i < m * k; i++) wide[i] = widen(x[i]);
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t p = 0; p < panels; p++)
    panel_product(packed + p * k * PANEL, x, wide, bias, residual, y, m, k, n, p * PANEL);
  free(wide);
  free(prepared);
  return 0;
}

/* Rotary embedding of queries and keys, bitwise the runner's bf16 ops (x * cos and the
 * half-swapped x * signed sin, each rounded, then their rounded sum): queries widened to fp32
 * into `queries` [b][t][heads][dim], keys and values in bf16 (every one a bf16 value, so the
 * cache holds them exactly in half the bytes fp32 takes) into one layer's cache
 * [slots][2 * kv_heads][capacity][dim] at row starts[b] + t of slot slots[b]. qkv is
 * [b][t][heads + 2 * kv_heads][dim]; cos and sin (sign folded) are [b][t][dim]. */
void multiguess_bf16_rope_cache(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin,
                                float *queries, uint16_t *cache, const int64_t *slots,
                                const int64_t *starts, int64_t batch, int64_t width, int64_t heads,
                                int64_t kv_heads, int64_t dim, int64_t capacity) {
  const int64_t half = dim / 2, all = heads + 2 * kv_heads;
  for (int64_t b = 0; b < batch; b++) {
    uint16_t *slot = cache + slots[b] * 2 * kv_heads * capacity * dim;
    for (int64_t t = 0; t < width; t++) {
      const int64_t row = b * width + t;
      const uint16_t *c = cos + row * dim, *s = sin + row * dim;
      for (int64_t h = 0; h < all; h++) {
        const uint16_t *x = qkv + (row * all + h) * dim;
        float *query = h < heads ? queries + (row * heads + h) * dim : NULL;
        uint16_t *kept = h < heads ? NULL : slot + ((h - heads) * capacity + starts[b] + t) * dim;
        if (h >= heads + kv_heads) {
          memcpy(kept, x, (size_t)dim * sizeof *x);
          continue;
        }
        for (int64_t d = 0; d < dim; d++) {
          const uint16_t other = d < half ? x[d + half] : x[d - half];
          const uint16_t rotated =
              narrow(widen(narrow(widen(x[d]) * widen(c[d]))) + widen(narrow(widen(other) * widen(s[d]))));
          if (query)
            query[d] = widen(rotated);
          else
            kept[d] = rotated;
        }
      }
    }
  }
}

/* Query heads that share a key/value head, attended together at most this many at a time: each
 * key and value is read once for all of them, and their sums make independent chains. */
#define MAX_SHARED 4

/* Lanes [at, at + VLANES) of a group of keys: from `group`, where they were widened once for
 * the n > 1 heads that read them, else widened from the cache as they are read. */
static inline vec group_key(const float *group, const uint16_t *key, const int n, int64_t at) {
  return n > 1 ? vload(group + at) : vload_bf16(key + at);
}

/* The attention of n query heads q [n][dim] that read the same cached keys and values, over
 * `length` of them (dim % 16 == 0, dim <= 256), skipping keys their additive mask row hides
 * (-inf); scores [n][length + 16], out [n][dim]. Each head's arithmetic is that of the head
 * alone: keys are visited in cache order and hidden ones add nothing, so the result depends only
 * on the visible keys' values and order (a tree node and the same token decoded alone get the
 * same bits), never on which heads come along. Scores are taken VLANES keys at a time, their
 * dot products summed across lanes together (vsums: one order for every key, wherever it sits
 * in its group), instead of one horizontal sum a key. */
static inline __attribute__((always_inline)) void attend(const float *q, const uint16_t *keys, const uint16_t *values,
                                                         const float *mask, int64_t length, float scale,
                                                         float *scores, uint16_t *out, const int n,
                                                         const int64_t blocks) {
  const int64_t dim = blocks * VLANES, stride = length + 16;
  vec query[MAX_SHARED][256 / VLANES], highest[MAX_SHARED];
  for (int h = 0; h < n; h++) {
    highest[h] = vsplat(-INFINITY);
    for (int64_t c = 0; c < blocks; c++) query[h][c] = vload(q + h * dim + VLANES * c);
  }
  for (int64_t first = 0; first < length; first += VLANES) {
    const int64_t live = length - first < VLANES ? length - first : VLANES;
    bool shown = false;
    for (int64_t j = first; j < first + live; j++) shown |= mask[j] != -INFINITY;
    if (!shown) {
      for (int h = 0; h < n; h++)
        for (int64_t j = first; j < first + live; j++) scores[h * stride + j] = -INFINITY;
      continue;
    }
    const uint16_t *key = keys + first * dim;
    const vec hidden = vload_part(mask + first, live); /* past `length`: -inf, as hidden keys */
    float group[VLANES * 256] __attribute__((aligned(64))); /* the group's keys widened once, for n > 1 */
    if (n > 1)
      for (int64_t i = 0; i < live * blocks; i++) vstore(group + VLANES * i, vload_bf16(key + VLANES * i));
    for (int h = 0; h < n; h++) {
      vec dots[VLANES];
#pragma GCC unroll 16
      for (int i = 0; i < VLANES; i++) {
        dots[i] = vzero();
        if (i >= live) continue;
        dots[i] = vmul(query[h][0], group_key(group, key, n, i * dim));
        for (int64_t c = 1; c < blocks; c++)
          dots[i] = vfma(query[h][c], group_key(group, key, n, i * dim + VLANES * c), dots[i]);
      }
      const vec score = vhide(vadd(vmul(vsums(dots), vsplat(scale)), hidden), hidden);
      vstore(scores + h * stride + first, score); /* a row has room for a whole group past `length` */
      highest[h] = vmax(highest[h], score);
    }
  }
  for (int h = 0; h < n; h++) {
    const float top = vmax_lanes(highest[h]);
    for (int64_t j = 0; j < length; j += VLANES)
      exp_shifted(scores + h * stride + j, length - j < VLANES ? length - j : VLANES, top);
  }
  vec acc[MAX_SHARED][256 / VLANES];
  float total[MAX_SHARED];
  for (int h = 0; h < n; h++) {
    total[h] = 0.0f;
    for (int64_t c = 0; c < blocks; c++) acc[h][c] = vzero();
  }
  for (int64_t j = 0; j < length; j++) {
    const uint16_t *value = values + j * dim;
    bool weighed = false;
    for (int h = 0; h < n; h++) weighed |= scores[h * stride + j] != 0.0f;
    if (!weighed) continue;
    vec widened[256 / VLANES]; /* the value once for all n heads */
    for (int64_t c = 0; c < blocks; c++) widened[c] = vload_bf16(value + VLANES * c);
    for (int h = 0; h < n; h++) {
      const float weight = scores[h * stride + j];
      if (weight == 0.0f) continue;
      total[h] += weight;
      for (int64_t c = 0; c < blocks; c++) acc[h][c] = vfma(vsplat(weight), widened[c], acc[h][c]);
    }
  }
  for (int h = 0; h < n; h++) {
    const vec inverse = vsplat(1.0f / total[h]);
    for (int64_t c = 0; c < blocks; c++) vstore_bf16(out + h * dim + VLANES * c, vmul(acc[h][c], inverse));
  }
}

/* attend with the head count and the common head sizes' vector counts as constants, so the
 * sums stay in registers. */
#define ATTEND(n, blocks) attend(q, keys, values, mask, length, scale, scores, out, n, blocks)
#define HEADS(blocks)    \
  switch (n) {           \
    case 4:              \
      ATTEND(4, blocks); \
      break;             \
    case 3:              \
      ATTEND(3, blocks); \
      break;             \
    case 2:              \
      ATTEND(2, blocks); \
      break;             \
    default:             \
      ATTEND(1, blocks); \
  }
static void attend_heads(const float *q, const uint16_t *keys, const uint16_t *values, const float *mask,
                         int64_t length, int64_t dim, float scale, float *scores, uint16_t *out, int n) {
  switch (dim / VLANES) {
    case 4:
      HEADS(4);
      break;
    case 8:
      HEADS(8);
      break;
    default:
      HEADS(dim / VLANES);
  }
}
#undef HEADS
#undef ATTEND

/* Attention of fp32 queries [b][t][heads][dim] over one layer's bf16 cache [slots][2 * kv_heads]
 * [capacity][dim] (keys, then values, widened to fp32 as they are read) for sequence b's slot
 * slots[b], rows [0, length), under an additive mask [b][t][length] (0 or -inf); query head h
 * reads key/value head h / (heads / kv_heads). The heads of a key/value head go together,
 * `shared` at a time (as many as keep their sums in half the vector registers, at most
 * MAX_SHARED). Output bf16 [b][t][heads * dim], the dtype the o projection takes. The threads
 * take the rows in turn, not in halves: a prefill's later rows (and a longer sequence's) attend
 * over more keys. Returns -1 when out of memory. */
int multiguess_attention(const float *queries, const uint16_t *cache, const int64_t *slots,
                         const float *mask, uint16_t *out, int64_t batch, int64_t width,
                         int64_t heads, int64_t kv_heads, int64_t dim, int64_t capacity,
                         int64_t length, float scale, int threads) {
  const int64_t group = heads / kv_heads, fit = VREGISTERS / 2 / (dim / VLANES);
  const int64_t shared = fit < 1 ? 1 : fit > MAX_SHARED ? MAX_SHARED : fit;
  const int64_t chunks = (group + shared - 1) / shared, items = batch * width * kv_heads * chunks;
  bool failed = false;
#pragma omp parallel num_threads(threads)
  {
    float *scores = malloc((size_t)(MAX_SHARED * (length + 16)) * sizeof *scores);
    if (!scores) {
#pragma omp atomic write
      failed = true;
    }
#pragma omp for schedule(static, 1)
    for (int64_t item = 0; item < items; item++) {
      if (!scores) continue;
      const int64_t row = item / (kv_heads * chunks), kv = item / chunks % kv_heads, b = row / width;
      const int64_t skipped = item % chunks * shared, n = group - skipped < shared ? group - skipped : shared;
      const int64_t first = kv * group + skipped;
      const uint16_t *slot = cache + slots[b] * 2 * kv_heads * capacity * dim;
      const uint16_t *keys = slot + kv * capacity * dim, *values = slot + (kv_heads + kv) * capacity * dim;
      const int64_t at = (row * heads + first) * dim;
      attend_heads(queries + at, keys, values, mask + row * length, length, dim, scale, scores, out + at, (int)n);
    }
    free(scores);
  }
  return failed ? -1 : 0;
}

/* One decoder layer's packed weights and cache (bf16_kernel.py builds it once per layer). */
typedef struct {
  const uint16_t *input_norm, *post_norm; /* RMSNorm weights [d] */
  const uint16_t *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
  uint16_t *cache; /* bf16 [slots][2 * kv_heads][capacity][dim] */
  int64_t qkv_n, inter; /* q/k/v outputs, MLP intermediate size */
  float eps, post_eps, scale; /* the two norms' epsilons, the attention scale */
} multiguess_layer;


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
