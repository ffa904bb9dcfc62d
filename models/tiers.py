"""Per-class fluid model of one engine serving several SLO tiers.

The single-class model (:mod:`servetune.models.fluid`) pools every class into one FCFS
prefill queue. Here each class ``c`` keeps its own queueing, so that per-class knobs can
be chosen jointly: its priority level, its chunk cap and its seat and KV caps. At a
common load scale ``s`` (every class's rate times ``s``) the mean step time ``t`` and the
arrivals per step ``x_c = share_c x`` are fixed (the step time does not depend on these
knobs), so every quantity below is a constant of (``s``, the shared knobs ``g``, the class
option ``o``) or a sum of such constants over the classes. That is what makes the policy
MILP (:mod:`servetune.models.tiers_milp`) linear.

Per class ``c`` with option ``o`` (chunk cap ``L``; caps ``m`` seats, ``F`` of the KV
blocks), shared knobs ``g`` (seats ``B``, token budget ``M``, watermark ``w``):

- decode rows per step ``D = sum_c x_c (O_c - 1)``; prefill room ``R = M - D``; the class's
  chunk ``ch = min(L, R)``. A prompt of ``P`` tokens is ``S = a P + b P^2 / 2`` seconds of
  prefill work (``a`` per token, ``b`` per attention pair) plus the decode-only time of
  the ``ceil(P / ch)`` steps it rides on; ``rho_c = lambda_c E[a P + b P^2 / 2]`` is the
  share of the GPU's time the class's prompts take;
- prefill queue with priorities (Cobham's M/G/1 with non-preemptive priorities, made
  G/G/1 by Kingman's factor ``k = (ca^2 + cs^2) / (1 + cs^2)``): a class waits
  ``W_c = W0 / ((1 - a_c)(1 - b_c))``, ``a_c`` the load of the classes strictly before it
  and ``b_c`` that plus its own level's. ``W0 = k sum_k lambda_k min(1, ch_k / R)
  E[S_k^2] / 2`` is the work a newcomer finds in progress: a prompt that holds only a chunk
  ``ch < R`` of each step blocks others for that share of its service. (In steps of the
  mean step time, as the single-class model counts it, a 30k-token prompt's deep-attention
  steps were invisible, and the goodput of unchunked policies came out 2.1-2.3x too
  high.) The q-quantile wait uses an exponential tail ``W_c / p ln(p / (1 - q))`` with
  ``p`` the chance of waiting;
- TTFT = the wait, plus ``ceil(P_q / ch)`` prefill steps and the prompt's own attention
  (as the single-class model), plus, when a cap limits the class's running requests to
  ``n`` (``m``, or ``F K / E[footprint]``), the wait of an M/M/n admission queue (Erlang C)
  with the class's mean running set as offered load;
- TPOT = a decode-only step plus, summed over the classes ``k``, the prefill time class
  ``k``'s prompts add to a request's decode steps (:meth:`FluidModel.prefill_excess_quantile`
  with ``k``'s prompts and chunk; a sum of quantiles, so an upper bound), at least the
  burst term; nothing to check when even a full step (``M`` tokens) meets the target;
- end-to-end = TTFT + ``(O_q - 1)`` TPOT (an upper bound: a sum of quantiles);
- seats and KV: the class's Poisson (seats) and lognormal (KV, shot noise) q-quantile
  demand, held to its caps; their sum over the classes, times the pooling factor (the
  quantile of the pooled demand over the sum of the classes' quantiles, at no caps), fits
  ``B`` and ``K (1 - w)``.

``TierCalibration`` factors per class (fitted by :mod:`servetune.solvers.tiers` to what the
simulator measured) scale TTFT and TPOT, as the single-class loop does.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from servetune.models.fluid import (
    _Q_TABLE,
    COEF_CONSTANT,
    COEF_PREFILL_PAIR,
    FluidModel,
    Knobs,
    LoadModel,
    Platform,
    Target,
    _tpot_z_at,
    lognormal_quantile,
    poisson_quantile_cf,
)

_BINS = 200  # quantile bins per class for the moments below
BUDGET_UTIL_MAX = 0.995
ERLANG_LOAD_MAX = 0.98  # a capped class whose running set would fill more is unstable


@dataclass(frozen=True, order=True)
class ClassOption:
    """The per-class knobs the model chooses among for one class."""

    chunk_cap: int = 0  # tokens per step for each of the class's prompts; 0: no cap
    max_seqs: int | None = None  # running requests of the class; None: no cap
    max_kv_fraction: float = 1.0  # share of the KV blocks the class may hold

    def cost(self) -> int:
        """How many settings the option adds to the policy (a tie-break: simpler first)."""
        return int(self.chunk_cap > 0) + int(self.max_seqs is not None) + int(
            self.max_kv_fraction < 1.0)


@dataclass(frozen=True, order=True)
class Shared:
    """The knobs every class shares."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_watermark: float = 0.0


