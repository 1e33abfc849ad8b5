"""`splitserve plan`: candidates for a budget, their layouts, a ranking that agrees with
simulate() run by hand, determinism for a seed, the CLI's table and JSON, and the class pools
that feed named workloads."""

from __future__ import annotations

import json
from functools import partial

import pytest

from common.config import ConfigError, GatewayConfig, RoutingConfig
from control_plane.cli import main
from simulator import pools
from simulator.plan import Candidate, arrival_window, candidates, evaluate, layout, rank
from simulator.run import Slo, simulate
from simulator.workload import SyntheticShape, synthetic

from unit.simulator.sim_fixtures import COSTS, instance_config

GATEWAY = GatewayConfig(routing=RoutingConfig(local_prefill="off"))
BASE = partial(layout, instance=instance_config(), gateway=GATEWAY)
SLO = Slo(ttft_s=0.3, tbt_s=0.05)
SHAPE = SyntheticShape(prompt_median=60, prompt_sigma=0.5, max_prompt_tokens=200,
                       output_median=12, output_sigma=0.5, max_output_tokens=40)


def test_candidates_cover_the_ratios_and_policies_once_each():
    found = candidates(4, (0.25, 0.5, 0.75), ("vllm", "sarathi"))
    assert [c.label for c in found] == ["1P:3D", "2P:2D", "3P:1D", "vllm x4", "sarathi x4"]
    # on 2 instances every fraction rounds to 1P:1D: one candidate, not three
    assert [c.label for c in candidates(2, (0.25, 0.5, 0.75), ())] == ["1P:1D"]
    assert [c.label for c in candidates(1, (0.5,), ("sarathi",))] == ["sarathi x1"]
    with pytest.raises(ConfigError):
        Candidate(1, 1, 2, policy="vllm")


def test_a_candidate_sets_chunk_admission_policy_and_flips_in_its_layout():
    disagg = layout(Candidate(1, 3, flip_policy="load-ratio", chunk_size=128,
                              admission="reserve-dynamic"))
    assert disagg.instance.prefill.chunk_size == 128
    assert disagg.instance.decode.admission == "reserve-dynamic"
    assert disagg.gateway.flip_policy == "load-ratio" and disagg.gateway.flip_options
    assert layout(Candidate(2, 2)).gateway.flip_options == ()  # `none` takes no options
    coupled = layout(Candidate(num_coupled=4, policy="sarathi", chunk_size=256))
    assert coupled.instance.coupled_policy == "sarathi" and coupled.num_coupled == 4
    assert coupled.instance.engine.batch.max_num_batched_tokens == 256


def by_hand(candidate: Candidate, requests, seed: int) -> float:
    report = simulate(BASE(candidate), COSTS, requests, seed, SLO)
    return report["goodput"]["num_met"] / arrival_window(requests) / candidate.instances


def test_the_ranking_agrees_with_simulate_and_repeats_for_a_seed():
    chosen = [Candidate(1, 1), Candidate(num_coupled=2, policy="vllm"),
              Candidate(num_coupled=2, policy="sarathi")]
    workloads = {s: synthetic(40, 25.0, s, SHAPE) for s in (0, 1)}
    rows = [evaluate(c, COSTS, workloads, [SLO], BASE)[0] for c in chosen]
    for candidate, row in zip(chosen, rows):
        expected = [by_hand(candidate, workloads[s], s) for s in (0, 1)]
        assert row["goodput_per_instance"]["per_seed"] == pytest.approx(expected)
    ranked = rank(rows)
    means = [r["goodput_per_instance"]["mean"] for r in ranked]
    assert means == sorted(means, reverse=True) and len(set(means)) > 1  # they differ here
    again = rank([evaluate(c, COSTS, workloads, [SLO], BASE)[0] for c in chosen])
    strip = lambda rs: [{k: v for k, v in r.items() if k != "cpu_s"} for r in rs]
    assert strip(again) == strip(ranked)


def test_rank_marks_candidates_the_best_does_not_beat_on_every_seed():
    def row(name, *per_seed):
        return {"candidate": name, "slo_attainment": 1.0, "ttft_p99_s": 0.1, "tbt_p99_s": 0.01,
                "goodput_per_instance": {"mean": sum(per_seed) / 3, "per_seed": per_seed}}

    # b's mean is below a's, but it wins on seed 2: not distinguishable; c loses on every seed
    ranked = rank([row("c", 1.0, 2.0, 1.5), row("a", 5.0, 7.0, 6.0), row("b", 4.0, 6.5, 6.5)])
    assert [(r["candidate"], r["distinguishable"]) for r in ranked] == \
        [("a", True), ("b", False), ("c", True)]
    tied = rank([row("x", 1.0, 1.0, 1.0), row("y", 1.0, 1.0, 1.0)])
    assert tied[1]["distinguishable"] is False


