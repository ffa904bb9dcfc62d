"""Engine config export: a servetune Policy as the config file each engine reads.

``export_policy(policy, engine, profile=None, role=None)`` returns an :class:`ExportResult`
with the file's text, the policy settings the engine cannot express (``unsupported``: each
says what the user needs instead, a router rule or a gateway limit), approximations
(``notes``) and the conventional file name. Both lists are also written as comments at
the top of the file, so nothing is dropped silently.

Per-class settings (``Policy.classes``: priorities, seat and KV reservations and caps,
chunk caps, queue caps) are no engine's: each exporter lists them with what the gateway in
front of the engine does instead, and ``export_policy`` returns that as machine-readable
rules (``gateway_rules``, a :class:`~servetune.schemas.gateway.GatewayRules`, None when no
class asks anything of a gateway); see :mod:`servetune.export.classes`.

``role`` (``prefill`` or ``decode``; None: an aggregated instance, the file as before
roles existed) makes the file one instance of a disaggregated prefill/decode pair: the
engine's P/D settings are added (vLLM's ``kv-transfer-config``, SGLang's
``disaggregation-mode``, TensorRT-LLM's ``cache_transceiver_config``; each exporter cites
its sources) and the notes say how the pair is wired. TGI has no P/D serving: a role is
refused with one line naming the engine. All three write NIXL as the KV transfer library,
so one transport serves every engine.

Engines and their formats (``docs/engines.md`` sections 1.2-1.5, 2.1, 3, 4, 6):

- ``vllm``: ``vllm serve MODEL --config vllm.yaml`` (long option names, kebab-case);
- ``sglang``: ``python -m sglang.launch_server --config sglang.yaml`` (CLI names);
- ``trtllm``: ``trtllm-serve MODEL --extra_llm_api_options trtllm.yaml`` (LLM-API fields);
- ``tgi``: ``text-generation-launcher`` flags and their environment variables (TGI has no
  config file), as a shell file to source.

Which key or flag each engine takes a knob as, and which knobs it cannot express, come
from the knob table (:mod:`servetune.knobs`): :func:`plain_settings` writes the knobs an
engine takes as they are, :func:`unsupported_settings` lists the ones it lacks; each
exporter adds its conversions, its special cases and the advice for what it lacks.

Memory settings come from the GPU profile the policy was tuned with: the optimizer
writes it into ``metadata.profile`` (``gpu_memory_bytes``, ``weight_bytes``,
``gpu_memory_utilization``, ``activation_bytes``, ``block_size``, ``kv_blocks``); an
explicit ``profile`` argument (a Profile document or such a mapping) takes precedence.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from servetune import __version__, knobs
from servetune.engines import BY_NAME, CONFIG_FILES, DISAGG_ROLES, ENGINE_NAMES
from servetune.errors import ServetuneError
from servetune.export.classes import class_source, gateway_rules
from servetune.schemas.base import dump_yaml
from servetune.schemas.policy import Policy

if TYPE_CHECKING:
    from servetune.profiles.schema import Profile
    from servetune.schemas.gateway import GatewayRules


# The instances of a disaggregated prefill/decode pair an export may be for.
ROLES: tuple[str, ...] = DISAGG_ROLES

FILENAMES: dict[str, str] = CONFIG_FILES


@dataclass(frozen=True)
class ExportResult:
    """One engine's config: its text, what it cannot express, and its file name."""

    text: str
    unsupported: list[str]
    filename: str
    engine: str = ""
    notes: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)  # the emitted keys and values
    args: list[str] = field(default_factory=list)  # launcher arguments (TGI)
    env: dict[str, str] = field(default_factory=dict)  # environment variables (TGI)
    warnings: list[str] = field(default_factory=list)  # provenance mismatches (export_policy)
    requires: str = ""  # the minimum engine version the file's options need, in words
    gateway_rules: GatewayRules | None = None  # per-class rules (export_policy), if any


