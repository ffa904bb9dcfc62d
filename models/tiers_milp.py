"""Tier MILP: per-class priority, chunk cap and seat/KV caps, chosen jointly.

At a common load scale ``s`` the per-class model (:mod:`servetune.models.tiers`) gives
every quantity as a constant of the shared knobs, of one class's option, or of the
priority order; the classes couple through the shared seats, KV blocks and step budget,
through the prefill work each class leaves for the others (its chunk cap), and through the
order. The driver (:mod:`servetune.solvers.tiers`) bisects on ``s`` for the largest scale at
which the best margin is >= 0: the largest common load at which every tier meets its SLO.

Sets
    G   shared settings (max_num_seqs, max_num_batched_tokens, kv_watermark)
    C   request classes;  O[c]  class c's options (chunk cap, seat cap, KV cap)
    W   priority orders (weak orders of C as levels; 3 for two classes, 13 for three)
    L[k]  class k's chunk caps among its options
Parameters (at scale s; ``tiers.Terms``)
    wf[g,c,w]     seconds of class c's q-quantile TTFT per step of W0 under order w
                  (Cobham's factor 1/((1-a)(1-b)) with the exponential tail)
    w0[g,k,L]     class k's share of W0 (steps) when its chunk cap is L
    own[g,c,o]    class c's own prefill, attention and admission (cap) wait, seconds
    base[g,c], ex[g,c,k,L], burst[g,c]   TPOT: decode step, prefill excess of k's prompts
                  with chunk L on c's decode steps, burst floor (g where a full step
                  already meets c's TPOT have none)
    seat[g,c,o], kv[g,c,o]   class c's q-quantile seats and KV blocks within its caps
    ps[g], pk[g]  pooling factors; B[g], K[g]  seats and KV blocks (less watermark)
    T[c,f]        class c's limit of metric f (ttft, tpot, e2e);  Oq[c] its output quantile
Variables
    z[g], v[g,w], u[g,c,o] in {0,1}    the shared setting, the order, each class's option
    l[g,k,L] = sum of u[g,k,o] over o with chunk cap L  (an expression)
    W0[g] = sum_{k,L} w0[g,k,L] l[g,k,L]  (an expression; at most W0max[g], the sum over
                  k of its largest w0)
    y[g,w] >= 0, y >= W0[g] - W0max[g] (1 - v[g,w])   (= v[g,w] W0[g]: TTFT's only
                  product, order x the chunk caps; its coefficients are >= 0, so the
                  minimum is the product)
    m <= 1        the smallest relative margin over every SLO condition
Constraints
    one_shared: sum_g z = 1;  one_order[g]: sum_w v = z[g];  one_option[g,c]: sum_o u = z[g]
    ttft[c]:  TTFT[c] = sum wf[g,c,w] y[g,w] + sum own[g,c,o] u[g,c,o]
              TTFT[c] + T[c,ttft] m <= T[c,ttft]
    tpot[c]:  TPOT[c] = sum_g base[g,c] z[g] + sum ex[g,c,k,L] l[g,k,L];
              TPOT[c] + T[c,tpot] m <= T[c,tpot];  sum_g burst[g,c] z[g] + T m <= T
    e2e[c]:   TTFT[c] + (Oq[c] - 1) TPOT[c] + T[c,e2e] m <= T[c,e2e]
    seats:    sum ps[g] seat[g,c,o] u[g,c,o] <= sum_g B[g] z[g]
    kv:       sum pk[g] kv[g,c,o] u[g,c,o] <= sum_g K[g] z[g]
    (an unstable shared setting, option or order (a queue that never drains) is fixed to 0)
Objective
    maximize  m - eps (sum cost[o] u[g,c,o] + sum (levels[w] - 1) v[g,w])
    (the largest margin; among equal margins the simplest policy: fewest per-class
    settings, fewest priority levels)
Second stage (where the margin is >= 0): with m >= m* fixed,
    minimize  sum_c TTFT[c] / T[c,ttft] + eps sum cost[o] u[g,c,o]
    (of the policies that keep the margin, the one that leaves the classes the most of
    their TTFT budgets: when the margin is set by something no per-class knob moves, such
    as TPOT or the GPU's throughput, the order and chunk caps still go where they shorten
    the queues of the tight tiers most)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyomo.environ as pyo

from servetune.models.tiers import ClassOption, Shared, Terms, TierModel, orderings

TIE_WEIGHT = 1e-5  # per setting or extra priority level; well below a margin that matters
MARGIN_FLOOR = -10.0  # the margin's lower bound (keeps the LP bounded)
MARGIN_SLACK = 1e-6  # the second stage keeps the first stage's margin to this


@dataclass(frozen=True)
class TierChoice:
    """The MILP's answer at one scale."""

    margin: float
    shared: Shared
    levels: tuple[int, ...]  # priority level per class (model.names order)
    options: dict[str, ClassOption]