def orderings(n_classes: int) -> list[tuple[int, ...]]:
    """Every weak order of ``n_classes`` classes as priority levels (0 first, levels
    contiguous): 3 for two classes, 13 for three."""
    out = set()
    for levels in itertools.product(range(n_classes), repeat=n_classes):
        used = sorted(set(levels))
        if used == list(range(len(used))):
            out.add(levels)
    return sorted(out, key=lambda o: (len(set(o)), o))


@dataclass(frozen=True)
class TierCalibration:
    """Per-class multipliers on the predicted TTFT and TPOT."""

    ttft: dict[str, float] = field(default_factory=dict)
    tpot: dict[str, float] = field(default_factory=dict)

    def of(self, metric: str, name: str) -> float:
        return float(getattr(self, metric).get(name, 1.0))


@dataclass
class ClassTerms:
    """One class's constants at (scale, shared knobs), per option of the class."""

    rho: float  # share of the GPU's time its prompts' prefill takes
    w0: dict[int, float]  # by chunk cap: the class's share of W0 (seconds)
    own_ttft_s: dict[ClassOption, float]  # prefill steps, own attention, admission wait
    seats: dict[ClassOption, float]  # q-quantile running requests within its caps
    kv_blocks: dict[ClassOption, float]  # q-quantile KV blocks within its caps
    stable: dict[ClassOption, bool]


@dataclass
class Terms:
    """Every constant of the model at one scale and one setting of the shared knobs."""

    scale: float
    shared: Shared
    stable: bool  # the step-time fixed point exists and the budget keeps up
    classes: dict[str, ClassTerms] = field(default_factory=dict)
    wait_factor: dict[tuple[str, tuple[int, ...]], float] = field(default_factory=dict)
    tpot_base_s: dict[str, float] = field(default_factory=dict)
    tpot_burst_s: dict[str, float] = field(default_factory=dict)
    tpot_free: dict[str, bool] = field(default_factory=dict)  # a full step meets TPOT
    excess_s: dict[tuple[str, str, int], float] = field(default_factory=dict)  # (c, k, L)
    output_q: dict[str, float] = field(default_factory=dict)
    seat_pool: float = 1.0
    kv_pool: float = 1.0
    kv_capacity_blocks: float = 0.0


@dataclass(frozen=True)
class Evaluation:
    """One full assignment evaluated directly (no MILP): each condition as (value,
    limit), and the smallest relative margin ``1 - value / limit`` over the SLO ones."""

    feasible: bool
    margin: float
    conditions: dict[str, tuple[float, float]]

    def binding(self) -> str:
        """The condition closest to (or furthest past) its limit."""
        if not self.conditions:
            return "stability"
        return min(self.conditions, key=lambda k: (1.0 - self.conditions[k][0]
                                                   / self.conditions[k][1], k))


