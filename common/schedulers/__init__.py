"""Instance-local schedulers that are pure Python: they plan forwards and absorb their results.

Here: the contract and the plan builder (`base`), the queues and preemption that the co-located
policies and the decode instance's planner share (`queues`), the host-tier bookkeeping
(`swapping`), and the co-located (coupled) policies, which both the offline engine (`splitserve
generate`) and the coupled role (`coupled_instance`) run. The disaggregated roles' planners live
in their own packages (`prefill_instance`, `decode_instance`).
"""
