"""Comparison report of two policies: Markdown, PNG plots and a JSON summary.

``compare(...)`` simulates a *current* and a *new* policy on the same trace, at its own
rate and at stress rates (+20 %, +50 % by default: the trace's arrivals compressed in
time), searches each policy's goodput (the highest arrival rate at which it meets the
SLO set), and runs both once more at the current policy's goodput rate, near saturation,
where policies differ most. ``build_report(...)`` turns that into the files
``write_report`` stores:

- ``ttft_cdf.png`` and ``tpot_cdf.png``: distribution of time to first token and time per
  output token of completed requests, current vs new, at the trace's rate and near
  saturation;
- ``kv_queue.png``: KV-cache utilization and waiting-queue length over simulated time, at
  both rates;
- ``goodput.png``: SLO attainment versus offered rate for both policies, from the goodput
  search, with each policy's goodput marked;
- ``report.md``: the verdict, a results table (per class too when the trace has several),
  the knob changes with the reasons the optimizer's models gave, the engine configs
  written, the plots, and a glossary;
- ``summary.json``: the same numbers for machines.

Files are deterministic: no clock readings or wall times, PNGs without a software tag, so
the same inputs give the same bytes. Plots use matplotlib's Agg backend (no display).
:func:`servetune.io.commit_files` writes them as one output set (a new generation folder
made live by one rename), so an interrupted run leaves the previous set intact and a reader
never sees a mix of two runs. With ``new=None`` the report
describes the current policy alone (the nightly job's infeasible case).
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from servetune import knobs as knob_table
from servetune.executor import Executor, SerialExecutor
from servetune.io import commit_files, finite_or_none, plain_data
from servetune.schemas.policy import ClassPolicy, Policy
from servetune.schemas.slo import ClassSLO, SLOSet
from servetune.sim import goodput, simulate
from servetune.workloads.reuse import hit_rate_curve
from servetune.workloads.trace import Trace

if TYPE_CHECKING:  # matplotlib loads lazily (see pyplot)
    from types import ModuleType

    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from servetune.profiles.schema import Profile
    from servetune.sim.api import SimResult
    from servetune.sim.goodput import GoodputResult

DEFAULT_STRESS = (1.2, 1.5)
FIGURE_NAMES = ("ttft_cdf.png", "tpot_cdf.png", "kv_queue.png", "goodput.png")
COLORS = {"current": "#4c72b0", "new": "#dd8452"}

GLOSSARY = """\
- **TTFT** (time to first token): seconds from a request's arrival to its first output
  token; what a chat user feels as "waiting for the answer to start".
- **TPOT** (time per output token): seconds between output tokens after the first, i.e.
  (end-to-end time - TTFT) / (output tokens - 1); what a user feels as reading speed.
- **SLO attainment**: the share of requests that meet every latency limit of their class;
  requests shed by a queue cap count as misses.
- **Goodput**: the highest arrival rate (requests per second) at which the policy still meets
  the SLO set, found by replaying the trace faster and slower (DistServe; MLPerf's server
  scenario for percentile limits).
- **Stress runs**: the same trace replayed 20 % and 50 % faster (more requests per second),
  to check that the new policy does not break first when traffic grows.
- **KV utilization**: the share of the GPU's key-value cache blocks in use; near 100 % the
  engine must preempt (recompute) requests or stop admitting.
- **Queue length**: requests that arrived but are not yet running.
"""


@dataclass
class PolicyEvaluation:
    """One policy's simulated runs (by rate scale) and its goodput search."""

    label: str  # "current" or "new"
    policy: Policy
    runs: dict[float, SimResult]  # by rate scale
    goodput: GoodputResult

    def attainment(self, scale: float, slo: SLOSet) -> float:
        return float(self.runs[scale].attainment(slo))

    def meets_slo(self, scale: float, slo: SLOSet) -> bool:
        return bool(self.runs[scale].meets_slo(slo))


