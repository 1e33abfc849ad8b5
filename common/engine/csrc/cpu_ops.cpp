// CPU kernels for the engine's fast path (bfloat16/float16/float32), built on first use.
//
// What torch's eager ops do in several passes and allocations, each of these does in one pass:
//   rms_norm            out = weight * normalize(x)
//   fused_add_rms_norm  residual += x; x = weight * normalize(residual)     (in place)
//   rotary_neox         x = rotate(x, cos[pos], sin[pos]) for every head    (in place)
//   silu_and_mul        out = silu(x[:, :I]) * x[:, I:]
//   skinny_linear       linear for a few rows: float32 on AVX2 (skinny_linear_f32.h), bfloat16
//                       on AVX512-BF16 (skinny_linear_bf16.h)
//   store_kv            new tokens' keys and values into their cache slots
//   paged_decode_attention  one query token per sequence against its paged KV blocks, read
//                           where they lie (no gather), grouped-query heads sharing each KV read
//                           (decode_attention_generic.h; bfloat16 on AVX512-BF16 CPUs takes
//                           decode_attention_bf16.h)
//   sample_rows         one token per logits row: temperature, top-k, top-p, min-p (sampling.h)
//   paged_prefill_attention  a prefill chunk of one sequence, causal over its cached context
//                           (prefill_attention_bf16.h on AVX512-BF16, else row by row through
//                           the decode kernel)
//   paged_attention     a whole forward's decodes and prefill chunks in one call
//                           (varlen_attention_bf16.h, AVX512-BF16 with AMX tiles where present)
// bfloat16 norms and SiLU on AVX512-BF16 take elementwise_bf16.h.
// All arithmetic is in float32; results are rounded once to the tensor's dtype.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// Rows are converted to float32 scratch and back with plain integer arithmetic on the raw
// 16-bit words, so the loops vectorize (loads of c10::BFloat16 objects do not). The integer views
// of float memory are declared may_alias: under strict aliasing the compiler could otherwise
// drop float stores that only these views read.
using f32_bits = uint32_t __attribute__((__may_alias__));
using bf16_bits = uint16_t __attribute__((__may_alias__));
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void load_row<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  const bf16_bits* raw = reinterpret_cast<const bf16_bits*>(src);
  f32_bits* out = reinterpret_cast<f32_bits*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(raw[i]) << 16;
}

template <typename T>
inline void store_row(T* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

template <>
inline void store_row<at::BFloat16>(at::BFloat16* dst, const float* src, int64_t n) {
  const f32_bits* bits = reinterpret_cast<const f32_bits*>(src);
  bf16_bits* raw = reinterpret_cast<bf16_bits*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = bits[i];
    const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;  // nearest-even
    raw[i] = static_cast<uint16_t>((b & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
  }
}

// Round float values to T's precision and back (mirrors transformers' intermediate casts).
template <typename T>
inline void round_row(float* row, int64_t n, T* scratch) {
  store_row(scratch, row, n);
  load_row(scratch, row, n);
}

// exp(x) by range reduction and a degree-6 polynomial (Cephes expf, relative error ~1e-7).
// Unlike std::exp it vectorizes, which makes softmax and SiLU memory-bound instead of exp-bound.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

#include "elementwise_bf16.h"

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps,
                   at::Tensor* residual) {
  const int64_t rows = x.size(0), n = x.size(1);
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  const int64_t res_stride = residual ? residual->stride(0) : 0;
  T* out_ptr = out.data_ptr<T>();
  const T* x_ptr = x.data_ptr<T>();
  T* res_ptr = residual ? residual->data_ptr<T>() : nullptr;
  std::vector<float> w(n);
  load_row(weight.data_ptr<T>(), w.data(), n);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        bf16_rows::rms_norm_row(x_ptr + r * x_stride, res_ptr ? res_ptr + r * res_stride : nullptr,
                                out_ptr + r * out_stride, w.data(), n, static_cast<float>(eps));
    });
    return;
  }
