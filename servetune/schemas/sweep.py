"""Sweep: many optimize / nightly / plan jobs in one file, for ``servetune sweep``.

A sweep lists jobs one by one (``jobs``), as products of axes (``products``), or both::

    apiVersion: servetune/v1
    kind: Sweep
    name: shipped
    defaults: {requests: 300, max_simulations: 20}   # every job that takes them
    products:
      - command: optimize
        profiles: [h200-llama-3.1-8b, l40s-llama-3.1-8b]   # files or shipped names
        workloads: [../workloads/azure-conv-2023.yaml]
        slos: [../slos/mlperf-llama-3.1-8b-server.yaml]
        seeds: [0, 1]
    jobs:
      - command: plan
        workload: ../workloads/azure-conv-2023.yaml
        forecast: ../forecasts/azure-conv-peak-100.yaml
        fleet: ../fleets/cloud-4types.yaml
        slo: ../slos/mlperf-llama-3.1-8b-server.yaml

Relative paths resolve against the folder of the sweep file. A product takes each axis
(a plural name: ``profiles``, ``workloads``, ``traces``, ``slos``, ``spaces``,
``currents``, ``forecasts``, ``fleets``, ``growth``, ``engines``, ``seeds``, ``methods``)
or the one fixed value of that setting (the singular name), not both. Which settings a
command takes, and which it needs, is :data:`COMMAND_SETTINGS`; the expansion into jobs,
their names and input hashes is :mod:`servetune.apps.sweep`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from servetune.engines import ENGINE_NAMES
from servetune.schemas.base import Document, Strict
from servetune.schemas.job import METHODS

COMMANDS = ("optimize", "nightly", "plan")
CAPACITY_METHODS = ("auto", "optimizer", "candidates")


@dataclass(frozen=True)
class CommandSettings:
    """What one command takes: ``required`` (each a setting name, or a tuple of names of
    which exactly one is given) and ``optional``."""

    required: tuple[str | tuple[str, ...], ...]
    optional: tuple[str, ...]

    def takes(self, name: str) -> bool:
        flat = [n for r in self.required for n in ((r,) if isinstance(r, str) else r)]
        return name in flat or name in self.optional


COMMAND_SETTINGS: dict[str, CommandSettings] = {
    "optimize": CommandSettings(
        required=("profile", "slo", ("workload", "trace")),
        optional=("trace_format", "space", "method", "requests", "max_simulations",
                  "time_limit_s", "seed", "engine"),
    ),
    "nightly": CommandSettings(
        required=("trace", "profile", "slo", "current"),
        optional=("trace_format", "space", "max_simulations", "time_limit_s", "seed",
                  "engine", "gate_engines", "min_gain"),
    ),
    "plan": CommandSettings(
        required=("workload", "forecast", "fleet", "slo"),
        optional=("growth", "engine", "capacity_method", "budget", "model", "topologies",
                  "seed"),
    ),
}

# Settings that name input files (resolved against the sweep file; their bytes go into a
# job's input hash), in the order a job's name lists them.
FILE_SETTINGS = ("profile", "fleet", "workload", "trace", "forecast", "slo", "space",
                 "current")
# Each product axis and the setting it varies, in the order a job's name lists them.
AXES: dict[str, str] = {
    "profiles": "profile", "workloads": "workload", "traces": "trace", "slos": "slo",
    "spaces": "space", "currents": "current", "forecasts": "forecast", "fleets": "fleet",
    "growth": "growth", "engines": "engine", "seeds": "seed", "methods": "method",
}


class FixedSettings(Strict):
    """The settings of one job, every one optional here (the command says which it takes
    and needs); a file is a path relative to the sweep file (a profile may also be a
    shipped profile's name)."""

    profile: str | None = Field(None, min_length=1, description="Profile YAML or shipped name")
    workload: str | None = Field(None, min_length=1, description="Workload YAML")
    trace: str | None = Field(None, min_length=1, description="request trace file")
    trace_format: str | None = Field(None, description="trace format; detected when omitted")
    slo: str | None = Field(None, min_length=1, description="SLOSet YAML")
    space: str | None = Field(None, min_length=1, description="SearchSpace YAML")
    current: str | None = Field(None, min_length=1, description="nightly: the live Policy")
    forecast: str | None = Field(None, min_length=1, description="plan: Forecast YAML")
    fleet: str | None = Field(None, min_length=1, description="plan: Fleet YAML")
    method: Literal[METHODS] | None = None  # type: ignore[valid-type]
    requests: int | None = Field(None, ge=50, le=1_000_000)
    max_simulations: int | None = Field(None, ge=1, le=10_000_000)
    time_limit_s: float | None = Field(None, gt=0, le=86400)
    seed: int | None = Field(None, ge=0)
    engine: Literal[ENGINE_NAMES] | None = None  # type: ignore[valid-type]
    gate_engines: list[Literal[ENGINE_NAMES]] | None = Field(  # type: ignore[valid-type]
        None, min_length=1, description="nightly: engines to gate (default vllm, sglang)")
    min_gain: float | None = Field(None, ge=0, le=10)
    capacity_method: Literal[CAPACITY_METHODS] | None = None  # type: ignore[valid-type]
    budget: float | None = Field(None, gt=0)
    model: str | None = Field(None, min_length=1)
    topologies: str | None = Field(None, min_length=1, description="plan: e.g. agg,1:1")


class SweepDefaults(FixedSettings):
    """Settings for every job of the sweep that takes them (a job's own value wins)."""

    growth: float | None = Field(None, gt=0, le=1000)


class SweepJob(FixedSettings):
    """One job, given in full."""

    command: Literal[COMMANDS]  # type: ignore[valid-type]
    name: str | None = Field(None, min_length=1, max_length=120,
                             description="folder name under jobs/ (default: from its inputs)")
    growth: float | None = Field(None, gt=0, le=1000)


class SweepProduct(FixedSettings):
    """One job for every combination of its axes' values."""

    command: Literal[COMMANDS]  # type: ignore[valid-type]
    profiles: list[str] | None = Field(None, min_length=1)
    workloads: list[str] | None = Field(None, min_length=1)
    traces: list[str] | None = Field(None, min_length=1)
    slos: list[str] | None = Field(None, min_length=1)
    spaces: list[str] | None = Field(None, min_length=1)
    currents: list[str] | None = Field(None, min_length=1)
    forecasts: list[str] | None = Field(None, min_length=1)
    fleets: list[str] | None = Field(None, min_length=1)
    growth: list[float] | None = Field(None, min_length=1)
    engines: list[Literal[ENGINE_NAMES]] | None = Field(None, min_length=1)  # type: ignore[valid-type]
    seeds: list[int] | None = Field(None, min_length=1)
    methods: list[Literal[METHODS]] | None = Field(None, min_length=1)  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _axis_or_fixed(self) -> SweepProduct:
        for axis, setting in AXES.items():
            values = getattr(self, axis)
            if values is None:
                continue
            if axis != setting and getattr(self, setting) is not None:
                raise ValueError(f"give {setting} (one value) or {axis} (an axis), not both")
            if len(set(map(repr, values))) != len(values):
                raise ValueError(f"{axis}: a value is listed twice; list each once")
            if axis == "growth" and any(not (0 < g <= 1000) for g in values):
                raise ValueError("growth: give factors > 0 and <= 1000")
            if axis == "seeds" and any(s < 0 for s in values):
                raise ValueError("seeds: give seeds >= 0")
        return self

    def axes(self) -> dict[str, list[Any]]:
        """The axes this product varies (setting name -> values), in :data:`AXES` order."""
        return {setting: list(getattr(self, axis)) for axis, setting in AXES.items()
                if getattr(self, axis) is not None}

    def fixed(self) -> dict[str, Any]:
        """The settings every job of the product shares (those given)."""
        names = [n for n in FixedSettings.model_fields if getattr(self, n) is not None]
        return {n: getattr(self, n) for n in names}


class Sweep(Document):
    KIND: ClassVar[str] = "Sweep"
    kind: Literal["Sweep"] = "Sweep"
    name: str = Field("sweep", min_length=1)
    defaults: SweepDefaults = Field(default_factory=SweepDefaults)
    products: list[SweepProduct] = Field(default_factory=list)
    jobs: list[SweepJob] = Field(default_factory=list)

    @model_validator(mode="after")
    def _some_job(self) -> Sweep:
        if not self.products and not self.jobs:
            raise ValueError("products, jobs: give at least one job (a jobs: entry or a "
                             "products: entry)")
        return self