@dataclass
class Comparison:
    trace: Trace
    slo: SLOSet
    profile_name: str
    engine: str
    scales: tuple[float, ...]  # 1.0 first, then the stress scales
    current: PolicyEvaluation
    new: PolicyEvaluation | None  # None: the current policy alone (nothing to compare)
    # Both policies are also run at the current policy's goodput rate (near saturation),
    # where their queues and KV use differ most; None when there is no such rate.
    capacity_scale: float | None = None

    @property
    def evaluations(self) -> tuple[PolicyEvaluation, ...]:
        return (self.current,) if self.new is None else (self.current, self.new)


def _compare_task(shared: tuple, item: tuple) -> Any:
    """One independent piece of :func:`compare`: a run of a policy at a rate scale
    (``("run", policy, scale)``) or a policy's goodput search (``("goodput", policy)``)."""
    trace, profile, slo, engine, goodput_rel_tol = shared
    if item[0] == "run":
        return simulate(trace, item[1], profile, engine=engine, rate_scale=item[2])
    return goodput(trace, item[1], profile, slo, engine=engine, rel_tol=goodput_rel_tol)


def compare(
    trace: Trace,
    current: Policy,
    new: Policy | None,
    profile: Profile,
    slo: SLOSet,
    *,
    engine: str = "vllm",
    stress: Sequence[float] = DEFAULT_STRESS,
    goodput_rel_tol: float | None = None,
    executor: Executor | None = None,
) -> Comparison:
    """Evaluate both policies (or the current one alone when ``new`` is None) on the same
    trace, rates and SLO set: each simulated at every rate scale (1.0, then ``stress``)
    and its goodput searched, then both at the current policy's goodput. Those runs and
    searches do not depend on each other: they run on ``executor`` (default: in this
    process), and the comparison is the same on any executor."""
    scales = (1.0, *(float(s) for s in stress))
    ex = executor or SerialExecutor()
    shared = (trace, profile, slo, engine, goodput_rel_tol)
    labelled = [("current", current)] + ([] if new is None else [("new", new)])
    items = [("run", policy, s) for _, policy in labelled for s in scales]
    items += [("goodput", policy) for _, policy in labelled]
    results = ex.map(_compare_task, items, shared=shared)
    runs = results[:len(scales) * len(labelled)]
    evals = [
        PolicyEvaluation(label=label, policy=policy,
                         runs=dict(zip(scales, runs[n * len(scales):(n + 1) * len(scales)],
                                       strict=True)),
                         goodput=results[len(runs) + n])
        for n, (label, policy) in enumerate(labelled)
    ]
    cur = evals[0]
    nxt = evals[1] if new is not None else None
    capacity = (float(cur.goodput.rate_scale)
                or (float(nxt.goodput.rate_scale) if nxt is not None else 0.0) or None)
    if capacity is not None:
        todo = [ev for ev in evals if capacity not in ev.runs]
        extra = ex.map(_compare_task, [("run", ev.policy, capacity) for ev in todo],
                       shared=shared)
        for ev, res in zip(todo, extra, strict=True):
            ev.runs[capacity] = res
    return Comparison(
        trace=trace,
        slo=slo,
        profile_name=str(getattr(profile, "name", "")),
        engine=engine,
        scales=scales,
        current=cur,
        new=nxt,
        capacity_scale=capacity,
    )


# --------------------------------------------------------------------------- knob changes


def knob_changes(current: Policy, new: Policy, reasons: dict[str, str] | None = None
                 ) -> list[dict[str, Any]]:
    """Every knob whose value differs, with the reason the optimizer gave (if any).

    ``reasons`` maps a dotted knob path (or a section such as ``long_requests``) to text."""
    reasons = reasons or {}
    cur, nxt = current.knobs(), new.knobs()
    out = []
    for path in cur:
        if cur[path] == nxt[path]:
            continue
        reason = reasons.get(path) or reasons.get(path.split(".")[0]) or ""
        out.append({"knob": path, "current": cur[path], "new": nxt[path], "reason": reason})
    default = ClassPolicy().model_dump()
    for name in sorted(set(current.classes) | set(new.classes)):
        a = current.classes[name].model_dump() if name in current.classes else default
        b = new.classes[name].model_dump() if name in new.classes else default
        for key in a:
            if a[key] != b[key]:
                path = f"classes.{name}.{key}"
                out.append({"knob": path, "current": a[key], "new": b[key],
                            "reason": reasons.get(path, "")})
    return out


