"""The policy knobs: one row each, the one list of them.

A knob is a tunable Policy setting, named by its dotted path (``batching.max_num_seqs``);
:data:`KNOBS` holds every one, in the order of ``Policy.knobs()``. A row says:

- ``modeled``: the fluid model and the policy MILP choose it (it is a field of
  ``servetune.models.fluid.Knobs``; the others take their first search-space value);
- ``sim_param`` / ``sim_encode``: the simulator kernel parameter it feeds (a field of
  ``servetune.sim._kernel.Params``) and how the policy's value becomes it
  (:func:`sim_values`; a row whose parameter the kernel does not have yet feeds nothing,
  :func:`simulated`);
- ``off_at_or_above``: how candidates compare for equivalence: a value at or above that
  other knob's value acts as off (a per-request chunk cap at or above the step budget caps
  nothing), so the simulator cannot tell it from the default (:func:`equivalence_key`);
- ``exports``: per engine, the key or flag the engine takes it as (:class:`Plain`: the
  value as is; :class:`Converted`: the exporter computes the value), or
  :class:`NotExpressible`;
- ``space``: its values in the default search space of ``servetune optimize`` (``None``:
  not searched by default);
- ``summary``: shown in ``servetune optimize``'s one-line summary;
- ``switch``: the knob that turns this one on (the long-request lanes act only while
  ``long_requests.threshold_tokens`` is set); it is reported and simulated with it;
- ``widen``: the range of values the engines accept that ``optimize`` may widen a search
  space into when its answer sits on the space's edge (:func:`beyond_edge`); values
  outside it (a chunk cap of 0: off) are not on the knob's scale. ``None``: never widened.
- ``label``: its short name in reports and logs (``seqs 32, tokens 1024``,
  :func:`short_text`); None: its dotted path;
- ``engine_defaults``: for a knob whose policy value may be None meaning "the engine's own
  default" (``batching.enable_chunked_prefill``: on in vLLM, SGLang and TGI, off in
  ``trtllm-serve``), that default per engine (:func:`value_for` resolves it; the simulator
  and the exporters use the resolved value, so a policy that does not ask for chunking
  gets each engine's own behaviour, and one that sets ``true`` or ``false`` gets it
  everywhere).

The fluid model's ``Knobs``, the default search space, the equivalence key, the
exporters' name tables and "not expressible" lists and the CLI summary line are derived
from this table. A new knob is a row here plus the code that gives it meaning (the Policy
field, the simulator, the fluid model and MILP when modeled, an exporter's conversion).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from servetune.engines import ENGINE_NAMES, ENGINES
from servetune.schemas.policy import Policy


@dataclass(frozen=True)
class Plain:
    """The engine takes the knob's value as is, under ``name`` (left out when None)."""

    name: str

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)


@dataclass(frozen=True)
class Converted:
    """The engine takes the knob under ``names``, with a value its exporter computes
    (units, an ``off`` spelling, a cap shared with another knob)."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class NotExpressible:
    """The engine has no such knob. A policy at the knob's default loses nothing (the
    engine behaves so anyway), unless ``always``: then every policy sets something the
    engine cannot (TGI has no running-batch cap at all)."""

    always: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return ()


Export = Plain | Converted | NotExpressible
NOT_EXPRESSIBLE = NotExpressible()


def converted(*names: str) -> Converted:
    return Converted(tuple(names))


# --- how a policy value becomes the simulator kernel's parameter ----------------------
SimEncode = Callable[[Any, Policy, int], int | bool]


def _count(value: Any, policy: Policy, kv_blocks: int) -> int:
    return int(value)


def _flag(value: Any, policy: Policy, kv_blocks: int) -> bool:
    return bool(value)


def _priority_mode(value: Any, policy: Policy, kv_blocks: int) -> bool:
    return value == "priority"


def _cap_or_none(value: Any, policy: Policy, kv_blocks: int) -> int:
    return -1 if value is None else int(value)  # -1: no cap


def _share_of_pool(value: Any, policy: Policy, kv_blocks: int) -> int:
    return int(math.floor(value * kv_blocks))  # a fraction of the KV pool, in blocks


def _seats_or_batch(value: Any, policy: Policy, kv_blocks: int) -> int:
    return int(policy.batching.max_num_seqs if value is None else value)


def _is_set(value: Any, policy: Policy, kv_blocks: int) -> bool:
    return value is not None


@dataclass(frozen=True)
class Knob:
    """One policy knob (module docstring)."""

    path: str
    sim_param: str
    sim_encode: SimEncode
    exports: Mapping[str, Export]
    modeled: bool = False
    space: tuple[Any, ...] | None = None
    summary: bool = False
    off_at_or_above: str | None = None
    switch: str | None = None
    widen: tuple[float, float] | None = None
    engine_defaults: Mapping[str, Any] | None = None
    label: str | None = None

    @property
    def name(self) -> str:
        """The field name (``max_num_seqs``): the fluid model's attribute for it."""
        return self.path.rsplit(".", 1)[-1]

    @property
    def section(self) -> str:
        """``batching``, ``admission``, ``long_requests``, ``caching``; ``scheduling`` for
        itself."""
        return self.path.split(".", 1)[0]

    @property
    def default(self) -> Any:
        return _policy_defaults()[self.path]

    def value(self, policy: Policy) -> Any:
        """The policy's value as written (None: unset, or the engine's default)."""
        target: Any = policy
        for part in self.path.split("."):
            target = getattr(target, part)
        return target

    def value_for(self, policy: Policy, engine: str) -> Any:
        """The value ``engine`` runs with: the policy's, or, where the policy leaves it
        None and the row has ``engine_defaults``, the engine's own default."""
        value = self.value(policy)
        if value is None and self.engine_defaults is not None:
            _check_engine(engine)
            return self.engine_defaults[engine]
        return value


