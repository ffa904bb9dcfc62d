"""The nightly tuning job: re-optimize on yesterday's trace, keep the better policy.

``run_nightly(...)``:

1. loads the trace, the GPU profile, the SLO set and the policy in production
   (``--current``), and fits a workload to the trace;
2. optimizes a new policy (:func:`servetune.apps.optimize.optimize`), judging candidates
   by replaying the trace itself, time-scaled: the fitted workload feeds only the model
   and the report's reasons;
3. for **each engine it exports to** (``engines``), simulates the current and the new
   policy with that engine's admission model (:func:`gate_profile`: on the KV pool the
   engine's exported config really gives, which for TGI can be smaller than the tuned
   one) on the trace at its own rate and at +20 % and +50 % rate stress, and searches both
   policies' goodput (:mod:`servetune.apps.report`);
4. decides per engine (the gate): the new policy replaces the current one on that engine
   only when its goodput there is higher by at least ``min_gain`` (relative, 0.02 = 2 %)
   **and** its SLO attainment there is not lower on any stress run **and** it differs from
   the current one **and** the optimizer stopped on its work budget or by converging, not
   on the wall-clock safety stop (whose answer depends on the machine's speed: then the
   current policy stays everywhere, exit 10, and the report says why);
5. writes, in ``out_dir``, one output set (:func:`servetune.io.commit_files`: a new
   generation folder, made live by one rename): ``policy.yaml`` when the new policy passes
   at least one engine's gate, and the config of each engine whose gate it passes
   (``vllm.yaml``, ``sglang.yaml`` ...); ``report.md`` (with one gate row per engine and
   why) with its plots and ``summary.json`` (``gates``) always. A failing engine's config
   is not written, and an earlier run's policy and configs leave the live set (they stay
   in the older generations), so the folder never mixes two runs. Where the current
   policy stays (exit 10, 3, and the failing engines of exit 11), ``summary.json``'s
   ``live_policy`` names it (:func:`live_policy`) and the report says so; on exit 10 and
   3 the live ``policy.yaml`` and its configs stay when that ``policy.yaml`` is the
   ``--current`` file itself (last night's output as tonight's input).

Exit codes (:data:`EXIT_CODES`): 0 new policy written for every engine, 11 new policy
written for some engines only (the passing ones; the report says why the others failed),
10 current policy kept (every gate failed), 2 user error, 3 infeasible (no policy in the
search space meets the SLOs; the report says what binds).

``run_report(...)`` is ``servetune report``: steps 3 and 5 for two given policies.

The job holds ``out_dir``'s lock from the start (a second run into it exits 2 at once,
naming this one's pid). Every file is built in memory first and committed as one set, so
an interrupted or killed run leaves the previous set intact; nothing here reads a clock,
so the same inputs give the same files.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from servetune import knobs as knob_table
from servetune.apps.optimize import gpu_facts, optimize
from servetune.apps.report import (
    DEFAULT_STRESS,
    FIGURE_NAMES,
    MODEL_ERROR_HEADING,
    Comparison,
    ReportFiles,
    Verdict,
    build_report,
    compare,
    model_error_section,
    report_file_list,
    write_report,
)
from servetune.engines import CONFIG_FILES, ENGINE_NAMES
from servetune.errors import EXIT_INFEASIBLE, EXIT_KEPT_CURRENT, InfeasibleError, ServetuneError
from servetune.executor import Executor
from servetune.export import (
    ExportResult,
    export_policy,
    memory_facts,
    profile_memory_facts,
)
from servetune.export.tgi import tgi_memory
from servetune.io import (
    check_outputs,
    commit_files,
    drop_timings,
    output_folder_lock,
    sha256_file,
)
from servetune.models.fluid import Calibration, FluidModel, Knobs, LoadModel, Platform, targets_for
from servetune.profiles.schema import Profile
from servetune.profiles.shipped import load_profile, shipped_or_path
from servetune.schemas.base import document_to_yaml, load_document
from servetune.schemas.policy import Policy
from servetune.schemas.slo import SLOSet
from servetune.schemas.space import SearchSpace
from servetune.schemas.workload import Workload
from servetune.sim import goodput
from servetune.solvers import baselines
from servetune.solvers.loop import STOP_TIME_LIMIT
from servetune.workloads.fitting import class_stats, fit_workload
from servetune.workloads.formats import load_trace
from servetune.workloads.reuse import curve_text, hit_rate_curve, pool_blocks
from servetune.workloads.trace import Trace

EXIT_NEW_POLICY = 0
EXIT_SOME_ENGINES = 11
EXIT_CODES = {
    EXIT_NEW_POLICY: "new policy written (every engine's gate passed)",
    EXIT_SOME_ENGINES: "new policy written for some engines only (the others' gates failed)",
    EXIT_KEPT_CURRENT: "current policy kept",
    2: "user error (bad input file or option)",
    EXIT_INFEASIBLE: "infeasible: no policy in the search space meets the SLOs",
}
# Fewer requests than this make the goodput search meaningless: a p99 over fewer than 100
# requests is their maximum, and a handful of requests "meets" any SLO at any rate.
MIN_TRACE_REQUESTS = 100
# Attainments are shares of requests; this absorbs float noise only, never one request.
ATTAINMENT_TOLERANCE = 1e-9
# The names nightly owns in --out-dir: one missing from a run's set leaves the folder.
NIGHTLY_FILES = ("policy.yaml", *CONFIG_FILES.values())
REPORT_FILES = ("report.md", *FIGURE_NAMES, "summary.json")
OUTPUT_FILES = (*NIGHTLY_FILES, *REPORT_FILES)

Progress = Callable[[str], Any]


@dataclass
class Decision:
    write_new: bool
    gain: float | None  # relative goodput gain; None when the current goodput is 0
    reasons: list[str] = field(default_factory=list)


@dataclass
class EngineGate:
    """One engine's gate: both policies compared under its admission model and KV pool."""

    engine: str
    comparison: Comparison
    decision: Decision
    kv_blocks: int  # the KV pool simulated
    pool_note: str | None = None  # why the pool differs from the profile's, when it does

    @property
    def passed(self) -> bool:
        return self.decision.write_new

    def row(self) -> dict[str, Any]:
        comp = self.comparison
        assert comp.new is not None
        return {
            "engine": self.engine,
            "passed": self.passed,
            "config_written": self.passed,
            "gain": self.decision.gain,
            "goodput_rate_per_s": {"current": comp.current.goodput.rate_per_s,
                                   "new": comp.new.goodput.rate_per_s},
            "attainment": {f"{s:g}x": {"current": comp.current.attainment(s, comp.slo),
                                       "new": comp.new.attainment(s, comp.slo)}
                           for s in comp.scales[1:]},
            "kv_blocks": self.kv_blocks,
            "kv_pool_note": self.pool_note,
            "reasons": list(self.decision.reasons),
        }


