"""The engine: model code, paged KV cache, model runner, sampler, and the instance worker loop.

The engine knows nothing about text: it takes and returns token ids.
"""
