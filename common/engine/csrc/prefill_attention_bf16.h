// The tile computation of paged prefill attention for bfloat16 on CPUs with AVX512-BF16
// (included by cpu_ops.cpp after decode_attention_bf16.h, whose exp16 and unpermute it uses;
// varlen_attention_bf16.h schedules it).
//
// Every query row of a prefill chunk reads the same context. The decode kernel, one row per
// task, reads each key and value once per row and folds every 16 dot products horizontally.
// Here a task takes a tile of rows (up to 16 chunk tokens x the query heads of one KV head)
// over the context of its sequence and KV head, re-laid once per forward (relay_block):
//   keys    transposed to (pair of dims) x 16 tokens: q.k for 16 tokens is dim / 2 VDPBF16PS of
//           a broadcast query pair, with no horizontal sums, and SR rows share each key vector;
//           the same layout is an AMX B tile (16 dim pairs x 16 tokens);
//   values  two tokens interleaved word by word, as in the decode kernel: VR rows share each
//           value vector; 16 such pair rows are an AMX B tile of 16 (permuted) dims.
// Scores, softmax and sums are float32; probabilities are rounded to bfloat16 for VDPBF16PS (or
// the AMX tiles) and the output once. Chunk row i sees the first num_cached + i + 1 context
// tokens (causal).
#pragma once

#if defined(__AVX512BF16__)

namespace bf16_prefill {
constexpr int64_t MAX_TILE_TOKENS = 16;
constexpr int SR = 8;  // query rows per register block of the scores pass

// Per-thread scratch of one tile (all sized in elements), and the tile's re-laid context.
struct Tile {
  const f32_bits* keys = nullptr;      // [blocks][dim / 2][16]: key pairs, token-minor
  const at::BFloat16* values = nullptr;  // [blocks][8 pairs][2 dim]: two tokens interleaved
  std::vector<f32_bits> query;     // [rows][dim / 2]: query pairs
  std::vector<float> scores;       // [rows][stride]
  std::vector<at::BFloat16> probs;   // [rows][stride]: softmax numerators, zero past the row
  std::vector<float> peaks, totals, acc;
  std::vector<int64_t> lens;       // context tokens each row sees
};

// Re-lays context block b (tokens 16 b .. 16 b + 15 of `len`) of one KV head into the two
// layouts above, at kb ([dim / 2][16] words) and vb ([8 pairs][2 dim]); tokens past len become
// zeros (a whole block past it too).
template <int CH>
void relay_block(const at::BFloat16* k_head, const at::BFloat16* v_head, const int64_t* rows,
                 int64_t len, int64_t b, f32_bits* kb, at::BFloat16* vb) {
  constexpr int64_t dim = 16 * CH, HALF = dim / 2;
  const int64_t t0 = 16 * b, n = std::clamp<int64_t>(len - t0, 0, 16);
  const __m512i zero = _mm512_setzero_si512();
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
  // Offsets in 32-bit words of the 16 tokens' key rows (past n: masked off).
  alignas(64) int32_t offsets[16];
  for (int j = 0; j < 16; ++j) offsets[j] = j < n ? static_cast<int32_t>(rows[t0 + j] / 2) : 0;
  const __m512i base = _mm512_load_si512(offsets);
  const auto* k_words = reinterpret_cast<const int*>(k_head);
  for (int64_t p = 0; p < HALF; ++p) {
    const __m512i idx = _mm512_add_epi32(base, _mm512_set1_epi32(static_cast<int>(p)));
    _mm512_storeu_si512(kb + p * 16, _mm512_mask_i32gather_epi32(zero, valid, idx, k_words, 4));
  }
  for (int j = 0; j < 16; j += 2) {
    for (int64_t c = 0; c < CH / 2; ++c) {
      const __m512i a = j < n ? _mm512_loadu_si512(v_head + rows[t0 + j] + 32 * c) : zero;
      const __m512i z = j + 1 < n ? _mm512_loadu_si512(v_head + rows[t0 + j + 1] + 32 * c) : zero;
      _mm512_storeu_si512(vb + (j / 2) * 2 * dim + 64 * c, _mm512_unpacklo_epi16(a, z));
      _mm512_storeu_si512(vb + (j / 2) * 2 * dim + 64 * c + 32, _mm512_unpackhi_epi16(a, z));
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
    const f32_bits* kb = w.keys + b * HALF * 16;
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

// Softmax numerators exp(scale * (score - peak)) of one row as bfloat16, zero from the row's
// length up to `width`; returns their float32 sum. (Scores already scaled: scale 1.)
inline float row_probabilities(const float* scores, float peak, int64_t len, int64_t width,
                               at::BFloat16* probs, float scale = 1.f) {
  const __m512 scale_v = _mm512_set1_ps(scale), shift = _mm512_set1_ps(-peak * scale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < width; t += 16) {
    const int64_t seen = std::clamp<int64_t>(len - t, 0, 16);
    const __mmask16 valid = static_cast<__mmask16>((1u << seen) - 1u);
    const __m512 e = _mm512_maskz_mov_ps(
        valid, bf16_decode::exp16(_mm512_fmadd_ps(_mm512_loadu_ps(scores + t), scale_v, shift)));
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
      const at::BFloat16* vb = w.values + t * 2 * dim;
      for (int c = 0; c < CH; ++c) {
        const __m512bh v = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vb + 32 * c));
        for (int r = 0; r < VR; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p[r], v);
      }
    }
  for (int r = 0; r < VR; ++r)
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(w.acc.data() + ((r0 + r) * CH + c) * 16, acc[r][c]);
}

}  // namespace bf16_prefill

#endif  // __AVX512BF16__
