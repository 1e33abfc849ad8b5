// Paged prefill attention for bfloat16 on CPUs with AVX512-BF16 (included by cpu_ops.cpp after
// decode_attention_bf16.h, whose exp16 and unpermute it uses).
//
// Every query row of a prefill chunk reads the same context. The decode kernel, one row per
// task, reads each key and value once per row and folds every 16 dot products horizontally.
// This one gives a task a tile of rows (up to 16 chunk tokens x the query heads of one KV head)
// and re-lays each 16-token block of the context once per tile:
//   keys    transposed to (pair of dims) x 16 tokens: q.k for 16 tokens is dim / 2 VDPBF16PS of
//           a broadcast query pair, with no horizontal sums, and SR rows share each key vector;
//   values  two tokens interleaved word by word, as in the decode kernel: VR rows share each
//           value vector.
// Scores, softmax and sums are float32; probabilities are rounded to bfloat16 for VDPBF16PS and
// the output once. Chunk row i sees the first num_cached + i + 1 context tokens (causal).
#pragma once

#if defined(__AVX512BF16__)

namespace bf16_prefill {
constexpr int64_t MAX_TILE_TOKENS = 16;
constexpr int SR = 8;  // query rows per register block of the scores pass

// Per-thread scratch of one tile (all sized in elements).
struct Tile {
  std::vector<f32_bits> keys;      // [blocks][dim / 2][16]: key pairs, token-minor
  std::vector<at::BFloat16> values;  // [blocks][8 pairs][dim]: two tokens interleaved
  std::vector<f32_bits> query;     // [rows][dim / 2]: query pairs
  std::vector<float> scores;       // [rows][stride]
  std::vector<at::BFloat16> probs;   // [rows][stride]: softmax numerators, zero past the row
  std::vector<float> peaks, totals, acc;
  std::vector<int64_t> lens;       // context tokens each row sees
};

// Gathers the tile's context into the two layouts above (tokens past len become zeros).
template <int CH>
void relay_context(const at::BFloat16* k_head, const at::BFloat16* v_head, const int64_t* rows,
                   int64_t len, Tile& w) {
  constexpr int64_t dim = 16 * CH, HALF = dim / 2;
  const int64_t blocks = (len + 15) / 16;
  w.keys.resize(blocks * HALF * 16);
  w.values.resize(blocks * 16 * dim);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t t0 = 16 * b, n = std::min<int64_t>(16, len - t0);
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
    // Offsets in 32-bit words of the 16 tokens' key rows (past n: token t0, masked off).
    alignas(64) int32_t offsets[16];
    for (int j = 0; j < 16; ++j) offsets[j] = static_cast<int32_t>(rows[t0 + (j < n ? j : 0)] / 2);
    const __m512i base = _mm512_load_si512(offsets);
    const auto* k_words = reinterpret_cast<const int*>(k_head);
    f32_bits* kb = w.keys.data() + b * HALF * 16;
    for (int64_t p = 0; p < HALF; ++p) {
      const __m512i idx = _mm512_add_epi32(base, _mm512_set1_epi32(static_cast<int>(p)));
      const __m512i pairs = _mm512_mask_i32gather_epi32(zero, valid, idx, k_words, 4);
      _mm512_storeu_si512(kb + p * 16, pairs);
    }
    at::BFloat16* vb = w.values.data() + b * 16 * dim;
    for (int j = 0; j < 16; j += 2) {
      for (int64_t c = 0; c < CH / 2; ++c) {
        const __m512i a = j < n ? _mm512_loadu_si512(v_head + rows[t0 + j] + 32 * c) : zero;
        const __m512i z =
            j + 1 < n ? _mm512_loadu_si512(v_head + rows[t0 + j + 1] + 32 * c) : zero;
        _mm512_storeu_si512(vb + (j / 2) * 2 * dim + 64 * c, _mm512_unpacklo_epi16(a, z));
        _mm512_storeu_si512(vb + (j / 2) * 2 * dim + 64 * c + 32, _mm512_unpackhi_epi16(a, z));
      }
    }
  }
}

