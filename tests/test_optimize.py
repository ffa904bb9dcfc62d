"""`servetune optimize` end to end on the real simulator (small samples), its job file,
determinism, provenance, and the infeasible exit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from servetune.apps.optimize import DEFAULT_SPACE_KNOBS
from servetune.cli import app
from servetune.schemas.base import load_document
from servetune.schemas.job import DEFAULT_MAX_SIMULATIONS, OptimizeJob
from servetune.schemas.policy import Policy
from servetune.schemas.slo import SLOSet
from servetune.schemas.space import SearchSpace

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = REPO / "configs" / "workloads" / "azure-conv-2023.yaml"
PROFILE = REPO / "gpu_profiles" / "h200-llama-3.1-8b.yaml"
SLO = REPO / "configs" / "slos" / "mlperf-llama-3.1-8b-server.yaml"

pytestmark = pytest.mark.skipif(
    not (WORKLOAD.exists() and PROFILE.exists() and SLO.exists()),
    reason="shipped workload/profile/SLO files not present yet",
)


def _space(tmp_path: Path) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(
        "apiVersion: servetune/v1\nkind: SearchSpace\nname: tiny\nknobs:\n"
        "  max_num_seqs: [64, 256]\n  max_num_batched_tokens: [1024, 4096]\n"
    )
    return path


def _run(args: list[str]):
    return CliRunner().invoke(app, args, catch_exceptions=False)


def _args(tmp_path: Path, out: str, *extra: str) -> list[str]:
    return [
        "optimize", "--workload", str(WORKLOAD), "--profile", str(PROFILE), "--slo", str(SLO),
        "--space", str(_space(tmp_path)), "--requests", "300", "--quiet", "-o",
        str(tmp_path / out), *extra,
    ]


def test_same_inputs_and_seed_give_identical_policy_bytes(tmp_path):
    a = _run(_args(tmp_path, "a.yaml", "--json-out", str(tmp_path / "a.json")))
    assert a.exit_code == 0, a.output
    b = _run(_args(tmp_path, "b.yaml"))
    assert b.exit_code == 0, b.output
    assert (tmp_path / "a.yaml").read_bytes() == (tmp_path / "b.yaml").read_bytes()

    policy = load_document(tmp_path / "a.yaml", Policy)
    meta = policy.metadata
    assert meta["method"] == "milp"
    assert meta["inputs"]["workload"]["sha256"] and meta["inputs"]["slo"]["sha256"]
    assert set(meta["profile"]) == {
        "name", "gpu_memory_utilization", "block_size", "kv_blocks", "gpu_memory_bytes",
        "weight_bytes", "activation_bytes",
        "gpu", "model",  # what `servetune export` compares with --profile
    }
    # The exporters read these facts back: TensorRT-LLM's memory fraction needs no
    # --profile, and equals the one computed from the profile itself.
    from servetune.export import memory_facts
    from servetune.export.trtllm import free_gpu_memory_fraction
    from servetune.profiles.shipped import load_profile

    from_meta = free_gpu_memory_fraction(memory_facts(policy))
    assert from_meta == pytest.approx(
        free_gpu_memory_fraction(memory_facts(policy, load_profile(PROFILE))), rel=1e-6
    )
    assert meta["simulated"]["goodput_rate_per_s"] > 0
    assert meta["solver"]["milp"]["statuses"][0][0] == "optimal"
    assert "time" not in yaml.safe_dump(meta).lower().replace("time_limit", "")

    summary = json.loads((tmp_path / "a.json").read_text())
    for key in ("method", "policy", "goodput_rate_per_s", "defaults_goodput_rate_per_s",
                "attainment", "simulations", "solver_s", "simulation_s", "wall_s",
                "iterations"):
        assert key in summary, key
    assert summary["policy"]["batching.max_num_seqs"] in (64, 256)
    assert summary["goodput_rate_per_s"] == pytest.approx(
        meta["simulated"]["goodput_rate_per_s"], rel=1e-5
    )
    assert summary["iterations"] and summary["simulations"] > 0


def test_infeasible_slo_exits_3_naming_the_binding_constraint(tmp_path):
    slo = tmp_path / "tight.yaml"
    slo.write_text(
        "apiVersion: servetune/v1\nkind: SLOSet\nname: tight\nclasses:\n"
        "  default: {ttft_s: 2.0, tpot_s: 0.002, percentile: 99}\n"
    )
    args = _args(tmp_path, "never.yaml", "--json-out", str(tmp_path / "s.json"))
    args[args.index(str(SLO))] = str(slo)
    res = _run(args)
    assert res.exit_code == 3
    assert "TPOT cannot go below" in res.output and "target 2 ms" in res.output
    assert not (tmp_path / "never.yaml").exists()
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["status"] == "infeasible"
    assert summary["infeasible"]["binding"] == "tpot[default]"
    assert summary["infeasible"]["best_value"] > 0.002


def test_job_file_paths_resolve_against_its_folder(tmp_path):
    folder = tmp_path / "jobs"
    folder.mkdir()
    (folder / "w.yaml").write_bytes(WORKLOAD.read_bytes())
    (folder / "s.yaml").write_bytes(SLO.read_bytes())
    _space(folder)
    (folder / "job.yaml").write_text(
        "apiVersion: servetune/v1\nkind: OptimizeJob\nworkload: w.yaml\n"
        "profile: h200-llama-3.1-8b\nslo: s.yaml\nspace: space.yaml\nrequests: 300\n"
        "output: out/policy.yaml\n"
    )
    res = _run(["optimize", str(folder / "job.yaml"), "--quiet"])
    assert res.exit_code == 0, res.output
    assert load_document(folder / "out" / "policy.yaml", Policy).batching.max_num_seqs in (
        64, 256
    )


def test_bad_inputs_exit_2_without_output(tmp_path):
    res = _run(["optimize", "--workload", str(tmp_path / "missing.yaml"), "--profile",
                str(PROFILE), "--slo", str(SLO), "-o", str(tmp_path / "p.yaml")])
    assert res.exit_code == 2
    assert "missing.yaml" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "p.yaml").exists()
    res = _run(["optimize", "--workload", str(WORKLOAD), "--profile", str(PROFILE), "--slo",
                str(SLO), "--method", "annealing", "-o", str(tmp_path / "p.yaml")])
    assert res.exit_code == 2 and "--method" in res.output


def test_shipped_default_space_and_quickstart_job():
    space = load_document(REPO / "configs" / "spaces" / "default.yaml", SearchSpace)
    assert space.knobs == DEFAULT_SPACE_KNOBS
    job_path = REPO / "configs" / "jobs" / "quickstart.yaml"
    job = load_document(job_path, OptimizeJob)
    assert job.method == "milp"
    # Work decides the result; the wall clock is only a safety stop (tests/test_determinism.py).
    assert job.max_simulations == DEFAULT_MAX_SIMULATIONS and job.time_limit_s == 600
    for rel in (job.workload, job.profile, job.slo, job.space):
        assert (job_path.parent / rel).exists(), rel


def test_job_needs_exactly_one_source():
    from servetune.errors import ServetuneError
    from servetune.schemas.base import document_from_data

    with pytest.raises(ServetuneError, match="exactly one of workload or trace"):
        document_from_data(
            {"apiVersion": "servetune/v1", "kind": "OptimizeJob", "profile": "p", "slo": "s"},
            OptimizeJob, "job.yaml",
        )


def test_time_limit_is_honoured(tmp_path):
    res = _run(_args(tmp_path, "p.yaml", "--time-limit", "0.000001"))
    assert res.exit_code == 2
    assert "--time-limit" in res.output and "allow more time" in res.output
    assert not (tmp_path / "p.yaml").exists()


def test_trace_input(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    n = 400
    t = np.cumsum(rng.exponential(0.2, n))
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(n):
        sec = t[i]
        stamp = f"2023-11-16 18:{15 + int(sec // 60):02d}:{sec % 60:010.7f}"
        lines.append(f"{stamp},{rng.integers(50, 3000)},{rng.integers(5, 400)}")
    trace = tmp_path / "trace.csv"
    trace.write_text("\n".join(lines) + "\n")
    args = ["optimize", "--trace", str(trace), "--profile", str(PROFILE), "--slo", str(SLO),
            "--space", str(_space(tmp_path)), "--quiet", "-o", str(tmp_path / "p.yaml")]
    res = _run(args)
    assert res.exit_code == 0, res.output
    meta = load_document(tmp_path / "p.yaml", Policy).metadata
    assert meta["inputs"]["trace"]["file"] == "trace.csv"
    assert meta["sample_requests"] == n


def test_simulation_infeasibility_names_the_metric():
    from servetune.apps.optimize import explain_sim_infeasible
    from servetune.conditions import Condition
    from servetune.models.fluid import Knobs
    from servetune.schemas.slo import SLOSet
    from servetune.search import GoodputResult
    from servetune.solvers.loop import Evaluated, SimPoint

    slo = load_document(SLO, SLOSet)
    pts = [
        SimPoint(0.1, 0.5, False, 0.9,
                 judged={"default": {"p99_ttft_s": 3.5, "p99_tpot_s": 0.05}}),
        SimPoint(0.05, 0.25, False, 0.95,
                 judged={"default": {"p99_ttft_s": 2.6, "p99_tpot_s": 0.04}}),
    ]
    ev = Evaluated(0, Knobs(64, 512), 1.0, Condition.parse("ttft[default]"),
                   GoodputResult(0.0, 0.0, pts))
    msg, details = explain_sim_infeasible([ev], slo)
    assert details["binding"] == "ttft[default]"
    assert "TTFT stays at 2.6 s" in msg and "target 2 s" in msg
    assert details["best_value"] == 2.6


@settings(max_examples=60, deadline=None)
@given(data=st.dictionaries(
    st.sampled_from(["apiVersion", "kind", "workload", "trace", "profile", "slo", "space",
                     "method", "time_limit_s", "seed", "requests", "engine", "bogus"]),
    st.one_of(st.none(), st.integers(-5, 10**7), st.floats(allow_nan=True), st.text(max_size=8),
              st.sampled_from(["servetune/v1", "OptimizeJob", "milp", "grid", "vllm"])),
))
def test_job_documents_fail_only_with_servetune_errors(data):
    from servetune.errors import ServetuneError
    from servetune.schemas.base import document_from_data

    try:
        document_from_data(data, OptimizeJob, "job.yaml")
    except ServetuneError as err:
        assert err.message.startswith("job.yaml")


def test_returned_policy_passes_the_simulator_at_its_goodput(tmp_path):
    from servetune.apps.optimize import optimize
    from servetune.profiles.shipped import load_profile
    from servetune.schemas.slo import SLOSet
    from servetune.schemas.workload import Workload
    from servetune.sim import simulate
    from servetune.sim.api import prepare_trace
    from servetune.sim.evaluator import Evaluator, judging_window_s

    workload = load_document(WORKLOAD, Workload)
    profile = load_profile(PROFILE)
    slo = load_document(SLO, SLOSet)
    space = load_document(_space(tmp_path), SearchSpace)
    res = optimize(workload, profile, slo, space, n_requests=300, seed=3,
                   compare_defaults=False)
    assert res.summary["converged"] is True
    sample = prepare_trace(workload, seed=3, n_requests=300)
    scale = res.policy.metadata["simulated"]["rate_scale"]
    # At the goodput, 300 requests would span less than the window the TTFT target needs
    # (2 s / 3% = 67 s), so the run that judged it used a longer sample of the workload.
    window = judging_window_s(slo, 0.03)
    assert window == pytest.approx(2.0 / 0.03)
    sim = Evaluator(sample, profile, slo, source=workload, seed=3, min_window_s=window)
    trace, own_scale = sim.sample_for(scale)
    assert len(trace) > len(sample)
    run = simulate(trace, res.policy, profile, rate_scale=own_scale)
    assert run.meets_slo(slo)
    assert run.trace.duration_s >= window
    assert res.summary["sample_window_s"] == pytest.approx(run.trace.duration_s)
    assert res.summary["warnings"] == []
    # Same arrival rate as the base sample at that scale.
    assert len(run.trace) / run.trace.duration_s == pytest.approx(
        scale * sim.base_rate_per_s, rel=0.01
    )
    for ev in res.evaluated:  # everything the loop simulated
        assert ev.goodput.rate_per_s <= res.summary["goodput_rate_per_s"] + 1e-9


def test_a_short_trace_at_a_high_rate_is_flagged(tmp_path):
    """A trace cannot be sampled longer: when its requests span less than the window
    the TTFT target needs at the goodput, the summary says the goodput may be optimistic."""
    from servetune.apps.optimize import optimize
    from servetune.profiles.shipped import load_profile
    from servetune.schemas.slo import SLOSet
    from servetune.schemas.workload import Workload
    from servetune.sim.api import prepare_trace

    workload = load_document(WORKLOAD, Workload)
    slo = load_document(SLO, SLOSet)
    trace = prepare_trace(workload, seed=1, n_requests=200)
    res = optimize(trace, load_profile(PROFILE), slo, load_document(_space(tmp_path),
                   SearchSpace), n_requests=200, compare_defaults=False)
    assert res.summary["sample_window_s"] < res.summary["min_window_s"]
    assert "optimistic" in res.summary["warnings"][0]


def test_requests_turned_away_need_the_slo_sets_permission():
    """Two prompts larger than the whole KV pool are rejected by every policy: at the
    default max_rejected_share of 0 nothing is feasible and the explanation says so; with
    1% allowed the policy says how many were turned away and which."""
    from servetune.apps.optimize import optimize
    from servetune.errors import InfeasibleError
    from servetune.profiles.shipped import load_profile
    from servetune.schemas.slo import SLOSet
    from servetune.workloads.trace import from_arrays

    profile = load_profile(PROFILE)
    profile = profile.model_copy(update={"memory": profile.memory.model_copy(
        update={"kv_blocks_override": 1001})})  # 1000 usable blocks: 16,000 tokens
    n = 300
    rng = np.random.default_rng(0)
    prompts = rng.integers(200, 800, n)
    prompts[[50, 200]] = 20_000
    trace = from_arrays(np.arange(n) * 0.5, prompts, rng.integers(20, 100, n))
    space = SearchSpace(name="tiny", knobs={"batching.max_num_seqs": [64],
                                            "batching.max_num_batched_tokens": [2048]})

    def slo(cap: float) -> SLOSet:
        return SLOSet(classes={"default": {"ttft_s": 5.0, "percentile": 99,
                                           "max_rejected_share": cap}})

    with pytest.raises(InfeasibleError) as err:
        optimize(trace, profile, slo(0.0), space, method="grid", n_requests=n,
                 compare_defaults=False)
    assert err.value.details["binding"] == "rejected[default]"
    assert "turned away 0.667% or more" in str(err.value)
    result = optimize(trace, profile, slo(0.01), space, method="grid", n_requests=n,
                      compare_defaults=False)
    away = result.summary["turned_away"]
    assert away["requests"] == 2 and away["share"] == pytest.approx(2 / n)
    [(reason, which)] = away["by_reason"].items()
    assert reason.startswith("rejected: needs more KV blocks than the pool")
    assert (which["prompt_tokens_min"], which["prompt_tokens_max"]) == (20_000, 20_000)
    assert result.policy.metadata["simulated"]["turned_away"]["requests"] == 2


def test_an_answer_on_the_edge_of_the_space_widens_it():
    """max_num_seqs offered only 4 or 8 holds the conversation workload far below what the
    GPU can do: the answer sits on the high edge, 16 does better, so the space grows there
    (up to MAX_WIDENINGS times, each a search again) and the policy says so. Without
    widening the answer stays on the edge."""
    from servetune.apps.optimize import MAX_WIDENINGS, optimize
    from servetune.profiles.shipped import load_profile
    from servetune.workloads.fitting import load_workload

    workload = load_workload(WORKLOAD)
    profile = load_profile(PROFILE)
    slo = load_document(SLO, SLOSet)
    space = SearchSpace(name="narrow", knobs={"batching.max_num_seqs": [4, 8],
                                              "batching.max_num_batched_tokens": [2048]})
    kept = optimize(workload, profile, slo, space, n_requests=300, compare_defaults=False,
                    widen_edges=False)
    assert kept.policy.batching.max_num_seqs == 8
    assert kept.summary["space_edges"] == []
    wide = optimize(workload, profile, slo, space, n_requests=300, compare_defaults=False)
    edges = wide.summary["space_edges"]
    grown = [e for e in edges if e["widened"]]
    assert [e["beyond"] for e in grown] == [16, 32, 64][:MAX_WIDENINGS]
    assert all(e["knob"] == "batching.max_num_seqs" and e["side"] == "high" for e in grown)
    assert [e["round"] for e in grown] == list(range(1, len(grown) + 1))
    assert wide.policy.batching.max_num_seqs == grown[-1]["beyond"]
    assert wide.summary["goodput_rate_per_s"] > 1.5 * kept.summary["goodput_rate_per_s"]
    assert [e["beyond"] for e in wide.policy.metadata["space_edges"]] == [
        e["beyond"] for e in edges]


def test_progress_lines_do_not_wrap_when_piped(tmp_path):
    """Piped to a file or grep, each progress message stays on one line (rich wrapped them
    at 80 columns before)."""
    import subprocess
    import sys

    args = [a for a in _args(tmp_path, "p.yaml") if a != "--quiet"]
    proc = subprocess.run(
        [sys.executable, "-c", "from servetune.cli import run; run()", *args],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines and all(ln.startswith(("optimize:", "wrote ")) for ln in lines), lines
    assert any(len(ln) > 80 for ln in lines)  # long messages exist and were not wrapped


def test_a_generic_csv_trace_is_read_with_columns(tmp_path):
    """`optimize --trace generic.csv --columns ...` reads the same requests as the Azure
    file they came from, so it chooses the same policy with the same goodput."""
    from datetime import datetime

    rows = (REPO / "configs/examples/azure-conv-synthetic.csv").read_text().splitlines()[1:401]
    t0 = datetime.fromisoformat(rows[0].split(",")[0][:26])
    generic = tmp_path / "generic.csv"
    generic.write_text("t,p,o\n" + "".join(
        f"{(datetime.fromisoformat(r.split(',')[0][:26]) - t0).total_seconds():.6f},"
        f"{r.split(',')[1]},{r.split(',')[2]}\n" for r in rows))
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")

    def run(trace: Path, out: str, *extra: str) -> dict:
        res = _run(["optimize", "--trace", str(trace), "--profile", str(PROFILE), "--slo",
                    str(SLO), "--space", str(_space(tmp_path)), "--requests", "300", "-q",
                    "-o", str(tmp_path / out), "--json-out", str(tmp_path / f"{out}.json"),
                    *extra])
        assert res.exit_code == 0, res.output
        return json.loads((tmp_path / f"{out}.json").read_text())

    a = run(azure, "a.yaml")
    g = run(generic, "g.yaml", "--columns", "arrival=t,prompt=p,output=o")
    assert g["policy"] == a["policy"]
    assert g["goodput_rate_per_s"] == pytest.approx(a["goodput_rate_per_s"], rel=1e-6)