def build_model(model: TierModel, terms: list[Terms],
                options: dict[str, list[ClassOption]]) -> pyo.ConcreteModel:
    """The Pyomo model of the module docstring over the shared settings in ``terms``
    (one Terms per shared setting, all at one scale)."""
    names = list(model.names)
    orders = orderings(len(names))
    m = pyo.ConcreteModel(name="tiers_milp")
    m.G = pyo.Set(initialize=range(len(terms)), ordered=True)
    m.C = pyo.Set(initialize=names, ordered=True)
    m.W = pyo.Set(initialize=range(len(orders)), ordered=True)
    m.GCO = pyo.Set(dimen=3, ordered=True, initialize=[
        (g, c, o) for g in m.G for c in names for o in range(len(options[c]))])
    chunks = {c: sorted({opt.chunk_cap for opt in options[c]}) for c in names}
    m.GKL = pyo.Set(dimen=3, ordered=True, initialize=[
        (g, k, cap) for g in m.G for k in names for cap in chunks[k]])
    m.GW = pyo.Set(dimen=2, ordered=True, initialize=[(g, w) for g in m.G for w in m.W])

    m.z = pyo.Var(m.G, domain=pyo.Binary)
    m.v = pyo.Var(m.GW, domain=pyo.Binary)
    m.u = pyo.Var(m.GCO, domain=pyo.Binary)
    m.y = pyo.Var(m.GW, domain=pyo.NonNegativeReals)
    m.m = pyo.Var(bounds=(MARGIN_FLOOR, 1.0))

    def l_expr(g: int, k: str, cap: int):
        return sum(m.u[g, k, o] for o, opt in enumerate(options[k]) if opt.chunk_cap == cap)

    m.one_shared = pyo.Constraint(expr=sum(m.z[g] for g in m.G) == 1)
    m.one_order = pyo.Constraint(m.G, rule=lambda m, g: sum(m.v[g, w] for w in m.W) == m.z[g])
    m.one_option = pyo.Constraint(m.G, m.C, rule=lambda m, g, c: sum(
        m.u[g, c, o] for o in range(len(options[c]))) == m.z[g])
    # W0[g] and its bound; y[g,w] >= W0[g] - W0max[g] (1 - v[g,w]) is v W0 (TTFT's only
    # product) wherever TTFT presses y down, which its coefficients >= 0 make it do.
    def w0_expr(g: int):
        t = terms[g]
        return sum(t.classes[k].w0[cap] * l_expr(g, k, cap) for k in names
                   for cap in chunks[k]) if t.stable else 0
    w0_max = [sum(max(t.classes[k].w0[cap] for cap in chunks[k]) for k in names)
              if t.stable else 0.0 for t in terms]
    m.product = pyo.Constraint(m.GW, rule=lambda m, g, w: m.y[g, w]
                               >= w0_expr(g) - w0_max[g] * (1 - m.v[g, w]))

    # Unstable choices (a queue that never drains) are off.
    m.unstable = pyo.ConstraintList()
    for g, t in enumerate(terms):
        if not t.stable:
            m.unstable.add(m.z[g] == 0)
            continue
        for c in names:
            for o, opt in enumerate(options[c]):
                if not t.classes[c].stable[opt]:
                    m.unstable.add(m.u[g, c, o] == 0)
        for w, levels in enumerate(orders):
            if any(not math.isfinite(t.wait_factor[(c, levels)]) for c in names):
                m.unstable.add(m.v[g, w] == 0)

    def ttft(c: str):
        expr = 0
        for g, t in enumerate(terms):
            if not t.stable:
                continue
            for w, levels in enumerate(orders):
                f = t.wait_factor[(c, levels)]
                if math.isfinite(f) and f > 0:
                    expr += f * m.y[g, w]
            for o, opt in enumerate(options[c]):
                expr += t.classes[c].own_ttft_s[opt] * m.u[g, c, o]
        return expr

    def tpot(c: str, *, skip_free: bool):
        expr = 0
        for g, t in enumerate(terms):
            if not t.stable or (skip_free and t.tpot_free[c]):
                continue
            expr += t.tpot_base_s[c] * m.z[g]
            for k in names:
                for cap in chunks[k]:
                    expr += t.excess_s[(c, k, cap)] * l_expr(g, k, cap)
        return expr

    m.slo = pyo.ConstraintList()
    m.ttft_share = {}  # TTFT[c] / T[c,ttft], for the second stage
    for c in names:
        tgt = model.targets[c]
        if tgt.ttft_s is not None:
            expr = ttft(c)
            m.ttft_share[c] = expr / tgt.ttft_s
            m.slo.add(expr + tgt.ttft_s * m.m <= tgt.ttft_s)
        if tgt.tpot_s is not None:
            m.slo.add(tpot(c, skip_free=True) + tgt.tpot_s * m.m <= tgt.tpot_s)
            burst = sum(t.tpot_burst_s[c] * m.z[g] for g, t in enumerate(terms)
                        if t.stable and not t.tpot_free[c])
            m.slo.add(burst + tgt.tpot_s * m.m <= tgt.tpot_s)
        if c in model.e2e_s:
            limit = model.e2e_s[c]
            out_q = max((t.output_q[c] for t in terms if t.stable), default=1.0) - 1.0
            m.slo.add(ttft(c) + max(out_q, 0.0) * tpot(c, skip_free=False)
                      + limit * m.m <= limit)

    m.seats = pyo.Constraint(expr=sum(
        terms[g].seat_pool * terms[g].classes[c].seats[options[c][o]] * m.u[g, c, o]
        for (g, c, o) in m.GCO if terms[g].stable)
        <= sum(terms[g].shared.max_num_seqs * m.z[g] for g in m.G))
    m.kv = pyo.Constraint(expr=sum(
        terms[g].kv_pool * terms[g].classes[c].kv_blocks[options[c][o]] * m.u[g, c, o]
        for (g, c, o) in m.GCO if terms[g].stable)
        <= sum(terms[g].kv_capacity_blocks * m.z[g] for g in m.G))

    m.cost = sum(options[c][o].cost() * m.u[g, c, o] for (g, c, o) in m.GCO)
    m.obj = pyo.Objective(sense=pyo.maximize, expr=m.m - TIE_WEIGHT * (
        m.cost + sum((len(set(orders[w])) - 1) * m.v[g, w] for (g, w) in m.GW)))
    return m


