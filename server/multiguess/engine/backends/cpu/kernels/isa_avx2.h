/* AVX2 + FMA vector code of bf16_kernels.c, for CPUs without AVX512-BF16 (AMD Zen 2 and 3,
 * Intel client cores): bf16 is widened to fp32 in registers, where the product of two bf16 is
 * exact, and accumulated by FMA in 8 fp32 lanes. A packed pair of inputs is one 32-bit lane, its
 * first input in the low half, so a shift and a mask widen the two without shuffling. The
 * weights stream at half their fp32 size, which is what a decode step waits for. */
#define HAS_AMX 0

static inline __m256 widen8(__m128i v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* Eight floats to bf16, rounded to nearest even like narrow() (NaN stays NaN). */
static inline __m128i narrow8(__m256 f) {
  const __m256i bits = _mm256_castps_si256(f);
  const __m256i high = _mm256_srli_epi32(bits, 16);
  const __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  const __m256i out = _mm256_blendv_epi8(rounded, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(out, out), 0xD8));
}

/* The first `live` (at most 8) bf16 at p, zero past them, and the store of as many. */
static inline __m128i load8(const uint16_t *p, int64_t live) {
  if (live >= 8) return _mm_loadu_si128((const __m128i *)p);
  uint16_t part[8] = {0};
  memcpy(part, p, (size_t)live * sizeof *p);
  return _mm_loadu_si128((const __m128i *)part);
}

static inline void store8(uint16_t *p, __m128i v, int64_t live) {
  if (live >= 8) {
    _mm_storeu_si128((__m128i *)p, v);
    return;
  }
  uint16_t part[8];
  _mm_storeu_si128((__m128i *)part, v);
  memcpy(p, part, (size_t)live * sizeof *p);
}

/* e^x in fp32 lanes: 2^n * p(r), r = x - n ln2, |r| <= ln2/2, a degree-6 polynomial (relative
 * error ~2e-7); 0 below -87, +inf above 88. */
static inline __m256 exp8(__m256 x) {
  const __m256 tiny = _mm256_set1_ps(-87.0f), huge = _mm256_set1_ps(88.0f);
  const __m256 underflow = _mm256_cmp_ps(x, tiny, _CMP_LT_OQ);
  const __m256 overflow = _mm256_cmp_ps(x, huge, _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, tiny), huge);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 poly = _mm256_set1_ps(1.0f / 720);
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.0f / 120));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.0f / 24));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.0f / 6));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(0.5f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.0f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.0f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 value = _mm256_andnot_ps(underflow, _mm256_mul_ps(poly, _mm256_castsi256_ps(scale)));
  return _mm256_blendv_ps(value, _mm256_set1_ps(INFINITY), overflow);
}

/* act(gate) * up in bf16, gate and up the two halves of a row: bf16(bf16(silu(gate)) * up),
 * silu(g) = g / (1 + e^-g) in fp32 as torch computes it (its exp may differ in the last bit). */
static void silu_mul_row(const uint16_t *gate_up, int64_t k, uint16_t *out) {
  for (int64_t j = 0; j < k; j += 8) {
    const int64_t live = k - j;
    const __m256 gate = widen8(load8(gate_up + j, live));
    const __m256 up = widen8(load8(gate_up + k + j, live));
    const __m256 silu = _mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate))));
    store8(out + j, narrow8(_mm256_mul_ps(widen8(narrow8(silu)), up)), live);
  }
}

/* One output row's 64 (`live`) fp32 sums of a panel, rounded to bf16 at y + at, plus the
 * residual there when given: bf16(residual + bf16(product)), as torch adds two bf16 tensors. */
static inline void store_row(const __m256 acc[8], const uint16_t *residual, uint16_t *y, int64_t at,
                             int64_t live) {
  for (int j = 0; j < 8 && 8 * j < live; j++) {
    __m128i out = narrow8(acc[j]);
    if (residual) out = narrow8(_mm256_add_ps(widen8(out), widen8(load8(residual + at + 8 * j, live - 8 * j))));
    store8(y + at + 8 * j, out, live - 8 * j);
  }
}

/* The four cache lines of one packed pair of a panel (64 outputs x 2 inputs, 256 bytes) into L2:
 * every line, not one in two (docs/ENGINE.md). */
