// Paged decode attention for every dtype and CPU (included by cpu_ops.cpp): the generic kernel,
// with AVX2 and AVX-512 inner loops where the CPU has them. bfloat16 on AVX512-BF16 CPUs runs
// the faster kernels of decode_attention_bf16.h instead, for the head dims they support.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define SPLITSERVE_AVX2_ATTENTION 1
// AVX2 machines run float32 by default ("auto"): the key/value row stays in eight-lane
// registers and is reused for every head of the group, with no copy to scratch.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
constexpr int64_t kMaxChunks8 = 16;  // head dims up to 128 stay in registers

template <typename T>
inline bool avx2_group_scores(const float* qf, const T* k, int64_t group, int64_t dim,
                              float* out, int64_t out_stride) {
  if (dim % 8 != 0 || dim / 8 > kMaxChunks8) return false;
  __m256 key[kMaxChunks8];
  const int64_t chunks = dim / 8;
  for (int64_t c = 0; c < chunks; ++c) key[c] = load8(k + 8 * c);
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = qf + g * dim;
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qg), key[0]);
    for (int64_t c = 1; c < chunks; ++c)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), key[c], acc);
    out[g * out_stride] = sum8(acc);
  }
  return true;
}

template <typename T>
inline bool avx2_group_accumulate(const float* p, int64_t p_stride, const T* v, int64_t group,
                                  int64_t dim, float* acc) {
  if (dim % 8 != 0 || dim / 8 > kMaxChunks8) return false;
  __m256 value[kMaxChunks8];
  const int64_t chunks = dim / 8;
  for (int64_t c = 0; c < chunks; ++c) value[c] = load8(v + 8 * c);
  for (int64_t g = 0; g < group; ++g) {
    const __m256 w = _mm256_set1_ps(p[g * p_stride]);
    float* a = acc + g * dim;
    for (int64_t c = 0; c < chunks; ++c)
      _mm256_storeu_ps(a + 8 * c, _mm256_fmadd_ps(w, value[c], _mm256_loadu_ps(a + 8 * c)));
  }
  return true;
}
#endif

// Scores of one query group against one context token: q . k for each of `group` heads.
// The AVX-512 and AVX2 versions keep the key row in registers and reuse it for every head.
template <typename T>
inline void group_scores(const float* qf, const T* k, float* kv, int64_t group, int64_t dim,
                         float* out, int64_t out_stride) {
#if defined(SPLITSERVE_AVX2_ATTENTION)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>)
    if (avx2_group_scores(qf, k, group, dim, out, out_stride)) return;
#endif
  load_row(k, kv, dim);
  for (int64_t g = 0; g < group; ++g) {
    float dot = 0.f;
    const float* qg = qf + g * dim;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < dim; ++d) dot += qg[d] * kv[d];
    out[g * out_stride] = dot;
  }
}

// acc[g] += p[g] * v for each head g of the group (p strided by p_stride).
template <typename T>
inline void group_accumulate(const float* p, int64_t p_stride, const T* v, float* kv,
                             int64_t group, int64_t dim, float* acc) {
#if defined(SPLITSERVE_AVX2_ATTENTION)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>)
    if (avx2_group_accumulate(p, p_stride, v, group, dim, acc)) return;
#endif
  load_row(v, kv, dim);
  for (int64_t g = 0; g < group; ++g) {
    const float w = p[g * p_stride];
    float* a = acc + g * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) a[d] += w * kv[d];
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

template <>
inline void group_scores<at::BFloat16>(const float* qf, const at::BFloat16* k, float*,
                                       int64_t group, int64_t dim, float* out,
                                       int64_t out_stride) {
  if (dim % 16 != 0 || dim > 256) {
    std::vector<float> kv(dim);
    load_row(k, kv.data(), dim);
    for (int64_t g = 0; g < group; ++g) {
      float dot = 0.f;
      for (int64_t d = 0; d < dim; ++d) dot += qf[g * dim + d] * kv[d];
      out[g * out_stride] = dot;
    }
    return;
  }
  __m512 key[16];
  const int64_t chunks = dim / 16;
  for (int64_t c = 0; c < chunks; ++c) key[c] = load16(k + 16 * c);
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = qf + g * dim;
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), key[0]);
    for (int64_t c = 1; c < chunks; ++c)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), key[c], acc);
    out[g * out_stride] = _mm512_reduce_add_ps(acc);
  }
}

