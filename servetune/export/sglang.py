"""SGLang: a ``launch_server --config`` YAML with the CLI names (engines.md 2.1-2.3).

Mapping:

- ``batching.max_num_seqs`` -> ``max-running-requests``;
- ``batching.max_num_batched_tokens`` -> ``chunked-prefill-size`` (``-1`` when chunked
  prefill is off) and ``max-prefill-tokens``; SGLang budgets prefill only, decode rows
  are not counted (a note says so);
- ``scheduling: priority`` -> ``enable-priority-scheduling`` with
  ``schedule-low-priority-values-first`` (SGLang serves *higher* values first by default;
  servetune, like vLLM, serves *lower* values first, so the sign convention is flipped by
  the flag and request values stay the same on every engine), ``retraction-policy:
  priority`` (lowest priority retracted first, as vLLM preempts) and
  ``disable-priority-preemption`` (the simulated policy never preempts on arrival);
- ``admission.max_queued_requests`` caps waiting + running; SGLang's
  ``max-queued-requests`` caps the waiting queue only, so it gets the cap minus the
  running-set cap (and the running-set cap is at most the in-flight cap);
- the profile -> ``mem-fraction-static`` (weights + KV share of total memory, i.e. vLLM's
  utilization minus the activation reserve) and ``max-total-tokens`` (the KV pool in
  tokens the policy was tuned for);
- ``schedule-conservativeness`` stays 1.0: SGLang reserves future output instead of a
  watermark, and no scale of it is equivalent to one.

Not expressible: ``long_prefill_token_threshold`` (no per-request chunk cap; PR #34554 was
closed unmerged), ``kv_watermark``, ``reserve_full_prompt: false``,
``max_queued_prompt_tokens``, long-request lanes, per-class priorities.
"""

from __future__ import annotations

from typing import Any

from servetune.export import (
    ExportResult,
    MemoryFacts,
    class_priority_instead,
    lanes_instead,
    no_chunk_cap_instead,
    queued_tokens_instead,
    yaml_result,
)
from servetune.schemas.policy import Policy

TITLE = "SGLang"
USAGE = (
    "python -m sglang.launch_server --model-path MODEL --config sglang.yaml   "
    "(command-line flags override this file)"
)


def mem_fraction_static(facts: MemoryFacts) -> float | None:
    """SGLang's share of total memory for weights + KV pool: vLLM's utilization (weights,
    activations, KV) less the activation reserve, which SGLang keeps outside the fraction."""
    if facts.gpu_memory_utilization is None:
        return None
    if facts.activation_bytes is None or facts.gpu_memory_bytes is None:
        return facts.gpu_memory_utilization
    return (
        facts.gpu_memory_utilization * facts.gpu_memory_bytes - facts.activation_bytes
    ) / facts.gpu_memory_bytes


def export(policy: Policy, facts: MemoryFacts) -> ExportResult:
    b, a = policy.batching, policy.admission
    settings: dict[str, Any] = {
        "max-running-requests": b.max_num_seqs,
        "chunked-prefill-size": b.max_num_batched_tokens if b.enable_chunked_prefill else -1,
        "max-prefill-tokens": b.max_num_batched_tokens,
        "schedule-policy": "fcfs",
        "schedule-conservativeness": 1.0,
    }
    notes = [
        "SGLang's chunked-prefill-size and max-prefill-tokens budget prefill tokens only; "
        "decode rows are not counted against them as they are in vLLM's budget",
        "SGLang admits against prompt + a decaying estimate of future output (engines.md "
        "2.2) rather than the prompt alone; schedule-conservativeness 1.0 is its default",
    ]
    unsupported: list[str] = []

    if policy.scheduling == "priority":
        settings["enable-priority-scheduling"] = True
        settings["schedule-low-priority-values-first"] = True
        settings["retraction-policy"] = "priority"
        settings["disable-priority-preemption"] = True
        if policy.classes:
            unsupported.append(class_priority_instead(policy, TITLE))

    if a.max_queued_requests is not None:
        # In-flight (waiting + running) <= cap also bounds the running set by the cap.
        running_cap = min(b.max_num_seqs, a.max_queued_requests)
        settings["max-running-requests"] = running_cap
        waiting_cap = max(1, a.max_queued_requests - running_cap)
        settings["max-queued-requests"] = waiting_cap
        notes.append(
            f"max-queued-requests caps the waiting queue only: set to admission."
            f"max_queued_requests ({a.max_queued_requests}) - max-running-requests "
            f"({running_cap}), floored at 1, so waiting + running stays within the cap"
        )

    fraction = mem_fraction_static(facts)
    if fraction is not None:
        settings["mem-fraction-static"] = round(fraction, 4)
    else:
        notes.append(
            "mem-fraction-static not set (no profile): SGLang sizes its KV pool itself; pass "
            "--profile to pin the pool the policy was tuned for"
        )
    if facts.kv_tokens is not None:
        settings["max-total-tokens"] = facts.kv_tokens

    if b.long_prefill_token_threshold > 0:
        unsupported.append(no_chunk_cap_instead(
            policy, TITLE, ", so one long prompt takes a whole prefill pass"))
    if a.kv_watermark > 0:
        unsupported.append(
            f"admission.kv_watermark ({a.kv_watermark:g}): SGLang keeps no free-KV "
            "watermark; raise schedule-conservativeness (> 1) for more headroom, or lower "
            "mem-fraction-static"
        )
    if not a.reserve_full_prompt:
        unsupported.append(
            "admission.reserve_full_prompt (false): SGLang always reserves the whole prompt "
            "at admission; nothing to do unless you relied on over-admission"
        )
    if a.max_queued_prompt_tokens is not None:
        unsupported.append(queued_tokens_instead(policy))
    if policy.long_requests.enabled:
        unsupported.append(lanes_instead(policy))

    return yaml_result("sglang", TITLE, USAGE, policy, settings, unsupported, notes)
