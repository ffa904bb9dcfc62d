"""TensorRT-LLM: an ``--extra_llm_api_options`` YAML with LLM-API field names (docs/engines.md 4).

The file's keys are ``TorchLlmArgs`` fields (strict: unknown keys fail) and the file
overrides the command line. Mapping: ``batching.max_num_seqs`` -> ``max_batch_size``;
``batching.max_num_batched_tokens`` -> ``max_num_tokens``; ``enable_chunked_prefill``
(written always: the policy's value, or, when the policy leaves it unset, ``false``,
trtllm-serve's default and what servetune's ``trtllm`` model simulates);
``scheduler_config.capacity_scheduler_policy: GUARANTEED_NO_EVICT`` (prompt + maximum
output reserved at admission, never evicts: the model servetune's ``trtllm`` engine
simulates) and ``context_chunking_policy: FIRST_COME_FIRST_SERVED``.

KV memory: vLLM's ``gpu_memory_utilization`` u is a share of *total* memory M for
weights W, activations A and KV; TensorRT-LLM's ``kv_cache_config.free_gpu_memory_fraction``
f is a share of the memory *free after* weights and buffers. Equal KV pools need

    f = (u * M - W - A) / (M - W - A)

(A = 0 when the profile gives no activation reserve). ``kv_cache_config.max_tokens`` pins
the pool in tokens as well (the smaller of the two wins) and ``tokens_per_block`` the
block size. Without M, W and u (from the policy's ``metadata.profile`` or ``--profile``)
the export fails with a message naming what is missing.

``caching.enable_prefix_caching`` -> ``kv_cache_config.enable_block_reuse``, only when
the policy sets it: block reuse is on by default (``KvCacheConfig(enable_block_reuse: bool =
True, ...)``, https://nvidia.github.io/TensorRT-LLM/llm-api/reference/KvCacheConfig.html, the
1.3 and 1.4 release pages alike).

Not expressible: priorities (TensorRT-LLM schedules FCFS), per-request chunk cap, queue
caps, watermark, long-request lanes.

Per-class settings (:mod:`servetune.export.classes`): no priority field to set, so the
gateway orders its per-class queues by the classes' priorities; a class's ``max_seqs`` and
``max_queued_requests`` become gateway concurrency and queue limits (HTTP 503 beyond); seat
reservations a gateway reservation; KV reservations and caps, and a class chunk cap
(TensorRT-LLM has none), a replica pool of the class's own.

A prefill or decode instance (``role``; TensorRT-LLM says context and generation server)
gets ``cache_transceiver_config: {backend: NIXL}``, and a prefill instance
``disable_overlap_scheduler: true``, as TensorRT-LLM's disaggregated serving page gives
them (https://nvidia.github.io/TensorRT-LLM/features/disagg-serving.html, source
docs/source/features/disagg-serving.md): "We use the ``cache_transceiver_config``
configuration to set up disaggregated serving"; ``backend`` takes ``DEFAULT``, ``UCX``,
``NIXL`` or ``MPI`` (the CacheTransceiverConfig reference adds ``MOONCAKE``), and the
default the page states differs between versions (NIXL in one, UCX after the edit of
NVIDIA/TensorRT-LLM PR #9352), so the backend is written, not left to a release's
default; the context servers' example config
sets ``disable_overlap_scheduler: True`` because the overlap scheduler is "not supported
for disaggregated context servers yet". ``max_tokens_in_buffer`` is recommended at or
above the longest prompt (ISL), which the policy does not know: it is left to the engine,
and a note says so. The pair is joined by ``trtllm-serve disaggregated -c
disagg_config.yaml`` listing context_servers and generation_servers.
"""

from __future__ import annotations

from typing import Any

from servetune.engines import engine
from servetune.errors import ServetuneError
from servetune.export import (
    ExportResult,
    Instead,
    MemoryFacts,
    Since,
    fcfs_only_instead,
    lanes_instead,
    no_chunk_cap_instead,
    plain_settings,
    queued_tokens_instead,
    requires_text,
    unsupported_settings,
    yaml_result,
)
from servetune.export.classes import GatewayFacts, class_settings_instead
from servetune.knobs import export_names
from servetune.schemas.policy import Policy

