// Batched token sampling for the rows of a logits matrix (included by cpu_ops.cpp).
//
// One task per row, all rows of a step in one call, each pass over the vocabulary vectorized:
//   greedy rows   (inv_temp 0) the first maximal logit;
//   exponentiate  e_i = exp((x_i - max) / T), 0 for -inf logits; max e is 1, so min-p is the
//                 plain threshold e >= min_p;
//   top-k         the k-th largest e, by nth_element over the candidates at or above a level
//                 that holds k to about 4k tokens, bisected on e's bit pattern; tokens tied at
//                 the cut all stay;
//   draw          inverse CDF in vocabulary order over the kept tokens: the first whose running
//                 mass exceeds u times the kept mass;
//   top-p         by rejection, without sorting or selecting (as FlashInfer samples): draw from
//                 the survivors of min-p and top-k that lie above a pivot; accept the token if
//                 the survivors strictly above it hold less than p of the survivors' mass (it
//                 is then in the top-p set, ties included); else raise the pivot to it (nothing
//                 at or below it is in the set) and draw again. Every proposal is a sample of a
//                 superset of the top-p set, so an accepted one is exact; the first is accepted
//                 with probability >= p.
// u for draw r of a row is splitmix64(key + r * golden) scaled to [0, 1): the caller gives each
// row a 64-bit key, a pure function of (seed, token index) for a seeded row, so its token does
// not depend on the batch or the instance.
#pragma once

namespace sampling {

constexpr int64_t kBlock = 64;  // the draw's running sum advances a block at a time
constexpr int kMaxDraws = 64;   // top-p rejection rounds before taking the pivot's cut exactly

struct Scratch {
  std::vector<float> e, values;
};

inline double uniform(uint64_t key, int round) {
  uint64_t z = key + static_cast<uint64_t>(round) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1p-53;
}

inline float row_max(const float* x, int64_t n) {
#if defined(__AVX512F__)  // gcc left the generic loop scalar where it was inlined
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 keep = bf16_rows::tail_mask(n, i);
    m = _mm512_mask_max_ps(m, keep, m, _mm512_maskz_loadu_ps(keep, x + i));
  }
  return _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)  // likewise (gcc 12 keeps even 8 explicit lanes scalar)
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float top = *std::max_element(lanes, lanes + 8);
  for (; i < n; ++i) top = std::max(top, x[i]);
  return top;
#else
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
#endif
}

// The first maximal element, in one pass: each lane keeps its largest value and the first
// index holding it; the lanes are reduced at the end (NaN or -inf everywhere: 0).
inline int64_t argmax(const float* x, int64_t n) {
#if defined(__AVX512F__)
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i best_at = _mm512_setzero_si512(), at = _mm512_set_epi32(
      15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i step = _mm512_set1_epi32(16);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16, at = _mm512_add_epi32(at, step)) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 more = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, more, v);
    best_at = _mm512_mask_mov_epi32(best_at, more, at);
  }
  alignas(64) float values[16];
  alignas(64) int32_t index[16];
  _mm512_store_ps(values, best);
  _mm512_store_si512(index, best_at);
  float top = -std::numeric_limits<float>::infinity();
  int64_t top_at = 0;
  for (int l = 0; l < 16; ++l)
    if (values[l] > top || (values[l] == top && index[l] < top_at)) {
      top = values[l];
      top_at = index[l];
    }
  for (; i < n; ++i)
    if (x[i] > top) {
      top = x[i];
      top_at = i;
    }
  return top_at;
#else
  float top = -std::numeric_limits<float>::infinity();
  int64_t top_at = 0;
  for (int64_t i = 0; i < n; ++i)
    if (x[i] > top) {
      top = x[i];
      top_at = i;
    }
  return top_at;
#endif
}

#if defined(__AVX512F__)
inline double reduce_pd(__m512d a, __m512d b) { return _mm512_reduce_add_pd(_mm512_add_pd(a, b)); }

