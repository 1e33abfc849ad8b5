// What the skinny linear kernels share (included by cpu_ops.cpp before them): the dispatch of a
// row count to a register tile, and the sweep over output blocks that calls the tiles.

// Calls fn(std::integral_constant<int, R>{}) with R = rows, or MaxR for more rows: the skinny
// kernels' register tiles take their row count as a template argument.
template <int MaxR, int R = 1, typename Fn>
inline void with_row_count(int64_t rows, Fn&& fn) {
  if constexpr (R == MaxR) {
    fn(std::integral_constant<int, R>{});
  } else {
    if (rows == R) return fn(std::integral_constant<int, R>{});
    with_row_count<MaxR, R + 1>(rows, std::forward<Fn>(fn));
  }
}

// out [M, N] (+ bias) from a weight packed in blocks of kCols outputs, each block `k * kCols`
// elements. Threads split the blocks. Every row tile passes over one slice (`slice` of the
// block's `steps` reduction steps) before the next slice is touched, so the weights stream from
// memory once, at one steady pace. tile_rows(rows, x, x_stride, block, s0, s1, sums) adds steps
// [s0, s1) of `rows` rows into float32 sums [rows, kCols]; results are rounded once to T.
template <typename T, int64_t kCols, int64_t kRowTile, typename TileRows>
void sweep_blocks(const T* xp, int64_t x_stride, int64_t m, const T* wp, int64_t k, int64_t n,
                  int64_t steps, int64_t slice, const T* bp, T* op, TileRows tile_rows) {
  const int64_t blocks = (n + kCols - 1) / kCols;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(m * kCols);
    for (int64_t b = begin; b < end; ++b) {
      const T* block = wp + b * k * kCols;
      std::fill(sums.begin(), sums.end(), 0.f);
      for (int64_t s0 = 0; s0 < steps; s0 += slice)
        for (int64_t r0 = 0; r0 < m; r0 += kRowTile)
          tile_rows(std::min(kRowTile, m - r0), xp + r0 * x_stride, x_stride, block, s0,
                    std::min(steps, s0 + slice), sums.data() + r0 * kCols);
      const int64_t col0 = b * kCols, cols = std::min(kCols, n - col0);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < cols; ++c)
          op[r * n + col0 + c] = T(sums[r * kCols + c] +
                                   (bp != nullptr ? static_cast<float>(bp[col0 + c]) : 0.f));
    }
  });
}