template <>
inline void group_accumulate<at::BFloat16>(const float* p, int64_t p_stride,
                                           const at::BFloat16* v, float* kv, int64_t group,
                                           int64_t dim, float* acc) {
  if (dim % 16 != 0 || dim > 256) {
    load_row(v, kv, dim);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += p[g * p_stride] * kv[d];
    return;
  }
  __m512 value[16];
  const int64_t chunks = dim / 16;
  for (int64_t c = 0; c < chunks; ++c) value[c] = load16(v + 16 * c);
  for (int64_t g = 0; g < group; ++g) {
    const __m512 w = _mm512_set1_ps(p[g * p_stride]);
    float* a = acc + g * dim;
    for (int64_t c = 0; c < chunks; ++c)
      _mm512_storeu_ps(a + 16 * c, _mm512_fmadd_ps(w, value[c], _mm512_loadu_ps(a + 16 * c)));
  }
}
#endif

template <typename T>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_table,
                           const at::Tensor& context_lens, double scale) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t table_stride = block_table.stride(0);
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t row_stride = kv_heads * dim;  // between consecutive tokens of a block
  // With many sequences a task takes every KV head of one sequence, so each token's key/value
  // row is read whole and in order; with few, tasks split by KV head to use every thread.
  const int64_t span = batch >= 2 * at::get_num_threads() ? kv_heads : 1;
  const int64_t tasks_per_seq = kv_heads / span;
  at::parallel_for(0, batch * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows = span * group;  // query heads handled by one task
    std::vector<float> qf(rows * dim), acc(rows * dim), kv(dim), scores, total(rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_seq, kvh0 = (task % tasks_per_seq) * span;
      const int64_t len = lens[b];
      const int64_t* blocks = table + b * table_stride;
      scores.resize(rows * len);
      for (int64_t r = 0; r < rows; ++r) {
        load_row(q_ptr + b * q_s0 + (kvh0 * group + r) * q_s1, qf.data() + r * dim, dim);
        for (int64_t d = 0; d < dim; ++d) qf[r * dim + d] *= static_cast<float>(scale);
      }
      for (int64_t t = 0; t < len; ++t) {  // scores = q . k for every context token
        const T* row = k_ptr + (blocks[t / block_size] * block_size + t % block_size) * row_stride;
        for (int64_t h = 0; h < span; ++h)
          group_scores(qf.data() + h * group * dim, row + (kvh0 + h) * dim, kv.data(), group,
                       dim, scores.data() + h * group * len + t, len);
      }
      for (int64_t r = 0; r < rows; ++r) {  // softmax numerators and their sums
        float* sr = scores.data() + r * len;
        const float peak = *std::max_element(sr, sr + len);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          sr[t] = fast_exp(sr[t] - peak);
          sum += sr[t];
        }
        total[r] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {  // acc = sum_t p_t v_t
        const T* row = v_ptr + (blocks[t / block_size] * block_size + t % block_size) * row_stride;
        for (int64_t h = 0; h < span; ++h)
          group_accumulate(scores.data() + h * group * len + t, len, row + (kvh0 + h) * dim,
                           kv.data(), group, dim, acc.data() + h * group * dim);
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* a = acc.data() + r * dim;
        const float inv = 1.f / total[r];
        for (int64_t d = 0; d < dim; ++d) a[d] *= inv;
        store_row(o_ptr + b * o_s0 + (kvh0 * group + r) * o_s1, a, dim);
      }
    }
  });
}
