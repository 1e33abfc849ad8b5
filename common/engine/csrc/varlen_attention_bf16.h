// Attention for a whole forward's flat batch in one call, bfloat16 on CPUs with AVX512-BF16
// (included by cpu_ops.cpp after decode_attention_bf16.h and prefill_attention_bf16.h).
//
// A forward holds decode tokens (one query token per sequence) and prefill chunks of several
// sequences. Calling a kernel per chunk per layer left threads idle at every call's tail and
// paid the call's set-up per sequence; here one call per layer does everything:
//   relay    every prefill sequence's context, per KV head and 16-token block, in the layouts
//            of prefill_attention_bf16.h, once (not once per tile), the blocks split across
//            threads;
//   tasks    decode sequences as the decode kernel's tasks (all KV heads of a sequence, or one
//            when there are few), prefill chunks as tiles of up to 16 tokens x one KV head's
//            query heads; sorted by cost, largest first, and handed to threads one at a time
//            from a shared counter, so the costs even out;
//   tiles    with AMX, scores and values are tile products (a tile of 16 query rows x 32 context
//            tokens per TDPBF16PS pair); else the VDPBF16PS register blocks of
//            prefill_attention_bf16.h.
#pragma once

#if defined(__AVX512BF16__)

#include <array>
#include <atomic>

namespace varlen_bf16 {

struct Batch {
  const at::BFloat16 *q, *k, *v;
  at::BFloat16* out;
  int64_t q_s0, q_s1, o_s0, o_s1, block_size, kv_heads, dim, group, row_stride;
  const int64_t *q_start, *q_len, *cached, *block_offsets, *block_ids;
  float scale;

  int64_t context(int64_t s) const { return cached[s] + q_len[s]; }
  // Element offsets of the KV rows of sequence s's first `len` context tokens.
  void rows(int64_t s, int64_t len, std::vector<int64_t>& out_rows) const {
    const int64_t* blocks = block_ids + block_offsets[s];
    out_rows.resize(len);
    for (int64_t t0 = 0, blk = 0; t0 < len; t0 += block_size, ++blk)
      for (int64_t t = t0, row = blocks[blk] * block_size * row_stride;
           t < std::min(t0 + block_size, len); ++t, row += row_stride)
        out_rows[t] = row;
  }
};

// Where each prefill sequence's re-laid context lives: per KV head, `blocks` 16-token blocks
// (an even count: AMX steps take 32 tokens) of keys and values.
struct Relaid {
  std::vector<f32_bits> keys;
  std::vector<at::BFloat16> values;
  std::vector<int64_t> key_at, value_at, blocks;  // per sequence (offsets of KV head 0)