@dataclass
class NightlyOutcome:
    exit_code: int
    status: str
    files: list[Path]
    summary: dict[str, Any]


def same_knobs(a: Policy, b: Policy) -> bool:
    """Same scheduling settings (names and provenance aside): every knob of the knob
    table equal, exactly, and the same per-class settings."""
    return knob_table.values(a) == knob_table.values(b) and a.classes == b.classes


def decide(comp: Comparison, min_gain: float) -> Decision:
    """Replace the current policy only when the new one is better by the margin and no
    worse under stress (module docstring, step 4)."""
    cur, new = comp.current, comp.new
    g_cur, g_new = float(cur.goodput.rate_per_s), float(new.goodput.rate_per_s)
    gain: float | None
    if g_cur > 0:
        gain = (g_new - g_cur) / g_cur
    else:
        gain = None if g_new > 0 else 0.0
    reasons: list[str] = []
    ok = True
    if same_knobs(cur.policy, new.policy):
        ok = False
        reasons.append("the optimizer proposes the policy already in production")
    gain_text = "from zero" if gain is None else f"{100 * gain:+.1f}%"
    if gain is not None and gain < min_gain:
        ok = False
        reasons.append(
            f"goodput {g_cur:.3f} -> {g_new:.3f} req/s ({gain_text}) is below the required "
            f"gain of {100 * min_gain:.1f}%"
        )
    else:
        reasons.append(
            f"goodput {g_cur:.3f} -> {g_new:.3f} req/s ({gain_text}; required "
            f"{100 * min_gain:.1f}%)"
        )
    for scale in comp.scales[1:]:
        a_cur = cur.attainment(scale, comp.slo)
        a_new = new.attainment(scale, comp.slo)
        if a_new + ATTAINMENT_TOLERANCE < a_cur:
            ok = False
            reasons.append(
                f"SLO attainment at +{round(100 * (scale - 1))}% rate would drop "
                f"from {a_cur:.4f} to {a_new:.4f}"
            )
        else:
            reasons.append(
                f"SLO attainment at +{round(100 * (scale - 1))}% rate {a_cur:.4f} -> {a_new:.4f}"
            )
    return Decision(write_new=ok, gain=gain, reasons=reasons)


def gate_profile(profile: Profile, engine: str, policy: Policy | None = None
                 ) -> tuple[Profile, str | None]:
    """The profile with the KV pool ``engine``'s exported config really gives, and a note
    when it differs from ``profile``'s: TGI's ``--cuda-memory-fraction`` cannot exceed 1.0,
    so where the tuned pool needs more, TGI's pool is smaller
    (:func:`servetune.export.tgi.tgi_memory`); the other engines' exporters reach the
    tuned pool."""
    if engine != "tgi":
        return profile, None
    mem = tgi_memory(memory_facts(policy or Policy(), profile))
    if mem is None or mem.reaches_tuned_pool:
        return profile, None
    tuned = profile.kv_blocks()
    if profile.memory.kv_blocks_override is not None or profile.hardware is None:
        usable = max(1, math.floor(tuned * mem.kv_share))
        memory = profile.memory.model_copy(update={"kv_blocks_override": usable + 1})
    else:
        # the vLLM share of total memory whose pool is TGI's: u' * M - W - A = share * KV
        reserved = profile.weight_bytes() + profile.memory.activation_reserve_bytes
        util = (reserved + mem.kv_share * profile.kv_pool_bytes()) / profile.hardware.memory_bytes
        memory = profile.memory.model_copy(update={"gpu_memory_utilization": util})
    smaller = profile.model_copy(update={"memory": memory})
    needed = f"{mem.needed:.4f}" if mem.needed is not None else "more than 1.0"
    note = (f"TGI's KV pool is {smaller.kv_blocks()} blocks, {100 * mem.kv_share:.1f}% of the "
            f"profile's {tuned}: the tuned pool needs --cuda-memory-fraction {needed} (with "
            f"TGI_WIGGLE_ROOM {mem.wiggle_room:g}), TGI takes at most 1.0; the gate simulated "
            "the smaller pool")
    return smaller, note


# --------------------------------------------------------------------------- inputs


def parse_engines(engines: str | Sequence[str]) -> list[str]:
    """The engine names in ``engines`` (comma-separated or a list), checked, in order,
    without repeats."""
    items = engines.split(",") if isinstance(engines, str) else list(engines)
    names = [e.strip() for e in items if e.strip()]
    if not names:
        raise ServetuneError("argument `engines`: name at least one engine (e.g. vllm,sglang)")
    for e in names:
        if e not in ENGINE_NAMES:
            raise ServetuneError(
                f"argument `engines`: {e!r} is not supported; choose from {', '.join(ENGINE_NAMES)}"
            )
    return list(dict.fromkeys(names))


