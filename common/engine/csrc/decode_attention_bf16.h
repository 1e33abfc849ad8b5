// Paged decode attention for bfloat16 on CPUs with AVX512-BF16 (included by cpu_ops.cpp).
//
// The generic kernel in cpu_ops.cpp reduces every query.key dot product horizontally and keeps
// its value accumulators in memory, which leaves it at a fraction of memory bandwidth. This one:
//   scores  q.k with VDPBF16PS (bf16 pairs in, float32 sums out), 16 context tokens at a time,
//           the 16 partial-sum vectors folded into one vector of 16 scores by a shuffle tree;
//   values  per block of 16 tokens, the accumulators of up to 16 / (head_dim / 16) query heads
//           sit in registers while the block's value rows go past, two tokens per VDPBF16PS
//           (the softmax probabilities are rounded to bfloat16 for it);
//   order   both passes walk the context block by block, all of a task's KV heads together, so
//           each block's rows are read whole and in order, with the next block prefetched.
// Scores, softmax and accumulation are float32; the output is rounded once to bfloat16.
#pragma once

#if defined(__AVX512BF16__)

namespace bf16_decode {
using bf16_rows::exp16;
// Prefetch distance in tokens: two blocks of 16 ahead, issued a slice at a time between the
// block's computations (a whole block's lines at once overflow the miss queues and stall).
constexpr int64_t PF = 32;

// out[j] = sum of the 16 lanes of a[j], for j = 0..15.
inline __m512 reduce16(__m512 a[16]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // 128-bit lane L of c[i] now holds the lane-L partial sums of a[4i..4i+3]; add the lanes.
  const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                   _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                                   _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88),
                       _mm512_shuffle_f32x4(e01, e23, 0xDD));
}

inline __m512bh load_bh(const at::BFloat16* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

// Asks for the 64-byte lines [base + rows[t], + 32 * lines) of tokens [from, to) before use:
// a sequence's blocks lie anywhere in the cache, which the hardware prefetcher does not follow.
// Into L2, not L1: on the fourth session's 2-core Zen 4 VM, prefetches into L1 stalled on the
// few L1 miss buffers (13% of the scores pass sat on the instruction after one) and decode
// streamed 16 GB/s; into L2 it streams 23-29 GB/s, about what two cores read, and prefill
// chunks (whose blocks are in cache already) run the same (`python -m bench.attention_kernels`).
// The L1 hint had been tuned on an earlier Zen 4 VM (33 GB/s there), not available to compare.
inline void prefetch_rows(const at::BFloat16* base, const int64_t* rows, int64_t from,
                          int64_t to, int lines) {
  for (int64_t t = from; t < to; ++t)
    for (int l = 0; l < lines; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(base + rows[t] + 32 * l), _MM_HINT_T1);
}

// scale * q . k_j for one query head and the n <= 16 tokens whose rows are rows[0 .. n).
template <int CH>  // head_dim = 16 * CH, CH even
inline __m512 block_scores(const __m512bh* qv, const at::BFloat16* k_head, const int64_t* rows,
                           int n, __m512 scale) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    acc[j] = _mm512_setzero_ps();
    if (j < n) {
      const at::BFloat16* k = k_head + rows[j];
      for (int c = 0; c < CH / 2; ++c)
        acc[j] = _mm512_dpbf16_ps(acc[j], qv[c], load_bh(k + 32 * c));
    }
  }
  return _mm512_mul_ps(reduce16(acc), scale);
}

// acc_g += sum_j p_g[j] v_j over the n tokens of one block, for `heads` query heads of one KV
// head. Tokens go in pairs through VDPBF16PS: `pairs` holds the probabilities as bfloat16 pairs
// (p_t, p_t+1), and the two value rows are interleaved word by word, so each 32-dim chunk lands
// in two accumulators with a lane-local dim order that `unpermute` undoes at the end.
template <int CH>
inline void block_values(const f32_bits* pairs, int64_t pair_stride, int heads,
                         const at::BFloat16* v_head, const int64_t* rows, int n, float* acc_mem) {
  constexpr int MAX_HEADS = 16 / CH > 0 ? 16 / CH : 1;
  __m512 acc[MAX_HEADS][CH];
  for (int g = 0; g < heads; ++g)
    for (int c = 0; c < CH; ++c) acc[g][c] = _mm512_loadu_ps(acc_mem + (g * CH + c) * 16);
  for (int j = 0; j < n; j += 2) {
    const at::BFloat16* va = v_head + rows[j];
    const at::BFloat16* vb = j + 1 < n ? v_head + rows[j + 1] : va;  // its probability is 0
    __m512bh value[CH];
    for (int c = 0; c < CH / 2; ++c) {
      const __m512i a = _mm512_loadu_si512(va + 32 * c), b = _mm512_loadu_si512(vb + 32 * c);
      value[2 * c] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(a, b));
      value[2 * c + 1] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(a, b));
    }
    for (int g = 0; g < MAX_HEADS; ++g) {
      if (g >= heads) break;
      const __m512bh w = reinterpret_cast<__m512bh>(
          _mm512_set1_epi32(static_cast<int>(pairs[g * pair_stride + j / 2])));
      for (int c = 0; c < CH; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], w, value[c]);
    }
  }
  for (int g = 0; g < heads; ++g)
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(acc_mem + (g * CH + c) * 16, acc[g][c]);
}

