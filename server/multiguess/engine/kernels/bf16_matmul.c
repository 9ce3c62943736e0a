/* y = x W^T (+ bias) in bf16 with fp32 accumulation, for CPUs with AVX512-BF16.
 *
 * The weight is packed once into panels of 64 output rows, [panels][K/2][64][2]: one panel is
 * one contiguous stream and each step of the inner loop reads 256 bytes of it, the pairs of
 * inputs that vdpbf16ps multiplies. Every output accumulates its input pairs in order, in one
 * fp32 lane, from its bias (or zero); rows of x are independent of each other, so a row's
 * result does not depend on how many rows are computed with it. Panels are split between
 * OpenMP threads (the runtime torch itself uses when both link libgomp.so.1).
 */
#include <immintrin.h>
#include <stdint.h>

#define PANEL 64
#define ROWS 6 /* rows of x per pass over a panel: 24 accumulators in registers */

static void panel_product(const uint16_t *panel, const uint16_t *x, const uint16_t *bias,
                          uint16_t *y, int64_t m, int64_t k, int64_t n, int64_t first) {
  const int64_t pairs = k / 2;
  int64_t live = n - first < PANEL ? n - first : PANEL;
  __m512 start[4];
  for (int j = 0; j < 4; j++) {
    start[j] = _mm512_setzero_ps();
    int64_t lane0 = first + 16 * j;
    if (bias && lane0 < n) {
      __mmask16 mask = live - 16 * j >= 16 ? 0xFFFF : (__mmask16)((1u << (live - 16 * j)) - 1);
      __m256i b16 = _mm256_maskz_loadu_epi16(mask, bias + lane0);
      start[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b16), 16));
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
    for (int64_t i = 0; i < rows; i++) {
      uint16_t *out = y + (r0 + i) * n + first;
      for (int j = 0; j < 4 && 16 * j < live; j++) {
        __mmask16 mask = live - 16 * j >= 16 ? 0xFFFF : (__mmask16)((1u << (live - 16 * j)) - 1);
        _mm256_mask_storeu_epi16(out + 16 * j, mask, (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
      }
    }
  }
}

/* x: [m][k] bf16, packed: [ceil(n / 64)][k/2][64][2] bf16 (zero rows past n), bias: [n] or NULL,
 * y: [m][n] bf16. k must be even. */
void multiguess_bf16_matmul(const uint16_t *packed, const uint16_t *x, const uint16_t *bias,
                            uint16_t *y, int64_t m, int64_t k, int64_t n, int threads) {
  const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t p = 0; p < panels; p++)
    panel_product(packed + p * k * PANEL, x, bias, y, m, k, n, p * PANEL);
}
