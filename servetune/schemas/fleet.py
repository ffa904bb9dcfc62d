"""Inputs of capacity planning and background-job placement: Fleet, Forecast, Jobs.

- ``Fleet``: the GPU types one may buy or rent. Each names a profile (or one profile per
  model), its hourly price per GPU (with the source of the price), the GPUs one replica
  uses (its tensor-parallel degree), and optional limits on how many GPUs may be used.
  Fleet-wide: the utilization headroom (plan each type to at most this share of its
  simulated capacity), whether every type in use carries one spare replica (N+1), and
  the scaling: ``hourly`` (replicas follow the load, as with on-demand GPUs) or
  ``static`` (the same replicas all day, as with reserved GPUs; the night then leaves
  room for background jobs).
- ``Forecast``: per request class, the arrival rate over the day (24 hourly slots) or
  one peak rate, plus optional growth factors for what-if studies.
- ``Jobs``: background work (evaluations, synthetic data): per job its volume (a request
  count, or a token volume with its length distribution), release time, deadline, value,
  priority, and whether it may be paused and resumed.

``CapacityPlan`` is what ``servetune plan`` writes and ``servetune place`` reads.

Times are seconds from midnight of the forecast day; a deadline after 86,400 s falls on
the next day (the forecast repeats).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from servetune.engines import ENGINE_NAMES
from servetune.schemas.base import Document, Strict, check_nested
from servetune.schemas.policy import Policy
from servetune.schemas.workload import MAX_TOKENS_BOUND

SLOTS_PER_DAY = 24
SECONDS_PER_SLOT = 3600.0
MAX_HORIZON_S = 7 * 86400.0
MAX_GPUS = 1_000_000  # per GPU type: beyond any fleet; keeps the MILP's bounds finite
MAX_JOB_REQUESTS = 10**12  # beyond any background job; keeps the arithmetic in range


class GPUType(Strict):
    model_config = ConfigDict(allow_inf_nan=False)
    name: str = Field(min_length=1, description="short name used in plans (e.g. h100)")
    profile: str | None = Field(
        None, description="path of the Profile YAML (relative to the fleet file or cwd)"
    )
    profiles: dict[str, str] | None = Field(
        None, description="one Profile path per model name; the fleet's `model` picks one"
    )
    price_per_gpu_hour: float = Field(gt=0, description="on-demand price of one GPU, $/hour")
    price_source: str = Field("", description="where the price comes from (citation)")
    gpus_per_replica: int | None = Field(
        None, ge=1, le=64,
        description="GPUs per replica (tensor-parallel degree); default: the profile's",
    )
    max_gpus: int | None = Field(None, ge=0, le=MAX_GPUS,
                                 description="at most this many GPUs of this type")
    min_gpus: int = Field(0, ge=0, le=MAX_GPUS,
                          description="at least this many GPUs in every slot")

    @field_validator("name")
    @classmethod
    def _name_is_simple(cls, v: str) -> str:
        if not all(c.isalnum() or c in "-_." for c in v):
            raise ValueError("use letters, digits, '-', '_' or '.' only")
        return v

    @model_validator(mode="after")
    def _one_profile_source(self) -> GPUType:
        if (self.profile is None) == (self.profiles is None):
            raise ValueError("set exactly one of profile (a path) or profiles (model -> path)")
        if self.profiles is not None and not self.profiles:
            raise ValueError("profiles: name at least one model")
        if self.max_gpus is not None and self.min_gpus > self.max_gpus:
            raise ValueError(f"min_gpus ({self.min_gpus}) must be <= max_gpus ({self.max_gpus})")
        return self

    @property
    def replica_gpus(self) -> int:
        return self.gpus_per_replica or 1

    def price_per_replica_hour(self) -> float:
        return self.price_per_gpu_hour * self.replica_gpus

    def max_replicas(self) -> int | None:
        return None if self.max_gpus is None else self.max_gpus // self.replica_gpus

    def min_replicas(self) -> int:
        return -(-self.min_gpus // self.replica_gpus)

    def profile_path(self, model: str | None, base_dir: Path | None = None) -> Path:
        """The profile file for ``model`` (ignored when the type names one profile)."""
        if self.profile is not None:
            raw = self.profile
        else:
            assert self.profiles is not None
            if model is None:
                if len(self.profiles) != 1:
                    raise ValueError(
                        f"gpu_types[{self.name}].profiles names {sorted(self.profiles)}; "
                        "set the fleet's `model` (or argument `model`) to pick one"
                    )
                raw = next(iter(self.profiles.values()))
            elif model not in self.profiles:
                raise ValueError(
                    f"gpu_types[{self.name}].profiles has no model {model!r} "
                    f"(has {sorted(self.profiles)})"
                )
            else:
                raw = self.profiles[model]
        p = Path(raw)
        if not p.is_absolute() and base_dir is not None and (base_dir / p).exists():
            return base_dir / p
        return p


class Fleet(Document):
    KIND: ClassVar[str] = "Fleet"
    kind: Literal["Fleet"] = "Fleet"
    name: str = "fleet"
    model: str | None = Field(None, description="which model's profile to use per GPU type")
    gpu_types: list[GPUType] = Field(min_length=1)
    utilization_headroom: float = Field(
        0.85, gt=0, le=1, description="plan each replica to at most this share of its capacity"
    )
    redundancy: Literal["none", "n+1"] = Field(
        "none", description="n+1: every GPU type in use in a slot carries one spare replica"
    )
    scaling: Literal["hourly", "static"] = Field(
        "hourly", description="hourly: replicas follow the load each slot (on-demand); "
        "static: the same replicas all day (reserved GPUs, sized for the peak)"
    )

    @model_validator(mode="after")
    def _unique_names(self) -> Fleet:
        seen: set[str] = set()
        for i, g in enumerate(self.gpu_types):
            if g.name in seen:
                raise ValueError(f"gpu_types.{i}.name: duplicate GPU type name {g.name!r}")
            seen.add(g.name)
        return self

    def type_named(self, name: str) -> GPUType:
        for g in self.gpu_types:
            if g.name == name:
                return g
        raise KeyError(name)


class ClassForecast(Strict):
    rate_per_s: list[float] | None = Field(
        None, description="arrival rate in each hourly slot of the day (24 values), req/s"
    )
    peak_rate_per_s: float | None = Field(None, gt=0, description="one peak rate, req/s")

    @field_validator("rate_per_s")
    @classmethod
    def _day_of_rates(cls, v: list[float] | None) -> list[float] | None:
        if v is None:
            return v
        if len(v) != SLOTS_PER_DAY:
            raise ValueError(f"give {SLOTS_PER_DAY} hourly rates (got {len(v)})")
        for i, r in enumerate(v):
            if not (r >= 0 and r < float("inf")):
                raise ValueError(f"slot {i}: rate must be a finite number >= 0 (got {r})")
        return v

    @model_validator(mode="after")
    def _one_shape(self) -> ClassForecast:
        if (self.rate_per_s is None) == (self.peak_rate_per_s is None):
            raise ValueError("set exactly one of rate_per_s (24 hourly values) or peak_rate_per_s")
        return self

    def rates(self) -> list[float]:
        return list(self.rate_per_s) if self.rate_per_s is not None else [
            float(self.peak_rate_per_s or 0.0)
        ]


class Forecast(Document):
    KIND: ClassVar[str] = "Forecast"
    kind: Literal["Forecast"] = "Forecast"
    name: str = "forecast"
    source: str = ""
    classes: dict[str, ClassForecast] = Field(
        min_length=1, description="per workload class (or `default` for a one-class workload)"
    )
    growth: list[float] = Field(
        default_factory=lambda: [1.0],
        description="load multipliers for what-if scenarios (`servetune plan --growth forecast`)",
    )

    @field_validator("growth")
    @classmethod
    def _positive_growth(cls, v: list[float]) -> list[float]:
        if not v:
            raise ValueError("give at least one growth factor (e.g. [1.0])")
        for g in v:
            if not (g > 0 and g < float("inf")):
                raise ValueError(f"growth factors must be finite and > 0 (got {g})")
        return v

    @model_validator(mode="after")
    def _same_shape(self) -> Forecast:
        shapes = {name: c.rate_per_s is not None for name, c in self.classes.items()}
        if len(set(shapes.values())) > 1:
            raise ValueError(
                "classes: use rate_per_s (24 hourly values) for every class or "
                "peak_rate_per_s for every class, not a mix"
            )
        if sum(max(c.rates()) for c in self.classes.values()) <= 0:
            raise ValueError("classes: every rate is 0; nothing to plan for")
        return self

    @property
    def n_slots(self) -> int:
        return len(next(iter(self.classes.values())).rates())

    @property
    def slot_s(self) -> float:
        """Length of one slot: an hour for a daily forecast; a peak forecast is one hour
        at the peak rate (its cost is quoted per hour)."""
        return SECONDS_PER_SLOT

    def class_rates(self, growth: float = 1.0) -> dict[str, list[float]]:
        return {name: [r * growth for r in c.rates()] for name, c in self.classes.items()}


class LengthDistribution(Strict):
    """Token lengths of a job's requests: a lognormal with this mean and coefficient of
    variation, clipped to [min, max] (cv 0 gives every request the mean)."""

    model_config = ConfigDict(allow_inf_nan=False)
    mean: float = Field(gt=0, le=MAX_TOKENS_BOUND, description="mean tokens per request")
    cv: float = Field(0.5, ge=0, le=10, description="standard deviation / mean")
    min: int = Field(1, ge=1, le=MAX_TOKENS_BOUND)
    max: int | None = Field(None, ge=1, le=MAX_TOKENS_BOUND)

    @model_validator(mode="after")
    def _ordered(self) -> LengthDistribution:
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        if self.max is not None and self.mean > self.max:
            raise ValueError(f"mean ({self.mean}) must be <= max ({self.max})")
        return self


class Job(Strict):
    model_config = ConfigDict(allow_inf_nan=False)
    id: str = Field(min_length=1)
    requests: int | None = Field(None, ge=1, le=MAX_JOB_REQUESTS,
                                 description="number of requests")
    tokens: float | None = Field(
        None, gt=0, le=MAX_JOB_REQUESTS * MAX_TOKENS_BOUND,
        description="token volume (prompt + output); requests = tokens / mean size"
    )
    prompt_tokens: LengthDistribution
    output_tokens: LengthDistribution
    release_s: float = Field(0.0, ge=0, le=MAX_HORIZON_S,
                             description="earliest start, seconds from midnight")
    deadline_s: float = Field(gt=0, description="must finish by, seconds from midnight")
    value: float = Field(1.0, gt=0, le=1e12,
                         description="worth of completing the job by its deadline")
    priority: int = Field(
        0, ge=-(2**31), lt=2**31,
        description="among schedules of equal value, lower-priority-value jobs finish first"
    )
    preemptible: bool = Field(True, description="may pause between slots and move GPU types")

    @model_validator(mode="after")
    def _volume(self) -> Job:
        if (self.requests is None) == (self.tokens is None):
            raise ValueError("set exactly one of requests or tokens")
        if self.deadline_s > MAX_HORIZON_S:
            raise ValueError(f"deadline_s must be within 7 days ({MAX_HORIZON_S:.0f} s)")
        return self

    def mean_request_tokens(self) -> float:
        return self.prompt_tokens.mean + self.output_tokens.mean

    def n_requests(self) -> int:
        if self.requests is not None:
            return self.requests
        assert self.tokens is not None
        return max(1, round(self.tokens / self.mean_request_tokens()))

    def total_tokens(self) -> float:
        return self.n_requests() * self.mean_request_tokens()


class Jobs(Document):
    KIND: ClassVar[str] = "Jobs"
    kind: Literal["Jobs"] = "Jobs"
    name: str = "jobs"
    jobs: list[Job] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_ids(self) -> Jobs:
        seen: set[str] = set()
        for i, j in enumerate(self.jobs):
            if j.id in seen:
                raise ValueError(f"jobs.{i}.id: duplicate job id {j.id!r}")
            seen.add(j.id)
        return self


class PlanBucket(Strict):
    name: str
    prompt_tokens: list[int | None] = Field(description="[low, high) bounds; null = unbounded")
    output_tokens: list[int | None]
    share: float = Field(ge=0, le=1, description="share of the planned requests")


class PlanGPUType(Strict):
    name: str
    profile: str = Field(description="profile path (relative to the plan file when possible)")
    price_per_gpu_hour: float
    gpus_per_replica: int
    capacity_rate_per_s: dict[str, float] = Field(
        description="validated per-replica capacity per bucket, req/s (0 = cannot serve)"
    )
    policy: dict = Field(default_factory=dict, description="the Policy one replica runs")

    @field_validator("policy")
    @classmethod
    def _a_policy(cls, v: dict) -> dict:
        if v:  # `servetune place` simulates it: check it as the Policy file it would be
            check_nested(v, Policy)
        return v


# How `servetune plan` sampled the workload (CapacityPlan.sample): the keys `servetune
# place` samples it again with, and the least and most each may be.
PLAN_SAMPLE_INTS = {"requests": (1, 10_000_000), "seed": (0, 2**63 - 1),
                    "capacity_requests": (1, 10_000_000)}
PLAN_SAMPLE_EDGES = ("prompt_edges", "output_edges")


def _whole(v: Any, low: int, high: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


class CapacityPlan(Document):
    """What ``servetune plan`` writes and ``servetune place`` reads."""

    KIND: ClassVar[str] = "CapacityPlan"
    OMIT_WHEN_EMPTY: ClassVar[tuple[str, ...]] = ("excluded_gpu_types", "growth_sweep",
                                                  "topology")
    kind: Literal["CapacityPlan"] = "CapacityPlan"
    name: str = "plan"
    inputs: dict = Field(default_factory=dict, description="input paths and SHA-256 hashes")
    growth: float = Field(1.0, gt=0, allow_inf_nan=False)
    slot_s: float = Field(SECONDS_PER_SLOT, gt=0, le=MAX_HORIZON_S, allow_inf_nan=False)
    n_slots: int = Field(ge=1)
    engine: Literal[ENGINE_NAMES] = "vllm"  # type: ignore[valid-type]
    sample: dict = Field(default_factory=dict, description="how the workload was sampled")
    buckets: list[PlanBucket]
    gpu_types: list[PlanGPUType]
    replicas: dict[str, list[int]] = Field(description="replicas per GPU type and slot")
    gpus: dict[str, list[int]] = Field(description="GPUs per type and slot")
    routing: dict[str, dict[str, list[float]]] = Field(
        description="bucket -> GPU type -> share of the bucket's rate in each slot"
    )
    cost: dict = Field(default_factory=dict)
    single_type: dict = Field(default_factory=dict)
    validation: dict = Field(default_factory=dict)
    solver: dict = Field(default_factory=dict)
    excluded_gpu_types: dict[str, str] = Field(
        default_factory=dict, description="fleet GPU types left out of the plan, and why"
    )
    growth_sweep: list[dict] = Field(default_factory=list, description="what-if scenarios")
    topology: dict = Field(
        default_factory=dict,
        description="serving topologies compared (aggregated, prefill:decode units): per GPU "
        "type the one chosen, per unit its capacity, count and routing, and the cost of the "
        "aggregated-only, disaggregated-only and mixed plans (omitted: aggregated only)",
    )

    @field_validator("inputs")
    @classmethod
    def _input_paths(cls, v: dict) -> dict:
        for name, entry in v.items():
            if not (isinstance(entry, dict) and isinstance(entry.get("path"), str)
                    and entry["path"]):
                raise ValueError(f"{name}: expected {{path: FILE, sha256: HEX}}; "
                                 "run `servetune plan` again")
        return v

    @field_validator("sample")
    @classmethod
    def _sample(cls, v: dict) -> dict:
        for key, (low, high) in PLAN_SAMPLE_INTS.items():
            if key in v and not _whole(v[key], low, high):
                raise ValueError(f"{key}: expected a whole number in [{low}, {high}] "
                                 f"(got {v[key]!r:.40})")
        for key in PLAN_SAMPLE_EDGES:
            if key in v and not (isinstance(v[key], list)
                                 and all(_whole(e, 2, 10**9) for e in v[key])):
                raise ValueError(f"{key}: expected a list of token counts >= 2 "
                                 f"(got {v[key]!r:.40})")
        return v

    @field_validator("replicas", "gpus")
    @classmethod
    def _counts_per_slot(cls, v: dict[str, list[int]]) -> dict[str, list[int]]:
        for t, row in v.items():
            if not row or min(row) < 0:
                raise ValueError(f"{t}: expected a count >= 0 per slot (got {row!r:.40})")
        return v

    @field_validator("routing")
    @classmethod
    def _shares(cls, v: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, list[float]]]:
        for b, per_type in v.items():
            for t, row in per_type.items():
                if not all(math.isfinite(f) and f >= 0 for f in row):
                    raise ValueError(f"{b}.{t}: expected shares >= 0 (got {row!r:.40})")
        return v
