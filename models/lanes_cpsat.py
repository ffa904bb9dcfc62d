"""Long-request lanes (CP-SAT): the length threshold, and the seats and KV blocks
reserved for and capped to long requests, so that short requests keep their TTFT target
while long requests still progress.

A request is long when its prompt plus its class's mean output reaches the threshold
(the Policy's rule). For each candidate threshold the workload's quantiles give the long
share and the mean holding of long and short requests; Little's law gives the mean
number of each running at the operating rate (``n = rate * share * residency``), and
since concurrent requests of an M/G/inf system are Poisson, the chance constraints use
Poisson quantiles of those counts.

Sets
    H   candidate thresholds (tokens)
Parameters (per threshold h, from the workload and the operating point)
    QLs[h], QLb[h]   Poisson q-quantile of concurrent long requests, and their KV blocks
    QSs[h], QSb[h]   the same for short requests
    one_long[h]      KV blocks of one long request at a high prompt quantile
    ok[h]            1 when short requests' prefill meets the TTFT target under h
    B, K             max_num_seqs and the KV blocks left after the watermark
Variables
    u[h] in {0,1}    threshold h is chosen
    r, m             reserved seats and seat cap for long requests (integers)
    R, Mk            reserved KV blocks and KV-block cap for long requests (integers)
Constraints
    one_threshold:   sum_h u[h] = 1;   usable: u[h] = 0 where ok[h] = 0
    long_seats:      m >= sum_h QLs[h] u[h]           (long requests progress, at q)
    long_kv:         Mk >= sum_h QLb[h] u[h]
    reserve_one:     r >= 1;  R >= sum_h one_long[h] u[h]  (one long always fits)
    nested:          r <= m;  R <= Mk
    short_seats:     m + sum_h QSs[h] u[h] <= B       (short requests find a seat, at q)
    short_kv:        Mk + sum_h QSb[h] u[h] <= K
Objective
    minimize  W (m + r) / B + W (Mk + R) / K - sum_h rank[h] u[h]
    (the smallest lanes that keep long requests moving, leaving the rest to short ones;
    ``rank`` prefers larger thresholds (fewer requests treated as long) on ties, with
    weight W large enough that lane size always comes first)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from servetune.models.fluid import ClassLoad, FluidModel, Knobs, poisson_quantile

if TYPE_CHECKING:  # ortools loads only when a model is built
    from ortools.sat.python import cp_model

DEFAULT_THRESHOLDS = (2048, 4096, 8192, 16384, 32768, 65536)
_MIDS = (np.arange(800) + 0.5) / 800
OBJ_WEIGHT = 1000  # lane size units per unit of normalised size (rank is < 1 per unit)


@dataclass(frozen=True)
class LaneThreshold:
    threshold: int
    long_share: float
    long_seats_q: int  # QLs
    long_blocks_q: int  # QLb
    short_seats_q: int  # QSs
    short_blocks_q: int  # QSb
    one_long_blocks: int
    short_ttft_ok: bool


@dataclass(frozen=True)
class LaneInstance:
    thresholds: tuple[LaneThreshold, ...]
    max_num_seqs: int  # B
    kv_blocks: int  # K (after the watermark)
    total_kv_blocks: int

    def usable(self) -> list[int]:
        return [i for i, t in enumerate(self.thresholds) if t.short_ttft_ok]


@dataclass(frozen=True)
class LaneChoice:
    threshold_tokens: int
    reserved_seqs: int
    max_seqs: int
    reserved_kv_blocks: int
    max_kv_blocks: int
    total_kv_blocks: int

    def policy_fields(self) -> dict[str, Any]:
        """The Policy's ``long_requests`` section (fractions of the whole pool)."""
        return {
            "long_requests.threshold_tokens": self.threshold_tokens,
            "long_requests.reserved_seqs": self.reserved_seqs,
            "long_requests.reserved_kv_fraction": round(
                self.reserved_kv_blocks / self.total_kv_blocks, 6
            ),
            "long_requests.max_seqs": self.max_seqs,
            "long_requests.max_kv_fraction": round(self.max_kv_blocks / self.total_kv_blocks, 6),
        }


