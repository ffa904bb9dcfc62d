"""Check the simulator against a real benchmark run, and correct a profile to match it.

:func:`replay` drives the simulator with the requests of a :class:`BenchRun` (their send
times, prompt and output tokens). An open-loop run is replayed at its send times. A
closed-loop run (``max_concurrency`` C) is replayed as a closed loop: request ``i`` is
sent when it was meant to be (at once for ``--request-rate inf``) or, if C requests are
still in flight, ``CLIENT_GAP_S`` after the earliest of them finishes (the client reads the
last token, then sends: the step that starts as the other one ends has already been
scheduled, so the new request joins the one after). Which requests are in flight depends
on the latencies the simulator predicts, so the send times are found by iterating:
simulate, recompute the send times from the simulated latencies, repeat until none
moves. The load is causal (a send depends only on finishes before it, which depend only
on sends before them), so each round fixes at least the earliest send still wrong, and the
iteration ends exactly, in at most one round per request (``CLOSED_LOOP_MAX_ROUNDS``
bounds it for very long runs; the report says how many rounds it took and whether it
converged).

:func:`compare` sets predicted against measured TTFT, TPOT (= the request's mean
inter-token latency) and end-to-end latency (mean, p50, p90, p99, and per-request errors)
and output throughput. :func:`calibrate` fits the four terms of the profile's step time
that a real engine run shows and a GPU timing does not (:data:`PARAMS`): the host seconds
per step and per sequence (``host_s_per_step``, ``host_s_per_seq``; the per-step one as
the run exposes it, so the corrected profile pins ``host_overlap: false``), the decode
attention per context token (``decode_attn_s_per_context_token``: the KV bandwidth the
engine's paged, split-KV kernel reaches) and ``gpu_time_scale``, a factor on the whole GPU
part. It minimises the squared per-request TTFT and E2E errors, each normalised by the
measured mean, with a damped Gauss-Newton (Levenberg-Marquardt) search whose Jacobian
comes from finite differences of whole replays, from three starts (:data:`_STARTS`). (The
exact derivatives of a fixed schedule are no good here: a slower step batches more
requests into the next ones, so the real latencies move far less than a frozen schedule
says.) A run tells the terms apart when its batches vary (a sweep of concurrencies, or a
load that rises and falls) and its contexts do (short and long prompts). The corrected
profile records the fit in its ``calibration`` block: the benchmark file's SHA-256, what
was fitted and the error before and after.
"""

from __future__ import annotations

import heapq
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from servetune.apps.report import summary_json_text
from servetune.errors import ServetuneError
from servetune.executor import Executor, SerialExecutor
from servetune.io import commit_files, plain_data
from servetune.profiles.schema import CalibrationFile, Profile
from servetune.profiles.steptime import COEF_HOST_SEQ, COEF_HOST_STEP
from servetune.schemas.policy import Policy
from servetune.sim import simulate
from servetune.sim.metrics import distribution
from servetune.workloads.bench import BenchRun
from servetune.workloads.trace import Trace

if TYPE_CHECKING:
    from servetune.sim.api import SimResult

CLIENT_GAP_S = 1e-6  # a request sent as another finishes joins the step after the next
CLOSED_LOOP_TOL_S = 1e-9  # sends equal up to rounding: the fixed point is exact
CLOSED_LOOP_MAX_ROUNDS = 2000
METRICS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E"))
PARAMS = ("host_s_per_step", "host_s_per_seq", "gpu_time_scale",
          "decode_attn_s_per_context_token")
# Search units (ms, us, factor, ns per token) and finite-difference steps in them.
_UNIT = np.array([1e-3, 1e-6, 1.0, 1e-9])
_STEP = np.array([0.25, 20.0, 0.03, 5.0])
_LOW = np.array([0.0, 0.0, 0.05, 0.0])
_HIGH = np.array([999.0, 999_000.0, 100.0, 1e6])


# ----------------------------------------------------------------------------- replay


@dataclass(eq=False)
class Replay:
    """One replay of a run: the simulator's result and per-request predictions, in the
    run's order."""

    result: SimResult
    send_s: np.ndarray
    ttft_s: np.ndarray
    e2e_s: np.ndarray
    tpot_s: np.ndarray
    rounds: int = 1
    converged: bool = True
    max_shift_s: float = 0.0
    not_completed: int = 0


