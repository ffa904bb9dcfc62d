"""Per-class settings (``Policy.classes``) on engines that have no per-class admission.

No engine admits by class: vLLM and SGLang take a priority per *request*, and none keeps
seats, KV or a queue per class or caps one class's prefill chunks. So each per-class
setting becomes work for the gateway (router, proxy) in front of the engine's replicas,
listed under "not expressible" in the engine's file (one line per class and setting
group, classes in name order, the policy's numbers) and written as machine-readable rules
(:class:`~servetune.schemas.gateway.GatewayRules`, ``gateway-rules.yaml``):

- ``priority`` (under ``scheduling: priority``): as before, the engine's priority
  scheduling (vLLM, SGLang) and the value the gateway sets in each request's ``priority``
  field; TensorRT-LLM and TGI serve first come, first served, so the gateway orders its
  own per-class queues by it;
- ``max_seqs``: a concurrency limit: at most that many of the class's requests in flight
  at one replica; the rest wait at the gateway in a queue of the class's own, so a held
  class blocks no other (as the policy's class lanes do). The engine rule counts running
  requests; in flight also counts those waiting inside the engine, so the gateway's limit
  is as strict or a little stricter;
- ``max_queued_requests``: a queue limit on the class's requests in flight and waiting;
  an arrival beyond it is answered with the engine's overload status (HTTP 503, vLLM's
  past ``max-num-queued-reqs``; 429 for TGI, its answer past ``--max-concurrent-requests``);
- ``reserved_seqs`` (a class without a pool): a per-class reservation at the gateway:
  other requests go to a replica only while they leave the class's unused reserve free
  within the replica's ``batching.max_num_seqs`` seats, which is the engine rule moved
  in front of it;
- ``reserved_kv_fraction``, ``max_kv_fraction``: a gateway cannot count KV blocks, so the
  class gets a replica pool of its own: at least the larger of its KV reserve and its seat
  reserve (``reserved_seqs / max_num_seqs``) of the replicas, at most its KV cap; it may
  spill into the main pool only when the pool is there for a reservation alone;
- ``long_prefill_token_threshold`` differing from the policy's: a pool of its own too; on
  vLLM the pool's config sets ``long-prefill-token-threshold`` to the class's cap, on the
  engines without a per-request chunk cap the pool only keeps the class's long prompts
  away from the other classes.

A pool is named after its class. Every limit is per replica (the policy is one engine's).
A policy whose classes ask nothing of a gateway gets no rules, and its engine file is what
it was before per-class settings existed.
"""

from __future__ import annotations

import importlib
import math
import textwrap
from dataclasses import dataclass

from servetune import __version__
from servetune.engines import BY_NAME
from servetune.errors import ServetuneError
from servetune.knobs import CHUNK_CAP
from servetune.schemas.base import document_to_yaml
from servetune.schemas.gateway import (
    DEFAULT_CLASS_HEADER,
    ClassRule,
    ClassSource,
    GatewayRules,
    Pool,
    field_name_problem,
    header_name_problem,
)
from servetune.schemas.policy import ClassPolicy, Policy

GATEWAY_RULES_FILE = "gateway-rules.yaml"


@dataclass(frozen=True)
class GatewayFacts:
    """What an engine offers the gateway in front of it (each exporter's ``GATEWAY``)."""

    title: str
    overflow_status: int  # the HTTP status the engine answers its own overload with
    priority_field: str | None  # the request field its priority scheduling reads; None: FCFS
    chunk_cap_key: str | None  # its per-request chunk cap's key; None: it has none
    no_chunk_cap_why: str = ""  # what the missing cap does, for the advice


def gateway_facts(engine: str) -> GatewayFacts:
    """Engine ``engine``'s :class:`GatewayFacts` (its exporter module's ``GATEWAY``)."""
    module = BY_NAME[engine].exporter.split(":")[0]
    facts: GatewayFacts = importlib.import_module(module).GATEWAY
    return facts


def class_source(header: str | None = None, field: str | None = None) -> ClassSource:
    """How the gateway tells a request's class: ``header`` or ``field`` (the default:
    header ``x-servetune-class``); a bad name is one error line saying what to give."""
    if header is not None and field is not None:
        raise ServetuneError("give argument `class_header` or argument `class_field`, not both")
    if field is not None:
        problem = field_name_problem(field)
        if problem is not None:
            raise ServetuneError(f"argument `class_field` {field!r} {problem}")
        return ClassSource(field=field)
    header = DEFAULT_CLASS_HEADER if header is None else header
    problem = header_name_problem(header)
    if problem is not None:
        raise ServetuneError(f"argument `class_header` {header!r} {problem}")
    return ClassSource(header=header)


# --------------------------------------------------------------------- what a class needs

def _ceil4(x: float) -> float:
    """``x`` rounded up to 4 decimals (a pool's floor must not shrink by rounding)."""
    return math.ceil(x * 10_000 - 1e-9) / 10_000


