// bfloat16 linear layers on AMX tiles, for the row counts of decode steps and small chunks
// (included by cpu_ops.cpp; built only where the compiler targets AMX-BF16).
//
// On a 2-core Intel Xeon with AMX (bfloat16 matmul 2.0-2.5 TFLOP/s, read 35 GB/s), oneDNN ran
// the default model's 30 layers of decode matmuls at 10-17 GB/s of weights for 1-32 rows
// (`python -m bench.linear_kernels`), and the VDPBF16PS skinny kernel was compute bound past
// one row (60 GFLOP/s at 8 rows). Here one TDPBF16PS multiplies a tile of up to 16 rows x 32
// inputs by 32 inputs x 16 outputs, so the FLOPs cost little and the weights stream once:
//   packing   weight [N, K] -> [N/32][K/32][2][16][32]: for each pair of 16-output blocks and
//             each 32-input step, two B tiles (16 input pairs x 16 outputs x 2, VNNI) that lie
//             next to each other, so an output pair's weights are one sequential stream;
//   tiles     tmm0-3 the float32 sums of 2 row groups x 2 output blocks, tmm4-5 the rows' inputs,
//             tmm6-7 the two weight tiles: each weight tile feeds both row groups;
//   threads   split the output pairs; rows beyond 32 loop inside an output pair, whose weights
//             (K / 32 x 2 KB) then come from L1/L2.
// K must be a multiple of 32 (others keep the VDPBF16PS kernel); N is padded to 32 with zeros.
// Sums are float32; the output is rounded once to bfloat16, bias added first.
#pragma once

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define SPLITSERVE_AMX_BF16 1
#include <sys/syscall.h>
#include <unistd.h>

namespace amx_bf16 {

constexpr int64_t kK = 32;     // inputs per tile step
constexpr int64_t kN = 16;     // outputs per B tile
constexpr int64_t kRows = 16;  // rows per A tile
constexpr int64_t kTileElems = kK * kN;
constexpr int64_t kPrefetchSteps = 4;  // weight tiles fetched this many steps (8 KB) ahead

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out AMX state only to processes that ask for it (once per process).
inline bool enable() {
  static const bool ok = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Tiles for a row group of r0 rows in tmm0/1/4 and r1 rows (may be 0) in tmm2/3/5.
inline void configure(int r0, int r1) {
  TileConfig cfg;
  const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(std::max(rows[t], 1));
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

at::Tensor pack(const at::Tensor& weight) {
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), pairs = (n + 2 * kN - 1) / (2 * kN);
  at::Tensor packed = at::zeros({pairs, k / kK, 2, kK / 2, 2 * kN}, w.options());
  const at::BFloat16* src = w.data_ptr<at::BFloat16>();
  at::BFloat16* dst = packed.data_ptr<at::BFloat16>();
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < 2 * kN && p * 2 * kN + c < n; ++c) {
        const at::BFloat16* row = src + (p * 2 * kN + c) * k;
        const int64_t half = c / kN, col = c % kN;
        for (int64_t i = 0; i < k; ++i) {
          const int64_t step = i / kK, within = i % kK;
          dst[(((p * (k / kK) + step) * 2 + half) * (kK / 2) + within / 2) * 2 * kN +
              col * 2 + within % 2] = row[i];
        }
      }
  });
  return packed;
}

// Writes float32 sums [rows, 32] (+ bias) into out rows of bfloat16 (rounded once) or float32
// (the logits, which the sampler reads in float32), `cols` valid columns.
template <typename Out>
inline void write_rows(const float* sums, int64_t rows, const at::BFloat16* bias, int64_t cols,
                       Out* out, int64_t out_stride) {
  const __mmask16 lo = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 hi = cols >= 32 ? 0xFFFF
                       : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
        _mm256_maskz_loadu_epi16(lo, bias)), 16));
    b1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
        _mm256_maskz_loadu_epi16(hi, bias + 16)), 16));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 s0 = _mm512_add_ps(_mm512_loadu_ps(sums + r * 32), b0);
    const __m512 s1 = _mm512_add_ps(_mm512_loadu_ps(sums + r * 32 + 16), b1);
    if constexpr (std::is_same_v<Out, float>) {
      _mm512_mask_storeu_ps(out + r * out_stride, lo, s0);
      _mm512_mask_storeu_ps(out + r * out_stride + 16, hi, s1);
    } else {
      _mm256_mask_storeu_epi16(out + r * out_stride, lo, (__m256i)_mm512_cvtneps_pbh(s0));
      _mm256_mask_storeu_epi16(out + r * out_stride + 16, hi, (__m256i)_mm512_cvtneps_pbh(s1));
    }
  }
}