// a += the low 8 lanes of v, b += the high 8, in float64.
inline void add_pd(__m512 v, __m512d& a, __m512d& b) {
  a = _mm512_add_pd(a, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
  b = _mm512_add_pd(b, _mm512_cvtps_pd(_mm256_castpd_ps(
                           _mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}

// 2^x for x <= 0 on 16 lanes: 2^round(x) by VSCALEFPS times 2^f, f in [-1/2, 1/2], by its
// degree-6 Taylor polynomial (relative error about 1.2e-7, float32's own). Fewer operations
// than exp16's clamps and two-step range reduction: the exp pass is most of a sampled row.
inline __m512 exp2_16(__m512 x) {
  const __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, k);
  __m512 p = _mm512_set1_ps(1.5403530393e-4f);           // ln2^6 / 6!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146e-3f));  // ln2^5 / 5!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));  // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));  // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));  // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));  // ln2
  return _mm512_scalef_ps(_mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f)), k);
}

// e = exp((x - mx) * inv_temp), 0 where x is -inf; returns the sum of e.
inline double exponentiate(const float* x, int64_t n, float mx, float inv_temp, float* e) {
  constexpr float kLog2e = 1.44269504088896341f;
  const __m512 scale = _mm512_set1_ps(inv_temp * kLog2e);
  const __m512 shift = _mm512_set1_ps(-mx * inv_temp * kLog2e);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512d a = _mm512_setzero_pd(), b = _mm512_setzero_pd();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = bf16_rows::tail_mask(n, i);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    const __mmask16 finite = _mm512_mask_cmp_ps_mask(m, v, neg_inf, _CMP_NEQ_OQ);
    const __m512 ex = _mm512_maskz_mov_ps(finite, exp2_16(_mm512_fmadd_ps(v, scale, shift)));
    _mm512_mask_storeu_ps(e + i, m, ex);
    add_pd(ex, a, b);
  }
  return reduce_pd(a, b);
}

// Mass of the values > above and >= cut.
inline double mass(const float* e, int64_t n, float cut, float above) {
  const __m512 cut_v = _mm512_set1_ps(cut), above_v = _mm512_set1_ps(above);
  __m512d a = _mm512_setzero_pd(), b = _mm512_setzero_pd();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = bf16_rows::tail_mask(n, i);
    const __m512 v = _mm512_maskz_loadu_ps(m, e + i);
    const __mmask16 keep = _mm512_mask_cmp_ps_mask(
        _mm512_cmp_ps_mask(v, cut_v, _CMP_GE_OQ), v, above_v, _CMP_GT_OQ);
    add_pd(_mm512_maskz_mov_ps(keep, v), a, b);
  }
  return reduce_pd(a, b);
}

// Sum of the values >= cut and > above among [start, stop), stop - start <= kBlock.
inline float block_mass(const float* e, int64_t start, int64_t stop, float cut, float above) {
  const __m512 cut_v = _mm512_set1_ps(cut), above_v = _mm512_set1_ps(above);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = start; i < stop; i += 16) {
    const __mmask16 m = bf16_rows::tail_mask(stop, i);
    const __m512 v = _mm512_maskz_loadu_ps(m, e + i);
    const __mmask16 keep = _mm512_mask_cmp_ps_mask(
        _mm512_cmp_ps_mask(v, cut_v, _CMP_GE_OQ), v, above_v, _CMP_GT_OQ);
    sum = _mm512_mask_add_ps(sum, keep, sum, v);
  }
  return _mm512_reduce_add_ps(sum);
}
#else
inline double exponentiate(const float* x, int64_t n, float mx, float inv_temp, float* e) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  double total = 0.0;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) {
    e[i] = x[i] == neg_inf ? 0.f : fast_exp((x[i] - mx) * inv_temp);
    total += e[i];
  }
  return total;
}