// Puts an accumulator row of block_values back in dim order, scaled by `inv`.
inline void unpermute(const float* acc, int64_t dim, float inv, float* row) {
  for (int64_t c = 0; c < dim / 32; ++c)
    for (int e = 0; e < 16; ++e) {
      const int64_t base = 32 * c + 8 * (e / 4) + e % 4;
      row[base] = acc[32 * c + e] * inv;           // from the interleaved low words
      row[base + 4] = acc[32 * c + 16 + e] * inv;  // from the high words
    }
}

// Turns each query row's scores into softmax numerators; their sums go to `totals`. Rows are
// padded to a multiple of 16; lanes past `len` become 0.
inline void softmax_rows(float* scores, int64_t stride, int64_t len, int nrows,
                         const float* peaks, float* totals) {
  for (int r = 0; r < nrows; ++r) {
    float* s = scores + r * stride;
    const __m512 peak = _mm512_set1_ps(peaks[r]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
      const int64_t n = std::min<int64_t>(16, len - t);
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
      const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(s + t), peak);
      const __m512 e = _mm512_maskz_mov_ps(valid, exp16(x));
      _mm512_storeu_ps(s + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    totals[r] = _mm512_reduce_add_ps(sum);
  }
}

// Per-thread scratch of one task: scores [query rows, stride], accumulators [query rows, dim].
struct Scratch {
  std::vector<float> scores, acc, peaks, totals;
  std::vector<at::BFloat16> probs;  // softmax numerators, bfloat16, read as pairs
  std::vector<__m512bh> query;
};

// Scores of every query row of a task against the whole context, block by block; the block's
// key rows are prefetched one block ahead (a sequence's blocks lie anywhere in the cache).
template <int CH>
void task_scores(const at::BFloat16* k_task, const int64_t* rows, int64_t len, int64_t group,
                 int lines, float scale, Scratch& w, int64_t nrows, int64_t stride) {
  constexpr int64_t dim = 16 * CH, HALF = CH / 2;
  const __m512 scale_v = _mm512_set1_ps(scale);
  prefetch_rows(k_task, rows, 0, std::min<int64_t>(PF, len), lines);
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - t0));
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
    for (int64_t r = 0; r < nrows; ++r) {  // the next block's rows, a slice per query row
      prefetch_rows(k_task, rows, std::min(t0 + PF + r * 16 / nrows, len),
                    std::min(t0 + PF + (r + 1) * 16 / nrows, len), lines);
      const __m512 s = block_scores<CH>(w.query.data() + r * HALF, k_task + (r / group) * dim,
                                        rows + t0, n, scale_v);
      _mm512_mask_storeu_ps(w.scores.data() + r * stride + t0, valid, s);
      w.peaks[r] = std::max(w.peaks[r], _mm512_mask_reduce_max_ps(valid, s));
    }
  }
}

// acc[r] = sum_t p_r[t] v_t for every query row of a task, block by block, from the bfloat16
// probabilities in w.probs; value rows prefetched one block ahead.
template <int CH>
void task_values(const at::BFloat16* v_task, const int64_t* rows, int64_t len, int64_t span,
                 int64_t group, int lines, Scratch& w, int64_t stride) {
  constexpr int64_t dim = 16 * CH;
  constexpr int64_t MAX_HEADS = 16 / CH > 0 ? 16 / CH : 1;
  const auto* pairs = reinterpret_cast<const f32_bits*>(w.probs.data());
  prefetch_rows(v_task, rows, 0, std::min<int64_t>(PF, len), lines);
  const int64_t subgroups = (group + MAX_HEADS - 1) / MAX_HEADS;  // block_values calls per head
  const int64_t slices = span * subgroups;  // the next block's prefetch is split this many ways
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - t0));
    for (int64_t h = 0; h < span; ++h)
      for (int64_t g0 = 0; g0 < group; g0 += MAX_HEADS) {
        const int64_t slice = h * subgroups + g0 / MAX_HEADS;
        prefetch_rows(v_task, rows, std::min(t0 + PF + slice * 16 / slices, len),
                      std::min(t0 + PF + (slice + 1) * 16 / slices, len), lines);
        const int64_t r = h * group + g0;
        block_values<CH>(pairs + (r * stride + t0) / 2, stride / 2,
                         static_cast<int>(std::min(MAX_HEADS, group - g0)), v_task + h * dim,
                         rows + t0, n, w.acc.data() + r * dim);
      }
  }
}

