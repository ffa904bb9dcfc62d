"""Per-class reservations (CP-SAT): the seats and KV blocks each class is guaranteed.

Once the tier MILP (:mod:`servetune.models.tiers_milp`) has chosen the classes' caps and
order, what is left is purely combinatorial: how many of the shared seats and blocks to
set aside for each class, so that a burst of one class cannot take what another needs.
A reservation is only worth its q-quantile demand, and it must never starve another
class: whatever the others reserve, each class's own demand must still fit beside it.

Sets
    C   request classes
Parameters
    d[c], e[c]     class c's q-quantile seats and KV blocks (within its caps), rounded up
                   and at most B and K
    B, K           max_num_seqs and the KV blocks left after the watermark
    value[c]       the value of one of c's requests (its SLO tier's ``value``)
Variables
    r[c] in 0..d[c], R[c] in 0..e[c]   seats and KV blocks reserved for class c
Constraints
    leave_seats[j]:  d[j] + sum_{k != j} r[k] <= B      (j's demand fits beside the others'
    leave_kv[j]:     e[j] + sum_{k != j} R[k] <= K       reserves, even when they are idle)
    keep_one:        sum_c r[c] <= B - 1;  sum_c R[c] <= K - 1   (unreserved room remains)
Objective
    maximize  sum_c value[c] (W r[c] / d[c] + W R[c] / e[c])   (W scales to integers)
    (each class's demand covered, in proportion, weighted by what its requests are worth)
"""

from __future__ import annotations

from dataclasses import dataclass

SCALE = 10_000  # W: objective weights as integers


@dataclass(frozen=True)
class ReserveInstance:
    names: tuple[str, ...]
    seats: dict[str, int]  # d
    blocks: dict[str, int]  # e
    values: dict[str, float]
    max_num_seqs: int  # B
    kv_blocks: int  # K


def build_model(inst: ReserveInstance):
    """The CP-SAT model of the module docstring and its variables ``(r, R)``."""
    # lazy: OR-Tools (0.3 s) loads only when a model is built, not with the package
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    for c in inst.names:
        if not (0 <= inst.seats[c] <= inst.max_num_seqs and 0 <= inst.blocks[c] <= inst.kv_blocks):
            raise ValueError(f"class {c}: demand must lie within [0, B] seats and [0, K] blocks")
    r = {c: model.NewIntVar(0, max(int(inst.seats[c]), 0), f"r[{c}]") for c in inst.names}
    big_r = {c: model.NewIntVar(0, max(int(inst.blocks[c]), 0), f"R[{c}]") for c in inst.names}
    for j in inst.names:
        model.Add(inst.seats[j] + sum(r[k] for k in inst.names if k != j) <= inst.max_num_seqs)
        model.Add(inst.blocks[j] + sum(big_r[k] for k in inst.names if k != j)
                  <= inst.kv_blocks)
    model.Add(sum(r.values()) <= inst.max_num_seqs - 1)
    model.Add(sum(big_r.values()) <= inst.kv_blocks - 1)
    terms = []
    for c in inst.names:
        v = inst.values[c]
        if inst.seats[c] > 0:
            terms.append(int(round(SCALE * v / inst.seats[c])) * r[c])
        if inst.blocks[c] > 0:
            terms.append(int(round(SCALE * v / inst.blocks[c])) * big_r[c])
    model.Maximize(sum(terms))
    return model, r, big_r
