"""GatewayRules: what a gateway in front of an engine's replicas does for per-class settings.

``servetune export`` writes one (``gateway-rules.yaml``, next to the engine config) when the
policy has per-class settings (``Policy.classes``) the engine cannot express; how each
setting becomes a rule is in :mod:`servetune.export.classes`. The file is engine-neutral:
any gateway, router or proxy that can match a request, set a field on it, limit
concurrency per key, queue and route can apply it. The fields:

- ``policy``, ``engine``, ``config_file``: where the rules come from, and the engine config
  of the *main pool* (every replica not in one of ``pools``);
- ``class_from``: how the gateway tells a request's class: the value of request header
  ``header`` (lower case; ``x-servetune-class`` unless told otherwise), or of the JSON body
  field ``field`` (a dotted path, e.g. ``model`` or ``metadata.tenant``); a request whose
  value is the name of a class in ``classes`` belongs to it, any other request is
  unclassed (no limits, the engine's default priority, the main pool);
- ``limits_per: replica``: every count below is per engine replica (the policy is one
  engine's); a gateway that counts across N replicas of a pool multiplies by N;
- ``seats_per_replica``: the policy's ``batching.max_num_seqs``, the seats the
  reservations are counted against;
- ``priority_field``: the request body field the gateway sets to the class's priority
  (``priority``: vLLM and SGLang, lower first); null where the engine serves first come,
  first served, so the gateway orders its own per-class queues by the priority instead;
- ``classes``, by class name:

  - ``priority``: the value to set (null: the policy schedules first come, first served);
  - ``concurrency_limit``: at most this many of the class's requests in flight at one
    replica; the rest wait at the gateway, in a queue of the class's own;
  - ``queue_limit`` and ``overflow_status``: at most this many of the class's requests in
    flight and waiting per replica; an arrival beyond is answered with this HTTP status;
  - ``reserved_seqs``: with no ``pool``, the gateway forwards other traffic to a replica
    only while it leaves this class's unused reserve (``reserved_seqs`` less the class's
    requests in flight there) free within ``seats_per_replica``; with a pool, the pool's
    share holds it;
  - ``reserved_kv_fraction``, ``max_kv_fraction``, ``long_prefill_token_threshold``: the
    policy's values, kept for the reader; the pool carries them out (a gateway cannot
    count KV);
  - ``pool``: the pool the class is routed to (null: the main pool);

- ``pools``, by name (a pool is named after its class): ``classes`` (the classes routed
  there), ``min_share`` and ``max_share`` (the share of the replicas the pool should have:
  at least ``min_share``, the class's reservation; at most ``max_share``, its KV cap;
  ``max_share`` null: no cap, size it for the class's load), ``spill_to_main`` (whether
  the class's requests may go to the main pool when its own is full: only where the pool
  is there for a reservation alone), ``policy_overrides`` (policy knobs, by dotted path,
  that differ in the pool's engine config: export the policy with them for the pool) and
  ``engine_overrides`` (the same in the engine's own keys), and ``settings`` (the class
  settings the pool is there for).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from servetune.engines import ENGINE_NAMES
from servetune.schemas.base import Document, Strict

DEFAULT_CLASS_HEADER = "x-servetune-class"
# The HTTP statuses a gateway answers an arrival beyond a class's queue limit with: 503
# (vLLM's answer past max-num-queued-reqs), 429 (TGI's past --max-concurrent-requests).
OVERFLOW_STATUSES: tuple[int, ...] = (429, 503)

# An HTTP field name is a token (RFC 9110 5.1, 5.6.2).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
MAX_NAME_CHARS = 128
# Headers that frame or route the request itself: no gateway can take a class from them.
FRAMING_HEADERS = frozenset({
    "connection", "content-length", "content-type", "host", "keep-alive",
    "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
})
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
# Body fields the gateway writes (the priority) or that hold the request's content.
RESERVED_FIELDS = frozenset({"priority", "prompt", "messages"})


def header_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be the header a gateway takes the class from (None: it can)."""
    if not name:
        return "is empty; give a header name such as x-servetune-class"
    if len(name) > MAX_NAME_CHARS:
        return f"is longer than {MAX_NAME_CHARS} characters"
    if not _TOKEN.fullmatch(name):
        return ("is not an HTTP header name (letters, digits and !#$%&'*+-.^_`|~ only; no "
                "spaces, colons or other characters)")
    if name.lower() in FRAMING_HEADERS:
        return ("is a standard header that frames or routes the request; choose a header of "
                "your own such as x-servetune-class")
    return None