def load_inputs(
    trace_path: Path, profile_path: Path, slo_path: Path,
    trace_read: Mapping[str, Any] | None = None,
) -> tuple[Trace, Profile, SLOSet]:
    """The trace (read with ``trace_read``: load_trace's ``fmt``, ``columns``,
    ``arrival_unit``, ``on_bad_row``), the profile and the SLO set."""
    trace = load_trace(trace_path, **dict(trace_read or {}))
    if len(trace) < MIN_TRACE_REQUESTS:
        raise ServetuneError(
            f"{trace_path}: only {len(trace)} requests; comparing policies needs at least "
            f"{MIN_TRACE_REQUESTS} (a p99 over fewer is just the slowest request); give a "
            "longer trace window"
        )
    profile = load_profile(profile_path)
    slo = load_document(slo_path, SLOSet)
    for name in trace.class_names:
        try:
            slo.for_class(name)
        except KeyError:
            raise ServetuneError(
                f"{slo_path}: classes: no entry for the trace's request class {name!r}; add "
                "it or a 'default' class"
            ) from None
    return trace, profile, slo


def with_profile_facts(policy: Policy, profile: Profile) -> Policy:
    """The policy with ``metadata.profile`` completed from the profile (the activation
    reserve, for instance), so its engine configs can be re-exported without the
    profile; values the optimizer wrote are kept."""
    meta = policy.metadata.get("profile")
    facts = {**profile_memory_facts(profile), **(meta if isinstance(meta, dict) else {})}
    facts = {k: v for k, v in facts.items() if v is not None}
    return policy.model_copy(update={"metadata": {**policy.metadata, "profile": facts}})


# --------------------------------------------------------------------------- optimizer


@dataclass
class Optimized:
    policy: Policy
    reasons: dict[str, str]  # knob path (or section) -> why, from the models
    info: dict[str, Any]  # method, statuses, simulations (no wall times)
    # When the answer has a long-request lane: the best candidate simulated without one
    # (the gate's fallback, :func:`run_nightly`); None otherwise.
    without_lane: Policy | None = None


def _shown(value: Any) -> str:
    return "off" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def knob_reasons(fluid: FluidModel, current: Policy, new: Policy) -> dict[str, str]:
    """For each changed knob the fluid model knows: the model's goodput and binding
    condition with the new value and with the current value put back, all else equal."""
    new_knobs = Knobs.from_policy(new)
    cur_knobs = Knobs.from_policy(current)
    rate_new, binding_new, _ = fluid.goodput(new_knobs)
    reasons: dict[str, str] = {}
    for path, attr in Knobs.FIELDS.items():
        a, b = getattr(cur_knobs, attr), getattr(new_knobs, attr)
        if a == b:
            continue
        try:
            alt = replace(new_knobs, **{attr: a})
            if alt.max_num_batched_tokens < alt.max_num_seqs:
                raise ValueError("inconsistent")
            rate_alt, binding_alt, _ = fluid.goodput(alt)
        except (ValueError, ZeroDivisionError):
            continue
        shown_a, shown_b = _shown(a), _shown(b)
        if math.isclose(rate_alt, rate_new, rel_tol=5e-4):
            reasons[path] = (
                f"model: no goodput difference ({rate_new:.2f} req/s with {shown_b} or "
                f"{shown_a}, limited by {binding_new.words()}); the simulator-"
                "validated search settled on this value"
            )
        else:
            reasons[path] = (
                f"model: {rate_new:.2f} req/s with {shown_b}, limited by "
                f"{binding_new.words()}; {rate_alt:.2f} req/s with {shown_a} "
                f"(limited by {binding_alt.words()})"
            )
    return reasons


def model_reasons(workload: Workload, profile: Profile, slo: SLOSet, current: Policy,
                  new: Policy, *, calibration: dict[str, float] | None = None
                  ) -> dict[str, str]:
    """:func:`knob_reasons` from the fluid model of ``workload`` on ``profile`` at ``slo``
    (with the optimizer loop's calibration when given)."""
    load = LoadModel.from_class_stats(class_stats(workload))
    fluid = FluidModel(load, Platform.from_profile(profile), targets_for(load, slo))
    if calibration:
        fluid = fluid.with_calibration(Calibration(**calibration))
    return knob_reasons(fluid, current, new)


def optimize_policy(
    trace: Trace,
    workload: Workload,
    profile: Profile,
    slo: SLOSet,
    *,
    current: Policy,
    space: SearchSpace | None = None,
    time_limit_s: float | None = None,
    max_simulations: int | None = None,
    seed: int = 0,
    inputs: dict[str, str] | None = None,
    engine: str = "vllm",
    progress: Progress | None = None,
    executor: Executor | None = None,
) -> Optimized:
    """Run the optimizer on the trace (knobs outside the search space keep the current
    policy's values): candidates are judged by replaying the trace itself, time-scaled,
    so its bursts are the ones the policy is tuned for; the fluid model reads the trace's
    moments. Raises InfeasibleError (exit 3) when nothing meets the SLOs. The reasons come
    from the fitted workload's fluid model, calibrated as the loop left it."""
    kwargs: dict[str, Any] = {}
    if time_limit_s is not None:
        kwargs["time_limit_s"] = time_limit_s
    if max_simulations is not None:
        kwargs["max_simulations"] = max_simulations
    result = optimize(
        trace, profile, slo, space, seed=seed, base_policy=current, inputs=inputs or {},
        compare_defaults=False,
        engine=engine, progress=progress, executor=executor, **kwargs,
    )
    if result.policy is None:  # pragma: no cover - optimize raises InfeasibleError instead
        raise InfeasibleError(result.explanation or "no policy meets the SLOs")
    summary = result.summary
    reasons = model_reasons(workload, profile, slo, current, result.policy,
                            calibration=summary.get("calibration"))
    for it in summary.get("iterations") or []:
        lanes = it.get("lanes") if isinstance(it, dict) else None
        if lanes and lanes.get("kept"):
            cand = lanes.get("candidate", {})
            reasons["long_requests"] = (
                f"CP-SAT lane sizing ({lanes.get('status')}); with the lane the simulator "
                f"measured {cand.get('simulated_rate_per_s', float('nan')):.2f} req/s"
            )
    objective = result.policy.metadata.get("objective", {})
    info = {
        "method": summary.get("method"),
        "simulations": summary.get("simulations"),
        "converged": summary.get("converged"),
        "stopped_by": summary.get("stopped_by"),
        "goodput_rate_per_s_on_sample": summary.get("goodput_rate_per_s"),
        "predicted_goodput_rate_per_s": summary.get("predicted_goodput_rate_per_s"),
        "binding": objective.get("binding") if isinstance(objective, dict) else None,
        "solver": result.policy.metadata.get("solver"),
        "model_error": summary.get("model_error"),
    }
    return Optimized(policy=result.policy, reasons=reasons, info=info,
                     without_lane=best_without_lane(result.policy, result.evaluated))