@dataclass(frozen=True)
class MemoryFacts:
    """What the exporters need to know about the GPU and model the policy was tuned for.

    ``gpu_memory_utilization`` is vLLM's share of *total* GPU memory for weights,
    activations and KV; ``activation_bytes`` the activation/CUDA-graph reserve inside it.
    """

    gpu_memory_bytes: int | None = None
    weight_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    activation_bytes: int | None = None
    block_size: int | None = None
    kv_blocks: int | None = None
    kv_blocks_override: int | None = None  # the profile pins the pool (vLLM's override)
    source: str = ""

    @property
    def kv_tokens(self) -> int | None:
        if self.kv_blocks is None or self.block_size is None:
            return None
        return self.kv_blocks * self.block_size

    def missing(self, *names: str) -> list[str]:
        return [n for n in names if getattr(self, n) is None]


_FACT_NAMES = (
    "gpu_memory_bytes",
    "weight_bytes",
    "gpu_memory_utilization",
    "activation_bytes",
    "block_size",
    "kv_blocks",
    "kv_blocks_override",
)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


_POSITIVE = ("block_size", "gpu_memory_bytes", "kv_blocks_override")

# Other spellings of the same facts (Profile.memory_summary() uses the long ones).
_ALIASES = {
    "weight_bytes_per_gpu": "weight_bytes",
    "activation_reserve_bytes": "activation_bytes",
}


def _facts_from_mapping(data: Mapping[str, Any], source: str) -> MemoryFacts:
    data = {_ALIASES.get(str(k), str(k)): v for k, v in data.items()}
    values: dict[str, Any] = {}
    for name in _FACT_NAMES:
        raw = data.get(name)
        num = _number(raw)
        if raw is not None and num is None:
            raise ServetuneError(f"{source}: {name}: expected a number (got {raw!r})")
        if num is None:
            continue
        if name == "gpu_memory_utilization":
            if not 0.0 < num <= 1.0:
                raise ServetuneError(f"{source}: {name}: must be in (0, 1] (got {raw!r})")
            values[name] = num
        else:
            # counts of bytes and blocks: check the whole number used, not the raw value
            # (0.5 bytes would pass "> 0" and then divide by zero)
            if num < 0 or (name in _POSITIVE and int(num) <= 0):
                raise ServetuneError(f"{source}: {name}: must be positive (got {raw!r})")
            values[name] = int(num)
    return MemoryFacts(source=source, **values)


def profile_memory_facts(profile: Profile) -> dict[str, Any]:
    """The facts of a Profile document as a plain mapping (what the optimizer stores in a
    policy's ``metadata.profile``): its ``memory_summary()`` in this module's names."""
    summary = profile.memory_summary() if hasattr(profile, "memory_summary") else {}
    data = {_ALIASES.get(k, k): v for k, v in summary.items()}
    out = {name: data[name] for name in _FACT_NAMES if data.get(name) is not None}
    if "name" not in out and getattr(profile, "name", None):
        out = {"name": profile.name, **out}
    return out


def _facts_from_profile(profile: Profile) -> MemoryFacts:
    source = f"profile {getattr(profile, 'name', '')!r}"
    return _facts_from_mapping(profile_memory_facts(profile), source)


def memory_facts(
    policy: Policy, profile: Profile | Mapping[str, Any] | MemoryFacts | None = None
) -> MemoryFacts:
    """The memory facts from ``profile`` when given, else the policy's
    ``metadata.profile``, else an empty set (exporters then say what they could not pin)."""
    if profile is not None:
        if isinstance(profile, MemoryFacts):
            return profile
        if isinstance(profile, Mapping):
            return _facts_from_mapping(profile, "argument `profile`")
        return _facts_from_profile(profile)
    meta = policy.metadata.get("profile") if isinstance(policy.metadata, dict) else None
    if isinstance(meta, Mapping):
        return _facts_from_mapping(meta, f"policy {policy.name!r}: metadata.profile")
    return MemoryFacts()


# An option's first engine release: (version, evidence) or (None, evidence) where the
# release is not pinned (docs/engines.md 7).
Since = tuple[str | None, str]


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".") if p.isdigit())