TITLE = engine("trtllm").title
USAGE = (
    "trtllm-serve MODEL --extra_llm_api_options trtllm.yaml   "
    "(this file overrides command-line flags)"
)

# What servetune knows of when trtllm-serve took these options (no release pinned by a
# source read): the issue where a maintainer-confirmed setup used them.
SINCE: dict[str, Since] = {
    "scheduler_config": (None, "scheduler_config.capacity_scheduler_policy in the "
                         "--extra_llm_api_options YAML of trtllm-serve's PyTorch backend, "
                         "NVIDIA/TensorRT-LLM#4509, 2025-05"),
}


def _watermark_instead(policy: Policy) -> str:
    return (
        f"admission.kv_watermark ({policy.admission.kv_watermark:g}): no watermark knob; "
        "GUARANTEED_NO_EVICT never over-commits KV, so it needs none"
    )


def _reserve_full_instead(policy: Policy) -> str:
    return (
        "admission.reserve_full_prompt (false): GUARANTEED_NO_EVICT always reserves the "
        "whole prompt and its maximum output; MAX_UTILIZATION is the closest over-admitting "
        "mode"
    )


def _queue_cap_instead(policy: Policy) -> str:
    return (
        f"admission.max_queued_requests ({policy.admission.max_queued_requests}): "
        "trtllm-serve has no queue cap; set a gateway concurrency limit of that many "
        "in-flight requests (reject beyond with HTTP 503)"
    )


# What a missing per-request chunk cap leaves in TensorRT-LLM.
NO_CHUNK_CAP_WHY = " (only the chunking policy)"

# What to do instead, for each knob the knob table says TensorRT-LLM cannot express.
INSTEAD: dict[str, Instead] = {
    "scheduling": lambda policy: fcfs_only_instead(
        "TensorRT-LLM schedules first come, first served"),
    "batching.long_prefill_token_threshold": lambda policy: no_chunk_cap_instead(
        policy, TITLE, NO_CHUNK_CAP_WHY),
    "admission.kv_watermark": _watermark_instead,
    "admission.reserve_full_prompt": _reserve_full_instead,
    "admission.max_queued_requests": _queue_cap_instead,
    "admission.max_queued_prompt_tokens": queued_tokens_instead,
    "long_requests.threshold_tokens": lanes_instead,
}


# What the gateway in front of TensorRT-LLM does for per-class settings (export.classes).
GATEWAY = GatewayFacts(title=TITLE, overflow_status=503, priority_field=None,
                       chunk_cap_key=None, no_chunk_cap_why=NO_CHUNK_CAP_WHY)

# TensorRT-LLM's name for prefix caching (the knob table's): a kv_cache_config field.
(BLOCK_REUSE_PATH,) = export_names("trtllm", "caching.enable_prefix_caching")
BLOCK_REUSE_KEY = BLOCK_REUSE_PATH.removeprefix("kv_cache_config.")
# A P/D instance (module docstring).
TRANSCEIVER_KEY = "cache_transceiver_config"
TRANSCEIVER_BACKEND = "NIXL"
OVERLAP_KEY = "disable_overlap_scheduler"
SERVER_KINDS = {"prefill": "context_servers", "decode": "generation_servers"}


def _role_notes(role: str) -> list[str]:
    notes = [
        f"{role} instance: {TRANSCEIVER_KEY}.backend {TRANSCEIVER_BACKEND} (the other instance "
        "of the pair must use the same); list this server's URL under "
        f"{SERVER_KINDS[role]} in the config of trtllm-serve disaggregated -c "
        "disagg_config.yaml, which marks requests context-only or generation-only",
        f"{TRANSCEIVER_KEY}.max_tokens_in_buffer not set: TensorRT-LLM recommends at least "
        "the longest prompt (ISL) you serve; set it to that",
    ]
    if role == "prefill":
        notes.append(f"{OVERLAP_KEY}: true: TensorRT-LLM's overlap scheduler is not supported "
                     "on disaggregated context (prefill) servers")
    return notes


