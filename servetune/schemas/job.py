"""OptimizeJob: one file that names everything ``servetune optimize`` needs.

Relative paths resolve against the folder of the job file, so a job can be run from
anywhere. Exactly one of ``workload`` (a Workload YAML) and ``trace`` (a request trace
in any supported format) is given.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from servetune.engines import ENGINE_NAMES
from servetune.optimize_options import (
    DEFAULT_MAX_SIMULATIONS,
    DEFAULT_TIME_LIMIT_S,
    METHODS,
)
from servetune.schemas.base import Document


class OptimizeJob(Document):
    KIND: ClassVar[str] = "OptimizeJob"
    kind: Literal["OptimizeJob"] = "OptimizeJob"
    name: str = "optimize"
    workload: str | None = Field(None, description="Workload YAML (or give trace)")
    trace: str | None = Field(None, description="request trace file (or give workload)")
    trace_format: str | None = Field(None, description="trace format; detected when omitted")
    profile: str = Field(..., min_length=1, description="Profile YAML or shipped profile name")
    slo: str = Field(..., min_length=1, description="SLOSet YAML")
    space: str | None = Field(None, description="SearchSpace YAML; the default space if omitted")
    method: Literal[METHODS] = "milp"  # type: ignore[valid-type]
    max_simulations: int = Field(
        DEFAULT_MAX_SIMULATIONS, ge=1, le=10_000_000,
        description="work budget: simulations the search may start (decides the result)",
    )
    time_limit_s: float = Field(
        DEFAULT_TIME_LIMIT_S, gt=0, le=86400,
        description="wall-clock safety stop, seconds; when it fires metadata.stopped_by says so",
    )
    seed: int = Field(0, ge=0, description="seed of the workload sample and of random methods")
    requests: int | None = Field(
        None, ge=50, le=1_000_000,
        description="requests per simulation; null: a workload's 3000, a trace's every row "
        "(at most 20000)",
    )
    engine: Literal[ENGINE_NAMES] = "vllm"  # type: ignore[valid-type]
    per_class: bool | None = Field(
        None, description="also choose per-class settings (SLO tiers); null: when the SLO "
        "set gives the classes different tiers")
    output: str | None = Field(None, description="policy YAML to write (-o overrides)")
    summary_json: str | None = Field(
        None, description="summary JSON to write (--json-out overrides)"
    )

    @model_validator(mode="after")
    def _one_source(self) -> OptimizeJob:
        if (self.workload is None) == (self.trace is None):
            raise ValueError("give exactly one of workload or trace")
        return self