def requires_text(engine_title: str, since: Mapping[str, Since], used: Any) -> str:
    """The file's "Requires" line: the newest pinned release among the options ``used``
    (names in ``since``), and the options whose first release is not pinned."""
    rows = [(name, *since[name]) for name in dict.fromkeys(used) if name in since]
    pinned = [r for r in rows if r[1] is not None]
    out = []
    if pinned:
        name, version, evidence = max(pinned, key=lambda r: _version_key(str(r[1])))
        out.append(f"{engine_title} >= {version} (`{name}`: {evidence})")
    open_rows = [r for r in rows if r[1] is None]
    if open_rows:
        out.append("a release with " + "; ".join(f"`{n}` ({e})" for n, _, e in open_rows)
                   + ", release not pinned by servetune: check --help")
    return "; and ".join(out)


def header(engine_title: str, usage: str, policy: Policy, unsupported: list[str],
           notes: list[str], requires: str = "", role: str | None = None) -> str:
    """The comment block at the top of every exported file (``role``: the P/D instance
    it configures, named in the first line)."""
    instance = f" for a {role} instance" if role is not None else ""
    lines = [
        f"{engine_title} config{instance} exported by servetune {__version__} from policy "
        f"{policy.name!r}.",
        f"Use: {usage}",
    ]
    if requires:
        lines.append(f"Requires: {requires}.")
    if unsupported:
        lines.append("")
        lines.append(f"NOT EXPRESSIBLE in {engine_title} ({len(unsupported)}): the policy "
                     "sets these, the engine has no such knob; do this instead:")
        lines += [f"  - {item}" for item in unsupported]
    else:
        lines.append("Every policy setting is expressed below; nothing was left out.")
    if notes:
        lines.append("")
        lines.append("Notes:")
        lines += [f"  - {item}" for item in notes]
    out = []
    for line in lines:
        if not line:
            out.append("#")
            continue
        indent = "    " if line.startswith("  - ") else "  "
        out += textwrap.wrap(line, width=98, initial_indent="# ",
                             subsequent_indent="# " + indent, break_on_hyphens=False)
    return "\n".join(out) + "\n"


def lane_summary(policy: Policy) -> str:
    lr = policy.long_requests
    parts = [f"threshold {lr.threshold_tokens} tokens (prompt + expected output)"]
    if lr.reserved_seqs:
        parts.append(f"{lr.reserved_seqs} reserved seats")
    if lr.reserved_kv_fraction:
        parts.append(f"{lr.reserved_kv_fraction:g} of KV reserved")
    if lr.max_seqs is not None:
        parts.append(f"at most {lr.max_seqs} running")
    if lr.max_kv_fraction < 1.0:
        parts.append(f"at most {lr.max_kv_fraction:g} of KV")
    return ", ".join(parts)


def lanes_instead(policy: Policy) -> str:
    """What a user needs in place of long-request lanes on an engine without them."""
    lr = policy.long_requests
    cap = (
        f"; cap concurrent long requests at {lr.max_seqs} with a gateway concurrency limit"
        if lr.max_seqs is not None
        else ""
    )
    return (
        f"long_requests ({lane_summary(policy)}): the engine has no long-request lanes; "
        f"instead add a router rule sending requests whose prompt + max_tokens >= "
        f"{lr.threshold_tokens} to a separate replica pool (or a gateway queue of their own)"
        f"{cap}"
    )


def class_priority_instead(policy: Policy, engine_title: str) -> str:
    """Per-class priorities travel with each request; say which value each class sends."""
    pairs = ", ".join(f"{name}={cp.priority}" for name, cp in sorted(policy.classes.items()))
    return (
        f"classes.*.priority ({pairs}): {engine_title} takes priority per request, not per "
        f"class; set the request's `priority` field to these values at the gateway or client"
    )


def fcfs_only_instead(engine_queue: str) -> str:
    """What to do about ``scheduling: priority`` on an engine that serves in arrival order."""
    return (
        f"scheduling (priority): {engine_queue}; serve high-priority classes from their own "
        "replicas or queue them first at the gateway"
    )


def no_chunk_cap_instead(policy: Policy, engine_title: str, why: str = "") -> str:
    """What to do about ``long_prefill_token_threshold`` on an engine without the cap."""
    return (
        f"batching.long_prefill_token_threshold "
        f"({policy.batching.long_prefill_token_threshold}): {engine_title} has no "
        f"per-request chunk cap{why}; route very long prompts to a separate replica with a "
        "router rule"
    )


