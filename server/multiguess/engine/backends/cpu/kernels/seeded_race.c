/* Sampling over one row of logits on CPUs (engine/sampling.py): a seeded race over a whole row
 * (seeded_choice), and a truncated row's kept set and its race (kept_tokens).
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
#include <immintrin.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#define GOLDEN 0x9E3779B97F4A7C15ull
#define MIX1 0xBF58476D1CE4E5B9ull
#define MIX2 0x94D049BB133111EBull

static inline uint64_t splitmix(uint64_t key, uint64_t token) {
  uint64_t z = key + token * GOLDEN;
  z = (z ^ (z >> 30)) * MIX1;
  z = (z ^ (z >> 27)) * MIX2;
  return z ^ (z >> 31);
}

/* The uniform u = (k + 0.5) 2^-53 in (0, 1) of the top 53 bits k of a hash. */
static inline double uniform(uint64_t bits) { return ((double)(bits >> 11) + 0.5) * 0x1p-53; }

/* s - log(E) with E = -log(u). */
static inline double score(double s, uint64_t bits) { return s - log(-log(uniform(bits))); }

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

/* A truncated row's kept set (top-k, top-p) by engine/sampling.py's rule (kept_tokens): the
 * largest logits in rank order, tempered in double; their probabilities under the normaliser
 * (the log-sum-exp of the first top_k when top-k is on, else the whole row's); the nucleus,
 * cut where the mass before a rank reaches top_p, renormalised. Instead of a framework's topk,
 * softmax normaliser, cumsum and masks over the row: one pass for the largest logit, the
 * row's normaliser in fp32 lanes, one that collects the candidates within a few (tempered)
 * logits of the best, more while they do not hold the kept set, and ranks taken off a heap of
 * the candidates only until the cut. Returns how many tokens are kept (ids and probs written in rank
 * order), or -1 when the candidates do not hold the kept set or exceed `capacity` (a flat row:
 * the caller processes it whole), -2 without memory. Ties in a logit rank the lower id first. */

#define CANDIDATES 16.0 /* tempered logits below the best, at most: e^-16 of its mass, 1e-7 */

typedef struct {
  float value;
  int64_t id;
} ranked_logit;

static inline bool ranks_before(ranked_logit a, ranked_logit b) {
  return a.value > b.value || (a.value == b.value && a.id < b.id);
}

/* A heap of ranks[0, size) whose root ranks first: restore it below `at`. */
static void sift_down(ranked_logit *ranks, int64_t size, int64_t at) {
  for (;;) {
    int64_t first = at, left = 2 * at + 1, right = left + 1;
    if (left < size && ranks_before(ranks[left], ranks[first])) first = left;
    if (right < size && ranks_before(ranks[right], ranks[first])) first = right;
    if (first == at) return;
    const ranked_logit moved = ranks[at];
    ranks[at] = ranks[first], ranks[first] = moved;
    at = first;
  }
}

/* The heap's first rank, taken out of it. */
static ranked_logit pop_first(ranked_logit *ranks, int64_t *size) {
  const ranked_logit first = ranks[0];
  ranks[0] = ranks[--*size];
  sift_down(ranks, *size, 0);
  return first;
}

static float row_max(const float *logits, int64_t n) {
  __m256 best = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) best = _mm256_max_ps(best, _mm256_loadu_ps(logits + j));
  float lanes[8], top = -INFINITY;
  _mm256_storeu_ps(lanes, best);
  for (int k = 0; k < 8; k++) top = lanes[k] > top ? lanes[k] : top;
  for (; j < n; j++) top = logits[j] > top ? logits[j] : top;
  return top;
}

/* e^x in fp32 lanes for x <= 0: 2^k p(r), r = x - k ln2, a degree-6 polynomial (relative
 * error ~2e-7); 0 below -87. AVX2 alone (no FMA), which every variant of the library has. */
static inline __m256 exp_lanes(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(k, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(k, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 120));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 24));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 6));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(0.5f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* log sum exp(logit / temperature) over the whole row, whose largest logit is `top`. */
static double row_log_normaliser(const float *logits, int64_t n, double temperature, float top) {
  const __m256 shift = _mm256_set1_ps(top), inverse = _mm256_set1_ps((float)(1.0 / temperature));
  double total = 0.0;
  int64_t j = 0;
  while (j + 8 <= n) { /* fp32 partial sums of at most 1024 terms, added up in double */
    __m256 part = _mm256_setzero_ps();
    for (int64_t end = j + 1024 < n ? j + 1024 : n; j + 8 <= end; j += 8)
      part = _mm256_add_ps(part, exp_lanes(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(logits + j), shift), inverse)));
    float lanes[8];
    _mm256_storeu_ps(lanes, part);
    for (int k = 0; k < 8; k++) total += lanes[k];
  }
  for (; j < n; j++) total += exp(((double)logits[j] - top) / temperature);
  return (double)top / temperature + log(total);
}