def _engines(**cells: Export) -> dict[str, Export]:
    """A row's export cells: one per engine of the engine table, no more, no fewer."""
    if sorted(cells) != sorted(ENGINE_NAMES):
        raise ValueError(f"export cells {sorted(cells)} != engines {sorted(ENGINE_NAMES)}")
    return {name: cells[name] for name in ENGINE_NAMES}


_NONE = NOT_EXPRESSIBLE
_LANES = "long_requests.threshold_tokens"
# The per-request chunk cap: what a gateway's class pools and the tier model set per class
# (only the engines that express it, see its row).
CHUNK_CAP = "batching.long_prefill_token_threshold"

KNOBS: tuple[Knob, ...] = (
    Knob("scheduling", "priority_scheduling", _priority_mode,
         _engines(vllm=Plain("scheduling-policy"),
                  sglang=converted("enable-priority-scheduling"),
                  trtllm=_NONE, tgi=_NONE)),
    Knob("batching.max_num_seqs", "max_seqs", _count,
         _engines(vllm=Plain("max-num-seqs"), sglang=converted("max-running-requests"),
                  trtllm=Plain("max_batch_size"), tgi=NotExpressible(always=True)),
         modeled=True, space=(4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048), summary=True,
         widen=(1, 16384), label="seqs"),
    Knob("batching.max_num_batched_tokens", "budget", _count,
         _engines(vllm=Plain("max-num-batched-tokens"),
                  sglang=converted("chunked-prefill-size", "max-prefill-tokens"),
                  trtllm=Plain("max_num_tokens"), tgi=Plain("--max-batch-prefill-tokens")),
         modeled=True, space=(256, 512, 1024, 2048, 4096, 8192, 16384, 32768), summary=True,
         widen=(16, 262144), label="tokens"),
    Knob(CHUNK_CAP, "long_prefill_threshold", _count,
         _engines(vllm=Plain("long-prefill-token-threshold"), sglang=_NONE, trtllm=_NONE,
                  tgi=_NONE),
         modeled=True, space=(0, 128, 256, 512, 1024, 2048), summary=True,
         off_at_or_above="batching.max_num_batched_tokens", widen=(16, 262144),
         label="chunk"),
    # None: each engine's own default (Engine.chunked_prefill: off only in trtllm-serve).
    Knob("batching.enable_chunked_prefill", "chunked_prefill", _flag,
         _engines(vllm=Plain("enable-chunked-prefill"),
                  sglang=converted("chunked-prefill-size"),
                  trtllm=Plain("enable_chunked_prefill"), tgi=converted("PREFILL_CHUNKING")),
         engine_defaults={e.name: e.chunked_prefill for e in ENGINES}),
    Knob("admission.kv_watermark", "watermark_blocks", _share_of_pool,
         _engines(vllm=Plain("watermark"), sglang=_NONE, trtllm=_NONE, tgi=_NONE),
         modeled=True, space=(0.0, 0.01, 0.05), summary=True, widen=(0.0, 0.5),
         label="watermark"),
    Knob("admission.reserve_full_prompt", "reserve_full_prompt", _flag,
         _engines(vllm=Plain("scheduler-reserve-full-isl"), sglang=_NONE, trtllm=_NONE,
                  tgi=_NONE)),
    Knob("admission.max_queued_requests", "max_queued_requests", _cap_or_none,
         _engines(vllm=Plain("max-num-queued-reqs"), sglang=converted("max-queued-requests"),
                  trtllm=_NONE, tgi=Plain("--max-concurrent-requests")),
         modeled=True, space=(None, 2048), label="queue"),
    Knob("admission.max_queued_prompt_tokens", "max_queued_prompt_tokens", _cap_or_none,
         _engines(vllm=Plain("max-num-queued-tokens"), sglang=_NONE, trtllm=_NONE,
                  tgi=_NONE),
         modeled=True, label="queued tokens"),
    # The lanes: one switch (the threshold) and their sizes, which act only with it.
    Knob(_LANES, "lanes", _is_set, _engines(vllm=_NONE, sglang=_NONE, trtllm=_NONE, tgi=_NONE)),
    Knob("long_requests.reserved_seqs", "lane_reserved_seqs", _count,
         _engines(vllm=_NONE, sglang=_NONE, trtllm=_NONE, tgi=_NONE), switch=_LANES),
    Knob("long_requests.reserved_kv_fraction", "lane_reserved_blocks", _share_of_pool,
         _engines(vllm=_NONE, sglang=_NONE, trtllm=_NONE, tgi=_NONE), switch=_LANES),
    Knob("long_requests.max_seqs", "lane_max_seqs", _seats_or_batch,
         _engines(vllm=_NONE, sglang=_NONE, trtllm=_NONE, tgi=_NONE), switch=_LANES),
    Knob("long_requests.max_kv_fraction", "lane_max_blocks", _share_of_pool,
         _engines(vllm=_NONE, sglang=_NONE, trtllm=_NONE, tgi=_NONE), switch=_LANES),
    # Prefix caching. None: each engine's own default, on in all four:
    # - vLLM: CacheConfig.enable_prefix_caching = True (vllm/config/cache.py; engines.md 1.3);
    #   the file says `enable-prefix-caching: true` or `no-enable-prefix-caching: true`: a
    #   true value is a flag for every `--config` loader, while older loaders dropped a false
    #   one silently (vllm/utils FlexibleArgumentParser.load_config_file);
    # - SGLang: the radix cache, on unless `--disable-radix-cache` (default False,
    #   server_args.py; engines.md 2.1), so only off is written;
    # - TensorRT-LLM: KvCacheConfig.enable_block_reuse = True (LLM-API reference,
    #   nvidia.github.io/TensorRT-LLM .../llm-api/reference/KvCacheConfig.html, 1.3-1.4);
    # - TGI: the launcher sets the environment variable PREFIX_CACHING to "true" unless the
    #   model is a VLM or seq2seq, has LoRA adapters, or runs paged attention (no flag;
    #   launcher/src/main.rs resolve_attention; the server reads "1"/"true" as on).
    # Written only when the policy sets it, so a policy that leaves it unset exports as before.
    Knob("caching.enable_prefix_caching", "prefix_caching", _flag,
         _engines(vllm=converted("enable-prefix-caching", "no-enable-prefix-caching"),
                  sglang=converted("disable-radix-cache"),
                  trtllm=converted("kv_cache_config.enable_block_reuse"),
                  tgi=converted("PREFIX_CACHING")),
         engine_defaults={"vllm": True, "sglang": True, "trtllm": True, "tgi": True}),
)