def queued_tokens_instead(policy: Policy) -> str:
    """What to do about ``max_queued_prompt_tokens`` on an engine without the cap."""
    return (
        f"admission.max_queued_prompt_tokens ({policy.admission.max_queued_prompt_tokens}): "
        "no such cap; enforce it at the gateway (HTTP 503 when the prompt tokens of requests "
        "still in prefill exceed it)"
    )


def plain_settings(policy: Policy, engine: str, *sections: str) -> dict[str, Any]:
    """The knobs ``engine`` takes as they are, under its names (the knob table's
    :class:`~servetune.knobs.Plain` cells), by section in the order given (all, in table
    order, by default); a knob set to None is left out, except one that None leaves to the
    engine (``batching.enable_chunked_prefill``), which is written as the engine's own
    default, so the file says what the engine will do."""
    out: dict[str, Any] = {}
    for path, name in knobs.plain_names(engine, sections or None).items():
        value = knobs.value_for(path, policy, engine)
        if value is not None:
            out[name] = value
    return out


Instead = Callable[[Policy], str]


def unsupported_settings(policy: Policy, engine: str, instead: dict[str, Instead]) -> list[str]:
    """One entry per knob ``engine`` cannot express (in the order of
    :func:`servetune.knobs.not_expressible`) that the policy moves off its default, or that
    no policy can leave out: what the user needs instead, from ``instead`` (knob path ->
    advice) or, for a knob the exporter has no advice for, a generic line."""
    out = []
    for k in knobs.not_expressible(engine):
        cell = k.exports[engine]
        always = isinstance(cell, knobs.NotExpressible) and cell.always
        value = k.value(policy)
        if value == k.default and not always:
            continue
        advice = instead.get(k.path)
        out.append(advice(policy) if advice is not None else (
            f"{k.path} ({value}): {BY_NAME[engine].title} has no such setting; enforce it "
            "outside the engine (a router rule or a gateway limit)"
        ))
    return out


def yaml_result(engine: str, title: str, usage: str, policy: Policy, settings: dict[str, Any],
                unsupported: list[str], notes: list[str], requires: str = "",
                role: str | None = None) -> ExportResult:
    """An engine's YAML config: the comment header, then the settings."""
    return ExportResult(
        engine=engine,
        text=header(title, usage, policy, unsupported, notes, requires, role)
        + dump_yaml(settings),
        unsupported=unsupported,
        filename=FILENAMES[engine],
        notes=notes,
        settings=settings,
        requires=requires,
    )