def field_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be the body field a gateway takes the class from (None: it can)."""
    if not name:
        return "is empty; give a request body field such as model or user"
    if len(name) > MAX_NAME_CHARS:
        return f"is longer than {MAX_NAME_CHARS} characters"
    if not _FIELD.fullmatch(name):
        return ("is not a request body field (names of letters, digits and _, not starting "
                "with a digit, joined by dots, e.g. metadata.tenant)")
    if name in RESERVED_FIELDS:
        return ("holds the request's content or the priority the gateway sets; choose the "
                "field that names the tenant or class, such as model or user")
    return None


class ClassSource(Strict):
    header: str | None = Field(None, description="request header holding the class name")
    field: str | None = Field(None, description="request body field (dotted path) holding it")

    @field_validator("header")
    @classmethod
    def _header(cls, value: str | None) -> str | None:
        if value is None:
            return None
        problem = header_name_problem(value)
        if problem is not None:
            raise ValueError(f"{value!r} {problem}")
        return value.lower()  # header names are case-insensitive; HTTP/2 sends lower case

    @field_validator("field")
    @classmethod
    def _field(cls, value: str | None) -> str | None:
        if value is not None:
            problem = field_name_problem(value)
            if problem is not None:
                raise ValueError(f"{value!r} {problem}")
        return value

    @model_validator(mode="after")
    def _one(self) -> ClassSource:
        if (self.header is None) == (self.field is None):
            raise ValueError("class_from: give exactly one of header or field")
        return self


class ClassRule(Strict):
    priority: int | None = Field(None, description="the request's priority (lower first)")
    concurrency_limit: int | None = Field(
        None, ge=1, description="the class's requests in flight per replica (max_seqs)")
    queue_limit: int | None = Field(
        None, ge=1, description="the class's requests in flight + waiting per replica")
    overflow_status: Literal[OVERFLOW_STATUSES] | None = Field(  # type: ignore[valid-type]
        None, description="HTTP status for an arrival beyond queue_limit")
    reserved_seqs: int = Field(0, ge=0, description="seats per replica kept for the class")
    reserved_kv_fraction: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    max_kv_fraction: float = Field(1.0, ge=0.0, le=1.0, allow_inf_nan=False)
    long_prefill_token_threshold: int | None = Field(None, ge=1)
    pool: str | None = Field(None, min_length=1, description="pool name; null: the main pool")

    @model_validator(mode="after")
    def _overflow(self) -> ClassRule:
        if (self.queue_limit is None) != (self.overflow_status is None):
            raise ValueError("overflow_status is set exactly when queue_limit is")
        return self


class Pool(Strict):
    classes: list[str] = Field(min_length=1, description="the classes routed to the pool")
    min_share: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False,
                             description="at least this share of the replicas")
    max_share: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False,
                                    description="at most this share of the replicas")
    spill_to_main: bool = Field(False, description="overflow may go to the main pool")
    policy_overrides: dict[str, Any] = Field(default_factory=dict)
    engine_overrides: dict[str, Any] = Field(default_factory=dict)
    settings: list[str] = Field(default_factory=list, description="why the pool exists")

    @model_validator(mode="after")
    def _shares(self) -> Pool:
        if self.max_share is not None and self.min_share > self.max_share:
            raise ValueError(f"min_share ({self.min_share}) must be <= max_share "
                             f"({self.max_share})")
        return self


class GatewayRules(Document):
    KIND: ClassVar[str] = "GatewayRules"
    kind: Literal["GatewayRules"] = "GatewayRules"
    policy: str = Field(description="the policy's name")
    engine: Literal[ENGINE_NAMES]  # type: ignore[valid-type]
    config_file: str = Field(min_length=1, description="the main pool's engine config")
    class_from: ClassSource = Field(default_factory=lambda: ClassSource(
        header=DEFAULT_CLASS_HEADER))
    limits_per: Literal["replica"] = "replica"
    seats_per_replica: int = Field(ge=1, description="batching.max_num_seqs")
    priority_field: str | None = Field(None, min_length=1)
    classes: dict[str, ClassRule] = Field(min_length=1)
    pools: dict[str, Pool] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> GatewayRules:
        for name, rule in self.classes.items():
            if rule.pool is not None:
                pool = self.pools.get(rule.pool)
                if pool is None:
                    raise ValueError(f"classes.{name}.pool: no pool {rule.pool!r} in pools")
                if name not in pool.classes:
                    raise ValueError(f"pools.{rule.pool}.classes: lacks {name!r}, which "
                                     "classes routes there")
        for pool_name, pool in self.pools.items():
            for name in pool.classes:
                rule = self.classes.get(name)
                if rule is None or rule.pool != pool_name:
                    raise ValueError(f"pools.{pool_name}.classes: {name!r} is not a class "
                                     f"routed to pool {pool_name!r}")
        kept = sum(r.reserved_seqs for r in self.classes.values() if r.pool is None)
        if kept >= self.seats_per_replica:
            raise ValueError(f"the classes' reserved_seqs kept at the gateway ({kept}) must be "
                             f"< seats_per_replica ({self.seats_per_replica})")
        return self