  int64_t key_offset(int64_t s, int64_t g, int64_t dim) const {
    return key_at[s] + g * blocks[s] * dim / 2 * 16;
  }
  int64_t value_offset(int64_t s, int64_t g, int64_t dim) const {
    return value_at[s] + g * blocks[s] * 16 * dim;
  }
  const f32_bits* key(int64_t s, int64_t g, int64_t dim) const {
    return keys.data() + key_offset(s, g, dim);
  }
  const at::BFloat16* value(int64_t s, int64_t g, int64_t dim) const {
    return values.data() + value_offset(s, g, dim);
  }
};

struct Task {
  int64_t cost, seq, a, b;  // decode: (first KV head, span); tile: (first token, end token)
  int64_t head;             // tile: its KV head; decode: -1
};

#if defined(SPLITSERVE_AMX_BF16)
// Tiles 0-3: float32 sums (rows x 16), 4-5: A operands (rows x 32 bf16), 6-7: B (16 x 32).
inline void configure_tiles(int rows) {
  amx_bf16::TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(t < 6 ? rows : 16);
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Unscaled scores of query rows [r0, r0 + 16) (fewer as configured) against tokens [0, width),
// width a multiple of 32, into scores (row stride `stride` floats).
template <int CH>
void amx_scores(bf16_prefill::Tile& w, int64_t r0, int64_t width, int64_t stride) {
  constexpr int64_t HALF = 8 * CH;  // 32-bit words per query row
  const f32_bits* q = w.query.data() + r0 * HALF;
  float* out = w.scores.data() + r0 * stride;
  for (int64_t u = 0; u < width / 32; ++u) {
    const f32_bits* k0 = w.keys + 2 * u * HALF * 16;  // blocks 2u and 2u + 1
    const f32_bits* k1 = k0 + HALF * 16;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t h = 0; h < CH / 2; ++h) {  // 32 dims (16 pairs) at a time
      _tile_loadd(4, q + 16 * h, HALF * 4);
      _tile_loadd(6, k0 + 16 * 16 * h, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, k1 + 16 * 16 * h, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    _tile_stored(0, out + 32 * u, stride * 4);
    _tile_stored(1, out + 32 * u + 16, stride * 4);
  }
}

// acc rows [r0, r0 + 16) = probabilities x values over tokens [0, width), in the values'
// interleaved dim order (16 dims per tile: 4 tiles per pass over the tokens).
template <int CH>
void amx_values(bf16_prefill::Tile& w, int64_t r0, int64_t width, int64_t stride) {
  constexpr int64_t dim = 16 * CH;
  const at::BFloat16* p = w.probs.data() + r0 * stride;
  float* acc = w.acc.data() + r0 * dim;
  for (int64_t piece = 0; piece < CH; piece += 4) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t u = 0; u < width / 32; ++u) {
      const at::BFloat16* v = w.values + 16 * u * 2 * dim + 32 * piece;  // pair rows 16u..
      _tile_loadd(4, p + 32 * u, stride * 2);
      _tile_loadd(6, v, 4 * dim);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, v + 32, 4 * dim);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(6, v + 64, 4 * dim);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(7, v + 96, 4 * dim);
      _tile_dpbf16ps(3, 4, 7);
    }
    _tile_stored(0, acc + 16 * piece, dim * 4);
    _tile_stored(1, acc + 16 * piece + 16, dim * 4);
    _tile_stored(2, acc + 16 * piece + 32, dim * 4);
    _tile_stored(3, acc + 16 * piece + 48, dim * 4);
  }
}

// The largest of a row's first len (unscaled) scores.
inline float row_peak(const float* s, int64_t len) {
  __m512 peak = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(16, len - t)) - 1u);
    peak = _mm512_mask_max_ps(peak, valid, peak, _mm512_loadu_ps(s + t));
  }
  return _mm512_reduce_max_ps(peak);
}

// Rows [0, nrows) of a tile through AMX, 16 at a time.
template <int CH>
void amx_rows(bf16_prefill::Tile& w, int64_t nrows, int64_t stride, float scale) {
  for (int64_t r0 = 0; r0 < nrows; r0 += 16) {
    const int64_t nr = std::min<int64_t>(16, nrows - r0);
    const int64_t width = (w.lens[r0 + nr - 1] + 31) / 32 * 32;  // the last row sees the most
    configure_tiles(static_cast<int>(nr));
    amx_scores<CH>(w, r0, width, stride);
    for (int64_t r = r0; r < r0 + nr; ++r) {
      const float* s = w.scores.data() + r * stride;  // unscaled: scale > 0 keeps the peak
      w.totals[r] = bf16_prefill::row_probabilities(s, row_peak(s, w.lens[r]), w.lens[r], width,
                                                     w.probs.data() + r * stride, scale);
    }
    amx_values<CH>(w, r0, width, stride);
  }
}
#endif  // SPLITSERVE_AMX_BF16

// Tile rows through the VDPBF16PS register blocks (rows padded to their block sizes).
template <int CH>
void vector_rows(bf16_prefill::Tile& w, int64_t nrows, int64_t stride, float scale) {
  constexpr int VR = 24 / CH;
  for (int64_t r0 = 0; r0 < nrows; r0 += bf16_prefill::SR)
    bf16_prefill::score_rows<CH>(w, r0, stride, scale, &w.peaks[r0]);
  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t width = (w.lens[(r / VR + 1) * VR - 1] + 15) / 16 * 16;  // its VR block's
    w.totals[r] = bf16_prefill::row_probabilities(w.scores.data() + r * stride, w.peaks[r],
                                                  w.lens[r], width, w.probs.data() + r * stride);
  }
  for (int64_t r0 = 0; r0 < nrows; r0 += VR) bf16_prefill::weigh_values<CH, VR>(w, r0, stride);
}

