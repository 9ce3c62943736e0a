/* AVX512-BF16 (and AMX) vector code of bf16_kernels.c: bf16 pairs multiplied by vdpbf16ps,
 * 16 fp32 lanes; on CPUs with AMX tiles the same panels also feed tdpbf16ps, 16 rows of x at a
 * time: a decode step streams the weights as fast as vdpbf16ps, and a tree's extra rows ride on
 * the same loads nearly free, where vdpbf16ps pays for every row. */
#define HAS_AMX 1
#define ROWS 6 /* rows of x per pass over a panel: 24 accumulators in registers */

static inline __mmask16 lanes(int64_t live) {
  return live >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << live) - 1);
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

/* vdpbf16ps multiplies bf16 pairs as they are: x is never widened here. */
static inline bool widens_inputs(int64_t m) {
  (void)m;
  return false;
}

static void panel_product(const uint16_t *panel, const uint16_t *x, const float *wide, const uint16_t *bias,
                          const uint16_t *residual, uint16_t *y, int64_t m, int64_t k, int64_t n,
                          int64_t first) {
  (void)wide;
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


/* What attention (bf16_kernels.c: attend) computes with: VLANES fp32 lanes. */
#define VLANES 16
typedef __m512 vec;
#define VREGISTERS 32 /* vector registers */
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vload_bf16(const uint16_t *p) { return widen_lanes(_mm256_loadu_si256((const __m256i *)p)); }
static inline vec vsplat(float f) { return _mm512_set1_ps(f); }
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline float vmax_lanes(vec v) { return _mm512_reduce_max_ps(v); }

/* Lane i: the sum of v[i]'s lanes, for each of 16 vectors, added in one order for every i
 * (halves, quarters, then pairs: _mm512_reduce_add_ps's order), so a sum does not depend on
 * its vector's place among the 16. */
static inline vec vsums(const vec v[16]) {
  __m512 halves[8], quarters[4], pairs[2];
  for (int i = 0; i < 8; i++) /* [v[2i]: 8 sums of 2 | v[2i + 1]: 8 sums of 2] */
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; i++) /* 128-bit chunk c: v[4i + c]'s 4 sums of 4 */
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; i++) /* chunk c: 2 sums of 8 of v[8i + c], then of v[8i + 4 + c] */
    pairs[i] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  /* chunk c: the sums of v[c], v[4 + c], v[8 + c], v[12 + c]; then back in order */
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}
static inline void vstore_bf16(uint16_t *out, vec v) { _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(v)); }

/* p[0, live) (live <= 16), -inf past it. */
static inline vec vload_part(const float *p, int64_t live) {
  return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes(live), p);
}

/* v, and -inf where `mask` is -inf (a hidden key). */
static inline vec vhide(vec v, vec mask) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mask, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), v, mask);
}

/* scores[j, j + live) (live <= 16) as e^(s - top), those at -inf (hidden keys) as 0. */
static inline void exp_shifted(float *scores, int64_t live, float top) {
  const __mmask16 mask = lanes(live);
  const __m512 s = _mm512_maskz_loadu_ps(mask, scores);
  const __mmask16 shown = _mm512_mask_cmp_ps_mask(mask, s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
  _mm512_mask_storeu_ps(scores, mask, _mm512_maskz_mov_ps(shown, exp_lanes(_mm512_sub_ps(s, _mm512_set1_ps(top)))));
}
