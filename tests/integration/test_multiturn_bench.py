"""`splitserve bench --workload multiturn` against a real `splitserve up` with the default model:
2 conversations x 2 turns, turn 2 carrying turn 1's answer through the gateway's chat template."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cluster_fixture import ROOT, Cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster("--dtype", "float32", log_dir=tmp_path_factory.mktemp("cluster"))
    yield c
    c.stop()


def test_two_conversations_of_two_turns(cluster, tmp_path):
    out = tmp_path / "multiturn.json"
    result = subprocess.run([sys.executable, "-m", "control_plane.cli", "bench", "--url",
                             cluster.url, "--workload", "multiturn", "--num-requests", "2",
                             "--rate", "4", "--max-turns", "2", "--think-time", "0.2",
                             "--max-tokens", "16", "--out", str(out)],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    turns = report["requests"]
    assert [(t["conversation"], t["turn"]) for t in turns] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all(t["error"] is None and t["output_tokens"] >= 1 for t in turns)
    for first, second in (turns[0:2], turns[2:4]):
        # the server's count of turn 2's prompt holds turn 1's prompt and its generated answer
        assert second["prompt_tokens"] > first["prompt_tokens"] + first["output_tokens"]
        assert second["send_time"] >= first["send_time"] + first["jct"] + second["think_time_s"]
    by_turn = report["summary"]["by_turn"]
    assert by_turn["1"]["num_ok"] == by_turn["2"]["num_ok"] == by_turn["later"]["num_ok"] == 2
    assert 0 < by_turn["1"]["ttft_s"]["p50"] and 0 < by_turn["later"]["ttft_s"]["p99"]
    assert "TTFT p50" in result.stdout and "later" in result.stdout
