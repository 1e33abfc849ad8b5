"""The cache directory a validation's real run reads: the profile record the simulator fits,
and everything else (models, kernels) from the shared cache.

The serving code reads `splitserve profile`'s record from its cache directory at start-up: the
prefill instances' ChunkSize (prefill_instance.role.chunk_size_for), the gateway's local prefill
budget (control_plane.routing.LocalPrefillBudget), the co-located policies' cost curves
(coupled_instance.role.load_costs). Until 2026-12-02 the shared cache held one record,
whichever profile ran last there, while a validation simulates each case with the record of
its thread count (`--profile`, repeatable): the two sides ran different ChunkSizes on
2026-11-28's Zen 4 (the real prefill instance 192 tokens, the simulated one 64;
docs/simulator.md). The serving code now takes the record of its own model, dtype and thread
count (common.profile_record), but two profiles of one thread count (a full one and a
minimum-time one) still replace each other there, and a validation must run exactly the record
its simulation fits. So each record gets a directory of its own under the shared cache, named
by its contents, holding a copy of the record (and no other) and a link to each other entry of
the shared cache.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from common.profile_record import PROFILE_RECORD, PROFILE_RECORDS

RECORDS = "profile-records"  # under the shared cache: one directory per record's contents


def record_cache_dir(cache_dir: str, record_path: str) -> str:
    """A cache directory whose profile record is `record_path`'s and whose other entries are
    links to the shared cache's (entries that appear in the shared cache later are linked on
    the next call)."""
    shared = Path(cache_dir).expanduser().resolve()
    data = Path(record_path).expanduser().read_bytes()
    own = shared / RECORDS / hashlib.sha256(data).hexdigest()[:16]
    own.mkdir(parents=True, exist_ok=True)
    (own / PROFILE_RECORD).write_bytes(data)
    for entry in shared.iterdir():
        link = own / entry.name
        if entry.name not in (RECORDS, PROFILE_RECORD, PROFILE_RECORDS) and not link.exists() \
                and not link.is_symlink():
            link.symlink_to(entry)
    return str(own)