class TierModel:
    """The per-class model of the module docstring for one workload, GPU and SLO set."""

    def __init__(self, load: LoadModel, platform: Platform, targets: dict[str, Target],
                 *, e2e_s: dict[str, float] | None = None,
                 calibration: TierCalibration | None = None,
                 capacity_quantile: float = 0.99) -> None:
        self.load = load
        self.platform = platform
        self.targets = targets
        self.e2e_s = dict(e2e_s or {})
        self.calibration = calibration or TierCalibration()
        self.capacity_quantile = capacity_quantile
        self.names = tuple(c.name for c in load.classes)
        self.pooled = FluidModel(load, platform, targets, capacity_quantile=capacity_quantile)
        self._moments = {c.name: _class_moments(c) for c in load.classes}
        # Per pair (class c, source k): a model whose shots are k's prompts only and whose
        # rows are c's outputs (c at a vanishing share).
        self._pair_models: dict[tuple[str, str], FluidModel] = {}
        self._cache: dict[tuple, Terms] = {}

    def with_calibration(self, calibration: TierCalibration) -> TierModel:
        new = TierModel.__new__(TierModel)
        new.__dict__.update(self.__dict__)
        new.calibration = calibration
        new._cache = {}
        return new

    # ------------------------------------------------------------------ constants
    def _pair_model(self, c: str, k: str) -> FluidModel:
        if (c, k) not in self._pair_models:
            by = {cl.name: cl for cl in self.load.classes}
            classes = (replace(by[k], share=1.0),) if c == k else (
                replace(by[k], share=1.0), replace(by[c], share=1e-12))
            self._pair_models[(c, k)] = FluidModel(
                LoadModel(classes, 1.0), self.platform,
                {n.name: self.targets[n.name] for n in classes},
                capacity_quantile=self.capacity_quantile)
        return self._pair_models[(c, k)]

    def terms(self, scale: float, shared: Shared,
              options: dict[str, Sequence[ClassOption]]) -> Terms:
        """The constants at ``scale`` for ``shared`` and every option listed per class."""
        key = (scale, shared, tuple((n, tuple(options[n])) for n in self.names))
        if key in self._cache:
            return self._cache[key]
        out = self._terms(scale, shared, options)
        self._cache[key] = out
        return out

    def _terms(self, scale: float, shared: Shared,
               options: dict[str, Sequence[ClassOption]]) -> Terms:
        fm = self.pooled
        rate = scale * self.load.rate_per_s
        x = fm.x_at_rate(rate)
        terms = Terms(scale, shared, stable=False)
        if not math.isfinite(x) or x <= 0:
            return terms
        step = float(fm.mean_step_s(x))
        budget = float(shared.max_num_batched_tokens)
        xs = {c.name: c.share * x for c in self.load.classes}
        decode = sum(xs[c.name] * (c.output_mean - 1.0) for c in self.load.classes)
        room = budget - decode
        prefill = sum(xs[c.name] * c.prompt_mean for c in self.load.classes)
        if room <= 0 or (decode + prefill) / budget >= BUDGET_UTIL_MAX:
            return terms
        terms.stable = True
        q_cap = self.capacity_quantile
        bs = float(self.platform.block_size)
        kv_cap_blocks = self.platform.kv_blocks * (1.0 - shared.kv_watermark)
        terms.kv_capacity_blocks = kv_cap_blocks
        ca2 = fm.ca2
        cs2 = fm.cs2
        kingman = (ca2 + cs2) / (1.0 + cs2)
        coef = fm.coef
        constant = coef[COEF_CONSTANT] > 0
        ctx_per_row = fm.context / max(fm.decode_rows, 1e-9)
        pairs_per_token = fm.pairs / fm.prompt_mean
        running_pool = 0.0
        kv_k1_pool = kv_k2_pool = 0.0
        seat_sum = kv_sum = 0.0
        # A prompt of P tokens costs a P + b P^2 / 2 seconds of prefill (per token, per
        # attention pair) and rides on ceil(P / ch) steps' decode-only time.
        token_s, pair_s = fm._chunk_token_s, fm._pair_s
        decode_only_s = float(fm.step_seconds(
            np.array(decode), np.array(decode + x), np.array(decode),
            np.array(decode * ctx_per_row), np.array(0.0)))
        decode_step_s = 0.0 if constant else decode_only_s
        busy = 0.0
        for cl in self.load.classes:
            name = cl.name
            mom = self._moments[name]
            xc = xs[name]
            tgt = self.targets[name]
            rate_c = xc / step  # requests per second
            work = token_s * mom.prompts + 0.5 * pair_s * mom.prompts**2
            chunks = sorted({o.chunk_cap for o in options[name]} | {0})
            w0 = {}
            for cap in chunks:
                ch = min(float(cap) if cap > 0 else math.inf, room)
                service = work + np.ceil(mom.prompts / ch - 1e-9) * decode_step_s
                # A prompt holding ch of the step's R prefill tokens blocks a newcomer for
                # that share of its service (all of it when it takes the whole room).
                w0[cap] = kingman * rate_c * min(1.0, ch / room) * float(
                    np.mean(service**2)) / 2.0
            ct = ClassTerms(rho=rate_c * float(np.mean(work)), w0=w0, own_ttft_s={}, seats={},
                            kv_blocks={}, stable={})
            busy += ct.rho
            prompt_q = cl.prompt_quantile(tgt.q)
            for opt in options[name]:
                ch = min(float(opt.chunk_cap) if opt.chunk_cap > 0 else math.inf, room)
                steps_q = math.ceil(prompt_q / ch - 1e-9)
                own_chunk = min(ch, prompt_q)
                pf_tokens = min(budget, decode + max(prefill, own_chunk))
                others = max(pf_tokens - decode - own_chunk, 0.0)
                pf_step = float(fm.step_seconds(
                    np.array(pf_tokens), np.array(x * fm.output_mean), np.array(decode),
                    np.array(decode * ctx_per_row), np.array(others * pairs_per_token)))
                own_attention = 0.0 if constant else (
                    coef[COEF_PREFILL_PAIR] * 0.5 * prompt_q * prompt_q)
                running, k1, k2 = mom.demand(xc, ch)
                seats_q = float(poisson_quantile_cf(running, q_cap))
                kv_q = (float(lognormal_quantile(k1, k2, q_cap)) + 0.5 * bs * seats_q) / bs
                # The caps: at most n of the class run at once; beyond, it queues (M/M/n).
                n = math.inf
                if opt.max_seqs is not None:
                    n = float(opt.max_seqs)
                if opt.max_kv_fraction < 1.0:
                    n = min(n, math.floor(opt.max_kv_fraction * kv_cap_blocks
                                          / mom.footprint_blocks(bs)))
                admission_s = 0.0
                stable = True
                if math.isfinite(n):
                    if running >= ERLANG_LOAD_MAX * n or n < 1:
                        stable = False
                    else:
                        hold = running / xc if xc > 0 else 0.0
                        admission_s = step * erlang_wait_quantile(int(n), running, hold,
                                                                  tgt.q)
                    seats_q = min(seats_q, n)
                    kv_q = min(kv_q, opt.max_kv_fraction * kv_cap_blocks)
                ct.own_ttft_s[opt] = self.calibration.of("ttft", name) * (
                    steps_q * pf_step + own_attention + 0.5 * step + admission_s)
                ct.seats[opt] = seats_q
                ct.kv_blocks[opt] = kv_q
                ct.stable[opt] = stable
            # The uncapped demand, for the pooling factors.
            running0, k1, k2 = mom.demand(xc, room)
            running_pool += running0
            seat_sum += float(poisson_quantile_cf(running0, q_cap))
            kv_k1_pool += k1
            kv_k2_pool += k2
            kv_sum += float(lognormal_quantile(k1, k2, q_cap)) / bs
            terms.classes[name] = ct
        terms.seat_pool = min(1.0, float(poisson_quantile_cf(running_pool, q_cap))
                              / max(seat_sum, 1e-12))
        terms.kv_pool = min(1.0, float(lognormal_quantile(kv_k1_pool, kv_k2_pool, q_cap))
                            / bs / max(kv_sum, 1e-12))
        # Priority waits: the factor on W0 for each class under each ordering.
        if busy >= 1.0:  # the prompts' prefill alone would take all of the GPU's time
            terms.stable = False
            return terms
        p_busy = min(1.0, busy * max(1.0, 0.5 * (ca2 + 1.0)))
        for levels in orderings(len(self.names)):
            for i, name in enumerate(self.names):
                ahead = sum(terms.classes[n].rho for j, n in enumerate(self.names)
                            if levels[j] < levels[i])
                upto = sum(terms.classes[n].rho for j, n in enumerate(self.names)
                           if levels[j] <= levels[i])
                q = self.targets[name].q
                if upto >= 1.0:
                    factor = math.inf
                elif p_busy <= 1.0 - q:
                    factor = 0.0
                else:
                    factor = (1.0 / ((1.0 - ahead) * (1.0 - upto)) / p_busy
                              * math.log(p_busy / (1.0 - q)))
                terms.wait_factor[(name, levels)] = self.calibration.of("ttft", name) * factor
        # TPOT: per class, the decode-only step, the burst floor, and the excess each
        # source class's prompts add with each of its chunk caps.
        base_state = fm.state(Knobs(max_num_seqs=shared.max_num_seqs,
                                    max_num_batched_tokens=shared.max_num_batched_tokens,
                                    kv_watermark=shared.kv_watermark), x)
        sd_decode_s = math.sqrt(max(x * fm._decode_time_sq, 0.0))
        for cl in self.load.classes:
            name = cl.name
            tgt = self.targets[name]
            z_tab = fm.tpot_z.get(name)
            decode_noise = float(_tpot_z_at(fm._decode_tau, z_tab, tgt.q)) * sd_decode_s
            base = decode_only_s + decode_noise
            full = float(fm.step_seconds(
                np.array(budget), np.array(decode + x), np.array(decode),
                np.array(decode * ctx_per_row),
                np.array(budget * cl.prompt_quantile(tgt.q)))) + decode_noise
            cal = self.calibration.of("tpot", name)
            terms.tpot_base_s[name] = cal * base
            terms.tpot_free[name] = tgt.tpot_s is None or cal * full <= tgt.tpot_s
            terms.tpot_burst_s[name] = cal * min(float(base_state.tpot_q_s[name][0]), full)
            terms.output_q[name] = cl.output_quantile(tgt.q)
            for src in self.load.classes:
                pm = self._pair_model(name, src.name)
                for cap in terms.classes[src.name].w0:
                    ch = min(float(cap) if cap > 0 else math.inf, room)
                    _, quant = pm.prefill_excess_quantile(name, np.array([xs[src.name]]),
                                                             np.array([ch]), tgt.q)
                    terms.excess_s[(name, src.name, cap)] = cal * float(quant[0])
        return terms

    # ------------------------------------------------------------------ one assignment
    def evaluate(self, t: Terms, levels: tuple[int, ...],
                 choice: dict[str, ClassOption]) -> Evaluation:
        """The conditions of one full assignment under the constants ``t`` (which must
        cover its options), computed directly: the oracle the MILP's linearisation is
        checked against."""
        shared = t.shared
        if not t.stable:
            return Evaluation(False, -math.inf, {})
        conds: dict[str, tuple[float, float]] = {}
        ok = all(t.classes[n].stable[choice[n]] for n in self.names)
        w0 = sum(t.classes[n].w0[choice[n].chunk_cap] for n in self.names)
        for name in self.names:
            tgt = self.targets[name]
            ttft = t.wait_factor[(name, levels)] * w0 + t.classes[name].own_ttft_s[choice[name]]
            tpot = self.tpot_value(t, name, choice)
            if tgt.ttft_s is not None:
                conds[f"ttft[{name}]"] = (ttft, tgt.ttft_s)
            if tgt.tpot_s is not None and not t.tpot_free[name]:
                conds[f"tpot[{name}]"] = (tpot, tgt.tpot_s)
                conds[f"tpot_burst[{name}]"] = (t.tpot_burst_s[name], tgt.tpot_s)
            if name in self.e2e_s:
                conds[f"e2e[{name}]"] = (ttft + max(t.output_q[name] - 1.0, 0.0) * tpot,
                                         self.e2e_s[name])
        seats = t.seat_pool * sum(t.classes[n].seats[choice[n]] for n in self.names)
        kv = t.kv_pool * sum(t.classes[n].kv_blocks[choice[n]] for n in self.names)
        capacity = {"seats": (seats, float(shared.max_num_seqs)),
                    "kv_memory": (kv, t.kv_capacity_blocks)}
        ok = ok and all(v <= lim for v, lim in capacity.values())
        margin = min((1.0 - v / lim for v, lim in conds.values()), default=1.0)
        conds.update(capacity)
        return Evaluation(bool(ok and margin >= 0.0 and math.isfinite(margin)), margin, conds)

    def tpot_value(self, t: Terms, name: str, choice: dict[str, ClassOption]) -> float:
        """Class ``name``'s heavy-prompt TPOT under ``choice`` (the MILP's linear form)."""
        return t.tpot_base_s[name] + sum(t.excess_s[(name, k, choice[k].chunk_cap)]
                                         for k in self.names)