inline double mass(const float* e, int64_t n, float cut, float above) {
  double total = 0.0;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) total += (e[i] >= cut && e[i] > above) ? e[i] : 0.f;
  return total;
}

inline float block_mass(const float* e, int64_t start, int64_t stop, float cut, float above) {
  float block = 0.f;
#pragma omp simd reduction(+ : block)
  for (int64_t i = start; i < stop; ++i) block += (e[i] >= cut && e[i] > above) ? e[i] : 0.f;
  return block;
}
#endif

#if defined(__AVX512F__)
inline int64_t count_at_least(const float* e, int64_t n, float level) {
  const __m512 level_v = _mm512_set1_ps(level);
  int64_t count = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = bf16_rows::tail_mask(n, i);
    count += __builtin_popcount(
        _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, e + i), level_v, _CMP_GE_OQ));
  }
  return count;
}

// The values >= lower, packed (compressed in registers: a compress straight to memory is
// microcoded and slow on Zen 4).
inline void at_least(const float* e, int64_t n, float lower, std::vector<float>& values) {
  values.resize(n + 16);
  const __m512 lower_v = _mm512_set1_ps(lower);
  int64_t count = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = bf16_rows::tail_mask(n, i);
    const __m512 v = _mm512_maskz_loadu_ps(m, e + i);
    const __mmask16 keep = _mm512_mask_cmp_ps_mask(m, v, lower_v, _CMP_GE_OQ);
    _mm512_storeu_ps(values.data() + count, _mm512_maskz_compress_ps(keep, v));
    count += __builtin_popcount(keep);
  }
  values.resize(count);
}
#else
inline int64_t count_at_least(const float* e, int64_t n, float level) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) count += e[i] >= level;
  return count;
}

inline void at_least(const float* e, int64_t n, float lower, std::vector<float>& values) {
  values.clear();
  for (int64_t i = 0; i < n; ++i)
    if (e[i] >= lower) values.push_back(e[i]);
}
#endif

// The k-th largest e (0 < k < n), selecting among the values at or above a level that holds
// k to about 4k of them. The level is bisected on the bit pattern of e in [0, 1] (ordered like
// the values, and geometric, so peaked rows find their level as fast as flat ones).
inline float kth_largest(const float* e, int64_t n, int64_t k, std::vector<float>& values) {
  uint32_t lo = 0, hi = 0x3F800000u;  // bits of 0 (holds all n >= k) and of 1.0 (the max)
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    float level;
    std::memcpy(&level, &mid, sizeof(level));
    const int64_t count = count_at_least(e, n, level);
    if (count < k) {
      hi = mid;
      continue;
    }
    lo = mid;
    if (count <= 4 * k + 64) break;
  }
  float lower;
  std::memcpy(&lower, &lo, sizeof(lower));
  at_least(e, n, lower, values);
  std::nth_element(values.begin(), values.begin() + (k - 1), values.end(), std::greater<float>());
  return values[k - 1];
}

inline bool kept(float v, float cut, float above) { return v >= cut && v > above && v > 0.f; }

// Inverse CDF in vocabulary order over the values >= cut and > above, whose mass is `total`.
inline int64_t draw(const float* e, int64_t n, float cut, float above, double total, double u) {
  const double goal = u * total;
  double acc = 0.0;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t stop = std::min(n, start + kBlock);
    const float block = block_mass(e, start, stop, cut, above);
    if (acc + block <= goal) {
      acc += block;
      continue;
    }
    for (int64_t i = start; i < stop; ++i) {
      if (!kept(e[i], cut, above)) continue;
      acc += e[i];
      if (acc > goal) return i;
    }
  }
  for (int64_t i = n - 1; i > 0; --i)  // rounding left the goal unreached: the last kept token
    if (kept(e[i], cut, above)) return i;
  return 0;
}