# --------------------------------------------------------------------------- numbers


def _run_numbers(result: SimResult, slo: SLOSet) -> dict[str, Any]:
    summary = result.summary(slo)
    summary.pop("sim_wall_s", None)
    summary["meets_slo"] = bool(result.meets_slo(slo))
    return summary


def comparison_numbers(comp: Comparison) -> dict[str, Any]:
    """Per policy: goodput and each run's summary (deterministic: no wall times)."""
    out: dict[str, Any] = {}
    for ev in comp.evaluations:
        gp = ev.goodput
        out[ev.label] = {
            "policy": ev.policy.name,
            "goodput_rate_per_s": float(gp.rate_per_s),
            "goodput_rate_scale": float(gp.rate_scale),
            "goodput_bracketed": bool(getattr(gp, "bracketed", True)),
            "goodput_points": [
                {"rate_scale": float(p["rate_scale"]), "rate_per_s": float(p["rate_per_s"]),
                 "meets_slo": bool(p["meets_slo"]),
                 "attainment": finite_or_none(p.get("attainment"))}
                for p in gp.points
            ],
            "runs": {_scale_key(s): _run_numbers(r, comp.slo) for s, r in ev.runs.items()},
        }
    return out


def _scale_key(scale: float) -> str:
    return f"{scale:g}x"


# --------------------------------------------------------------------------- plots


def figure_bytes(fig: Figure, dpi: int = 100) -> bytes:
    """The figure as PNG bytes (no software-version stamp, so the same plot gives the
    same bytes), and the figure closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    # lazy: matplotlib takes 0.8 s to import; only runs that draw plots should pay it
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def pyplot() -> ModuleType:
    """matplotlib's pyplot on the Agg backend (no display), with fixed settings so the
    same plot gives the same bytes."""
    # lazy: matplotlib takes 0.8 s to import, and the backend must be set before pyplot
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.hashsalt": "servetune", "font.size": 9})
    return plt


def hit_rate_figure(traces: dict[str, Trace], title: str) -> bytes:
    """PNG: the LRU prefix-cache hit rate of each trace's blocks against cache size
    (blocks, log scale; :func:`servetune.workloads.reuse.hit_rate_curve` on a fine grid),
    each one's infinite-cache bound dotted."""
    grid = tuple(float(f) for f in np.geomspace(0.002, 1.0, 40))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    block_tokens = 0
    for name, trace in traces.items():
        curve = hit_rate_curve(trace, grid)
        block_tokens = curve["block_tokens"]
        points = curve["points"]
        line = ax.plot([p["blocks"] for p in points], [100 * p["hit_rate"] for p in points],
                       "-", label=name)[0]
        ax.axhline(100 * curve["bound"], color=line.get_color(), linestyle=":", linewidth=0.8)
    _plain_log_axis(ax)
    ax.set_xlabel(f"cache size (blocks of {block_tokens} tokens)")
    ax.set_ylabel("block references hit (%)")
    ax.set_title(f"LRU prefix-cache hit rate: {title}")
    ax.legend(loc="upper left")
    fig.tight_layout()
    return figure_bytes(fig)