def second_stage(m: pyo.ConcreteModel, margin: float) -> None:
    """Turn the solved model into its second stage: keep the margin (to ``MARGIN_SLACK``)
    and spend what is left of the classes' TTFT budgets as little as possible (the sum of
    TTFT[c] / T[c,ttft], the c-mu rule's spirit: priority to the classes whose prompts are
    short and whose limits are tight), fewest settings among equals."""
    m.obj.deactivate()
    m.keep_margin = pyo.Constraint(expr=m.m >= margin - MARGIN_SLACK)
    m.obj2 = pyo.Objective(sense=pyo.minimize, expr=sum(m.ttft_share.values())
                           + TIE_WEIGHT * m.cost)


def decode(m: pyo.ConcreteModel, terms: list[Terms], model: TierModel,
           options: dict[str, list[ClassOption]]) -> TierChoice:
    """The chosen shared setting, order and options."""
    orders = orderings(len(model.names))
    g = max(m.G, key=lambda i: pyo.value(m.z[i]))
    w = max(m.W, key=lambda i: pyo.value(m.v[g, i]))
    chosen = {c: options[c][max(range(len(options[c])), key=lambda o: pyo.value(m.u[g, c, o]))]
              for c in model.names}
    return TierChoice(margin=float(pyo.value(m.m)), shared=terms[g].shared,
                      levels=orders[w], options=chosen)