static inline void prefetch_pair(const uint16_t *at) {
  for (int line = 0; line < 4; line++) _mm_prefetch((const char *)(at + 32 * line), _MM_HINT_T1);
}

/* Rows r and r + 1 of x against half a panel (outputs 32 * half ... + 31): four accumulators
 * per row, so that each widened weight feeds two rows' FMAs (the widening costs as much as an
 * FMA, and a tree's rows are what make a product compute-bound). */
static void pair_of_rows(const uint16_t *panel, const uint16_t *x, const __m256 start[8], int64_t pairs,
                         int64_t k, int64_t r, int half, __m256 acc[2][8]) {
  const __m256i odd_half = _mm256_set1_epi32((int)0xffff0000u);
  const uint16_t *x0 = x + r * k, *x1 = x0 + k;
  __m256 a0[4], a1[4];
  for (int j = 0; j < 4; j++) a0[j] = a1[j] = start[4 * half + j];
  const uint16_t *w = panel + 64 * half; /* four 8-output loads of 16 bf16 each */
  for (int64_t p = 0; p < pairs; p++, w += 2 * PANEL) {
    /* The first half's pass requests all four lines of a pair into L2, where the second finds
     * them; meanwhile the second requests the next panel, so the memory never waits. */
    const uint16_t *ahead = half == 0 ? w + PREFETCH : w - 64 + pairs * 2 * PANEL;
    prefetch_pair(ahead);
    const __m256 even0 = _mm256_set1_ps(widen(x0[2 * p])), odd0 = _mm256_set1_ps(widen(x0[2 * p + 1]));
    const __m256 even1 = _mm256_set1_ps(widen(x1[2 * p])), odd1 = _mm256_set1_ps(widen(x1[2 * p + 1]));
    for (int j = 0; j < 4; j++) {
      const __m256i both = _mm256_loadu_si256((const __m256i *)(w + 16 * j));
      const __m256 low = _mm256_castsi256_ps(_mm256_slli_epi32(both, 16));
      const __m256 high = _mm256_castsi256_ps(_mm256_and_si256(both, odd_half));
      a0[j] = _mm256_fmadd_ps(odd0, high, _mm256_fmadd_ps(even0, low, a0[j]));
      a1[j] = _mm256_fmadd_ps(odd1, high, _mm256_fmadd_ps(even1, low, a1[j]));
    }
  }
  for (int j = 0; j < 4; j++) {
    acc[0][4 * half + j] = a0[j];
    acc[1][4 * half + j] = a1[j];
  }
}

/* Row r of x against the whole panel: eight accumulators, one contiguous stream (a decode
 * step's single row waits on memory, not on arithmetic). */
static void one_row(const uint16_t *panel, const uint16_t *x, const __m256 start[8], int64_t pairs, int64_t k,
                    int64_t r, __m256 acc[8]) {
  const __m256i odd_half = _mm256_set1_epi32((int)0xffff0000u);
  const uint16_t *xr = x + r * k;
  for (int j = 0; j < 8; j++) acc[j] = start[j];
  const uint16_t *w = panel;
  for (int64_t p = 0; p < pairs; p++, w += 2 * PANEL) {
    prefetch_pair(w + PREFETCH);
    const __m256 even = _mm256_set1_ps(widen(xr[2 * p]));
    const __m256 odd = _mm256_set1_ps(widen(xr[2 * p + 1]));
    for (int j = 0; j < 8; j++) {
      const __m256i both = _mm256_loadu_si256((const __m256i *)(w + 16 * j));
      acc[j] = _mm256_fmadd_ps(even, _mm256_castsi256_ps(_mm256_slli_epi32(both, 16)), acc[j]);
      acc[j] = _mm256_fmadd_ps(odd, _mm256_castsi256_ps(_mm256_and_si256(both, odd_half)), acc[j]);
    }
  }
}

#define WIDE_ROWS 8 /* rows from which a panel is widened once and shared (docs/ENGINE.md) */
#define SLICE 128    /* inputs per widened slice: 64 outputs x 128 fp32, 32 KiB, one L1 */
#define BLOCK 6      /* rows per pass over a slice's 16-output tile: 12 accumulators */
#define GROUP 24     /* rows whose sums are kept while a slice is in L1 */

/* Whether x is widened to fp32 for this many rows (bf16_kernels.c passes it as `wide`). */
static inline bool widens_inputs(int64_t m) { return m >= WIDE_ROWS; }

