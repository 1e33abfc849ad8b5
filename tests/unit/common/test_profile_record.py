"""Which `splitserve profile` record fits a served model: the last record and one per model,
dtype and thread count (common.profile_record), and the readers that take them."""

from __future__ import annotations

import json
from types import SimpleNamespace

from common.profile_record import (
    PROFILE_RECORD,
    PROFILE_RECORDS,
    ProfileIdentity,
    read_record,
    find_record,
    served_identity,
    write_record,
)

ONE = {"model": "Org/Model v2", "dtype": "float32", "threads": 1, "recommended_chunk_size": 64}
TWO = {**ONE, "threads": 2, "recommended_chunk_size": 384}


def test_each_profile_is_kept_under_its_identity_beside_the_last_one(tmp_path):
    write_record(tmp_path, ONE)
    write_record(tmp_path, TWO)
    assert json.loads((tmp_path / PROFILE_RECORD).read_text()) == TWO
    assert sorted(p.name for p in (tmp_path / PROFILE_RECORDS).iterdir()) == \
        ["Org_Model_v2-float32-t1.json", "Org_Model_v2-float32-t2.json"]
    one = ProfileIdentity("Org/Model v2", "float32", 1)
    assert read_record(tmp_path, one) == ONE  # not the last record, measured on 2 threads
    assert read_record(tmp_path, ProfileIdentity("Org/Model v2", "float32", 2)) == TWO
    assert find_record(tmp_path, ProfileIdentity("Org/Model v2", "float32", 2)) == \
        (tmp_path / PROFILE_RECORD, TWO)
    assert read_record(tmp_path) == TWO  # nothing asked: the last one


def test_no_record_is_taken_for_other_forwards(tmp_path):
    write_record(tmp_path, ONE)
    for other in (ProfileIdentity("Org/Model v2", "float32", 4),
                  ProfileIdentity("Org/Model v2", "bfloat16", 1),
                  ProfileIdentity("other", "float32", 1)):
        assert read_record(tmp_path, other) is None and find_record(tmp_path, other) is None
    # a partly known identity matches on what it knows, from the last record only
    assert read_record(tmp_path, ProfileIdentity("Org/Model v2")) == ONE
    assert read_record(tmp_path / "missing", ProfileIdentity()) is None


def test_a_last_record_copied_in_by_hand_wins_over_the_kept_one(tmp_path):
    # simulator/record_cache.py makes a directory holding exactly the record a simulation fits
    write_record(tmp_path, ONE)
    (tmp_path / PROFILE_RECORD).write_text(json.dumps({**ONE, "recommended_chunk_size": 192}))
    assert read_record(tmp_path, ProfileIdentity("Org/Model v2", "float32", 1))[
        "recommended_chunk_size"] == 192


def test_a_kept_record_of_another_identity_under_the_right_name_is_refused(tmp_path):
    (tmp_path / PROFILE_RECORDS).mkdir()
    (tmp_path / PROFILE_RECORDS / "Org_Model_v2-float32-t1.json").write_text(json.dumps(TWO))
    (tmp_path / PROFILE_RECORDS / "Org_Model_v2-float32-t2.json").write_text("{not json")
    assert read_record(tmp_path, ProfileIdentity("Org/Model v2", "float32", 1)) is None
    assert read_record(tmp_path, ProfileIdentity("Org/Model v2", "float32", 2)) is None


def test_the_served_identity_is_what_the_runner_says():
    runner = SimpleNamespace(resolved=SimpleNamespace(name="m"), dtype_name="bfloat16",
                             num_threads=2)
    assert served_identity(runner) == ProfileIdentity("m", "bfloat16", 2)
    assert served_identity(SimpleNamespace()) == ProfileIdentity()
    gpu = SimpleNamespace(**vars(runner), device=SimpleNamespace(type="cuda"))
    assert served_identity(gpu) == ProfileIdentity("m", "bfloat16", None)
    assert ProfileIdentity().matches(ONE) and ProfileIdentity().file_name() is None