def _split(cls: ClassLoad, threshold: float) -> tuple[float, float, float, float, float]:
    """(long share, long mean prompt, short mean prompt, long high prompt, short high
    prompt at the 0.99 quantile of each part) of one class at a threshold."""
    prompts = np.interp(_MIDS, np.linspace(0, 1, len(cls.prompt_table)), cls.prompt_table)
    is_long = prompts + cls.output_mean >= threshold
    share = float(is_long.mean())
    long_p = prompts[is_long]
    short_p = prompts[~is_long]
    lm = float(long_p.mean()) if len(long_p) else 0.0
    sm = float(short_p.mean()) if len(short_p) else 0.0
    lh = float(np.quantile(long_p, 0.99)) if len(long_p) else 0.0
    sh = float(np.quantile(short_p, 0.99)) if len(short_p) else 0.0
    return share, lm, sm, lh, sh


def build_instance(
    fluid: FluidModel,
    knobs: Knobs,
    rate_per_s: float,
    *,
    thresholds: tuple[int, ...] = DEFAULT_THRESHOLDS,
    quantile: float = 0.99,
) -> LaneInstance:
    """Per-threshold parameters at an operating point (a policy and an arrival rate)."""
    x = fluid.x_at_rate(rate_per_s)
    if not math.isfinite(x):
        x = fluid.x_upper(knobs)
    step = float(fluid.mean_step_s(x))
    bs = fluid.platform.block_size
    budget = knobs.max_num_batched_tokens
    decode = x * fluid.decode_rows
    room = max(budget - decode, 1.0)
    chunk = min(room, knobs.long_prefill_token_threshold or math.inf)
    kv_free = int(fluid.platform.kv_blocks * (1.0 - knobs.kv_watermark))
    out = []
    for h in thresholds:
        long_rate = 0.0
        long_res = short_res = 0.0  # request-seconds in system per second (Little)
        long_kv = short_kv = 0.0  # token-seconds per second
        one_long = 0.0
        short_hi = 0.0
        for c in fluid.load.classes:
            share, lm, sm, lh, sh = _split(c, h)
            rate = rate_per_s * c.share
            dec = c.output_mean - 1.0
            for part, frac, mean_p in (("long", share, lm), ("short", 1 - share, sm)):
                if frac <= 0:
                    continue
                res_steps = dec + mean_p / chunk + 0.5
                seconds = res_steps * step
                holding = mean_p + c.output_mean / 2.0 + bs / 2.0
                if part == "long":
                    long_rate += rate * frac
                    long_res += rate * frac * seconds
                    long_kv += rate * frac * seconds * holding
                    one_long = max(one_long, lh + c.output_mean)
                else:
                    short_res += rate * frac * seconds
                    short_kv += rate * frac * seconds * holding
                    short_hi = max(short_hi, sh)
        ql = poisson_quantile(long_res, quantile)
        qs = poisson_quantile(short_res, quantile)
        long_hold = long_kv / long_res if long_res > 0 else 0.0
        short_hold = short_kv / short_res if short_res > 0 else 0.0
        # Short requests' TTFT with long ones out of the way: their own high prompt in
        # chunks, plus one step of wait.
        ttft_short = (math.ceil(short_hi / chunk) + 1.0) * step
        ttft_ok = all(
            t.ttft_s is None or ttft_short <= t.ttft_s for t in fluid.targets.values()
        )
        out.append(
            LaneThreshold(
                threshold=int(h),
                long_share=long_rate / max(rate_per_s, 1e-12),
                long_seats_q=max(int(ql), 1),
                long_blocks_q=int(math.ceil(ql * long_hold / bs)),
                short_seats_q=int(qs),
                short_blocks_q=int(math.ceil(qs * short_hold / bs)),
                one_long_blocks=int(math.ceil(one_long / bs)),
                short_ttft_ok=bool(ttft_ok and long_rate > 0),
            )
        )
    return LaneInstance(tuple(out), knobs.max_num_seqs, kv_free, fluid.platform.kv_blocks)


def objective_value(inst: LaneInstance, h: int, r: int, m: int, R: int, Mk: int) -> float:
    """The objective in the model's integer units (lower is better)."""
    n = len(inst.thresholds)
    rank = (h + 1) / (n + 1)  # larger thresholds are later in the list
    size = (m + r) / inst.max_num_seqs + (Mk + R) / inst.kv_blocks
    return OBJ_WEIGHT * size - rank