/* Pairs [from, from + count) of a panel as fp32 in four tiles of 16 outputs, [4][SLICE][16]
 * (tile-major, so a tile's inputs are one contiguous stream). */
static void widen_slice(const uint16_t *panel, int64_t from, int64_t count, float *slice) {
  const __m256i odd_half = _mm256_set1_epi32((int)0xffff0000u);
  for (int64_t p = 0; p < count; p++) {
    const uint16_t *w = panel + (from + p) * 2 * PANEL;
    prefetch_pair(w + PREFETCH);
    for (int j = 0; j < 8; j++) {
      const __m256i both = _mm256_loadu_si256((const __m256i *)(w + 16 * j));
      float *at = slice + (j / 2) * SLICE * 16 + 2 * p * 16 + (j % 2) * 8;
      _mm256_storeu_ps(at, _mm256_castsi256_ps(_mm256_slli_epi32(both, 16)));
      _mm256_storeu_ps(at + 16, _mm256_castsi256_ps(_mm256_and_si256(both, odd_half)));
    }
  }
}

/* `rows` (at most BLOCK) rows of fp32 x, k apart, against one widened tile of `inputs` inputs:
 * sums [rows][64] (16 of them, at sums) go on from where they stand, an FMA per input in order.
 * Inlined with a constant `rows`, its 2 * rows accumulators stay in registers. */
static inline __attribute__((always_inline)) void block_product(const float *tile, const float *x, int64_t k,
                                                                int64_t inputs, float *sums, const int rows) {
  __m256 acc[BLOCK][2];
  for (int r = 0; r < rows; r++) {
    acc[r][0] = _mm256_loadu_ps(sums + 64 * r);
    acc[r][1] = _mm256_loadu_ps(sums + 64 * r + 8);
  }
  for (int64_t i = 0; i < inputs; i++) {
    const __m256 w0 = _mm256_loadu_ps(tile + 16 * i), w1 = _mm256_loadu_ps(tile + 16 * i + 8);
    for (int r = 0; r < rows; r++) {
      const __m256 xv = _mm256_broadcast_ss(x + r * k + i);
      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < rows; r++) {
    _mm256_storeu_ps(sums + 64 * r, acc[r][0]);
    _mm256_storeu_ps(sums + 64 * r + 8, acc[r][1]);
  }
}

static void block_product_any(const float *tile, const float *x, int64_t k, int64_t inputs, float *sums,
                              int64_t rows) {
  switch (rows) {
    case 1: block_product(tile, x, k, inputs, sums, 1); break;
    case 2: block_product(tile, x, k, inputs, sums, 2); break;
    case 3: block_product(tile, x, k, inputs, sums, 3); break;
    case 4: block_product(tile, x, k, inputs, sums, 4); break;
    case 5: block_product(tile, x, k, inputs, sums, 5); break;
    default: block_product(tile, x, k, inputs, sums, BLOCK); break;
  }
}

/* Rows [r0, r0 + rows) (at most GROUP) of fp32 x against a panel, a widened slice at a time: the
 * weight is widened once per slice for all of them, and each tile of it then feeds BLOCK rows'
 * FMAs per load, which is what a tree's rows need from a CPU without bf16 arithmetic. */
static void group_product(const uint16_t *panel, const float *wide, const __m256 start[8],
                          const uint16_t *residual, uint16_t *y, int64_t rows, int64_t r0, int64_t k,
                          int64_t n, int64_t first, int64_t live, float *slice) {
  float sums[GROUP][64];
  for (int64_t r = 0; r < rows; r++)
    for (int j = 0; j < 8; j++) _mm256_storeu_ps(sums[r] + 8 * j, start[j]);
  for (int64_t from = 0; from < k / 2; from += SLICE / 2) {
    const int64_t count = k / 2 - from < SLICE / 2 ? k / 2 - from : SLICE / 2;
    widen_slice(panel, from, count, slice);
    for (int t = 0; t < 4; t++)
      for (int64_t b = 0; b < rows; b += BLOCK)
        block_product_any(slice + t * SLICE * 16, wide + (r0 + b) * k + 2 * from, k, 2 * count,
                          sums[b] + 16 * t, rows - b < BLOCK ? rows - b : BLOCK);
  }
  for (int64_t r = 0; r < rows; r++) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_loadu_ps(sums[r] + 8 * j);
    store_row(acc, residual, y, (r0 + r) * n + first, live);
  }
}

