"""TGI: ``text-generation-launcher`` flags and environment variables (docs/engines.md 3).

TGI reads no config file, so the export is a POSIX shell file: ``export NAME=value``
lines (each launcher flag's environment variable is its long name in UPPER_SNAKE case;
without ``export`` the lines also suit ``docker run --env-file``) and the same settings as
one shell-ready argument string ``TGI_ARGS``.

Mapping: ``batching.max_num_batched_tokens`` -> ``--max-batch-prefill-tokens`` (prefill
only); ``batching.enable_chunked_prefill`` -> ``PREFILL_CHUNKING`` (an environment
variable only); ``admission.max_queued_requests`` -> ``--max-concurrent-requests``
(in-flight requests beyond it get HTTP 429, servetune's shedding); the profile's KV pool
-> ``--cuda-memory-fraction`` (below). ``--max-batch-total-tokens`` is not emitted:
flash-attention models ignore it and size the KV pool themselves.

KV memory (docs/engines.md 3): after loading the weights and a warm-up batch TGI takes
``free = max(0, free_now - (1 - f) * M)`` (``f`` = ``--cuda-memory-fraction``, M the
GPU's memory; ``get_cuda_free_memory``) and gives the KV cache ``free * w`` bytes, w being
its wiggle room ``TGI_WIGGLE_ROOM`` (0.90; ``flash_causal_lm.py`` ``warmup``). With
``free_now = M - W - A`` (weights, activation reserve), the pool the policy was tuned
with, ``u * M - W - A`` (vLLM's share u of total memory), needs

    f = (W + A + (u * M - W - A) / w) / M

rounded up to 4 decimals. Writing u itself, as servetune once did, gives a pool w times
the tuned one (10 % smaller). TGI cannot take more than all of memory: where f would
exceed 1.0, the file sets 1.0, says how much smaller TGI's pool is, and nightly's TGI gate
simulates that pool (:func:`tgi_memory`). ``TGI_WIGGLE_ROOM`` is written too, so the
arithmetic holds whatever default a TGI release has.

``caching.enable_prefix_caching`` -> ``PREFIX_CACHING`` (``1`` or ``0``, only when the
policy sets it), an environment variable with no launcher flag: the launcher reads it and,
when it is unset, sets it to ``true`` unless the model is a VLM or seq2seq, has LoRA
adapters or runs paged attention (``resolve_attention``, launcher/src/main.rs); the server
takes ``1`` or ``true`` as on.

Not expressible: the running-batch cap ``max_num_seqs`` (``--max-batch-size`` applies
only to padded hardware), priorities (TGI is strictly FIFO), the per-request chunk cap,
the watermark (TGI reserves prompt + max_new_tokens up front and never over-commits),
``max_queued_prompt_tokens``, long-request lanes. TGI serves prefill and decode in one
process and has no disaggregated mode: an export for a prefill or decode instance
(``role``) is refused.

Per-class settings (:mod:`servetune.export.classes`): no priority field to set, so the
gateway orders its per-class queues by the classes' priorities; a class's ``max_seqs`` and
``max_queued_requests`` become gateway concurrency and queue limits (HTTP 429 beyond, as
TGI answers past ``--max-concurrent-requests``); seat reservations a gateway reservation;
KV reservations and caps, and a class chunk cap (TGI has none), a replica pool of the
class's own.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass

from servetune.engines import engine
from servetune.errors import ServetuneError
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
from servetune.export.classes import GatewayFacts, class_settings_instead
from servetune.knobs import export_names, value_for
from servetune.schemas.policy import Policy

TITLE = engine("tgi").title
USAGE = (
    "set -a; . ./tgi.sh; set +a; text-generation-launcher --model-id MODEL   "
    "(or: text-generation-launcher --model-id MODEL $TGI_ARGS)"
)
# The environment variables (no launcher flag) that switch chunked prefill and prefix
# caching.
(CHUNKING_ENV,) = export_names("tgi", "batching.enable_chunked_prefill")
(PREFIX_CACHING_ENV,) = export_names("tgi", "caching.enable_prefix_caching")


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


# What the gateway in front of TGI does for per-class settings (export.classes): 429, as
# TGI answers past --max-concurrent-requests.
GATEWAY = GatewayFacts(title=TITLE, overflow_status=429, priority_field=None,
                       chunk_cap_key=None)

# TGI's share of the free memory it gives the KV cache, by default, and the largest
# --cuda-memory-fraction (a share of all memory).
TGI_WIGGLE_ROOM = 0.90
WIGGLE_ENV = "TGI_WIGGLE_ROOM"
MAX_CUDA_MEMORY_FRACTION = 1.0


@dataclass(frozen=True)
class TgiMemory:
    """TGI's memory flag for a profile, and the KV pool it gives.

    ``fraction``: the ``--cuda-memory-fraction`` to write; ``needed``: the fraction the
    tuned pool needs (None when the profile lacks the GPU's memory or the weights);
    ``kv_share``: TGI's KV pool over the tuned one (1.0 when the flag reaches it)."""

    fraction: float
    needed: float | None
    kv_share: float
    wiggle_room: float = TGI_WIGGLE_ROOM

    @property
    def reaches_tuned_pool(self) -> bool:
        return self.kv_share >= 1.0


def tgi_memory(facts: MemoryFacts, wiggle_room: float = TGI_WIGGLE_ROOM) -> TgiMemory | None:
    """The ``--cuda-memory-fraction`` that gives TGI the KV pool of ``facts`` (module
    docstring), or None without ``gpu_memory_utilization`` (TGI's default 1.0 applies)."""
    u = facts.gpu_memory_utilization
    if u is None:
        return None
    if facts.gpu_memory_bytes is None or facts.weight_bytes is None:
        # Without M and W the fraction cannot be solved for; u gives w times the pool.
        return TgiMemory(fraction=round(u, 4), needed=None, kv_share=wiggle_room,
                         wiggle_room=wiggle_room)
    total = float(facts.gpu_memory_bytes)
    reserved = float(facts.weight_bytes) + float(facts.activation_bytes or 0)
    kv_bytes = u * total - reserved
    if kv_bytes <= 0:
        raise ServetuneError(
            f"{facts.source}: weights and activations ({reserved:.0f} B) leave no KV memory "
            f"at gpu_memory_utilization {u} of {total:.0f} B; check the profile"
        )
    needed = (reserved + kv_bytes / wiggle_room) / total
    if needed <= MAX_CUDA_MEMORY_FRACTION:
        fraction = min(math.ceil(needed * 10_000 - 1e-9) / 10_000, MAX_CUDA_MEMORY_FRACTION)
        return TgiMemory(fraction=fraction, needed=needed, kv_share=1.0,
                         wiggle_room=wiggle_room)
    best = wiggle_room * (MAX_CUDA_MEMORY_FRACTION * total - reserved)
    return TgiMemory(fraction=MAX_CUDA_MEMORY_FRACTION, needed=needed,
                     kv_share=max(best, 0.0) / kv_bytes, wiggle_room=wiggle_room)


def _memory_note(mem: TgiMemory, facts: MemoryFacts) -> str:
    w = f"{mem.wiggle_room:g}"
    if mem.needed is None:
        return (
            f"--cuda-memory-fraction {mem.fraction:g} is the profile's gpu_memory_utilization "
            f"unadjusted ({facts.source} lacks the GPU's memory or the weights): TGI keeps "
            f"{WIGGLE_ENV}={w} of the free memory for KV, so its pool is about "
            f"{100 * mem.kv_share:.0f}% of the tuned one; pass --profile to correct it"
        )
    if mem.reaches_tuned_pool:
        return (
            f"--cuda-memory-fraction {mem.fraction:g} = (W + A + (u*M - W - A) / w) / M with "
            f"w = {WIGGLE_ENV} {w} and u, M, W, A from {facts.source}: TGI's KV pool is "
            "the tuned one (u itself would give w times it)"
        )
    tuned = facts.kv_blocks
    blocks = (f" (about {math.floor(tuned * mem.kv_share)} of {tuned} blocks)"
              if tuned is not None else "")
    return (
        f"KV POOL SMALLER THAN TUNED: the tuned pool needs --cuda-memory-fraction "
        f"{mem.needed:.4f} (w = {WIGGLE_ENV} {w}; u, M, W, A from {facts.source}), more than "
        f"TGI's maximum {MAX_CUDA_MEMORY_FRACTION:.1f}; at {mem.fraction:.1f} TGI's pool is "
        f"{100 * mem.kv_share:.1f}% of the tuned one{blocks}. servetune nightly's TGI gate "
        "simulates this smaller pool"
    )


def env_name(flag: str) -> str:
    """``--max-batch-prefill-tokens`` -> ``MAX_BATCH_PREFILL_TOKENS`` (clap's env names)."""
    return flag.lstrip("-").replace("-", "_").upper()


def _value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _and_list(names: list[str]) -> str:
    """``A``, ``A and B``, ``A, B and C``."""
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def export(policy: Policy, facts: MemoryFacts, role: str | None = None) -> ExportResult:
    if role is not None:
        raise ServetuneError(
            f"argument `role` {role!r}: TGI has no disaggregated prefill/decode serving, so "
            "there is no TGI prefill or decode instance to configure; export the pair for "
            "vllm, sglang or trtllm, or export TGI without a role"
        )
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
    mem = tgi_memory(facts)
    if mem is not None:
        flags["--cuda-memory-fraction"] = mem.fraction
        notes.append(_memory_note(mem, facts))
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
    if policy.caching.enable_prefix_caching is not None:
        env[PREFIX_CACHING_ENV] = "1" if policy.caching.enable_prefix_caching else "0"
    if mem is not None:
        env[WIGGLE_ENV] = _value(mem.wiggle_room)  # the fraction above assumes it

    unsupported = unsupported_settings(policy, "tgi", INSTEAD)
    unsupported += class_settings_instead(policy, GATEWAY)

    body = ["# Environment variables (without `export`, the lines suit docker --env-file):"]
    body += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    env_only = [name for name in env if name not in {env_name(f) for f in flags}]
    body.append(f"# The same settings as launcher arguments ({_and_list(env_only)} "
                f"{'has' if len(env_only) == 1 else 'have'} no flag):")
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
