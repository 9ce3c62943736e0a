/* What the layers of one forward share, as the layer kernels read it: the bf16 library's
 * (multiguess_bf16_layer) and the quantized one's (multiguess_quant_layer); bf16_kernel.py's
 * StepPlaces builds it once per forward. */
#ifndef MULTIGUESS_LAYER_STEP_H
#define MULTIGUESS_LAYER_STEP_H
#include <stdint.h>

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

#endif