// scores[r][t] = scale * q_r . k_t for SR rows from r0, over the blocks the last of them sees;
// peaks[r] = the row's largest score among the tokens it sees.
template <int CH>
void score_rows(Tile& w, int64_t r0, int64_t stride, float scale, float* peaks) {
  constexpr int64_t HALF = 8 * CH;
  const int64_t blocks = (w.lens[r0 + SR - 1] + 15) / 16;
  const f32_bits* q = w.query.data() + r0 * HALF;
  __m512 peak[SR];
  for (int r = 0; r < SR; ++r) peak[r] = _mm512_set1_ps(-INFINITY);
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 acc[SR];
    for (int r = 0; r < SR; ++r) acc[r] = _mm512_setzero_ps();
    const f32_bits* kb = w.keys.data() + b * HALF * 16;
    for (int64_t p = 0; p < HALF; ++p) {
      const __m512bh k = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kb + p * 16));
      for (int r = 0; r < SR; ++r) {
        const __m512bh qp = reinterpret_cast<__m512bh>(
            _mm512_set1_epi32(static_cast<int>(q[r * HALF + p])));
        acc[r] = _mm512_dpbf16_ps(acc[r], qp, k);
      }
    }
    for (int r = 0; r < SR; ++r) {
      const __m512 s = _mm512_mul_ps(acc[r], scale_v);
      _mm512_storeu_ps(w.scores.data() + (r0 + r) * stride + 16 * b, s);
      const int64_t seen = std::clamp<int64_t>(w.lens[r0 + r] - 16 * b, 0, 16);
      peak[r] = _mm512_mask_max_ps(peak[r], static_cast<__mmask16>((1u << seen) - 1u), peak[r], s);
    }
  }
  for (int r = 0; r < SR; ++r) peaks[r] = _mm512_reduce_max_ps(peak[r]);
}

// Softmax numerators of one row as bfloat16, zero from the row's length up to `width`; returns
// their float32 sum.
inline float row_probabilities(const float* scores, float peak, int64_t len, int64_t width,
                               at::BFloat16* probs) {
  const __m512 peak_v = _mm512_set1_ps(peak);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < width; t += 16) {
    const int64_t seen = std::clamp<int64_t>(len - t, 0, 16);
    const __mmask16 valid = static_cast<__mmask16>((1u << seen) - 1u);
    const __m512 e = _mm512_maskz_mov_ps(
        valid, bf16_decode::exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + t), peak_v)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + t),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  return _mm512_reduce_add_ps(sum);
}

// acc[r] = sum_t p_r[t] v_t for VR rows from r0 (in the interleaved dim order of the values).
template <int CH, int VR>
void weigh_values(Tile& w, int64_t r0, int64_t stride) {
  constexpr int64_t dim = 16 * CH;
  const int64_t blocks = (w.lens[r0 + VR - 1] + 15) / 16;
  const auto* pairs = reinterpret_cast<const f32_bits*>(w.probs.data());
  __m512 acc[VR][CH];
  for (int r = 0; r < VR; ++r)
    for (int c = 0; c < CH; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t t = 8 * b + j;  // index of the token pair
      __m512bh p[VR];
      for (int r = 0; r < VR; ++r)
        p[r] = reinterpret_cast<__m512bh>(
            _mm512_set1_epi32(static_cast<int>(pairs[(r0 + r) * stride / 2 + t])));
      const at::BFloat16* vb = w.values.data() + t * 2 * dim;
      for (int c = 0; c < CH; ++c) {
        const __m512bh v = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vb + 32 * c));
        for (int r = 0; r < VR; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p[r], v);
      }
    }
  for (int r = 0; r < VR; ++r)
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(w.acc.data() + ((r0 + r) * CH + c) * 16, acc[r][c]);
}

