"""TGI: ``text-generation-launcher`` flags and environment variables (docs/engines.md 3).

TGI reads no config file, so the export is a POSIX shell file: ``export NAME=value``
lines (each launcher flag's environment variable is its long name in UPPER_SNAKE case;
without ``export`` the lines also suit ``docker run --env-file``) and the same settings as
one shell-ready argument string ``TGI_ARGS``.

Mapping: ``batching.max_num_batched_tokens`` -> ``--max-batch-prefill-tokens`` (prefill
only); ``batching.enable_chunked_prefill`` -> ``PREFILL_CHUNKING`` (an environment
variable only); ``admission.max_queued_requests`` -> ``--max-concurrent-requests``
(in-flight requests beyond it get HTTP 429, servetune's shedding); the profile's
``gpu_memory_utilization`` -> ``--cuda-memory-fraction``. ``--max-batch-total-tokens`` is
not emitted: flash-attention models ignore it and size the KV pool themselves.

Not expressible: the running-batch cap ``max_num_seqs`` (``--max-batch-size`` applies
only to padded hardware), priorities (TGI is strictly FIFO), the per-request chunk cap,
the watermark (TGI reserves prompt + max_new_tokens up front and never over-commits),
``max_queued_prompt_tokens``, long-request lanes.
"""

from __future__ import annotations

import shlex

from servetune.engines import engine
from servetune.export import (
    FILENAMES,
    ExportResult,
    Instead,
    MemoryFacts,
    fcfs_only_instead,
    header,
    lanes_instead,
    no_chunk_cap_instead,
    plain_settings,
    queued_tokens_instead,
    unsupported_settings,
)
from servetune.knobs import export_names, value_for
from servetune.schemas.policy import Policy

TITLE = engine("tgi").title
USAGE = (
    "set -a; . ./tgi.sh; set +a; text-generation-launcher --model-id MODEL   "
    "(or: text-generation-launcher --model-id MODEL $TGI_ARGS)"
)
# The environment variable (no launcher flag) that switches chunked prefill.
(CHUNKING_ENV,) = export_names("tgi", "batching.enable_chunked_prefill")


def _max_seqs_instead(policy: Policy) -> str:
    return (
        f"batching.max_num_seqs ({policy.batching.max_num_seqs}): TGI has no running-batch "
        "cap on flash-attention models (the KV reservation bounds the batch); to bound "
        "in-flight requests use --max-concurrent-requests (HTTP 429 beyond it) or a gateway "
        "limit"
    )


def _watermark_instead(policy: Policy) -> str:
    return (
        f"admission.kv_watermark ({policy.admission.kv_watermark:g}): no watermark knob; TGI "
        "reserves prompt + max_new_tokens at admission and never over-commits, so it needs "
        "none"
    )


def _reserve_full_instead(policy: Policy) -> str:
    return (
        "admission.reserve_full_prompt (false): TGI always reserves prompt + "
        "max_new_tokens at admission; no over-admitting mode exists"
    )


# What to do instead, for each knob the knob table says TGI cannot express.
INSTEAD: dict[str, Instead] = {
    "batching.max_num_seqs": _max_seqs_instead,
    "scheduling": lambda policy: fcfs_only_instead("TGI's queue is strictly first in, first out"),
    "batching.long_prefill_token_threshold": lambda policy: no_chunk_cap_instead(policy, TITLE),
    "admission.kv_watermark": _watermark_instead,
    "admission.reserve_full_prompt": _reserve_full_instead,
    "admission.max_queued_prompt_tokens": queued_tokens_instead,
    "long_requests.threshold_tokens": lanes_instead,
}


def env_name(flag: str) -> str:
    """``--max-batch-prefill-tokens`` -> ``MAX_BATCH_PREFILL_TOKENS`` (clap's env names)."""
    return flag.lstrip("-").replace("-", "_").upper()


def _value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def export(policy: Policy, facts: MemoryFacts) -> ExportResult:
    a = policy.admission
    flags: dict[str, object] = plain_settings(policy, "tgi")
    notes: list[str] = [
        "--max-batch-prefill-tokens budgets prefill tokens; with prefill chunking (the "
        "default where supported) the running batch's decode tokens are taken out of it "
        "first, as in vLLM's budget, without chunking they are not counted",
    ]
    if a.max_queued_requests is None:
        notes.append(
            "--max-concurrent-requests not set: TGI's default (128) rejects in-flight "
            "requests beyond 128 with HTTP 429, while the policy sets no cap; raise it above "
            "your peak concurrency"
        )
    if facts.gpu_memory_utilization is not None:
        flags["--cuda-memory-fraction"] = round(facts.gpu_memory_utilization, 4)
    else:
        notes.append(
            "--cuda-memory-fraction not set (no profile): TGI's default 1.0 applies; pass "
            "--profile to pin the memory share the policy was tuned for"
        )
    args: list[str] = []
    for flag, value in flags.items():
        args += [flag, _value(value)]
    env = {env_name(flag): _value(value) for flag, value in flags.items()}
    chunked = value_for("batching.enable_chunked_prefill", policy, "tgi")
    env[CHUNKING_ENV] = "1" if chunked else "0"

    unsupported = unsupported_settings(policy, "tgi", INSTEAD)

    body = ["# Environment variables (without `export`, the lines suit docker --env-file):"]
    body += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    body.append("# The same settings as launcher arguments (PREFILL_CHUNKING has no flag):")
    body.append(f"TGI_ARGS={shlex.quote(shlex.join(args))}")
    text = header(TITLE, USAGE, policy, unsupported, notes) + "\n".join(body) + "\n"
    settings = {flag.lstrip("-"): value for flag, value in flags.items()}
    return ExportResult(
        engine="tgi",
        text=text,
        unsupported=unsupported,
        filename=FILENAMES["tgi"],
        notes=notes,
        settings=settings,
        args=args,
        env=env,
    )