inline bool use_amx() {
#if defined(SPLITSERVE_AMX_BF16)
  return amx_bf16::enable();
#else
  return false;
#endif
}

// One tile: chunk tokens [i0, i1) of sequence s x the query heads of KV head g; rows
// token-major, so a row block's last row sees the most context.
template <int CH>
void tile_task(const Batch& bt, const Relaid& relaid, int64_t s, int64_t g, int64_t i0,
               int64_t i1, bool amx, bf16_prefill::Tile& w) {
  constexpr int64_t dim = 16 * CH, HALF = dim / 2;
  constexpr int64_t PAD = bf16_prefill::SR * (24 / CH) / std::gcd(bf16_prefill::SR, 24 / CH);
  const int64_t group = bt.group, cached = bt.cached[s];
  const int64_t real = (i1 - i0) * group, nrows = amx ? real : (real + PAD - 1) / PAD * PAD;
  const int64_t stride = (cached + i1 + 31) / 32 * 32;
  w.keys = relaid.key(s, g, dim);
  w.values = relaid.value(s, g, dim);
  w.query.assign(nrows * HALF, 0);
  w.lens.resize(nrows);
  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t i = r < real ? i0 + r / group : i1 - 1;  // padding rows copy the last length
    w.lens[r] = cached + i + 1;
    if (r < real)
      std::memcpy(w.query.data() + r * HALF,
                  bt.q + (bt.q_start[s] + i) * bt.q_s0 + (g * group + r % group) * bt.q_s1,
                  dim * sizeof(at::BFloat16));
  }
  w.scores.resize(nrows * stride);
  w.probs.resize(nrows * stride);
  w.totals.resize(nrows);
  w.acc.resize(nrows * dim);
  w.peaks.resize(nrows);
#if defined(SPLITSERVE_AMX_BF16)
  if (amx) amx_rows<CH>(w, nrows, stride, bt.scale);
  else vector_rows<CH>(w, nrows, stride, bt.scale);
#else
  vector_rows<CH>(w, nrows, stride, bt.scale);
#endif
  alignas(64) float row[dim];
  for (int64_t r = 0; r < real; ++r) {
    bf16_decode::unpermute(w.acc.data() + r * dim, dim, 1.f / w.totals[r], row);
    store_row(bt.out + (bt.q_start[s] + i0 + r / group) * bt.o_s0 +
                  (g * group + r % group) * bt.o_s1, row, dim);
  }
}

// Re-lays every prefill sequence's context (sequences with more than one query token), the
// (sequence, KV head, block) units split across threads.
template <int CH>
Relaid relay(const Batch& bt, const std::vector<int64_t>& prefills,
             const std::vector<std::vector<int64_t>>& rows) {
  constexpr int64_t dim = 16 * CH, HALF = dim / 2;
  Relaid r;
  std::vector<std::array<int64_t, 3>> units;  // (sequence, KV head, block)
  int64_t keys = 0, values = 0;
  r.key_at.assign(rows.size(), 0);
  r.value_at.assign(rows.size(), 0);
  r.blocks.assign(rows.size(), 0);
  for (int64_t s : prefills) {
    const int64_t blocks = 2 * ((bt.context(s) + 31) / 32);
    r.key_at[s] = keys;
    r.value_at[s] = values;
    r.blocks[s] = blocks;
    keys += bt.kv_heads * blocks * HALF * 16;
    values += bt.kv_heads * blocks * 16 * dim;
    for (int64_t g = 0; g < bt.kv_heads; ++g)
      for (int64_t b = 0; b < blocks; ++b) units.push_back({s, g, b});
  }
  r.keys.resize(keys);
  r.values.resize(values);
  at::parallel_for(0, static_cast<int64_t>(units.size()), 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [s, g, b] = units[i];
      bf16_prefill::relay_block<CH>(bt.k + g * dim, bt.v + g * dim, rows[s].data(),
                                    bt.context(s), b,
                                    r.keys.data() + r.key_offset(s, g, dim) + b * HALF * 16,
                                    r.values.data() + r.value_offset(s, g, dim) + b * 16 * dim);
    }
  });
  return r;
}