def feasible(inst: LaneInstance, h: int, r: int, m: int, R: int, Mk: int) -> bool:
    """The constraints of the module docstring, for one assignment (the test oracle)."""
    t = inst.thresholds[h]
    return (
        t.short_ttft_ok
        and m >= t.long_seats_q
        and Mk >= t.long_blocks_q
        and r >= 1
        and R >= t.one_long_blocks
        and r <= m
        and R <= Mk
        and m + t.short_seats_q <= inst.max_num_seqs
        and Mk + t.short_blocks_q <= inst.kv_blocks
        and r < inst.max_num_seqs
    )


@dataclass
class LaneModel:
    """The CP-SAT model of one instance, and how to read a solution back."""

    model: cp_model.CpModel
    u: dict[int, cp_model.IntVar]
    r: cp_model.IntVar
    m: cp_model.IntVar
    R: cp_model.IntVar
    Mk: cp_model.IntVar
    inst: LaneInstance

    def decode(self, solver: cp_model.CpSolver) -> LaneChoice:
        """The chosen threshold and lane sizes from a solved ``CpSolver``."""
        h = next(i for i in sorted(self.u) if solver.Value(self.u[i]))
        return LaneChoice(
            threshold_tokens=self.inst.thresholds[h].threshold,
            reserved_seqs=int(solver.Value(self.r)),
            max_seqs=int(solver.Value(self.m)),
            reserved_kv_blocks=int(solver.Value(self.R)),
            max_kv_blocks=int(solver.Value(self.Mk)),
            total_kv_blocks=self.inst.total_kv_blocks,
        )

    def objective_of(self, choice: LaneChoice) -> float:
        """The objective of a decoded choice in :func:`objective_value`'s units."""
        h = next(i for i, t in enumerate(self.inst.thresholds)
                 if t.threshold == choice.threshold_tokens)
        return objective_value(self.inst, h, choice.reserved_seqs, choice.max_seqs,
                               choice.reserved_kv_blocks, choice.max_kv_blocks)


NO_USABLE_THRESHOLD = "no threshold both splits off long requests and keeps short TTFT"


def build_model(inst: LaneInstance) -> LaneModel | None:
    """The CP-SAT model, named as in the module docstring; ``None`` when no threshold is
    usable (the model would be infeasible by ``usable`` alone)."""
    # lazy: OR-Tools takes 0.5 s to import; the optimizer imports this module on every
    # run, and builds a lane model only for some
    from ortools.sat.python import cp_model

    if not inst.usable():
        return None
    B, K = inst.max_num_seqs, inst.kv_blocks
    th = inst.thresholds
    model = cp_model.CpModel()
    u = {i: model.NewBoolVar(f"u[{th[i].threshold}]") for i in range(len(th))}
    r = model.NewIntVar(0, max(B - 1, 0), "r")
    m = model.NewIntVar(0, B, "m")
    R = model.NewIntVar(0, K, "R")
    Mk = model.NewIntVar(0, K, "Mk")
    model.AddExactlyOne(u.values())  # one_threshold
    for i, t in enumerate(th):
        if not t.short_ttft_ok:
            model.Add(u[i] == 0)  # usable
    model.Add(m >= sum(t.long_seats_q * u[i] for i, t in enumerate(th)))  # long_seats
    model.Add(Mk >= sum(t.long_blocks_q * u[i] for i, t in enumerate(th)))  # long_kv
    model.Add(r >= 1)  # reserve_one
    model.Add(R >= sum(t.one_long_blocks * u[i] for i, t in enumerate(th)))
    model.Add(r <= m)  # nested
    model.Add(R <= Mk)
    model.Add(m + sum(t.short_seats_q * u[i] for i, t in enumerate(th)) <= B)  # short_seats
    model.Add(Mk + sum(t.short_blocks_q * u[i] for i, t in enumerate(th)) <= K)  # short_kv
    # Integer objective: scale so the size terms dominate the rank tie-break exactly as
    # in objective_value (multiply through by B * K * (n + 1)).
    n = len(th)
    scale_seats = OBJ_WEIGHT * K * (n + 1)
    scale_blocks = OBJ_WEIGHT * B * (n + 1)
    model.Minimize(
        scale_seats * (m + r) + scale_blocks * (Mk + R)
        - sum(B * K * (i + 1) * u[i] for i in range(n))
    )
    return LaneModel(model, u, r, m, R, Mk, inst)
