// Decode attention on AMX tiles: one query token of one sequence, the query heads of one KV
// head (included by cpu_ops.cpp after decode_attention_bf16.h and prefill_attention_bf16.h;
// varlen_attention_bf16.h calls it where the CPU has AMX and blocks hold a multiple of 16).
//
// The VDPBF16PS decode kernel spends most of a step's attention on instructions: 16 dot
// products per query row per 16 tokens, folded horizontally, then two VDPBF16PS per token pair
// and query row for the values. Here:
//   scores  S^T [16 tokens x 16] = K [16 tokens x 32 dims] . Q^T [32 dims x the group's heads],
//           K loaded as a tile straight from the cache (16 rows of one block, row stride of the
//           cache), Q^T built once per task; each head's 16 scores gathered from the result;
//   values  O [heads x 16 dims] += P [heads x 32 tokens] . V [32 tokens x 16 dims], V's rows
//           interleaved two tokens at a time into B tiles (dims permuted as in the other
//           kernels, undone at the end), four output tiles per pass over the tokens.
// Tokens past the context in its last 16 are read from the block (allocated, stale) and masked
// out of the softmax; their values are zeroed before they meet a probability.
#pragma once

#if defined(SPLITSERVE_AMX_BF16)

namespace amx_decode {

struct Scratch {
  std::vector<f32_bits> qt;         // [dim / 32][16 dim pairs][16 heads]
  std::vector<at::BFloat16> vt;     // [4 pieces][16 token pairs][32]
  std::vector<float> scores, acc;   // [heads][stride], [16][dim]
  std::vector<at::BFloat16> probs;  // [16][stride], rows past the group zero
  std::vector<float> peaks, totals;
  alignas(64) float st[16 * 16];    // S^T of one 16-token step
};

// Scaled scores of the group's heads over tokens [0, len), their peaks; `qt` built first.
template <int CH>
void scores(const at::BFloat16* k_head, const int64_t* rows, int64_t len, int64_t row_stride,
            int64_t group, int64_t stride, float scale, Scratch& w) {
  constexpr int64_t quarters = CH / 2;  // 32 dims each
  const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                            5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
  const __m512 scale_v = _mm512_set1_ps(scale);
  __m512 peak[16];
  for (int64_t n = 0; n < group; ++n) peak[n] = _mm512_set1_ps(-INFINITY);
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    _tile_zero(0);
    for (int64_t j = 0; j < quarters; ++j) {
      _tile_loadd(4, k_head + rows[t0] + 32 * j, row_stride * 2);
      _tile_loadd(6, w.qt.data() + j * 16 * 16, 64);
      _tile_dpbf16ps(0, 4, 6);
    }
    _tile_stored(0, w.st, 64);
    const __mmask16 valid =
        static_cast<__mmask16>((1u << std::min<int64_t>(16, len - t0)) - 1u);
    for (int64_t n = 0; n < group; ++n) {
      const __m512 s = _mm512_mul_ps(
          _mm512_i32gather_ps(_mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(n))),
                              w.st, 4), scale_v);
      _mm512_storeu_ps(w.scores.data() + n * stride + t0, s);
      peak[n] = _mm512_mask_max_ps(peak[n], valid, peak[n], s);
    }
  }
  for (int64_t n = 0; n < group; ++n) w.peaks[n] = _mm512_reduce_max_ps(peak[n]);
}

// The B tiles of value pieces [piece0, piece0 + 4) for tokens [t0, t0 + 32), zero past len.
template <int CH>
void value_tiles(const at::BFloat16* v_head, const int64_t* rows, int64_t len, int64_t t0,
                 int64_t piece0, Scratch& w) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j = 0; j < 16; ++j) {
    const int64_t a = t0 + 2 * j, b = a + 1;
    for (int64_t c = 0; c < 2; ++c) {  // the two 32-dim chunks of these pieces
      const int64_t dim0 = 16 * piece0 + 32 * c;
      const __m512i va = a < len ? _mm512_loadu_si512(v_head + rows[a] + dim0) : zero;
      const __m512i vb = b < len ? _mm512_loadu_si512(v_head + rows[b] + dim0) : zero;
      _mm512_storeu_si512(w.vt.data() + ((2 * c) * 16 + j) * 32, _mm512_unpacklo_epi16(va, vb));
      _mm512_storeu_si512(w.vt.data() + ((2 * c + 1) * 16 + j) * 32,
                          _mm512_unpackhi_epi16(va, vb));
    }
  }
}

// acc [16][dim] (permuted dims) = probabilities x values over tokens [0, stride).
template <int CH>
void values(const at::BFloat16* v_head, const int64_t* rows, int64_t len, int64_t stride,
            Scratch& w) {
  constexpr int64_t dim = 16 * CH;
  for (int64_t piece0 = 0; piece0 < CH; piece0 += 4) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t t0 = 0; t0 < stride; t0 += 32) {
      value_tiles<CH>(v_head, rows, len, t0, piece0, w);
      _tile_loadd(4, w.probs.data() + t0, stride * 2);
      _tile_loadd(6, w.vt.data(), 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(6, w.vt.data() + 16 * 32, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(6, w.vt.data() + 2 * 16 * 32, 64);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(6, w.vt.data() + 3 * 16 * 32, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
    for (int q = 0; q < 4; ++q) {
      float* at = w.acc.data() + 16 * (piece0 + q);
      if (q == 0) _tile_stored(0, at, dim * 4);
      if (q == 1) _tile_stored(1, at, dim * 4);
      if (q == 2) _tile_stored(2, at, dim * 4);
      if (q == 3) _tile_stored(3, at, dim * 4);
    }
  }
}

// One KV head of one sequence's decode token: q rows [group][dim] at q (head stride q_s1), out
// likewise. Tiles must be configured 16 rows x 64 bytes (varlen_bf16::configure_tiles(16)).
template <int CH>
void head_task(const at::BFloat16* q, int64_t q_s1, const at::BFloat16* k_head,
               const at::BFloat16* v_head, const int64_t* rows, int64_t len, int64_t row_stride,
               int64_t group, float scale, at::BFloat16* out, int64_t o_s1, Scratch& w) {
  constexpr int64_t dim = 16 * CH, HALF = dim / 2;
  const int64_t stride = (len + 31) / 32 * 32;
  w.qt.assign(HALF * 16, 0);
  for (int64_t n = 0; n < group; ++n) {
    const f32_bits* qn = reinterpret_cast<const f32_bits*>(q + n * q_s1);
    for (int64_t p = 0; p < HALF; ++p) w.qt[p * 16 + n] = qn[p];  // [pair][head]
  }
  w.scores.resize(group * stride);
  w.probs.assign(16 * stride, at::BFloat16(0.f));
  w.acc.resize(16 * dim);
  w.peaks.resize(group);
  w.totals.resize(group);
  w.vt.resize(4 * 16 * 32);
  scores<CH>(k_head, rows, len, row_stride, group, stride, scale, w);
  for (int64_t n = 0; n < group; ++n)
    w.totals[n] = bf16_prefill::row_probabilities(w.scores.data() + n * stride, w.peaks[n], len,
                                                  stride, w.probs.data() + n * stride);
  values<CH>(v_head, rows, len, stride, w);
  alignas(64) float row[dim];
  for (int64_t n = 0; n < group; ++n) {
    bf16_decode::unpermute(w.acc.data() + n * dim, dim, 1.f / w.totals[n], row);
    store_row(out + n * o_s1, row, dim);
  }
}

}  // namespace amx_decode

#endif  // SPLITSERVE_AMX_BF16