// The forward's tasks, largest first: decode sequences by (sequence, KV head span), prefill
// chunks by (sequence, KV head, tile of tokens).
inline std::vector<Task> plan_tasks(const Batch& bt, int64_t num_seqs, int64_t threads) {
  std::vector<Task> tasks;
  int64_t decodes = 0, prefill_tokens = 0;
  for (int64_t s = 0; s < num_seqs; ++s)
    (bt.q_len[s] == 1 ? decodes : prefill_tokens) += bt.q_len[s];
  // Many decode sequences: one task covers all KV heads of one (reads whole KV rows).
  const int64_t span = decodes >= 2 * threads ? bt.kv_heads : 1;
  // Few prefill tokens: smaller tiles, so the threads have enough tasks to share.
  const int64_t tile = std::clamp<int64_t>(prefill_tokens * bt.kv_heads / (4 * threads), 1,
                                           bf16_prefill::MAX_TILE_TOKENS);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = bt.context(s);
    if (bt.q_len[s] == 1) {
      for (int64_t h = 0; h < bt.kv_heads; h += span)
        tasks.push_back({len * span * bt.group, s, h, span, -1});
      continue;
    }
    for (int64_t i0 = 0; i0 < bt.q_len[s]; i0 += tile) {
      const int64_t i1 = std::min(bt.q_len[s], i0 + tile);
      for (int64_t g = 0; g < bt.kv_heads; ++g)
        tasks.push_back({(i1 - i0) * bt.group * (bt.cached[s] + i1), s, i0, i1, g});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& x, const Task& y) { return x.cost > y.cost; });
  return tasks;
}

template <int CH>
void run(const Batch& bt, int64_t num_seqs, bool tiles) {
  const int64_t threads = at::get_num_threads();
  std::vector<std::vector<int64_t>> rows(num_seqs);
  std::vector<int64_t> prefills;
  for (int64_t s = 0; s < num_seqs; ++s)
    if (bt.q_len[s] > 1) {
      prefills.push_back(s);
      bt.rows(s, bt.context(s), rows[s]);
    }
  const Relaid relaid = relay<CH>(bt, prefills, rows);
  const std::vector<Task> tasks = plan_tasks(bt, num_seqs, threads);
  const int64_t count = static_cast<int64_t>(tasks.size());
  const bool amx = tiles && use_amx();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, count), 1, [&](int64_t, int64_t) {
    bf16_prefill::Tile tile;
    bf16_decode::Scratch scratch;
    std::vector<int64_t> own_rows;
    bool tiles_used = false;
    for (int64_t i = next++; i < count; i = next++) {
      const Task& t = tasks[i];
      if (t.head >= 0) {
        tile_task<CH>(bt, relaid, t.seq, t.head, t.a, t.b, amx, tile);
        tiles_used = true;
        continue;
      }
      const int64_t len = bt.context(t.seq);
      bt.rows(t.seq, len, own_rows);
      const at::BFloat16* q = bt.q + bt.q_start[t.seq] * bt.q_s0;
      at::BFloat16* out = bt.out + bt.q_start[t.seq] * bt.o_s0;
      bf16_decode::decode_task<CH>(q, bt.q_s1, bt.k, bt.v, own_rows.data(), len, t.a, t.b,
                                   bt.group, bt.scale, out, bt.o_s1, scratch);
    }
#if defined(SPLITSERVE_AMX_BF16)
    if (tiles_used && amx) _tile_release();
#endif
  });
}

}  // namespace varlen_bf16

#endif  // __AVX512BF16__