// The exact top-p cut among the values >= cut and > above (which hold the top-p set), by
// sorting them: the fallback when rejection has not accepted after kMaxDraws rounds.
inline float top_p_cut(const float* e, int64_t n, float cut, float above, double target,
                       std::vector<float>& values) {
  values.clear();
  for (int64_t i = 0; i < n; ++i)
    if (kept(e[i], cut, above)) values.push_back(e[i]);
  std::sort(values.begin(), values.end(), std::greater<float>());
  double before = 0.0;
  for (size_t j = 0; j < values.size(); ++j) {
    if (before + values[j] >= target) return values[j];
    before += values[j];
  }
  return values.empty() ? cut : values.back();
}

inline int64_t sample_row(const float* x, int64_t n, float inv_temp, int64_t top_k, float top_p,
                          float min_p, uint64_t key, Scratch& s) {
  if (inv_temp == 0.f) return argmax(x, n);
  const float mx = row_max(x, n);
  if (!(mx > -std::numeric_limits<float>::infinity())) return 0;  // nothing finite to draw
  s.e.resize(n);
  float* e = s.e.data();
  const double total = exponentiate(x, n, mx, inv_temp, e);
  float cut = min_p;
  if (top_k > 0 && top_k < n) cut = std::max(cut, kth_largest(e, n, top_k, s.values));
  const double survivors = cut > 0.f ? mass(e, n, cut, -1.f) : total;
  if (top_p >= 1.f) return draw(e, n, cut, -1.f, survivors, uniform(key, 0));
  const double target = static_cast<double>(top_p) * survivors;
  float pivot = -1.f;
  double kept = survivors;
  for (int round = 0; round < kMaxDraws; ++round) {
    const int64_t token = draw(e, n, cut, pivot, kept, uniform(key, round));
    const double above = mass(e, n, cut, e[token]);
    if (above < target) return token;
    pivot = e[token];
    kept = above;
  }
  // Rarely reached (each round accepts with probability >= p): cut exactly by sorting what is
  // left above the pivot (the top of the survivors, so the target is unchanged).
  const float exact = top_p_cut(e, n, cut, pivot, target, s.values);
  return draw(e, n, exact, pivot, mass(e, n, exact, pivot), uniform(key, kMaxDraws));
}

// logits [N, V] float32 (rows contiguous); rows int64 [R]: which logits rows to sample; the
// per-row parameters are [R] tensors (inv_temp 0 = greedy; keys: int64 bit patterns of the
// rows' 64-bit keys). Returns int64 [R] token ids.
at::Tensor sample(at::Tensor logits, at::Tensor rows, at::Tensor inv_temp, at::Tensor top_k,
                  at::Tensor top_p, at::Tensor min_p, at::Tensor keys) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1 &&
                  logits.scalar_type() == at::kFloat, "logits: [N, V] float32, rows contiguous");
  const int64_t num = rows.numel(), vocab = logits.size(1), stride = logits.stride(0);
  const std::pair<const at::Tensor*, at::ScalarType> params[] = {
      {&rows, at::kLong}, {&inv_temp, at::kFloat}, {&top_k, at::kLong}, {&top_p, at::kFloat},
      {&min_p, at::kFloat}, {&keys, at::kLong}};
  for (const auto& [t, dtype] : params)
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->numel() == num &&
                    t->scalar_type() == dtype,
                "sampling parameters: contiguous [R] CPU tensors of the documented dtypes");
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < num; ++r)
    TORCH_CHECK(row[r] >= 0 && row[r] < logits.size(0), "row ", row[r], " outside the logits");
  auto out = at::empty({num}, rows.options());
  const float* base = logits.data_ptr<float>();
  const float* t = inv_temp.data_ptr<float>();
  const int64_t* k = top_k.data_ptr<int64_t>();
  const float* p = top_p.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  const int64_t* key = keys.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, num, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t r = begin; r < end; ++r)
      o[r] = sample_row(base + row[r] * stride, vocab, t[r], k[r], p[r], mp[r],
                        static_cast<uint64_t>(key[r]), scratch);
  });
  return out;
}

}  // namespace sampling