def _chunk_cap(policy: Policy, cp: ClassPolicy) -> int | None:
    """The class's chunk cap where it differs from the policy's (else None)."""
    cap = cp.long_prefill_token_threshold
    return cap if cap is not None and cap != policy.batching.long_prefill_token_threshold else None


@dataclass(frozen=True)
class _PoolPlan:
    min_share: float
    max_share: float | None
    spill_to_main: bool
    chunk_cap: int | None
    settings: tuple[str, ...]


def _pool_plan(policy: Policy, cp: ClassPolicy) -> _PoolPlan | None:
    """The replica pool class ``cp`` needs (None: the main pool serves it)."""
    chunk = _chunk_cap(policy, cp)
    kv = cp.reserved_kv_fraction > 0 or cp.max_kv_fraction < 1.0
    if chunk is None and not kv:
        return None
    cap = cp.max_kv_fraction if cp.max_kv_fraction < 1.0 else None
    floor = max(cp.reserved_kv_fraction, _ceil4(cp.reserved_seqs / policy.batching.max_num_seqs))
    if cap is not None:
        floor = min(floor, cap)  # the cap binds first, in the engine as here
    settings = [name for name, on in (
        ("reserved_seqs", cp.reserved_seqs > 0),
        ("reserved_kv_fraction", cp.reserved_kv_fraction > 0),
        ("max_kv_fraction", cap is not None),
        ("long_prefill_token_threshold", chunk is not None),
    ) if on]
    return _PoolPlan(min_share=floor, max_share=cap, spill_to_main=chunk is None and cap is None,
                     chunk_cap=chunk, settings=tuple(settings))


def _needs_gateway(policy: Policy, cp: ClassPolicy) -> bool:
    return bool((policy.scheduling == "priority" and cp.priority != 0)
                or cp.has_lane or _chunk_cap(policy, cp) is not None)


def needs_gateway(policy: Policy) -> bool:
    """Whether any class of ``policy`` asks something of the gateway."""
    return any(_needs_gateway(policy, cp) for cp in policy.classes.values())


# ------------------------------------------------------------------- the engine file's lines

def _limits_line(name: str, cp: ClassPolicy, gw: GatewayFacts) -> str | None:
    settings, actions = [], []
    if cp.max_seqs is not None:
        settings.append(f"classes.{name}.max_seqs ({cp.max_seqs})")
        actions.append(f"send class {name} at most {cp.max_seqs} requests in flight per "
                       "replica and queue the rest")
    if cp.max_queued_requests is not None:
        settings.append(f"classes.{name}.max_queued_requests ({cp.max_queued_requests})")
        whose = "its" if actions else f"class {name}'s"
        actions.append(f"answer HTTP {gw.overflow_status} to {whose} arrivals beyond "
                       f"{cp.max_queued_requests} in flight and queued per replica")
    if not settings:
        return None
    return (f"{', '.join(settings)}: {gw.title} has no per-class admission; at the gateway, "
            f"{', and '.join(actions)}")


def _share_text(plan: _PoolPlan) -> str:
    if plan.max_share is None:
        return f"at least {plan.min_share:g} of the replicas"
    if plan.min_share > 0:
        return f"at least {plan.min_share:g} and at most {plan.max_share:g} of the replicas"
    return f"at most {plan.max_share:g} of the replicas"


def _reserve_line(name: str, cp: ClassPolicy, plan: _PoolPlan | None, seats: int,
                  gw: GatewayFacts) -> str | None:
    settings = [f"classes.{name}.{key} ({value:g})" for key, value, on in (
        ("reserved_seqs", cp.reserved_seqs, cp.reserved_seqs > 0),
        ("reserved_kv_fraction", cp.reserved_kv_fraction, cp.reserved_kv_fraction > 0),
        ("max_kv_fraction", cp.max_kv_fraction, cp.max_kv_fraction < 1.0),
    ) if on]
    if not settings:
        return None
    if plan is None:  # seats alone: the gateway keeps them
        return (f"{settings[0]}: {gw.title} keeps no seats for a class; at the gateway, send "
                f"other requests to a replica only while they leave class {name}'s unused "
                f"reserve of {cp.reserved_seqs} of its {seats} seats free (or give the class "
                "a replica pool of its own)")
    lacks = " or ".join(word for word, on in (
        ("reservations", cp.reserved_seqs > 0 or cp.reserved_kv_fraction > 0),
        ("KV caps", cp.max_kv_fraction < 1.0)) if on)
    kv = (cp.reserved_kv_fraction > 0 or cp.max_kv_fraction < 1.0)
    spill = (", spilling into the main pool when it is full" if plan.spill_to_main
             else ", and never into the main pool" if plan.max_share is not None else "")
    return (f"{', '.join(settings)}: {gw.title} has no per-class {lacks}"
            f"{', and a gateway cannot count KV' if kv else ''}; route class {name} to a "
            f"replica pool of its own, `{name}`, of {_share_text(plan)}{spill}")


