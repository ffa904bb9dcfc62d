"""vLLM: a ``vllm serve --config`` YAML with the long option names (docs/engines.md 1.2-1.5).

Keys are kebab-case long option names, as vLLM's docs show for config files; the
command line overrides the file. The V0-only ``max-num-partial-prefills`` family is never
emitted: current vLLM rejects unknown scheduler keys (docs/engines.md 1.2).

Mapping: ``batching.*`` -> ``max-num-seqs``, ``max-num-batched-tokens``,
``long-prefill-token-threshold``, ``enable-chunked-prefill``; ``scheduling`` ->
``scheduling-policy``; ``admission.*`` -> ``watermark``, ``scheduler-reserve-full-isl``,
``max-num-queued-reqs``, ``max-num-queued-tokens`` (queue caps only when set); the
profile -> ``gpu-memory-utilization``, ``block-size`` and, when it pins the pool,
``num-gpu-blocks-override``. Not expressible: long-request
lanes (router rule) and per-class priorities (per-request field).
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
    plain_settings,
    requires_text,
    unsupported_settings,
    yaml_result,
)
from servetune.schemas.policy import Policy

TITLE = engine("vllm").title
USAGE = "vllm serve MODEL --config vllm.yaml   (command-line flags override this file)"

# The first vLLM release of the options this exporter writes, where servetune knows it
# (docs/engines.md 7); the others exist in every release with a --config file.
SINCE: dict[str, Since] = {
    "--config": ("0.6.0", "PR #7737; vllm-project/vllm#8273"),
    "max-num-queued-reqs": ("0.29.0", "PR #49445, merged 2026-07-22; in v0.29.0 per "
                            "vllm-project/vllm#58192"),
    "max-num-queued-tokens": ("0.29.0", "PR #49445, merged 2026-07-22; in v0.29.0 per "
                              "vllm-project/vllm#58192"),
    "scheduler-reserve-full-isl": (None, "full-ISL admission, PR #37307, merged 2026-03-17"),
}

# What to do instead, for each knob the knob table says vLLM cannot express.
INSTEAD: dict[str, Instead] = {"long_requests.threshold_tokens": lanes_instead}


def export(policy: Policy, facts: MemoryFacts) -> ExportResult:
    # vLLM's config lists the batching options, then the scheduling policy, then admission.
    settings: dict[str, Any] = plain_settings(
        policy, "vllm", "batching", "scheduling", "admission")

    notes: list[str] = []
    if facts.gpu_memory_utilization is not None:
        settings["gpu-memory-utilization"] = round(facts.gpu_memory_utilization, 4)
    else:
        notes.append(
            "gpu-memory-utilization not set (no profile): vLLM's default applies; pass "
            "--profile to pin the KV pool size the policy was tuned for"
        )
    if facts.block_size is not None:
        settings["block-size"] = facts.block_size
    if facts.kv_blocks_override is not None:
        # The profile fixes the pool in blocks (what-if / replay profiles): pin it exactly.
        settings["num-gpu-blocks-override"] = facts.kv_blocks_override

    unsupported = unsupported_settings(policy, "vllm", INSTEAD)
    if policy.scheduling == "priority" and policy.classes:
        unsupported.append(class_priority_instead(policy, TITLE))
    if not knobs.value_for("batching.enable_chunked_prefill", policy, "vllm"):
        notes.append(
            "enable-chunked-prefill is false: vLLM then requires max-num-batched-tokens >= "
            "max-model-len; raise it or cap --max-model-len"
        )

    requires = requires_text(TITLE, SINCE, ["--config", *settings])
    return yaml_result("vllm", TITLE, USAGE, policy, settings, unsupported, notes, requires)