def test_plan_cli_prints_a_table_and_writes_json(tmp_path, capsys):
    common = ["plan", "--hardware", "h100-llama2-7b", "--instances", "2", "--workload",
              "synthetic", "--num-requests", "20", "--rate", "10", "--local-prefill", "off",
              "--prefill-fractions", "0.5", "--policies", "sarathi", "--seeds", "0,1"]
    assert main([*common, "--out", str(tmp_path / "plan.json")]) == 0
    table = capsys.readouterr().out
    assert "recommended for 2 instances:" in table and "sarathi x2" in table
    result = json.loads((tmp_path / "plan.json").read_text())
    assert [r["candidate"] for r in result["candidates"]] in (["1P:1D", "sarathi x2"],
                                                              ["sarathi x2", "1P:1D"])
    assert result["recommended"] == result["candidates"][0]["candidate"]
    assert result["seeds"] == [0, 1]
    assert main([*common, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [r["goodput_per_instance"] for r in printed["candidates"]] == \
        [r["goodput_per_instance"] for r in result["candidates"]]


def pool_file(tmp_path):
    data = {"kind": pools.KIND, "pools": {"LPLD": [[10, 5], [20, 6]], "LPHD": [[30, 200]],
                                          "HPLD": [[600, 7]], "HPHD": [[700, 300]]}}
    return pools.save(data, tmp_path / "pools.json")


def test_pools_resample_each_class_and_mix_them_in_equal_shares(tmp_path):
    loaded = pools.load(pool_file(tmp_path))
    mixed = pools.draw(loaded, "Mixed", 40, 10.0, seed=3)
    assert {c: sum(r.workload_class == c for r in mixed) for c in pools.CLASSES} == \
        dict.fromkeys(pools.CLASSES, 10)
    assert all((r.num_prompt_tokens, r.output_tokens) in loaded[r.workload_class] for r in mixed)
    assert pools.draw(loaded, "Mixed", 40, 10.0, seed=3) == mixed
    assert pools.draw(loaded, "Mixed", 40, 10.0, seed=4) != mixed
    assert pools.mean_lengths(loaded, "LPLD") == (15.0, 5.5)


def test_plan_cli_draws_a_named_workload_from_the_pools(tmp_path, capsys):
    assert main(["plan", "--hardware", "h100-llama2-7b", "--instances", "2", "--workload",
                 "HPLD", "--rate", "20", "--duration", "1", "--pools", str(pool_file(tmp_path)),
                 "--prefill-fractions", "", "--policies", "vllm,sarathi", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {r["candidate"] for r in result["candidates"]} == {"vllm x2", "sarathi x2"}
    assert result["workload"] == {"name": "HPLD", "rate": 20.0, "duration_s": 1.0,
                                  "num_requests": None}


def test_plan_charges_the_stack_times_in_every_candidate(tmp_path, capsys):
    common = ["plan", "--hardware", "h100-llama2-7b", "--instances", "2", "--workload",
              "synthetic", "--num-requests", "20", "--rate", "10", "--local-prefill", "off",
              "--prefill-fractions", "0.5", "--policies", "sarathi", "--json"]
    ttft = {}
    for extra in ([], ["--request-latency", "0.3"]):
        assert main([*common, *extra]) == 0
        rows = json.loads(capsys.readouterr().out)["candidates"]
        ttft[bool(extra)] = {r["candidate"]: r["ttft_p99_s"] for r in rows}
    assert set(ttft[True]) == {"1P:1D", "sarathi x2"}
    for name, plain in ttft[False].items():  # every request waits 0.3 s more on its way in
        assert ttft[True][name] == pytest.approx(plain + 0.3, abs=0.05)
    assert main([*common, "--wake", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("splitserve plan: error:") and "must be >= 0" in err
    assert "\n" not in err


def test_plan_shares_one_machines_cores_among_every_candidates_instances(capsys):
    """`--shared-cores`: each candidate's instances share the cores (simulator/cores.py), so
    four 1-thread instances on one core run their forwards at a quarter of the speed."""
    common = ["plan", "--hardware", "h100-llama2-7b", "--instances", "4", "--workload",
              "synthetic", "--num-requests", "20", "--rate", "10", "--local-prefill", "off",
              "--prefill-fractions", "0.5", "--policies", "sarathi", "--json"]
    jct = {}
    for extra in ([], ["--shared-cores", "4"], ["--shared-cores", "1"]):
        assert main([*common, *extra]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["machine"]["shared_cores"] == (int(extra[1]) if extra else None)
        jct[tuple(extra)] = {r["candidate"]: r["jct_mean_s"] for r in result["candidates"]}
    own, four, one = jct.values()
    assert set(own) == {"2P:2D", "sarathi x4"}
    for name, plain in own.items():
        assert four[name] == pytest.approx(plain, rel=1e-6)  # a core each: no wait
        assert one[name] > 2.0 * plain
    assert main([*common, "--shared-cores", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("splitserve plan: error:") and "shared_cores" in err
    assert "\n" not in err
