"""Plots and JSON copies of a capacity plan and a background-job schedule.

``write_plan_report`` writes, into one folder, ``cost_by_type.png`` (the mixed plan's daily
cost split by GPU type, beside each single-type plan and, where topologies were compared,
the aggregated-only and disaggregated-only plans), ``replicas_over_day.png`` (GPUs of
each type per slot), ``cost_vs_growth.png`` (only with a growth sweep) and ``plan.json``.
``write_schedule_report`` writes ``spare_and_work.png`` (the spare tokens per slot and the
background work scheduled into them) and ``schedule.json``. Each set is committed as one
unit (:func:`servetune.io.commit_files`; a plan without a sweep removes an earlier
``cost_vs_growth.png``); plots use matplotlib's Agg backend through
:func:`servetune.apps.report.pyplot`, so no display is needed and the same plan gives the
same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from servetune.apps.report import figure_bytes, pyplot
from servetune.io import commit_files
from servetune.schemas.base import document_data
from servetune.schemas.fleet import CapacityPlan

PLOT_DPI = 110
SWEEP_PLOT = "cost_vs_growth.png"  # written only with a growth sweep


def plan_json_text(plan: CapacityPlan) -> str:
    """The plan as indented JSON (what ``plan.json`` and ``servetune plan --json`` hold)."""
    return json.dumps(document_data(plan), indent=2)


def write_plan_report(plan: CapacityPlan, folder: Path) -> list[Path]:
    """cost_by_type.png, replicas_over_day.png, (with a sweep) cost_vs_growth.png and
    plan.json, all written or none."""
    plt = pyplot()
    files: list[tuple[str, bytes]] = []
    # cost by GPU type: the mixed plan's split, and each single-type plan beside it
    fig, ax = plt.subplots(figsize=(7, 4))
    by_type = plan.cost["by_type_usd"]
    scale = 24.0 / (plan.n_slots * plan.slot_s / 3600.0)
    bottom = 0.0
    for t, c in by_type.items():
        if c > 0:
            ax.bar("mixed plan", c * scale, bottom=bottom, label=t)
            bottom += c * scale
    for t, v in plan.single_type.items():
        if isinstance(v, dict) and v.get("feasible"):
            ax.bar(f"{t} only", v["daily_usd"], color="0.6")
    # with topologies compared: the aggregated-only and disaggregated-only plans too
    for kind, v in plan.topology.get("comparison", {}).items():
        if kind not in ("mixed", "cheapest") and v.get("feasible"):
            ax.bar(f"{kind} only", v["daily_usd"], color="0.8")
    if plan.topology:
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)  # more bars than fit level
    ax.set_ylabel("cost per day ($)")
    ax.set_title("Cost by GPU type")
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(("cost_by_type.png", figure_bytes(fig, dpi=PLOT_DPI)))
    # replicas over the day
    fig, ax = plt.subplots(figsize=(7, 4))
    # one extra point so that the last slot is drawn as wide as the others
    hours = list(range(plan.n_slots + 1))
    stack = [[*gpus, gpus[-1]] for gpus in plan.gpus.values()]
    ax.stackplot(hours, stack, labels=list(plan.gpus), step="post")
    ax.set_xlabel("slot (hour of day)")
    ax.set_ylabel("GPUs")
    ax.set_title("GPUs over the day")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    files.append(("replicas_over_day.png", figure_bytes(fig, dpi=PLOT_DPI)))
    sweep = [r for r in plan.growth_sweep if r.get("feasible", True)]
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4))
        g = [r["growth"] for r in sweep]
        ax.plot(g, [r["daily_usd"] for r in sweep], "o-", label="mixed fleet")
        ax.plot(g, [r["best_single_daily_usd"] if r["best_single_daily_usd"] is not None
                    else float("nan") for r in sweep], "s--",
                label="best single type")
        ax.set_xlabel("load growth (x forecast)")
        ax.set_ylabel("cost per day ($)")
        ax.set_title("Cost versus load growth")
        ax.legend()
        fig.tight_layout()
        files.append((SWEEP_PLOT, figure_bytes(fig, dpi=PLOT_DPI)))
    files.append(("plan.json", plan_json_text(plan).encode("utf-8")))
    # owned even when absent: an earlier run's sweep plot must not outlive its plan
    return commit_files(folder, files, owned=[name for name, _ in files] + [SWEEP_PLOT])


def write_schedule_report(schedule: dict[str, Any], folder: Path) -> list[Path]:
    """spare_and_work.png (spare tokens per slot and the scheduled background work) and
    schedule.json, both written or neither."""
    plt = pyplot()
    n = schedule["horizon_slots"]
    slot_s = schedule["slot_s"]
    spare = [sum(v[h] for v in schedule["spare_tok_s"].values()) * slot_s for h in range(n)]
    used = [0.0] * n
    for r in schedule["jobs"]:
        for a in r.get("allocation", []):
            used[a["slot"]] += a["tokens"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(range(n), [s / 1e6 for s in spare], color="0.8", label="spare")
    ax.bar(range(n), [u / 1e6 for u in used], label="scheduled")
    ax.set_xlabel("slot (hour from midnight)")
    ax.set_ylabel("background tokens (millions)")
    ax.set_title("Background work in the capacity left free")
    ax.legend()
    fig.tight_layout()
    return commit_files(folder, [
        ("spare_and_work.png", figure_bytes(fig, dpi=PLOT_DPI)),
        ("schedule.json", json.dumps(schedule, indent=2).encode("utf-8")),
    ])