/* The logits at or above `floor` into ranks (at most `capacity` of them); how many there are. */
static int64_t collect(const float *logits, int64_t n, float floor, ranked_logit *ranks, int64_t capacity) {
  const __m256 bar = _mm256_set1_ps(floor);
  int64_t count = 0, j = 0;
  for (; j + 8 <= n; j += 8) {
    unsigned mask = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(logits + j), bar, _CMP_GE_OQ));
    for (; mask; mask &= mask - 1, count++) {
      const int64_t id = j + __builtin_ctz(mask);
      if (count < capacity) ranks[count] = (ranked_logit){logits[id], id};
    }
  }
  for (; j < n; j++)
    if (logits[j] >= floor) {
      if (count < capacity) ranks[count] = (ranked_logit){logits[j], j};
      count++;
    }
  return count;
}

/* The nucleus of one set of candidates (a heap of `count`): ranks taken off it into ids and
 * tempered, cut where the mass before a rank reaches top_p; the number kept, or -1 when the
 * candidates run out first (or hold fewer than top_k). */
static int64_t nucleus(ranked_logit *ranks, int64_t count, double temperature, int64_t top_k, double top_p,
                       double normaliser, int64_t *ids, double *probs) {
  if (top_k > count) return -1;
  for (int64_t at = count / 2 - 1; at >= 0; at--) sift_down(ranks, count, at);
  int64_t ranked = 0;
  if (top_k > 0) {
    for (; ranked < top_k; ranked++) {
      const ranked_logit next = pop_first(ranks, &count);
      ids[ranked] = next.id, probs[ranked] = (double)next.value / temperature;
    }
    double total = 0.0;
    for (int64_t r = 0; r < ranked; r++) total += exp(probs[r] - probs[0]);
    normaliser = probs[0] + log(total);
    for (int64_t r = 0; r < ranked; r++) probs[r] = exp(probs[r] - normaliser);
  }
  double mass = 0.0;
  int64_t kept = 0;
  for (int64_t r = 0; kept == r; r++) { /* while the mass before a rank is short of top_p */
    if (r == ranked) {
      if (top_k > 0) break;
      if (count == 0) return -1;
      const ranked_logit next = pop_first(ranks, &count);
      ids[r] = next.id, probs[r] = exp((double)next.value / temperature - normaliser);
      ranked++;
    }
    mass += probs[r];
    if (mass - probs[r] < top_p) kept = r + 1;
  }
  double total = 0.0;
  for (int64_t r = 0; r < kept; r++) total += probs[r];
  for (int64_t r = 0; r < kept; r++) probs[r] /= total;
  return kept;
}

int64_t multiguess_kept(const float *logits, int64_t n, double temperature, int64_t top_k, double top_p,
                        int64_t capacity, int64_t *ids, double *probs) {
  const float top = row_max(logits, n);
  const double normaliser = top_k > 0 ? NAN : row_log_normaliser(logits, n, temperature, top);
  ranked_logit *ranks = malloc((size_t)capacity * sizeof *ranks);
  if (!ranks) return -2;
  int64_t kept = -1;
  for (double below = CANDIDATES / 4; below <= CANDIDATES && kept < 0; below *= 2) { /* more while short */
    const int64_t count = collect(logits, n, (float)((double)top - below * temperature), ranks, capacity);
    if (count > capacity) break;
    kept = nucleus(ranks, count, temperature, top_k, top_p, normaliser, ids, probs);
  }
  free(ranks);
  return kept;
}

/* The rank of a kept set's winner of the seeded race under `key`: the largest p / E, as
 * engine/sampling.py's race_top (ties: the first rank). */
int64_t multiguess_kept_race(const int64_t *ids, const double *probs, int64_t count, uint64_t key) {
  int64_t best_r = 0;
  double best = -1.0;
  for (int64_t r = 0; r < count; r++) {
    double value = probs[r] / -log(uniform(splitmix(key, (uint64_t)ids[r])));
    if (value > best) best = value, best_r = r;
  }
  return best_r;
}
