"""SGLang: a ``launch_server --config`` YAML with the CLI names (docs/engines.md 2.1-2.3).

Mapping:

- ``batching.max_num_seqs`` -> ``max-running-requests``;
- ``batching.max_num_batched_tokens`` -> ``chunked-prefill-size`` (``-1`` when chunked
  prefill is off) and ``max-prefill-tokens``; SGLang budgets prefill only, decode rows
  are not counted (a note says so);
- ``scheduling: priority`` -> ``enable-priority-scheduling`` with
  ``schedule-low-priority-values-first`` (SGLang serves *higher* values first by default;
  servetune, like vLLM, serves *lower* values first, so the sign convention is flipped by
  the flag and request values stay the same on every engine), ``retraction-policy:
  priority`` (lowest priority retracted first) and
  ``priority-scheduling-preemption-threshold: 10`` (SGLang's default, pinned: the
  simulated model preempts running requests whose value exceeds a waiting one's by more
  than 10, as SGLang does unless ``disable-priority-preemption``);
- ``admission.max_queued_requests`` caps waiting + running; SGLang's
  ``max-queued-requests`` caps the waiting queue only, so it gets the cap minus the
  running-set cap (and the running-set cap is at most the in-flight cap);
- the profile -> ``mem-fraction-static`` (weights + KV share of total memory, i.e. vLLM's
  utilization minus the activation reserve) and ``max-total-tokens`` (the KV pool in
  tokens the policy was tuned for);
- ``schedule-conservativeness`` stays 1.0: SGLang reserves future output instead of a
  watermark, and no scale of it is equivalent to one;
- ``caching.enable_prefix_caching: false`` -> ``disable-radix-cache: true``; true or unset
  writes nothing: the radix (prefix) cache is on unless ``--disable-radix-cache`` (default
  False; server_args.py, engines.md 2.1), and SGLang's ``--config`` loader skips a
  store_true flag given as false (``ConfigArgumentMerger._add_boolean_arg``,
  python/sglang/srt/server_args_config_parser.py), so ``false`` would say nothing either.

A prefill or decode instance (``role``) gets ``disaggregation-mode: prefill|decode`` and
``disaggregation-transfer-backend: nixl``, as SGLang's PD disaggregation page gives them
(https://docs.sglang.io/docs/advanced_features/pd_disaggregation, source
docs/advanced_features/pd_disaggregation.md: "Currently, we support Mooncake and NIXL as
the transfer engine"; its NIXL examples launch ``--disaggregation-mode prefill`` /
``decode`` with ``--disaggregation-transfer-backend nixl`` and pair them with
``python -m sglang_router.launch_router --pd-disaggregation --prefill URL --decode URL``).
server_args.py's choices for the backend are ``mooncake`` (its default) and ``nixl``;
the file writes ``nixl``, the transfer library the vLLM and TensorRT-LLM exports use too.

Not expressible: ``long_prefill_token_threshold`` (no per-request chunk cap; sgl-project/sglang
PR #34554 was closed unmerged), ``kv_watermark``, ``reserve_full_prompt: false``,
``max_queued_prompt_tokens``, long-request lanes, per-class priorities.

Per-class settings (:mod:`servetune.export.classes`): priorities travel in each request's
``priority`` field (the gateway sets them; the flag above keeps vLLM's lower-first
values); a class's ``max_seqs`` and ``max_queued_requests`` become gateway concurrency and
queue limits (HTTP 503 beyond; SGLang's own rejection status is not pinned by servetune);
seat reservations a gateway reservation; KV reservations and caps, and a class chunk cap
(SGLang has none), a replica pool of the class's own.
"""

from __future__ import annotations

from typing import Any

from servetune import knobs
from servetune.engines import engine
from servetune.export import (
    ExportResult,
    Instead,
    MemoryFacts,
    Since,
    class_priority_instead,
    lanes_instead,
    no_chunk_cap_instead,
    queued_tokens_instead,
    requires_text,
    unsupported_settings,
    yaml_result,
)
from servetune.export.classes import GatewayFacts, class_settings_instead
from servetune.knobs import export_names
from servetune.schemas.policy import Policy

TITLE = engine("sglang").title
USAGE = (
    "python -m sglang.launch_server --model-path MODEL --config sglang.yaml   "
    "(command-line flags override this file)"
)
# Where servetune knows when SGLang gained an option this exporter writes: the pull
# request, since no release is pinned by a source read (facts from the PRs' pages: the
# dates shown there; the merge dates were not shown). The others are older than both.
SINCE: dict[str, Since] = {
    "--config": (None, "YAML config files, sgl-project/sglang PR #10534, opened "
                 "2025-09-16, merged"),
    "enable-priority-scheduling": (None, "priority scheduling with preemption, PR #8746, "
                                   "reviewed 2025-09-09, merged"),
    "schedule-low-priority-values-first": (None, "PR #8746, reviewed 2025-09-09, merged"),
    "priority-scheduling-preemption-threshold": (None, "PR #8746, reviewed 2025-09-09, "
                                                 "merged"),
}