BY_PATH: dict[str, Knob] = {k.path: k for k in KNOBS}
MODELED: tuple[Knob, ...] = tuple(k for k in KNOBS if k.modeled)


@cache
def _policy_defaults() -> dict[str, Any]:
    return Policy().knobs()


def knob(path: str) -> Knob:
    """The row of ``path`` (KeyError when it is not a knob)."""
    return BY_PATH[path]


def values(policy: Policy) -> dict[str, Any]:
    """Every knob's value in ``policy``, by path, in table order."""
    return {k.path: k.value(policy) for k in KNOBS}


def switched_on(k: Knob, policy: Policy) -> bool:
    """Whether ``k`` acts in ``policy``: it has no switch, or its switch is set."""
    if k.switch is None:
        return True
    switch = BY_PATH[k.switch]
    return switch.value(policy) != switch.default


# --- derived: equivalence, the default space, the summary line, simulator values -------


def equivalence_key(dotted: Mapping[str, Any]) -> tuple:
    """The values of the knobs in ``dotted`` (path -> value), in table order, with those
    the simulator cannot tell apart made equal (a value at or above its
    ``off_at_or_above`` knob's value becomes the default, i.e. off)."""
    key = []
    for k in KNOBS:
        if k.path not in dotted:
            continue
        value = dotted[k.path]
        if k.off_at_or_above is not None and value >= dotted[k.off_at_or_above]:
            value = k.default
        key.append(value)
    return tuple(key)


def default_space_knobs() -> dict[str, list[Any]]:
    """The default search space of ``servetune optimize``: knob path -> values."""
    return {k.path: list(k.space) for k in KNOBS if k.space is not None}