def _chunk_line(name: str, plan: _PoolPlan | None, gw: GatewayFacts) -> str | None:
    if plan is None or plan.chunk_cap is None:
        return None
    setting = f"classes.{name}.long_prefill_token_threshold ({plan.chunk_cap})"
    if gw.chunk_cap_key is not None:
        return (f"{setting}: {gw.title}'s chunk cap is per engine, not per class; route "
                f"class {name} to pool `{name}`, whose {gw.chunk_cap_key} is {plan.chunk_cap}")
    return (f"{setting}: {gw.title} has no per-request chunk cap{gw.no_chunk_cap_why}; route "
            f"class {name} to a replica pool of its own, `{name}`, so its long prompts do "
            "not hold up the other classes")


def class_settings_instead(policy: Policy, gw: GatewayFacts) -> list[str]:
    """The engine file's lines for the per-class settings (priorities aside: each exporter
    says those as before): per class in name order, its limits, its reservations and KV
    caps, its chunk cap, each line with the policy's numbers and what to do instead."""
    out: list[str] = []
    seats = policy.batching.max_num_seqs
    for name, cp in sorted(policy.classes.items()):
        plan = _pool_plan(policy, cp)
        lines = (_limits_line(name, cp, gw), _reserve_line(name, cp, plan, seats, gw),
                 _chunk_line(name, plan, gw))
        out += [line for line in lines if line is not None]
    return out


# ----------------------------------------------------------------------------- the rules

def gateway_rules(policy: Policy, engine: str, *, config_file: str,
                  source: ClassSource | None = None) -> GatewayRules | None:
    """The gateway rules for ``policy`` in front of ``engine`` (its main pool's config is
    ``config_file``), or None when no class asks anything of a gateway."""
    if not needs_gateway(policy):
        return None
    gw = gateway_facts(engine)
    classes: dict[str, ClassRule] = {}
    pools: dict[str, Pool] = {}
    for name, cp in sorted(policy.classes.items()):
        plan = _pool_plan(policy, cp)
        classes[name] = ClassRule(
            priority=cp.priority if policy.scheduling == "priority" else None,
            concurrency_limit=cp.max_seqs,
            queue_limit=cp.max_queued_requests,
            overflow_status=gw.overflow_status if cp.max_queued_requests is not None else None,
            reserved_seqs=cp.reserved_seqs,
            reserved_kv_fraction=cp.reserved_kv_fraction,
            max_kv_fraction=cp.max_kv_fraction,
            long_prefill_token_threshold=cp.long_prefill_token_threshold,
            pool=name if plan is not None else None,
        )
        if plan is None:
            continue
        chunk = plan.chunk_cap if gw.chunk_cap_key is not None else None
        pools[name] = Pool(
            classes=[name],
            min_share=plan.min_share,
            max_share=plan.max_share,
            spill_to_main=plan.spill_to_main,
            policy_overrides={CHUNK_CAP: chunk} if chunk is not None else {},
            engine_overrides={gw.chunk_cap_key: chunk} if chunk is not None else {},
            settings=list(plan.settings),
        )
    return GatewayRules(
        policy=policy.name,
        engine=engine,
        config_file=config_file,
        class_from=source if source is not None else class_source(),
        seats_per_replica=policy.batching.max_num_seqs,
        priority_field=gw.priority_field if policy.scheduling == "priority" else None,
        classes=classes,
        pools=pools,
    )


def gateway_rules_text(rules: GatewayRules) -> str:
    """The rules file: a comment header saying what it is, then the document's YAML."""
    title = BY_NAME[rules.engine].title
    src = rules.class_from
    told = (f"header {src.header}" if src.header is not None
            else f"JSON body field {src.field}")
    lines = [
        f"Gateway rules exported by servetune {__version__} from policy {rules.policy!r} for "
        f"{title} ({rules.config_file}): the policy's per-class settings {title} cannot "
        "express, as rules for the gateway in front of its replicas.",
        f"A request's class is the value of its {told}; other requests have no limits and "
        "go to the main pool (the replicas running the engine config). Every limit is per "
        "replica. A class with a pool goes to replicas running the engine config with the "
        "pool's overrides.",
        "Fields: servetune.schemas.gateway (module docstring).",
    ]
    header = "\n".join(
        "\n".join(textwrap.wrap(line, width=96, break_on_hyphens=False)) for line in lines)
    return document_to_yaml(rules, header=header)


__all__ = [
    "GATEWAY_RULES_FILE",
    "GatewayFacts",
    "class_settings_instead",
    "class_source",
    "gateway_facts",
    "gateway_rules",
    "gateway_rules_text",
    "needs_gateway",
]