def best_without_lane(answer: Policy, evaluated: Sequence[Any]) -> Policy | None:
    """When ``answer`` has a long-request lane, the candidate the optimizer simulated best
    without one (by its simulated goodput), named and with provenance as the answer,
    marked as the fallback; None when the answer has no lane or no such candidate passed."""
    if not answer.long_requests.enabled:
        return None
    plain = [e for e in evaluated
             if e.goodput.passed and not e.policy.long_requests.enabled]
    if not plain:
        return None
    top = max(plain, key=lambda e: e.goodput.rate_per_s)
    meta = {k: v for k, v in answer.metadata.items() if k not in ("simulated", "objective")}
    meta["fallback"] = ("the optimizer's best candidate without a long-request lane, "
                        f"{top.goodput.rate_per_s:.3f} req/s in its search")
    return top.policy.model_copy(update={"name": answer.name, "metadata": meta})


# --------------------------------------------------------------------------- the job


def _say(progress: Progress | None, text: str) -> None:
    if progress is not None:
        progress(text)


def _check_out_dir(out: Path, names: Sequence[str],
                   inputs: dict[str, str | os.PathLike[str] | None]) -> None:
    """Refuse, before any work, an output folder that is not one, or one where this run
    would write over one of its own inputs (``--current out/policy.yaml --out-dir out``
    where that is a regular file; last night's link into ``out``'s output sets is fine)."""
    check_outputs({}, {f"argument `{k}`": v for k, v in inputs.items()}, out_dirs={
        "argument `out_dir`": (out, [*names, *REPORT_FILES])})