/* A panel's 64 outputs for every row of x: from WIDE_ROWS rows in groups over widened slices
 * (`wide` is x in fp32), below that two rows at a time and the last odd one alone. Every output
 * sums its inputs in order from its bias, one FMA each, whichever path computes it, so a row's
 * bits do not depend on how many rows came with it. */
static void panel_product(const uint16_t *panel, const uint16_t *x, const float *wide, const uint16_t *bias,
                          const uint16_t *residual, uint16_t *y, int64_t m, int64_t k, int64_t n,
                          int64_t first) {
  const int64_t pairs = k / 2;
  const int64_t live = n - first < PANEL ? n - first : PANEL;
  __m256 start[8];
  for (int j = 0; j < 8; j++)
    start[j] = bias && 8 * j < live ? widen8(load8(bias + first + 8 * j, live - 8 * j)) : _mm256_setzero_ps();
  if (wide) {
    float slice[4 * SLICE * 16] __attribute__((aligned(32)));
    for (int64_t r0 = 0; r0 < m; r0 += GROUP)
      group_product(panel, wide, start, residual, y, m - r0 < GROUP ? m - r0 : GROUP, r0, k, n, first, live,
                    slice);
    return;
  }
  int64_t r = 0;
  for (; r + 1 < m; r += 2) {
    __m256 acc[2][8];
    pair_of_rows(panel, x, start, pairs, k, r, 0, acc);
    pair_of_rows(panel, x, start, pairs, k, r, 1, acc);
    store_row(acc[0], residual, y, r * n + first, live);
    store_row(acc[1], residual, y, (r + 1) * n + first, live);
  }
  if (r < m) {
    __m256 acc[8];
    one_row(panel, x, start, pairs, k, r, acc);
    store_row(acc, residual, y, r * n + first, live);
  }
}

/* What attention (bf16_kernels.c: attend) computes with: VLANES fp32 lanes. */
#define VLANES 8
typedef __m256 vec;
#define VREGISTERS 16 /* vector registers */
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vec vload_bf16(const uint16_t *p) { return widen8(_mm_loadu_si128((const __m128i *)p)); }
static inline vec vsplat(float f) { return _mm256_set1_ps(f); }
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline float vmax_lanes(vec v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline void vstore_bf16(uint16_t *out, vec v) { _mm_storeu_si128((__m128i *)out, narrow8(v)); }

/* Lane i: the sum of v[i]'s lanes, for each of 8 vectors, added in one order for every i
 * (halves, then pairs), so a sum does not depend on its vector's place among the 8. */
static inline vec vsums(const vec v[8]) {
  __m256 halves[4], pairs[2];
  for (int i = 0; i < 4; i++) /* [v[2i]: 4 sums of 2 | v[2i + 1]: 4 sums of 2] */
    halves[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                              _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  for (int i = 0; i < 2; i++) /* [v[4i]: 2 sums of 4, v[4i + 2]: 2 | v[4i + 1]: 2, v[4i + 3]: 2] */
    pairs[i] = _mm256_add_ps(_mm256_shuffle_ps(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  /* [the sums of v[0], v[2], v[4], v[6] | v[1], v[3], v[5], v[7]]; then back in order */
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* p[0, live) (live <= 8), -inf past it. */
static inline vec vload_part(const float *p, int64_t live) {
  float part[8];
  for (int i = 0; i < 8; i++) part[i] = i < live ? p[i] : -INFINITY;
  return _mm256_loadu_ps(part);
}

/* v, and -inf where `mask` is -inf (a hidden key). */
static inline vec vhide(vec v, vec mask) {
  return _mm256_blendv_ps(v, mask, _mm256_cmp_ps(mask, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
}

/* scores[j, j + live) (live <= 8) as e^(s - top), those at -inf (hidden keys) as 0. */
static inline void exp_shifted(float *scores, int64_t live, float top) {
  float part[8] = {0};
  memcpy(part, scores, (size_t)live * sizeof *scores);
  const __m256 s = _mm256_loadu_ps(part);
  const __m256 shown = _mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
  _mm256_storeu_ps(part, _mm256_and_ps(shown, exp8(_mm256_sub_ps(s, _mm256_set1_ps(top)))));
  memcpy(scores, part, (size_t)live * sizeof *scores);
}
