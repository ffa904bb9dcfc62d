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

SLO tiers: each class also has a ``value``, what one request served within its class's
limits is worth (1 by default), so a run reports the value it served per second beside
its attainment. Classes come from a trace's class column (a tenant, endpoint or priority
column mapped to ``class``), from a workload's class list, or from ``length_bands``:
when present, a request belongs to the first band whose ``max_prompt_tokens`` its prompt
does not exceed (the last band, ``max_prompt_tokens: null``, takes the rest), overriding
the trace's own labels (:func:`servetune.workloads.tiers.classify`).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

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
    value: float = Field(
        1.0, gt=0, allow_inf_nan=False,
        description="value of one request served within every limit of the class",
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


class LengthBand(Strict):
    """Requests whose prompt has at most ``max_prompt_tokens`` tokens (and more than the
    previous band's) belong to class ``class``; null: no upper bound (the last band)."""

    # "class" is a Python keyword: the field is class_name, the file's key is "class"
    model_config = ConfigDict(validate_by_alias=True, validate_by_name=False,
                              serialize_by_alias=True)
    class_name: str = Field(alias="class", min_length=1, description="class of the band")
    max_prompt_tokens: int | None = Field(
        ..., ge=1, description="largest prompt of the band, tokens; null: unbounded (last band)"
    )


class SLOSet(Document):
    KIND: ClassVar[str] = "SLOSet"
    # Files written before length bands existed keep their bytes.
    OMIT_WHEN_EMPTY: ClassVar[tuple[str, ...]] = ("length_bands",)
    kind: Literal["SLOSet"] = "SLOSet"
    name: str = "slo"
    source: str = ""
    classes: dict[str, ClassSLO] = Field(min_length=1)
    length_bands: list[LengthBand] | None = Field(
        None, min_length=1,
        description="classes by prompt length, increasing; the last band unbounded",
    )

    @model_validator(mode="after")
    def _bands(self) -> SLOSet:
        if self.length_bands is None:
            return self
        unknown = [b.class_name for b in self.length_bands if b.class_name not in self.classes]
        if unknown:
            raise ValueError(
                f"length_bands: class {unknown[0]!r} is not in classes "
                f"({', '.join(self.classes)}); add it there or fix the band's class"
            )
        bounds = [b.max_prompt_tokens for b in self.length_bands]
        if bounds[-1] is not None:
            raise ValueError(
                f"length_bands: the last band must be unbounded (max_prompt_tokens: null; "
                f"got {bounds[-1]}) so that every prompt falls in a band"
            )
        if any(b is None for b in bounds[:-1]):
            i = bounds.index(None)
            raise ValueError(
                f"length_bands: band {i + 1} of {len(bounds)} is unbounded (null); only the "
                "last band may be"
            )
        finite = [b for b in bounds[:-1] if b is not None]
        for i, (lo, hi) in enumerate(zip(finite, finite[1:], strict=False)):
            if hi <= lo:
                raise ValueError(
                    f"length_bands: max_prompt_tokens must increase band by band (band "
                    f"{i + 2} has {hi} after {lo})"
                )
        return self

    def band_classes(self) -> tuple[str, ...]:
        """The classes of ``length_bands`` in band order, each once (empty without bands)."""
        if self.length_bands is None:
            return ()
        return tuple(dict.fromkeys(b.class_name for b in self.length_bands))

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