// One tile: chunk tokens [i0, i1) x the `group` query heads of KV head g. Rows are ordered
// token-major, so a row block's last row sees the most context.
template <int CH>
void tile_task(const at::Tensor& q, at::Tensor& out, const at::BFloat16* k_head,
               const at::BFloat16* v_head, const int64_t* rows, int64_t num_cached, int64_t i0,
               int64_t i1, int64_t g, int64_t group, float scale, Tile& w) {
  constexpr int64_t dim = 16 * CH, HALF = dim / 2;
  constexpr int VR = 24 / CH;
  constexpr int64_t PAD = SR * VR / std::gcd(SR, VR);
  const int64_t real = (i1 - i0) * group, nrows = (real + PAD - 1) / PAD * PAD;
  const int64_t len = num_cached + i1, stride = (len + 15) / 16 * 16;
  relay_context<CH>(k_head, v_head, rows, len, w);
  w.query.assign(nrows * HALF, 0);
  w.lens.resize(nrows);
  const auto* q_ptr = q.data_ptr<at::BFloat16>();
  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t i = r < real ? i0 + r / group : i1 - 1;  // padding rows copy the last length
    w.lens[r] = num_cached + i + 1;
    if (r < real)
      std::memcpy(w.query.data() + r * HALF,
                  q_ptr + i * q.stride(0) + (g * group + r % group) * q.stride(1),
                  dim * sizeof(at::BFloat16));
  }
  w.scores.resize(nrows * stride);
  w.probs.resize(nrows * stride);
  w.totals.resize(nrows);
  w.acc.resize(nrows * dim);
  w.peaks.resize(nrows);
  for (int64_t r0 = 0; r0 < nrows; r0 += SR) score_rows<CH>(w, r0, stride, scale, &w.peaks[r0]);
  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t width = (w.lens[(r / VR + 1) * VR - 1] + 15) / 16 * 16;  // its VR block's
    w.totals[r] = row_probabilities(w.scores.data() + r * stride, w.peaks[r], w.lens[r], width,
                                    w.probs.data() + r * stride);
  }
  for (int64_t r0 = 0; r0 < nrows; r0 += VR) weigh_values<CH, VR>(w, r0, stride);
  auto* o_ptr = out.data_ptr<at::BFloat16>();
  alignas(64) float row[dim];
  for (int64_t r = 0; r < real; ++r) {
    bf16_decode::unpermute(w.acc.data() + r * dim, dim, 1.f / w.totals[r], row);
    store_row(o_ptr + (i0 + r / group) * out.stride(0) + (g * group + r % group) * out.stride(1),
              row, dim);
  }
}

// The whole chunk: q [tokens, heads, dim] against the sequence's blocks `block_table` (int64,
// 1-D), of which the first num_cached tokens were stored before this chunk (and the chunk's own
// keys and values after them).
void prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& block_table,
                       int64_t num_cached, double scale) {
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, row_stride = kv_heads * dim;
  const int64_t len = num_cached + tokens;
  const int64_t* table = block_table.data_ptr<int64_t>();
  std::vector<int64_t> rows(len);  // element offset of each context token's KV row
  for (int64_t t = 0; t < len; ++t)
    rows[t] = (table[t / block_size] * block_size + t % block_size) * row_stride;
  // Enough tasks for the threads to share the work, as few rows per tile as that needs.
  const int64_t threads = at::get_num_threads();
  const int64_t tile = std::clamp<int64_t>(tokens * kv_heads / (4 * threads), 1, MAX_TILE_TOKENS);
  const int64_t tiles = (tokens + tile - 1) / tile;
  const auto* k_ptr = k_cache.data_ptr<at::BFloat16>();
  const auto* v_ptr = v_cache.data_ptr<at::BFloat16>();
  at::parallel_for(0, tiles * kv_heads, 1, [&](int64_t begin, int64_t end) {
    Tile w;
    for (int64_t task = begin; task < end; ++task) {
      // Tiles in zig-zag order (0, n-1, 1, n-2, ...): later tiles see more context, and each
      // thread takes a contiguous range of tasks.
      const int64_t i = task / kv_heads, g = task % kv_heads;
      const int64_t z = i % 2 == 0 ? i / 2 : tiles - 1 - i / 2;
      const int64_t i0 = z * tile, i1 = std::min(tokens, i0 + tile);
      if (dim == 64)
        tile_task<4>(q, out, k_ptr + g * dim, v_ptr + g * dim, rows.data(), num_cached, i0, i1,
                     g, group, static_cast<float>(scale), w);
      else
        tile_task<8>(q, out, k_ptr + g * dim, v_ptr + g * dim, rows.data(), num_cached, i0, i1,
                     g, group, static_cast<float>(scale), w);
    }
  });
}

}  // namespace bf16_prefill

#endif  // __AVX512BF16__