def run_nightly(
    trace_path: str | os.PathLike[str],
    profile_path: str | os.PathLike[str],
    slo_path: str | os.PathLike[str],
    current_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    engines: Sequence[str] = ("vllm", "sglang"),
    min_gain: float = 0.02,
    space_path: str | os.PathLike[str] | None = None,
    time_limit_s: float | None = None,
    max_simulations: int | None = None,
    seed: int = 0,
    sim_engine: str = "vllm",
    stress: Sequence[float] = DEFAULT_STRESS,
    progress: Progress | None = None,
    trace_read: Mapping[str, Any] | None = None,
    executor: Executor | None = None,
) -> NightlyOutcome:
    """The whole job (module docstring). Returns the exit code and what was written. The
    independent simulations (the optimizer's batches, the comparisons' runs) go to
    ``executor`` (default: in this process); the outputs are the same on any executor."""
    if not (isinstance(min_gain, int | float) and math.isfinite(min_gain) and min_gain >= 0):
        raise ServetuneError(f"argument `min_gain` must be a number >= 0 (got {min_gain})")
    engines = parse_engines(engines)
    if sim_engine not in ENGINE_NAMES:
        raise ServetuneError(
            f"argument `sim_engine` {sim_engine!r}: choose one of {', '.join(ENGINE_NAMES)}"
        )
    # a shipped profile's bare name is its file (hashed for the provenance like any other)
    trace_path, profile_path, slo_path, current_path = (
        Path(trace_path), Path(shipped_or_path(str(profile_path))), Path(slo_path),
        Path(current_path))
    out = Path(out_dir)
    _check_out_dir(out, NIGHTLY_FILES, {
        "trace_path": trace_path, "profile_path": profile_path, "slo_path": slo_path,
        "current_path": current_path, "space_path": space_path})

    # held from here: a second run into `out` fails now, not after its optimization
    with output_folder_lock(out):
        _say(progress, f"loading {trace_path.name}, {profile_path.name}, {slo_path.name}")
        trace, profile, slo = load_inputs(trace_path, profile_path, slo_path, trace_read)
        current = load_document(current_path, Policy)
        space = None if space_path is None else load_document(space_path, SearchSpace)
        inputs = _provenance(trace_path, profile_path, slo_path, current_path, space_path)
        base_summary: dict[str, Any] = {
            "min_gain": min_gain,
            "engines": engines,
            "sim_engine": sim_engine,
            "inputs": inputs,
            "exit_codes": {str(k): v for k, v in EXIT_CODES.items()},
        }

        _say(progress, f"fitting a workload to {len(trace)} requests")
        workload = fit_workload(trace, name=trace_path.stem, source=trace_path.name)

        _say(progress, "optimizing a new policy")
        try:
            opt = optimize_policy(trace, workload, profile, slo, current=current, space=space,
                                  time_limit_s=time_limit_s, max_simulations=max_simulations,
                                  seed=seed, inputs=inputs,
                                  engine=sim_engine, progress=progress, executor=executor)
        except InfeasibleError as err:
            _say(progress, "infeasible; simulating the current policy for the report")
            comp = compare(trace, current, None, profile, slo, engine=sim_engine, stress=stress,
                           executor=executor)
            live = live_policy(out, current_path, current, engines, keep_files=True)
            return _write_infeasible(out, err, comp, base_summary, live, progress)
        new = with_profile_facts(opt.policy, profile)
        timed_out = opt.info.get("stopped_by") == STOP_TIME_LIMIT

        new, gates, lane_note = _gate(new, opt, current, trace, profile, slo, engines,
                                      min_gain=min_gain, stress=stress, timed_out=timed_out,
                                      executor=executor, progress=progress)
        passed = [g for g in gates if g.passed]
        # The report's plots and results: the optimizer's engine when it is gated, else the
        # first engine; the gate table covers every engine.
        main = next((g for g in gates if g.engine == sim_engine), gates[0])
        comp = main.comparison

        failed = [g.engine for g in gates if not g.passed]
        new, exports, policy_text = _adopt(new, current, gates, sim_engine=sim_engine,
                                           min_gain=min_gain)
        status, code, headline = _headline(new, current, engines, gates, timed_out=timed_out)
        reasons = _reasons(main, gates, lane_note)
        files_written = (["policy.yaml"] + [e.filename for e in exports]) if exports else []
        # where the new policy is not adopted, the one in production stays: say which it is
        live = (live_policy(out, current_path, current, failed, keep_files=not passed)
                if failed else None)
        defaults_text, defaults_rule = defaults_section(current, profile)
        # Yesterday's promise, replayed on today's trace; today's, for tomorrow.
        kept = main.comparison.new if main.passed else main.comparison.current
        assert kept is not None
        promise = promise_record(kept.policy, kept.goodput.rate_per_s, main.engine, trace_path)
        checked = check_promise(previous_promise(out), trace, profile, slo, current,
                                main.comparison.current.goodput.rate_per_s, main.engine)
        summary_extra = {
            **base_summary,
            "status": status,
            "exit_code": code,
            "gain": main.decision.gain,
            "kept_because": "time_limit" if timed_out else None,
            "gates": [g.row() for g in gates],
            "files_written": [*files_written, "report.md", *FIGURE_NAMES, "summary.json"],
            "live_policy": live,
            "optimizer": drop_timings(opt.info),
            "new_policy": new.knobs(),
            "defaults_rule": defaults_rule,
            "promise": promise,
            "last_promise": checked,
        }
        _say(progress, "rendering the report and its plots")
        report = build_report(
            comp, Verdict(headline, reasons), reasons=opt.reasons, exports=exports,
            inputs=inputs, title="servetune nightly tuning report", summary_extra=summary_extra,
            extra_sections=[("Gate per engine", gate_table(gates)),
                            *_live_policy_section(live, policy_written=bool(passed)),
                            (MODEL_ERROR_HEADING, model_error_section(opt.info.get("model_error"))),
                            (PROMISE_HEADING, promise_section(promise, checked)),
                            *prefix_cache_section(trace, main.kv_blocks * profile.block_size),
                            ("Engine defaults on this GPU", defaults_text)],
        )
        _say(progress, f"writing outputs to {out}")
        written = _write_outputs(out, policy_text, exports, report, live)
        return NightlyOutcome(exit_code=code, status=status, files=written, summary=report.summary)


def _provenance(trace_path: Path, profile_path: Path, slo_path: Path, current_path: Path,
                space_path: str | os.PathLike[str] | None) -> dict[str, str]:
    """Each input file by name and the start of its sha256, for the report and policy."""
    files = {"trace": trace_path, "profile": profile_path, "slo": slo_path,
             "current policy": current_path}
    if space_path is not None:
        files["search space"] = Path(space_path)
    return {what: f"{path.name} (sha256 {sha256_file(path)[:16]})"
            for what, path in files.items()}


def _gate(new: Policy, opt: Any, current: Policy, trace: Trace, profile: Profile,
          slo: SLOSet, engines: Sequence[str], *, min_gain: float, stress: Sequence[float],
          timed_out: bool, executor: Executor | None, progress: Progress | None,
          ) -> tuple[Policy, list[EngineGate], str | None]:
    """The proposal gated on every engine (current and new simulated on the trace, under
    stress and at goodput); where every gate fails because the optimizer's long-request
    lane lowers attainment under stress, the best candidate without a lane gated instead.
    Returns the proposal that stands, its gates, and the note on the lane (None)."""

    def gate_all(proposal: Policy) -> list[EngineGate]:
        gates: list[EngineGate] = []
        for e in engines:
            _say(progress, f"{e}: simulating current and new policies (trace, +20%, "
                           "+50%, goodput)")
            gate_prof, pool_note = gate_profile(profile, e, proposal)
            comp_e = compare(trace, current, proposal, gate_prof, slo, engine=e,
                             stress=stress, executor=executor)
            decision = decide(comp_e, min_gain)
            if timed_out:
                # The safety stop cut the search short, so the new policy is whatever
                # this machine reached in the time: another run could differ. Keep
                # the current one.
                decision = Decision(False, decision.gain, [
                    "the optimizer's wall-clock safety stop (--time-limit) ended its "
                    "search before its work budget or convergence did, so the proposed "
                    "policy depends on this machine's speed and is not adopted; raise "
                    "--time-limit",
                    *decision.reasons,
                ])
            gates.append(EngineGate(e, comp_e, decision, gate_prof.kv_blocks(),
                                    pool_note))
        return gates

    gates = gate_all(new)
    lane_note = None
    if (not any(g.passed for g in gates) and opt.without_lane is not None
            and any("would drop" in r for g in gates for r in g.decision.reasons)):
        # A lane delays some long requests to serve more in all; where that lowers
        # attainment under stress, the best policy without one may still pass.
        _say(progress, "the lane lowers attainment under stress: gating the best "
                       "candidate without a lane")
        plain = with_profile_facts(opt.without_lane, profile)
        plain_gates = gate_all(plain)
        lane_note = (f"The optimizer's answer has a long-request lane "
                     f"(threshold {new.long_requests.threshold_tokens} tokens), which "
                     "lowered SLO attainment under stress: "
                     + "; ".join(r for r in gates[0].decision.reasons if "would drop" in r)
                     + ". The best candidate without a lane was gated instead"
                     + (" and passed." if any(g.passed for g in plain_gates)
                        else " and failed too."))
        if any(g.passed for g in plain_gates):
            new, gates = plain, plain_gates
    return new, gates, lane_note


