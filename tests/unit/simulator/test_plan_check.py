"""simulator.plan_check: a candidate's `splitserve up` flags build, through `splitserve
simulate`'s parser, the very layout `splitserve plan` simulates for it (so the real run checks
the plan's own candidate), and the paired verdict on goodput per seed."""

from __future__ import annotations

import json

import pytest

from control_plane.cli import build_parser
from control_plane.cli_args import cluster_instance_config, gateway_config
from simulator.args import core_sharing
from simulator.plan import candidates, layout
from simulator.plan_check import candidate_flags, sharing_flags, verdict
from simulator.validate import flags_layout

FOUND = candidates(4, (0.25, 0.5), ("vllm", "sarathi"), flip_policies=("none", "load-ratio"),
                   chunk_sizes=(None, 256), admissions=("greedy", "reserve-static"))


@pytest.mark.parametrize("candidate", FOUND, ids=lambda c: f"{c.label}-{c.chunk_size}-"
                                                           f"{c.admission}")
def test_flags_build_the_layout_plan_simulates(candidate, tmp_path):
    args = build_parser().parse_args(["simulate", "--local-prefill", "off",
                                      "--cache-dir", str(tmp_path)])
    planned = layout(candidate, cluster_instance_config(args), gateway_config(args, 0))
    from_flags = flags_layout(candidate_flags(candidate), str(tmp_path))
    assert (from_flags.num_prefill, from_flags.num_decode, from_flags.num_coupled) == (
        candidate.num_prefill, candidate.num_decode, candidate.num_coupled)
    assert from_flags.instance == planned.instance
    assert from_flags.gateway == planned.gateway


def test_candidates_differ_in_their_flags():
    assert len({tuple(candidate_flags(c)) for c in FOUND}) == len(FOUND)


def rows(*per_seed):
    return [{"goodput_per_instance": {"per_seed": list(values)}} for values in per_seed]


def test_verdict_needs_every_seed():
    assert verdict(*rows((3, 2, 5), (1, 1, 4))) == "better"
    assert verdict(*rows((1, 1, 4), (3, 2, 5))) == "worse"
    assert verdict(*rows((3, 1, 5), (1, 2, 4))) == "not distinguishable"
    assert verdict(*rows((3, 2, 5), (3, 1, 4))) == "not distinguishable"


def test_an_earlier_run_must_describe_the_same_requests_and_slos(tmp_path):
    import argparse
    import json

    from common.config import ConfigError
    from simulator.plan_check import earlier_run

    args = argparse.Namespace(workload="LPLD", num_requests=32, seeds="0,1", instances=2,
                              slo_ttft=1.0, slo_tbt=0.2, real_from=tmp_path / "LPLD-2.json",
                              sampled=False)
    stored = {"workload": "LPLD", "num_requests": 32, "seeds": [0, 1], "instances": 2,
              "slo": {"ttft_s": 1.0, "tbt_s": 0.2, "tbt_percentile": 99.0,
                      "ttft_per_prompt_token_s": 0.0}, "rate": 0.7, "real": []}
    args.real_from.write_text(json.dumps(stored))
    assert earlier_run(args)["rate"] == 0.7
    args.real_from.write_text(json.dumps({**stored, "num_requests": 40, "seeds": [0]}))
    with pytest.raises(ConfigError, match="num_requests, seeds"):
        earlier_run(args)
    # a greedy check's real runs are not a sampled check's, nor the other way round
    args.real_from.write_text(json.dumps(stored))
    with pytest.raises(ConfigError, match="sampling"):
        earlier_run(argparse.Namespace(**{**vars(args), "sampled": True}))
    args.real_from.write_text(json.dumps({**stored, "sampling": {"temperature": 0.7,
                                                                 "top_p": 0.95}}))
    assert earlier_run(argparse.Namespace(**{**vars(args), "sampled": True}))["rate"] == 0.7
    with pytest.raises(ConfigError, match="sampling"):
        earlier_run(args)


@pytest.mark.parametrize("sampled", [False, True])
def test_the_real_runs_read_the_record_the_plan_was_simulated_on(sampled, tmp_path,
                                                                  monkeypatch):
    import simulator.plan_check as pc
    import simulator.validate as v
    from common.engine.profile import recorded_chunk_size
    from unit.simulator.test_cli import RECORD

    monkeypatch.setattr(v, "workload_requests", lambda *args: ([], []))
    monkeypatch.setattr(pc, "simulate_candidates", lambda found, *args: [
        {"candidate": c.label} for c in found])
    seen = []

    class Seen(Exception):
        """The first real run's cache directory is all this test needs."""

    def real_goodput(candidate, workloads, windows, slo, cache_dir, log_dir, sampling):
        seen.append((cache_dir, sampling))
        raise Seen

    monkeypatch.setattr(pc, "real_goodput", real_goodput)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "profile.json").write_text('{"recommended_chunk_size": 512}')
    with pytest.raises(Seen):
        pc.main(["--profile", str(RECORD), "--cache-dir", str(tmp_path / "cache"),
                 "--rate", "1.0", "--out", str(tmp_path / "out")]
                + (["--sampled"] if sampled else []))
    assert recorded_chunk_size(seen[0][0]) == json.loads(RECORD.read_text())[
        "recommended_chunk_size"]
    assert seen[0][1] == ({"temperature": 0.7, "top_p": 0.95} if sampled else {})


@pytest.mark.parametrize("budget", [2, 3])
def test_a_budget_beyond_the_cores_is_simulated_on_shared_cores(budget, tmp_path):
    """plan_check simulates a candidate of more instances than the machine's cores on shared
    cores, the layout `splitserve plan --shared-cores` builds for it."""
    args = build_parser().parse_args(["plan", "--local-prefill", "off", "--shared-cores", "2",
                                      "--cache-dir", str(tmp_path)])
    for candidate in candidates(budget, (0.34, 0.67), ("sarathi",)):
        planned = layout(candidate, cluster_instance_config(args), gateway_config(args, 0),
                         fixed=core_sharing(args))
        flags = candidate_flags(candidate) + sharing_flags(candidate, 2)
        from_flags = flags_layout(flags, str(tmp_path))
        assert from_flags.instance == planned.instance
        assert from_flags.shared_cores == (2 if budget > 2 else None)
        assert (from_flags.shared_cores, from_flags.core_threads) == (
            (planned.shared_cores, planned.core_threads) if budget > 2 else (None, 1))
