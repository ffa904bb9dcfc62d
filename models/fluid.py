"""Fluid (steady-state) model of a scheduling policy under a workload on one GPU.

The free variable is ``x``, the mean number of requests that arrive per engine step.
Everything else follows from ``x``, the policy's knobs, the workload's per-class moments
and quantiles, and the profile's step-time coefficients (``servetune.profiles.steptime``):

- step contents per step: ``D = x (O - 1)`` decoding rows, ``Tp = x P`` prefill tokens,
  ``T = D + Tp`` tokens, ``S = x O`` sampled rows, ``C = x E[(O-1)(P + O/2)]`` context
  read, ``W = x E[P^2] / 2`` prefill attention pairs (a prompt's chunks always add up to
  ``P^2/2`` pairs, however it is chunked);
- mean step time ``t(x) = max_k (c0_k + c1_k x)`` (the step-time model is affine in ``x``
  except for the convex piecewise-linear GEMM term ``g``; decode rows take ``g`` and
  prefill tokens its steepest slope, since a mean step mixes decode-only steps on the
  memory-bound floor with compute-bound prefill steps: :meth:`FluidModel.step_pieces`),
  steps per second ``1/t`` and arrival
  rate ``lambda = x / t(x)``, which increases with ``x``; so the sustainable rate of a
  policy is ``x* / t(x*)`` with ``x*`` the largest ``x`` that meets every condition below;
- running set ``N = x (O - 1 + prefill steps)`` (Little's law in steps), its Poisson
  quantile (concurrent requests of an M/G/inf system are Poisson), and KV occupancy,
  *shot noise*: a request holds about ``P`` tokens over its ``P / c + 1/2`` prefill
  steps and ``P + O/2`` over its ``O - 1`` decode steps, so the occupancy's mean is
  ``x E[(O - 1)(P + O/2) + P (P / c + 1/2)]`` and its variance ``x E[(O - 1)(P + O/2)^2
  + P^2 (P / c + 1/2)]`` (an M/G/inf sum); its high quantile is a lognormal's with these
  two moments, plus half a block of rounding per request. (The Poisson count times the
  mean holding, used before, ignored the spread of holdings: on a long-context workload
  whose prompts reach 100k tokens it was 3-4x below the simulator's occupancy.)
- TTFT: the prefill queue serves ``M - D`` tokens per step (what the token budget leaves
  after decodes), utilisation ``rho = Tp / (M - D)``. Without a chunk cap it is one FCFS
  server (Kingman: ``W = (ca^2 + cs^2)/2 * rho/(1-rho) * E[S]``); a chunk cap ``L``
  shares it among ``c = (M - D) / L`` prompts (G/G/c: Allen-Cunneen with Sakasegawa's
  probability of waiting ``p = rho^(sqrt(2(c+1)) - 1)``). The q-quantile wait uses an
  exponential tail, ``W_q = W / p' * ln(p' / (1 - q))`` with ``p' = min(1, p (ca^2+1)/2)``
  (bursty arrivals find the queue busy more often). The q-quantile prompt then needs
  ``ceil(P_q / min(L, M - D))`` steps (``L`` = ``long_prefill_token_threshold``) plus
  its own causal attention, ``P_q^2 / 2`` pairs;
- TPOT: a request's TPOT is the mean of its ``L = O - 1`` decode steps. Two mechanisms
  slow them, and the model takes the worse, at most a full step (the budget's tokens
  attending as deep as the q-quantile prompt):

  * bursts filling steps: a step carrying ``D`` decodes and ``Tp + z sqrt(x E[P min(P,
    c)] max(1, ca^2))`` prefill tokens (compound renewal counts; a prompt adds at most a
    chunk ``c = min(L_cap, M - D)`` to each of its steps), capped by the budget, as
    Sarathi-Serve bounds a step's chunk by the TPOT target. The mean of ``O - 1`` steps
    correlated over ``tau = max(1, (ca^2 + cs^2)/2) / (1 - rho)`` steps (the prefill
    queue's relaxation time) has the noise of ``(O - 1) / tau`` independent ones, so
    ``z`` is the q-quantile of that averaged noise over the class's outputs
    (:func:`tpot_noise_quantiles`), not the per-step ``Phi^-1(q)``;
  * heavy prompts: a decode-only step, plus the prefill time other requests' prompts
    add to its steps, plus the noise of its neighbours' context reads. A prompt of ``P``
    tokens costs ``T(P) = a P + b P^2 / 2`` seconds (``a`` the GEMM's steepest slope per
    token, ``b`` per attention pair, however it is chunked) over ``n = ceil(P / c)``
    consecutive steps; about ``x (L + n)`` prompts overlap a request's decode (Poisson),
    each sharing ``L n / (L + n)`` of its steps on average, so the request's extra time
    is a compound sum of shots ``T(P) L / (L + n)`` (mean ``x L E[T]``, as the mean step
    says). Its q-quantile over the class's requests
    (:meth:`FluidModel.prefill_excess_quantile`) takes, per output length, the larger
    tail of a lognormal with the sum's two moments (many overlaps) and of one big shot
    (few). This is what a chunk cap trades for long prompts: short outputs that meet a
    long prompt's deep chunks set the tail, and a smaller chunk spreads that prompt over
    more steps. The context reads (``x E[(O - 1) (r + k (P + O/2))^2]`` of variance) last
    a neighbour's residual decode life and average over the request's steps as the
    burst noise does.

  (The burst term alone saw neither the attention of deep chunks, 0.4 s for a 2048-token
  chunk at depth 50k on an L40S, nor that a prompt's chunks come in a run: 3-5x
  optimistic on long prompts. The heavy-prompt term alone, with its variance times
  ``ca^2``, was 4-11x pessimistic on the bursty Azure code traffic; as clusters of
  ``ca^2`` prompts, 13-38x optimistic there. Hence both, each for what it models.)
- stability: ``T < M`` (demand per step below what one step serves), seats and KV.

Every condition is non-decreasing in ``x``, so each gives a largest ``x``
(:meth:`FluidModel.limits`); the smallest of them binds. Predictions can be scaled by
:class:`Calibration` factors that the search loop fits to what the simulator measured.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

import numpy as np

from servetune.conditions import Condition, Family
from servetune.knobs import MODELED as MODELED_KNOBS
from servetune.profiles.steptime import (
    COEF_ALLREDUCE,
    COEF_CONSTANT,
    COEF_DECODE_CTX,
    COEF_DECODE_SEQ,
    COEF_FIXED,
    COEF_HOST_SEQ,
    COEF_HOST_STEP,
    COEF_LM_ROW,
    COEF_PREFILL_PAIR,
    StepTimeModel,
)
from servetune.schemas.space import normalise_path

if TYPE_CHECKING:  # only for annotations: the model layer reads these documents' fields
    from servetune.profiles.schema import Profile
    from servetune.schemas.policy import Policy
    from servetune.schemas.slo import ClassSLO, SLOSet
    from servetune.workloads.fitting import ClassStats
    from servetune.workloads.trace import Trace

# Quantile grid used to integrate moments from quantile functions (midpoint rule).
_N_MOMENT_BINS = 400
# Quantile table kept per class (0, 0.005, ..., 1).
_Q_TABLE = np.linspace(0.0, 1.0, 201)
# Budget utilisation above this counts as unstable (queues grow without bound).
BUDGET_UTIL_MAX = 0.995
# Quantile used for the seat and KV chance constraints.
DEFAULT_CAPACITY_QUANTILE = 0.99


def normal_quantile(q: float) -> float:
    return NormalDist().inv_cdf(min(max(q, 1e-12), 1 - 1e-12))


# Correlation times (steps) at which the TPOT noise quantile is tabulated.
_TPOT_TAU = np.geomspace(1.0, 1024.0, 21)
# Prompt and output bins per class for the joint (P, O) moments of the shot-noise terms.
_N_JOINT_BINS = 100
# Bins for the TPOT shot model, evaluated at every load and chunk size: prompt quantile
# edges dense in the tail (the longest prompts set the tail), output quantiles uniform.
_SHOT_PROMPT_EDGES = np.concatenate([np.linspace(0.0, 0.9, 19), np.linspace(0.92, 0.98, 4),
                                     np.linspace(0.99, 1.0, 11)])
_N_SHOT_OUTPUT_BINS = 16
# The grid on which the TPOT prefill-excess quantile is solved per class: loads (arrivals
# per step, 6 per decade) and chunk sizes (log-spaced from 16 tokens to twice the
# longest prompt), and the bisection steps (a ratio of 2^(40 / 2^22) in the end).
_EXCESS_X_RANGE = (1e-7, 1e3)
_EXCESS_X_POINTS = 61
_EXCESS_CHUNK_POINTS = 16
_EXCESS_BISECTIONS = 22


def normal_sf(z) -> np.ndarray:
    """``1 - Phi(z)``, vectorised (Abramowitz and Stegun 26.2.17, error < 7.5e-8)."""
    z = np.asarray(z, dtype=np.float64)
    t = 1.0 / (1.0 + 0.2316419 * np.abs(z))
    poly = t * (0.319381530 + t * (-0.356563782 + t * (1.781477937 + t * (
        -1.821255978 + t * 1.330274429))))
    upper = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi) * poly
    return np.where(z >= 0, upper, 1.0 - upper)


def lognormal_shape(mean, var) -> tuple[np.ndarray, np.ndarray]:
    """``(mu, s)`` of the lognormal with this mean and variance (a positive sum of
    heavy-tailed shots: its skew grows with its CV, as a compound-Poisson sum's does)."""
    mean = np.maximum(np.asarray(mean, dtype=np.float64), 1e-150)
    s2 = np.log1p(np.maximum(np.asarray(var, dtype=np.float64), 0.0) / (mean * mean))
    return np.log(mean) - 0.5 * s2, np.sqrt(s2)


def lognormal_quantile(mean, var, q: float) -> np.ndarray:
    """The q-quantile of the lognormal with this mean and variance (0 where mean is 0)."""
    mu, s = lognormal_shape(mean, var)
    out = np.exp(mu + normal_quantile(q) * s)
    return np.where(np.asarray(mean) > 0, out, 0.0)
_erfc = np.frompyfunc(math.erfc, 1, 1)


def tpot_noise_quantiles(cls: ClassLoad, q: float, bins: int = 200) -> np.ndarray:
    """``z(tau)`` on the grid ``_TPOT_TAU``: a share ``1 - q`` of the class's requests see
    a mean step time above ``mean + z sd`` (``sd``: one step's), when step loads are
    correlated over ``tau`` steps.

    A request's TPOT is the mean of its ``O - 1`` decode steps; with loads correlated over
    ``tau`` steps that mean has the noise of ``m = max(1, (O - 1) / tau)`` independent
    steps, ``sd / sqrt(m)``. So ``z`` solves ``E_O[1 - Phi(z sqrt(m))] = 1 - q`` over the
    class's outputs of two or more tokens (one-token outputs have no TPOT): long outputs
    average prefill bursts out, unless the bursts last as long as the requests."""
    mids = (np.arange(bins) + 0.5) / bins
    outputs = np.interp(mids, _Q_TABLE, np.asarray(cls.output_table, dtype=np.float64))
    decode_steps = np.maximum(outputs[outputs >= 2.0] - 1.0, 1.0)
    z_step = normal_quantile(q)
    if len(decode_steps) == 0:
        return np.full(len(_TPOT_TAU), z_step)
    root_m = np.sqrt(np.maximum(decode_steps[None, :] / _TPOT_TAU[:, None], 1.0))
    lo = np.zeros(len(_TPOT_TAU))
    hi = np.full(len(_TPOT_TAU), z_step)  # the share above z_step sqrt(m) is <= 1 - q
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        share = np.mean(0.5 * _erfc(mid[:, None] * root_m / math.sqrt(2.0)).astype(float),
                        axis=1)
        above = share > 1.0 - q
        lo = np.where(above, mid, lo)
        hi = np.where(above, hi, mid)
    return hi


def _tpot_z_at(tau_steps, z_tab: np.ndarray | None, q: float) -> np.ndarray | float:
    """The TPOT noise quantile ``z`` for loads correlated over ``tau_steps`` steps,
    interpolated in the class's table (:func:`tpot_noise_quantiles`); the per-step
    normal quantile where the class has none."""
    if z_tab is None:
        return normal_quantile(q)
    return np.interp(np.log(np.clip(tau_steps, 1.0, _TPOT_TAU[-1])), np.log(_TPOT_TAU), z_tab)


def poisson_quantile_cf(mean: np.ndarray | float, q: float) -> np.ndarray | float:
    """Continuous Cornish-Fisher approximation of the Poisson q-quantile:
    ``m + z sqrt(m) + (z^2 - 1) / 6`` (monotone in ``m``; exact enough for m >= 5)."""
    z = normal_quantile(q)
    m = np.maximum(np.asarray(mean, dtype=np.float64), 0.0)
    out = m + z * np.sqrt(m) + (z * z - 1.0) / 6.0
    out = np.where(m > 0, np.maximum(out, 0.0), 0.0)
    return float(out) if np.ndim(out) == 0 else out


def poisson_quantile(mean: float, q: float) -> int:
    """Exact q-quantile of a Poisson(mean) variable (smallest k with CDF(k) >= q);
    Cornish-Fisher rounded up beyond mean 600 where the sum would underflow."""
    if mean <= 0:
        return 0
    if mean > 600:
        return int(math.ceil(poisson_quantile_cf(mean, q)))
    pmf = math.exp(-mean)
    cdf = pmf
    k = 0
    while cdf < q and k < 100_000:
        k += 1
        pmf *= mean / k
        cdf += pmf
    return k


@dataclass(frozen=True)
class ClassLoad:
    """What the models need to know about one request class."""

    name: str
    share: float  # of the total arrival rate
    priority: int
    interarrival_cv: float
    prompt_mean: float
    prompt_sq_mean: float  # E[P^2]
    output_mean: float
    output_sq_mean: float  # E[O^2]
    prompt_table: tuple[float, ...]  # prompt quantiles at _Q_TABLE
    output_table: tuple[float, ...]

    def prompt_quantile(self, q: float) -> float:
        return float(np.interp(q, _Q_TABLE, self.prompt_table))

    def output_quantile(self, q: float) -> float:
        return float(np.interp(q, _Q_TABLE, self.output_table))

    @property
    def decode_context_per_request(self) -> float:
        """E[(O - 1)(P + O/2)]: context tokens read over a request's decode steps
        (prompt and output lengths taken as independent)."""
        return (self.output_mean - 1.0) * self.prompt_mean + 0.5 * (
            self.output_sq_mean - self.output_mean
        )

    @staticmethod
    def from_quantile_functions(
        name: str,
        share: float,
        prompt_q: Callable[[float], float],
        output_q: Callable[[float], float],
        *,
        priority: int = 0,
        interarrival_cv: float = 1.0,
        prompt_mean: float | None = None,
        output_mean: float | None = None,
    ) -> ClassLoad:
        """Moments by integrating the quantile functions; the means are matched to the
        given ones when present (the quantile knots may round them)."""
        mids = (np.arange(_N_MOMENT_BINS) + 0.5) / _N_MOMENT_BINS

        def moments(fn: Callable[[float], float], mean: float | None) -> tuple[float, float]:
            v = np.array([max(1.0, float(fn(float(q)))) for q in mids])
            m1, m2 = float(v.mean()), float((v * v).mean())
            if mean is not None and m1 > 0:
                scale = mean / m1
                m1, m2 = mean, m2 * scale * scale
            return m1, max(m2, m1 * m1)

        pm, p2 = moments(prompt_q, prompt_mean)
        om, o2 = moments(output_q, output_mean)
        return ClassLoad(
            name=name,
            share=share,
            priority=priority,
            interarrival_cv=interarrival_cv,
            prompt_mean=pm,
            prompt_sq_mean=p2,
            output_mean=om,
            output_sq_mean=o2,
            prompt_table=tuple(max(1.0, float(prompt_q(float(q)))) for q in _Q_TABLE),
            output_table=tuple(max(1.0, float(output_q(float(q)))) for q in _Q_TABLE),
        )

    @staticmethod
    def from_samples(
        name: str, share: float, prompt: np.ndarray, output: np.ndarray, *,
        priority: int = 0, interarrival_cv: float = 1.0,
    ) -> ClassLoad:
        p = np.asarray(prompt, dtype=np.float64)
        o = np.asarray(output, dtype=np.float64)
        return ClassLoad(
            name=name,
            share=share,
            priority=priority,
            interarrival_cv=interarrival_cv,
            prompt_mean=float(p.mean()),
            prompt_sq_mean=float((p * p).mean()),
            output_mean=float(o.mean()),
            output_sq_mean=float((o * o).mean()),
            prompt_table=tuple(float(v) for v in np.quantile(p, _Q_TABLE)),
            output_table=tuple(float(v) for v in np.quantile(o, _Q_TABLE)),
        )


@dataclass(frozen=True)
class LoadModel:
    """The workload as the models see it: classes and the base (1x) arrival rate."""

    classes: tuple[ClassLoad, ...]
    rate_per_s: float

    @staticmethod
    def from_class_stats(stats: Sequence[ClassStats]) -> LoadModel:
        """From ``servetune.workloads.fitting.class_stats(workload)`` (anything with the same
        attributes: name, share, rate_per_s, priority, interarrival_cv, prompt_mean,
        output_mean, prompt_quantile(q), output_quantile(q))."""
        classes = tuple(
            ClassLoad.from_quantile_functions(
                s.name,
                float(s.share),
                s.prompt_quantile,
                s.output_quantile,
                priority=int(getattr(s, "priority", 0)),
                interarrival_cv=float(getattr(s, "interarrival_cv", 1.0) or 1.0),
                prompt_mean=float(s.prompt_mean),
                output_mean=float(s.output_mean),
            )
            for s in stats
        )
        return LoadModel(classes, float(sum(float(s.rate_per_s) for s in stats)))

    @staticmethod
    def from_trace(trace: Trace) -> LoadModel:
        """Empirical moments of a Trace, per class."""
        n = len(trace)
        duration = max(float(trace.duration_s), 1e-9)
        ids = trace.class_ids()
        gaps = np.diff(trace.arrival_s)
        cv = float(gaps.std() / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0 else 1.0
        prio = trace.priorities()
        classes = []
        for k, name in enumerate(trace.class_names):
            sel = ids == k
            if not sel.any():
                continue
            classes.append(
                ClassLoad.from_samples(
                    name, float(sel.sum()) / n, trace.prompt_tokens[sel],
                    trace.output_tokens[sel], priority=int(np.min(prio[sel])),
                    interarrival_cv=cv,
                )
            )
        return LoadModel(tuple(classes), n / duration if n > 1 else 1.0)

    # Share-weighted per-request aggregates -------------------------------------------
    def mean(self, fn: Callable[[ClassLoad], float]) -> float:
        return float(sum(c.share * fn(c) for c in self.classes))


@dataclass(frozen=True, order=True)
class Knobs:
    """The policy settings the fluid model and the MILP choose among: the knob table's
    modeled knobs (``servetune.knobs``), one field each, named as the policy field."""

    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int = 0
    kv_watermark: float = 0.0
    max_queued_requests: int | None = None
    max_queued_prompt_tokens: int | None = None

    FIELDS = {k.path: k.name for k in MODELED_KNOBS}  # dotted path -> field

    @staticmethod
    def from_policy(policy: Policy) -> Knobs:
        return Knobs(**{k.name: k.value(policy) for k in MODELED_KNOBS})

    def as_dotted(self) -> dict[str, Any]:
        return {path: getattr(self, name) for path, name in self.FIELDS.items()}


@dataclass(frozen=True)
class Platform:
    """The GPU x model the policy runs on: step-time model and KV pool, and the engine
    whose host cost per step the step time includes (``servetune.engines``)."""

    step_time: StepTimeModel
    kv_blocks: int
    block_size: int = 16
    engine: str = "vllm"

    @staticmethod
    def from_profile(profile: Profile, engine: str = "vllm") -> Platform:
        return Platform(profile.step_time, int(profile.kv_blocks()), int(profile.block_size),
                        engine)

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size


@dataclass(frozen=True)
class Target:
    """One class's SLO as the fluid model checks it: limits at quantile ``q``."""

    ttft_s: float | None
    tpot_s: float | None
    q: float

    @staticmethod
    def from_class_slo(slo: ClassSLO) -> Target:
        q = slo.percentile / 100.0 if slo.percentile is not None else float(slo.attainment)
        return Target(ttft_s=slo.ttft_s, tpot_s=slo.tpot_s, q=q)


def targets_for(load: LoadModel, slo: SLOSet) -> dict[str, Target]:
    """Per-class targets from an SLOSet (its ``default`` entry covers unnamed classes)."""
    return {c.name: Target.from_class_slo(slo.for_class(c.name)) for c in load.classes}


@dataclass(frozen=True)
class Calibration:
    """Multipliers on the model's predictions, fitted to simulator measurements."""

    ttft: float = 1.0
    tpot: float = 1.0
    kv: float = 1.0

    def as_dict(self) -> dict[str, float]:
        return {"ttft": self.ttft, "tpot": self.tpot, "kv": self.kv}


@dataclass
class FluidState:
    """The model's prediction for one policy at one load (vectorised over ``x``)."""

    x: np.ndarray  # arrivals per step
    step_s: np.ndarray
    rate_per_s: np.ndarray
    decode_seqs: np.ndarray
    prefill_tokens: np.ndarray
    tokens: np.ndarray
    budget_util: np.ndarray
    prefill_util: np.ndarray
    running: np.ndarray
    running_q: np.ndarray
    kv_mean_tokens: np.ndarray
    kv_q_tokens: np.ndarray
    ttft_q_s: dict[str, np.ndarray]
    tpot_q_s: dict[str, np.ndarray]
    queued_q: np.ndarray
    queued_prompt_tokens_q: np.ndarray

    def at(self, i: int = 0) -> dict[str, Any]:
        """The prediction at index ``i`` as plain floats (for logs and reports)."""
        def f(a: np.ndarray) -> float:
            return float(np.asarray(a).reshape(-1)[i])
        return {
            "arrivals_per_step": f(self.x),
            "step_s": f(self.step_s),
            "steps_per_s": 1.0 / f(self.step_s),
            "rate_per_s": f(self.rate_per_s),
            "decode_seqs": f(self.decode_seqs),
            "prefill_tokens_per_step": f(self.prefill_tokens),
            "tokens_per_step": f(self.tokens),
            "budget_util": f(self.budget_util),
            "prefill_util": f(self.prefill_util),
            "running": f(self.running),
            "running_q": f(self.running_q),
            "kv_mean_tokens": f(self.kv_mean_tokens),
            "kv_q_tokens": f(self.kv_q_tokens),
            "ttft_q_s": {k: f(v) for k, v in self.ttft_q_s.items()},
            "tpot_q_s": {k: f(v) for k, v in self.tpot_q_s.items()},
            "stable": bool(f(self.budget_util) < BUDGET_UTIL_MAX and f(self.prefill_util) < 1),
        }


@dataclass(frozen=True)
class Limit:
    """The largest arrivals-per-step one condition allows, and the value at x -> 0."""

    condition: Condition
    x_max: float
    floor_value: float | None = None  # the metric's value at vanishing load
    target: float | None = None


def binding_limit(limits: dict[Condition, Limit]) -> Limit:
    """The tightest of a point's limits (the smallest ``x_max``; ties go to the first
    condition by key, so the choice is deterministic)."""
    return min(limits.values(), key=lambda lim: (lim.x_max, lim.condition.key))


@dataclass
class FluidModel:
    load: LoadModel
    platform: Platform
    targets: dict[str, Target]
    calibration: Calibration = field(default_factory=Calibration)
    capacity_quantile: float = DEFAULT_CAPACITY_QUANTILE

    def __post_init__(self) -> None:
        ld = self.load
        self.prompt_mean = ld.mean(lambda c: c.prompt_mean)
        self.prompt_sq = ld.mean(lambda c: c.prompt_sq_mean)
        self.output_mean = ld.mean(lambda c: c.output_mean)
        self.decode_rows = ld.mean(lambda c: c.output_mean - 1.0)
        self.context = ld.mean(lambda c: c.decode_context_per_request)
        self.pairs = 0.5 * self.prompt_sq
        self.tokens = self.prompt_mean + self.decode_rows
        self.ca2 = ld.mean(lambda c: c.interarrival_cv**2)
        self.cs2 = max(self.prompt_sq / self.prompt_mean**2 - 1.0, 0.0)
        self.coef, self.pieces = self.platform.step_time.as_arrays(self.platform.engine)
        self.tpot_z = {
            c.name: tpot_noise_quantiles(c, self.targets[c.name].q)
            for c in ld.classes if c.name in self.targets
        }
        self._shot_noise_moments()

    def _shot_noise_moments(self) -> None:
        """Moments for the shot-noise terms (module docstring): joint (P, O) bins per
        class, P and O independent within a class, as ``decode_context_per_request``
        takes them."""
        mids = (np.arange(_N_JOINT_BINS) + 0.5) / _N_JOINT_BINS
        ps, os_, ws = [], [], []
        for c in self.load.classes:
            p = np.interp(mids, _Q_TABLE, np.asarray(c.prompt_table, dtype=np.float64))
            o = np.interp(mids, _Q_TABLE, np.asarray(c.output_table, dtype=np.float64))
            pp, oo = np.meshgrid(p, o, indexing="ij")
            ps.append(pp.ravel())
            os_.append(oo.ravel())
            ws.append(np.full(pp.size, c.share / pp.size))
        p, o, w = np.concatenate(ps), np.concatenate(os_), np.concatenate(ws)
        w = w / w.sum()
        rows = np.maximum(o - 1.0, 0.0)
        held = p + 0.5 * o  # tokens a decoding request holds, on average over its decode
        # The prompt marginal (per class, its bins weighted by share) for E[P min(P, c)].
        self._marginal_prompts = np.concatenate([pp[::len(mids)] for pp in ps])
        self._marginal_w = np.concatenate([np.full(len(mids), c.share / len(mids))
                                           for c in self.load.classes])
        self._marginal_w = self._marginal_w / self._marginal_w.sum()
        # KV variance: a request holds about P + O/2 tokens over its O - 1 decode steps
        # and P over its P / c + 1/2 prefill steps.
        self._kv_decode_sq = float(np.sum(w * rows * held**2))
        self._prompt_sq_cube = (float(np.sum(w * p**2)), float(np.sum(w * p**3)))
        # Step time: one decode row costs its row terms plus its context read.
        c = self.coef
        constant = c[COEF_CONSTANT] > 0
        row_s = 0.0 if constant else float(
            c[COEF_DECODE_SEQ] + c[COEF_LM_ROW] + c[COEF_HOST_SEQ]
            + min(b for _, b in self.pieces) + c[COEF_ALLREDUCE])
        ctx_s = 0.0 if constant else float(c[COEF_DECODE_CTX])
        self._decode_time_sq = float(np.sum(w * rows * (row_s + ctx_s * held) ** 2))
        # A decoding neighbour's load lasts its residual decode life (steps).
        life = float(np.sum(w * rows))
        self._decode_tau = (float(np.sum(w * rows * rows)) / (2.0 * life)) if life > 0 else 1.0
        # Prefill shots: a prompt of P tokens costs a P + b P^2 / 2 seconds of steps
        # (a per token, b per attention pair), however it is chunked.
        self._chunk_token_s = 0.0 if constant else float(
            max(b for _, b in self.pieces) + c[COEF_ALLREDUCE])
        self._pair_s = 0.0 if constant else float(c[COEF_PREFILL_PAIR])
        edges = _SHOT_PROMPT_EDGES
        smids, widths = 0.5 * (edges[1:] + edges[:-1]), np.diff(edges)
        sp = np.concatenate([np.interp(smids, _Q_TABLE, np.asarray(c.prompt_table, float))
                             for c in self.load.classes])
        sw = np.concatenate([widths * c.share for c in self.load.classes])
        self._shot_prompts = sp
        self._shot_w = sw / sw.sum()
        self._shot_s = self._chunk_token_s * sp + 0.5 * self._pair_s * sp * sp
        omids = (np.arange(_N_SHOT_OUTPUT_BINS) + 0.5) / _N_SHOT_OUTPUT_BINS
        self._shot_rows = {}
        self._excess_tables: dict[tuple[str, float], tuple[np.ndarray, ...]] = {}
        for cl in self.load.classes:
            out = np.interp(omids, _Q_TABLE, np.asarray(cl.output_table, float))
            self._shot_rows[cl.name] = np.maximum(out[out >= 2.0] - 1.0, 1.0)

    def prompt_chunked_sq(self, chunk) -> np.ndarray:
        """``E[P min(P, c)]`` for chunk sizes ``c`` (vectorised): a prompt of ``P``
        tokens adds ``min(P, c)`` tokens to each of about ``P / c`` steps, so this is the
        per-arrival variance of the prefill tokens one step carries (``E[P^2]`` when a
        prompt fits one chunk)."""
        c = np.asarray(chunk, dtype=np.float64)
        p = self._marginal_prompts[:, None]
        out = np.sum(self._marginal_w[:, None] * p * np.minimum(p, c.reshape(1, -1)), axis=0)
        return out.reshape(c.shape)

    def prefill_excess_quantile(self, name: str, x, chunk, q: float
                                ) -> tuple[np.ndarray, np.ndarray]:
        """(mean, q-quantile over the class's requests) of the prefill time per decode
        step that other requests' prompts add to a request's decode steps, at loads ``x``
        with chunk sizes ``chunk`` (arrays of one shape).

        A request decodes for ``L = O - 1`` steps; a prompt of ``P`` tokens is prefilled
        over ``n = ceil(P / c)`` consecutive steps and costs ``T(P) = a P + b P^2 / 2``.
        About ``x (L + n)`` prompts overlap the request's steps, sharing on average ``L n /
        (L + n)`` of their steps with it, so the request's extra time is a compound sum of
        ``x (L + n)`` shots of ``T(P) L / (L + n)`` (mean ``x L E[T]``, as the mean step
        says; Poisson overlaps: bursts are the other TPOT term's, in :meth:`state`). Per
        decode step that is
        the sum over L: short outputs that meet a long prompt's chunks set the tail, and a
        chunk cap spreads a prompt thinly over more requests.

        The quantile is solved once per class on a grid of loads and chunk sizes
        (:meth:`_prefill_excess_solve`) and interpolated bilinearly in their logarithms,
        which keeps it monotone in both (the limits' bisection calls this thousands of
        times); outside the load grid it scales in proportion to ``x``."""
        x = np.asarray(x, dtype=np.float64)
        chunk = np.broadcast_to(np.asarray(chunk, dtype=np.float64), x.shape)
        mean = x * float(self._shot_w @ self._shot_s)
        key = (name, q)
        if key not in self._excess_tables:
            xs = np.geomspace(_EXCESS_X_RANGE[0], _EXCESS_X_RANGE[1], _EXCESS_X_POINTS)
            cs = np.geomspace(16.0, max(32.0, 2.0 * float(self._shot_prompts.max())),
                              _EXCESS_CHUNK_POINTS)
            gx, gc = np.meshgrid(xs, cs, indexing="ij")
            table = self._prefill_excess_solve(name, gx.ravel(), gc.ravel(), q)
            self._excess_tables[key] = (np.log(xs), np.log(cs), table.reshape(gx.shape))
        lx, lc, table = self._excess_tables[key]
        ux = np.log(np.maximum(x, 1e-300))
        uc = np.clip(np.log(np.maximum(chunk, 1.0)), lc[0], lc[-1])
        inside = np.clip(ux, lx[0], lx[-1])
        i = np.clip(np.searchsorted(lx, inside) - 1, 0, len(lx) - 2)
        j = np.clip(np.searchsorted(lc, uc) - 1, 0, len(lc) - 2)
        fx = (inside - lx[i]) / (lx[i + 1] - lx[i])
        fc = (uc - lc[j]) / (lc[j + 1] - lc[j])
        value = ((1 - fx) * (1 - fc) * table[i, j] + fx * (1 - fc) * table[i + 1, j]
                 + (1 - fx) * fc * table[i, j + 1] + fx * fc * table[i + 1, j + 1])
        value = value * np.exp(ux - inside)  # beyond the grid: in proportion to x
        return mean, np.where(x > 0, value, 0.0)

    def _prefill_excess_solve(self, name: str, x: np.ndarray, chunk: np.ndarray, q: float
                              ) -> np.ndarray:
        """The quantile of :meth:`prefill_excess_quantile`, solved directly: per output
        length, the larger tail of a lognormal with the sum's two moments (many overlaps)
        and of one big shot (few; the others add their mean); the mixture over the
        class's output lengths is solved for a share ``1 - q`` above by bisection in
        log space."""
        rows = self._shot_rows.get(name)
        mean = x * float(self._shot_w @ self._shot_s)
        if rows is None or len(rows) == 0 or mean.max() <= 0:
            return mean
        n = np.maximum(np.ceil(self._shot_prompts[None, :] / chunk[:, None] - 1e-9),
                       1.0)[:, None, :]  # (x, 1, P)
        L = rows[None, :, None]  # (1, O, 1)
        count = L + n
        size = self._shot_s[None, None, :] * L / count
        w = self._shot_w[None, None, :]
        k1 = x[:, None] * np.sum(w * count * size, axis=-1)  # (x, O)
        k2 = x[:, None] * np.sum(w * count * size * size, axis=-1)
        mu, sd = lognormal_shape(k1, k2)
        sd = np.maximum(sd, 1e-12)
        lrows = rows[None, :]
        rate = x[:, None, None] * w * count  # overlapping prompts per bin (x, O, P)

        def share_above(y: np.ndarray) -> np.ndarray:
            total = y[:, None] * lrows  # (x, O)
            smooth = normal_sf((np.log(np.maximum(total, 1e-300)) - mu) / sd)
            big = size > (total - k1)[:, :, None]
            jump = -np.expm1(-np.sum(np.where(big, rate, 0.0), axis=-1))
            return np.mean(np.maximum(smooth, jump), axis=1)

        # Above hi no request's excess can lie (past the largest shot over the mean, and
        # eight log-SDs into the lognormal's tail); below lo the quantile is 0 to the
        # precision that matters.
        hi = np.max((np.maximum(k1 + size.max(axis=-1), np.exp(mu + 8.0 * sd))) / lrows,
                    axis=1)
        lo = np.maximum(mean * 1e-6, 1e-300)
        for _ in range(_EXCESS_BISECTIONS):
            mid = np.sqrt(lo * hi)
            bad = share_above(mid) > 1.0 - q
            lo = np.where(bad, mid, lo)
            hi = np.where(bad, hi, mid)
        return np.where(mean > 0, hi, 0.0)

    def with_calibration(self, calibration: Calibration) -> FluidModel:
        # A copy, not dataclasses.replace: what __post_init__ derives (moments, TPOT noise
        # tables, prefill-excess tables) depends on the load, platform and targets only,
        # and recomputing it took 20 ms a calibration.
        new = copy.copy(self)
        new.calibration = calibration
        return new

    # Step time ------------------------------------------------------------------------
    def step_seconds(self, tokens, sampled, decode, context, pairs) -> np.ndarray:
        """The profile's step-time form, vectorised."""
        c, p = self.coef, self.pieces
        if c[COEF_CONSTANT] > 0:
            return np.full(np.shape(np.asarray(tokens, dtype=float)), c[COEF_CONSTANT])
        tokens = np.asarray(tokens, dtype=np.float64)
        gemm = np.max(p[:, 0][:, None] + p[:, 1][:, None] * tokens.reshape(1, -1), axis=0)
        gemm = gemm.reshape(tokens.shape)
        return (
            c[COEF_FIXED] + c[COEF_HOST_STEP] + gemm + c[COEF_ALLREDUCE] * tokens
            + c[COEF_DECODE_CTX] * context + c[COEF_DECODE_SEQ] * decode
            + c[COEF_PREFILL_PAIR] * pairs + (c[COEF_LM_ROW] + c[COEF_HOST_SEQ]) * sampled
        )

    def step_pieces(self) -> list[tuple[float, float]]:
        """Mean step time as ``max_k (c0_k + c1_k x)``: one (c0, c1) per GEMM piece.

        Steps are not all alike: most carry only decodes (``x (O - 1)`` rows, on the
        GEMM's memory-bound floor) and some also carry prefill chunks, whose tokens are
        compute-bound. Taking the GEMM at the *mean* token count would put the prefill
        tokens on the floor too (Jensen: the mean of a convex cost exceeds the cost at the
        mean), so prefill tokens are charged the steepest GEMM slope ``b_max`` and the
        decode rows the piecewise form: ``max_k (a_k + b_k x (O - 1)) + b_max x P``. Since
        every slope is at most ``b_max``, this bounds each step's GEMM from above, and is
        exact when decodes sit on the floor and prefill fills its share of the budget."""
        c = self.coef
        if c[COEF_CONSTANT] > 0:
            return [(float(c[COEF_CONSTANT]), 0.0)]
        linear = (
            c[COEF_ALLREDUCE] * self.tokens + c[COEF_DECODE_CTX] * self.context
            + c[COEF_DECODE_SEQ] * self.decode_rows + c[COEF_PREFILL_PAIR] * self.pairs
            + (c[COEF_LM_ROW] + c[COEF_HOST_SEQ]) * self.output_mean
        )
        b_max = float(max(b for _, b in self.pieces))
        prefill = b_max * self.prompt_mean
        return [
            (float(c[COEF_FIXED] + c[COEF_HOST_STEP] + a),
             float(b * self.decode_rows + prefill + linear))
            for a, b in self.pieces
        ]

    def mean_step_s(self, x) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        return np.max([c0 + c1 * x for c0, c1 in self.step_pieces()], axis=0)

    def x_at_rate(self, rate_per_s: float) -> float:
        """Arrivals per step at a given rate: t = max_k c0_k / (1 - c1_k rate); inf when
        the step-time fixed point does not exist (the GPU cannot keep up)."""
        t = 0.0
        for c0, c1 in self.step_pieces():
            if c1 * rate_per_s >= 1.0:
                return math.inf
            t = max(t, c0 / (1.0 - c1 * rate_per_s))
        return rate_per_s * t

    # The state ------------------------------------------------------------------------
    def state(self, knobs: Knobs, x) -> FluidState:
        return self.states(float(knobs.max_num_batched_tokens), _chunk_cap(knobs), x)

    def states(self, budget, chunk_cap, x) -> FluidState:
        """:meth:`state` with the token budget and the per-request chunk cap (inf: none)
        given as arrays of ``x``'s shape: the states of many step shapes at once."""
        x = np.atleast_1d(np.asarray(x, dtype=np.float64))
        cal = self.calibration
        step = self.mean_step_s(x)
        decode = x * self.decode_rows
        prefill = x * self.prompt_mean
        tokens = decode + prefill
        room = np.maximum(budget - decode, 1e-9)  # prefill tokens a step can take
        rho = np.where(budget - decode > 0, prefill / room, np.inf)
        chunk = np.minimum(room, chunk_cap)
        prefill_steps = self.prompt_mean / chunk + 0.5
        running = x * (self.decode_rows + prefill_steps)
        running_q = poisson_quantile_cf(running, self.capacity_quantile)
        # KV occupancy is shot noise: each request in the system holds its tokens (about
        # P while it prefills, P + O/2 while it decodes); its mean and variance are x
        # E[sum over its steps of held] and x E[sum of held^2] (M/G/inf), and its
        # quantile a lognormal's: heavy-tailed prompts put it far above the mean number of
        # requests times the mean holding.
        p_sq, p_cube = self._prompt_sq_cube
        kv_k1 = x * (self.context + self.prompt_sq / chunk + 0.5 * self.prompt_mean)
        kv_k2 = x * (self._kv_decode_sq + p_cube / chunk + 0.5 * p_sq)
        kv_mean = cal.kv * kv_k1
        kv_q = cal.kv * lognormal_quantile(kv_k1, kv_k2, self.capacity_quantile) + (
            0.5 * self.platform.block_size * running_q)

        # Prefill queue in steps. With a per-request chunk cap L the budget is shared by
        # c = room / L prompts at once (a G/G/c queue of servers of L tokens per step),
        # without one FCFS single server: Allen-Cunneen's wait with Sakasegawa's
        # probability of waiting, rho^(sqrt(2(c+1)) - 1) (= rho for c = 1, Kingman).
        with np.errstate(divide="ignore", invalid="ignore"):
            servers = np.maximum(np.floor(room / chunk), 1.0)
            service = self.prompt_mean * servers / room
            stable = rho < 1.0
            p_wait = np.where(
                stable, np.power(np.clip(rho, 0.0, 1.0), np.sqrt(2.0 * (servers + 1.0)) - 1.0),
                1.0,
            )
            wait_mean = np.where(
                stable,
                0.5 * (self.ca2 + self.cs2) * p_wait / (servers * (1.0 - rho)) * service,
                np.inf,
            )
            # Bursty arrivals (ca^2 > 1) find the queue busy more often than rho says.
            p_busy = np.minimum(1.0, p_wait * max(1.0, 0.5 * (self.ca2 + 1.0)))
        ttft: dict[str, np.ndarray] = {}
        tpot: dict[str, np.ndarray] = {}
        # Prompt tokens arriving per step: compound renewal counts, whose variance is the
        # Poisson one times the index of dispersion ca^2 (bursty traffic fills steps); a
        # prompt adds at most a chunk to each of its steps. The decode rows' context
        # reads make a step's time shot noise too.
        sd_prefill = np.sqrt(np.maximum(
            x * self.prompt_chunked_sq(chunk) * max(1.0, self.ca2), 0.0))
        sd_decode_s = np.sqrt(np.maximum(x * self._decode_time_sq, 0.0))
        pairs_per_token = self.pairs / self.prompt_mean
        context_per_row = self.context / max(self.decode_rows, 1e-9)
        for cls in self.load.classes:
            tgt = self.targets[cls.name]
            q = tgt.q
            with np.errstate(divide="ignore", invalid="ignore"):
                # Conditional on waiting, the wait is about exponential (mean W / p_busy).
                tail = np.where(
                    p_busy > 1.0 - q, np.log(np.maximum(p_busy, 1e-300) / (1.0 - q)), 0.0
                )
                wait_q = np.where(stable, wait_mean / np.maximum(p_busy, 1e-300) * tail, np.inf)
            prompt_q = cls.prompt_quantile(q)
            own_chunk = np.minimum(chunk, prompt_q)
            steps_q = np.ceil(prompt_q / chunk - 1e-9)
            pf_tokens = np.minimum(budget, decode + np.maximum(prefill, own_chunk))
            others = np.maximum(pf_tokens - decode - own_chunk, 0.0)
            pf_step = self.step_seconds(
                pf_tokens, x * self.output_mean, decode, decode * context_per_row,
                others * pairs_per_token,
            )
            # The request's own causal attention: P_q^2 / 2 pairs over its chunks, however
            # it is chunked (a long prompt's attention dominates its prefill).
            own_attention = self.coef[COEF_PREFILL_PAIR] * 0.5 * prompt_q * prompt_q
            if self.coef[COEF_CONSTANT] > 0:
                own_attention = 0.0
            ttft[cls.name] = cal.ttft * (
                wait_q * step + steps_q * pf_step + own_attention + 0.5 * step
            )
            # TPOT, two mechanisms, whichever is worse, at most a full step (the budget's
            # tokens attending as deep as the q-quantile prompt):
            # (a) bursts: a step carrying D decodes and Tp + z sqrt(x E[P min(P, c)] ca^2)
            # prefill tokens (compound renewal counts, capped by the room), with z the
            # q-quantile of that noise averaged over a request's decode steps, which
            # stay correlated for the prefill queue's relaxation time (Kingman's factor
            # (ca^2 + cs^2) / 2 over 1 - rho steps; :func:`tpot_noise_quantiles`);
            # (b) heavy prompts: a decode-only step plus the prefill time other prompts
            # add per decode step (:meth:`prefill_excess_quantile`) and the noise of the
            # neighbours' context reads, which last their residual decode life.
            z_tab = self.tpot_z.get(cls.name)
            burst = max(1.0, 0.5 * (self.ca2 + self.cs2))
            z = _tpot_z_at(burst / np.maximum(1.0 - rho, 1e-9), z_tab, q)
            hi_prefill = np.minimum(room, prefill + z * sd_prefill)
            bursts = self.step_seconds(
                decode + hi_prefill, decode + x, decode, decode * context_per_row,
                hi_prefill * pairs_per_token)
            pf_mean, pf_q = self.prefill_excess_quantile(cls.name, x, chunk, q)
            decode_noise = _tpot_z_at(self._decode_tau, z_tab, q) * sd_decode_s
            spread = np.sqrt(np.maximum(pf_q - pf_mean, 0.0) ** 2 + decode_noise**2)
            heavy = self.step_seconds(
                decode, decode + x, decode, decode * context_per_row, 0.0 * decode,
            ) + pf_mean + spread
            full_step = self.step_seconds(
                np.broadcast_to(budget, decode.shape), decode + x, decode, decode * context_per_row,
                np.broadcast_to(budget * prompt_q, decode.shape)) + decode_noise
            tpot[cls.name] = cal.tpot * np.minimum(np.maximum(bursts, heavy), full_step)
        in_system = running + x * np.where(np.isfinite(wait_mean), wait_mean, 1e12)
        queued_q = poisson_quantile_cf(in_system, self.capacity_quantile)
        in_prefill = x * (prefill_steps + np.where(np.isfinite(wait_mean), wait_mean, 1e12))
        queued_tokens_q = poisson_quantile_cf(in_prefill, self.capacity_quantile) * (
            self.prompt_mean
        )
        return FluidState(
            x=x, step_s=step, rate_per_s=x / step, decode_seqs=decode, prefill_tokens=prefill,
            tokens=tokens, budget_util=tokens / budget, prefill_util=rho, running=running,
            running_q=running_q, kv_mean_tokens=kv_mean, kv_q_tokens=kv_q, ttft_q_s=ttft,
            tpot_q_s=tpot, queued_q=queued_q, queued_prompt_tokens_q=queued_tokens_q,
        )

    def evaluate(self, knobs: Knobs, rate_per_s: float) -> dict[str, Any]:
        """The prediction at an arrival rate (``stable: False`` when it cannot keep up)."""
        x = self.x_at_rate(rate_per_s)
        if not math.isfinite(x):
            return {"rate_per_s": rate_per_s, "stable": False}
        out = self.state(knobs, x).at(0)
        out["stable"] = bool(out["stable"] and self.violations(knobs, x, only_stability=True)
                             == [])
        return out

    # Conditions -----------------------------------------------------------------------
    def condition_values(self, st: FluidState) -> dict[Condition, np.ndarray]:
        """Each condition's value in a state, whatever the policy's limits (the queue
        caps' too: a policy without them ignores theirs)."""
        out = {
            Condition(Family.BUDGET): st.budget_util,
            Condition(Family.SEATS): st.running_q,
            Condition(Family.KV_MEMORY): st.kv_q_tokens,
        }
        for name, tgt in self.targets.items():
            if tgt.ttft_s is not None:
                out[Condition(Family.TTFT, name)] = st.ttft_q_s[name]
            if tgt.tpot_s is not None:
                out[Condition(Family.TPOT, name)] = st.tpot_q_s[name]
        out[Condition(Family.QUEUE_REQUESTS)] = st.queued_q
        out[Condition(Family.QUEUE_PROMPT_TOKENS)] = st.queued_prompt_tokens_q
        return out

    def condition_limits(self, knobs: Knobs) -> dict[Condition, float]:
        """Each condition's limit under a policy: it holds where value <= limit."""
        return {cond: float(limit[0])
                for cond, limit in self.condition_limits_many([knobs]).items()
                if not math.isnan(limit[0])}

    def condition_limits_many(self, points: Sequence[Knobs]) -> dict[Condition, np.ndarray]:
        """:meth:`condition_limits` of many policies: each condition's limit per point,
        NaN where a policy does not have it (no queue cap). The conditions come in
        :meth:`condition_values`' order."""
        n = len(points)

        def per_point(value: Callable[[Knobs], float | None]) -> np.ndarray:
            return np.array([np.nan if (v := value(k)) is None else v for k in points],
                            dtype=np.float64)

        out = {
            Condition(Family.BUDGET): np.full(n, BUDGET_UTIL_MAX),
            Condition(Family.SEATS): per_point(lambda k: k.max_num_seqs),
            Condition(Family.KV_MEMORY): self.platform.kv_tokens * (
                1.0 - per_point(lambda k: k.kv_watermark)),
        }
        for name, tgt in self.targets.items():
            if tgt.ttft_s is not None:
                out[Condition(Family.TTFT, name)] = np.full(n, float(tgt.ttft_s))
            if tgt.tpot_s is not None:
                out[Condition(Family.TPOT, name)] = np.full(n, float(tgt.tpot_s))
        out[Condition(Family.QUEUE_REQUESTS)] = per_point(lambda k: k.max_queued_requests)
        out[Condition(Family.QUEUE_PROMPT_TOKENS)] = per_point(
            lambda k: k.max_queued_prompt_tokens)
        return out

    def conditions(
        self, knobs: Knobs, st: FluidState
    ) -> dict[Condition, tuple[np.ndarray, float]]:
        """Each condition as (value, limit): it holds where value <= limit."""
        values = self.condition_values(st)
        return {cond: (values[cond], limit)
                for cond, limit in self.condition_limits(knobs).items()}

    def violations(
        self, knobs: Knobs, x: float, *, only_stability: bool = False
    ) -> list[Condition]:
        """The conditions broken at ``x`` (only the stability ones with
        ``only_stability``)."""
        st = self.state(knobs, x)
        broken = []
        for cond, (value, limit) in self.conditions(knobs, st).items():
            if only_stability and not cond.stability:
                continue
            if not float(value[0]) <= limit:
                broken.append(cond)
        return broken

    def x_upper(self, knobs: Knobs) -> float:
        """No load beyond this keeps the budget stable."""
        return BUDGET_UTIL_MAX * knobs.max_num_batched_tokens / self.tokens

    def limits(
        self, knobs: Knobs, *, grid: int = 96, refine: int = 30
    ) -> dict[Condition, Limit]:
        """For each condition, the largest x that meets it (vectorised scan + bisection)."""
        return self.limits_many([knobs], grid=grid, refine=refine)[0]

    def limits_many(
        self, points: Sequence[Knobs], *, grid: int = 96, refine: int = 30
    ) -> list[dict[Condition, Limit]]:
        """:meth:`limits` for many points at once. The state depends only on the token
        budget and the chunk cap (seats, watermark and queue caps only move the limits),
        so the states of every step shape are one evaluation on a grid of loads, and
        each bisection step one evaluation for every limit still being narrowed."""
        shapes: dict[tuple[int, float], int] = {}
        shape_of = np.array([shapes.setdefault(
            (k.max_num_batched_tokens, _chunk_cap(k)), len(shapes)) for k in points],
            dtype=np.int64)
        if not shapes:
            return [{} for _ in points]
        budget = np.array([b for b, _ in shapes], dtype=np.float64)
        chunk_cap = np.array([c for _, c in shapes], dtype=np.float64)
        # x from 0 to the budget's stability bound, per shape: one row each
        base = np.concatenate([[1e-9], np.geomspace(1e-6, 1.0, grid)])
        xs = (BUDGET_UTIL_MAX * budget / self.tokens)[:, None] * base[None, :]
        cols = len(base)
        values = self.condition_values(self.states(
            np.repeat(budget, cols), np.repeat(chunk_cap, cols), xs.ravel()))
        # Per condition (those a point has: limit not NaN): the last grid load that meets
        # it, and where the grid crosses its limit the bracket to narrow by bisection.
        found: dict[Condition, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        narrow: list[tuple[Condition, np.ndarray]] = []  # (condition, which of its points)
        lo_l, up_l, limit_l, shape_l = [], [], [], []
        for cond, limit in self.condition_limits_many(points).items():
            has = np.flatnonzero(~np.isnan(limit))
            value = values[cond].reshape(len(shapes), cols)[shape_of[has]]
            bad = ~(value <= limit[has, None])
            first_bad = np.where(bad.any(axis=1), np.argmax(bad, axis=1), cols)
            rows = xs[shape_of[has]]
            x_max = np.where(first_bad == 0, 0.0,
                             rows[np.arange(len(has)), np.maximum(first_bad - 1, 0)])
            found[cond] = (has, x_max, value[:, 0], limit[has])
            crossing = (first_bad > 0) & (first_bad < cols)
            if crossing.any():
                at = np.flatnonzero(crossing)
                narrow.append((cond, at))
                lo_l.append(x_max[at])
                up_l.append(rows[at, first_bad[at]])
                limit_l.append(limit[has[at]])
                shape_l.append(shape_of[has[at]])
        if narrow:
            lo, up = np.concatenate(lo_l), np.concatenate(up_l)
            limits, of_shape = np.concatenate(limit_l), np.concatenate(shape_l)
            spans = np.cumsum([0] + [len(at) for _, at in narrow])
            for _ in range(refine):
                mid = 0.5 * (lo + up)
                at_mid = self.condition_values(
                    self.states(budget[of_shape], chunk_cap[of_shape], mid))
                value = np.concatenate([at_mid[cond][spans[j]:spans[j + 1]]
                                        for j, (cond, _) in enumerate(narrow)])
                good = value <= limits
                lo = np.where(good, mid, lo)
                up = np.where(good, up, mid)
            for j, (cond, at) in enumerate(narrow):
                found[cond][1][at] = lo[spans[j]:spans[j + 1]]
        out: list[dict[Condition, Limit]] = [{} for _ in points]
        for cond, (has, x_max, floor_value, limit) in found.items():
            for i, x, floor, target in zip(has.tolist(), x_max.tolist(),
                                           floor_value.tolist(), limit.tolist(), strict=True):
                out[i][cond] = Limit(cond, x, floor, target)
        return out

    def goodput(self, knobs: Knobs) -> tuple[float, Condition, dict[Condition, Limit]]:
        """(largest sustainable rate at the SLOs, the binding condition, all limits)."""
        lims = self.limits(knobs)
        binding = binding_limit(lims)
        x = binding.x_max
        rate = float(x / self.mean_step_s(x)) if x > 0 else 0.0
        return rate, binding.condition, lims


def _chunk_cap(knobs: Knobs) -> float:
    """The per-request prefill chunk cap in tokens (inf: none)."""
    return float(knobs.long_prefill_token_threshold) or math.inf


def knobs_grid(space_knobs: dict[str, list[Any]], base: Knobs | None = None) -> list[Knobs]:
    """Every valid Knobs combination of a search space (``max_num_batched_tokens >=
    max_num_seqs``, as vLLM requires); knobs the fluid model does not know are ignored
    here and handled by the caller."""
    base = base or Knobs(1024, 8192)
    space_knobs = {normalise_path(p): v for p, v in space_knobs.items()}
    names = [p for p in space_knobs if p in Knobs.FIELDS]
    out: list[Knobs] = []

    def rec(i: int, cur: dict[str, Any]) -> None:
        if i == len(names):
            k = replace(base, **{Knobs.FIELDS[p]: v for p, v in cur.items()})
            if k.max_num_batched_tokens >= k.max_num_seqs:
                out.append(k)
            return
        for v in space_knobs[names[i]]:
            cur[names[i]] = v
            rec(i + 1, cur)
        cur.pop(names[i], None)

    rec(0, {})
    return out