def _adopt(new: Policy, current: Policy, gates: list[EngineGate], *, sim_engine: str,
           min_gain: float) -> tuple[Policy, list[ExportResult], str]:
    """Where some gate passed: the new policy with its nightly provenance, its engine
    configs for the engines that passed, and its YAML; else ``new``, none and ""."""
    passed = [g for g in gates if g.passed]
    if not passed:
        return new, [], ""
    failed = [g.engine for g in gates if not g.passed]
    first = next((g for g in passed if g.engine == sim_engine), passed[0])
    assert first.comparison.new is not None
    new = new.model_copy(update={"metadata": {**new.metadata, "nightly": {
        "replaces": current.name,
        "engines": [g.engine for g in passed],
        "not_adopted_on": failed,
        "goodput_engine": first.engine,
        "goodput_rate_per_s": {
            "current": round(first.comparison.current.goodput.rate_per_s, 6),
            "new": round(first.comparison.new.goodput.rate_per_s, 6)},
        "gain": None if first.decision.gain is None else round(first.decision.gain, 6),
        "gains": {g.engine: None if g.decision.gain is None else round(g.decision.gain, 6)
                  for g in gates},
        "min_gain": min_gain,
    }}})
    # each was judged under its own engine's model: no provenance warning applies
    exports = [export_policy(new, g.engine, check_provenance=False) for g in passed]
    return new, exports, document_to_yaml(
        new, header="servetune nightly: the new scheduling policy (kind: Policy)")


def _headline(new: Policy, current: Policy, engines: Sequence[str], gates: list[EngineGate],
              *, timed_out: bool) -> tuple[str, int, str]:
    """(status, exit code, the report's headline) from the gates."""
    passed = [g.engine for g in gates if g.passed]
    failed = [g.engine for g in gates if not g.passed]
    if passed and not failed:
        return "new_policy_written", EXIT_NEW_POLICY, (
            f"New policy written: `{new.name}` replaces `{current.name}` on "
            f"{', '.join(engines)} (exit 0).")
    if passed:
        return "new_policy_written_some_engines", EXIT_SOME_ENGINES, (
            f"New policy written for {', '.join(passed)} only: "
            f"`{new.name}` replaces `{current.name}` there; it failed the gate of "
            f"{', '.join(failed)}, whose "
            f"config{'s were' if len(failed) > 1 else ' was'} not written (exit 11).")
    if timed_out:
        return "current_kept", EXIT_KEPT_CURRENT, (
            f"Current policy kept: `{current.name}` stays in production (exit 10): "
            "the optimizer's safety time limit fired.")
    return "current_kept", EXIT_KEPT_CURRENT, (
        f"Current policy kept: `{current.name}` stays in production (exit 10).")


def _reasons(main: EngineGate, gates: list[EngineGate], lane_note: str | None) -> list[str]:
    """The verdict's reasons: the main engine's, the lane note first; with more engines,
    each prefixed by its engine, then the others' gates."""
    reasons = list(main.decision.reasons)
    if lane_note:
        reasons.insert(0, lane_note)
    if len(gates) > 1:
        reasons = [f"{main.engine}: {r}" for r in reasons] + [
            f"{g.engine}: gate {'passed' if g.passed else 'failed'}"
            + ("" if g.passed else f": {'; '.join(_failures(g.decision))}")
            for g in gates if g is not main]
    return reasons


PROMISE_HEADING = "Yesterday's promise, checked today"


def promise_record(policy: Policy, goodput_rate_per_s: float, engine: str,
                   trace_path: Path) -> dict[str, Any]:
    """What this run promises the next one: the policy in production after it (the new
    one where the gate of the report's engine passed, else the current one), its goodput
    on this trace under that engine, and the trace it was measured on."""
    return {"goodput_rate_per_s": goodput_rate_per_s, "engine": engine,
            "trace": trace_path.name,
            "policy": policy.model_dump(mode="json", exclude={"metadata"})}


def previous_promise(out: Path) -> dict[str, Any] | None:
    """The promise the last run into ``out`` left in its ``summary.json``; None when there
    is none (a first run, a folder from before promises were kept, an unreadable file)."""
    try:
        data = json.loads((out / "summary.json").read_text())
        promise = data["promise"]
        return {"goodput_rate_per_s": float(promise["goodput_rate_per_s"]),
                "engine": str(promise["engine"]), "trace": str(promise.get("trace", "")),
                "policy": Policy.model_validate(promise["policy"])}
    except (OSError, ValueError, KeyError, TypeError, ValidationError):
        return None


