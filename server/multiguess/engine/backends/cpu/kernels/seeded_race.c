/* Seeded sampling's race over one row of logits (engine/sampling.py: seeded_choice).
 *
 * A seeded request draws the token of position t by an exponential race: token j wins with the
 * largest p_j / E_j, where E_j = -log(u_j) and u_j comes from splitmix64 of the position's key
 * and j (sampling.position_noise). Taken in log space the winner is the argmax of
 * s_j - log(E_j) with s_j = logit_j / temperature: no softmax, and the normaliser drops out.
 * The two logarithms are the cost, and almost every token cannot win: since E_j >= 1 - u_j,
 * s_j - log(1 - u_j) bounds its score, and 1 - u_j's binary exponent bounds that logarithm
 * with integer arithmetic, so only the few tokens whose bound reaches the best score so far
 * are scored exactly. The scores of those are the reference's (same operations in double),
 * and ties go to the lowest index, as torch.argmax breaks them.
 */
#include <math.h>
#include <stdint.h>

#define GOLDEN 0x9E3779B97F4A7C15ull
#define MIX1 0xBF58476D1CE4E5B9ull
#define MIX2 0x94D049BB133111EBull

static inline uint64_t splitmix(uint64_t key, uint64_t token) {
  uint64_t z = key + token * GOLDEN;
  z = (z ^ (z >> 30)) * MIX1;
  z = (z ^ (z >> 27)) * MIX2;
  return z ^ (z >> 31);
}

/* s - log(E) with E = -log(u), u = (k + 0.5) 2^-53 for the top 53 bits k of the hash. */
static inline double score(double s, uint64_t bits) {
  double u = ((double)(bits >> 11) + 0.5) * 0x1p-53;
  return s - log(-log(u));
}

/* An upper bound of score(s, bits): 1 - u = (m - 0.5) 2^-53 >= m 2^-54 with m = 2^53 - k >= 1,
 * so -log(1 - u) <= (54 - floor(log2 m)) log 2. */
static inline double bound(double s, uint64_t bits) {
  uint64_t m = (1ull << 53) - (bits >> 11);
  int floor_log2 = 63 - __builtin_clzll(m);
  return s + (54 - floor_log2) * M_LN2;
}

int64_t multiguess_seeded_argmax(const float *logits, int64_t n, double temperature, uint64_t key) {
  int64_t best_j = 0;
  for (int64_t j = 1; j < n; j++)
    if (logits[j] > logits[best_j]) best_j = j;
  /* The likeliest token's score starts the bar high, so that few others need scoring. */
  double best = score((double)logits[best_j] / temperature, splitmix(key, (uint64_t)best_j));
  for (int64_t j = 0; j < n; j++) {
    uint64_t bits = splitmix(key, (uint64_t)j);
    double s = (double)logits[j] / temperature;
    if (bound(s, bits) < best - 1e-9 * (1.0 + fabs(best))) continue; /* margin: rounding */
    double value = score(s, bits);
    if (value > best || (value == best && j < best_j)) {
      best = value;
      best_j = j;
    }
  }
  return best_j;
}
