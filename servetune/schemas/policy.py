"""Policy: the scheduling settings servetune chooses (the product).

Defaults reproduce ``vllm serve`` on a GPU with >= 70 GiB that is not an A100
(docs/engines.md 1.2-1.4): FCFS, 1024 sequences, 8192 batched tokens, no per-request chunk
cap, chunked prefill as the engine does it (``enable_chunked_prefill: null``: on in vLLM,
SGLang and TGI, off in ``trtllm-serve``; ``true`` or ``false`` asks every engine for it),
full prompt reserved at admission, watermark 0, no queue caps, no long-request lanes, prefix
caching as the engine does it (``caching.enable_prefix_caching: null``: on in all four engines;
``true`` or ``false`` asks every engine for it).

Long-request lanes (``long_requests``) are servetune's extension. A request is *long*
when its prompt plus expected output (its ``max_tokens`` when the request carries one,
otherwise its class's mean output) reaches ``threshold_tokens``. Then:

- ``reserved_seqs`` running seats and ``reserved_kv_fraction`` of the KV blocks may be
  used only by long requests (short requests are admitted only while they leave them free);
- long requests together never hold more than ``max_seqs`` seats or ``max_kv_fraction``
  of the KV blocks;
- a waiting long request that does not fit its lane does not block short requests behind it.

Per-class settings (``classes``, by class name: a trace's class labels, a workload's
classes or an SLO set's length bands) are the same kind of lane, one per class that sets
any of them (SLO tiers: chat, long-context, batch on one engine):

- ``priority``: the class's queue and preemption order under ``scheduling: priority``
  (lower first, vLLM's convention);
- ``reserved_seqs`` and ``reserved_kv_fraction``: running seats and KV blocks only this
  class may use (other requests are admitted only while they leave the class's unused
  reserve free), a guarantee;
- ``max_seqs`` and ``max_kv_fraction``: caps on what the class's running requests hold (KV
  counted by prompt + expected output, so the cap holds without preempting), a limit that
  protects the other classes;
- ``long_prefill_token_threshold``: the class's own per-request chunk cap (vLLM: it
  replaces ``batching.long_prefill_token_threshold`` for the class's requests);
- ``max_queued_requests``: the class's waiting + running requests; arrivals beyond are shed.

A class with a seat, KV or queue setting has a waiting queue of its own: a head request
that does not fit its class's lane does not block other classes. When long-request lanes
are on too, a long request belongs to the long lane, whatever its class.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from servetune.schemas.base import Document, Strict


class Batching(Strict):
    max_num_seqs: int = Field(1024, ge=1, description="max running requests (batch width)")
    max_num_batched_tokens: int = Field(8192, ge=1, description="token budget per engine step")
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="per-request per-step cap on new tokens; 0 = off"
    )
    enable_chunked_prefill: bool | None = Field(
        None, description="split prompts by the remaining step budget; off: a prompt that "
        "does not fit the remaining budget waits; null = the engine's own default (on in "
        "vLLM, SGLang and TGI, off in trtllm-serve)"
    )


class Admission(Strict):
    kv_watermark: float = Field(
        0.0, ge=0.0, lt=1.0, description="fraction of KV blocks kept free when admitting"
    )
    reserve_full_prompt: bool = Field(
        True, description="admit only when the whole prompt fits in KV (scheduler_reserve_full_isl)"
    )
    max_queued_requests: int | None = Field(
        None, ge=1, description="cap on waiting+running requests; arrivals beyond are shed (503)"
    )
    max_queued_prompt_tokens: int | None = Field(
        None, ge=1, description="cap on prompt tokens of requests still in prefill; beyond: shed"
    )


class LongRequests(Strict):
    threshold_tokens: int | None = Field(
        None, ge=1, description="prompt + expected output that makes a request long; None = off"
    )
    reserved_seqs: int = Field(0, ge=0, description="running seats only long requests may use")
    reserved_kv_fraction: float = Field(
        0.0, ge=0.0, le=1.0, description="share of KV blocks only long requests may use"
    )
    max_seqs: int | None = Field(None, ge=1, description="cap on running long requests")
    max_kv_fraction: float = Field(
        1.0, ge=0.0, le=1.0, description="cap on the share of KV blocks long requests hold"
    )

    @property
    def enabled(self) -> bool:
        return self.threshold_tokens is not None

    @model_validator(mode="after")
    def _consistent(self) -> LongRequests:
        if self.max_seqs is not None and self.reserved_seqs > self.max_seqs:
            raise ValueError(
                f"reserved_seqs ({self.reserved_seqs}) must be <= max_seqs ({self.max_seqs})"
            )
        if self.reserved_kv_fraction > self.max_kv_fraction:
            raise ValueError(
                f"reserved_kv_fraction ({self.reserved_kv_fraction}) must be <= "
                f"max_kv_fraction ({self.max_kv_fraction})"
            )
        return self


class Caching(Strict):
    enable_prefix_caching: bool | None = Field(
        None, description="reuse the KV blocks an earlier request computed for the same prompt "
        "prefix; null = the engine's own default (on in vLLM, SGLang, trtllm-serve and TGI)"
    )


class ClassPolicy(Strict):
    priority: int = Field(0, description="lower value is served first (vLLM convention)")
    reserved_seqs: int = Field(0, ge=0, description="running seats only this class may use")
    max_seqs: int | None = Field(None, ge=1, description="cap on the class's running requests")
    reserved_kv_fraction: float = Field(
        0.0, ge=0.0, le=1.0, allow_inf_nan=False,
        description="share of KV blocks only this class may use")
    max_kv_fraction: float = Field(
        1.0, ge=0.0, le=1.0, allow_inf_nan=False,
        description="cap on the share of KV blocks the class holds (prompt + expected output)")
    long_prefill_token_threshold: int | None = Field(
        None, ge=1, description="the class's per-request per-step chunk cap; None = the "
        "policy's batching.long_prefill_token_threshold")
    max_queued_requests: int | None = Field(
        None, ge=1, description="cap on the class's waiting + running requests; beyond: shed")

    @model_validator(mode="after")
    def _consistent(self) -> ClassPolicy:
        if self.max_seqs is not None and self.reserved_seqs > self.max_seqs:
            raise ValueError(
                f"reserved_seqs ({self.reserved_seqs}) must be <= max_seqs ({self.max_seqs})")
        if self.reserved_kv_fraction > self.max_kv_fraction:
            raise ValueError(
                f"reserved_kv_fraction ({self.reserved_kv_fraction}) must be <= "
                f"max_kv_fraction ({self.max_kv_fraction})")
        return self

    @property
    def has_lane(self) -> bool:
        """The class sets a seat, KV or queue limit, so it waits in a queue of its own."""
        return bool(self.reserved_seqs or self.max_seqs is not None
                    or self.reserved_kv_fraction or self.max_kv_fraction < 1.0
                    or self.max_queued_requests is not None)


# The sections that hold knobs, in the order of Policy.knobs() (and of the knob table).
SECTIONS: dict[str, type[Strict]] = {
    "batching": Batching,
    "admission": Admission,
    "long_requests": LongRequests,
    "caching": Caching,
}


class Policy(Document):
    KIND: ClassVar[str] = "Policy"
    kind: Literal["Policy"] = "Policy"
    name: str = "policy"
    scheduling: Literal["fcfs", "priority"] = "fcfs"
    batching: Batching = Field(default_factory=Batching)
    admission: Admission = Field(default_factory=Admission)
    long_requests: LongRequests = Field(default_factory=LongRequests)
    caching: Caching = Field(default_factory=Caching)
    classes: dict[str, ClassPolicy] = Field(
        default_factory=dict, description="per-class settings (priority, reserved and "
        "maximum seats and KV, chunk cap, queue cap), by class name"
    )
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description="provenance: inputs' hashes, method, solver statuses, objective, "
        "simulated metrics, version, time",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Policy:
        b = self.batching
        if b.max_num_batched_tokens < b.max_num_seqs:
            raise ValueError(
                f"batching.max_num_batched_tokens ({b.max_num_batched_tokens}) must be >= "
                f"batching.max_num_seqs ({b.max_num_seqs}), as vLLM requires"
            )
        lr = self.long_requests
        if lr.reserved_seqs >= b.max_num_seqs and lr.enabled:
            raise ValueError(
                f"long_requests.reserved_seqs ({lr.reserved_seqs}) must be < "
                f"batching.max_num_seqs ({b.max_num_seqs}) so short requests keep a seat"
            )
        if lr.reserved_kv_fraction + self.admission.kv_watermark >= 1.0 and lr.enabled:
            raise ValueError(
                "long_requests.reserved_kv_fraction + admission.kv_watermark must be < 1"
            )
        long_seats = lr.reserved_seqs if lr.enabled else 0
        long_kv = lr.reserved_kv_fraction if lr.enabled else 0.0
        seats = long_seats + sum(c.reserved_seqs for c in self.classes.values())
        if seats and seats >= b.max_num_seqs:
            raise ValueError(
                f"the reserved seats of classes.* and long_requests ({seats}) must be < "
                f"batching.max_num_seqs ({b.max_num_seqs}) so unreserved traffic keeps a seat")
        kv = long_kv + sum(c.reserved_kv_fraction for c in self.classes.values())
        if kv and kv + self.admission.kv_watermark >= 1.0:
            raise ValueError(
                f"the reserved KV fractions of classes.* and long_requests ({kv:g}) plus "
                f"admission.kv_watermark ({self.admission.kv_watermark:g}) must be < 1")
        return self

    def class_priority(self, class_name: str) -> int:
        entry = self.classes.get(class_name)
        return entry.priority if entry is not None else 0

    def knobs(self) -> dict[str, Any]:
        """The tunable settings as flat dotted paths (``batching.max_num_seqs`` ...)."""
        out: dict[str, Any] = {"scheduling": self.scheduling}
        for section in SECTIONS:
            for key, value in getattr(self, section).model_dump().items():
                out[f"{section}.{key}"] = value
        return out