# SGLang's names for the knobs it expresses (the knob table's); it takes none as is.
(RUNNING_KEY,) = export_names("sglang", "batching.max_num_seqs")
CHUNK_KEY, PREFILL_KEY = export_names("sglang", "batching.max_num_batched_tokens")
(PRIORITY_KEY,) = export_names("sglang", "scheduling")
(QUEUE_KEY,) = export_names("sglang", "admission.max_queued_requests")
(NO_PREFIX_CACHE_KEY,) = export_names("sglang", "caching.enable_prefix_caching")
# A P/D instance: its mode and the KV transfer library (module docstring).
MODE_KEY = "disaggregation-mode"
TRANSFER_KEY = "disaggregation-transfer-backend"
TRANSFER_BACKEND = "nixl"


def _watermark_instead(policy: Policy) -> str:
    return (
        f"admission.kv_watermark ({policy.admission.kv_watermark:g}): SGLang keeps no free-KV "
        "watermark; raise schedule-conservativeness (> 1) for more headroom, or lower "
        "mem-fraction-static"
    )


def _reserve_full_instead(policy: Policy) -> str:
    return (
        "admission.reserve_full_prompt (false): SGLang always reserves the whole prompt "
        "at admission; nothing to do unless you relied on over-admission"
    )


# What a missing per-request chunk cap does in SGLang.
NO_CHUNK_CAP_WHY = ", so one long prompt takes a whole prefill pass"

# What to do instead, for each knob the knob table says SGLang cannot express.
INSTEAD: dict[str, Instead] = {
    "batching.long_prefill_token_threshold": lambda policy: no_chunk_cap_instead(
        policy, TITLE, NO_CHUNK_CAP_WHY),
    "admission.kv_watermark": _watermark_instead,
    "admission.reserve_full_prompt": _reserve_full_instead,
    "admission.max_queued_prompt_tokens": queued_tokens_instead,
    "long_requests.threshold_tokens": lanes_instead,
}


# What the gateway in front of SGLang does for per-class settings (export.classes).
GATEWAY = GatewayFacts(title=TITLE, overflow_status=503, priority_field="priority",
                       chunk_cap_key=None, no_chunk_cap_why=NO_CHUNK_CAP_WHY)


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


def _role_note(role: str) -> str:
    flag = "--prefill" if role == "prefill" else "--decode"
    return (
        f"{role} instance: {MODE_KEY} {role} with {TRANSFER_KEY} {TRANSFER_BACKEND} (SGLang's "
        "default is mooncake; the other instance of the pair must use the same backend); "
        "pair it with the other role through python -m sglang_router.launch_router "
        f"--pd-disaggregation, which takes this instance's URL under {flag}"
    )


def export(policy: Policy, facts: MemoryFacts, role: str | None = None) -> ExportResult:
    b, a = policy.batching, policy.admission
    chunked = knobs.value_for("batching.enable_chunked_prefill", policy, "sglang")
    settings: dict[str, Any] = {
        RUNNING_KEY: b.max_num_seqs,
        CHUNK_KEY: b.max_num_batched_tokens if chunked else -1,
        PREFILL_KEY: b.max_num_batched_tokens,
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
        settings[PRIORITY_KEY] = True
        settings["schedule-low-priority-values-first"] = True
        settings["retraction-policy"] = "priority"
        settings["priority-scheduling-preemption-threshold"] = (
            engine("sglang").priority_preemption_threshold)
        if policy.classes:
            unsupported.append(class_priority_instead(policy, TITLE))

    if a.max_queued_requests is not None:
        # In-flight (waiting + running) <= cap also bounds the running set by the cap.
        running_cap = min(b.max_num_seqs, a.max_queued_requests)
        settings[RUNNING_KEY] = running_cap
        waiting_cap = max(1, a.max_queued_requests - running_cap)
        settings[QUEUE_KEY] = waiting_cap
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
    if policy.caching.enable_prefix_caching is False:
        settings[NO_PREFIX_CACHE_KEY] = True
    if role is not None:
        settings[MODE_KEY] = role
        settings[TRANSFER_KEY] = TRANSFER_BACKEND
        notes.append(_role_note(role))

    unsupported += unsupported_settings(policy, "sglang", INSTEAD)
    unsupported += class_settings_instead(policy, GATEWAY)

    requires = requires_text(TITLE, SINCE, ["--config", *settings])
    return yaml_result("sglang", TITLE, USAGE, policy, settings, unsupported, notes, requires,
                       role)
