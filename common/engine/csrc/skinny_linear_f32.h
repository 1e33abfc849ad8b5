// Skinny float32 linear layers for AVX2 CPUs (included by cpu_ops.cpp).
//
// A decode step multiplies a few rows (one per sequence) by every weight matrix. oneDNN's AVX2
// float32 kernels are slow there: on the 2-core AVX2 EPYC, 576x3072 took 200 us at one row and
// 640-750 us at two to four rows, where reading the 7 MB weight takes about 300 us. This kernel
// reads each weight once, from a layout packed for it ([ceil(N/16)][K][16]: for each input
// feature, 16 consecutive outputs), and keeps the sums of up to six rows x 16 outputs in
// registers: per input feature, two weight loads, one broadcast per row, two FMAs per row.
// Threads split the output blocks.

#if defined(__AVX2__) && defined(__FMA__)
#define SPLITSERVE_SKINNY_F32 1
namespace skinny_f32 {

constexpr int64_t kCols = 16;     // outputs per packed block: two 8-lane vectors
constexpr int64_t kRowTile = 6;   // rows per register tile: 12 accumulators + 3 operands

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "weight: 2-d float32");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + kCols - 1) / kCols;
  at::Tensor packed = at::zeros({blocks, k, kCols}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t c = 0; c < kCols && b * kCols + c < n; ++c) {
        const float* row = src + (b * kCols + c) * k;
        float* out = dst + b * k * kCols + c;
        for (int64_t i = 0; i < k; ++i) out[i * kCols] = row[i];
      }
  });
  return packed;
}

// sums[r, 0:16] += x[r, k0:k1] . block[k0:k1] for R rows (sums: R x 16, unaligned).
template <int R>
inline void tile(const float* x, int64_t x_stride, const float* block, int64_t k0, int64_t k1,
                 float* sums) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    lo[r] = _mm256_loadu_ps(sums + r * kCols);
    hi[r] = _mm256_loadu_ps(sums + r * kCols + 8);
  }
  for (int64_t i = k0; i < k1; ++i) {
    const __m256 w0 = _mm256_loadu_ps(block + i * kCols);
    const __m256 w1 = _mm256_loadu_ps(block + i * kCols + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + i);
      lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(sums + r * kCols, lo[r]);
    _mm256_storeu_ps(sums + r * kCols + 8, hi[r]);
  }
}

inline void tile_rows(int64_t rows, const float* x, int64_t x_stride, const float* block,
                      int64_t k0, int64_t k1, float* sums) {
  with_row_count<kRowTile>(rows, [&](auto r) {
    tile<decltype(r)::value>(x, x_stride, block, k0, k1, sums);
  });
}

// out [M, N] = x [M, K] @ weight^T (+ bias), weight given as pack(weight); bias may be empty.
// Row tiles sweep slices of kSlice input features (8 KB of a block) at a time.
void linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.is_contiguous(), "x rows, out contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK(packed.size(1) == k && packed.size(0) * kCols >= n && out.size(0) == m,
              "shapes do not match the packed weight");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == n && bias.is_contiguous()), "bias: [N]");
  constexpr int64_t kSlice = 128;
  sweep_blocks<float, kCols, kRowTile>(x.data_ptr<float>(), x.stride(0), m,
                                       packed.data_ptr<float>(), k, n, k, kSlice,
                                       bias.numel() ? bias.data_ptr<float>() : nullptr,
                                       out.data_ptr<float>(),
                                       [](auto... a) { tile_rows(a...); });
}

}  // namespace skinny_f32
#endif  // __AVX2__ && __FMA__