def free_gpu_memory_fraction(facts: MemoryFacts) -> float:
    """TensorRT-LLM's share of free memory (after weights and buffers) that gives the
    same KV bytes as vLLM's share ``gpu_memory_utilization`` of total memory."""
    missing = facts.missing("gpu_memory_bytes", "weight_bytes", "gpu_memory_utilization")
    if missing:
        where = facts.source or (
            "the policy has no metadata.profile and no argument `profile` was given"
        )
        todo = (
            "give a profile with hardware and model sections"
            if facts.source.startswith("profile")
            else "pass argument `profile` P.yaml (the GPU profile the policy was tuned with)"
        )
        raise ServetuneError(
            f"{where}: TensorRT-LLM's kv_cache_config.free_gpu_memory_fraction needs "
            f"{', '.join(missing)}; {todo}"
        )
    total = float(facts.gpu_memory_bytes)  # type: ignore[arg-type]
    reserved = float(facts.weight_bytes) + float(facts.activation_bytes or 0)  # type: ignore[arg-type]
    kv_bytes = facts.gpu_memory_utilization * total - reserved  # type: ignore[operator]
    free_after_weights = total - reserved
    if kv_bytes <= 0 or free_after_weights <= 0:
        raise ServetuneError(
            f"{facts.source}: weights and activations ({reserved:.0f} B) leave no KV memory "
            f"at gpu_memory_utilization {facts.gpu_memory_utilization} of {total:.0f} B; "
            "check the profile"
        )
    return kv_bytes / free_after_weights


def export(policy: Policy, facts: MemoryFacts, role: str | None = None) -> ExportResult:
    kv_cache_config: dict[str, Any] = {
        "free_gpu_memory_fraction": round(free_gpu_memory_fraction(facts), 4),
    }
    if facts.kv_tokens is not None:
        kv_cache_config["max_tokens"] = facts.kv_tokens
    if facts.block_size is not None:
        kv_cache_config["tokens_per_block"] = facts.block_size
    if policy.caching.enable_prefix_caching is not None:
        kv_cache_config[BLOCK_REUSE_KEY] = policy.caching.enable_prefix_caching
    settings: dict[str, Any] = {
        **plain_settings(policy, "trtllm"),
        "kv_cache_config": kv_cache_config,
        "scheduler_config": {
            "capacity_scheduler_policy": "GUARANTEED_NO_EVICT",
            "context_chunking_policy": "FIRST_COME_FIRST_SERVED",
        },
    }
    notes = [
        "GUARANTEED_NO_EVICT reserves prompt + maximum output at admission and never evicts "
        "(engines.md 4); MAX_UTILIZATION would admit like vLLM and pause requests instead",
        "free_gpu_memory_fraction = (u*M - W - A) / (M - W - A) with u, M, W, A from "
        f"{facts.source}: the same KV bytes as gpu_memory_utilization "
        f"{facts.gpu_memory_utilization:g} of total memory gives vLLM",
    ]
    if not settings["enable_chunked_prefill"]:
        why = ("trtllm-serve's default, as the policy leaves batching.enable_chunked_prefill "
               "unset" if policy.batching.enable_chunked_prefill is None
               else "the policy sets batching.enable_chunked_prefill: false")
        notes.append(
            f"enable_chunked_prefill is false ({why}): a prompt is prefilled whole in one step, "
            f"so a prompt longer than max_num_tokens ({policy.batching.max_num_batched_tokens}) "
            "cannot be scheduled (servetune's simulator rejects it); set "
            "batching.enable_chunked_prefill: true in the policy to chunk"
        )
    if role is not None:
        settings[TRANSCEIVER_KEY] = {"backend": TRANSCEIVER_BACKEND}
        if role == "prefill":
            settings[OVERLAP_KEY] = True
        notes += _role_notes(role)
    unsupported = unsupported_settings(policy, "trtllm", INSTEAD)
    unsupported += class_settings_instead(policy, GATEWAY)

    requires = requires_text(TITLE, SINCE, settings)
    return yaml_result("trtllm", TITLE, USAGE, policy, settings, unsupported, notes, requires,
                       role)
