// Skinny bfloat16 linear layers for AVX512-BF16 CPUs (included by cpu_ops.cpp).
//
// The bfloat16 twin of skinny_linear_f32.h. oneDNN's bfloat16 kernels lose most of the memory
// bandwidth on the few rows of a decode step on some CPUs: on the 2-core AVX512-BF16 EPYC, one
// row through the 30 layers' weights took 14 ms (about 19 GB/s, where the machine reads 30-58).
// Here the weight is packed for VDPBF16PS ([ceil(N/32)][K/2][32][2]: for each pair of input
// features, 32 consecutive outputs, the pair adjacent), so one instruction multiplies a row's
// input pair, broadcast, by 16 outputs' weight pairs and adds both products into float32 sums.
// Up to kRowTile rows x 32 outputs stay in registers; threads split the output blocks; each row
// tile passes over one 8 KB slice of a block before the next slice, so the weights stream once,
// the next slice prefetched into L2 meanwhile.
// Sums are float32; the output is rounded once to bfloat16 (nearest even), bias added first.

#if defined(__AVX512BF16__)
#define SPLITSERVE_SKINNY_BF16 1
namespace skinny_bf16 {

constexpr int64_t kCols = 32;      // outputs per packed block: two 16-lane vectors
constexpr int64_t kRowTile = 8;    // rows per register tile: 16 accumulators + 3 operands
constexpr int64_t kSlicePairs = 64;  // input pairs per slice: 64 x 32 x 2 x 2 B = 8 KB

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight: 2-d bfloat16");
  TORCH_CHECK(weight.size(1) % 2 == 0, "the bfloat16 skinny kernel needs an even in_features");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + kCols - 1) / kCols;
  at::Tensor packed = at::zeros({blocks, k / 2, kCols, 2}, w.options());
  const at::BFloat16* src = w.data_ptr<at::BFloat16>();
  at::BFloat16* dst = packed.data_ptr<at::BFloat16>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t c = 0; c < kCols && b * kCols + c < n; ++c) {
        const at::BFloat16* row = src + (b * kCols + c) * k;
        at::BFloat16* out = dst + b * k * kCols + 2 * c;
        for (int64_t i = 0; i < k; ++i) out[(i / 2) * 2 * kCols + i % 2] = row[i];
      }
  });
  return packed;
}

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// sums[r, 0:32] += x[r, 2 p0 : 2 p1] . block[p0:p1] for R rows (sums: R x 32 float32).
template <int R, bool kPrefetch>
inline void tile(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* block, int64_t p0,
                 int64_t p1, float* sums) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    lo[r] = _mm512_loadu_ps(sums + r * kCols);
    hi[r] = _mm512_loadu_ps(sums + r * kCols + 16);
  }
  for (int64_t p = p0; p < p1; ++p) {
    // With several row tiles, the same pair's two lines one slice ahead, into L2: the weights
    // stream from DRAM, and without this the row tiles of a slice waited on them (at 16-32
    // rows, 14.9 -> 11.4 and 24.0 -> 20.1 ms for the 30 layers on the fifth session's Zen 4
    // VM). Past the block's end it fetches the next block, which the same thread most likely
    // takes next. One row tile streams a slice once, which the hardware prefetcher follows.
    if constexpr (kPrefetch) {
      const char* ahead = reinterpret_cast<const char*>(block + (p + kSlicePairs) * 2 * kCols);
      _mm_prefetch(ahead, _MM_HINT_T1);
      _mm_prefetch(ahead + 64, _MM_HINT_T1);
    }
    const __m512bh w0 = as_bh(_mm512_loadu_si512(block + p * 2 * kCols));
    const __m512bh w1 = as_bh(_mm512_loadu_si512(block + p * 2 * kCols + kCols));
    for (int r = 0; r < R; ++r) {
      // The row's input pair (2p, 2p + 1) as one 32-bit word, in every lane.
      const f32_bits pair = *reinterpret_cast<const f32_bits*>(x + r * x_stride + 2 * p);
      const __m512bh xv = as_bh(_mm512_set1_epi32(static_cast<int>(pair)));
      lo[r] = _mm512_dpbf16_ps(lo[r], xv, w0);
      hi[r] = _mm512_dpbf16_ps(hi[r], xv, w1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(sums + r * kCols, lo[r]);
    _mm512_storeu_ps(sums + r * kCols + 16, hi[r]);
  }
}

template <bool kPrefetch>
inline void tile_rows(int64_t rows, const at::BFloat16* x, int64_t x_stride,
                      const at::BFloat16* block, int64_t p0, int64_t p1, float* sums) {
  with_row_count<kRowTile>(rows, [&](auto r) {
    tile<decltype(r)::value, kPrefetch>(x, x_stride, block, p0, p1, sums);
  });
}

// out [M, N] = x [M, K] @ weight^T (+ bias), weight given as pack(weight); bias may be empty.
void linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
              packed.scalar_type() == at::kBFloat16, "bfloat16 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.is_contiguous(), "x rows, out contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), pairs = k / 2;
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) == pairs && k % 2 == 0 &&
              packed.size(0) * kCols >= n && out.size(0) == m,
              "shapes do not match the packed weight");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == n && bias.is_contiguous() &&
                                    bias.scalar_type() == at::kBFloat16), "bias: [N] bfloat16");
  const auto sweep = [&](auto tile_fn) {
    sweep_blocks<at::BFloat16, kCols, kRowTile>(
        x.data_ptr<at::BFloat16>(), x.stride(0), m, packed.data_ptr<at::BFloat16>(), k, n, pairs,
        kSlicePairs, bias.numel() ? bias.data_ptr<at::BFloat16>() : nullptr,
        out.data_ptr<at::BFloat16>(), tile_fn);
  };
  if (m > kRowTile)
    sweep([](auto... a) { tile_rows<true>(a...); });
  else
    sweep([](auto... a) { tile_rows<false>(a...); });
}

}  // namespace skinny_bf16
#endif  // __AVX512BF16__
