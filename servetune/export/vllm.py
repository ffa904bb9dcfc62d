"""vLLM: a ``vllm serve --config`` YAML with the long option names (docs/engines.md 1.2-1.5).

Keys are kebab-case long option names, as vLLM's docs show for config files; the
command line overrides the file. The V0-only ``max-num-partial-prefills`` family is never
emitted: current vLLM rejects unknown scheduler keys (docs/engines.md 1.2).

Mapping: ``batching.*`` -> ``max-num-seqs``, ``max-num-batched-tokens``,
``long-prefill-token-threshold``, ``enable-chunked-prefill``; ``scheduling`` ->
``scheduling-policy``; ``admission.*`` -> ``watermark``, ``scheduler-reserve-full-isl``,
``max-num-queued-reqs``, ``max-num-queued-tokens`` (queue caps only when set); the
profile -> ``gpu-memory-utilization``, ``block-size`` and, when it pins the pool,
``num-gpu-blocks-override``; ``caching.enable_prefix_caching`` (only when the policy sets
it; vLLM's own default is on, ``CacheConfig.enable_prefix_caching = True`` in
vllm/config/cache.py) -> ``enable-prefix-caching: true`` or ``no-enable-prefix-caching:
true``. Both are true values on purpose: vLLM's ``--config`` loader
(``FlexibleArgumentParser.load_config_file``, vllm/utils/argparse_utils.py) turns a true
boolean into ``--key`` in every release, and a false one into ``--no-key`` only in current
releases (older ones dropped ``key: false`` without a word). Not expressible: long-request
lanes (router rule) and per-class priorities (per-request field).

Per-class settings (:mod:`servetune.export.classes`): priorities travel in each request's
``priority`` field under ``scheduling-policy: priority`` (the gateway sets them); a class's
``max_seqs`` and ``max_queued_requests`` become gateway concurrency and queue limits (HTTP
503 beyond, as vLLM answers past ``max-num-queued-reqs``); seat reservations a gateway
reservation; KV reservations and caps a replica pool of the class's own; a class chunk cap
a pool whose ``long-prefill-token-threshold`` is the class's.

A prefill or decode instance (``role``) gets ``kv-transfer-config``, the NixlConnector
form of vLLM's NixlConnector usage guide
(https://docs.vllm.ai/en/latest/features/nixl_connector_usage.html, source
docs/features/nixl_connector_usage.md: prefillers take
``{"kv_connector":"NixlConnector","kv_role":"kv_producer"}``, decoders ``"kv_role":
"kv_consumer"``; the page adds that NixlConnector "does not distinguish kv_role", which is
"effectively a placeholder": the proxy in front decides which instance prefills, and that
``kv_load_failure_policy`` defaults to ``fail``, so it is not written). The value is a JSON
string, not a YAML mapping: nested configs take JSON (engines.md 1.5), and a string reaches
every loader unchanged, while older loaders passed a mapping on as a Python repr. Under
NVIDIA Dynamo the worker is ``python -m dynamo.vllm`` with ``--disaggregation-mode
prefill|decode`` (ai-dynamo/dynamo examples/backends/vllm/launch/disagg.sh; its vLLM
argument group says of ``--is-prefill-worker``: "DEPRECATED: use
--disaggregation-mode=prefill"; older releases took ``--is-prefill-worker`` /
``--is-decode-worker`` only), said in the file's notes.
"""

from __future__ import annotations

import json
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
from servetune.export.classes import GatewayFacts, class_settings_instead
from servetune.knobs import CHUNK_CAP, export_names
from servetune.schemas.policy import Policy

TITLE = engine("vllm").title
USAGE = "vllm serve MODEL --config vllm.yaml   (command-line flags override this file)"
USAGE_ROLE = (
    "vllm serve MODEL --config vllm.yaml   (the {role} instance of a P/D pair, behind a proxy "
    "that sends each request to a prefill and then a decode instance; command-line flags "
    "override this file)"
)

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

# What the gateway in front of vLLM does for per-class settings (export.classes).
(CHUNK_CAP_KEY,) = export_names("vllm", CHUNK_CAP)
GATEWAY = GatewayFacts(title=TITLE, overflow_status=503, priority_field="priority",
                       chunk_cap_key=CHUNK_CAP_KEY)

# vLLM's names for prefix caching on and off (the knob table's).
PREFIX_ON_KEY, PREFIX_OFF_KEY = export_names("vllm", "caching.enable_prefix_caching")

# A P/D instance: the connector, and its kv_role per role (the NixlConnector guide's).
KV_TRANSFER_KEY = "kv-transfer-config"
KV_CONNECTOR = "NixlConnector"
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
# Dynamo's worker flag for the role, before --disaggregation-mode replaced it.
DYNAMO_OLD_FLAGS = {"prefill": "--is-prefill-worker", "decode": "--is-decode-worker"}


def kv_transfer_config(role: str) -> str:
    """``kv-transfer-config`` for a ``role`` instance, as the JSON string vLLM parses."""
    return json.dumps({"kv_connector": KV_CONNECTOR, "kv_role": KV_ROLES[role]},
                      separators=(",", ":"))


def _role_notes(role: str) -> list[str]:
    peers = "--prefiller-hosts" if role == "prefill" else "--decoder-hosts"
    return [
        f"{role} instance: {KV_TRANSFER_KEY} uses {KV_CONNECTOR} with kv_role "
        f"{KV_ROLES[role]}, as vLLM's NixlConnector guide gives it; NixlConnector treats "
        "kv_role as a placeholder, so the proxy in front decides which instance prefills "
        f"(vLLM's toy_proxy_server.py lists this one under {peers}); give each instance its "
        "own VLLM_NIXL_SIDE_CHANNEL_PORT, and VLLM_NIXL_SIDE_CHANNEL_HOST when the pair "
        "spans machines",
        f"under NVIDIA Dynamo: python -m dynamo.vllm --model MODEL --disaggregation-mode "
        f"{role} with this file's settings (the same argument names); Dynamo releases "
        f"before --disaggregation-mode take {DYNAMO_OLD_FLAGS[role]} instead",
    ]


def export(policy: Policy, facts: MemoryFacts, role: str | None = None) -> ExportResult:
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
    prefix_caching = policy.caching.enable_prefix_caching
    if prefix_caching is not None:
        settings[PREFIX_ON_KEY if prefix_caching else PREFIX_OFF_KEY] = True
    if role is not None:
        settings[KV_TRANSFER_KEY] = kv_transfer_config(role)
        notes += _role_notes(role)

    unsupported = unsupported_settings(policy, "vllm", INSTEAD)
    if policy.scheduling == "priority" and policy.classes:
        unsupported.append(class_priority_instead(policy, TITLE))
    unsupported += class_settings_instead(policy, GATEWAY)
    if not knobs.value_for("batching.enable_chunked_prefill", policy, "vllm"):
        notes.append(
            "enable-chunked-prefill is false: vLLM then requires max-num-batched-tokens >= "
            "max-model-len; raise it or cap --max-model-len"
        )

    requires = requires_text(TITLE, SINCE, ["--config", *settings])
    usage = USAGE if role is None else USAGE_ROLE.format(role=role)
    return yaml_result("vllm", TITLE, usage, policy, settings, unsupported, notes, requires,
                       role)
