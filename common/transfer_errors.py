"""Error strings shared by the roles about KV hand-offs."""

# KVTransferDone errors starting with this mean the decode instance refused the offer without
# touching the blocks (it is draining for a flip, or is no longer a decode instance): the prefill
# instance offers the sequence elsewhere instead of failing it.
REJECTED = "rejected: "
