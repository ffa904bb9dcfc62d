"""The conditions an optimization checks: what limits a policy's goodput, or makes it fail.

A :class:`Condition` is a family (TTFT, TPOT, KV memory, token-budget stability, ...) and,
for the per-class latency families, the request class it applies to. The fluid model
keys its limits by it, the policy MILP builds its constraints from it, and the
optimizer and the nightly job word their explanations with it. Its :attr:`Condition.key`
(``"ttft[chat]"``, ``"kv_memory"``) is how a condition appears in written output (the
policy's provenance, ``--json`` summaries, measured values); :meth:`Condition.parse`
reads a key back.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Family(Enum):
    """What a condition limits; the value is its key (and its key's prefix per class)."""

    BUDGET = "budget"  # per-step token demand below max_num_batched_tokens (T < M)
    SEATS = "seats"  # running requests within max_num_seqs
    KV_MEMORY = "kv_memory"  # KV-cache tokens within the memory after the watermark
    QUEUE = "queue"  # the queue caps together (one MILP constraint family)
    QUEUE_REQUESTS = "queue_requests"
    QUEUE_PROMPT_TOKENS = "queue_prompt_tokens"
    STABILITY = "stability"  # no load at all is sustainable (nothing more specific)
    TTFT = "ttft"  # per class
    TPOT = "tpot"  # per class
    E2E = "e2e"  # per class (an SLO limit the simulator judges; the fluid model has none)
    REJECTED = "rejected"  # per class: the share turned away within max_rejected_share

    @property
    def per_class(self) -> bool:
        return self in PER_CLASS

    @classmethod
    def of_metric(cls, metric: str) -> Family:
        """The family of an SLO limit named as in ``ClassSLO.limits()`` (``"ttft_s"``)."""
        return cls(metric.removesuffix("_s"))


PER_CLASS = frozenset({Family.TTFT, Family.TPOT, Family.E2E, Family.REJECTED})
# The families that decide whether a load is sustainable at all (the rest are targets).
STABILITY_FAMILIES = frozenset({Family.BUDGET, Family.SEATS, Family.KV_MEMORY})

# How a binding condition reads in an explanation (per-class latency families are worded
# with their class; a family missing here reads as its key).
_WORDS = {
    Family.BUDGET: "the per-step token budget (demand must stay below max_num_batched_tokens)",
    Family.SEATS: "the running seats (max_num_seqs)",
    Family.KV_MEMORY: "KV-cache memory",
    Family.QUEUE: "the queue caps (shedding)",
    Family.QUEUE_REQUESTS: "the cap on queued requests",
    Family.QUEUE_PROMPT_TOKENS: "the cap on queued prompt tokens",
}
_WORDED_PER_CLASS = frozenset({Family.TTFT, Family.TPOT})


@dataclass(frozen=True)
class Condition:
    """One condition: a family, and the request class for a per-class family.

    Conditions order by their key, so ties between equally tight conditions break the
    same way wherever they are compared."""

    family: Family
    request_class: str | None = None

    def __post_init__(self) -> None:
        if self.family.per_class and self.request_class is None:
            raise ValueError(f"condition {self.family.value!r} needs a request class")
        if not self.family.per_class and self.request_class is not None:
            raise ValueError(f"condition {self.family.value!r} has no request class")

    @property
    def key(self) -> str:
        """The condition as written out: ``"ttft[chat]"``, ``"kv_memory"``."""
        if self.request_class is None:
            return self.family.value
        return f"{self.family.value}[{self.request_class}]"

    @classmethod
    def parse(cls, key: str) -> Condition:
        """The condition a :attr:`key` names (ValueError when it names none)."""
        head, sep, rest = key.partition("[")
        try:
            family = Family(head)
        except ValueError:
            raise ValueError(f"not a condition: {key!r}") from None
        if not sep:
            return cls(family)
        if not rest.endswith("]"):
            raise ValueError(f"not a condition: {key!r}")
        return cls(family, rest[:-1])

    def __str__(self) -> str:
        return self.key

    def __lt__(self, other: Condition) -> bool:
        if not isinstance(other, Condition):
            return NotImplemented
        return self.key < other.key

    @property
    def metric(self) -> str:
        """The family's name as a metric in a sentence: ``TTFT``, ``TPOT``, ``E2E``."""
        return self.family.value.upper()

    @property
    def stability(self) -> bool:
        """Whether this condition decides if a load is sustainable at all."""
        return self.family in STABILITY_FAMILIES

    def words(self) -> str:
        """The condition in words, as an explanation names what limits a policy."""
        if self.family in _WORDED_PER_CLASS:
            return f"the {self.metric} target of class '{self.request_class}'"
        if self.family is Family.REJECTED:
            return f"the share of class '{self.request_class}' turned away (max_rejected_share)"
        return _WORDS.get(self.family, self.key)

    def seconds(self, value: float) -> str:
        """A latency of this condition's metric, in the unit its explanations use."""
        if self.family is Family.TPOT:
            return f"{value * 1e3:.0f} ms"
        return f"{value:.3g} s"

    def floor_sentence(self, floor_value: float, target: float) -> str:
        """A sentence for a condition that cannot hold even at vanishing load, where its
        value is ``floor_value`` against ``target``."""
        if self.family is Family.TPOT:
            return (
                f"TPOT cannot go below {floor_value * 1e3:.0f} ms on this GPU and model; "
                f"target {target * 1e3:.0f} ms"
            )
        if self.family is Family.TTFT:
            return (
                f"TTFT cannot go below {floor_value:.3g} s on this GPU and model; "
                f"target {target:.3g} s"
            )
        if self.family is Family.KV_MEMORY:
            return (
                f"the KV cache ({target:.0f} tokens after the watermark) cannot hold even "
                f"a few requests ({floor_value:.0f} tokens needed)"
            )
        if self.family is Family.SEATS:
            return "max_num_seqs is too small for even the lightest load"
        return f"{self.key} cannot be met even at vanishing load"

    def advice(self, floor_value: float) -> list[str]:
        """What would let a space whose best value is ``floor_value`` meet it."""
        if self.family is Family.TPOT:
            return [
                f"raise the TPOT target to at least {floor_value * 1e3:.0f} ms",
                "use a faster GPU profile or tensor parallelism",
            ]
        if self.family is Family.TTFT:
            return [
                f"raise the TTFT target to at least {floor_value:.3g} s",
                "add larger max_num_batched_tokens values to the space",
                "use a faster GPU profile, or serve very long prompts elsewhere",
            ]
        if self.family is Family.KV_MEMORY:
            return ["use a GPU with more memory, an fp8 KV cache, or a lower kv_watermark"]
        return ["widen the search space"]

    def simulated_floor_sentence(self, value: float, target: float, rate_per_s: float) -> str:
        """A sentence for a latency (or the share turned away) that stayed at ``value`` or
        more (above ``target``) in every simulation, down to ``rate_per_s``, with what
        would help."""
        if self.family is Family.REJECTED:
            return (
                f"class '{self.request_class}' turned away {value:.3%} or more of its "
                f"requests in every simulation, even at {rate_per_s:.3g} req/s (allowed "
                f"{target:.3%}): no policy tried serves them all (the simulation's "
                "records say which and why); raise max_rejected_share in the SLO set if "
                "turning them away is acceptable, or use a GPU with more memory"
            )
        return (
            f"{self.metric} stays at {self.seconds(value)} or more in simulation, even at "
            f"{rate_per_s:.3g} req/s (target {self.seconds(target)}); relax the "
            f"{self.metric} target, widen the search space or use a faster GPU"
        )