def _plain_log_axis(ax: Axes) -> None:
    """Log-scale x axis labelled 0.5, 1, 2 rather than 5x10^-1."""
    # lazy: as in pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_xscale("log")
    # 1-2-3-5 per decade: a range such as 5-45 req/s still gets a label past 20
    ax.xaxis.set_major_locator(LogLocator(base=10.0, subs=(1.0, 2.0, 3.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _single_limit(slo: SLOSet, metric: str) -> float | None:
    values = {getattr(c, metric) for c in slo.classes.values()}
    values.discard(None)
    return values.pop() if len(values) == 1 else None


def _second_scale(comp: Comparison) -> float:
    """The rate the CDFs show beside the trace's own: the current policy's goodput (near
    saturation, where policies differ), else the highest stress rate."""
    if comp.capacity_scale is not None:
        return comp.capacity_scale
    return comp.scales[-1]


def _cdf_plot(comp: Comparison, metric: str, title: str, xlabel: str) -> bytes:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    top = _second_scale(comp)
    shown = ((1.0, "-"),) if top == 1.0 else ((1.0, "-"), (top, ":"))
    drew = False
    for ev in comp.evaluations:
        for scale, style in shown:
            if scale not in ev.runs:
                continue
            res = ev.runs[scale]
            m = res.metrics
            values = np.asarray(getattr(m, metric), dtype=float)
            values = np.sort(values[np.isfinite(values) & (values > 0)])
            if values.size == 0:
                continue
            y = np.arange(1, values.size + 1) / values.size
            rate = scale * ev.goodput.base_rate_per_s
            ax.step(values, y, where="post", linestyle=style, color=COLORS[ev.label],
                    label=f"{ev.label} ({ev.policy.name}) at {rate:.3g} req/s")
            drew = True
    limit = _single_limit(comp.slo, metric)
    if limit is not None:
        ax.axvline(limit, color="black", linestyle="--", linewidth=1,
                   label=f"SLO limit {limit:g} s")
    if drew:
        _plain_log_axis(ax)
    ax.set_ylim(0, 1.01)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("share of completed requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return figure_bytes(fig)


def _series(res: SimResult) -> dict[str, np.ndarray]:
    series = getattr(res.output, "series", None) or {}
    return {k: np.asarray(v, dtype=float) for k, v in series.items()}


def _kv_queue_plot(comp: Comparison) -> bytes:
    plt = pyplot()
    columns = [(1.0, "at the trace's rate")]
    if comp.capacity_scale is not None and comp.capacity_scale != 1.0:
        rate = comp.capacity_scale * comp.current.goodput.base_rate_per_s
        columns.append((comp.capacity_scale, f"at {rate:.2f} req/s (current goodput)"))
    fig, axes = plt.subplots(2, len(columns), figsize=(6 * len(columns), 5.5), sharex="col",
                             squeeze=False)
    for col, (scale, where) in enumerate(columns):
        ax_kv, ax_q = axes[0][col], axes[1][col]
        for ev in comp.evaluations:
            if scale not in ev.runs:
                continue
            s = _series(ev.runs[scale])
            if "t_s" not in s or s["t_s"].size == 0:
                continue
            label = f"{ev.label} ({ev.policy.name})"
            if "kv_util" in s:
                ax_kv.plot(s["t_s"], 100.0 * s["kv_util"], color=COLORS[ev.label],
                           label=label, linewidth=1)
            if "waiting" in s:
                ax_q.plot(s["t_s"], s["waiting"], color=COLORS[ev.label], label=label,
                          linewidth=1)
        ax_kv.set_title(f"KV cache and queue {where}")
        ax_kv.set_ylabel("KV cache in use (%)")
        ax_kv.set_ylim(0, 105)
        ax_q.set_ylabel("requests waiting (mean per time bin)")
        ax_q.set_xlabel("simulated time (s)")
        for ax in (ax_kv, ax_q):
            ax.grid(True, alpha=0.3)
            ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return figure_bytes(fig)


def _target_attainment(slo: SLOSet) -> float | None:
    """The attainment line to draw: the target share (or percentile / 100) when every class
    uses the same one."""
    values = set()
    for c in slo.classes.values():
        values.add(c.attainment if c.attainment is not None else c.percentile / 100.0)
    return values.pop() if len(values) == 1 else None


def _goodput_plot(comp: Comparison) -> bytes:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for ev in comp.evaluations:
        pts = sorted(ev.goodput.points, key=lambda p: p["rate_per_s"])
        pts = [p for p in pts if finite_or_none(p.get("attainment")) is not None]
        if pts:
            x = [p["rate_per_s"] for p in pts]
            y = [p["attainment"] for p in pts]
            ax.plot(x, y, color=COLORS[ev.label], linewidth=1,
                    label=f"{ev.label} ({ev.policy.name})")
            for p in pts:
                ax.plot(p["rate_per_s"], p["attainment"], "o", color=COLORS[ev.label],
                        markerfacecolor=COLORS[ev.label] if p["meets_slo"] else "white",
                        markersize=5)
        if ev.goodput.rate_per_s > 0:
            ax.axvline(ev.goodput.rate_per_s, color=COLORS[ev.label], linestyle="--",
                       linewidth=1,
                       label=f"{ev.label} goodput {ev.goodput.rate_per_s:.2f} req/s")
    target = _target_attainment(comp.slo)
    if target is not None:
        ax.axhline(target, color="black", linestyle=":", linewidth=1,
                   label=f"target {target:g}")
    base = comp.current.goodput.base_rate_per_s
    if base:
        ax.axvline(base, color="gray", linewidth=1, label=f"trace rate {base:.2f} req/s")
    _plain_log_axis(ax)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("offered rate (requests/s, trace replayed faster or slower)")
    ax.set_ylabel("SLO attainment")
    ax.set_title("Goodput search: attainment vs rate (filled = meets the SLO set)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    return figure_bytes(fig)


def figures(comp: Comparison) -> dict[str, bytes]:
    """The report's PNG files by name."""
    vs = "current vs new" if comp.new is not None else "current policy"
    figs = {
        "ttft_cdf.png": _cdf_plot(comp, "ttft_s", f"Time to first token, {vs}",
                                  "TTFT (s, log scale)"),
        "tpot_cdf.png": _cdf_plot(comp, "tpot_s", f"Time per output token, {vs}",
                                  "TPOT (s, log scale)"),
        "kv_queue.png": _kv_queue_plot(comp),
        "goodput.png": _goodput_plot(comp),
    }
    assert tuple(figs) == FIGURE_NAMES
    return figs


# --------------------------------------------------------------------------- markdown


def _fmt(x: Any, unit: str = "", digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x}{unit}"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "n/a"
        return f"{x:.{digits}g}{unit}"
    return f"{x}{unit}"


def _ms(x: Any) -> str:
    """A latency in ms below a second, in seconds above."""
    if x is None:
        return "n/a"
    x = float(x)
    return f"{1000.0 * x:.0f} ms" if x < 1.0 else f"{x:.3g} s"


def _pct(x: Any) -> str:
    return "n/a" if x is None else f"{100.0 * float(x):.1f}%"


def _value(v: Any) -> str:
    if v is None:
        return "off"
    if isinstance(v, bool):
        return "on" if v else "off"
    return f"{v}"


@dataclass
class Verdict:
    """What the caller decided, in words (nightly: written or kept)."""

    headline: str
    reasons: list[str] = field(default_factory=list)


def results_table(comp: Comparison, numbers: dict[str, Any]) -> str:
    """One column per evaluated policy (current, and new when there is one)."""
    evs = comp.evaluations
    cols = [numbers[ev.label] for ev in evs]

    def row(label: str, cell: Any) -> str:
        return f"| {label} | " + " | ".join(cell(c) for c in cols) + " |"

    def attainment(key: str) -> Any:
        def cell(c: dict[str, Any]) -> str:
            r = c["runs"][key]
            verdict = "meets" if r["meets_slo"] else "misses"
            return f"{_fmt(r['overall']['attainment'])} ({verdict})"
        return cell

    def at_rate(metric: str) -> Any:
        def cell(c: dict[str, Any]) -> str:
            d = c["runs"]["1x"]["overall"][metric]
            return f"{_ms(d['p50'])} / {_ms(d['p99'])}"
        return cell

    lines = ["| | " + " | ".join(f"{ev.label}: `{ev.policy.name}`" for ev in evs) + " |",
             "|---|" + "---|" * len(evs),
             row("Goodput (highest rate meeting the SLOs)",
                 lambda c: f"{c['goodput_rate_per_s']:.2f} req/s")]
    for scale in comp.scales:
        where = "trace rate" if scale == 1.0 else f"+{round(100 * (scale - 1)):d}% rate"
        lines.append(row(f"SLO attainment at {where} ({scale:g}x)",
                         attainment(_scale_key(scale))))
    lines += [
        row("TTFT p50 / p99 at trace rate", at_rate("ttft_s")),
        row("TPOT p50 / p99 at trace rate", at_rate("tpot_s")),
        row("Output throughput at trace rate",
            lambda c: _fmt(c["runs"]["1x"]["overall"]["throughput_tok_s"], " tok/s", 4)),
        row("Preemptions / shed requests at trace rate",
            lambda c: f"{c['runs']['1x']['preemptions']} / {c['runs']['1x']['shed']}"),
        row("Mean / peak KV-cache use at trace rate",
            lambda c: f"{_pct(c['runs']['1x']['kv']['mean_util'])} / "
                      f"{_pct(c['runs']['1x']['kv']['peak_util'])}"),
    ]
    return "\n".join(lines)


def per_class_table(comp: Comparison, numbers: dict[str, Any]) -> str:
    """Attainment and p99 latencies per request class at the trace's rate (and near
    saturation), one row per class; empty for a single-class trace."""
    names = list(numbers["current"]["runs"]["1x"]["per_class"])
    if len(names) < 2:
        return ""
    keys = [("1x", "trace rate")]
    if comp.capacity_scale is not None and _scale_key(comp.capacity_scale) != "1x":
        keys.append((_scale_key(comp.capacity_scale), "current goodput rate"))
    evs = comp.evaluations
    head = "| class | SLO | " + " | ".join(
        f"{ev.label} at {where}" for key, where in keys for ev in evs) + " |"
    lines = [head, "|---|---|" + "---|" * (len(keys) * len(evs))]
    for name in names:
        try:
            target = _slo_text_one(comp.slo.for_class(name))
        except KeyError:
            target = "n/a"
        cells = []
        for key, _ in keys:
            for ev in evs:
                c = numbers[ev.label]["runs"][key]["per_class"].get(name)
                if c is None:
                    cells.append("n/a")
                    continue
                cells.append(f"attainment {_fmt(c['attainment'])}, p99 TTFT "
                             f"{_ms(c['ttft_s']['p99'])}, p99 TPOT {_ms(c['tpot_s']['p99'])}")
        lines.append(f"| `{name}` | {target} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def changes_table(changes: list[dict[str, Any]]) -> str:
    if not changes:
        return "The new policy sets every knob as the current one does.\n"
    lines = ["| knob | current | new | why (from the optimizer's models) |",
             "|---|---|---|---|"]
    for ch in changes:
        reason = ch["reason"] or "no binding constraint reported"
        lines.append(f"| `{ch['knob']}` | {_value(ch['current'])} | {_value(ch['new'])} | "
                     f"{reason.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


MODEL_ERROR_HEADING = "How far the optimizer's model was off"
def _rate(x: Any) -> str:
    return "n/a" if x is None else f"{float(x):.3g}"


def model_error_section(error: dict[str, Any] | None) -> str:
    """The fluid model's goodput predictions against the simulator's goodputs, for every
    candidate the optimizer simulated (``optimize``'s ``summary["model_error"]``,
    :func:`servetune.solvers.loop.model_error`), in words and one table (Markdown)."""
    if not error:
        return "The optimizer used no model (a baseline search), so there is no model error.\n"
    rows = error.get("per_candidate") or []
    factor = error.get("factor")
    median, worst = error.get("median_ratio"), error.get("worst_miss")
    fallback = error.get("fallback") or {}
    text = [
        f"The optimizer's fluid model predicted the goodput of each of the {len(rows)} "
        "candidates it simulated; after recalibration the median ratio simulated / "
        f"predicted was {_fmt(median)} over the {error.get('compared', 0)} whose goodput "
        f"was bracketed, and its worst miss a factor of {_fmt(worst)}"
        + (f" ({error.get('worst_miss_label')})" if worst is not None else "")
        + f". As the loop proposed them (before recalibration) the worst miss was "
        f"{_fmt(error.get('worst_miss_as_proposed'))}."
    ]
    if fallback.get("ran"):
        text.append(
            f"The recalibrated model missed by more than {_fmt(factor)}x, so it was not "
            "trusted near the answer: the optimizer searched the best policy's neighbours "
            "(one grid step in each knob) by simulation, "
            f"{fallback.get('simulations', 0)} simulations, {fallback.get('moves', 0)} "
            f"move(s); best goodput {_rate(fallback.get('from_rate_per_s'))} -> "
            f"{_rate(fallback.get('to_rate_per_s'))} req/s."
        )
    elif error.get("unsure"):
        text.append(f"The recalibrated model missed by more than {_fmt(factor)}x, but the "
                    "search had no budget or incumbent left to check its answer by "
                    "simulation.")
    else:
        text.append(f"Every miss was within {_fmt(factor)}x, so the model's ranking was "
                    "trusted; no extra simulations were spent.")
    lines = [" ".join(text), "",
             "| candidate | knobs | predicted (as proposed) | predicted (recalibrated) | "
             "simulated goodput | miss |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lo, hi = r.get("simulated_rate_per_s"), r.get("simulated_upper_rate_per_s")
        if lo:
            sim_text = _rate(lo)
        elif hi is not None:
            sim_text = f"< {_rate(hi)}"
        else:
            sim_text = "no pass"
        miss = r.get("miss")
        lines.append(
            f"| {r.get('label', '')} | {knob_table.short_text(r.get('knobs') or {})} | "
            f"{_rate(r.get('predicted_rate_per_s'))} | "
            f"{_rate(r.get('recalibrated_rate_per_s'))} | {sim_text} | "
            f"{'n/a' if miss is None else f'{float(miss):.2f}x'} |")
    lines += ["", "Goodputs in req/s. *simulated goodput*: the highest rate that met the "
              "SLOs (\"< x\": rejected at x, the rate it had to beat); *miss*: the smallest "
              "factor between the recalibrated prediction and the simulated bracket."]
    return "\n".join(lines) + "\n"


def _slo_text_one(c: ClassSLO) -> str:
    limits = ", ".join(f"{k.removesuffix('_s').upper()} <= {v:g} s"
                       for k, v in c.limits().items())
    judge = (f"p{c.percentile:g}" if c.percentile is not None
             else f"{c.attainment:g} of requests")
    return f"{limits} ({judge})"


def _slo_text(slo: SLOSet) -> str:
    return "; ".join(f"class `{name}`: {_slo_text_one(c)}" for name, c in slo.classes.items())


def markdown(
    comp: Comparison,
    numbers: dict[str, Any],
    verdict: Verdict,
    changes: list[dict[str, Any]],
    *,
    exports: Sequence[Any] = (),
    inputs: dict[str, str] | None = None,
    title: str = "servetune policy report",
    extra_sections: Sequence[tuple[str, str]] = (),
) -> str:
    """The report's Markdown text (deterministic)."""
    tr = comp.trace
    rate = (len(tr) - 1) / tr.duration_s if tr.duration_s > 0 else 0.0
    out = [f"# {title}", "", f"**{verdict.headline}**", ""]
    out += [f"- {r}" for r in verdict.reasons]
    stress = ", ".join(f"+{round(100 * (s - 1))}%" for s in comp.scales[1:])
    setting = (
        f"the request trace ({len(tr)} requests over {tr.duration_s:.0f} s, {rate:.2f} "
        f"requests/s on average) with the GPU profile `{comp.profile_name}`, against the SLO "
        f"set `{comp.slo.name}` ({_slo_text(comp.slo)})"
    )
    if comp.new is not None:
        what = (
            f"Two scheduling policies for the `{comp.engine}` engine model were simulated on "
            f"{setting}. The *current* policy is the one in production; the *new* one is the "
            "optimizer's proposal. Each was replayed at the trace's own rate and at "
            f"{stress} rate, and its goodput was searched by replaying the trace faster and "
            "slower."
        )
    else:
        what = (
            f"The policy in production was simulated with the `{comp.engine}` engine model on "
            f"{setting}, at the trace's own rate and at {stress} rate, and its goodput was "
            "searched by replaying the trace faster and slower. There is no new policy to "
            "compare it with."
        )
    out += ["", "## What was compared", "", what, "", "## Results", "",
            results_table(comp, numbers), ""]
    classes = per_class_table(comp, numbers)
    if classes:
        out += ["Per request class:", "", classes]
    if comp.new is not None:
        out += ["## What changed and why", "", changes_table(changes)]
    if exports:
        out += ["## Engine configs", ""]
        for ex in exports:
            out.append(f"- `{ex.filename}` ({ex.engine}): "
                       + (f"{len(ex.unsupported)} setting(s) the engine cannot express, "
                          "listed at the top of the file:" if ex.unsupported
                          else "every policy setting expressed."))
            out += [f"  - {item}" for item in ex.unsupported]
        out.append("")
    for heading, text in extra_sections:
        out += [f"## {heading}", "", text.rstrip(), ""]
    out += [
        "## Plots",
        "",
        "Time to first token of completed requests (further left is faster; solid: at the "
        "trace's rate, dotted: "
        + ("at the current policy's goodput rate, near saturation"
           if comp.capacity_scale is not None
           else f"at +{round(100 * (comp.scales[-1] - 1))}% rate")
        + "; dashed black: the SLO limit):",
        "",
        "![TTFT CDF](ttft_cdf.png)",
        "",
        "Time per output token (reading speed) of completed requests:",
        "",
        "![TPOT CDF](tpot_cdf.png)",
        "",
        "KV-cache utilization and waiting requests over time, at the trace's own rate"
        + (" and (right) replayed at the current policy's goodput rate, near saturation:"
           if comp.capacity_scale not in (None, 1.0) else ":"),
        "",
        "![KV utilization and queue length](kv_queue.png)",
        "",
        "SLO attainment at each rate the goodput search tried; a policy's goodput is the "
        "highest rate with a filled marker:",
        "",
        "![Goodput versus rate](goodput.png)",
        "",
        "## How to read this",
        "",
        GLOSSARY,
    ]
    if inputs:
        out += ["## Inputs", "", "| input | file |", "|---|---|"]
        out += [f"| {k} | `{v}` |" for k, v in inputs.items()]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


@dataclass
class ReportFiles:
    markdown: str
    figures: dict[str, bytes]
    summary: dict[str, Any]


def summary_json_text(summary: dict[str, Any]) -> str:
    return json.dumps(summary, indent=2, sort_keys=False, allow_nan=False) + "\n"


def build_report(
    comp: Comparison,
    verdict: Verdict,
    *,
    reasons: dict[str, str] | None = None,
    exports: Sequence[Any] = (),
    inputs: dict[str, str] | None = None,
    title: str = "servetune policy report",
    summary_extra: dict[str, Any] | None = None,
    extra_sections: Sequence[tuple[str, str]] = (),
) -> ReportFiles:
    """Everything ``write_report`` stores, built in memory first."""
    numbers = comparison_numbers(comp)
    changes = ([] if comp.new is None
               else knob_changes(comp.current.policy, comp.new.policy, reasons))
    md = markdown(comp, numbers, verdict, changes, exports=exports, inputs=inputs, title=title,
                  extra_sections=extra_sections)
    summary: dict[str, Any] = dict(summary_extra or {})
    summary.update(
        {
            "verdict": verdict.headline,
            "reasons": list(verdict.reasons),
            "engine_model": comp.engine,
            "profile": comp.profile_name,
            "slo": comp.slo.name,
            "trace_requests": len(comp.trace),
            "rate_scales": list(comp.scales),
            "changes": changes,
            **numbers,
        }
    )
    return ReportFiles(markdown=md, figures=figures(comp), summary=plain_data(summary))


def report_file_list(files: ReportFiles) -> list[tuple[str, bytes]]:
    """The report's files in commit order: plots, ``report.md``, ``summary.json``."""
    out = [(name, data) for name, data in files.figures.items()]
    out.append(("report.md", files.markdown.encode("utf-8")))
    out.append(("summary.json", summary_json_text(files.summary).encode("utf-8")))
    return out


def write_report(files: ReportFiles, out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write the plots, ``report.md`` and ``summary.json`` (see :func:`commit_files`)."""
    return commit_files(out_dir, report_file_list(files))