def check_promise(
    last: dict[str, Any] | None, trace: Trace, profile: Profile, slo: SLOSet,
    current: Policy, current_rate_per_s: float, engine: str,
) -> dict[str, Any] | None:
    """The last run's promise replayed on today's trace by the one evaluator
    (:func:`servetune.sim.goodput`, as the gate measures goodput), under the engine it was
    made for: its policy's goodput today. When that policy is today's current one under
    the same engine, the gate's own measurement of it is the answer."""
    if last is None:
        return None
    policy = last["policy"]
    same = (last["engine"] == engine
            and policy.model_dump(exclude={"name", "metadata"})
            == current.model_dump(exclude={"name", "metadata"}))
    if same:
        delivered = current_rate_per_s
    else:
        gate_prof, _note = gate_profile(profile, last["engine"], policy)
        delivered = goodput(trace, policy, gate_prof, slo, engine=last["engine"]).rate_per_s
    promised = last["goodput_rate_per_s"]
    return {"promised_rate_per_s": promised, "delivered_rate_per_s": delivered,
            "ratio": delivered / promised if promised > 0 else None,
            "engine": last["engine"], "promised_on": last["trace"]}


def promise_section(promise: dict[str, Any], checked: dict[str, Any] | None) -> str:
    """The report's lines: the last run's promise against today, and today's promise."""
    lines = []
    if checked is None:
        lines.append("No earlier run's summary.json in this folder: nothing to check yet.")
    else:
        ratio = checked["ratio"]
        lines.append(
            f"Last run promised {checked['promised_rate_per_s']:.3f} req/s "
            f"(on {checked['promised_on'] or 'its trace'}, {checked['engine']}); replayed on "
            f"today's trace it gives {checked['delivered_rate_per_s']:.3f} req/s"
            + (f" ({ratio:.2f}x)." if ratio is not None else "."))
    lines.append(f"Today's promise, checked by the next run into this folder: "
                 f"{promise['goodput_rate_per_s']:.3f} req/s with the policy in production "
                 f"({promise['engine']}).")
    return "\n\n".join(lines)


PREFIX_CACHE_HEADING = "Prefix cache: the trace's reuse and this KV pool"


def prefix_cache_section(trace: Trace, kv_tokens: int) -> list[tuple[str, str]]:
    """For a trace with prefix block ids, the report's section: its LRU hit-rate curve
    (:func:`servetune.workloads.reuse.hit_rate_curve`) and where a KV pool of
    ``kv_tokens`` tokens (the one the report's runs simulated) sits on it; none for a
    trace without ids."""
    if trace.prefix_offsets is None or trace.prefix_block_ids is None:
        return []
    pool = pool_blocks(kv_tokens, trace)
    curve = hit_rate_curve(trace, sizes=(pool,))
    at = curve["points"][-1]
    curve["points"] = curve["points"][:-1]
    text = (f"{curve_text(curve)}.\n\nThis KV pool holds {pool:,} blocks of "
            f"{curve['block_tokens']} tokens ({at['fraction']:.1%} of the trace's distinct "
            f"blocks): an LRU cache that size hits {at['hit_rate']:.1%} of the block "
            f"references, an unbounded one {curve['bound']:.1%}. The hit rates the "
            "simulated runs reached are in summary.json (`prefix_cache` of each run).")
    return [(PREFIX_CACHE_HEADING, text)]


def defaults_section(current: Policy, profile: Profile) -> tuple[str, str]:
    """What ``vllm serve`` would choose on the profile's GPU, by which rule, and whether the
    policy in production is that (a report's reader compares gains with it)."""
    knobs, rule = baselines.engine_default_knobs("vllm", gpu_facts(profile))
    same = all(current.knobs().get(path) == value for path, value in knobs.as_dotted().items()
               if path in ("batching.max_num_seqs", "batching.max_num_batched_tokens"))
    text = (f"On this GPU `vllm serve` picks {knobs.max_num_seqs} sequences and "
            f"{knobs.max_num_batched_tokens} batched tokens (rule: {rule}). The policy in "
            "production " + ("uses these." if same else "differs from them."))
    return text, rule


def _failures(decision: Decision) -> list[str]:
    """The reasons that failed a gate (the others only report numbers)."""
    bad = [r for r in decision.reasons
           if "below the required" in r or "would drop" in r or "already in production" in r
           or "safety stop" in r]
    return bad or list(decision.reasons)


def gate_table(gates: Sequence[EngineGate]) -> str:
    """The report's gate section: one row per engine exported to, and why it passed or
    failed."""
    lines = [
        "The new policy is judged under each engine's own admission model, on the KV pool "
        "its exported config gives; an engine's config is written only when the new policy "
        "passes that engine's gate.",
        "",
        "| engine | KV blocks | goodput current -> new (req/s) | gain | gate | config |",
        "|---|---|---|---|---|---|",
    ]
    for g in gates:
        comp = g.comparison
        assert comp.new is not None
        gain = "-" if g.decision.gain is None else f"{100 * g.decision.gain:+.1f}%"
        why = "passed" if g.passed else "failed: " + "; ".join(_failures(g.decision))
        config = f"`{CONFIG_FILES[g.engine]}` written" if g.passed else "not written"
        lines.append(
            f"| {g.engine} | {g.kv_blocks} | {comp.current.goodput.rate_per_s:.3f} -> "
            f"{comp.new.goodput.rate_per_s:.3f} | {gain} | {why} | {config} |")
    notes = [f"- {g.engine}: {g.pool_note}" for g in gates if g.pool_note]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def live_policy(out: Path, current_path: Path, current: Policy, engines: Sequence[str], *,
                keep_files: bool) -> dict[str, Any]:
    """The policy that stays in production on ``engines`` (summary.json's
    ``live_policy``): the ``--current`` file's name, its policy's name and sha256, and
    ``kept_in_folder``, the live files of ``out`` that are that policy's and stay in the
    new output set (``keep_files``: no new policy is written). They are kept only when
    ``out/policy.yaml`` is the ``--current`` file byte for byte (the cron setup: last
    night's ``out/policy.yaml`` is tonight's ``--current``), with the engine configs the
    same run exported from it; any other earlier policy and its configs leave the live set
    (they stay in older generations), so the folder never pairs this run's report with
    another run's policy."""
    sha = sha256_file(current_path)
    kept: list[str] = []
    here = out / "policy.yaml"
    if keep_files and here.is_file() and sha256_file(here) == sha:
        kept = ["policy.yaml", *(name for name in CONFIG_FILES.values()
                                 if (out / name).is_file())]
    return {"file": current_path.name, "name": current.name, "sha256": sha,
            "engines": list(engines), "kept_in_folder": kept}


