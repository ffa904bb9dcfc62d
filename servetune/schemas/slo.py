"""SLO sets: per request class, latency limits and how they are judged.

Each class has limits on TTFT, TPOT and end-to-end time (any may be absent) and one
target: either ``percentile`` (e.g. 99: the p99 of every limited metric must be within
its limit, as in MLPerf's server scenario) or ``attainment`` (e.g. 0.9: at least that
share of requests meet every limit of their class, as DistServe and
``vllm bench serve --goodput`` define goodput). The class named ``default`` applies to
every class not listed. Shed and rejected requests count as misses, and a class may turn
away at most ``max_rejected_share`` of its requests (shed by a queue cap or rejected at
admission, e.g. by a watermark that turns the largest prompts away): 0 by default, so a
policy never meets a p99 target by refusing the requests that would break it unless the
user allows it.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from servetune.schemas.base import Document, Strict


class ClassSLO(Strict):
    ttft_s: float | None = Field(None, gt=0, allow_inf_nan=False,
                                 description="time to first token limit, seconds")
    tpot_s: float | None = Field(None, gt=0, allow_inf_nan=False,
                                 description="time per output token limit, seconds")
    e2e_s: float | None = Field(None, gt=0, allow_inf_nan=False,
                                description="end-to-end latency limit, seconds")
    percentile: float | None = Field(
        None, gt=0, lt=100, description="judge by this percentile of each metric (e.g. 99)"
    )
    attainment: float | None = Field(
        None, gt=0, le=1, description="judge by the share of requests meeting every limit"
    )
    max_rejected_share: float = Field(
        0.0, ge=0, le=1, allow_inf_nan=False,
        description="largest share of the class's requests that may be turned away (shed "
        "or rejected); 0: none",
    )

    @model_validator(mode="after")
    def _one_target(self) -> ClassSLO:
        if (self.percentile is None) == (self.attainment is None):
            raise ValueError("set exactly one of percentile (e.g. 99) or attainment (e.g. 0.9)")
        if self.ttft_s is None and self.tpot_s is None and self.e2e_s is None:
            raise ValueError("set at least one of ttft_s, tpot_s, e2e_s")
        return self

    def limits(self) -> dict[str, float]:
        """The metric limits present, by metric name (``ttft_s``, ``tpot_s``, ``e2e_s``)."""
        return {
            k: v
            for k, v in (("ttft_s", self.ttft_s), ("tpot_s", self.tpot_s), ("e2e_s", self.e2e_s))
            if v is not None
        }


class SLOSet(Document):
    KIND: ClassVar[str] = "SLOSet"
    kind: Literal["SLOSet"] = "SLOSet"
    name: str = "slo"
    source: str = ""
    classes: dict[str, ClassSLO] = Field(min_length=1)

    def for_class(self, class_name: str) -> ClassSLO:
        """The SLO of ``class_name``, falling back to ``default``."""
        if class_name in self.classes:
            return self.classes[class_name]
        if "default" in self.classes:
            return self.classes["default"]
        # A set with one class and no default applies to everything.
        if len(self.classes) == 1:
            return next(iter(self.classes.values()))
        raise KeyError(class_name)
