"""docs/reproduction.md's generated tables against the committed JSON under docs/benchmarks/
(scripts/reproduction_tables.py): the committed file must equal its regeneration, a changed
number in the data or the file is caught, and a result without committed data reads "no
committed data" instead of a number."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "reproduction_tables.py"
DOC = ROOT / "docs" / "reproduction.md"


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location("reproduction_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)  # puts scripts/ on sys.path for its sibling modules
    return module


@pytest.fixture
def bench(tables, tmp_path, monkeypatch):
    """Point the loaders at an empty docs/benchmarks in tmp_path; returns that directory."""
    sources = sys.modules["reproduction_sources"]
    monkeypatch.setattr(sources, "BENCH", tmp_path)
    sources.load.cache_clear()
    yield tmp_path
    sources.load.cache_clear()


def region_body(text: str, name: str) -> str:
    start = text.index(f"<!-- generated:{name} -->")
    return text[start:text.index("<!-- end generated -->", start)]


def test_committed_tables_equal_their_regeneration_from_the_data(tables):
    text = DOC.read_text()
    stale = [name for name in tables.regions(text)
             if region_body(tables.render(text), name) != region_body(text, name)]
    assert not stale, (f"docs/reproduction.md regions {stale} disagree with docs/benchmarks/: "
                       "run `python scripts/reproduction_tables.py`")


def test_every_marked_region_has_a_builder_and_every_builder_a_region(tables):
    marked = tables.regions(DOC.read_text())
    assert len(marked) == len(set(marked))
    assert set(marked) == set(tables.BUILDERS)


def test_check_fails_on_a_number_edited_by_hand(tables, tmp_path):
    text = DOC.read_text()
    body = region_body(text, "E13")
    # power_of_two's mean total decoding time over decode_inter_current/seed{0,1,2}/inter.json
    assert "| 18.1 ± 0.1 |" in body
    edited = tmp_path / "reproduction.md"
    edited.write_text(text.replace(body, body.replace("| 18.1 ± 0.1 |", "| 17.9 ± 0.1 |")))
    assert tables.main(["--check", "--doc", str(edited)]) == 1
    edited.write_text(text)
    assert tables.main(["--check", "--doc", str(edited)]) == 0


def _e13_with(bench, times: dict[str, list[float]]) -> str:
    """E13's table over a copy of the rerun whose listed dispatchers took `times` per seed."""
    shutil.copytree(ROOT / "docs/benchmarks/decode_inter_current", bench / "decode_inter_current")
    for seed in (0, 1, 2):
        path = bench / f"decode_inter_current/seed{seed}/inter.json"
        data = json.loads(path.read_text())
        for row in data["rows"]:
            if row["policy"] in times:
                row["total_decoding_time_s"] = times[row["policy"]][seed]
        path.write_text(json.dumps(data))
    sys.modules["reproduction_sources"].load.cache_clear()
    return "\n".join(sys.modules["reproduction_experiments"].e13())


def test_a_changed_number_in_the_data_changes_its_table(tables, bench):
    e13 = _e13_with(bench, {"power_of_two": [12.34, 12.0, 12.5], "random": [20.0, 20.0, 23.0]})
    assert "| power_of_two (ours) | 12.3 ± 0.3 | -42% | 12.3, 12.0, 12.5 |" in e13
    assert "AMD EPYC Zen 5" in e13  # the CPU kind of the session that made the rerun


def test_e13_calls_overlapping_seeds_not_distinguishable(tables, bench):
    apart = _e13_with(bench, {"power_of_two": [10.0, 11.0, 12.0], "random": [13.0, 14.0, 15.0]})
    assert "| -21% |" in apart  # 11.0 vs 14.0
    shutil.rmtree(bench / "decode_inter_current")
    close = _e13_with(bench, {"power_of_two": [10.0, 11.0, 13.0], "random": [13.0, 14.0, 15.0]})
    assert "| -19% (not distinguishable) |" in close  # 11.3 vs 14.0


def test_without_committed_data_every_table_says_so(tables, bench):
    for name, build in tables.BUILDERS.items():
        text = "\n".join(build())
        assert "no committed data" in text, name
    glance = tables.BUILDERS["glance"]()
    rows = [line.split(" | ") for line in glance[2:]]
    assert rows and all(cells[2] == "no committed data" for cells in rows)


def test_a_json_that_records_its_cpu_is_taken_at_its_word(tables, bench):
    sources = sys.modules["reproduction_sources"]
    (bench / "decode_inter").mkdir()
    record = {"machine": {"cpu": {"kind": "AMD EPYC, family 26 (Zen 5), AVX512-BF16"}}}
    (bench / "decode_inter/inter.json").write_text(json.dumps(record))
    assert sources.cpu_kind("decode_inter") == "AMD EPYC, family 26 (Zen 5), AVX512-BF16"
    assert sources.cpu_kind("compare_HPLD") == sources.ZEN4  # no record: the session's kind


def test_a_region_without_a_builder_is_an_error(tables):
    with pytest.raises(KeyError, match="no builder"):
        tables.render("<!-- generated:E99 -->\nold\n<!-- end generated -->\n")
