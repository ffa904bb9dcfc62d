"""Fit a Workload to a trace, sample a trace from a Workload, and per-class moments.

Fitting (``fit_workload``): the trace is split into classes (one, by its class column, or
by prompt-length quantile bands). Per class:

- rate_c = overall mean rate * n_c / n, where the overall rate is (rows-1)/span as in
  :mod:`servetune.workloads.stats` (so one class has exactly the trace's rate and the
  classes' rates sum to it);
- two timescales. Real traces drift over the hour (Azure conv: 5-min rates 2.6-7.5 req/s,
  longer prompts in the peak; Mooncake: mean prompt 11.8k tokens in the first minutes,
  20.8k in the last) and a replay fails its SLO first in the peak, which a stationary
  sample lacks (stationary fits gave 1.2-1.6x the replay's goodput). So the rate is
  lambda(t) = rate * m(t) * x(Lambda(t)): a slow, deterministic, periodic profile m
  (piecewise constant on windows of minutes: the trace's own shape, which is what a
  nightly job replays: yesterday's traffic) times a fast Markov-modulated burst level x
  that runs in the profile's operational time Lambda(t) = integral_0^t m (mean-rate
  seconds), and the length mix follows the slow windows (``length_shift``):

  * the slow windows (``rate_windows_s``): "auto" (default) takes k = max(6, ceil(span /
    5 min)) equal windows covering the trace (so at most 5 minutes, no partial window),
    none when they would be shorter than 2 minutes or than 10 burst windows (a short
    trace cannot tell a trend from bursts, and keeps the simple fit); a number forces
    windows of that length; None or "none" turns them off (the stationary fit);
  * the profile: m_i = (requests in window i / window length), divided by their mean.
    ``auto`` keeps it when the index of dispersion of the windows' counts exceeds what
    a Poisson process reaches with odds ~1/1000 (1 + 3 sqrt(2 / (k - 1))), else the
    rate is flat (m_i = 1, and the windows stay only if the lengths drift);
  * the length drift: per window, a shift d_i of the normal score of prompt (output)
    lengths: a length drawn in window i is Q(Phi(d_i + a e)), Q the class's quantile
    function below, e standard normal, a = sqrt(1 - weighted variance of d), so over
    all windows the scores keep mean 0 and variance 1 and the marginal stays (close to)
    Q: the optimizer's models read Q unchanged. d_i is the shift that gives window i its
    own mean length (quadrature + bisection; the mean, not the median score, because a
    peak's prompts differ most in the tail: on the conv trace, shifts from mean normal
    scores gave 1.14x the replay's goodput (defaults, server, one seed), from the means
    1.04x), shrunk towards 0 by tau^2 / (tau^2 + 1/c_i) (c_i requests in the window,
    tau^2 the between-window variance of the mean scores net of noise); fitted only when
    the windows' mean normal scores s_i differ significantly (sum c_i s_i^2 more than 3
    SDs above its no-drift mean, k - 1). With a copula, its r is the within-window part:
    the overall score correlation cov(d_p, d_o) + a_p a_o r_within equals the fitted r.
    Why this form: 1-2 numbers per window, the marginals kept, and a replay shuffled
    within 5-min windows (times kept) matched the conv replay's goodput within 2% while
    one shuffled over the whole trace was 15% easier: the 5-minute length mix is what
    matters there;
- burstiness: the CV of the class's inter-arrival gaps measured in operational time
  Lambda(t) = integral of m (plain gaps without windows), so the windows' rate changes
  are removed first. ``auto`` (the default) first looks for sustained bursts (in that
  operational time), which i.i.d. gaps cannot make and which drive queueing and p99 TTFT
  (a renewal fit of the Azure code trace claimed 2-4x the goodput of replaying it):

  * ``modulated`` (Markov-modulated rate): windows of w = 10 arrivals at the mean rate
    (1..60 s); counts c_i, relative rates x_i = c_i / mean(c). Chosen when there are
    >= MOD_MIN_WINDOWS windows, consecutive counts correlate (lag-1 autocorrelation >
    max(0.1, 2/sqrt(windows))) and their index of dispersion exceeds 1.25x the median one
    of 8 seeded shuffles of the gaps (the same gaps as a renewal process). Levels: one
    for windows without arrivals, and up to 6 log-spaced bands of the others' x (log
    spacing keeps the rare intense windows that set p99 TTFT apart), each level the mean
    x of its windows, normalised to stationary mean 1; transitions: counts of
    consecutive windows' levels, row-normalised. The gaps within are those in the
    operational time of each window's own rate x_i, fitted by the renewal rule below.
    Why this: a few numbers (levels + a K x K matrix, K <= 7), it reproduces the windowed
    count dispersion, and a shorter sample stays a prefix of a longer one;
  * else the renewal fit (``arrival_process="renewal"`` forces it, and it is what
    ``auto`` chose before modulation):

  * ``empirical`` when the CV exceeds ``EMPIRICAL_CV_THRESHOLD`` (2) and the class has at
    least ``MIN_EMPIRICAL_GAPS`` gaps: the gaps, divided by their mean, at
    ``GAP_QUANTILE_GRID`` (dense in both tails: every 0.01% below 0.1% and above 99.9%),
    with Hazen plotting positions (order statistic i at (i + 1/2)/n), whose
    piecewise-linear quantile function has the sample's mean (the default linear
    positions halve the largest gap's weight: 3% of the mean gap on the code trace), then
    divided by the knots' mean so they have mean 1. Why 2: a moment-matched gamma with
    CV c has shape 1/c^2; above c = 2 (shape < 1/4) it puts over 10% of gaps below 0.1%
    of the mean gap, a spike at zero that real traces do not have (at the code trace's
    CV 13 it draws 94% of gaps under 1 ms where the trace has 17%), and the queueing of
    those simultaneous arrivals, not the trace's idle gaps, then dominates TTFT. At or
    below 2 the gamma (or Poisson) keeps the model to one number, which the optimizer's
    queueing formulas read anyway;
  * else ``gamma`` when the CV differs from 1 by more than ``POISSON_CV_TOLERANCE``, else
    ``poisson``.

  ``arrival_process`` may also force ``modulated``, ``poisson``, ``gamma`` or
  ``empirical``. A modulated class reports (``class_stats``) the trace's own gap CV;
- lengths: numpy quantiles (linear interpolation) of prompt and output tokens at
  ``QUANTILE_GRID``, which holds 0, 0.5, 0.9, 0.99 and 1 and is dense in the tail.
- prompt/output dependence (``prompt_output_correlation``): a Gaussian copula whose
  Spearman rank correlation equals the class's own rho_S (mid-ranks for ties):
  r = 2 sin(pi rho_S / 6). Left out (independent lengths, as before) with fewer than
  ``COPULA_MIN_REQUESTS`` requests or when |rho_S| <= ``COPULA_SIGMAS`` / sqrt(n - 1),
  i.e. within 3 standard errors of independence. Why: in a long-context trace the longest
  prompts come with the shortest outputs (Mooncake: rho_S -0.52, mean output 88 tokens
  above the median prompt and 210 below); drawn independently, a sample pairs 100k-token
  prompts with long decodes, which the trace never does, and the engine defaults'
  goodput on it was 1.7x the replay's (median of 3 seeds; 1.1x with the copula,
  benchmarks/RESULTS.md "Trace fidelity"). One number, and the marginals
  (all that the optimizer's models read) stay exactly the fitted ones.
- arrivals, non-parametric (``Workload.block_bootstrap``, all classes together; module
  :mod:`servetune.workloads.bootstrap`): a window-stratified block bootstrap of the
  trace's request sequence. The span is cut into blocks of ``block_s`` (default 60 s)
  from the first arrival; consecutive blocks form strata, the slow windows rounded to
  whole blocks (``auto``: the windows above, 300 s on the Azure traces, 180 s on
  Mooncake; a fixed ``rate_windows_s``: its length; none: one stratum); every request is
  stored (offset in its block, class, prompt and output tokens: ~4 numbers a request). A
  sample permutes the blocks within each stratum, so each stratum keeps exactly its
  requests (the slow profile, its length mix, where its longest prompts are) and each
  block its bursts and its (time, prompt, output) triples. Why 60 s: the bursts are
  shorter (Azure code, the bursty trace: autocorrelation of 1-s counts 0.39 at 5 s, 0.26
  at 10 s, under 0.05 from 20 s) and 60-s blocks keep the variance-time curve (index of
  dispersion of counts in windows of 1-300 s, median of 8 samples) within 14% (code) and
  12% (conv) of the trace's at every window, where 30-s blocks lose up to 39% at 2
  minutes; a 5-minute stratum still has 5 blocks (120 orders). What it loses: the
  correlation across block boundaries inside a stratum (the 1-2-minute swings), and it
  makes no traffic the trace never had (no new bursts or lengths). The classes stay
  fitted as above: the optimizer's models and ``class_stats`` read them, and the sample's
  class rates and lengths over a cycle are the trace's. ``auto`` decides from counts and
  lengths only (the rule was fixed before any goodput run), when every stratum but the
  last has >= 2 blocks, on any of:
  (1) a class is Markov-modulated (the burst test above fired: on the Azure code trace
  the chain over the slow profile counted the 5-10-minute variance twice and missed the
  bursts' shape, benchmarks/RESULTS.md);
  (2) the variance-time curve of the parametric fit (dispersion D of counts in windows
  w = 1 s, 2 s, ... up to span / 20; median of VT_SEEDS samples of as many requests)
  leaves the trace's band: |ln(D_fit / D_trace)| > ln 1.5 + 3 sqrt(4 / (k - 1)) at some
  w with k windows. Why 1.5: in heavy traffic a queue's delay grows as (D + c_s^2) rho /
  (1 - rho), so at a fixed delay (the SLO) and load ~0.8, a 1.5x error in D moves the
  load that meets it by ~10%, the acceptance band; the second term is 3 standard errors
  of the log ratio of two dispersion estimates (sqrt(2 / (k - 1)) each, Poisson counts);
  (3) the longest prompts cluster in time: the requests at or above the 99th-percentile
  prompt (at least 10), counted per stratum, against a binomial with each stratum's share
  of requests: chi^2 more than 3 SDs (sqrt(2 df)) above df. A length shift moves a
  window's mean, not the few longest prompts that set p99 TTFT (Mooncake);
  (4) the trace's sessions change over time: sessions replayed from the parametric fit's
  first turns (:func:`servetune.workloads.prefixes.later_turns_held`, CALIBRATION_SEEDS
  samples over the span) hold less than MIN_LATER_TURNS_HELD (85%) of the trace's later
  turns. Parametric first turns come at any time; where the sessions that go on longest
  begin at particular times (Mooncake: its documents asked about again and again begin
  early, 71% held; its second half begins with the first half's sessions open, 73%; its
  first half 89%; the session traces of benchmarks/reuse_fidelity.py 95-109%), only the
  trace's own order keeps them. Decided from counts of later turns; it was added after
  goodput runs had shown parametric first turns fall short on those traces.
  A trace shorter than the slow windows' 2 blocks each (under 12 minutes) is stratified
  in 2-block strata.
  Otherwise the parametric fit stays. ``arrival_process="bootstrap"`` forces the bootstrap
  (an error when the strata are too short), ``parametric`` (what ``auto`` chose before)
  or any single process keeps the classes only. Size: over MAX_BOOTSTRAP_REQUESTS
  (200,000) requests, every k-th stratum is kept (the smallest k that fits: a systematic
  sample of whole blocks evenly over the trace, so a day cycles through a shorter day),
  its times scaled by one factor so it arrives at the whole trace's mean rate.
- prefix reuse (``Workload.prefix_reuse``, when the trace has prefix block ids: Mooncake
  hashes or a session column): sessions and shared system prompts, fitted over all
  classes (:mod:`servetune.workloads.prefixes`, statistics in
  :mod:`servetune.workloads.reuse`). Its chances of a next turn are calibrated on the
  first turns that samples of this workload's own classes (or bootstrap) give over the
  trace's span, so a sample holds the trace's later turns.

Sampling (``sample_trace``): each class is an independent stream, generated in fixed
chunks of ``CHUNK`` requests from its own seeded generators: unit-mean exponential,
gamma or empirical gaps (u -> interp(u, gap quantiles, gap values / their mean)) cumulated
in operational time, mapped to seconds through the inverse cumulative rate (a modulated
class: of its level path, a Markov chain started from the stationary distribution and
drawn run by run, each level's holding time geometric, from a generator of its own), then
through the inverse of the slow profile's Lambda (periodic: the profile repeats after its
last window).
``rate_scale`` s divides the resulting times by s for a class with windows or a
modulation: the profile and the bursts compress with the time axis, exactly as a trace
replay scaled by s does (a goodput search compares the two; a profile kept in wall time
would instead spread s times more traffic over the same hour, a different workload).
Lengths are
drawn by inverse CDF u -> interp(u, quantiles, values), rounded to an integer >= 1: u is
a uniform from the prompt's (output's) own generator, or with a copula u_p = Phi(z_p),
u_o = Phi(r z_p + sqrt(1 - r^2) e), z_p and e standard normals from those generators;
with a length shift the scores are d_i + a z for the window i of the arrival time (at
rate scale 1).
Streams are merged by arrival time. Because each stream does not depend on how much is
drawn, a shorter sample is a prefix of a longer one with the same seed.
A workload with a ``block_bootstrap`` is sampled from it instead (all classes at once):
cycle c (``span_s`` seconds) lays out the strata in order, each stratum's blocks in an
order drawn from a generator seeded by (seed, c), each block taking its own length with
its requests at their offsets and keeping their class and lengths; ``rate_scale`` s
divides the times by s. Whole cycles do not depend on how many are drawn (a sample that
ends inside a cycle takes blocks from every stratum: :mod:`servetune.workloads.bootstrap`).
With ``prefix_reuse.sessions`` the stream gives first turns only (its requests that stand
for later turns are left out) and each replays a donor session's later turns
(:func:`servetune.workloads.prefixes.grow_sessions`); the stream is drawn to a length
whose sessions hold the requests asked for (doubling), everything up to its last arrival
being complete. The requests then get block ids, in arrival order, from generators of
their own (:func:`servetune.workloads.prefixes.assign_prefix_ids`). Over a parametric
stream the prefix property holds for sessions and ids too.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import yaml
from pydantic import ValidationError

from servetune.errors import ServetuneError
from servetune.io import write_text_atomic
from servetune.schemas.base import format_validation_error, load_document
from servetune.schemas.workload import (
    SCALE_BY,
    Arrival,
    BlockBootstrap,
    GapDistribution,
    LengthDistribution,
    LengthShift,
    PrefixReuse,
    RateModulation,
    RateWindows,
    Workload,
    WorkloadClass,
    knot_moments,
)
from servetune.workloads import bootstrap
from servetune.workloads.bootstrap import BLOCK_S
from servetune.workloads.copula import (
    COPULA_MIN_REQUESTS,
    fit_length_correlation,
    normal_cdf,
    normal_scores,
)
from servetune.workloads.prefixes import (
    CALIBRATION_SEEDS,
    FirstTurns,
    assign_prefix_ids,
    calibrate,
    fit_prefix_reuse,
    grow_sessions,
    later_turn_mask,
    later_turns_held,
)
from servetune.workloads.prefixes import summary as prefix_summary
from servetune.workloads.reuse import reuse_stats
from servetune.workloads.stats import gap_cv
from servetune.workloads.trace import Trace, from_arrays

POISSON_CV_TOLERANCE = 0.01
EMPIRICAL_CV_THRESHOLD = 2.0
MIN_EMPIRICAL_GAPS = 100  # fewer gaps make knots that are mostly interpolation noise
RATE_WINDOWS = ("auto", "none")
ARRIVAL_PROCESSES = ("auto", "bootstrap", "parametric", "renewal", "modulated", "poisson",
                     "gamma", "empirical")
# Markov modulation (see the module docstring)
MOD_ARRIVALS_PER_WINDOW = 10.0  # the window holds this many arrivals at the mean rate ...
MOD_MIN_WINDOW_S, MOD_MAX_WINDOW_S = 1.0, 60.0  # ... within these bounds
MOD_MIN_WINDOWS = 16  # fewer windows cannot show a correlation between consecutive ones
MOD_MAX_POSITIVE_LEVELS = 6  # levels with a positive rate (plus one at rate 0)
MOD_WINDOWS_PER_LEVEL = 10
MOD_DISPERSION_RATIO = 1.25  # windowed-count dispersion over that of the shuffled gaps
MOD_MIN_LAG1 = 0.1
MOD_SHUFFLES = 8
GAP_SIGNIFICANT_DIGITS = 6
# Prompt/output dependence (Gaussian copula, see the module docstring)
# Slow rate profile and length drift (two-timescale model, see the module docstring)
SLOW_WINDOW_S = 300.0  # the slow windows are at most 5 minutes long ...
SLOW_MIN_WINDOWS = 6  # ... and at least this many cover the trace ...
SLOW_MIN_WINDOW_S = 120.0  # ... and none are shorter than 2 minutes ...
SLOW_FAST_RATIO = 10.0  # ... or than 10 of the burst modulation's windows
SLOW_SIGMAS = 3.0  # the windowed counts' dispersion is this many SEs above Poisson's
SHIFT_SIGMAS = 3.0  # a length shift is fitted when its chi-square is this many SDs out
# Block bootstrap: when auto chooses it (see the module docstring)
VT_MIN_WINDOW_S = 1.0  # the variance-time curve from 1 s windows ...
VT_MIN_WINDOWS = 20  # ... doubling while the trace holds this many
VT_SEEDS = 4  # samples of the parametric fit (the median dispersion per window)
VT_FACTOR = 1.5  # a dispersion off by this factor moves goodput ~10% at load 0.8
VT_SIGMAS = 3.0  # ... beyond this many standard errors of the two estimates
TOP_PROMPT_SHARE = 0.01  # the longest 1% of prompts ...
TOP_MIN_REQUESTS = 10  # ... when there are at least this many of them
TOP_SIGMAS = 3.0  # their counts per stratum over-dispersed by this many SDs
MIN_LATER_TURNS_HELD = 0.85  # sessions replayed from parametric first turns hold less
CHUNK = 65536
DEFAULT_DURATION_S = 3600.0
MAX_RATE_WINDOWS = 100_000
# A rate scale outside this range makes arrival times degenerate (all equal, or beyond
# any horizon); goodput's search stays within 1/1024 .. 1024.
MIN_RATE_SCALE, MAX_RATE_SCALE = 1e-6, 1e6
MAX_BANDS = 64  # prompt-length bands (classes) --split-by prompt-quantiles may make
# Beyond this a sample, and the simulation of it, outgrows a workstation's memory (about 90
# bytes a request to sample, more to simulate: 10 million stay within a few GB).
MAX_SAMPLE_REQUESTS = 10_000_000


def _grid() -> np.ndarray:
    body = np.arange(0, 90) / 100.0  # 0.00 .. 0.89
    upper = 0.90 + np.arange(0, 36) * 0.0025  # 0.9000 .. 0.9875
    tail = 0.99 + np.arange(0, 18) * 0.0005  # 0.9900 .. 0.9985
    extreme = 0.999 + np.arange(0, 10) * 0.0001  # 0.9990 .. 0.9999
    grid = np.concatenate([[0.0, 0.005], body[1:], upper, tail, extreme, [1.0]])
    return np.round(grid, 6)


QUANTILE_GRID: np.ndarray = _grid()
# Gaps need both tails: the lower one holds the near-simultaneous arrivals, the upper one
# the idle periods that carry most of a bursty trace's mean gap.
GAP_QUANTILE_GRID: np.ndarray = np.unique(np.round(np.concatenate([_grid(), 1.0 - _grid()]), 6))


# ----------------------------------------------------------------------------- statistics


def _as_arrays(dist: LengthDistribution) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(dist.quantiles, dtype=np.float64), np.asarray(dist.values, np.float64)


def distribution_mean(dist: LengthDistribution) -> float:
    """Mean of the piecewise-linear quantile function (what the sampler draws from)."""
    q, v = _as_arrays(dist)
    return float(np.sum(np.diff(q) * (v[1:] + v[:-1]) / 2.0))


def distribution_quantile(
    dist: LengthDistribution, p: float | np.ndarray
) -> float | np.ndarray:
    """The ``p`` quantile (0..1) of a length distribution, interpolating between knots."""
    q, v = _as_arrays(dist)
    out = np.interp(np.asarray(p, dtype=np.float64), q, v)
    return float(out) if np.ndim(out) == 0 else out


@dataclass(frozen=True)
class ClassStats:
    """Moments and quantiles of one class, as the optimizer's models read them."""

    name: str
    priority: int
    rate_per_s: float
    share: float
    interarrival_cv: float
    prompt_mean: float
    prompt_p50: float
    prompt_p90: float
    prompt_p99: float
    prompt_max: float
    output_mean: float
    output_p50: float
    output_p90: float
    output_p99: float
    output_max: float
    prompt: LengthDistribution
    output: LengthDistribution

    def prompt_quantile(self, q: float) -> float:
        return float(distribution_quantile(self.prompt, q))

    def output_quantile(self, q: float) -> float:
        return float(distribution_quantile(self.output, q))


