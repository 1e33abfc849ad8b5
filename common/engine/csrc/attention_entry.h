// The attention entry points bound by cpu_ops.cpp (included after the kernels): argument checks
// and the choice of kernel.
#pragma once

// Whether the one-call kernel takes these tensors: bfloat16, a supported head dim, and a cache
// small enough for the 32-bit word offsets the prefill relay gathers by.
inline bool varlen_supported(const at::Tensor& q, const at::Tensor& k_cache) {
#if defined(__AVX512BF16__)
  return q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
         bf16_decode::supports(q.size(2)) &&
         k_cache.numel() / 2 < std::numeric_limits<int32_t>::max();
#else
  return false;
#endif
}

// Every sequence of a forward in one call: q, out [T, heads, dim]; seq_meta int64 [S, 4] rows
// (first query row, query tokens, cached tokens, offset of its block ids in block_ids); the
// sequence's query row i sees its first cached + i + 1 context tokens, whose keys and values
// (the chunk's own included) are in the cache blocks listed in block_ids.
// `tiles`: use AMX tiles where the CPU has them (false: the VDPBF16PS path, for tests).
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                     at::Tensor seq_meta, at::Tensor block_ids, double scale, bool tiles) {
  check_rows(q, "q");
  check_rows(out, "out");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  TORCH_CHECK(varlen_supported(q, k_cache) && v_cache.scalar_type() == k_cache.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "paged_attention: bfloat16 with head dim 64 or 128 on AVX512-BF16 CPUs only");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  TORCH_CHECK(seq_meta.scalar_type() == at::kLong && seq_meta.is_contiguous() &&
                  seq_meta.dim() == 2 && seq_meta.size(1) == 4, "seq_meta: contiguous int64 [S, 4]");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.is_contiguous() &&
                  block_ids.dim() == 1, "block_ids: contiguous 1-D int64");
  const int64_t num_seqs = seq_meta.size(0), block_size = k_cache.size(1);
  const int64_t* meta = seq_meta.data_ptr<int64_t>();
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t* m = meta + 4 * s;
    TORCH_CHECK(m[0] >= 0 && m[1] >= 1 && m[0] + m[1] <= q.size(0) && m[2] >= 0,
                "sequence ", s, ": query rows outside q or no query token");
    const int64_t blocks = (m[2] + m[1] + block_size - 1) / block_size;
    TORCH_CHECK(m[3] >= 0 && m[3] + blocks <= block_ids.numel(),
                "sequence ", s, ": block_ids holds fewer blocks than its context");
    for (int64_t b = 0; b < blocks; ++b)
      TORCH_CHECK(ids[m[3] + b] >= 0 && ids[m[3] + b] < k_cache.size(0),
                  "sequence ", s, ": block id outside the cache");
  }
#if defined(__AVX512BF16__)
  std::vector<int64_t> q_start(num_seqs), q_len(num_seqs), cached(num_seqs), offsets(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) {
    q_start[s] = meta[4 * s];
    q_len[s] = meta[4 * s + 1];
    cached[s] = meta[4 * s + 2];
    offsets[s] = meta[4 * s + 3];
  }
  const int64_t dim = q.size(2), kv_heads = k_cache.size(2);
  const varlen_bf16::Batch batch{
      q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
      v_cache.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), q.stride(0), q.stride(1),
      out.stride(0), out.stride(1), block_size, kv_heads, dim, q.size(1) / kv_heads,
      kv_heads * dim, q_start.data(), q_len.data(), cached.data(), offsets.data(), ids,
      static_cast<float>(scale)};
  if (dim == 64)
    varlen_bf16::run<4>(batch, num_seqs, tiles);
  else
    varlen_bf16::run<8>(batch, num_seqs, tiles);
#endif
}

void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_table, at::Tensor context_lens, double scale) {
  check_rows(q, "q");
  check_rows(out, "out");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.stride(1) == 1,
              "block_table: int64, rows contiguous");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(),
              "context_lens: contiguous int64");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
#if defined(__AVX512BF16__)
  if (q.scalar_type() == at::kBFloat16 && bf16_decode::supports(q.size(2))) {
    bf16_decode::decode_attention(out, q, k_cache, v_cache, block_table, context_lens, scale);
    return;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention",
                                  [&] {
                                    decode_attention_impl<scalar_t>(out, q, k_cache, v_cache,
                                                                    block_table, context_lens,
                                                                    scale);
                                  });
}

// One prefill chunk of one sequence: q [tokens, heads, dim], whose row i attends to the first
// num_cached + i + 1 tokens of the blocks in block_table (1-D int64; the chunk's own keys and
// values already stored). With AVX512-BF16, bfloat16 and a supported head dim, the tiled kernel;
// otherwise every row goes through paged_decode_attention with its own context length.
void paged_prefill_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                             at::Tensor block_table, int64_t num_cached, double scale) {
  check_rows(q, "q");
  check_rows(out, "out");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1 &&
                  block_table.is_contiguous(), "block_table: contiguous 1-D int64");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(num_cached >= 0 &&
                  block_table.numel() * k_cache.size(1) >= num_cached + q.size(0),
              "block_table holds fewer tokens than num_cached + the chunk");
#if defined(__AVX512BF16__)
  if (varlen_supported(q, k_cache)) {
    const int64_t tokens = q.size(0);
    const at::Tensor meta = at::tensor({int64_t{0}, tokens, num_cached, int64_t{0}},
                                       block_table.options()).view({1, 4});
    paged_attention(out, q, k_cache, v_cache, meta, block_table, scale, true);
    return;
  }
#endif
  const int64_t tokens = q.size(0);
  const auto lens = at::arange(num_cached + 1, num_cached + tokens + 1, block_table.options());
  paged_decode_attention(out, q, k_cache, v_cache, block_table.unsqueeze(0).expand({tokens, -1}),
                         lens, scale);
}