// sums [32 x 32] float32 = rows [r0, r0 + rows) of x times one output pair's packed weights.
inline void pair_rows(const at::BFloat16* x, int64_t x_stride, int64_t rows,
                      const at::BFloat16* w, int64_t steps, float* sums) {
  const int64_t a_stride = x_stride * 2, b_stride = 2 * kN * 2;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const at::BFloat16* b = w + s * 2 * kTileElems;
    const char* ahead = reinterpret_cast<const char*>(b + kPrefetchSteps * 2 * kTileElems);
    for (int line = 0; line < 2 * kTileElems * 2 / 64; ++line)
      _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    _tile_loadd(6, b, b_stride);
    _tile_loadd(7, b + kTileElems, b_stride);
    _tile_loadd(4, x + s * kK, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (rows > kRows) {
      _tile_loadd(5, x + kRows * x_stride + s * kK, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  // Row-major [32 rows][32 outputs]: block 0 in columns 0-15, block 1 in 16-31.
  _tile_stored(0, sums, 128);
  _tile_stored(1, sums + 16, 128);
  if (rows > kRows) {
    _tile_stored(2, sums + kRows * 32, 128);
    _tile_stored(3, sums + kRows * 32 + 16, 128);
  }
}

// out [M, N] = x [M, K] @ weight^T (+ bias), weight given as pack(weight); bias may be empty;
// out bfloat16 or float32.
void linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
            const at::Tensor& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
              (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "bfloat16 inputs, bfloat16 or float32 out");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.is_contiguous(), "x rows, out contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), steps = k / kK;
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == n && bias.is_contiguous() &&
                                    bias.scalar_type() == at::kBFloat16), "bias: [N] bfloat16");
  TORCH_CHECK(k % kK == 0 && packed.dim() == 5 && packed.size(1) == steps &&
              packed.size(0) * 2 * kN >= n && out.size(0) == m,
              "shapes do not match the packed weight");
  TORCH_CHECK(enable(), "the kernel did not grant this process AMX state");
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  const at::BFloat16* bp = bias.numel() ? bias.data_ptr<at::BFloat16>() : nullptr;
  const bool out_float = out.scalar_type() == at::kFloat;
  const int64_t x_stride = x.stride(0), pairs = (n + 2 * kN - 1) / (2 * kN);
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[2 * kRows * 2 * kN];
    int64_t configured = -1;
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col0 = p * 2 * kN;
      for (int64_t r0 = 0; r0 < m; r0 += 2 * kRows) {  // later groups find the weights in L1/L2
        const int64_t rows = std::min<int64_t>(2 * kRows, m - r0);
        if (rows != configured) {
          configure(static_cast<int>(std::min<int64_t>(rows, kRows)),
                    static_cast<int>(std::max<int64_t>(rows - kRows, 0)));
          configured = rows;
        }
        pair_rows(xp + r0 * x_stride, x_stride, rows, wp + p * steps * 2 * kTileElems, steps,
                  sums);
        const at::BFloat16* b = bp ? bp + col0 : nullptr;
        const int64_t cols = std::min<int64_t>(2 * kN, n - col0);
        if (out_float)
          write_rows(sums, rows, b, cols, out.data_ptr<float>() + r0 * n + col0, n);
        else
          write_rows(sums, rows, b, cols, out.data_ptr<at::BFloat16>() + r0 * n + col0, n);
      }
    }
    _tile_release();
  });
}

}  // namespace amx_bf16
#endif  // AMX-BF16