def _live_policy_section(live: dict[str, Any] | None, *, policy_written: bool = False
                         ) -> list[tuple[str, str]]:
    """The report's one sentence on the policy that stays in production (and, when this
    run wrote no policy, on the policy files in the folder)."""
    if live is None:
        return []
    kept = live["kept_in_folder"]
    many = len(kept) > 1
    here = ("" if policy_written else
            f"; this folder's {', '.join(f'`{n}`' for n in kept)} {'are' if many else 'is'} "
            f"that policy's, kept from the run that wrote {'them' if many else 'it'}" if kept
            else "; this folder holds no earlier run's policy or engine config beside this "
            "report")
    return [("Policy in production", (
        f"`{live['name']}` (`{live['file']}`, sha256 {live['sha256'][:16]}) stays in "
        f"production on {', '.join(live['engines'])}{here}."))]


def _write_outputs(out: Path, policy_text: str, exports: Sequence[ExportResult],
                   report: ReportFiles, live: dict[str, Any] | None) -> list[Path]:
    """Policy and configs, the report and ``summary.json`` as one output set
    (:func:`servetune.io.commit_files`); the kept policy's files stay in it as they are
    (``live``)."""
    files: list[tuple[str, bytes]] = []
    if policy_text:
        files.append(("policy.yaml", policy_text.encode("utf-8")))
        files += [(ex.filename, ex.text.encode("utf-8")) for ex in exports]
    files += report_file_list(report)
    return commit_files(out, files, owned=OUTPUT_FILES,
                        keep=live["kept_in_folder"] if live else ())


def _write_infeasible(out: Path, err: InfeasibleError, comp: Comparison,
                      base_summary: dict[str, Any], live: dict[str, Any],
                      progress: Progress | None) -> NightlyOutcome:
    """Exit 3: the report shows the policy in production alone (``live``), and says what
    binds."""
    current = comp.current.policy
    headline = (f"No policy in the search space meets the SLOs; `{current.name}` stays "
                "(exit 3).")
    why = (
        "The optimizer found no policy in the search space that meets the SLO set, so no "
        "policy or engine config was written. The line above names the condition that binds "
        "and the best value reachable; a larger search space, a lower rate, looser SLOs or "
        "another GPU can make it feasible. The numbers and plots below are the policy in "
        "production on the same trace."
    )
    summary_extra = {
        **base_summary,
        "status": "infeasible",
        "exit_code": EXIT_INFEASIBLE,
        "details": drop_timings(err.details),
        "files_written": ["report.md", *FIGURE_NAMES, "summary.json"],
        "live_policy": live,
    }
    _say(progress, "rendering the report and its plots")
    report = build_report(comp, Verdict(headline, [err.message]), inputs=base_summary["inputs"],
                          title="servetune nightly tuning report", summary_extra=summary_extra,
                          extra_sections=[("Why no new policy", why),
                                          *_live_policy_section(live)])
    _say(progress, f"writing outputs to {out}")
    written = _write_outputs(out, "", [], report, live)
    return NightlyOutcome(exit_code=EXIT_INFEASIBLE, status="infeasible", files=written,
                          summary=report.summary)


# --------------------------------------------------------------------- two given policies


@dataclass
class ReportOutcome:
    headline: str
    files: list[Path]
    summary: dict[str, Any]


def run_report(
    trace_path: str | os.PathLike[str],
    profile_path: str | os.PathLike[str],
    slo_path: str | os.PathLike[str],
    current_path: str | os.PathLike[str],
    new_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    engine: str = "vllm",
    progress: Progress | None = None,
    trace_read: Mapping[str, Any] | None = None,
    executor: Executor | None = None,
) -> ReportOutcome:
    """``servetune report``: compare two given policies on a trace (steps 3 and 5 of the
    module docstring, without the optimizer or a decision; the simulations on
    ``executor``) and write the report."""
    trace_path, profile_path, slo_path, current_path, new_path = (
        Path(trace_path), Path(shipped_or_path(str(profile_path))), Path(slo_path),
        Path(current_path), Path(new_path))
    _check_out_dir(Path(out_dir), [], {
        "trace_path": trace_path, "profile_path": profile_path, "slo_path": slo_path,
        "current_path": current_path, "new_path": new_path})
    trace, profile, slo = load_inputs(trace_path, profile_path, slo_path, trace_read)
    current = load_document(current_path, Policy)
    new = load_document(new_path, Policy)
    _say(progress, "simulating both policies (trace, +20%, +50%, goodput)")
    comp = compare(trace, current, new, profile, slo, engine=engine, executor=executor)
    g_cur, g_new = comp.current.goodput.rate_per_s, comp.new.goodput.rate_per_s
    headline = (f"Goodput {g_cur:.3f} req/s (current `{current.name}`) vs {g_new:.3f} req/s "
                f"(new `{new.name}`).")
    inputs = {name: f"{p.name} (sha256 {sha256_file(p)[:16]})" for name, p in
              (("trace", trace_path), ("profile", profile_path), ("slo", slo_path),
               ("current policy", current_path), ("new policy", new_path))}
    reasons = model_reasons(fit_workload(trace, name=trace_path.stem), profile, slo, current,
                            new)
    files = build_report(comp, Verdict(headline), inputs=inputs, reasons=reasons,
                         extra_sections=prefix_cache_section(
                             trace, profile.kv_blocks() * profile.block_size))
    written = write_report(files, out_dir)
    return ReportOutcome(headline=headline, files=written, summary=files.summary)
