"""The optimizer and nightly on an executor (issue 17, item 1): the same bytes with
``--workers 1``, ``--workers 2`` and ``--ray local``; a batch of goodput searches gives
the same answers serially and on processes, and its merge keeps the counts and the
caches exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from optimizer_fixtures import SMALL_SPACE, ThresholdSim, fluid
from test_nightly import POOR, SPACE, snapshot, tiny_args
from typer.testing import CliRunner

from servetune.cli import app
from servetune.executor import ProcessExecutor, SerialExecutor, ray_available
from servetune.models.fluid import Knobs, knobs_grid
from servetune.schemas.base import load_document
from servetune.schemas.policy import Policy
from servetune.schemas.slo import SLOSet
from servetune.schemas.space import apply_knobs
from servetune.sim.api import prepare_trace
from servetune.sim.evaluator import Evaluator
from servetune.solvers import baselines
from servetune.solvers.loop import GoodputTask, find_goodputs, search
from servetune.workloads.fitting import load_workload

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = REPO / "configs" / "workloads" / "azure-conv-2023.yaml"
TRACE = REPO / "configs" / "examples" / "azure-conv-synthetic.csv"
PROFILE = REPO / "gpu_profiles" / "h200-llama-3.1-8b.yaml"
SLO = REPO / "configs" / "slos" / "mlperf-llama-3.1-8b-server.yaml"

shipped = pytest.mark.skipif(
    not all(p.exists() for p in (WORKLOAD, TRACE, PROFILE, SLO)),
    reason="shipped workload/trace/profile/SLO files not present",
)
runner = CliRunner()


def make_policy(k: Knobs) -> Policy:
    return apply_knobs(Policy(), k.as_dotted())


def _truth(points: list[Knobs]) -> dict[Knobs, float]:
    """Goodputs that favour big step budgets and many seats, with ties across shapes (so
    a round's candidates pass and fail side by side)."""
    return {k: 2.0 + 0.002 * min(k.max_num_batched_tokens, 2048) + 0.01 * k.max_num_seqs
            for k in points}


# --- the batch, on a stand-in simulator -----------------------------------------------------


def test_a_batch_gives_the_same_answers_serially_and_on_processes():
    points = knobs_grid(SMALL_SPACE)
    truth = _truth(points)
    tasks = [GoodputTask(make_policy(k), start_scale=0.5 + 0.1 * i, rel_tol=0.02)
             for i, k in enumerate(points[:5])]
    serial_sim = ThresholdSim(truth)
    serial = find_goodputs(serial_sim, tasks, SerialExecutor())
    seen: list[int] = []
    with ProcessExecutor(2) as ex:
        sim = ThresholdSim(truth)
        parallel = find_goodputs(sim, tasks, ex, each=lambda i, _est: seen.append(i))
    assert parallel == serial and seen == [0, 1, 2, 3, 4]
    # The merge adds every fork's simulations, no more, no fewer.
    assert sim.simulations == serial_sim.simulations == sum(len(e.points) for e in serial)


def test_the_search_loop_evaluates_the_same_candidates_serially_and_on_processes():
    fm = fluid()
    points = knobs_grid(SMALL_SPACE)
    truth = _truth(points)

    def run(executor):
        sim = ThresholdSim(truth)
        res = search(fm, points, make_policy, sim, k=3, max_iterations=3, rel_tol=0.02,
                     executor=executor)
        return sim.simulations, [(e.label, e.knobs, e.goodput) for e in res.evaluated], \
            res.best.knobs, res.iterations

    serial = run(SerialExecutor())
    with ProcessExecutor(2) as ex:
        assert run(ex) == serial
    sims, evaluated, _, _ = serial
    # Every simulation is some candidate's or the incumbents' refinement: none lost.
    assert sims >= sum(len(g.points) for _, _, g in evaluated)


def test_random_search_keeps_its_budget_and_order_on_processes():
    points = knobs_grid(SMALL_SPACE)
    truth = _truth(points)
    serial = baselines.random_search(points, make_policy, ThresholdSim(truth), budget=20,
                                     seed=3)
    with ProcessExecutor(2) as ex:
        parallel = baselines.random_search(points, make_policy, ThresholdSim(truth),
                                           budget=20, seed=3, executor=ex)
    assert [(e.index, e.goodput) for e in parallel.evaluated] == \
        [(e.index, e.goodput) for e in serial.evaluated]
    assert parallel.simulations == serial.simulations
    # No batch starts once the budget is spent: everything but the last batch fit in it.
    assert serial.stopped_by == "simulation_budget"


def test_batch_size_follows_the_budget_left():
    assert baselines._batch_size(None, 0, 0) == baselines.MAX_BATCH
    assert baselines._batch_size(20, 0, 0) == 20 // baselines.SIMS_PER_POINT_GUESS
    assert baselines._batch_size(10, 40, 10) == 2  # 4 simulations a point so far
    assert baselines._batch_size(1, 40, 4) == 1  # always at least one point


# --- the real simulator's fork and merge ----------------------------------------------------


@shipped
def test_trace_simulator_forks_merge_counts_and_caches_exactly():
    from servetune.profiles.shipped import load_profile

    workload = load_workload(WORKLOAD)
    sim = Evaluator(prepare_trace(workload, seed=0, n_requests=200),
                         load_profile(str(PROFILE)), load_document(SLO, SLOSet),
                         source=workload, min_window_s=60.0)
    policies = [apply_knobs(Policy(), {"batching.max_num_seqs": n}) for n in (64, 256)]
    tasks = [GoodputTask(p, start_scale=1.0, rel_tol=0.05) for p in policies]
    with ProcessExecutor(2) as ex:
        first = find_goodputs(sim, tasks, ex)
        points = sum(len(e.points) for e in first)
        assert sim.simulations == points and len(sim._seen) == points
        assert sim._longer  # a longer sample was made in a worker and came back
        # The same searches again: every point is in the merged cache, none simulated.
        again = find_goodputs(sim, tasks, ex)
    assert again == first and sim.simulations == points


# --- the commands: the same bytes on any backend --------------------------------------------


def _optimize(tmp_path: Path, name: str, *extra: str) -> tuple[bytes, dict]:
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    out, summary = tmp_path / f"{name}.yaml", tmp_path / f"{name}.json"
    res = runner.invoke(app, [
        "optimize", "--workload", str(WORKLOAD), "--profile", str(PROFILE), "--slo", str(SLO),
        "--space", str(space), "--requests", "200", "--max-simulations", "16", "--quiet",
        "-o", str(out), "--json-out", str(summary), *extra])
    assert res.exit_code == 0, res.output
    return out.read_bytes(), json.loads(summary.read_text())


@shipped
def test_optimize_is_byte_identical_on_one_and_two_workers(tmp_path):
    one, s1 = _optimize(tmp_path, "one", "--workers", "1")
    two, s2 = _optimize(tmp_path, "two", "--workers", "2")
    assert two == one
    assert s2["simulations"] == s1["simulations"] and s2["iterations"] == s1["iterations"]


@shipped
@pytest.mark.skipif(not ray_available(), reason="ray is not installed (extra `ray`)")
def test_optimize_is_byte_identical_on_ray(tmp_path):
    serial, _ = _optimize(tmp_path, "serial", "--workers", "1")
    on_ray, _ = _optimize(tmp_path, "ray", "--ray", "local", "--workers", "2")
    assert on_ray == serial


@shipped
def test_nightly_is_byte_identical_on_one_and_two_workers(tmp_path):
    lines = TRACE.read_text().splitlines()
    (tmp_path / "trace.csv").write_text("\n".join(lines[:301]) + "\n")
    (tmp_path / "space.yaml").write_text(SPACE)
    (tmp_path / "poor.yaml").write_text(POOR)
    (tmp_path / "profile.yaml").write_bytes(PROFILE.read_bytes())
    outputs, codes = [], []
    for workers in ("1", "2"):
        out = tmp_path / f"out{workers}"
        res = runner.invoke(app, tiny_args(tmp_path, out, tmp_path / "poor.yaml",
                                           "--max-simulations", "12", "--workers", workers))
        assert res.exit_code in (0, 10), res.output  # adopted, or the current kept
        codes.append(res.exit_code)
        outputs.append(snapshot(out))
    assert "report.md" in outputs[0] and outputs[1] == outputs[0] and codes[1] == codes[0]


@pytest.mark.parametrize("command", ["optimize", "nightly", "report", "validate"])
def test_commands_take_workers_and_ray(command):
    res = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "--workers" in res.output and "--ray" in res.output
