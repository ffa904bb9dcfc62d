"""Baselines over the same search space, judged by the same simulator.

- engine defaults: ``vllm serve`` on a GPU with >= 70 GiB that is not an A100 (1024
  sequences, 8192 batched tokens; docs/engines.md 1.4) and SGLang's (chunked prefill 8192 on
  a < 160 GB GPU, docs/engines.md 2.1; ``max_running_requests`` = min(KV tokens / 2, the
  request-pool size, which SGLang sizes between 2048 and 4096 slots), simulated with the
  ``sglang`` admission model when the simulator has it;
- exhaustive grid: every point of the space simulated, goodput by bracketing and bisection
  from the workload's own rate (the brute-force oracle);
- every method's answer gets its goodput bracket narrowed to 1% at the end (as the milp
  loop's does), so answers are compared at the same resolution;
- random search: points in a seeded random order, same goodput search, until the
  simulation budget is spent;
- grid and random search evaluate their points in batches on an executor
  (:mod:`servetune.executor`), each batch of a size fixed by the inputs (never by the
  number of workers), the budget checked before each: a started batch finishes;
- Optuna TPE (only when ``optuna`` is importable, the optional extra ``optuna``), seeded,
  same budget.

Every baseline stops on work (a number of simulations), so its answer is the same on any
machine; the wall-clock ``deadline`` is only a safety stop, and ``stopped_by`` says when
it fired (the answer then depends on the machine's speed).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servetune.engines import GpuFacts, engine
from servetune.executor import Executor
from servetune.models.fluid import Knobs
from servetune.solvers.loop import (
    STOP_EXHAUSTED,
    STOP_TIME_LIMIT,
    Evaluated,
    GoodputTask,
    Simulator,
    find_goodput,
    find_goodputs,
    refine_goodput,
    work_stop,
)


def engine_default_knobs(name: str, gpu: GpuFacts) -> tuple[Knobs, str]:
    """Engine ``name``'s own batching defaults on ``gpu`` (the engine table's), the other
    knobs at the Policy defaults, and the rule that gave them."""
    default_batching = engine(name).default_batching
    if default_batching is None:
        raise ValueError(f"servetune does not model {name}'s default batching")
    d = default_batching(gpu)
    knobs = Knobs(max_num_seqs=d.max_num_seqs, max_num_batched_tokens=d.max_num_batched_tokens)
    return knobs, d.rule


@dataclass
class BaselineResult:
    method: str
    best: Evaluated | None
    evaluated: list[Evaluated] = field(default_factory=list)
    simulations: int = 0
    skipped: str = ""
    # STOP_EXHAUSTED (every point tried), STOP_SIMULATIONS (the budget was spent) or
    # STOP_TIME_LIMIT (the wall-clock safety stop fired)
    stopped_by: str = STOP_EXHAUSTED

    @property
    def stopped_at_deadline(self) -> bool:
        return self.stopped_by == STOP_TIME_LIMIT

    @property
    def goodput_rate_per_s(self) -> float:
        return self.best.goodput.rate_per_s if self.best else 0.0


def _best(evaluated: list[Evaluated]) -> Evaluated | None:
    passing = [e for e in evaluated if e.goodput.passed]
    return max(passing, key=lambda e: (e.goodput.rate_per_s, -e.index), default=None)


# The answer's goodput bracket is narrowed to this, as the milp loop does for its answer.
REFINE_TOL = 0.01


def _refined(evaluated: list[Evaluated], sim: Simulator) -> Evaluated | None:
    """The best point, its goodput bracket narrowed to ``REFINE_TOL``."""
    best = _best(evaluated)
    if best is not None:
        best.goodput = refine_goodput(sim, best.policy, best.goodput, rel_tol=REFINE_TOL)
    return best


def _evaluate(
    i: int, knobs: Knobs, make_policy: Callable[[Knobs], Any], sim: Simulator, label: str,
    rel_tol: float,
) -> Evaluated:
    policy = make_policy(knobs)
    est = find_goodput(sim, policy, start_scale=1.0, factor=2.0, rel_tol=rel_tol)
    return Evaluated(i, knobs, math.nan, None, est, policy, label=label)


# Points per batch: at most this many, and no more than the simulation budget left is
# expected to pay for (at the simulations per point seen so far, at first this guess).
# Fixed numbers, never the worker count: where a budget stops the search then depends on
# the inputs alone.
MAX_BATCH = 16
SIMS_PER_POINT_GUESS = 6


def _batch_size(left: int | None, spent: int, done: int) -> int:
    """How many points the next batch takes, with ``left`` simulations of the budget left
    (None: no budget) after ``spent`` simulations on ``done`` points."""
    if left is None:
        return MAX_BATCH
    per = spent / done if done and spent else SIMS_PER_POINT_GUESS
    return max(1, min(MAX_BATCH, int(left // per)))


def _search_points(
    order: list[int], points: list[Knobs], make_policy: Callable[[Knobs], Any],
    sim: Simulator, *, label: str, rel_tol: float, budget: int | None,
    deadline: float | None, executor: Executor | None,
    progress: Callable[[int, int], Any] | None = None,
) -> tuple[list[Evaluated], str]:
    """The points ``order`` names, in that order, in batches on ``executor``: each batch
    (:func:`_batch_size`) starts only while the ``budget`` (None: none) has simulations
    left and, the safety stop, before ``deadline``; a started batch finishes. Returns the
    points evaluated and why it stopped."""
    start = sim.simulations
    out: list[Evaluated] = []
    stopped_by = STOP_EXHAUSTED
    at = 0
    while at < len(order):
        spent = sim.simulations - start
        stop = work_stop(budget is not None and spent >= budget,
                         deadline is not None and time.perf_counter() > deadline)
        if stop:
            stopped_by = stop
            break
        left = None if budget is None else budget - spent
        part = [int(i) for i in order[at:at + _batch_size(left, spent, len(out))]]
        tasks = [GoodputTask(make_policy(points[i]), 1.0, rel_tol, factor=2.0) for i in part]

        def record(n: int, est: Any, part: list[int] = part, tasks: list = tasks) -> None:
            i = part[n]
            out.append(Evaluated(i, points[i], math.nan, None, est, tasks[n].policy,
                                 label=label))
            if progress:
                progress(len(out), len(order))

        find_goodputs(sim, tasks, executor, each=record)
        at += len(part)
    return out, stopped_by


def grid_search(
    points: list[Knobs],
    make_policy: Callable[[Knobs], Any],
    sim: Simulator,
    *,
    rel_tol: float = 0.03,
    progress: Callable[[int, int], Any] | None = None,
    budget: int | None = None,
    deadline: float | None = None,
    executor: Executor | None = None,
) -> BaselineResult:
    """Every point simulated (the oracle), in order, in batches on ``executor``; no new
    batch starts once ``budget`` simulations are spent (None: no limit) or, the safety
    stop, after ``deadline`` (a ``time.perf_counter`` value)."""
    start = sim.simulations
    out, stopped_by = _search_points(
        list(range(len(points))), points, make_policy, sim, label="grid", rel_tol=rel_tol,
        budget=budget, deadline=deadline, executor=executor, progress=progress)
    return BaselineResult("grid", _refined(out, sim), out, sim.simulations - start,
                          stopped_by=stopped_by)


def random_search(
    points: list[Knobs],
    make_policy: Callable[[Knobs], Any],
    sim: Simulator,
    *,
    budget: int,
    seed: int = 0,
    rel_tol: float = 0.03,
    deadline: float | None = None,
    executor: Executor | None = None,
) -> BaselineResult:
    """Points in a seeded random order, in batches on ``executor``, until ``budget``
    simulations are used (or, the safety stop, ``deadline`` passes); a batch takes no
    more points than the budget left is expected to pay for."""
    start = sim.simulations
    order = [int(i) for i in np.random.default_rng(seed).permutation(len(points))]
    out, stopped_by = _search_points(
        order, points, make_policy, sim, label="random", rel_tol=rel_tol, budget=budget,
        deadline=deadline, executor=executor)
    return BaselineResult("random", _refined(out, sim), out, sim.simulations - start,
                          stopped_by=stopped_by)


def optuna_available() -> bool:
    try:  # lazy: optuna is an optional extra (servetune[optuna])
        import optuna  # noqa: F401
    except ImportError:
        return False
    return True


def optuna_search(
    space_knobs: dict[str, list[Any]],
    points: list[Knobs],
    make_policy: Callable[[Knobs], Any],
    sim: Simulator,
    *,
    budget: int,
    seed: int = 0,
    rel_tol: float = 0.03,
    deadline: float | None = None,
) -> BaselineResult:
    """Optuna's TPE sampler over the knobs (categorical), until ``budget`` simulations
    (or, the safety stop, until ``deadline`` passes)."""
    if not optuna_available():
        return BaselineResult("optuna", None, skipped="optuna is not installed "
                              "(pip install 'servetune[optuna]')")
    import optuna  # lazy: an optional extra, present (checked above)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    index = {k: i for i, k in enumerate(points)}
    names = [p for p in space_knobs if p in Knobs.FIELDS]
    start = sim.simulations
    out: list[Evaluated] = []
    study = optuna.create_study(
        # TPE seeds numpy's legacy RandomState, which takes 32 bits
        direction="maximize", sampler=optuna.samplers.TPESampler(seed=int(seed) % 2**32)
    )
    trials = 0
    stopped_by = STOP_EXHAUSTED  # TPE stopped proposing new points
    while trials < 20 * max(budget, 1):
        stop = work_stop(sim.simulations - start >= budget,
                         deadline is not None and time.perf_counter() > deadline)
        if stop:
            stopped_by = stop
            break
        trials += 1
        trial = study.ask()
        values = {
            n: space_knobs[n][trial.suggest_categorical(n, list(range(len(space_knobs[n]))))]
            for n in names
        }
        knobs = Knobs(
            **{
                **{f: getattr(points[0], f) for f in Knobs.FIELDS.values()},
                **{Knobs.FIELDS[n]: v for n, v in values.items()},
            }
        )
        if knobs not in index:  # invalid combination (tokens < seqs)
            study.tell(trial, 0.0)
            continue
        ev = _evaluate(index[knobs], knobs, make_policy, sim, "optuna", rel_tol)
        out.append(ev)
        study.tell(trial, ev.goodput.rate_per_s)
    return BaselineResult("optuna", _refined(out, sim), out, sim.simulations - start,
                          stopped_by=stopped_by)