#endif
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(n), other(n);
    std::vector<T> scratch(n);
    for (int64_t r = begin; r < end; ++r) {
      load_row(x_ptr + r * x_stride, row.data(), n);
      if (res_ptr) {  // residual += x, rounded to T as transformers' add is
        T* rr = res_ptr + r * res_stride;
        load_row(rr, other.data(), n);
        for (int64_t i = 0; i < n; ++i) row[i] += other[i];
        store_row(rr, row.data(), n);
        load_row(rr, row.data(), n);
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) sum += row[i] * row[i];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + static_cast<float>(eps));
      for (int64_t i = 0; i < n; ++i) row[i] *= inv;
      round_row(row.data(), n, scratch.data());  // normalized value in T, then times weight
      for (int64_t i = 0; i < n; ++i) row[i] *= w[i];
      store_row(out_ptr + r * out_stride, row.data(), n);
    }
  });
}

template <typename T>
void rotary_impl(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                 const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  T* base = x.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cos_ptr = cos.data_ptr<float>();
  const float* sin_ptr = sin.data_ptr<float>();
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h)
          bf16_rows::rotary_row(base + t * s0 + h * s1, cos_ptr + pos[t] * half,
                                sin_ptr + pos[t] * half, half);
    });
    return;
  }
#endif
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> in(dim), out(dim);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_ptr + pos[t] * half;
      const float* s = sin_ptr + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = base + t * s0 + h * s1;
        load_row(v, in.data(), dim);
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          out[i] = in[i] * c[i] - in[i + half] * s[i];
          out[i + half] = in[i + half] * c[i] + in[i] * s[i];
        }
        store_row(v, out.data(), dim);
      }
    }
  });
}

template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  const T* in = x.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t in_stride = x.stride(0), out_stride = out.stride(0);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        bf16_rows::silu_and_mul_row(in + r * in_stride, in + r * in_stride + inter,
                                    o + r * out_stride, inter);
    });
    return;
  }
#endif
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(inter), up(inter);
    for (int64_t r = begin; r < end; ++r) {
      load_row(in + r * in_stride, gate.data(), inter);
      load_row(in + r * in_stride + inter, up.data(), inter);
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) gate[i] = gate[i] / (1.f + fast_exp(-gate[i])) * up[i];
      store_row(o + r * out_stride, gate.data(), inter);
    }
  });
}

#include "decode_attention_generic.h"
#include "decode_attention_bf16.h"
#include "prefill_attention_bf16.h"
#include "skinny_linear_common.h"
#include "skinny_linear_f32.h"
#include "skinny_linear_bf16.h"
#include "amx_linear_bf16.h"
#include "varlen_attention_bf16.h"
#include "sampling.h"

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

}  // namespace

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm",
                                  [&] { rms_norm_impl<scalar_t>(out, x, weight, eps, nullptr); });
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms",
                                  [&] { rms_norm_impl<scalar_t>(x, x, weight, eps, &residual); });
}

void rotary_neox(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin) {
  check_rows(x, "x");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous(), "cos: contiguous float32");
  TORCH_CHECK(sin.scalar_type() == at::kFloat && sin.is_contiguous(), "sin: contiguous float32");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_neox",
                                  [&] { rotary_impl<scalar_t>(x, positions, cos, sin); });
}

void silu_and_mul(at::Tensor out, at::Tensor x) {
  check_rows(x, "x");
  check_rows(out, "out");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul",
                                  [&] { silu_and_mul_impl<scalar_t>(out, x); });
}

// Writes the new tokens' keys and values [n, kv_heads, head_dim] (each token's heads adjacent,
// as in a slice of the fused qkv projection) into the cache slots `slots` (int64 [n]): one
// memcpy per row, where two index_copy_ calls cost about 20 us each per layer.
void store_kv(at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots, at::Tensor k,
              at::Tensor v) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots: contiguous int64");
  const int64_t n = slots.numel(), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == n && t->size(1) * t->size(2) == row &&
                    t->stride(2) == 1 && (t->size(1) == 1 || t->stride(1) == t->size(2)) &&
                    t->scalar_type() == k_cache.scalar_type(),
                "keys/values: [n, kv_heads, head_dim] in the cache's dtype, heads adjacent");
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  const size_t bytes = row * k_cache.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t k_step = k.stride(0) * k.element_size(), v_step = v.stride(0) * v.element_size();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots, "slot ", slot[i], " outside the cache");
    std::memcpy(kc + slot[i] * bytes, kp + i * k_step, bytes);
    std::memcpy(vc + slot[i] * bytes, vp + i * v_step, bytes);
  }
}