def erlang_wait_quantile(servers: int, offered: float, hold: float, q: float) -> float:
    """The q-quantile wait (in the units of ``hold``) of an M/M/n queue with ``servers``
    servers, ``offered`` = mean busy servers, and mean holding time ``hold``: Erlang C
    gives the chance of waiting ``C``; given a wait it is exponential with rate
    ``(n - a) / hold``, so the quantile is ``hold / (n - a) ln(C / (1 - q))`` when
    ``C > 1 - q``, else 0."""
    if offered <= 0:
        return 0.0
    # Erlang B by its stable recursion, then C.
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    rho = offered / servers
    c = b / (1.0 - rho + rho * b)
    if c <= 1.0 - q:
        return 0.0
    return hold / (servers - offered) * math.log(c / (1.0 - q))


@dataclass(frozen=True)
class _Moments:
    """One class's moments the model needs beyond :class:`ClassLoad`'s (prompt and output
    independent within the class, as the pooled model takes them)."""

    prompts: np.ndarray  # prompt tokens at the quantile bins' midpoints
    p2: float
    p3: float
    ctx: float  # E[(O - 1)(P + O/2)]
    ctx_sq: float  # E[(O - 1)(P + O/2)^2]
    output_mean: float
    prompt_mean: float

    def demand(self, arrivals: float, chunk: float) -> tuple[float, float, float]:
        """At ``arrivals`` per step and prompts prefilled ``chunk`` tokens a step: the
        mean running requests, and the mean and variance of the KV tokens they hold
        (shot noise, as :meth:`FluidModel.state` has it for the pooled classes)."""
        running = arrivals * (self.output_mean - 1.0 + self.prompt_mean / chunk + 0.5)
        k1 = arrivals * (self.ctx + self.p2 / chunk + 0.5 * self.prompt_mean)
        k2 = arrivals * (self.ctx_sq + self.p3 / chunk + 0.5 * self.p2)
        return running, k1, k2

    def footprint_blocks(self, block_size: float) -> float:
        """Mean lane footprint (blocks of prompt + output, as the kernel counts a cap)."""
        return (self.prompt_mean + self.output_mean) / block_size + 0.5


def _class_moments(cl) -> _Moments:
    mids = (np.arange(_BINS) + 0.5) / _BINS
    p = np.interp(mids, _Q_TABLE, np.asarray(cl.prompt_table, dtype=np.float64))
    o = np.interp(mids, _Q_TABLE, np.asarray(cl.output_table, dtype=np.float64))
    pp, oo = np.meshgrid(p, o, indexing="ij")
    rows = np.maximum(oo - 1.0, 0.0)
    held = pp + 0.5 * oo
    return _Moments(prompts=p, p2=float(np.mean(p * p)), p3=float(np.mean(p ** 3)),
                    ctx=float(np.mean(rows * held)), ctx_sq=float(np.mean(rows * held * held)),
                    output_mean=float(cl.output_mean), prompt_mean=float(cl.prompt_mean))