def closed_loop_sends(intended_s: np.ndarray, latency_s: np.ndarray, concurrency: int
                      ) -> np.ndarray:
    """Send times of a client that keeps at most ``concurrency`` requests in flight and
    sends them in order: each at its intended time, or ``CLIENT_GAP_S`` after a slot
    frees."""
    n = len(intended_s)
    out = np.empty(n, dtype=np.float64)
    flight: list[float] = []
    last = 0.0
    for i in range(n):
        t = max(float(intended_s[i]), last)
        if len(flight) >= concurrency:
            t = max(t, heapq.heappop(flight) + CLIENT_GAP_S)
        out[i] = t
        last = t
        heapq.heappush(flight, t + float(latency_s[i]))
    return out


def _trace(run: BenchRun, send_s: np.ndarray) -> tuple[Trace, int]:
    return Trace(arrival_s=send_s - send_s[0], prompt_tokens=run.prompt_tokens,
                 output_tokens=run.output_tokens, source=run.path), 0


TraceOf = Callable[[np.ndarray], tuple[Trace, int]]


def _predictions(run: BenchRun, send_s: np.ndarray, res: SimResult, trace: Trace,
                 first: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    # the run's requests are trace rows first.., the first of them sent at send_s[0]
    rows = slice(first, first + len(run))
    base = send_s[0] - trace.arrival_s[first]
    first_s = np.asarray(res.output.first_token_s, dtype=np.float64)[rows] + base
    finish = np.asarray(res.output.finish_s, dtype=np.float64)[rows] + base
    done = np.isfinite(finish) & np.isfinite(first_s)
    ttft = np.where(done, first_s - send_s, np.nan)
    e2e = np.where(done, finish - send_s, np.nan)
    steps = (run.output_tokens - 1).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(steps > 0, (e2e - ttft) / steps, np.nan)
    return ttft, e2e, tpot, int((~done).sum())


def replay(run: BenchRun, policy: Policy, profile: Profile, *, engine: str = "vllm",
           trace_of: TraceOf | None = None) -> Replay:
    """Simulate the run's requests as its client sent them (see the module doc).

    ``trace_of(send_s)`` builds the simulated trace for the run's send times and says at
    which row the run's requests start in it (default: the run's requests alone, from
    row 0). A caller can so put requests before the run (a server that served an earlier
    run keeps its prefix cache) or give the requests prefix blocks; the result's
    simulation then holds those rows too, and the predictions are the run's."""
    build = trace_of or (lambda send_s: _trace(run, send_s))

    def simulated(send: np.ndarray) -> tuple[SimResult, tuple]:
        trace, first = build(send)
        res = simulate(trace, policy, profile, engine=engine)
        return res, _predictions(run, send, res, trace, first)

    send = run.send_s.copy()
    if not run.closed_loop:
        res, (ttft, e2e, tpot, missing) = simulated(send)
        return Replay(res, send, ttft, e2e, tpot, not_completed=missing)
    assert run.max_concurrency is not None
    intended = run.intended_s if run.intended_s is not None else run.send_s
    send = closed_loop_sends(intended, np.zeros(len(run)), run.max_concurrency)
    shift = math.inf
    rounds = 0
    while True:
        rounds += 1
        res, (ttft, e2e, tpot, missing) = simulated(send)
        latency = np.where(np.isfinite(e2e), e2e, 0.0)  # turned away: frees its slot
        new = closed_loop_sends(intended, latency, run.max_concurrency)
        shift = float(np.max(np.abs(new - send)))
        if shift <= CLOSED_LOOP_TOL_S or rounds >= CLOSED_LOOP_MAX_ROUNDS:
            break
        send = new
    return Replay(res, send, ttft, e2e, tpot, rounds=rounds,
                  converged=shift <= CLOSED_LOOP_TOL_S, max_shift_s=shift,
                  not_completed=missing)


# ----------------------------------------------------------------------------- compare


def _throughput(run: BenchRun, send_s: np.ndarray, e2e_s: np.ndarray) -> dict[str, float]:
    done = np.isfinite(e2e_s)
    if not done.any():
        return {"output_tok_s": 0.0, "req_s": 0.0}
    span = float(np.max((send_s + e2e_s)[done]) - np.min(send_s))
    if span <= 0:
        return {"output_tok_s": 0.0, "req_s": 0.0}
    return {"output_tok_s": float(run.output_tokens[done].sum()) / span,
            "req_s": float(done.sum()) / span}


def _errors(measured: np.ndarray, predicted: np.ndarray) -> dict[str, float | None]:
    ok = np.isfinite(measured) & np.isfinite(predicted) & (measured > 0)
    if not ok.any():
        return {"mean_abs_s": None, "mean_rel": None, "median_abs_rel": None,
                "p90_abs_rel": None}
    diff = predicted[ok] - measured[ok]
    rel = diff / measured[ok]
    return {
        "mean_abs_s": float(np.mean(np.abs(diff))),
        "mean_rel": float(np.mean(rel)),
        "median_abs_rel": float(np.median(np.abs(rel))),
        "p90_abs_rel": float(np.percentile(np.abs(rel), 90)),
    }


def _stat_errors(meas: dict[str, Any], pred: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key, m in meas.items():
        p = pred.get(key)
        out[key] = (p - m) / m if (m and p is not None) else None
    return out


def compare(run: BenchRun, rep: Replay) -> dict[str, Any]:
    """Predicted against measured, per metric, throughput and replay facts."""
    metrics: dict[str, Any] = {}
    measured = {"ttft_s": run.ttft_s, "tpot_s": run.tpot_s, "e2e_s": run.e2e_s}
    predicted = {"ttft_s": rep.ttft_s, "tpot_s": rep.tpot_s, "e2e_s": rep.e2e_s}
    for key, _ in METRICS:
        meas, pred = distribution(measured[key]), distribution(predicted[key])
        metrics[key] = {
            "measured": meas, "predicted": pred,
            "stat_rel_error": _stat_errors(meas, pred),
            "per_request": _errors(measured[key], predicted[key]),
        }
    t_meas = _throughput(run, run.send_s, run.e2e_s)
    t_pred = _throughput(run, rep.send_s, rep.e2e_s)
    return {
        "requests": len(run),
        "failed_in_run": run.failed,
        "not_completed_in_simulation": rep.not_completed,
        "metrics": metrics,
        "throughput": {
            "measured": t_meas, "predicted": t_pred,
            "rel_error": {k: ((t_pred[k] - v) / v if v else None) for k, v in t_meas.items()},
        },
        "fit_error": fit_error(run, rep),
        "replay": {
            "closed_loop": run.closed_loop,
            "max_concurrency": run.max_concurrency,
            "request_rate": run.request_rate,
            "rounds": rep.rounds,
            "converged": rep.converged,
            "max_send_shift_s": rep.max_shift_s,
        },
    }


def residuals(run: BenchRun, rep: Replay) -> np.ndarray:
    """Per-request TTFT and E2E errors, each over the measured mean, over sqrt(n): the
    sum of squares is the mean squared normalised error. A request the simulator did not
    complete counts as missing by its whole measured latency."""
    parts = []
    for meas, pred in ((run.ttft_s, rep.ttft_s), (run.e2e_s, rep.e2e_s)):
        scale = float(np.mean(meas)) or 1.0
        diff = np.where(np.isfinite(pred), pred - meas, meas)
        parts.append(diff / scale)
    return np.concatenate(parts) / math.sqrt(len(run))


def fit_error(run: BenchRun, rep: Replay) -> dict[str, float]:
    """RMS of the per-request errors over the measured mean, TTFT and E2E, and both."""
    r = residuals(run, rep) * math.sqrt(len(run))
    n = len(run)
    return {
        "ttft_rms_rel": float(np.sqrt(np.mean(r[:n] ** 2))),
        "e2e_rms_rel": float(np.sqrt(np.mean(r[n:] ** 2))),
        "rms_rel": float(np.sqrt(np.mean(r ** 2))),
    }


# ----------------------------------------------------------------------------- calibrate


def with_step_params(profile: Profile, host_step: float, host_seq: float, scale: float,
                     decode_attn: float | None = None) -> Profile:
    """``profile`` with its host costs pinned (the per-step one as it shows, not
    overlapped: what a measured run can see), its GPU time scaled and, if given, its
    decode attention per context token set."""
    st = profile.step_time.model_dump()
    st.update(host_s_per_step=host_step, host_s_per_seq=host_seq, host_overlap=False,
              gpu_time_scale=scale)
    if decode_attn is not None:
        st["decode_attn_s_per_context_token"] = decode_attn
    data = profile.model_dump()
    data["step_time"] = st
    return Profile.model_validate(data)


def step_params(profile: Profile, engine: str) -> tuple[float, float, float, float]:
    """The fitted terms' values in ``profile`` for ``engine`` (:data:`PARAMS`); the
    per-step host time as a step exposes it (after any overlap with the GPU)."""
    st = profile.step_time
    coef, _ = st.as_arrays(engine)
    return (float(coef[COEF_HOST_STEP]), float(coef[COEF_HOST_SEQ]), st.gpu_time_scale,
            st.decode_attn_s_per_context_token)


@dataclass
class Calibration:
    """What :func:`calibrate` found."""

    before: dict[str, float]
    after: dict[str, float]
    start: dict[str, float]
    fitted: dict[str, float]
    error_before: dict[str, float]
    error_after: dict[str, float]
    profile: Profile
    replay: Replay
    simulations: int = 0
    rounds: int = 0
    history: list[dict[str, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fitted": self.fitted, "start": self.start,
            "error_before": self.error_before, "error_after": self.error_after,
            "rounds": self.rounds, "simulations": self.simulations,
        }


def _replay_at(shared: tuple, x: np.ndarray) -> Replay:
    """The replay of the run with the step parameters ``x`` (in ``_UNIT``s)."""
    run, policy, profile, engine = shared
    return replay(run, policy, with_step_params(profile, *(x * _UNIT).tolist()),
                  engine=engine)


def _evaluate(shared: tuple, x: np.ndarray) -> tuple[np.ndarray, Replay]:
    """One point of the fit: the residuals there, and its replay."""
    rep = _replay_at(shared, x)
    return residuals(shared[0], rep), rep


def _residuals_at(shared: tuple, x: np.ndarray) -> tuple[np.ndarray, int]:
    """A finite-difference point of the fit: the residuals there, and its simulations
    (what a worker process sends back; the replay stays there)."""
    r, rep = _evaluate(shared, x)
    return r, rep.rounds


# Where the search starts, besides the profile's own values: the host time per sequence
# and the attention per context token trade against each other on runs whose contexts
# vary little, and the error surface of a replay is bumpy (a schedule changes a step at a
# time), so one descent can stop on a bump. Each start is a multiple of (per step, per
# sequence, GPU scale, attention); the lowest error found wins.
_STARTS = ((1.0, 1.0, 1.0, 1.0), (1.0, 0.25, 1.0, 1.5), (1.0, 2.0, 1.0, 0.5))


def _descend(shared: tuple, x: np.ndarray, r: np.ndarray, rep: Replay, ex: Executor,
             max_rounds: int, progress: Callable[[int, float], None] | None
             ) -> tuple[np.ndarray, np.ndarray, Replay, list[dict[str, float]], int]:
    """Levenberg-Marquardt from ``x`` (residuals ``r``, replay ``rep``) with a
    finite-difference Jacobian; returns the best point, its residuals and replay, the
    cost history and the simulations run."""
    sims = 0
    cost = float(r @ r)
    history = [{"round": 0, "cost": cost}]
    lam = 1e-3
    fine = 1.0  # finite-difference steps shrink when a round cannot improve
    gain = 0.0
    for rounds in range(1, max_rounds + 1):
        jac = np.empty((len(r), len(PARAMS)))
        steps, moved = [], []
        for k in range(len(PARAMS)):
            step = _STEP[k] * fine
            h = step if x[k] + step <= _HIGH[k] else -step
            xk = x.copy()
            xk[k] += h
            steps.append(h)
            moved.append(xk)
        for k, (rk, n) in enumerate(ex.map(_residuals_at, moved, shared=shared)):
            sims += n
            jac[:, k] = (rk - r) / steps[k]
        a_mat = jac.T @ jac
        grad = jac.T @ r
        improved = False
        for _ in range(8):
            damp = a_mat + lam * np.diag(np.diag(a_mat) + 1e-12)
            try:
                dx = np.linalg.solve(damp, -grad)
            except np.linalg.LinAlgError:
                dx = -grad * 1e-3
            xn = np.clip(x + dx, _LOW, _HIGH)
            rn, repn = _evaluate(shared, xn)
            sims += repn.rounds
            cn = float(rn @ rn)
            if cn < cost:
                improved = True
                gain = cost - cn
                x, r, rep, cost = xn, rn, repn, cn
                lam = max(lam / 3.0, 1e-9)
                break
            lam *= 4.0
        history.append({"round": rounds, "cost": cost})
        if progress is not None:
            progress(rounds, cost)
        if cost < 1e-14:
            break
        if not improved or gain <= 1e-4 * cost:
            if fine < 0.01:
                break
            fine /= 4.0
            lam = 1e-3
    return x, r, rep, history, sims


def calibrate(
    run: BenchRun, policy: Policy, profile: Profile, *, engine: str = "vllm",
    max_rounds: int = 30, progress: Callable[[int, float], None] | None = None,
    baseline: Replay | None = None, executor: Executor | None = None,
) -> Calibration:
    """Fit :data:`PARAMS` so the replay of ``run`` matches it (see the module doc): a
    Levenberg-Marquardt descent from each of :data:`_STARTS`, the lowest error kept; the
    corrected profile carries the fit in its calibration block. The finite-difference
    replays of a round do not depend on each other: they run on ``executor`` (default: in
    this process); the fit is the same on any executor."""
    if profile.step_time.constant_s is not None:
        raise ServetuneError(
            f"profile {profile.name!r}: step_time.constant_s fixes every step's time; there "
            "is nothing to calibrate (use a profile with a fitted step-time model)"
        )
    shared = (run, policy, profile, engine)
    ex = executor or SerialExecutor()
    origin = np.clip(np.asarray(step_params(profile, engine)) / _UNIT, _LOW, _HIGH)
    if baseline is None:
        r0, first_rep = _evaluate(shared, origin)
    else:
        r0, first_rep = residuals(run, baseline), baseline
    sims = first_rep.rounds
    best = None
    history: list[dict[str, float]] = []
    tried: list[np.ndarray] = []
    for start in _STARTS:
        x = np.clip(origin * np.asarray(start), _LOW, _HIGH)
        if any(np.array_equal(x, t) for t in tried):  # a term at 0 makes starts alike
            continue
        tried.append(x)
        r, rep = (r0, first_rep) if start == _STARTS[0] else _evaluate(shared, x)
        found = _descend(shared, x, r, rep, ex, max_rounds, progress)
        sims += found[4] + (0 if start == _STARTS[0] else rep.rounds)
        history += [{"start": _STARTS.index(start), **h} for h in found[3]]
        if best is None or float(found[1] @ found[1]) < float(best[1] @ best[1]):
            best = found
    assert best is not None
    x, _, rep, _, _ = best
    fitted = dict(zip(PARAMS, (x * _UNIT).tolist(), strict=True))
    start_values = dict(zip(PARAMS, step_params(profile, engine), strict=True))
    err_before, err_after = fit_error(run, first_rep), fit_error(run, rep)
    corrected = _recorded(with_step_params(profile, *fitted.values()), run, engine, policy,
                          start_values, fitted, err_before, err_after)
    return Calibration(
        before=start_values, after=fitted, start=start_values, fitted=fitted,
        error_before=err_before, error_after=err_after, profile=corrected, replay=rep,
        simulations=sims, rounds=len(history) - len(tried), history=history,
    )


def _recorded(profile: Profile, run: BenchRun, engine: str, policy: Policy,
              start: dict[str, float], fitted: dict[str, float],
              before: dict[str, float], after: dict[str, float]) -> Profile:
    cal = profile.calibration.model_copy(deep=True)
    name = Path(run.path).name
    cal.files = [f for f in cal.files if f.sha256 != run.sha256]
    cal.files.append(CalibrationFile(path=name, sha256=run.sha256, rows=len(run)))
    fit = dict(cal.fit)
    for key, value in fitted.items():
        fit[f"validate_{key}"] = round(value, 9)
    for key, value in before.items():
        fit[f"validate_before_{key}"] = round(value, 6)
    for key, value in after.items():
        fit[f"validate_after_{key}"] = round(value, 6)
    cal.fit = fit
    loop = (f"closed loop at max_concurrency {run.max_concurrency}" if run.closed_loop
            else "open loop at the measured send times")
    was = ", ".join(f"{k} {v:.6g}" for k, v in start.items())
    cal.assumptions = [a for a in cal.assumptions if not a.startswith("validate --calibrate")]
    cal.assumptions.append(
        f"validate --calibrate: {', '.join(PARAMS)} fitted (host_overlap pinned false) "
        f"(were {was}) by least squares on the per-request TTFT and E2E (each over its "
        f"measured mean) of {len(run)} requests of {name} ({run.fmt}, sha256 "
        f"{run.sha256[:12]}), replayed {loop} with engine {engine} and policy "
        f"{policy.name!r}; RMS relative error {before['rms_rel']:.4f} before, "
        f"{after['rms_rel']:.4f} after"
    )
    data = profile.model_dump()
    data["calibration"] = cal.model_dump()
    return Profile.model_validate(data)


# ----------------------------------------------------------------------------- report


def _cdf_png(title: str, xlabel: str, series: list[tuple[str, np.ndarray, str]]) -> bytes:
    # lazy: matplotlib (through report.pyplot) takes 0.8 s to import
    from servetune.apps.report import _plain_log_axis, figure_bytes, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    drew = False
    for label, values, style in series:
        v = np.sort(values[np.isfinite(values) & (values > 0)])
        if v.size == 0:
            continue
        ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", linestyle=style,
                label=label)
        drew = True
    if drew:
        _plain_log_axis(ax)
    ax.set_ylim(0, 1.01)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("share of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return figure_bytes(fig)


def figures(run: BenchRun, rep: Replay, calibrated: Replay | None = None) -> dict[str, bytes]:
    """One CDF per metric: measured, predicted (and predicted after calibration)."""
    out = {}
    measured = {"ttft_s": run.ttft_s, "tpot_s": run.tpot_s, "e2e_s": run.e2e_s}
    for key, label in METRICS:
        series = [("measured", measured[key], "-"), ("predicted", getattr(rep, key), "--")]
        if calibrated is not None:
            series.append(("predicted, calibrated", getattr(calibrated, key), ":"))
        out[f"cdf_{key[:-2]}.png"] = _cdf_png(f"{label}: measured and predicted",
                                             f"{label} (s)", series)
    return out


def _ms(x: Any) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _pct(x: Any) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def markdown(summary: dict[str, Any]) -> str:
    """The report's ``report.md`` from :func:`validation_summary`'s dict."""
    comp = summary["comparison"]
    rp = comp["replay"]
    lines = [
        f"# servetune validate: {summary['bench_result']['file']}",
        "",
        f"- benchmark: {summary['bench_result']['format']}, {comp['requests']} successful "
        f"requests ({comp['failed_in_run']} failed, left out), sha256 "
        f"`{summary['bench_result']['sha256'][:16]}`",
        f"- simulated: profile `{summary['profile']}`, policy `{summary['policy']}`, engine "
        f"{summary['engine']}",
        "- replay: " + (
            f"closed loop, at most {rp['max_concurrency']} requests in flight "
            f"({rp['rounds']} fixed-point rounds, "
            f"{'converged' if rp['converged'] else 'NOT converged'}, last shift "
            f"{rp['max_send_shift_s'] * 1e3:.2f} ms)" if rp["closed_loop"]
            else "open loop at the measured send times"),
    ]
    if comp["not_completed_in_simulation"]:
        lines.append(f"- {comp['not_completed_in_simulation']} request(s) turned away by "
                     "the simulated policy (counted as missing)")
    for note in summary["bench_result"]["notices"]:
        lines.append(f"- note: {note}")
    lines += ["", "## Latency (ms): measured / predicted (relative error)", "",
              "| metric | mean | p50 | p90 | p99 | per-request median abs. error |",
              "|---|---|---|---|---|---|"]
    for key, label in METRICS:
        m = comp["metrics"][key]
        cells = [
            f"{_ms(m['measured'][s])} / {_ms(m['predicted'][s])} "
            f"({_pct(m['stat_rel_error'][s])})" for s in ("mean", "p50", "p90", "p99")
        ]
        med = m["per_request"]["median_abs_rel"]
        lines.append(f"| {label} | " + " | ".join(cells)
                     + f" | {'-' if med is None else f'{med * 100:.1f}%'} |")
    th = comp["throughput"]
    lines += [
        "",
        f"Output throughput: measured {th['measured']['output_tok_s']:.1f} tok/s, predicted "
        f"{th['predicted']['output_tok_s']:.1f} tok/s "
        f"({_pct(th['rel_error']['output_tok_s'])}).",
        "",
        f"Fit error (RMS of per-request error over the measured mean): TTFT "
        f"{comp['fit_error']['ttft_rms_rel']:.3f}, E2E {comp['fit_error']['e2e_rms_rel']:.3f}.",
        "",
        "TPOT is (E2E - TTFT) / (output tokens - 1), the request's mean inter-token latency.",
    ]
    cal = summary.get("calibration")
    if cal is not None:
        lines += ["", "## Calibration", "",
                  "| parameter | before | fitted |", "|---|---|---|"]
        for key in PARAMS:
            lines.append(f"| {key} | {cal['start'][key]:.6g} | {cal['fitted'][key]:.6g} |")
        lines += [
            "",
            f"RMS relative error {cal['error_before']['rms_rel']:.4f} before, "
            f"{cal['error_after']['rms_rel']:.4f} after ({cal['rounds']} rounds, "
            f"{cal['simulations']} simulations).",
        ]
        after = summary.get("comparison_calibrated")
        if after is not None:
            lines += ["", "| metric (calibrated) | mean | p50 | p90 | p99 |",
                      "|---|---|---|---|---|"]
            for key, label in METRICS:
                m = after["metrics"][key]
                lines.append(f"| {label} | " + " | ".join(
                    f"{_ms(m['measured'][s])} / {_ms(m['predicted'][s])} "
                    f"({_pct(m['stat_rel_error'][s])})" for s in ("mean", "p50", "p90", "p99")
                ) + " |")
    lines += ["", "![TTFT](cdf_ttft.png)", "![TPOT](cdf_tpot.png)", "![E2E](cdf_e2e.png)", ""]
    return "\n".join(lines)


def validation_summary(run: BenchRun, rep: Replay, *, profile: Profile, policy: Policy,
                       engine: str, cal: Calibration | None = None) -> dict[str, Any]:
    """The JSON summary of a validation (and a calibration when given)."""
    summary: dict[str, Any] = {
        "bench_result": {"file": Path(run.path).name, "format": run.fmt,
                         "sha256": run.sha256, "notices": list(run.notices)},
        "profile": profile.name, "policy": policy.name, "engine": engine,
        "comparison": compare(run, rep),
    }
    if cal is not None:
        summary["calibration"] = cal.to_dict()
        summary["comparison_calibrated"] = compare(run, cal.replay)
    return plain_data(summary)


def report_files(summary: dict[str, Any], run: BenchRun, rep: Replay,
                 cal: Calibration | None = None) -> list[tuple[str, bytes]]:
    """The report folder's files: CDF plots, ``report.md``, ``validate.json`` (last)."""
    files = list(figures(run, rep, cal.replay if cal is not None else None).items())
    files.append(("report.md", markdown(summary).encode("utf-8")))
    files.append(("validate.json", summary_json_text(summary).encode("utf-8")))
    return files


def write_report(out_dir: str | os.PathLike[str], files: list[tuple[str, bytes]]) -> list[Path]:
    """The report folder's files as one output set (:func:`servetune.io.commit_files`)."""
    return commit_files(out_dir, files)