def mismatch_warnings(policy: Policy, engine: str, profile: Profile | None = None) -> list[str]:
    """What the policy's provenance says it was not checked for: tuned under another
    engine's model (``metadata.engine``), or for another GPU or model than ``profile``
    (``metadata.profile``, as the optimizer writes it)."""
    meta = policy.metadata if isinstance(policy.metadata, dict) else {}
    out: list[str] = []
    tuned_engine = meta.get("engine")
    if isinstance(tuned_engine, str) and tuned_engine and tuned_engine != engine:
        title = BY_NAME[engine].title
        out.append(
            f"policy {policy.name!r} was tuned under servetune's {tuned_engine!r} engine model "
            f"(metadata.engine), not {engine!r}: {title}'s admission never judged it; check "
            f"it with `servetune simulate --engine {engine}` or let `servetune nightly "
            f"--engines {engine}` gate it")
    tuned = meta.get("profile")
    if profile is None or not isinstance(tuned, Mapping):
        return out
    given = profile_memory_facts(profile)
    hw, model = getattr(profile, "hardware", None), getattr(profile, "model", None)
    gpu_checked = model_checked = False
    if hw is not None and isinstance(tuned.get("gpu"), str):
        gpu_checked = True
        if tuned["gpu"] != hw.name:
            out.append(f"policy {policy.name!r} was tuned on GPU {tuned['gpu']!r} "
                       f"(metadata.profile.gpu), the profile given is for {hw.name!r}")
    elif _number(tuned.get("gpu_memory_bytes")) and given.get("gpu_memory_bytes"):
        gpu_checked = True
        a, b = int(_number(tuned["gpu_memory_bytes"]) or 0), int(given["gpu_memory_bytes"])
        if a != b:
            out.append(f"policy {policy.name!r} was tuned on a GPU with {a} bytes of memory "
                       f"(metadata.profile.gpu_memory_bytes), the profile given has {b}")
    if model is not None and isinstance(tuned.get("model"), str):
        model_checked = True
        if tuned["model"] != model.name:
            out.append(f"policy {policy.name!r} was tuned for model {tuned['model']!r} "
                       f"(metadata.profile.model), the profile given is for {model.name!r}")
    elif _number(tuned.get("weight_bytes")) and given.get("weight_bytes"):
        model_checked = True
        a, b = int(_number(tuned["weight_bytes"]) or 0), int(given["weight_bytes"])
        if a != b:
            out.append(f"policy {policy.name!r} was tuned for a model with {a} weight bytes "
                       f"per GPU (metadata.profile.weight_bytes), the profile given has {b} "
                       "(another model or parallelism)")
    if not (gpu_checked or model_checked):
        a_blocks, b_blocks = _number(tuned.get("kv_blocks")), given.get("kv_blocks")
        if a_blocks and b_blocks and int(a_blocks) != int(b_blocks):
            out.append(f"policy {policy.name!r} was tuned for a KV pool of {int(a_blocks)} "
                       f"blocks (metadata.profile.kv_blocks), the profile given has {b_blocks}")
    return out


def with_warnings(result: ExportResult, warnings: list[str]) -> ExportResult:
    """``result`` with ``warnings`` as comments at the very top of its file."""
    if not warnings:
        return result
    lines: list[str] = []
    for item in warnings:
        lines += textwrap.wrap(f"WARNING: {item}", width=98, initial_indent="# ",
                               subsequent_indent="#   ", break_on_hyphens=False)
    return replace(result, text="\n".join(lines) + "\n" + result.text,
                   warnings=[*result.warnings, *warnings])


def export_policy(
    policy: Policy,
    engine: str,
    *,
    profile: Profile | Mapping[str, Any] | MemoryFacts | None = None,
    check_provenance: bool = True,
    role: str | None = None,
    class_header: str | None = None,
    class_field: str | None = None,
) -> ExportResult:
    """Translate ``policy`` into ``engine``'s config file (see the module docstring), for
    an aggregated instance or, with ``role``, one instance of a prefill/decode pair, with
    the gateway rules for its per-class settings (``gateway_rules``; the gateway tells a
    request's class by header ``class_header``, default ``x-servetune-class``, or by body
    field ``class_field``).

    With ``check_provenance`` (the default), :func:`mismatch_warnings` (tuned under
    another engine's model, or for another GPU or model than a Profile ``profile``) go to
    the top of the file and to ``warnings``; ``servetune nightly`` turns it off for the
    engines whose gate it ran."""
    if engine not in BY_NAME:
        raise ServetuneError(
            f"engine {engine!r} is not supported; choose one of {', '.join(ENGINE_NAMES)}"
        )
    if role is not None and role not in ROLES:
        raise ServetuneError(
            f"argument `role` {role!r} is not supported; choose one of {', '.join(ROLES)}"
        )
    source = class_source(class_header, class_field)
    facts = memory_facts(policy, profile)
    result = BY_NAME[engine].export_function()(policy, facts, role=role)
    rules = gateway_rules(policy, engine, config_file=result.filename, source=source)
    result = replace(result, gateway_rules=rules)
    if not check_provenance:
        return result
    given = profile if profile is not None and hasattr(profile, "memory_summary") else None
    return with_warnings(result, mismatch_warnings(policy, engine, given))  # type: ignore[arg-type]


__all__ = [
    "FILENAMES",
    "ROLES",
    "ExportResult",
    "Instead",
    "MemoryFacts",
    "export_policy",
    "memory_facts",
    "mismatch_warnings",
    "requires_text",
    "with_warnings",
    "plain_settings",
    "profile_memory_facts",
    "unsupported_settings",
]
