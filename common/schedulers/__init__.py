"""Instance-local schedulers that are pure Python: they plan forwards and absorb their results.

The disaggregated roles' schedulers live in their own packages (`prefill_instance`,
`decode_instance`); the co-located (coupled) policies live here because both the offline engine
(`splitserve generate`) and the coupled instance role run them.
"""