def class_stats(workload: Workload) -> list[ClassStats]:
    """One ClassStats per class, in the workload's class order."""
    total = workload.total_rate_per_s
    out = []
    for name, cls in workload.classes.items():
        p, o = cls.prompt_tokens, cls.output_tokens
        pq = distribution_quantile(p, np.array([0.5, 0.9, 0.99, 1.0]))
        oq = distribution_quantile(o, np.array([0.5, 0.9, 0.99, 1.0]))
        out.append(
            ClassStats(
                name=name,
                priority=cls.priority,
                rate_per_s=cls.arrival.rate_per_s,
                share=cls.arrival.rate_per_s / total,
                interarrival_cv=cls.arrival.gaps_cv,
                prompt_mean=distribution_mean(p),
                prompt_p50=float(pq[0]),
                prompt_p90=float(pq[1]),
                prompt_p99=float(pq[2]),
                prompt_max=float(pq[3]),
                output_mean=distribution_mean(o),
                output_p50=float(oq[0]),
                output_p90=float(oq[1]),
                output_p99=float(oq[2]),
                output_max=float(oq[3]),
                prompt=p,
                output=o,
            )
        )
    return out


def class_stats_json(workload: Workload) -> dict[str, Any]:
    """The workload and its :func:`class_stats` as plain data (``workload show --json``)."""
    classes = []
    for s in class_stats(workload):
        row = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)
               if f.name not in ("prompt", "output")}
        cls = workload.classes[s.name]
        row["process"] = cls.arrival.process
        row["rate_windows"] = len(cls.arrival.windows.rate_multipliers) if (
            cls.arrival.windows is not None) else 0
        mod = cls.arrival.modulation
        row["modulation_levels"] = len(mod.levels) if mod is not None else 0
        row["modulation_window_s"] = mod.window_s if mod is not None else None
        classes.append(row)
    return {
        "name": workload.name,
        "source": workload.source,
        "duration_s": workload.duration_s,
        "rate_per_s": workload.total_rate_per_s,
        "arrival_model": arrival_model(workload),
        "classes": classes,
    } | ({} if workload.prefix_reuse is None else {
        "prefix_reuse": prefix_summary(workload.prefix_reuse)})


