// bfloat16 rows with AVX-512 (included by cpu_ops.cpp before the kernels that use it): the
// fused add + RMSNorm, SiLU-and-multiply and rotary for bfloat16, and exp16 for the attention
// kernels.
//
// The generic versions in cpu_ops.cpp convert each row to float32 scratch and make several
// passes over it (about 3.5 cycles per element on the Zen 4 VM); these keep 16 values per
// register from load to store, converting with VCVTNEPS2BF16 (round to nearest even). They
// round where the generic ones do: the residual sum and the normalized value to bfloat16
// before the weight multiply (transformers' casts), SiLU x up once at the end.
#pragma once

#if defined(__AVX512F__)
namespace bf16_rows {
inline __mmask16 tail_mask(int64_t n, int64_t i) {
  return n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
}

// fast_exp (cpu_ops.cpp) on 16 lanes: the same range reduction and polynomial, with the power of
// two applied by VSCALEFPS.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, k);
}

}  // namespace bf16_rows
#endif  // __AVX512F__

#if defined(__AVX512BF16__)

namespace bf16_rows {

inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m256i to_bf16(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }

inline void store16(at::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, to_bf16(v));
}

inline __m512 round16(__m512 v) {  // to bfloat16 and back
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

// out = round(round(h) / rms(h)) * w, h = round(x + residual) (then stored in residual) or x.
// out may be x.
inline void rms_norm_row(const at::BFloat16* x, at::BFloat16* residual, at::BFloat16* out,
                         const float* w, int64_t n, float eps) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n, i);
    __m512 h = load16(x + i, m);
    if (residual) {
      h = round16(_mm512_add_ps(h, load16(residual + i, m)));
      store16(residual + i, h, m);
    }
    squares = _mm512_fmadd_ps(h, h, squares);
  }
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(n) + eps);
  const __m512 inv_v = _mm512_set1_ps(inv);
  const at::BFloat16* h_row = residual ? residual : x;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n, i);
    const __m512 normed = round16(_mm512_mul_ps(load16(h_row + i, m), inv_v));
    store16(out + i, _mm512_mul_ps(normed, _mm512_maskz_loadu_ps(m, w + i)), m);
  }
}

// out[i] = silu(gate[i]) * up[i] for one row whose gate and up halves are `inter` wide.
inline void silu_and_mul_row(const at::BFloat16* gate, const at::BFloat16* up,
                             at::BFloat16* out, int64_t inter) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < inter; i += 16) {
    const __mmask16 m = tail_mask(inter, i);
    const __m512 g = load16(gate + i, m);
    const __m512 d = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    // 1 / d: VRCP14PS and one Newton step (relative error ~1e-8), cheaper than VDIVPS.
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
    store16(out + i, _mm512_mul_ps(_mm512_mul_ps(g, r), load16(up + i, m)), m);
  }
}

// One head of queries or keys rotated in place: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), where
// x1, x2 are the head's halves and c, s the position's float32 cos/sin rows of `half` values.
inline void rotary_row(at::BFloat16* v, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = tail_mask(half, i);
    const __m512 x1 = load16(v + i, m), x2 = load16(v + half + i, m);
    const __m512 cv = _mm512_maskz_loadu_ps(m, c + i), sv = _mm512_maskz_loadu_ps(m, s + i);
    store16(v + i, _mm512_fmsub_ps(x1, cv, _mm512_mul_ps(x2, sv)), m);
    store16(v + half + i, _mm512_fmadd_ps(x2, cv, _mm512_mul_ps(x1, sv)), m);
  }
}

}  // namespace bf16_rows

#endif  // __AVX512BF16__