// One task: KV heads [kvh0, kvh0 + span) of one sequence, i.e. query rows
// [kvh0 * group, (kvh0 + span) * group).
template <int CH>
void decode_task(const at::BFloat16* q, int64_t q_s1, const at::BFloat16* k_ptr,
                 const at::BFloat16* v_ptr, const int64_t* rows, int64_t len, int64_t kvh0,
                 int64_t span, int64_t group, float scale, at::BFloat16* out, int64_t o_s1,
                 Scratch& w) {
  constexpr int64_t dim = 16 * CH, HALF = CH / 2;
  const int64_t nrows = span * group, stride = (len + 15) / 16 * 16, r0 = kvh0 * group;
  const int lines = static_cast<int>(span * dim / 32);  // 64-byte lines of the task's row share
  w.scores.resize(nrows * stride);
  w.probs.resize(nrows * stride);
  w.acc.assign(nrows * dim, 0.f);
  w.peaks.assign(nrows, -INFINITY);
  w.totals.resize(nrows);
  w.query.resize(nrows * HALF);
  for (int64_t r = 0; r < nrows; ++r)
    for (int64_t c = 0; c < HALF; ++c)
      w.query[r * HALF + c] = load_bh(q + (r0 + r) * q_s1 + 32 * c);
  task_scores<CH>(k_ptr + kvh0 * dim, rows, len, group, lines, scale, w, nrows, stride);
  softmax_rows(w.scores.data(), stride, len, static_cast<int>(nrows), w.peaks.data(),
               w.totals.data());
  store_row(w.probs.data(), w.scores.data(), nrows * stride);
  task_values<CH>(v_ptr + kvh0 * dim, rows, len, span, group, lines, w, stride);
  alignas(64) float row[dim];
  for (int64_t r = 0; r < nrows; ++r) {
    unpermute(w.acc.data() + r * dim, dim, 1.f / w.totals[r], row);
    store_row(out + (r0 + r) * o_s1, row, dim);
  }
}

// The head dims this kernel handles; the generic kernel runs otherwise.
constexpr int64_t HEAD_DIMS[] = {64, 128};
inline bool supports(int64_t dim) {
  return std::find(std::begin(HEAD_DIMS), std::end(HEAD_DIMS), dim) != std::end(HEAD_DIMS);
}

void decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_table,
                      const at::Tensor& context_lens, double scale) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, row_stride = kv_heads * dim;
  const int64_t table_stride = block_table.stride(0);
  const auto* q_ptr = q.data_ptr<at::BFloat16>();
  const auto* k_ptr = k_cache.data_ptr<at::BFloat16>();
  const auto* v_ptr = v_cache.data_ptr<at::BFloat16>();
  auto* o_ptr = out.data_ptr<at::BFloat16>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t span = batch >= 2 * at::get_num_threads() ? kv_heads : 1;
  const int64_t tasks_per_seq = kv_heads / span;
  at::parallel_for(0, batch * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    std::vector<int64_t> rows;  // element offset of each context token's KV row
    for (int64_t task = begin; task < end; ++task) {
      // Sequences in zig-zag order (0, n-1, 1, n-2, ...): the threads' contiguous task ranges
      // then get equal work when lengths grow along the batch (the rows of a prefill chunk).
      const int64_t i = task / tasks_per_seq, kvh0 = (task % tasks_per_seq) * span;
      const int64_t b = i % 2 == 0 ? i / 2 : batch - 1 - i / 2;
      const int64_t len = lens[b];
      const int64_t* blocks = table + b * table_stride;
      rows.resize(len);
      for (int64_t t0 = 0, blk = 0; t0 < len; t0 += block_size, ++blk)  // no division per token
        for (int64_t t = t0, row = blocks[blk] * block_size * row_stride;
             t < std::min(t0 + block_size, len); ++t, row += row_stride)
          rows[t] = row;
      const auto* qb = q_ptr + b * q.stride(0);
      auto* ob = o_ptr + b * out.stride(0);
      if (dim == 64)
        decode_task<4>(qb, q.stride(1), k_ptr, v_ptr, rows.data(), len, kvh0, span, group,
                       static_cast<float>(scale), ob, out.stride(1), scratch);
      else
        decode_task<8>(qb, q.stride(1), k_ptr, v_ptr, rows.data(), len, kvh0, span, group,
                       static_cast<float>(scale), ob, out.stride(1), scratch);
    }
  });
}

}  // namespace bf16_decode

#endif  // __AVX512BF16__