# ----------------------------------------------------------------------------- fitting


def _fit_lengths(tokens: np.ndarray) -> LengthDistribution:
    values = np.quantile(np.asarray(tokens, dtype=np.float64), QUANTILE_GRID)
    values = np.maximum(np.round(values, 2), 1.0)
    values = np.maximum.accumulate(values)  # rounding must not break monotonicity
    return LengthDistribution(
        quantiles=[float(q) for q in QUANTILE_GRID], values=[float(v) for v in values]
    )


def _window_multipliers(arrival_s: np.ndarray, span: float, window_s: float) -> np.ndarray:
    n_windows = max(1, math.ceil(span / window_s))
    counts = np.bincount(
        np.minimum((arrival_s // window_s).astype(np.int64), n_windows - 1), minlength=n_windows
    ).astype(np.float64)
    lengths = np.full(n_windows, window_s)
    lengths[-1] = max(span - (n_windows - 1) * window_s, 1e-9) if span > 0 else window_s
    rates = counts / lengths
    return rates / rates.mean()


def _operational_time(t: np.ndarray, multipliers: np.ndarray, window_s: float) -> np.ndarray:
    """Lambda(t) = integral_0^t m(s) ds for the periodic piecewise-constant m."""
    k = len(multipliers)
    period = k * window_s
    starts = np.concatenate([[0.0], np.cumsum(multipliers) * window_s])
    p, r = np.divmod(t, period)
    i = np.minimum((r // window_s).astype(np.int64), k - 1)
    return p * starts[-1] + starts[i] + (r - i * window_s) * multipliers[i]


def fit_gaps(gaps: np.ndarray) -> GapDistribution:
    """Quantile knots of ``gaps`` (positive mean) at GAP_QUANTILE_GRID, scaled to mean 1."""
    x = np.asarray(gaps, dtype=np.float64)
    x = x / float(x.mean())
    values = np.quantile(x, GAP_QUANTILE_GRID, method="hazen")
    mean, _ = knot_moments(GAP_QUANTILE_GRID.tolist(), values.tolist())
    values = np.maximum.accumulate(
        np.array([float(f"{v:.{GAP_SIGNIFICANT_DIGITS}g}") for v in values / mean])
    )
    return GapDistribution(
        quantiles=[float(q) for q in GAP_QUANTILE_GRID], values=[float(v) for v in values]
    )


def _renewal(
    gaps: np.ndarray, rate: float, process: str, windows: RateWindows | None = None,
    modulation: RateModulation | None = None,
) -> Arrival:
    """The renewal part of an arrival process from ``gaps`` (in operational time when
    there are windows or a modulation); ``process`` auto/renewal picks one as documented."""
    cv = 1.0
    if len(gaps) >= 2 and gaps.mean() > 0:
        cv = gap_cv(gaps)
    cv = min(max(round(cv, 4), 0.01), 100.0)
    if process in ("auto", "renewal"):
        bursty = cv > EMPIRICAL_CV_THRESHOLD and len(gaps) >= MIN_EMPIRICAL_GAPS
        process = "empirical" if bursty else "gamma"
    extra = {"windows": windows, "modulation": modulation}
    if process == "empirical":
        if len(gaps) < 2 or not gaps.mean() > 0:
            raise ServetuneError(
                f"an empirical arrival process needs at least 2 gaps with a positive mean "
                f"(got {len(gaps)}); fit with argument `arrival_process` gamma"
            )
        # its interarrival_cv is computed from the knots (the schema checks they agree)
        return Arrival(process="empirical", rate_per_s=rate, interarrival_gaps=fit_gaps(gaps),
                       **extra)
    if process == "poisson" or abs(cv - 1.0) <= POISSON_CV_TOLERANCE:
        return Arrival(process="poisson", rate_per_s=rate, interarrival_cv=1.0, **extra)
    return Arrival(process="gamma", rate_per_s=rate, interarrival_cv=cv, **extra)


def _fit_arrival(
    arrival_s: np.ndarray,
    rate: float,
    multipliers: np.ndarray | None,
    window_s: float | None,
    process: str = "auto",
) -> Arrival:
    if multipliers is not None and window_s is not None:
        windows = RateWindows(
            window_s=float(window_s), rate_multipliers=[round(float(m), 4) for m in multipliers]
        )
        m = np.asarray(windows.rate_multipliers)
        t = _operational_time(arrival_s, m / m.mean(), window_s)
        if process in ("auto", "modulated"):
            # the bursts in the operational time of the slow profile
            fitted = _fit_modulated(t, rate, force=process == "modulated", windows=windows,
                                    seconds_gaps=np.diff(arrival_s))
            if fitted is not None:
                return fitted
            process = "renewal"
        return _renewal(np.diff(t), rate, process, windows=windows)
    if process in ("auto", "modulated"):
        fitted = _fit_modulated(arrival_s, rate, force=process == "modulated")
        if fitted is not None:
            return fitted
        process = "renewal"
    return _renewal(np.diff(arrival_s), rate, process)


# ----------------------------------------------------------------------------- modulation


def modulation_window_s(n: int, span_s: float) -> float:
    """The modulation's window: MOD_ARRIVALS_PER_WINDOW arrivals at the mean rate, within
    [MOD_MIN_WINDOW_S, MOD_MAX_WINDOW_S], to two significant digits."""
    w = MOD_ARRIVALS_PER_WINDOW * span_s / max(n - 1, 1)
    w = min(max(w, MOD_MIN_WINDOW_S), MOD_MAX_WINDOW_S)
    return float(f"{w:.2g}")


def window_counts(arrival_s: np.ndarray, window_s: float) -> np.ndarray:
    """Arrivals per whole window of ``window_s`` from the first arrival (a last, partial
    window is left out)."""
    t = np.asarray(arrival_s, dtype=np.float64)
    t = t - t[0]
    n_windows = max(1, int(t[-1] // window_s))
    idx = (t // window_s).astype(np.int64)
    return np.bincount(idx[idx < n_windows], minlength=n_windows).astype(np.float64)


def dispersion(counts: np.ndarray) -> float:
    """Index of dispersion (variance / mean) of windowed counts; 0 without arrivals."""
    mean = float(counts.mean())
    return float(counts.var() / mean) if mean > 0 else 0.0


def _lag1(counts: np.ndarray) -> float:
    c = counts - counts.mean()
    denom = float(c @ c)
    return float(c[:-1] @ c[1:]) / denom if denom > 0 else 0.0


def burst_evidence(arrival_s: np.ndarray, window_s: float) -> dict[str, float]:
    """What ``auto`` decides on: the windowed counts' index of dispersion, the median one
    of MOD_SHUFFLES shuffles of the gaps (a renewal process with the same gaps; seeded, so
    deterministic) and the lag-1 autocorrelation of consecutive windows' counts."""
    t = np.asarray(arrival_s, dtype=np.float64)
    counts = window_counts(t, window_s)
    gaps = np.diff(t)
    rng = np.random.default_rng(0)
    shuffled = [
        dispersion(window_counts(np.concatenate([[0.0], np.cumsum(rng.permutation(gaps))]),
                                 window_s))
        for _ in range(MOD_SHUFFLES)
    ]
    return {"windows": float(len(counts)), "dispersion": dispersion(counts),
            "shuffled_dispersion": float(np.median(shuffled)), "lag1": _lag1(counts)}


def _is_modulated(ev: dict[str, float]) -> bool:
    n = ev["windows"]
    return (
        n >= MOD_MIN_WINDOWS
        and ev["lag1"] > max(MOD_MIN_LAG1, 2.0 / math.sqrt(n))
        and ev["dispersion"] > MOD_DISPERSION_RATIO * ev["shuffled_dispersion"]
    )


def _fit_modulated(arrival_s: np.ndarray, rate: float, *, force: bool,
                   windows: RateWindows | None = None,
                   seconds_gaps: np.ndarray | None = None) -> Arrival | None:
    """The Markov-modulated fit, or None when ``auto`` finds no burst structure (or the
    class is too short to have windows). ``arrival_s`` is in the slow profile's
    operational time when there are ``windows``; ``seconds_gaps`` (default: its gaps)
    give the reported gap CV."""
    t = np.asarray(arrival_s, dtype=np.float64)
    t = t - t[0]
    n = len(t)
    span = float(t[-1])
    if n < 3 or span <= 0:
        return None
    w = modulation_window_s(n, span)
    ev = burst_evidence(t, w)
    if not force and not _is_modulated(ev):
        return None
    counts = window_counts(t, w)
    x = counts / counts.mean()
    # levels: windows without arrivals, then bands of the others' rates
    label = np.zeros(len(x), dtype=np.int64)
    pos = x > 0
    n_pos_levels = int(min(MOD_MAX_POSITIVE_LEVELS,
                           max(1, pos.sum() // MOD_WINDOWS_PER_LEVEL)))
    # log-spaced bands, so the rare intense windows that drive p99 TTFT keep a level
    lx = np.log(x[pos])
    edges = np.exp(np.linspace(lx.min(), lx.max(), n_pos_levels + 1)[1:-1])
    label[pos] = 1 + np.searchsorted(edges, x[pos], side="right")
    used = np.unique(label)
    label = np.searchsorted(used, label)  # renumber 0..k-1
    k = len(used)
    raw = np.array([x[label == j].mean() for j in range(k)])
    trans = np.zeros((k, k))
    np.add.at(trans, (label[:-1], label[1:]), 1.0)
    marginal = np.bincount(label, minlength=k) / len(label)
    rows = trans.sum(axis=1)
    trans = np.where(rows[:, None] > 0, trans / np.where(rows > 0, rows, 1)[:, None], marginal)
    # a silent level seen only at the trace's end would never be left: leave it as the
    # windows do on average
    stuck = (raw == 0) & (trans[:, raw > 0].sum(axis=1) == 0)
    trans[stuck] = marginal
    trans = np.round(trans, 6)
    trans = trans / trans.sum(axis=1, keepdims=True)
    modulation = RateModulation(
        window_s=w, levels=[1.0] * k, transitions=[[float(p) for p in r] for r in trans],
        gap_cv=min(max(round(gap_cv(np.diff(t) if seconds_gaps is None else seconds_gaps),
                             4), 0.01), 100.0),
    )
    pi = np.asarray(modulation.stationary())
    levels = raw / float(pi @ raw)
    modulation.levels = [float(f"{v:.{GAP_SIGNIFICANT_DIGITS}g}") for v in levels]
    # Operational time under each window's own rate (the last, partial window keeps the
    # last one's): the gaps there hold the structure within a window.
    m = np.concatenate([x, [x[-1]]])
    starts = np.concatenate([[0.0], np.cumsum(m) * w])
    i = np.minimum((t // w).astype(np.int64), len(m) - 1)
    tau = starts[i] + (t - i * w) * m[i]
    return _renewal(np.diff(tau), rate, "renewal", modulation=modulation, windows=windows)


# ----------------------------------------------------------------------------- slow profile


def auto_slow_window_s(n: int, span_s: float) -> float | None:
    """The slow window ``auto`` uses: k = max(SLOW_MIN_WINDOWS, ceil(span / 300 s)) equal
    windows covering the span (rounded up to the ms), or None when they would be shorter
    than SLOW_MIN_WINDOW_S or than SLOW_FAST_RATIO burst windows (a trace too short to
    tell a trend from bursts)."""
    if not span_s > 0 or n < 3:
        return None
    k = max(SLOW_MIN_WINDOWS, math.ceil(span_s / SLOW_WINDOW_S))
    w = math.ceil(span_s / k * 1000.0) / 1000.0
    if w < SLOW_MIN_WINDOW_S or w < SLOW_FAST_RATIO * modulation_window_s(n, span_s):
        return None
    return w


def slow_rate_evidence(arrival_s: np.ndarray, window_s: float) -> dict[str, float]:
    """What ``auto`` decides the slow profile on: the index of dispersion D of the counts
    in whole windows of ``window_s`` and the threshold a Poisson process (D = 1, standard
    error sqrt(2 / (windows - 1))) exceeds with odds of about 1 in 1000:
    1 + SLOW_SIGMAS * sqrt(2 / (windows - 1))."""
    counts = window_counts(np.asarray(arrival_s, dtype=np.float64), window_s)
    k = len(counts)
    limit = 1.0 + SLOW_SIGMAS * math.sqrt(2.0 / max(k - 1, 1))
    return {"windows": float(k), "dispersion": dispersion(counts), "poisson_limit": limit}


def _slow_rate_significant(ev: dict[str, float]) -> bool:
    return ev["windows"] >= SLOW_MIN_WINDOWS - 1 and ev["dispersion"] > ev["poisson_limit"]


def fit_length_shift(tokens: np.ndarray, window: np.ndarray, k: int) -> list[float] | None:
    """Per window (index ``window`` of each request, 0..k-1) the normal-score shift d_i
    whose lengths Q(Phi(d_i + a e)) have the window's mean length (a = sqrt(1 - the
    count-weighted variance of the shifts), shrunk towards 0 by tau^2 / (tau^2 + 1/c_i)
    (c_i requests in the window, tau^2 the between-window variance of the windows' mean
    normal scores net of sampling noise). None with fewer than COPULA_MIN_REQUESTS
    requests or when the mean normal scores s_i show no drift: chi^2 = sum c_i s_i^2
    within SHIFT_SIGMAS standard deviations (sqrt(2 df)) of its mean df = nonempty
    windows - 1."""
    n = len(tokens)
    if n < COPULA_MIN_REQUESTS or k < 2:
        return None
    z = normal_scores(tokens)
    c = np.bincount(window, minlength=k).astype(np.float64)
    s = np.bincount(window, weights=z, minlength=k)
    d = np.divide(s, c, out=np.zeros(k), where=c > 0)
    df = int((c > 0).sum()) - 1
    chi2 = float(c @ (d * d))
    if df < 1 or not chi2 > df + SHIFT_SIGMAS * math.sqrt(2.0 * df):
        return None
    shrink = (chi2 - df) / n
    shrink = shrink / (shrink + 1.0 / np.where(c > 0, c, 1.0))
    # the shift that gives each window its own mean length (the mean score underrates a
    # window whose tail, not its body, is heavier)
    knots = _as_arrays(_fit_lengths(tokens))
    means = np.divide(np.bincount(window, weights=np.asarray(tokens, np.float64),
                                  minlength=k), c, out=np.zeros(k), where=c > 0)
    wgt = c / c.sum()
    for _ in range(2):  # the within-window scale a depends on all shifts
        a = math.sqrt(max(1.0 - float(wgt @ (d - wgt @ d) ** 2), 0.05))
        d = np.array([_shift_for_mean(knots, float(mu), a) if ci > 0 else 0.0
                      for mu, ci in zip(means, c, strict=True)])
    d = np.clip(d * shrink, -3.0, 3.0)
    return [round(float(v), 4) for v in d]


_GH_X, _GH_W = np.polynomial.hermite_e.hermegauss(80)
_GH_W = _GH_W / _GH_W.sum()


def _shift_for_mean(knots: tuple[np.ndarray, np.ndarray], mean: float, a: float) -> float:
    """The d whose lengths Q(Phi(d + a e)) (e standard normal) have mean ``mean``
    (Gauss-Hermite quadrature, bisection on [-3, 3])."""
    q, v = knots
    lo, hi = -3.0, 3.0
    for _ in range(40):
        mid = (lo + hi) / 2.0
        m = float(_GH_W @ np.interp(normal_cdf(mid + a * _GH_X), q, v))
        lo, hi = (mid, hi) if m < mean else (lo, mid)
    return (lo + hi) / 2.0


def within_window_correlation(r: float | None, window: np.ndarray,
                              shift: LengthShift) -> float | None:
    """The copula's r within windows, given the whole trace's r (``fit_length_correlation``):
    the sampler's normal scores z = d_i + a e have overall correlation
    cov_w(d_p, d_o) + a_p a_o r_within, which this sets equal to r (a drift of both
    lengths would otherwise count as dependence twice). None when r is None."""
    if r is None:
        return None
    k = int(window.max()) + 1
    c = np.bincount(window, minlength=k).astype(np.float64)
    dp, ap = LengthShift.centred(shift.prompt, c.tolist())
    do, ao = LengthShift.centred(shift.output, c.tolist())
    if ap * ao <= 0.0:
        # The windows' shifts carry all of a length's score variance: nothing is left
        # within a window to couple (a degenerate trace, e.g. one length per window).
        return 0.0
    within = (r - float((c / c.sum()) @ (dp * do))) / (ap * ao)
    return float(min(max(round(within, 4), -0.9999), 0.9999))


def _slow_windows(
    arrivals: np.ndarray, prompt: np.ndarray, output: np.ndarray, span: float,
    setting: float | str | None,
) -> tuple[np.ndarray | None, float | None, LengthShift | None]:
    """(multipliers, window_s, length shift) of one class, as documented."""
    if setting is None or setting == "none":
        return None, None, None
    rate_significant = True
    if setting == "auto":
        w = auto_slow_window_s(len(arrivals), span)
        if w is None:
            return None, None, None
        rate_significant = _slow_rate_significant(slow_rate_evidence(arrivals, w))
    else:
        w = float(setting)
    multipliers = _window_multipliers(arrivals, span, w)
    k = len(multipliers)
    idx = np.minimum((arrivals // w).astype(np.int64), k - 1)  # as the multipliers
    dp = fit_length_shift(prompt, idx, k)
    do = fit_length_shift(output, idx, k)
    shift = None if dp is None and do is None else LengthShift(prompt=dp, output=do)
    if not rate_significant:
        if shift is None:
            return None, None, None
        multipliers = np.ones(k)
    return multipliers, w, shift


def _most_common_priority(trace: Trace, idx: np.ndarray) -> int:
    if trace.priority is None or len(idx) == 0:
        return 0
    vals, counts = np.unique(trace.priority[idx], return_counts=True)
    return int(vals[counts.argmax()])


def _split_indices(
    trace: Trace, split: str | None, bands: int
) -> list[tuple[str, np.ndarray, int]]:
    """(class name, row indices, priority) per non-empty class."""
    n = len(trace)
    if split is None or split == "none":
        return [("default", np.arange(n), _most_common_priority(trace, np.arange(n)))]
    if split == "class":
        if trace.class_id is None:
            raise ServetuneError(
                f"{trace.source or 'trace'}: has no class column to split by; map one with "
                "argument `columns` ...,class=COLUMN or use argument `split` prompt-quantiles"
            )
        out = []
        for k, name in enumerate(trace.class_names):
            idx = np.flatnonzero(trace.class_id == k)
            if len(idx) == 0:
                continue
            out.append((str(name), idx, _most_common_priority(trace, idx)))
        return out
    if split in ("prompt-quantiles", "prompt_quantiles", "bands"):
        if not 1 <= bands <= MAX_BANDS:
            raise ServetuneError(
                f"argument `bands` must be between 1 and {MAX_BANDS} (got {bands}); each band "
                "becomes a class with its own length distributions"
            )
        edges = np.quantile(trace.prompt_tokens, np.arange(1, bands) / bands)
        band = np.searchsorted(edges, trace.prompt_tokens, side="left")
        out = []
        for b in range(bands):
            idx = np.flatnonzero(band == b)
            if len(idx) == 0:
                continue
            lo, hi = int(trace.prompt_tokens[idx].min()), int(trace.prompt_tokens[idx].max())
            out.append((f"prompt-{lo}-{hi}", idx, 0))
        return out
    raise ServetuneError(f"unknown split {split!r}; use class or prompt-quantiles")


def check_rate_scale(rate_scale: float, what: str = "argument `rate_scale`") -> None:
    """Fail unless ``rate_scale`` is a number in [MIN_RATE_SCALE, MAX_RATE_SCALE]."""
    if not (
        isinstance(rate_scale, int | float)
        and MIN_RATE_SCALE <= rate_scale <= MAX_RATE_SCALE
    ):
        raise ServetuneError(
            f"{what} must be a number from {MIN_RATE_SCALE:g} to {MAX_RATE_SCALE:g} "
            f"(got {rate_scale})"
        )


def fit_workload(
    trace: Trace,
    *,
    split: str | None = None,
    bands: int = 3,
    rate_windows_s: float | str | None = "auto",
    name: str = "workload",
    source: str = "",
    arrival_process: str = "auto",
    block_s: float = BLOCK_S,
    scale_by: str = "time",
) -> Workload:
    """Fit a Workload to ``trace`` (see the module docstring for the method).
    ``rate_windows_s``: "auto" (a slow rate profile and length drift where significant),
    None or "none" (stationary), or a window length in seconds (always a profile).
    ``arrival_process``: auto (the block bootstrap when the parametric fit misses the
    trace's bursts or long-prompt placement, else parametric), bootstrap, parametric
    (modulated when bursty, else renewal), renewal, modulated, poisson, gamma or
    empirical. ``block_s``: the bootstrap's block length, seconds. ``scale_by``: what a
    rate scale compresses when the trace has sessions (time or sessions, see
    :mod:`servetune.workloads.prefixes`)."""
    if arrival_process not in ARRIVAL_PROCESSES:
        raise ServetuneError(
            f"argument `arrival_process` must be one of {', '.join(ARRIVAL_PROCESSES)} "
            f"(got {arrival_process!r})"
        )
    if scale_by not in SCALE_BY:
        raise ServetuneError(
            f"argument `scale_by` must be one of {', '.join(SCALE_BY)} (got {scale_by!r})")
    if not (isinstance(block_s, int | float) and 0 < block_s < math.inf):
        raise ServetuneError(f"argument `block_s` must be > 0 seconds (got {block_s})")
    if isinstance(rate_windows_s, str) and rate_windows_s not in RATE_WINDOWS:
        raise ServetuneError(
            f"argument `rate_windows_s` must be auto, none or a window length in seconds "
            f"(got {rate_windows_s!r})"
        )
    n = len(trace)
    if n < 2 or trace.duration_s <= 0:
        raise ServetuneError(
            f"{trace.source or 'trace'}: needs at least 2 requests at different times to fit "
            f"an arrival rate (got {n} over {trace.duration_s:g} s)"
        )
    fixed = rate_windows_s if isinstance(rate_windows_s, int | float) else None
    if fixed is not None and not (fixed > 0 and math.isfinite(fixed)):
        raise ServetuneError(
            f"argument `rate_windows_s` must be > 0 seconds (got {rate_windows_s})"
        )
    span = trace.duration_s
    overall_rate = (n - 1) / span
    if fixed is not None and span / fixed > MAX_RATE_WINDOWS:
        raise ServetuneError(
            f"argument `rate_windows_s` {rate_windows_s:g} s makes "
            f"{span / rate_windows_s:.0f} windows over {span:g} s; use at most "
            f"{MAX_RATE_WINDOWS:,} (a longer window)"
        )
    classes: dict[str, WorkloadClass] = {}
    class_index = np.zeros(n, dtype=np.int32)
    # the classes keep their parametric fit under the bootstrap (the models read it)
    class_process = ("auto" if arrival_process in ("auto", "bootstrap", "parametric")
                     else arrival_process)
    try:
        for cname, idx, prio in _split_indices(trace, split, bands):
            class_index[idx] = len(classes)
            arrivals = trace.arrival_s[idx]
            prompt, output = trace.prompt_tokens[idx], trace.output_tokens[idx]
            multipliers, window_s, shift = _slow_windows(
                arrivals, prompt, output, span, rate_windows_s)
            r = fit_length_correlation(prompt, output)
            if shift is not None and window_s is not None and multipliers is not None:
                r = within_window_correlation(r, np.minimum(
                    (arrivals // window_s).astype(np.int64), len(multipliers) - 1), shift)
            classes[cname] = WorkloadClass(
                priority=prio,
                arrival=_fit_arrival(
                    arrivals, overall_rate * len(idx) / n, multipliers, window_s,
                    class_process,
                ),
                length_shift=shift,
                prompt_tokens=_fit_lengths(prompt),
                output_tokens=_fit_lengths(output),
                prompt_output_correlation=r,
            )
        parametric = Workload(name=name, source=source, duration_s=round(span, 6),
                              classes=classes)
        stats = (reuse_stats(trace) if trace.prefix_block_ids is not None
                 and len(trace.prefix_block_ids) else None)
        prefix = None if stats is None else fit_prefix_reuse(trace, stats)
        sessions = prefix is not None and prefix.sessions is not None
        boot = None
        turns = None  # the parametric fit's first turns, where rule 4 reads them
        if arrival_process in ("auto", "bootstrap"):
            held = None  # the share of later turns parametric first turns' sessions hold
            if sessions and arrival_process == "auto":
                turns = _first_turns(parametric, prefix, span)
                held = later_turns_held(prefix, turns, trace, 0.0)
            boot = _block_bootstrap(trace, parametric,
                                    class_index if len(classes) > 1 else None,
                                    rate_windows_s, float(block_s),
                                    force=arrival_process == "bootstrap",
                                    later_turn=None if stats is None else stats.continues,
                                    later_turns_held=held)
        workload = Workload(name=name, source=source, duration_s=round(span, 6),
                            classes=classes, block_bootstrap=boot)
        if prefix is None:
            return workload
        if sessions:
            if boot is not None or turns is None:  # the samples' own first turns
                turns = _first_turns(workload, prefix, span)
            prefix = with_scale_by(calibrate(prefix, trace, turns), scale_by)
        return workload.model_copy(update={"prefix_reuse": prefix})
    except ValidationError as err:
        where = trace.source or "trace"
        raise ServetuneError(
            format_validation_error(err, f"{where}: cannot fit a workload")
        ) from None


def _first_turns(workload: Workload, model: PrefixReuse, span: float) -> FirstTurns:
    """The first turns of CALIBRATION_SEEDS samples of ``workload`` over ``span`` seconds
    (its requests that stand for later turns left out)."""
    out = []
    for seed in range(CALIBRATION_SEEDS):
        t, _, p, o, later = _sample_stream(workload, n_requests=None, horizon=span, seed=seed,
                                           rate_scale=1.0)
        if later is None:
            later = later_turn_mask(model, p, seed=seed)
        out.append((t[~later], p[~later], o[~later]))
    return out


def with_scale_by(model: PrefixReuse, scale_by: str) -> PrefixReuse:
    """``model`` whose sessions scale by ``scale_by`` (time or sessions)."""
    assert model.sessions is not None
    return model.model_copy(update={"sessions": model.sessions.model_copy(
        update={"scale_by": scale_by})})


def workload_scaled_by(workload: Workload, scale_by: str) -> Workload:
    """``workload`` with its sessions scaling by ``scale_by`` (``--scale-by``); an error
    when it has no sessions or the value is not one of SCALE_BY."""
    if scale_by not in SCALE_BY:
        raise ServetuneError(
            f"--scale-by must be one of {', '.join(SCALE_BY)} (got {scale_by!r})")
    model = workload.prefix_reuse
    if model is None or model.sessions is None:
        raise ServetuneError(
            "--scale-by applies to a workload with sessions (prefix_reuse.sessions, fitted from "
            f"a trace with prefix ids); workload {workload.name!r} has none")
    return workload.model_copy(update={"prefix_reuse": with_scale_by(model, scale_by)})


# ----------------------------------------------------------------------------- bootstrap


def bootstrap_stratum_s(span_s: float, block_s: float,
                        rate_windows_s: float | str | None = "auto") -> float | None:
    """The bootstrap's stratum: the slow windows (``auto``: max(SLOW_MIN_WINDOWS,
    ceil(span / 5 min)) equal windows, or 2 blocks where those are shorter and the span
    holds 4 blocks; a number: that window; None/"none": the whole trace) rounded to whole
    blocks; None when that is fewer than 2 blocks (nothing to permute)."""
    if rate_windows_s is None or rate_windows_s == "none":
        per = math.ceil(span_s / block_s)
    elif rate_windows_s == "auto":
        window = span_s / max(SLOW_MIN_WINDOWS, math.ceil(span_s / SLOW_WINDOW_S))
        per = bootstrap.blocks_per_stratum(window, block_s)
        if per < 2 and span_s >= 4 * block_s:  # a short trace: strata of 2 blocks
            per = 2
    else:
        per = bootstrap.blocks_per_stratum(float(rate_windows_s), block_s)
    return per * block_s if per >= 2 else None


def variance_time_windows(span_s: float) -> list[float]:
    """VT_MIN_WINDOW_S, doubling, while the span holds VT_MIN_WINDOWS of them."""
    out, w = [], VT_MIN_WINDOW_S
    while span_s / w >= VT_MIN_WINDOWS:
        out.append(w)
        w *= 2.0
    return out


def bootstrap_evidence(trace: Trace, parametric: Workload, block_s: float,
                       stratum_s: float) -> dict[str, Any]:
    """What ``auto`` decides the bootstrap on (see the module docstring), given the
    ``parametric`` fit (its classes; a bootstrap section is ignored): whether a class
    is Markov-modulated (the burst test fired); the variance-time curves of the trace and
    of the parametric fit (median of VT_SEEDS seeded samples of as many requests) and
    the worst excess of |log ratio| over its band; the longest prompts' counts per
    stratum against a binomial (chi-square and its limit)."""
    t = trace.arrival_s
    span = trace.duration_s
    n = len(trace)
    parametric = parametric.model_copy(update={"block_bootstrap": None})
    samples = [sample_trace(parametric, n_requests=n, seed=s).arrival_s
               for s in range(VT_SEEDS)]
    curve = []
    for w in variance_time_windows(span):
        counts = window_counts(t, w)
        d_trace = dispersion(counts)
        d_fit = float(np.median([dispersion(window_counts(a, w)) for a in samples]))
        band = math.log(VT_FACTOR) + VT_SIGMAS * math.sqrt(4.0 / max(len(counts) - 1, 1))
        excess = (abs(math.log(d_trace / d_fit)) - band
                  if d_trace > 0 and d_fit > 0 else -math.inf)
        curve.append({"window_s": w, "trace": d_trace, "fit": d_fit, "excess": excess})
    nb = max(1, math.ceil(span / block_s))
    stratum = (np.minimum((t // block_s).astype(np.int64), nb - 1)
               // bootstrap.blocks_per_stratum(stratum_s, block_s))
    prompt = trace.prompt_tokens
    top = prompt >= np.quantile(prompt, 1.0 - TOP_PROMPT_SHARE)
    in_stratum = np.bincount(stratum).astype(np.float64)
    used = in_stratum > 0
    df = int(used.sum()) - 1
    chi2, limit = 0.0, math.inf
    if top.sum() >= TOP_MIN_REQUESTS and df >= 1:
        expect = top.sum() * in_stratum[used] / n
        got = np.bincount(stratum[top], minlength=len(in_stratum))[used]
        chi2 = float(((got - expect) ** 2 / expect).sum())
        limit = df + TOP_SIGMAS * math.sqrt(2.0 * df)
    worst = max(curve, key=lambda c: c["excess"], default=None)
    return {
        "modulated": any(c.arrival.modulation is not None
                         for c in parametric.classes.values()),
        "variance_time": curve,
        "variance_time_misfit": worst is not None and worst["excess"] > 0,
        "top_prompts": int(top.sum()),
        "top_prompt_chi2": chi2,
        "top_prompt_limit": limit,
        "top_prompts_clustered": chi2 > limit,
    }


def _bootstrap_chosen(ev: dict[str, Any]) -> bool:
    return bool(ev["modulated"] or ev["variance_time_misfit"] or ev["top_prompts_clustered"]
                or ev.get("sessions_change_over_time", False))


def _block_bootstrap(trace: Trace, parametric: Workload, class_index: np.ndarray | None,
                     rate_windows_s: float | str | None, block_s: float,
                     force: bool, later_turn: np.ndarray | None = None,
                     later_turns_held: float | None = None) -> BlockBootstrap | None:
    """The bootstrap section when ``auto`` chooses it (or ``force``), else None.
    ``later_turns_held``: the share of the trace's later turns that sessions replayed
    from the parametric fit's first turns hold (rule 4; None: no sessions)."""
    span = trace.duration_s
    stratum_s = bootstrap_stratum_s(span, block_s, rate_windows_s)
    if stratum_s is None:
        if force:
            if rate_windows_s is None or rate_windows_s == "none":
                strata = f"one stratum, the trace's {span:g} s"
            elif rate_windows_s == "auto":
                k = max(SLOW_MIN_WINDOWS, math.ceil(span / SLOW_WINDOW_S))
                strata = f"the trace's {k} slow windows of {span / k:.4g} s"
            else:
                strata = f"argument `rate_windows_s` {float(rate_windows_s):g} s"
            raise ServetuneError(
                f"{trace.source or 'trace'}: a block bootstrap needs strata of at least 2 "
                f"blocks of {block_s:g} s (here: {strata}); use argument `arrival_process` "
                "auto or parametric, or longer argument `rate_windows_s`")
        return None
    if not force:
        evidence = bootstrap_evidence(trace, parametric, block_s, stratum_s)
        if later_turns_held is not None:
            evidence["later_turns_held"] = later_turns_held
            evidence["sessions_change_over_time"] = later_turns_held < MIN_LATER_TURNS_HELD
        if not _bootstrap_chosen(evidence):
            return None
    boot = bootstrap.fit_block_bootstrap(trace, class_index, block_s, stratum_s,
                                         later_turn=later_turn)
    if boot is None and force:
        raise ServetuneError(
            f"{trace.source or 'trace'}: one stratum of {stratum_s:g} s holds more than "
            f"{bootstrap.MAX_BOOTSTRAP_REQUESTS:,} requests, too many to store; use argument "
            "`arrival_process` auto or parametric")
    return boot


def arrival_model(workload: Workload) -> str:
    """One line on how a sample's arrivals are made."""
    if workload.block_bootstrap is not None:
        return bootstrap.describe(workload.block_bootstrap)
    return "parametric (per class)"


# ----------------------------------------------------------------------------- sampling


class _LevelPath:
    """A modulation's level path as runs: a level held for a geometric number of windows
    (``Geometric(1 - P[a][a])``, the holding time of the one-step chain), then a jump to
    another level ``b`` with probability ``P[a][b] / (1 - P[a][a])``; started from the
    stationary distribution, drawn from its own generator as far as the operational time
    (unit mean rate) asked for, and mapped to seconds. A run costs the same whatever its
    length, so a quiet level held for thousands of windows (a low rate in short windows)
    costs no more than one held for one."""

    def __init__(self, mod: RateModulation, rate: float, seed: np.random.SeedSequence):
        self.gen = np.random.Generator(np.random.PCG64(seed))
        pi = np.asarray(mod.stationary())
        m = np.asarray(mod.levels, dtype=np.float64)
        self.m = m / float(pi @ m)
        p = np.asarray(mod.transitions, dtype=np.float64)
        p = p / p.sum(axis=1, keepdims=True)
        self.stay = np.diag(p).copy()
        jump = p.copy()
        np.fill_diagonal(jump, 0.0)
        self.cum_jump = np.cumsum(jump, axis=1) / np.maximum(jump.sum(axis=1), 1e-300)[:, None]
        for a, row in enumerate(jump):  # rounding must not leave a draw past the last target
            targets = np.flatnonzero(row > 0)
            if len(targets):
                self.cum_jump[a, targets[-1]:] = np.inf
        self.cum_pi = np.cumsum(pi)
        self.cum_pi[-1] = np.inf
        self.w = mod.window_s
        self.rate = rate
        self.run_levels: list[int] = []
        self.run_windows: list[float] = []  # inf: a level never left
        self.op_end = 0.0  # operational time at the end of the last run

    def _next_run(self) -> None:
        u = self.gen.random()
        row = self.cum_jump[self.run_levels[-1]] if self.run_levels else self.cum_pi
        level = int(np.searchsorted(row, u, side="right"))
        stay = self.stay[level]
        windows = (math.inf if stay >= 1.0 else
                   1.0 if stay <= 0.0 else float(self.gen.geometric(1.0 - stay)))
        if self.m[level] > 0:
            self.op_end += windows * self.m[level] * self.w * self.rate
        elif windows == math.inf:  # the schema rejects such a chain; never loop forever
            raise ServetuneError("a rate modulation reached a level with rate 0 that it "
                                 "never leaves: no more arrivals would come")
        self.run_levels.append(level)
        self.run_windows.append(windows)

    def seconds(self, tau: np.ndarray) -> np.ndarray:
        while self.op_end < tau[-1]:
            self._next_run()
        levels = np.asarray(self.run_levels)
        windows = np.asarray(self.run_windows)
        rate_m = self.rate * self.m[levels]
        op = np.where(rate_m > 0, windows * self.w * rate_m, 0.0)
        ends = np.concatenate([[0.0], np.cumsum(op)])
        first_window = np.concatenate([[0.0], np.cumsum(windows[:-1])])
        # the run with ends[i] < tau <= ends[i+1] has a positive rate
        i = np.clip(np.searchsorted(ends, tau, side="left") - 1, 0, len(levels) - 1)
        inside = np.where(rate_m[i] > 0, (tau - ends[i]) / np.where(rate_m[i] > 0, rate_m[i], 1),
                          0.0)
        return first_window[i] * self.w + np.minimum(inside, windows[i] * self.w)


class _ClassStream:
    """One class's requests, generated CHUNK at a time from its own generators."""

    def __init__(self, cls: WorkloadClass, seed_seq: np.random.SeedSequence, rate_scale: float):
        gap_seed, prompt_seed, output_seed = seed_seq.spawn(3)
        self.gen_gap = np.random.Generator(np.random.PCG64(gap_seed))
        self.gen_prompt = np.random.Generator(np.random.PCG64(prompt_seed))
        self.gen_output = np.random.Generator(np.random.PCG64(output_seed))
        arrival = cls.arrival
        self.rate = arrival.rate_per_s * rate_scale
        self.cv = arrival.interarrival_cv
        self.process = arrival.process
        self.gap_knots = None
        if arrival.interarrival_gaps is not None:
            q = np.asarray(arrival.interarrival_gaps.quantiles, dtype=np.float64)
            v = np.asarray(arrival.interarrival_gaps.values, dtype=np.float64)
            mean, _ = arrival.interarrival_gaps.moments()
            self.gap_knots = (q, v / mean)  # unit mean in operational time
        self.windows = None
        self.time_scale = 1.0
        if arrival.windows is not None:
            m = np.asarray(arrival.windows.rate_multipliers, dtype=np.float64)
            m = m / m.mean()
            w = arrival.windows.window_s
            # mean-rate seconds Lambda(t) at each window start (one period)
            self.windows = (m, w, np.concatenate([[0.0], np.cumsum(m) * w]))
        self.path = None
        if arrival.modulation is not None:
            self.path = _LevelPath(arrival.modulation, arrival.rate_per_s, seed_seq.spawn(1)[0])
        if self.windows is not None or self.path is not None:
            # rate_scale compresses the time axis (the slow profile's too), as scaling a
            # trace replay does: times are made at scale 1, then divided by rate_scale
            self.rate = arrival.rate_per_s
            self.time_scale = 1.0 / rate_scale
        self.shift = None
        if cls.length_shift is not None and arrival.windows is not None:
            mult = arrival.windows.rate_multipliers
            self.shift = (LengthShift.centred(cls.length_shift.prompt, mult),
                          LengthShift.centred(cls.length_shift.output, mult))
        self.prompt = _as_arrays(cls.prompt_tokens)
        self.output = _as_arrays(cls.output_tokens)
        self.rho = cls.prompt_output_correlation
        self.op_time = 0.0
        self.times: list[np.ndarray] = []
        self.prompts: list[np.ndarray] = []
        self.outputs: list[np.ndarray] = []

    @property
    def last_s(self) -> float:
        return float(self.times[-1][-1]) if self.times else 0.0

    def _to_seconds(self, tau: np.ndarray) -> np.ndarray:
        """Operational time -> seconds at rate scale 1 (plain processes: at the scaled
        rate, time_scale 1)."""
        s1 = self.path.seconds(tau) if self.path is not None else tau / self.rate
        if self.windows is None:
            return s1
        # invert Lambda (mean-rate seconds -> seconds) of the periodic slow profile
        m, w, cum = self.windows
        k = len(m)
        per_period = cum[-1]
        p, r = np.divmod(s1, per_period)
        i = np.clip(np.searchsorted(cum, r, side="right") - 1, 0, k - 1)
        # the last window may have rate 0 and r may sit exactly on its start
        positive = np.flatnonzero(m > 0)
        i = np.where(m[i] > 0, i, positive[np.searchsorted(positive, i, side="right") - 1])
        return p * (k * w) + i * w + (r - cum[i]) / m[i]

    @staticmethod
    def _lengths(u: np.ndarray, qv: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        x = np.interp(u, qv[0], qv[1])
        return np.maximum(np.rint(x), 1).astype(np.int64)

    def _length_uniforms(self) -> tuple[np.ndarray, np.ndarray]:
        """CHUNK (prompt, output) probability pairs: independent uniforms, or through the
        Gaussian copula (normal scores from each length's own generator)."""
        if self.rho is None:
            return self.gen_prompt.random(CHUNK), self.gen_output.random(CHUNK)
        zp = self.gen_prompt.standard_normal(CHUNK)
        zo = self.rho * zp + math.sqrt(1.0 - self.rho * self.rho) * self.gen_output.standard_normal(
            CHUNK)
        return normal_cdf(zp), normal_cdf(zo)

    def _shifted_uniforms(self, t1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(prompt, output) probabilities with the slow window's normal-score shifts:
        z = d_i + a e (e the copula's normal scores), window i of each arrival time."""
        assert self.shift is not None and self.windows is not None
        (dp, ap), (do, ao) = self.shift
        _, w, _ = self.windows
        i = (t1 // w).astype(np.int64) % len(dp)
        ep = self.gen_prompt.standard_normal(len(t1))
        eo = self.gen_output.standard_normal(len(t1))
        if self.rho is not None:
            eo = self.rho * ep + math.sqrt(1.0 - self.rho * self.rho) * eo
        return normal_cdf(dp[i] + ap * ep), normal_cdf(do[i] + ao * eo)

    def extend(self) -> None:
        if self.process == "poisson":
            gaps = self.gen_gap.exponential(1.0, CHUNK)
        elif self.gap_knots is not None:
            gaps = np.interp(self.gen_gap.random(CHUNK), *self.gap_knots)
        else:
            shape = 1.0 / (self.cv * self.cv)
            gaps = self.gen_gap.gamma(shape, 1.0 / shape, CHUNK)
        tau = self.op_time + np.cumsum(gaps)
        self.op_time = float(tau[-1])
        t1 = self._to_seconds(tau)
        self.times.append(t1 * self.time_scale if self.time_scale != 1.0 else t1)
        up, uo = (self._length_uniforms() if self.shift is None
                  else self._shifted_uniforms(t1))
        self.prompts.append(self._lengths(up, self.prompt))
        self.outputs.append(self._lengths(uo, self.output))

    def upto(self, horizon_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        t = np.concatenate(self.times)
        keep = t <= horizon_s
        return t[keep], np.concatenate(self.prompts)[keep], np.concatenate(self.outputs)[keep]

    def count_upto(self, horizon_s: float) -> int:
        return int(sum(np.searchsorted(c, horizon_s, side="right") for c in self.times))


def sample_trace(
    workload: Workload,
    *,
    n_requests: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
    rate_scale: float = 1.0,
) -> Trace:
    """Draw a trace from ``workload``: the first ``n_requests`` arrivals and/or those within
    ``duration_s`` seconds (default: the workload's ``duration_s``, else one hour).
    Deterministic for a seed."""
    if n_requests is not None and n_requests < 1:
        raise ServetuneError(f"number of requests to sample must be >= 1 (got {n_requests})")
    if duration_s is not None and not (duration_s > 0 and math.isfinite(duration_s)):
        raise ServetuneError(f"sampling duration must be > 0 seconds (got {duration_s})")
    check_rate_scale(rate_scale, "rate scale")
    if n_requests is None and duration_s is None:
        duration_s = workload.duration_s or DEFAULT_DURATION_S
    expected = (
        n_requests if duration_s is None
        else workload.total_rate_per_s * rate_scale * duration_s
    )
    if n_requests is not None:
        expected = min(expected, n_requests)
    if expected > MAX_SAMPLE_REQUESTS:
        raise ServetuneError(
            f"sampling workload {workload.name!r} would draw about {expected:.3g} requests "
            f"(more than {MAX_SAMPLE_REQUESTS:,}); sample fewer requests or a shorter duration"
        )
    horizon = math.inf if duration_s is None else float(duration_s)
    model = workload.prefix_reuse
    if model is not None and model.sessions is not None:
        arrival, class_id, prompt, output, parent = _sample_sessions(
            workload, model, n_requests=n_requests, horizon=horizon, seed=seed,
            rate_scale=rate_scale)
    else:
        arrival, class_id, prompt, output, _ = _sample_stream(
            workload, n_requests=n_requests, horizon=horizon, seed=seed,
            rate_scale=rate_scale)
        parent = None
    if len(arrival) == 0:
        raise ServetuneError(
            f"sampling {duration_s:g} s of workload {workload.name!r} produced no requests; "
            "sample a longer duration or more requests"
        )
    priorities = np.array([c.priority for c in workload.classes.values()], dtype=np.int32)
    trace = from_arrays(
        arrival,
        prompt,
        output,
        class_id=class_id,
        class_names=workload.class_names,
        priority=priorities[class_id],
        source=f"workload:{workload.name} seed={seed}",
    )
    if model is None:
        return trace
    offsets, ids = assign_prefix_ids(model, trace.arrival_s, trace.prompt_tokens,
                                     trace.output_tokens, parent, seed=seed,
                                     rate_scale=rate_scale, cycle_s=workload.duration_s)
    return dataclasses.replace(trace, prefix_offsets=offsets, prefix_block_ids=ids,
                               prefix_block_tokens=model.block_tokens)


def _sample_stream(
    workload: Workload, *, n_requests: int | None, horizon: float, seed: int,
    rate_scale: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """(arrival, class index, prompt, output, later-turn mask or None) from the bootstrap
    or the classes: the first ``n_requests`` (None: all) up to ``horizon`` seconds."""
    if workload.block_bootstrap is not None:
        return bootstrap.sample_blocks(
            workload.block_bootstrap, seed=seed, n_requests=n_requests, horizon_s=horizon,
            rate_scale=rate_scale)
    return *_sample_classes(workload, n_requests=n_requests, horizon=horizon, seed=seed,
                            rate_scale=rate_scale), None


def _sample_sessions(
    workload: Workload, model: PrefixReuse, *, n_requests: int | None, horizon: float,
    seed: int, rate_scale: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(arrival, class index, prompt, output, parent) of a sample made of sessions
    (:mod:`servetune.workloads.prefixes`): the stream's first turns and their later turns,
    the first ``n_requests`` up to ``horizon``. The stream is drawn to a length whose
    sessions hold ``n_requests`` (doubling); everything up to the stream's last arrival
    is complete, since a later turn comes after its first turn."""
    want = n_requests
    max_prompt = int(max(distribution_quantile(c.prompt_tokens, 1.0)
                         for c in workload.classes.values()))
    while True:
        arrival, class_id, prompt, output, later = _sample_stream(
            workload, n_requests=want, horizon=horizon, seed=seed, rate_scale=rate_scale)
        complete = want is None or len(arrival) < want
        end = horizon if complete else float(arrival[-1])
        if later is None:
            later = later_turn_mask(model, prompt, seed=seed)
        first = ~later
        out = grow_sessions(model, arrival[first], class_id[first], prompt[first],
                            output[first], seed=seed, rate_scale=rate_scale, end_s=end,
                            max_prompt_tokens=max(max_prompt, int(prompt.max(initial=1))),
                            cycle_s=workload.duration_s)
        if complete or len(out[0]) >= n_requests:
            if n_requests is None or len(out[0]) <= n_requests:
                return out
            parent = out[4][:n_requests]
            return (*(x[:n_requests] for x in out[:4]), parent)
        want = max(2 * want, want + 16)


def _sample_classes(
    workload: Workload, *, n_requests: int | None, horizon: float, seed: int,
    rate_scale: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(arrival, class index, prompt, output) from the classes' own streams, merged in
    time order: the first ``n_requests`` (None: all) up to ``horizon`` seconds."""
    root = np.random.SeedSequence(int(seed) & 0xFFFFFFFFFFFFFFFF)
    streams = [
        _ClassStream(cls, s, rate_scale)
        for cls, s in zip(workload.classes.values(), root.spawn(len(workload.classes)),
                          strict=True)
    ]
    for s in streams:
        s.extend()
    if math.isfinite(horizon):
        for s in streams:
            while s.last_s < horizon:
                s.extend()
    if n_requests is not None:
        # Grow the stream that ends first until the merged prefix holds n requests.
        while True:
            known = min(s.last_s for s in streams)
            if min(known, horizon) == horizon or sum(
                s.count_upto(known) for s in streams
            ) >= n_requests:
                horizon = min(known, horizon)
                break
            min(streams, key=lambda s: s.last_s).extend()
    parts = [s.upto(horizon) for s in streams]
    arrival = np.concatenate([p[0] for p in parts])
    prompt = np.concatenate([p[1] for p in parts])
    output = np.concatenate([p[2] for p in parts])
    class_id = np.concatenate(
        [np.full(len(p[0]), k, dtype=np.int32) for k, p in enumerate(parts)]
    )
    order = np.argsort(arrival, kind="stable")
    if n_requests is not None:
        order = order[:n_requests]
    return arrival[order], class_id[order], prompt[order], output[order]


# ----------------------------------------------------------------------------- YAML


class _FlowListDumper(yaml.SafeDumper):
    """Block style, except lists of numbers, which go on one (wrapped) line."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = bool(data) and all(isinstance(x, int | float) and not isinstance(x, bool)
                              for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_FlowListDumper.add_representer(list, _represent_list)


def workload_to_yaml(workload: Workload, *, header: str = "") -> str:
    data = workload.model_dump(mode="json", exclude_none=True)
    text = yaml.dump(
        data, Dumper=_FlowListDumper, sort_keys=False, default_flow_style=False, width=100
    )
    if header:
        text = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + text
    return text


def save_workload(
    workload: Workload, path: str | os.PathLike[str], *, header: str = ""
) -> None:
    """Write ``workload`` as YAML atomically (numeric lists in flow style)."""
    write_text_atomic(path, workload_to_yaml(workload, header=header))


def load_workload(path: str | os.PathLike[str]) -> Workload:
    """Load and validate a Workload YAML file."""
    return load_document(path, Workload)