#include "attention_entry.h"

// Head dims the bfloat16 paged attention kernel handles on this build ([] without AVX512-BF16):
// there it also beats torch's attention for prefill chunks, which the runner then routes to it.
std::vector<int64_t> bf16_attention_head_dims() {
#if defined(__AVX512BF16__)
  return {std::begin(bf16_decode::HEAD_DIMS), std::end(bf16_decode::HEAD_DIMS)};
#else
  return {};
#endif
}

// The dtypes the skinny linear kernel handles on this build ("float32" on AVX2 with FMA,
// "bfloat16" on AVX512-BF16).
std::vector<std::string> skinny_linear_dtypes() {
  std::vector<std::string> dtypes;
#if defined(SPLITSERVE_SKINNY_F32)
  dtypes.push_back("float32");
#endif
#if defined(SPLITSERVE_SKINNY_BF16)
  dtypes.push_back("bfloat16");
#endif
  return dtypes;
}

at::Tensor skinny_pack(at::Tensor weight) {
#if defined(SPLITSERVE_AMX_BF16)  // AMX tiles where the input width is a multiple of 32
  if (weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
      weight.size(1) % amx_bf16::kK == 0 && amx_bf16::enable())
    return amx_bf16::pack(weight);
#endif
#if defined(SPLITSERVE_SKINNY_BF16)
  if (weight.scalar_type() == at::kBFloat16) return skinny_bf16::pack(weight);
#endif
#if defined(SPLITSERVE_SKINNY_F32)
  if (weight.scalar_type() == at::kFloat) return skinny_f32::pack(weight);
#endif
  TORCH_CHECK(false, "no skinny linear kernel for ", weight.scalar_type(), " on this build");
}

void skinny_linear(at::Tensor out, at::Tensor x, at::Tensor packed, at::Tensor bias) {
#if defined(SPLITSERVE_AMX_BF16)
  if (packed.dim() == 5) return amx_bf16::linear(out, x, packed, bias);
#endif
#if defined(SPLITSERVE_SKINNY_BF16)
  if (x.scalar_type() == at::kBFloat16) return skinny_bf16::linear(out, x, packed, bias);
#endif
#if defined(SPLITSERVE_SKINNY_F32)
  if (x.scalar_type() == at::kFloat) return skinny_f32::linear(out, x, packed, bias);
#endif
  TORCH_CHECK(false, "no skinny linear kernel for ", x.scalar_type(), " on this build");
}

// The kernels run without the GIL (they touch no Python object): while a forward runs, the
// instance's other threads (the KV server answering a decode instance's read, the transfer job
// thread, grammar compiles) get the interpreter at once instead of waiting for a switch
// interval at every kernel boundary.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("sample_rows", &sampling::sample, nogil);
  m.def("skinny_linear_dtypes", &skinny_linear_dtypes);
  m.def("skinny_pack", &skinny_pack, nogil);
  m.def("skinny_linear", &skinny_linear, nogil);
  m.def("bf16_attention_head_dims", &bf16_attention_head_dims);
  m.def("rms_norm", &rms_norm, nogil);
  m.def("fused_add_rms_norm", &fused_add_rms_norm, nogil);
  m.def("rotary_neox", &rotary_neox, nogil);
  m.def("silu_and_mul", &silu_and_mul, nogil);
  m.def("store_kv", &store_kv, nogil);
  m.def("paged_decode_attention", &paged_decode_attention, nogil);
  m.def("paged_prefill_attention", &paged_prefill_attention, nogil);
  m.def("paged_attention", &paged_attention, pybind11::arg("out"), pybind11::arg("q"),
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("seq_meta"),
        pybind11::arg("block_ids"), pybind11::arg("scale"), pybind11::arg("tiles") = true, nogil);
}
