"""Workload: request classes, each with an arrival process and length distributions.

A workload is what servetune optimizes for. Each class (keyed by name; the key order is
the class index a sampled trace uses) has

- ``priority``: lower is served first (vLLM's convention), used by ``scheduling: priority``;
- ``arrival``: a renewal process with mean ``rate_per_s``. ``poisson`` has exponential
  inter-arrival gaps (CV 1); ``gamma`` has gamma-distributed gaps whose coefficient of
  variation is ``interarrival_cv`` (> 1 bursty, < 1 regular); ``empirical`` draws each gap
  by inverse CDF from quantile knots ``interarrival_gaps`` (a trace's own gaps, in units of
  their mean: the sampler divides the knots by their piecewise-linear mean and by the
  rate, so the mean gap is exactly ``1 / rate_per_s``). ``empirical`` keeps the shape a
  moment-matched gamma cannot: a gamma with CV 13 has shape 1/169 and puts most gaps at
  (numerically) zero, while a real bursty trace has few tiny gaps and a long tail of idle
  gaps. Its ``interarrival_cv`` is the knots' CV (computed when omitted; when given it
  must agree within 1%), so readers of the CV see the same number. Optional ``windows`` make
  the rate piecewise constant: window ``i`` (of ``window_s`` seconds, repeating after the
  last one) runs at ``rate_per_s * rate_multipliers[i] / mean(rate_multipliers)``, so
  ``rate_per_s`` stays the mean rate. The gaps are drawn in "operational time" (unit
  rate) and mapped through the inverse cumulative rate, so the CV describes burstiness
  that the windows do not already explain. Optional ``modulation`` makes the rate a
  Markov chain over windows: each window of ``window_s``
  seconds runs at ``rate_per_s * levels[k] / sum(pi * levels)`` where ``k`` is the
  chain's state and ``pi`` the stationary distribution of the row-stochastic
  ``transitions`` matrix (``transitions[a][b]`` = probability that the window after one
  at level ``a`` is at level ``b``). It keeps the sustained bursts (seconds to minutes)
  that i.i.d. gaps cannot: the gaps above are then drawn in the modulated operational
  time. Its ``gap_cv`` is the CV of the gaps in seconds (what queueing formulas read;
  computed from the levels when omitted, see ``RateModulation``). Both together make a
  two-timescale rate: the chain runs in the operational time of the (slow) windows, so
  the bursts ride on the windows' profile (rate ``rate_per_s * m_i * level``);
- ``prompt_tokens`` / ``output_tokens``: empirical length distributions as quantile knots,
  ``values[i]`` = the ``quantiles[i]`` quantile. Sampling inverts this CDF with linear
  interpolation between knots and rounds to an integer >= 1. A fitted workload uses a grid
  that is dense in the tail, so p50, p90, p99 and the maximum are knots and are kept
  exactly; a hand-written one may use a few knots (``[0, 0.5, 0.99, 1]``).
- ``prompt_output_correlation`` (optional): couples a request's two lengths by a
  Gaussian copula. The sampler draws normal scores z_p and z_o = r z_p + sqrt(1 - r^2) e
  (e an independent standard normal) and inverts the two CDFs above at Phi(z_p), Phi(z_o),
  so the marginals stay exactly as given and r is the correlation of the normal scores.
  Absent (or 0), the lengths are independent. Long-context traces need it: in the
  Mooncake trace the longest prompts come with short outputs (rank correlation -0.52).
- ``length_shift`` (optional, needs ``arrival.windows``): the length mix following the
  slow rate profile. ``prompt[i]`` (``output[i]``) shifts the normal score of a length
  drawn in window ``i``: z = d_i + sqrt(1 - s^2) e, e standard normal, where d is the
  list centred on its arrival-weighted mean (weights ``rate_multipliers``) and s^2 its
  weighted variance (must be < 1), and the length is the quantile at Phi(z). Over all
  windows z has mean 0 and variance 1, so the marginal stays (close to) the knots above
  while window ``i``'s lengths sit d_i standard deviations (in normal scores) higher.

A class's share of traffic is its rate over the sum of rates (``class_stats``).

Optional ``block_bootstrap`` (workload level, written by ``servetune workload fit`` when a
trace's bursts or the placement of its longest prompts do not fit the classes' parametric
model): the trace's own requests, to be resampled instead of drawn from the classes. The
trace's span ``span_s`` is cut into blocks of ``block_s`` seconds from its first arrival
(the last block keeps its own, shorter length), consecutive groups of ``stratum_s /
block_s`` blocks form the strata, and per request, in block order (``block_counts[b]``
requests in block ``b``), its arrival ``offset_s`` from its block's start, its class
(``class_index``, a position in ``classes``; needed with more than one class) and its
``prompt_tokens`` and ``output_tokens``. A sample lays the strata out in order, each
one's blocks in a random order, each block at its own length with its requests at their
offsets, and repeats that with a new order per cycle of ``span_s`` seconds. The classes'
own fields stay: the optimizer's models read them. While the section is there, a sample
comes from it alone (a rate scale still compresses its times): to sample edited class
rates or lengths, remove it.

Optional ``prefix_reuse`` (workload level, written by ``servetune workload fit`` when the
trace has prefix block ids: Mooncake ``hash_ids`` or a session column): how requests
share prompt prefixes, so a sample carries chain-hash block ids
(``Trace.prefix_block_ids``: block ``m`` names a request's first ``(m + 1) *
block_tokens`` tokens) whose reuse, and how soon it comes, is the trace's. Requests fall
into bands of prompt length (``prompt_band_edges``). With ``sessions``, a sample is made
of sessions: the classes (or the bootstrap) give the first turns (a request of band ``b``
is a later turn, and left out, with probability ``sessions.later_turn_share[b]``; the
bootstrap knows which of its requests were later turns, ``later_turns``), and each first
turn replays the later turns of a donor: one of the fitted trace's sessions (listed in
``sessions``: each one's first prompt, time left to the trace's end, and per later turn
its parent, time after the first turn, prompt tokens beyond the first turn's covered
tokens and output), drawn among the few of its band watched at least as long as the first
turn has left in its cycle, its times drawn in by ``sessions.time_left_exponent`` where
the donor was watched longer. A later turn shares its parent's blocks up to its own
prompt. The arrivals of later turns thus come from the session
structure, and the reuse distances with them (:mod:`servetune.workloads.prefixes`).
``sessions.scale_by`` says what a rate scale compresses: ``time`` (every gap, think times
too: the same sessions, faster; the hit-rate curve against cache size stays the trace's)
or ``sessions`` (more sessions at once, each as slow as in the trace).
``system_prompts.share[b]`` of first turns start with a shared system prompt: one of
``system_prompts.tokens`` that leaves it ``system_prompts.own_tokens`` prompt tokens
(between their 1% and 99% quantiles), weighted by the uses it has left in the cycle
(``system_prompts.sessions`` at the cycle's start; when those that fit are used up, by
``system_prompts.sessions`` again), so uses spread over the cycle as in the trace; it
shares its blocks with every other user of that prompt (new ids for each prompt in each
``duration_s``-long cycle of a longer sample, as a longer trace would show new prompts).
Everything else gets new ids. No sample re-sends more than ``trace_reuse_ratio`` of its
block references (the fitted trace's infinite-cache bound), at any point.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal, get_args

import numpy as np
from pydantic import Field, field_validator, model_validator

from servetune.schemas.base import Document, Strict

MAX_TOKENS_BOUND = 10_000_000  # no request length beyond this is plausible; catches typos
# No serving deployment sees a million requests a second; beyond, arrival times lose
# their precision (a 1e300 rate makes every gap denormal), so it is a typo.
MAX_RATE_PER_S = 1e6


def _check_grid(q: list[float]) -> list[float]:
    if any(not math.isfinite(x) for x in q):
        raise ValueError("quantiles must be finite numbers")
    if q[0] != 0.0 or q[-1] != 1.0:
        raise ValueError("quantiles must start at 0 and end at 1")
    if any(b <= a for a, b in zip(q, q[1:], strict=False)):
        raise ValueError("quantiles must be strictly increasing")
    return q


def knot_moments(quantiles: list[float], values: list[float]) -> tuple[float, float]:
    """Mean and CV of the piecewise-linear quantile function through the knots: on a piece
    from (q0, a) to (q1, b), E[X] gains (q1-q0)(a+b)/2 and E[X^2] gains (q1-q0)(a^2+ab+b^2)/3."""
    # Work on values scaled to a maximum of 1: the CV does not depend on the scale, and
    # tiny or huge knots would otherwise underflow or overflow mean**2.
    scale = max((abs(v) for v in values), default=0.0)
    if not scale > 0:
        return 0.0, 0.0
    mean = second = 0.0
    for q0, q1, a, b in zip(quantiles, quantiles[1:], values, values[1:], strict=False):
        a, b = a / scale, b / scale
        mean += (q1 - q0) * (a + b) / 2.0
        second += (q1 - q0) * (a * a + a * b + b * b) / 3.0
    if mean <= 0:
        return mean * scale, 0.0
    return mean * scale, math.sqrt(max(second / (mean * mean) - 1.0, 0.0))


class QuantileKnots(Strict):
    """A distribution as values at a grid of quantiles (piecewise-linear quantile function),
    sampled by inverse CDF with interpolation. Subclasses state what a value may be."""

    quantiles: list[float] = Field(
        min_length=2, description="probability grid, strictly increasing from 0 to 1"
    )
    values: list[float] = Field(min_length=2, description="the value at each quantile")

    @field_validator("quantiles")
    @classmethod
    def _grid(cls, q: list[float]) -> list[float]:
        return _check_grid(q)

    @field_validator("values")
    @classmethod
    def _values(cls, v: list[float]) -> list[float]:
        if any(not math.isfinite(x) for x in v):
            raise ValueError("values must be finite")
        if any(b < a for a, b in zip(v, v[1:], strict=False)):
            raise ValueError("values must be non-decreasing (they are quantiles)")
        cls._check_range(v)
        return v

    @classmethod
    def _check_range(cls, v: list[float]) -> None:
        """Subclass hook: reject values outside the allowed range."""

    @model_validator(mode="after")
    def _same_length(self) -> QuantileKnots:
        if len(self.quantiles) != len(self.values):
            raise ValueError(
                f"quantiles has {len(self.quantiles)} entries but values has "
                f"{len(self.values)}; give one value per quantile"
            )
        return self

    def moments(self) -> tuple[float, float]:
        """(mean, CV) of the distribution the sampler draws from."""
        return knot_moments(self.quantiles, self.values)


class LengthDistribution(QuantileKnots):
    """Token lengths: values are token counts, >= 1."""

    values: list[float] = Field(
        min_length=2, description="token count at each quantile, non-decreasing, >= 1"
    )

    @classmethod
    def _check_range(cls, v: list[float]) -> None:
        if v[0] < 1:
            raise ValueError(f"values must be >= 1 token (got {v[0]})")
        if v[-1] > MAX_TOKENS_BOUND:
            raise ValueError(f"values must be <= {MAX_TOKENS_BOUND} tokens (got {v[-1]})")


class GapDistribution(QuantileKnots):
    """Inter-arrival gaps relative to the mean gap (any positive scale: the sampler divides
    by the knots' mean). Zero gaps (simultaneous arrivals) are allowed."""

    values: list[float] = Field(
        min_length=2, description="gap at each quantile in units of the mean gap, >= 0"
    )

    @classmethod
    def _check_range(cls, v: list[float]) -> None:
        if v[0] < 0:
            raise ValueError(f"values must be >= 0 (got {v[0]}); they are gaps between arrivals")
        if v[-1] <= 0:
            raise ValueError("values must not all be 0: the mean gap must be positive")


class RateWindows(Strict):
    """Piecewise-constant relative rate, repeating with period len(multipliers)*window_s."""

    window_s: float = Field(gt=0, description="length of each window, seconds")
    rate_multipliers: list[float] = Field(
        min_length=1, description="relative rate per window (normalised to mean 1), >= 0"
    )

    @field_validator("window_s")
    @classmethod
    def _finite_window(cls, w: float) -> float:
        if not math.isfinite(w):
            raise ValueError("window_s must be a finite number of seconds")
        return w

    @field_validator("rate_multipliers")
    @classmethod
    def _nonnegative(cls, m: list[float]) -> list[float]:
        if any(not math.isfinite(x) or x < 0 for x in m):
            raise ValueError("rate_multipliers must be finite and >= 0")
        if not any(x > 0 for x in m):
            raise ValueError("rate_multipliers needs at least one window with a rate > 0")
        return m


MAX_LEVELS = 64  # modulation levels; a fit uses at most 7


class RateModulation(Strict):
    """Markov-modulated relative rate: a chain over ``levels``, one step per window.

    ``gap_cv`` (the inter-arrival CV in seconds that ``class_stats`` reports) is the
    fitted trace's own gap CV; when omitted it is the CV of a mixture, one component per
    level with a positive rate, weighted by the share of arrivals at that level
    (pi_k m_k): the gaps at level k are the operational-time gaps divided by m_k. That
    holds when a window holds many gaps (levels with rate 0 add idle gaps it ignores)."""

    window_s: float = Field(gt=0, description="length of one step of the chain, seconds")
    levels: list[float] = Field(
        min_length=1, max_length=MAX_LEVELS,
        description="relative rate of each level (normalised to a stationary mean of 1), >= 0",
    )
    transitions: list[list[float]] = Field(
        min_length=1, description="row-stochastic matrix: transitions[a][b] = P(next level b "
        "| this level a); each row sums to 1",
    )
    gap_cv: float | None = Field(
        None, gt=0, le=100, description="CV of the inter-arrival gaps in seconds"
    )

    @field_validator("window_s")
    @classmethod
    def _finite_step(cls, w: float) -> float:
        if not math.isfinite(w):
            raise ValueError("window_s must be a finite number of seconds")
        return w

    @field_validator("levels")
    @classmethod
    def _levels(cls, m: list[float]) -> list[float]:
        if any(not math.isfinite(x) or x < 0 for x in m):
            raise ValueError("levels must be finite and >= 0")
        if not any(x > 0 for x in m):
            raise ValueError("levels needs at least one level with a rate > 0")
        return m

    @model_validator(mode="after")
    def _matrix(self) -> RateModulation:
        k = len(self.levels)
        if len(self.transitions) != k or any(len(row) != k for row in self.transitions):
            raise ValueError(
                f"transitions must be a {k} x {k} matrix (one row and one column per level; "
                f"got {len(self.transitions)} rows of lengths "
                f"{sorted({len(r) for r in self.transitions})})"
            )
        for a, row in enumerate(self.transitions):
            if any(not math.isfinite(x) or x < 0 for x in row):
                raise ValueError(f"transitions row {a}: probabilities must be finite and >= 0")
            if abs(sum(row) - 1.0) > 1e-3:
                raise ValueError(
                    f"transitions row {a} sums to {sum(row):.6g}; each row holds the "
                    "probabilities of the next window's level and must sum to 1"
                )
        pi = self.stationary()
        if not sum(p * m for p, m in zip(pi, self.levels, strict=True)) > 0:
            raise ValueError(
                "the chain spends all its time at levels with rate 0; give a level with a "
                "positive rate that the transitions reach"
            )
        # levels that lead to a positive rate, found backwards from the positive ones
        leads = {a for a, m in enumerate(self.levels) if m > 0}
        grew = True
        while grew:
            before = len(leads)
            leads |= {a for a, row in enumerate(self.transitions)
                      if any(row[b] > 0 for b in leads)}
            grew = len(leads) > before
        stuck = [a for a in range(k) if a not in leads]
        if stuck:
            raise ValueError(
                f"level {stuck[0]} has rate 0 and its transitions never lead to a level with "
                "a positive rate: once there, no request would ever arrive again; give it a "
                "transition toward a level with a positive rate"
            )
        return self

    def stationary(self) -> list[float]:
        """The stationary distribution pi of ``transitions`` (for a chain with several,
        the least-squares one of minimum norm: deterministic)."""
        p = np.asarray(self.transitions, dtype=np.float64)
        p = p / p.sum(axis=1, keepdims=True)
        k = len(p)
        a = np.vstack([p.T - np.eye(k), np.ones((1, k))])
        b = np.concatenate([np.zeros(k), [1.0]])
        pi = np.clip(np.linalg.lstsq(a, b, rcond=None)[0], 0.0, None)
        return (pi / pi.sum()).tolist()

    def mixture_cv(self, within_cv: float) -> float:
        """CV of the gaps in seconds when a window holds many gaps: a mixture over the
        positive levels (weights pi_k m_k) of operational-time gaps (CV ``within_cv``)
        divided by m_k."""
        pi = np.asarray(self.stationary())
        m = np.asarray(self.levels, dtype=np.float64)
        m = m / float(pi @ m)
        pos = m > 0
        w = pi[pos] * m[pos]
        w = w / w.sum()
        first = float(w @ (1.0 / m[pos]))
        second = (1.0 + within_cv * within_cv) * float(w @ (1.0 / m[pos] ** 2))
        return math.sqrt(max(second / (first * first) - 1.0, 0.0))


class Arrival(Strict):
    process: Literal["poisson", "gamma", "empirical"] = Field(
        "poisson",
        description="poisson (exponential gaps), gamma (gaps with the given CV) or empirical "
        "(gaps drawn from interarrival_gaps)",
    )
    rate_per_s: float = Field(
        gt=0, le=MAX_RATE_PER_S, description="mean arrival rate, requests per second"
    )
    interarrival_cv: float = Field(
        1.0, gt=0, le=100, description="coefficient of variation of the gaps (1 for poisson)"
    )
    interarrival_gaps: GapDistribution | None = Field(
        None, description="empirical only: gap quantile knots in units of the mean gap"
    )
    windows: RateWindows | None = Field(None, description="optional piecewise-constant rate")
    modulation: RateModulation | None = Field(
        None, description="optional Markov-modulated rate (bursts); with windows it runs "
        "in their operational time"
    )

    @property
    def gaps_cv(self) -> float:
        """CV of the inter-arrival gaps in seconds: the modulation's ``gap_cv`` when there
        is one, else ``interarrival_cv`` (windows are left out, as before)."""
        if self.modulation is not None and self.modulation.gap_cv is not None:
            return self.modulation.gap_cv
        return self.interarrival_cv

    @model_validator(mode="after")
    def _consistent(self) -> Arrival:
        if not math.isfinite(self.rate_per_s):
            raise ValueError("rate_per_s must be a finite number")
        self._check_process()
        if self.modulation is not None and self.modulation.gap_cv is None:
            cv = self.modulation.mixture_cv(self.interarrival_cv)
            self.modulation.__dict__["gap_cv"] = min(max(round(cv, 4), 0.01), 100.0)
        return self

    def _check_process(self) -> None:
        if self.process == "empirical":
            if self.interarrival_gaps is None:
                raise ValueError(
                    "process: empirical needs interarrival_gaps {quantiles, values} (fit one "
                    "with servetune workload fit), or use process: gamma"
                )
            _, cv = self.interarrival_gaps.moments()
            cv = min(max(round(cv, 4), 0.01), 100.0)
            if "interarrival_cv" not in self.model_fields_set:
                # bypass validate_assignment (it would re-run this validator)
                self.__dict__["interarrival_cv"] = cv
            elif abs(self.interarrival_cv - cv) > max(0.01 * cv, 1e-4):
                raise ValueError(
                    f"interarrival_cv {self.interarrival_cv} disagrees with the CV of "
                    f"interarrival_gaps ({cv}); set it to {cv} or leave it out"
                )
            return
        if self.interarrival_gaps is not None:
            raise ValueError(
                f"interarrival_gaps applies to process: empirical only (got process: "
                f"{self.process}); remove it or set process: empirical"
            )
        if self.process == "poisson" and self.interarrival_cv != 1.0:
            raise ValueError(
                f"a poisson process has interarrival_cv 1 (got {self.interarrival_cv}); "
                "use process: gamma for another CV"
            )


MAX_LENGTH_SHIFT = 5.0  # normal scores; a shift beyond puts a window outside the knots


class LengthShift(Strict):
    """Per window of ``arrival.windows``: a shift of the prompt (output) lengths' normal
    score (see the module docstring). Either list may be left out (no shift)."""

    prompt: list[float] | None = Field(
        None, min_length=1, description="normal-score shift of prompt lengths per window"
    )
    output: list[float] | None = Field(
        None, min_length=1, description="normal-score shift of output lengths per window"
    )

    @field_validator("prompt", "output")
    @classmethod
    def _finite(cls, d: list[float] | None) -> list[float] | None:
        if d is not None and any(
            not math.isfinite(x) or abs(x) > MAX_LENGTH_SHIFT for x in d
        ):
            raise ValueError(
                f"shifts must be finite numbers within +-{MAX_LENGTH_SHIFT:g} (they are "
                "normal scores: standard deviations of the lengths' ranks)"
            )
        return d

    @model_validator(mode="after")
    def _some(self) -> LengthShift:
        if self.prompt is None and self.output is None:
            raise ValueError("length_shift needs prompt and/or output shifts per window")
        return self

    @staticmethod
    def centred(shifts: list[float] | None, multipliers: list[float]) -> tuple[np.ndarray,
                                                                                float]:
        """(d, a): the shifts centred on their mean weighted by ``multipliers`` and the
        within-window scale sqrt(1 - weighted variance); zeros and 1 without shifts."""
        w = np.asarray(multipliers, dtype=np.float64)
        w = w / w.sum()
        if shifts is None:
            return np.zeros(len(w)), 1.0
        d = np.asarray(shifts, dtype=np.float64)
        d = d - float(w @ d)
        var = float(w @ (d * d))
        return d, math.sqrt(max(1.0 - var, 0.0))


class WorkloadClass(Strict):
    priority: int = Field(0, description="lower value is served first (vLLM convention)")
    arrival: Arrival
    prompt_tokens: LengthDistribution
    output_tokens: LengthDistribution
    prompt_output_correlation: float | None = Field(
        None, description="optional Gaussian-copula correlation of a request's prompt and "
        "output lengths (the correlation of their normal scores), strictly between -1 and 1; "
        "absent: drawn independently",
    )
    length_shift: LengthShift | None = Field(
        None, description="optional shift of the length mix per window of arrival.windows"
    )

    @field_validator("prompt_output_correlation")
    @classmethod
    def _correlation(cls, r: float | None) -> float | None:
        if r is not None and not (math.isfinite(r) and -1.0 < r < 1.0):
            raise ValueError(
                f"prompt_output_correlation must be a number strictly between -1 and 1 "
                f"(got {r}); leave it out for independent prompt and output lengths"
            )
        return r

    @model_validator(mode="after")
    def _shift_windows(self) -> WorkloadClass:
        shift = self.length_shift
        if shift is None:
            return self
        windows = self.arrival.windows
        if windows is None:
            raise ValueError(
                "length_shift gives one shift per window of arrival.windows, but the arrival "
                "has no windows; add arrival.windows or remove length_shift"
            )
        k = len(windows.rate_multipliers)
        for what, d in (("prompt", shift.prompt), ("output", shift.output)):
            if d is None:
                continue
            if len(d) != k:
                raise ValueError(
                    f"length_shift.{what} has {len(d)} entries but arrival.windows has {k} "
                    "windows; give one shift per window"
                )
            _, a = LengthShift.centred(d, windows.rate_multipliers)
            if not a > 0:
                raise ValueError(
                    f"length_shift.{what}: the shifts' variance (weighted by the windows' "
                    "rates) must be < 1, since the shifted normal scores must keep variance 1"
                )
        return self


class BlockBootstrap(Strict):
    """A trace's requests in fixed time blocks, resampled block by block within strata
    (see the module docstring)."""

    block_s: float = Field(gt=0, description="length of each block, seconds (the last block: "
                           "what span_s leaves)")
    stratum_s: float = Field(gt=0, description="length of each stratum, a whole number of "
                             "blocks; blocks move only within their stratum")
    span_s: float = Field(gt=0, description="one cycle: the blocks' total length (the fitted "
                          "trace's span), seconds")
    block_counts: list[int] = Field(
        min_length=1, description="requests in each block, in time order; their sum is the "
        "number of requests")
    offset_s: list[float] = Field(
        description="per request (in block order): arrival, seconds from its block's start")
    class_index: list[int] | None = Field(
        None, description="per request: its class, a position in classes (0 = the first); "
        "may be left out when there is one class")
    prompt_tokens: list[int] = Field(description="per request: prompt tokens, >= 1")
    output_tokens: list[int] = Field(description="per request: output tokens, >= 1")
    later_turns: list[int] | None = Field(
        None, description="positions (0-based, in block order, increasing) of the requests "
        "that were later turns of a session; with prefix_reuse.sessions a sample replays the "
        "others as first turns and makes the later turns from the sessions")

    @field_validator("block_s", "stratum_s", "span_s")
    @classmethod
    def _finite_seconds(cls, x: float) -> float:
        if not math.isfinite(x):
            raise ValueError("must be a finite number of seconds")
        return x

    @field_validator("block_counts")
    @classmethod
    def _counts(cls, c: list[int]) -> list[int]:
        bad = _first(np.asarray(c) < 0)
        if bad is not None:
            raise ValueError(f"block_counts[{bad}] is {c[bad]}; counts must be >= 0")
        return c

    @field_validator("offset_s")
    @classmethod
    def _offsets(cls, x: list[float]) -> list[float]:
        bad = _first(~(np.asarray(x, dtype=np.float64) >= 0))  # NaN too
        if bad is not None:
            raise ValueError(f"offset_s[{bad}] is {x[bad]}; offsets must be seconds >= 0")
        return x

    @field_validator("prompt_tokens", "output_tokens")
    @classmethod
    def _tokens(cls, v: list[int]) -> list[int]:
        a = np.asarray(v, dtype=np.int64)
        bad = _first((a < 1) | (a > MAX_TOKENS_BOUND))
        if bad is not None:
            raise ValueError(f"entry {bad} is {v[bad]}; token counts must be from 1 to "
                             f"{MAX_TOKENS_BOUND:,}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> BlockBootstrap:
        per = self.stratum_s / self.block_s
        if not (round(per) >= 1 and abs(per - round(per)) <= 1e-6 * per):
            raise ValueError(
                f"stratum_s {self.stratum_s:g} s must be a whole number of "
                f"blocks of block_s {self.block_s:g} s")
        nb = len(self.block_counts)
        if not ((nb - 1) * self.block_s < self.span_s <= nb * self.block_s * (1 + 1e-9)):
            want = max(1, math.ceil(self.span_s / self.block_s - 1e-9))
            raise ValueError(
                f"block_counts has {nb} blocks but span_s {self.span_s:g} s "
                f"in blocks of {self.block_s:g} s makes {want}; give one count per block")
        n = sum(self.block_counts)
        for what in ("offset_s", "class_index", "prompt_tokens", "output_tokens"):
            got = getattr(self, what)
            if got is not None and len(got) != n:
                raise ValueError(
                    f"{what} has {len(got)} entries but block_counts add up "
                    f"to {n} requests; give one entry per request")
        if self.later_turns:
            later = np.asarray(self.later_turns)
            bad = _first((later < 0) | (later >= n) | np.r_[False, np.diff(later) <= 0])
            if bad is not None:
                raise ValueError(
                    f"later_turns[{bad}] is {self.later_turns[bad]}; give increasing request "
                    f"positions from 0 to {n - 1}")
        length = self.block_lengths()
        block = np.repeat(np.arange(nb), self.block_counts)
        over = _first(np.asarray(self.offset_s, dtype=np.float64) > length[block] + 1e-6)
        if over is not None:
            raise ValueError(
                f"offset_s[{over}] is {self.offset_s[over]:g} s, beyond the "
                f"{length[block[over]]:g} s of its block {block[over]}; offsets are seconds "
                "from the start of the request's block")
        return self

    @property
    def n_requests(self) -> int:
        return len(self.offset_s)

    @property
    def blocks_per_stratum(self) -> int:
        return round(self.stratum_s / self.block_s)

    @property
    def n_strata(self) -> int:
        return -(-len(self.block_counts) // self.blocks_per_stratum)

    def block_lengths(self) -> np.ndarray:
        """Each block's length in seconds: block_s, the last one what span_s leaves."""
        length = np.full(len(self.block_counts), float(self.block_s))
        length[-1] = self.span_s - (len(length) - 1) * self.block_s
        return length


class NonNegativeKnots(QuantileKnots):
    """Quantile knots of a quantity >= 0 (seconds, tokens)."""

    @classmethod
    def _check_range(cls, v: list[float]) -> None:
        if v[0] < 0:
            raise ValueError(f"values must be >= 0 (got {v[0]})")


def _shares(v: list[float]) -> list[float]:
    bad = _first(~((np.asarray(v, dtype=np.float64) >= 0) & (np.asarray(v) <= 1)))
    if bad is not None:
        raise ValueError(f"entry {bad} is {v[bad]}; a share must be from 0 to 1")
    return v


ScaleBy = Literal["time", "sessions"]
SCALE_BY: tuple[str, ...] = get_args(ScaleBy)


class PrefixSessions(Strict):
    """Sessions: later turns that extend an earlier turn's context. The fitted trace's
    sessions, one per first turn in trace order, are the donors a sample replays: session
    ``i`` has ``later_turns[i]`` later turns, listed in the flat per-turn fields session
    by session, each session's in arrival order."""

    later_turn_share: list[float] = Field(
        min_length=1, description="per prompt band: share of the band's requests that are "
        "later turns of a session (0..1); the classes' requests of the band are first turns "
        "with the rest")
    first_prompt_tokens: list[int] = Field(
        min_length=1, description="per session: its first turn's prompt tokens (its band)")
    time_left_s: list[float] = Field(
        min_length=1, description="per session: seconds from its first turn to the fitted "
        "trace's end (how long its later turns were watched)")
    later_turns: list[int] = Field(
        min_length=1, description="per session: its number of later turns")
    parent: list[int] = Field(
        default_factory=list, description="per later turn: the turn it continues, -1 for its "
        "session's first turn, else a position among the session's earlier later turns")
    after_s: list[float] = Field(
        default_factory=list, description="per later turn: seconds after its session's "
        "first turn (at least its parent's)")
    extra_tokens: list[int] = Field(
        default_factory=list, description="per later turn: prompt tokens beyond its session's "
        "first turn's covered tokens (the context grown since, or the change in prompt "
        "length when ids cover the prompt only)")
    output_tokens: list[int] = Field(
        default_factory=list, description="per later turn: its output tokens")
    time_left_exponent: float = Field(
        0.0, ge=0, le=1, description="a donor watched longer than the first turn that "
        "replays it has left draws its turns in, their times times (time left / donor's "
        "time_left_s) to this power: 0 keeps the donor's times; fitted so that samples "
        "hold the trace's later turns")
    scale_by: ScaleBy = Field(
        "time", description="what a rate scale s does: time (divides think times by s "
        "too: the same sessions, faster) or sessions (s times as many sessions at once, "
        "think times as fitted)")

    @field_validator("later_turn_share")
    @classmethod
    def _in_unit(cls, v: list[float]) -> list[float]:
        return _shares(v)

    @model_validator(mode="after")
    def _donors(self) -> PrefixSessions:
        n = len(self.first_prompt_tokens)
        for what in ("time_left_s", "later_turns"):
            if len(getattr(self, what)) != n:
                raise ValueError(f"{what} has {len(getattr(self, what))} entries but "
                                 f"first_prompt_tokens has {n}; give one per session")
        counts = np.asarray(self.later_turns, dtype=np.int64)
        for what, values, low in (("first_prompt_tokens", self.first_prompt_tokens, 1),
                                  ("time_left_s", self.time_left_s, 0),
                                  ("later_turns", self.later_turns, 0),
                                  ("output_tokens", self.output_tokens, 1)):
            bad = _first(~(np.asarray(values, dtype=np.float64) >= low))
            if bad is not None:
                raise ValueError(f"{what}[{bad}] is {values[bad]}; it must be >= {low}")
        turns = int(counts.sum())
        for what in ("parent", "after_s", "extra_tokens", "output_tokens"):
            if len(getattr(self, what)) != turns:
                raise ValueError(f"{what} has {len(getattr(self, what))} entries but "
                                 f"later_turns adds up to {turns}; give one per later turn")
        start = np.repeat(np.cumsum(counts) - counts, counts)  # each turn's session's first
        position = np.arange(turns) - start
        parent = np.asarray(self.parent, dtype=np.int64)
        bad = _first((parent < -1) | (parent >= position))
        if bad is not None:
            raise ValueError(f"parent[{bad}] is {self.parent[bad]}; it must be -1 or an "
                             "earlier later turn of the same session")
        after = np.asarray(self.after_s, dtype=np.float64)
        before = np.where(parent >= 0, after[np.maximum(start + parent, 0)], 0.0)
        bad = _first(~(after >= before))
        if bad is not None:
            raise ValueError(f"after_s[{bad}] is {self.after_s[bad]}; a later turn comes "
                             "after its parent (and its session's first turn)")
        return self


class SystemPrompts(Strict):
    """Shared system prompts: leading blocks that first turns of different sessions share."""

    share: list[float] = Field(
        min_length=1, description="per prompt band: share of first turns that start with a "
        "system prompt (0..1)")
    own_tokens: NonNegativeKnots = Field(
        description="a first turn's prompt tokens after its system prompt (quantile knots)")
    tokens: list[int] = Field(
        min_length=1, description="each distinct system prompt's length in tokens, a positive "
        "multiple of block_tokens")
    sessions: list[int] = Field(
        min_length=1, description="each system prompt's popularity: the fitted trace's sessions "
        "that started with it (sampling weights, >= 1)")

    @field_validator("share")
    @classmethod
    def _in_unit(cls, v: list[float]) -> list[float]:
        return _shares(v)

    @model_validator(mode="after")
    def _paired(self) -> SystemPrompts:
        if len(self.tokens) != len(self.sessions):
            raise ValueError(
                f"tokens has {len(self.tokens)} entries but sessions has {len(self.sessions)}; "
                "give one popularity per system prompt")
        bad = _first(np.asarray(self.sessions) < 1)
        if bad is not None:
            raise ValueError(f"sessions[{bad}] is {self.sessions[bad]}; popularity must be >= 1")
        return self


class PrefixReuse(Strict):
    """How requests share prompt prefixes (see the module docstring)."""

    block_tokens: int = Field(
        512, ge=1, le=1 << 20, description="tokens per prefix block id (512 in Mooncake traces)")
    covers_output: bool = Field(
        False, description="ids cover the prompt and the output (a session's next turn "
        "re-sends both), not the prompt only")
    prompt_band_edges: list[float] = Field(
        default_factory=list, description="upper prompt-token edges of the bands but the last, "
        "strictly increasing: band b holds prompts with edges[b-1] < tokens <= edges[b]")
    sessions: PrefixSessions | None = Field(
        None, description="later turns of sessions; absent: no request continues another")
    system_prompts: SystemPrompts | None = Field(
        None, description="shared system prompts; absent: first turns share nothing")
    trace_reuse_ratio: float | None = Field(
        None, ge=0, le=1, description="for reference: the fitted trace's share of block "
        "references that repeat an earlier id")

    @field_validator("prompt_band_edges")
    @classmethod
    def _edges(cls, e: list[float]) -> list[float]:
        a = np.asarray(e, dtype=np.float64)
        if not np.all(np.isfinite(a)) or np.any(np.diff(a) <= 0):
            raise ValueError("prompt_band_edges must be finite and strictly increasing")
        return e

    @model_validator(mode="after")
    def _bands(self) -> PrefixReuse:
        k = len(self.prompt_band_edges) + 1
        for what, shares in (
            ("sessions.later_turn_share", self.sessions and self.sessions.later_turn_share),
            ("system_prompts.share", self.system_prompts and self.system_prompts.share),
        ):
            if shares and len(shares) != k:
                raise ValueError(
                    f"{what} has {len(shares)} entries but prompt_band_edges makes {k} "
                    "bands; give one share per band")
        if self.system_prompts is not None:
            t = np.asarray(self.system_prompts.tokens)
            bad = _first((t < self.block_tokens) | (t % self.block_tokens != 0))
            if bad is not None:
                raise ValueError(
                    f"system_prompts.tokens[{bad}] is {int(t[bad])}; a system prompt is a "
                    f"whole number of blocks of block_tokens {self.block_tokens}")
        return self

    def band(self, prompt_tokens: np.ndarray) -> np.ndarray:
        """Each prompt's band index."""
        return np.searchsorted(np.asarray(self.prompt_band_edges, dtype=np.float64),
                               prompt_tokens, side="left")


def _first(bad: np.ndarray) -> int | None:
    """The index of the first True, or None."""
    idx = np.flatnonzero(bad)
    return int(idx[0]) if len(idx) else None


class Workload(Document):
    KIND: ClassVar[str] = "Workload"
    kind: Literal["Workload"] = "Workload"
    name: str = "workload"
    source: str = Field("", description="where the numbers come from (trace, license)")
    duration_s: float | None = Field(
        None, gt=0, description="default sampling horizon (the fitted trace's span), seconds"
    )
    classes: dict[str, WorkloadClass] = Field(min_length=1)
    block_bootstrap: BlockBootstrap | None = Field(
        None, description="optional: the fitted trace's requests in time blocks; a sample "
        "resamples them (blocks permuted within strata) instead of drawing from the classes")
    prefix_reuse: PrefixReuse | None = Field(
        None, description="optional: sessions and shared system prompts; a sample then "
        "carries prefix block ids that reuse prompts as the fitted trace did")

    @field_validator("duration_s")
    @classmethod
    def _finite_duration(cls, d: float | None) -> float | None:
        if d is not None and not math.isfinite(d):
            raise ValueError("duration_s must be a finite number of seconds")
        return d

    @field_validator("classes")
    @classmethod
    def _names(cls, classes: dict[str, WorkloadClass]) -> dict[str, WorkloadClass]:
        for name in classes:
            if not name or not name.strip():
                raise ValueError("class names must be non-empty")
        return classes

    @model_validator(mode="after")
    def _bootstrap_classes(self) -> Workload:
        boot = self.block_bootstrap
        if boot is None:
            return self
        k = len(self.classes)
        if boot.class_index is None:
            if k > 1:
                raise ValueError(
                    f"block_bootstrap.class_index is missing: the workload has {k} classes; "
                    "give each request's class (0 = the first)")
            return self
        bad = _first((np.asarray(boot.class_index) < 0) | (np.asarray(boot.class_index) >= k))
        if bad is not None:
            raise ValueError(
                f"block_bootstrap.class_index[{bad}] is {boot.class_index[bad]}; the workload "
                f"has {k} class{'es' if k > 1 else ''} (0..{k - 1})")
        return self

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(self.classes)

    @property
    def total_rate_per_s(self) -> float:
        return sum(c.arrival.rate_per_s for c in self.classes.values())