def beyond_edge(path: str, offered: Iterable[Any], chosen: Any) -> tuple[str, Any] | None:
    """Where to widen the space of knob ``path`` when the value ``chosen`` sits on the
    edge of the values ``offered``: ``("low" | "high", the next value out)``, half or
    twice ``chosen``, clipped to the knob's ``widen`` range. None when ``chosen`` is
    inside the offered values or off the knob's scale, when the knob offers one value
    (the user pinned it), or when ``chosen`` is already at the end of the range."""
    row = BY_PATH[path]
    if row.widen is None or chosen is None:
        return None
    lo, hi = row.widen
    scale = sorted({v for v in offered if v is not None and lo <= v <= hi})
    if len(scale) < 2 or chosen not in scale:
        return None
    if chosen == scale[0]:
        side, value = "low", max(chosen / 2, lo)
    elif chosen == scale[-1]:
        side, value = "high", min(chosen * 2, hi) if chosen > 0 else hi
    else:
        return None
    if isinstance(chosen, int) and not isinstance(chosen, bool):
        value = int(round(value))
    return None if value == chosen else (side, value)


def summary_text(dotted: Mapping[str, Any]) -> str:
    """``max_num_seqs 256, max_num_batched_tokens 2048, ...`` for the summary knobs."""
    return ", ".join(f"{k.name} {dotted[k.path]}" for k in KNOBS if k.summary)


# The step shape: shown by short_text whatever its value.
STEP_SHAPE: tuple[str, ...] = ("batching.max_num_seqs", "batching.max_num_batched_tokens")


def short_text(dotted: Mapping[str, Any], sep: str = " ", join: str = ", ") -> str:
    """``seqs 32, tokens 1024, chunk 512``: each knob of ``dotted`` by its label (its path
    where it has none), the step shape always and the others when set (not None or 0)."""
    parts = []
    for path, value in dotted.items():
        row = BY_PATH.get(path)
        if path in STEP_SHAPE or value not in (None, 0, 0.0):
            parts.append(f"{row.label if row is not None and row.label else path}{sep}{value}")
    return join.join(parts)


def value_for(path: str, policy: Policy, engine: str) -> Any:
    """Knob ``path``'s value in ``policy`` as ``engine`` runs it (:meth:`Knob.value_for`)."""
    return BY_PATH[path].value_for(policy, engine)



def sim_values(policy: Policy, kv_blocks: int, engine: str = "vllm") -> dict[str, int | bool]:
    """The simulator kernel's parameters that ``policy``'s knobs set (fields of
    ``servetune.sim._kernel.Params``) on ``engine``, for a pool of
    ``kv_blocks`` blocks: fractions of the pool become blocks, an unset cap -1, a knob
    whose switch is off its default, and a knob left to the engine the engine's own
    default."""
    out: dict[str, int | bool] = {}
    for k in KNOBS:
        value = k.value_for(policy, engine) if switched_on(k, policy) else k.default
        if value is None and k.engine_defaults is not None:
            value = k.engine_defaults[engine]
        out[k.sim_param] = k.sim_encode(value, policy, kv_blocks)
    return out


# --- derived: the exporters' name tables ------------------------------------------------


def _check_engine(engine: str) -> None:
    if engine not in ENGINE_NAMES:
        raise KeyError(f"engine {engine!r} is not in the engine table")


def export_names(engine: str, path: str) -> tuple[str, ...]:
    """The keys or flags ``engine`` takes knob ``path`` as (empty: not expressible)."""
    _check_engine(engine)
    return BY_PATH[path].exports[engine].names


def plain_names(engine: str, sections: Iterable[str] | None = None) -> dict[str, str]:
    """Knob path -> ``engine``'s key, for the knobs it takes as they are; by section in
    the order given (all, in table order, by default)."""
    _check_engine(engine)
    order = list(sections) if sections is not None else list(dict.fromkeys(
        k.section for k in KNOBS))
    out: dict[str, str] = {}
    for section in order:
        for k in KNOBS:
            cell = k.exports[engine]
            if k.section == section and isinstance(cell, Plain):
                out[k.path] = cell.name
    return out


def not_expressible(engine: str) -> list[Knob]:
    """The knobs ``engine`` has no knob for, in the order an export lists them: those no
    policy can leave at a neutral value first, then table order; knobs that act only with
    a switch are reported with their switch, not on their own."""
    _check_engine(engine)
    rows = [k for k in KNOBS
            if isinstance(k.exports[engine], NotExpressible) and k.switch is None]
    always = [k for k in rows if k.exports[engine].always]  # type: ignore[union-attr]
    return always + [k for k in rows if k not in always]


__all__ = [
    "BY_PATH",
    "KNOBS",
    "MODELED",
    "NOT_EXPRESSIBLE",
    "Converted",
    "Knob",
    "NotExpressible",
    "Plain",
    "default_space_knobs",
    "equivalence_key",
    "export_names",
    "knob",
    "not_expressible",
    "plain_names",
    "sim_values",
    "summary_text",
    "switched_on",
    "value_for",
    "values",
]
