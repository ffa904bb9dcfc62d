"""Engine models of continuous batching: vLLM V1 (default), SGLang, TensorRT-LLM, TGI.

:func:`run_engine` replays a :class:`~servetune.workloads.trace.Trace` through one engine's
scheduler under a :class:`~servetune.schemas.policy.Policy`, a KV pool of ``kv_blocks``
blocks of ``block_size`` tokens, and a :class:`~servetune.profiles.steptime.StepTimeModel`, and
returns per-request timestamps and run totals (:class:`EngineOutput`).

Semantics (``docs/engines.md``; the step loop is in :mod:`servetune.sim._kernel`):

- **vllm** (section 1.1): each step first serves the running list in admission order,
  each request getting its remaining tokens capped by ``long_prefill_token_threshold``
  and the remaining budget (``max_num_batched_tokens``); blocks are allocated for those
  tokens only; when they run out, the last admitted running request (``priority``: the
  max (priority, arrival)) is recompute-preempted: its blocks are freed, its computed
  tokens lost (generated tokens kept and re-prefilled) and it goes to the front of the
  waiting queue; a step that preempted admits nothing. Then waiting requests are
  admitted in FCFS or (priority, arrival) order with strict head-of-line blocking, up to
  ``max_num_seqs``: the whole (re-)prefill's blocks must fit the free blocks when
  ``reserve_full_prompt`` (else only this chunk's), with ``kv_watermark`` headroom
  while the running list is non-empty (an idle engine admits into the watermark). With
  ``enable_chunked_prefill`` off (a policy that leaves it unset gets the engine's own
  default: off for trtllm only), a prompt that does not fit the remaining budget waits
  and blocks the queue (a resumed request whose re-prefill exceeds the whole budget is
  chunked: vLLM's own config check rules that case out). Among exact ties (same priority
  and arrival time) the queue takes the lower request id first and the priority victim
  is the first such request in the running list.
- **sglang** (2.2-2.4): a step is a prefill batch when one can be formed (the chunked
  request first, then admissions in queue order), else a decode batch of every running
  request (decode is not budgeted). A waiting request is refused when its re-prefill +
  ``min(max_tokens - generated, 4096)`` + one block reaches (``>=``) the free KV tokens
  less ``min(max_tokens - generated, 4096) * new_token_ratio`` for every running request
  (the chunked request in its last chunk: ``min(max_tokens, 4096)``) and less what the
  pass already admitted (prompt + ``min(max_tokens, 4096)`` + one block each). The
  ratio starts at 0.7, decays linearly to 0.098 over 600 decode steps, resets when idle,
  and after a retraction jumps to ``(decoded + 20 * running) / sum(max_tokens)``. When a
  decode batch does not fit, requests are retracted fewest-generated first (longest
  prompt, then latest among ties; under priority scheduling the highest priority value
  first) back to the front of the queue. A chunked prefill allocates one chunk's KV per
  step. Under priority scheduling (lower values first, as the exporter sets
  ``schedule-low-priority-values-first``) a waiting request refused for a seat or KV
  preempts running requests whose priority value exceeds its own by more than 10
  (highest value, then latest arrival first) when their output estimates cover its
  shortfall; they rejoin the queue after the pass.
- **trtllm** (4, GUARANTEED_NO_EVICT) and **tgi** (3): a request is admitted only when
  blocks for ``prompt + max_tokens - 1`` tokens can be reserved beside the running
  requests' reservations, so nothing is ever evicted. TensorRT-LLM budgets all tokens
  of a step and, as ``trtllm-serve`` does by default, does not chunk prefills unless the
  policy sets ``enable_chunked_prefill: true`` (a prompt is prefilled whole, in one step
  with room for it); TGI budgets prefill tokens, and with prefill chunking each decode row
  takes one token of that budget first (without chunking decode rows ride along).

For every engine: ``max_num_seqs`` caps the running batch, ``kv_watermark`` blocks are
kept free at admission (vLLM: only while something runs; the others have no watermark
of their own, and servetune's applies at every admission), and
``long_prefill_token_threshold`` (the policy's, or a class's) applies only to vLLM (the
others have no such knob).
Where the trace has no ``max_tokens`` column, a request's declared maximum output is its
output length (the engine "knows" it); with ``max_tokens``, a
request generates ``min(output_tokens, max_tokens)`` tokens. Priorities come from the
trace's ``priority`` column, else from the policy's class priorities (lower first).
The policy's extensions act at admission for every engine:

- lanes (Policy docstring): lane 0 is the common lane; each class of the trace whose
  policy entry sets a seat, KV or queue limit (``ClassPolicy.has_lane``) has a lane of its
  own, in the trace's class order; with long-request lanes on, a request whose prompt
  plus expected output (``max_tokens``, else ``expected_output``, else its class's mean
  output in the trace) reaches ``threshold_tokens`` is long and goes to the last lane,
  whatever its class. A lane's settings (``classes.NAME`` or ``long_requests``):
  ``reserved_seqs`` seats and ``reserved_kv_fraction`` of the blocks that requests of
  other lanes leave free (less what the lane's running requests hold) when they are
  admitted; its running requests never exceed ``max_seqs``, nor ``max_kv_fraction`` of
  the blocks counted by their lane footprint (blocks of prompt + expected output, so the
  cap holds without preempting); a class's ``max_queued_requests`` sheds its arrivals
  (status 1) while its lane's waiting + running requests reach it. Fractions become
  blocks rounded down. The lanes are separate queues merged by queue order; each is
  head-of-line blocking only within itself, so a request that does not fit its lane
  blocks none of another lane. A class's ``long_prefill_token_threshold`` is its
  requests' chunk cap (vLLM) instead of the policy's. A policy without lanes has one
  queue and none of these checks.
- queue caps: an arrival is shed (status 1, as HTTP 503) when waiting + running
  requests reach ``max_queued_requests``, or its class's lane cap (above), or when the
  prompt tokens of accepted requests not yet past their first token would exceed
  ``max_queued_prompt_tokens``.
- a request that could never run (prompt + output exceed the pool; its admission, i.e. its
  prompt (vLLM without ``reserve_full_prompt``: its first chunk) or TensorRT-LLM/TGI's
  reservation, exceeds the pool less the other lanes' reserves and (except vLLM, which
  waives it on an idle engine) the watermark; its footprint exceeds its lane's KV cap; or the
  step budget with chunking off) is rejected at arrival (status 2) with a reason instead
  of blocking the queue forever; the kernel decides this before the run with its own
  admission checks on the empty engine. A preempted request whose re-prefill has outgrown
  the pool less that headroom is rejected when even an empty engine could not re-admit it.

Prefix caching (``caching.enable_prefix_caching``, or ``prefix_caching=``): as vLLM's KV cache
manager, for every engine (SGLang's radix cache is modelled at block granularity, and
TensorRT-LLM's and TGI's reservations are not reduced by hits). A full block is cached under a
key naming its whole prefix: from the trace's prefix ids (``Trace.prefix_block_ids``, ids of
``prefix_block_tokens``-token blocks, chain hashes) where they cover the block, else a key
only the request itself can hit again (after a preemption). Prompt blocks are registered as
they are computed (a block another running request registered first is shared, counted
once); a request's other full blocks when it frees them. Freed blocks stay cached and are
evicted least recently freed first (a request's blocks last to first) when blocks are
needed. At admission the longest cached run of leading blocks, at most ``(prompt +
generated - 1) // block_size`` blocks, is computed for free; the KV check counts the
cached blocks no running request holds (taking them uses free blocks). A request admitted
with KV that arrives with it (``Requests.precomputed``, the decode side of disaggregated
serving, :mod:`servetune.sim.cluster`) holds blocks for it and runs once ``ready_delay``
has passed.

Time: arrivals enter the waiting queue at step boundaries; an idle engine jumps to the
next arrival; a step's duration is ``step_seconds(T, S, D, C, W)`` with T tokens, S rows
sampled, D decoding requests, C = sum over decoding requests of their context after this
step's token, W = sum over prefill chunks of ``chunk * (prefix + chunk / 2)``.
A request's first token comes at the end of the step that completes its prefill; it
finishes at the end of the step that samples its last token.

Step log (``step_log=True``): one dict per step, in order, with ``step``
(0-based), ``start_s``, ``duration_s``, ``scheduled`` (``[request_id, new_tokens]`` in
grant order; request id = trace row), ``preempted`` (in preemption order; SGLang
retractions too), ``finished``, ``admitted`` (first admissions and re-admissions after
preemption), ``shed`` (requests turned away at arrival: shed or rejected, see
``status``/``reason``; they appear in the first record written after their arrival),
``kv_blocks_used`` (during the step: after its allocations, before its finishes free
blocks), ``kv_blocks_total``, ``waiting`` and ``running`` (after scheduling). In fast mode
a jumped stretch of N identical decode steps is one record with ``repeat: N``: its
``duration_s`` spans the N steps and ``kv_blocks_used`` is the last step's, while
``step_durations_s`` and ``step_kv_blocks_used`` (N values each) let
:func:`expand_repeats` rebuild the reference mode's N records exactly. If the last
arrivals are all turned away after the final step, one zero-length record carries them.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np

from servetune import knobs
from servetune.engines import ENGINE_NAMES, kernel_id
from servetune.engines import engine as engine_row
from servetune.errors import ServetuneError
from servetune.profiles.steptime import StepTimeModel
from servetune.schemas.policy import Policy
from servetune.sim import _kernel as K
from servetune.sim.timeline import StepChunk
from servetune.workloads.trace import Trace

# What a simulation returns, as a version: bump it with every change to the engine models
# that changes a result, so that measurements cached on disk (capacity, spare room) keyed
# on it are measured again. 2: vLLM's full-prompt check and idle-engine watermark as the
# engine does them, TGI decode rows take budget.
# 3: trtllm does not chunk prefills unless the policy asks (trtllm-serve's default).
# 4: decode attention at the measured share of HBM bandwidth; a step may add a host cost
# per step and per sequence (servetune.engines: 0 until measured; a profile may pin it).
# 5: SGLang as PrefillAdder does it: a new request's own output counted in full and refused
# on >= (plus a page), chunked prefills allocated per chunk, priority preemption and
# priority retraction under priority scheduling.
# 6: prefix caching, on by default as in every engine (a preempted request's re-prefill
# finds its own blocks while they are cached; traces with prefix ids share blocks).
# 7: per-class lanes: a policy's classes' seats, KV shares, queue caps and chunk caps act
# (before, only their priorities did; policies without them give what they gave).
ENGINE_MODEL_VERSION = 7

# Why a request did not complete: the codes and texts live in the kernel, which records them.
REASONS = K.REASONS
REASON_SHED_REQUESTS = K.REASON_SHED_REQUESTS
REASON_SHED_TOKENS = K.REASON_SHED_TOKENS
REASON_KV_POOL = K.REASON_KV_POOL
REASON_LANE = K.REASON_LANE
REASON_BUDGET = K.REASON_BUDGET
REASON_RESERVATION = K.REASON_RESERVATION
REASON_READMIT = K.REASON_READMIT  # by the kernel, when even an empty engine cannot re-admit

# SGLang environment defaults (docs/engines.md 2.2).
SGLANG_CLIP_MAX_NEW_TOKENS = 4096
SGLANG_INIT_NEW_TOKEN_RATIO = 0.7
SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS = 600
SGLANG_RETRACT_DECODE_STEPS = 20
# SGLang's priority flags as servetune's exporter writes them (docs/engines.md 2.4): lower
# values first (servetune's convention, as vLLM's); the preemption threshold is
# SGLang's row in servetune.engines (priority_preemption_threshold).
SGLANG_LOW_PRIORITY_VALUES_FIRST = True

SERIES_BINS = 2048
# The step-log buffer (records, and events beside the room of two full steps): drained
# to the run's consumers whenever it fills.
LOG_RECORDS = 16384
LOG_EVENTS = 262144
_CHUNK_STEPS_FAST = 500_000
_CHUNK_STEPS_REFERENCE = 20_000


@dataclass(eq=False)
class EngineOutput:
    """Per-request arrays (indexed like the trace) and run totals of one engine run."""

    admitted_s: np.ndarray  # float64, first admission (step start); nan if never
    first_token_s: np.ndarray  # float64, end of the step that sampled the first token
    finish_s: np.ndarray  # float64, end of the step that sampled the last token
    preemptions: np.ndarray  # int32, recompute preemptions / retractions
    status: np.ndarray  # int8: 0 completed, 1 shed, 2 rejected
    reason: np.ndarray  # int8 code into REASONS (0 for completed)
    generated: np.ndarray  # int64, output tokens sampled
    steps: int
    kv_blocks_total: int
    kv_util_mean: float  # time-averaged blocks in use / total, over [0, sim_end_s]
    kv_util_peak: float
    sim_end_s: float
    series: dict[str, np.ndarray]  # t_s (bin start), kv_util, waiting, running
    step_log: list[dict[str, Any]] | None = None
    engine: str = "vllm"
    jumps: int = 0  # jumped stretches (fast mode)
    kv_blocks_in_use_end: int = 0  # 0 when every block was given back
    prefix_caching: bool = False
    hit_tokens: np.ndarray | None = None  # int64, prompt tokens served from the prefix
    # cache at first admission (None when caching is off)
    cache_evictions: int = 0
    block_size: int = 16
    replica: np.ndarray | None = None  # int64, a cluster's routing (servetune.sim.cluster)
    decode_replica: np.ndarray | None = None  # int64, disaggregated: -1 where not forwarded


_pure_module: ModuleType | None = None


def _kernel_module(reference: bool) -> ModuleType:
    """The compiled kernel, or the same source loaded as plain Python (reference)."""
    global _pure_module
    if not reference:
        return K
    if _pure_module is None:
        name = "servetune.sim._kernel_pure"
        spec = importlib.util.spec_from_file_location(name, K.__file__)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _pure_module = module
    return _pure_module


def unit_blocks_for(prefix_block_tokens: int, block_size: int) -> int:
    """Blocks per prefix-cache unit: a divisor of the blocks in one prefix id (all of them
    when there are at most ``UNIT_BLOCKS_MAX``), so that a unit never straddles two ids; 1
    when an id's tokens are not whole blocks."""
    width = max(int(prefix_block_tokens), 1)
    if width % block_size:
        return 1
    return math.gcd(width // block_size, K.UNIT_BLOCKS_MAX)


def _blocks(tokens: np.ndarray, block_size: int) -> np.ndarray:
    return (tokens + block_size - 1) // block_size


def _expected_output(
    trace: Trace, declared: np.ndarray | None, expected_output: np.ndarray | None
) -> np.ndarray:
    """Expected output per request, for the lanes' footprints and the long-request test
    (Policy docstring)."""
    n = len(trace)
    if trace.max_tokens is not None:
        return declared
    class_ids = trace.class_ids().astype(np.int64)
    if expected_output is not None:
        values = np.asarray(expected_output, dtype=np.float64)
        if values.shape == (n,):
            return np.ceil(values).astype(np.int64)
        if values.shape == (len(trace.class_names),):
            return np.ceil(values[class_ids]).astype(np.int64)
        raise ServetuneError(
            f"expected_output has shape {values.shape}; give one value per request ({n}) "
            f"or per class ({len(trace.class_names)})"
        )
    n_classes = max(int(class_ids.max()) + 1 if n else 1, len(trace.class_names))
    sums = np.bincount(class_ids, weights=trace.output_tokens, minlength=n_classes)
    counts = np.bincount(class_ids, minlength=n_classes)
    means = np.ceil(sums / np.maximum(counts, 1)).astype(np.int64)
    return means[class_ids]


def lane_footprint(trace: Trace, expected_output: np.ndarray | None = None) -> np.ndarray:
    """Per request, prompt + expected output: what the long-request test compares with a
    lane's ``threshold_tokens`` (Policy docstring)."""
    prompt = np.asarray(trace.prompt_tokens, dtype=np.int64)
    declared = (np.maximum(np.asarray(trace.max_tokens, dtype=np.int64), 1)
                if trace.max_tokens is not None else None)
    return prompt + _expected_output(trace, declared, expected_output)


def _validate(
    trace: Trace, kv_blocks: int, block_size: int, engine: str
) -> None:
    if engine not in ENGINE_NAMES:
        raise ServetuneError(
            f"engine {engine!r} is unknown; choose one of {', '.join(ENGINE_NAMES)}")
    if int(kv_blocks) < 1:
        raise ServetuneError(
            f"KV pool has {kv_blocks} blocks; the profile must leave at least one block "
            "(raise gpu_memory_utilization or set kv_blocks_override)"
        )
    if int(block_size) < 1:
        raise ServetuneError(f"block_size must be >= 1 (got {block_size})")
    if len(trace) == 0:
        raise ServetuneError("trace has no requests")


def kernel_params(
    policy: Policy,
    *,
    engine: str,
    kv_blocks: int,
    block_size: int,
    step_time: StepTimeModel,
    reference: bool = False,
    step_log: bool = False,
    prefix_caching: bool | None = None,
    prefix_block_tokens: int = 512,
    class_names: Sequence[str] = (),
) -> K.Params:
    """The kernel's run constants: ``engine``, ``policy``'s knobs in tokens and blocks of a
    pool of ``kv_blocks`` blocks of ``block_size`` tokens, its lanes for a trace of
    ``class_names`` (:func:`lane_limits`), the step-time coefficients, SGLang's constants,
    and the mode (``reference``: no jumps; ``step_log``). ``prefix_caching`` overrides the
    policy's ``caching.enable_prefix_caching``; ``prefix_block_tokens`` is the trace's
    tokens per prefix id."""
    total = int(kv_blocks)
    ratio_init = min(SGLANG_INIT_NEW_TOKEN_RATIO, 1.0)
    ratio_floor = ratio_init * SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
    coef, pieces = step_time.as_arrays(engine)
    values = knobs.sim_values(policy, total, engine)
    caching = bool(values.pop("prefix_caching"))
    if prefix_caching is not None:
        caching = bool(prefix_caching)
    return K.Params(
        engine=kernel_id(engine),
        # the policy's knobs, as the knob table encodes them
        **values,
        lane_limits=lane_limits(policy, class_names, values, total),
        prefix_caching=caching,
        # the pool and the step time
        total_blocks=total,
        block_size=int(block_size),
        prefix_block_tokens=max(int(prefix_block_tokens), 1),
        unit_blocks=unit_blocks_for(int(prefix_block_tokens), int(block_size)),
        step_coef=coef,
        step_pieces=pieces,
        # SGLang's environment constants
        sglang_clip=SGLANG_CLIP_MAX_NEW_TOKENS,
        sglang_retract_steps=SGLANG_RETRACT_DECODE_STEPS,
        sglang_preempt_threshold=engine_row("sglang").priority_preemption_threshold,
        ratio_init=ratio_init,
        ratio_floor=ratio_floor,
        ratio_decay=(ratio_init - ratio_floor) / SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS,
        # the mode
        jump=not reference,
        log=bool(step_log),
    )


def class_lanes(policy: Policy, class_names: Sequence[str]) -> tuple[str, ...]:
    """The classes among ``class_names`` (a trace's, in its order) that have a lane of their
    own (``ClassPolicy.has_lane``): the kernel's lanes 1, 2, ... (lane 0 is the common lane;
    the long-request lane, when on, comes after them)."""
    return tuple(name for name in class_names
                 if name in policy.classes and policy.classes[name].has_lane)


# A class's seats and KV shares become blocks and seats exactly as the long lane's do.
_kv_share = knobs.knob("long_requests.max_kv_fraction").sim_encode
_seat_cap = knobs.knob("long_requests.max_seqs").sim_encode


def lane_limits(policy: Policy, class_names: Sequence[str], values: dict[str, int | bool],
                kv_blocks: int) -> np.ndarray:
    """The kernel's lane table (``Params.lane_limits``, columns ``K.LIM_*``): the common
    lane (no limits), one lane per class of :func:`class_lanes`, then the long-request lane
    when ``values`` (the knob table's :func:`~servetune.knobs.sim_values`) turn it on."""
    total = int(kv_blocks)
    rows = [[0, 0, policy.batching.max_num_seqs, total, -1]]
    for name in class_lanes(policy, class_names):
        c = policy.classes[name]
        rows.append([c.reserved_seqs, _kv_share(c.reserved_kv_fraction, policy, total),
                     _seat_cap(c.max_seqs, policy, total),
                     _kv_share(c.max_kv_fraction, policy, total),
                     -1 if c.max_queued_requests is None else c.max_queued_requests])
    if values["lanes"]:
        rows.append([values["lane_reserved_seqs"], values["lane_reserved_blocks"],
                     values["lane_max_seqs"], values["lane_max_blocks"], -1])
    table = np.array(rows, dtype=np.int64)
    assert table.shape[1] == K.LANE_LIMITS
    return table


def kernel_requests(
    trace: Trace,
    policy: Policy,
    *,
    engine: str,
    block_size: int,
    expected_output: np.ndarray | None = None,
    prefix: tuple[np.ndarray, np.ndarray] | None = None,
) -> K.Requests:
    """The kernel's columns of ``trace`` under ``policy`` on ``engine``: tokens generated
    and declared maximum output, priorities, lanes (:func:`class_lanes`, then long
    requests, whatever their class) and lane footprints, chunk caps, and TensorRT-LLM/TGI
    reservations. ``reject`` is left 0 for the kernel's
    :func:`~servetune.sim._kernel.reject_at_arrival`. ``prefix``: the trace's
    :func:`prefix_columns`, when the caller has them already."""
    n = len(trace)
    bs = int(block_size)
    lr = policy.long_requests
    prompt = np.ascontiguousarray(trace.prompt_tokens, dtype=np.int64)
    if (prompt < 1).any() or (np.asarray(trace.output_tokens) < 1).any():
        raise ServetuneError("trace has a request with fewer than 1 prompt or output token")
    if trace.max_tokens is not None:
        declared = np.maximum(np.asarray(trace.max_tokens, dtype=np.int64), 1)
        out = np.minimum(np.asarray(trace.output_tokens, dtype=np.int64), declared)
    else:
        out = np.ascontiguousarray(trace.output_tokens, dtype=np.int64)
        declared = out.copy()
    if trace.priority is not None:
        prio = np.asarray(trace.priority, dtype=np.int64)
    else:
        class_prio = np.array(
            [policy.class_priority(name) for name in trace.class_names], dtype=np.int64
        )
        prio = class_prio[trace.class_ids().astype(np.int64)]
    if engine == "sglang" and not SGLANG_LOW_PRIORITY_VALUES_FIRST:
        prio = -prio  # the kernel serves lower values first; SGLang's default is higher
    arrival = np.ascontiguousarray(trace.arrival_s, dtype=np.float64)
    if not (np.all(np.isfinite(arrival)) and np.all(np.diff(arrival) >= 0)):
        raise ServetuneError("trace arrivals must be finite and sorted (use trace.from_arrays)")
    lane, chunk_cap = _class_columns(trace, policy)
    lane_blocks = np.zeros(n, dtype=np.int64)
    if lr.enabled or lane.any():
        footprint = lane_footprint(trace, expected_output)
        if lr.enabled:  # the last lane, after the classes'
            lane[footprint >= int(lr.threshold_tokens)] = len(class_lanes(
                policy, trace.class_names)) + 1
        lane_blocks = np.where(lane > 0, _blocks(footprint, bs), 0)
    reserved = np.zeros(n, dtype=np.int64)
    if kernel_id(engine) in (K.E_TRTLLM, K.E_TGI):
        # GUARANTEED_NO_EVICT / TGI: prompt + max output - 1 tokens reserved at admission
        reserved = _blocks(prompt + declared - 1, bs)
    prefix_start, prefix_ids = prefix if prefix is not None else prefix_columns(trace)
    return K.Requests(
        arrival=arrival,
        prompt=prompt,
        output=out,
        max_tokens=declared,
        priority=prio,
        lane=lane,
        lane_blocks=lane_blocks,
        chunk_cap=chunk_cap,
        reserved_blocks=reserved,
        reject=np.zeros(n, dtype=np.int8),
        prefix_start=prefix_start,
        prefix_ids=prefix_ids,
        precomputed=np.zeros(n, dtype=np.int64),
        ready_delay=np.zeros(n, dtype=np.float64),
    )


def _class_columns(trace: Trace, policy: Policy) -> tuple[np.ndarray, np.ndarray]:
    """Per request, from its class: its lane among :func:`class_lanes` (0: the common
    lane), and its chunk cap (its class's ``long_prefill_token_threshold``, else the
    policy's; 0: none)."""
    class_ids = trace.class_ids().astype(np.int64)
    n_classes = max(int(class_ids.max()) + 1 if len(trace) else 1, len(trace.class_names))
    lane = np.zeros(n_classes, dtype=np.int32)
    for k, name in enumerate(class_lanes(policy, trace.class_names)):
        lane[trace.class_names.index(name)] = k + 1
    cap = np.full(n_classes, int(policy.batching.long_prefill_token_threshold), np.int64)
    for i, name in enumerate(trace.class_names):
        entry = policy.classes.get(name)
        if entry is not None and entry.long_prefill_token_threshold is not None:
            cap[i] = entry.long_prefill_token_threshold
    return lane[class_ids], cap[class_ids]


def prefix_columns(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """The trace's prefix ids as the kernel reads them: CSR offsets (n + 1) and the ids
    renumbered densely from 0 in order of first appearance (so that ``id * B + offset``
    keys cannot overflow, whatever the trace's hash values)."""
    n = len(trace)
    if trace.prefix_offsets is None or trace.prefix_block_ids is None:
        return np.zeros(n + 1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    ids = np.asarray(trace.prefix_block_ids, dtype=np.int64)
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first), dtype=np.int64)
    dense = rank[inverse] if len(ids) else np.zeros(1, dtype=np.int64)
    return np.ascontiguousarray(trace.prefix_offsets, dtype=np.int64), dense


def _scalar_holder(dtype: np.dtype, reference: bool, **values: float) -> Any:
    """A 1-element holder of ``dtype``'s named scalars (zero unless given), read and written
    as ``holder[0].name``: a record array for the compiled kernel; for the reference mode,
    which runs as plain Python, a namespace of numpy scalars (faster to reach than a
    record's fields)."""
    if reference:
        fields = {name: dtype.fields[name][0].type(values.get(name, 0)) for name in dtype.names}
        return [SimpleNamespace(**fields)]
    holder = np.zeros(1, dtype=dtype).view(np.recarray)
    for name, value in values.items():
        holder[name][0] = value
    return holder


def _initial_state(params: K.Params, requests: K.Requests, reference: bool,
                   *, known: int | None = None, horizon_s: float | None = None,
                   lanes: np.ndarray | None = None) -> K.State:
    """An empty engine at time 0 with every request still to arrive: ``known`` of the
    rows are known now (default: all; a router appends the rest), ``horizon_s`` sizes
    the coarse series (default: the last arrival), ``lanes`` (default: the requests')
    are the lanes of the rows it may get, which size the lanes' queues."""
    n = len(requests.arrival)
    n_lanes = len(params.lane_limits)
    per_lane = np.bincount(requests.lane if lanes is None else lanes, minlength=n_lanes)
    lane_state = np.zeros((n_lanes, K.LANE_STATE), dtype=np.int64)
    lane_state[1:, K.LANE_HEAP_START] = np.cumsum(per_lane)[:-1]
    width = min(params.max_seqs, n) + 1
    last = float(requests.arrival[-1]) if horizon_s is None else float(horizon_s)
    bin_width = max(last, 1.0) / (SERIES_BINS // 2)
    # units and LRU nodes: each holds at least one cached block, so the pool bounds both
    cache_rows = int(params.total_blocks) if params.prefix_caching else 1
    unit = int(params.unit_blocks) if params.prefix_caching else 1
    table = 1 << max(int(2 * cache_rows - 1).bit_length(), 1)
    return K.State(
        computed=np.zeros(n, dtype=np.int64),
        generated=np.zeros(n, dtype=np.int64),
        held=np.zeros(n, dtype=np.int64),
        admitted_s=np.full(n, np.nan),
        first_token_s=np.full(n, np.nan),
        finish_s=np.full(n, np.nan),
        preemptions=np.zeros(n, dtype=np.int32),
        status=np.full(n, K.PENDING, dtype=np.int8),
        reason=np.zeros(n, dtype=np.int8),
        heap_key=np.zeros(max(int(per_lane.sum()), 1), dtype=np.int64),
        heap_id=np.zeros(max(int(per_lane.sum()), 1), dtype=np.int64),
        lanes=lane_state,
        running=np.zeros(width, dtype=np.int64),
        batch_req=np.zeros(width, dtype=np.int64),
        batch_tokens=np.zeros(width, dtype=np.int64),
        jump_hist=np.zeros(K.WINDOW_MAX + 2, dtype=np.int64),
        series=np.zeros((4, SERIES_BINS), dtype=np.float64),
        victims=np.zeros(max(n, 1), dtype=np.int64),
        ready_s=np.zeros(n, dtype=np.float64),
        done_order=np.zeros(n, dtype=np.int64),
        prefix_blocks=np.zeros(n, dtype=np.int64),
        hit_tokens=np.zeros(n, dtype=np.int64),
        table_key=np.full(table, K.EMPTY_KEY, dtype=np.int64),
        table_slot=np.zeros(table, dtype=np.int64),
        # (np.zeros leaves untouched pages unmapped: a run touches the units it uses)
        units=np.zeros((cache_rows, K.UNIT_COLUMNS), dtype=np.int64),
        unit_ref=np.zeros((cache_rows, unit), dtype=np.int32),
        unit_node=np.zeros((cache_rows, unit), dtype=np.int32),
        unit_free=np.arange(cache_rows - 1, -1, -1, dtype=np.int64),
        nodes=np.zeros((cache_rows, K.NODE_COLUMNS), dtype=np.int64),
        node_free=np.arange(cache_rows - 1, -1, -1, dtype=np.int64),
        scalars=_scalar_holder(K.SCALARS, reference, chunked_req=-1, token_ratio=params.ratio_init,
                               bin_width=bin_width, known=n if known is None else known,
                               until=np.inf, lru_head=-1, lru_tail=-1,
                               free_units=cache_rows, free_nodes=cache_rows),
    )


_RECORD_COLUMNS = ("step", "start_s", "duration_s", "kv_used", "waiting", "running", "repeat",
                   "events_end", "repeats_end")
_EVENT_COLUMNS = ("event_kind", "event_req", "event_value")
_REPEAT_COLUMNS = ("repeat_duration_s", "repeat_kv_used")
_FLOAT_COLUMNS = ("start_s", "duration_s", "repeat_duration_s")


def _new_step_log(step_log: bool, width: int, reference: bool) -> K.StepLog:
    """Empty step-log buffers (one row each when no log is kept). The driver drains them
    whenever they fill, so their size bounds the log's memory, not the run's length."""
    rows = {"records": LOG_RECORDS, "events": LOG_EVENTS + 8 * width,
            "repeats": K.WINDOW_MAX + LOG_RECORDS}
    if not step_log:
        rows = dict.fromkeys(rows, 1)
    columns: dict[str, np.ndarray] = {}
    for group, names in (("records", _RECORD_COLUMNS), ("events", _EVENT_COLUMNS),
                         ("repeats", _REPEAT_COLUMNS)):
        for name in names:
            dtype = np.float64 if name in _FLOAT_COLUMNS else np.int64
            columns[name] = np.zeros(rows[group], dtype=dtype)
    return K.StepLog(**columns, counts=_scalar_holder(K.LOG_COUNTS, reference))


def _grown(log: K.StepLog, names: tuple[str, ...], extra: int) -> K.StepLog:
    """``log`` with ``extra`` more (zero) rows in the ``names`` columns."""
    return log._replace(**{
        name: np.concatenate([getattr(log, name), np.zeros(extra, getattr(log, name).dtype)])
        for name in names
    })


def _stretch_cut_to_one(log: K.StepLog, first: int, stop: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Records ``first..stop-1``: where their per-step values start, their durations and
    KV blocks in use. A jumped stretch that an arrival cut to one step (``repeat`` 1 with
    one per-step value) is an ordinary record of that step."""
    rep_end = log.repeats_end[first:stop]
    before = log.repeats_end[first - 1:first] if first > 0 else np.zeros(1, dtype=np.int64)
    rep_start = np.concatenate([before, rep_end[:-1]])
    one = (log.repeat[first:stop] == 1) & (rep_end == rep_start + 1)
    duration = log.duration_s[first:stop].copy()
    duration[one] = log.repeat_duration_s[rep_start[one]]
    kv_used = log.kv_used[first:stop].copy()
    kv_used[one] = log.repeat_kv_used[rep_start[one]]
    return rep_start, duration, kv_used


def _chunk(log: K.StepLog, total: int) -> StepChunk:
    """The records in the step-log buffer (their events and per-step values), as a chunk
    whose columns are views into the buffer."""
    n = int(log.counts[0].records)
    _, duration, _ = _stretch_cut_to_one(log, 0, n)
    start = log.start_s[:n]
    n_events = int(log.events_end[n - 1]) if n else 0
    return StepChunk(
        start_s=start, end_s=start + duration, repeat=log.repeat[:n],
        events_end=log.events_end[:n], event_kind=log.event_kind[:n_events],
        event_req=log.event_req[:n_events], event_value=log.event_value[:n_events],
        records=lambda i, j: _step_records(log, total, i, j),
    )


def _drain(log: K.StepLog, total: int, sinks: list[Callable[[StepChunk], Any]]) -> int:
    """Hand the buffer's records to ``sinks`` and empty it, keeping the events logged for the
    record not written yet; returns the records drained."""
    counts = log.counts[0]
    n = int(counts.records)
    if n == 0:
        return 0
    chunk = _chunk(log, total)
    for sink in sinks:
        sink(chunk)
    done = int(log.events_end[n - 1])
    pending = int(counts.events) - done
    for name in _EVENT_COLUMNS:
        col = getattr(log, name)
        col[:pending] = col[done:done + pending].copy()
    counts.events = pending
    counts.records = 0
    counts.repeats = 0
    return n


def run_engine(
    trace: Trace,
    policy: Policy,
    kv_blocks: int,
    block_size: int,
    step_time: StepTimeModel,
    *,
    engine: str = "vllm",
    reference: bool = False,
    step_log: bool = False,
    progress: Callable[[int, int], None] | None = None,
    expected_output: np.ndarray | None = None,
    on_step_log: Callable[[StepChunk], Any] | None = None,
    prefix_caching: bool | None = None,
) -> EngineOutput:
    """Simulate ``trace`` on one engine; see the module docstring for the semantics.

    ``reference=True`` runs every step in plain Python (no jumps); otherwise the loop is
    compiled with numba and stretches of identical decode steps are jumped. Both give
    identical records. ``step_log=True`` also returns the step log (jumped
    stretches as one record with ``repeat``; :func:`expand_repeats` expands them).
    ``on_step_log(chunk)`` is handed the step log as it is written, a chunk of records at
    a time (:class:`~servetune.sim.timeline.StepChunk`), without the run keeping it.
    ``progress(done, total)`` is called between chunks of steps with the number of
    requests resolved so far. ``expected_output`` (per request or per class) overrides
    the trace's class mean output in the lanes' footprints and the long-request test
    when the trace has no ``max_tokens``. ``prefix_caching`` overrides the policy's
    ``caching.enable_prefix_caching``.
    """
    _validate(trace, kv_blocks, block_size, engine)
    n = len(trace)
    total = int(kv_blocks)
    requests = kernel_requests(trace, policy, engine=engine, block_size=block_size,
                               expected_output=expected_output)
    logging = step_log or on_step_log is not None
    params = kernel_params(policy, engine=engine, kv_blocks=kv_blocks, block_size=block_size,
                           step_time=step_time, reference=reference, step_log=logging,
                           prefix_caching=prefix_caching,
                           prefix_block_tokens=trace.prefix_block_tokens,
                           class_names=trace.class_names)
    state = _initial_state(params, requests, reference)
    scalars = state.scalars[0]
    width = len(state.running)
    log = _new_step_log(logging, width, reference)
    counts = log.counts[0]
    records: list[dict[str, Any]] = []
    sinks: list[Callable[[StepChunk], Any]] = []
    if step_log:
        sinks.append(lambda chunk: records.extend(chunk.records(0, len(chunk.start_s))))
    if on_step_log is not None:
        sinks.append(on_step_log)
    km = _kernel_module(reference)
    # Requests that could never run are rejected at arrival (no head-of-line deadlock),
    # by the kernel's own admission checks on the still empty engine.
    km.reject_at_arrival(params, requests, state)

    chunk = _CHUNK_STEPS_REFERENCE if reference else _CHUNK_STEPS_FAST
    while True:
        rc = km.run_kernel(params, requests, state, log, chunk)
        if rc == K.RC_DONE:
            break
        if rc == K.RC_LOG_FULL:
            _drain(log, total, sinks)
            # a step may log more events than the buffer holds (every waiting request
            # turned away): keep room for two such steps
            room = len(log.event_kind)
            if counts.events + counts.events_need > room // 2:
                log = _grown(log, _EVENT_COLUMNS,
                             max(room, 2 * int(counts.events + counts.events_need) - room))
                counts = log.counts[0]
        elif rc == K.RC_STUCK:
            raise RuntimeError(
                f"engine {engine} made no progress at t={scalars.now:.6f} s with "
                f"{int(state.lanes[:, K.LANE_WAITING].sum())} waiting and "
                f"{scalars.n_running} running (a bug)"
            )
        if progress is not None:
            progress(int(scalars.resolved), n)
    if progress is not None:
        progress(int(scalars.resolved), n)
    if logging:
        _drain(log, total, sinks)

    status = state.status
    if (status < 0).any():
        raise RuntimeError(f"{int((status < 0).sum())} requests unresolved at the end (a bug)")
    sim_end = float(scalars.now)
    kv_peak = float(scalars.peak) / total
    kv_mean = float(scalars.kv_integral) / (sim_end * total) if sim_end > 0 else 0.0
    kv_mean = min(kv_mean, kv_peak)  # rounding of the time integral can exceed the peak
    series = _series(state.series, float(scalars.bin_width), sim_end, total)
    return EngineOutput(
        admitted_s=state.admitted_s,
        first_token_s=state.first_token_s,
        finish_s=state.finish_s,
        preemptions=state.preemptions,
        status=status,
        reason=state.reason,
        generated=state.generated,
        steps=int(scalars.steps),
        kv_blocks_total=total,
        kv_util_mean=kv_mean,
        kv_util_peak=kv_peak,
        sim_end_s=sim_end,
        series=series,
        step_log=records if step_log else None,
        engine=engine,
        jumps=int(scalars.jumps),
        kv_blocks_in_use_end=int(scalars.used),
        prefix_caching=bool(params.prefix_caching),
        hit_tokens=state.hit_tokens if params.prefix_caching else None,
        cache_evictions=int(scalars.evictions),
        block_size=int(block_size),
    )


def _series(ser: np.ndarray, bin_w: float, sim_end: float, total: int) -> dict[str, np.ndarray]:
    """Time-binned means (at most SERIES_BINS rows): KV utilization, waiting, running."""
    nb = max(1, min(ser.shape[1], int(np.ceil(sim_end / bin_w)) if sim_end > 0 else 1))
    starts = np.arange(nb, dtype=np.float64) * bin_w
    widths = np.minimum(starts + bin_w, max(sim_end, bin_w)) - starts
    widths = np.where(widths > 0, widths, bin_w)
    return {
        "t_s": starts,
        "kv_util": ser[0, :nb] / widths / total,
        "waiting": ser[1, :nb] / widths,
        "running": ser[2, :nb] / widths,
        "kv_cached": ser[3, :nb] / widths / total,
    }


def _step_records(log: K.StepLog, total: int, first: int, stop: int) -> list[dict[str, Any]]:
    """Issue-7 records ``first..stop-1`` of the kernel's step-log buffer, as dicts."""
    if stop <= first:
        return []
    # events and per-step values from where record ``first``'s begin (offsets ev0, rep0)
    ev0 = ev_start = int(log.events_end[first - 1]) if first > 0 else 0
    ev1 = int(log.events_end[stop - 1])
    rep_starts, durations, kv_used = _stretch_cut_to_one(log, first, stop)
    rep0 = int(rep_starts[0])
    rep1 = int(log.repeats_end[stop - 1])
    columns = {name: getattr(log, name)[first:stop] for name in _RECORD_COLUMNS}
    columns.update(duration_s=durations, kv_used=kv_used)
    records = zip(*(columns[name].tolist() for name in _RECORD_COLUMNS), strict=True)
    events = list(zip(log.event_kind[ev0:ev1].tolist(), log.event_req[ev0:ev1].tolist(),
                      log.event_value[ev0:ev1].tolist(), strict=True))
    rep_durations = log.repeat_duration_s[rep0:rep1].tolist()
    rep_kv_used = log.repeat_kv_used[rep0:rep1].tolist()
    sched, preempt, finish, admit = K.EV_SCHED, K.EV_PREEMPT, K.EV_FINISH, K.EV_ADMIT
    out: list[dict[str, Any]] = []
    rep_start = rep0
    for step, start, dur, kv, waiting, running, repeat, ev_end, rep_end in records:
        scheduled: list[list[int]] = []
        preempted: list[int] = []
        finished: list[int] = []
        admitted: list[int] = []
        cached: list[list[int]] = []
        shed: list[int] = []
        for kind, req, value in events[ev_start - ev0:ev_end - ev0]:
            if kind == sched:
                scheduled.append([req, value])
            elif kind == preempt:
                preempted.append(req)
            elif kind == finish:
                finished.append(req)
            elif kind == admit:
                admitted.append(req)
                if value > 0:
                    cached.append([req, value])
            else:
                shed.append(req)
        rec: dict[str, Any] = {
            "step": step,
            "start_s": start,
            "duration_s": dur,
            "scheduled": scheduled,
            "preempted": preempted,
            "finished": finished,
            "admitted": admitted,
            "shed": shed,
            "kv_blocks_used": kv,
            "kv_blocks_total": total,
            "waiting": waiting,
            "running": running,
        }
        if cached:
            rec["cached_tokens"] = cached  # admitted with this many tokens in KV already
        if repeat > 1:
            rec["repeat"] = repeat
            rec["step_durations_s"] = rep_durations[rep_start - rep0:rep_end - rep0]
            rec["step_kv_blocks_used"] = rep_kv_used[rep_start - rep0:rep_end - rep0]
        out.append(rec)
        ev_start = ev_end
        rep_start = rep_end
    return out


def expand_repeats(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Expand jumped records (``repeat: N``) into the N step records the reference
    mode writes, exactly: each step's start is the previous start plus its duration
    (the same float addition the engine's clock does)."""
    out: list[dict[str, Any]] = []
    for rec in records:
        repeat = int(rec.get("repeat", 1))
        if "repeat" not in rec:
            out.append(rec)
            continue
        durations = rec["step_durations_s"]
        kv_used = rec["step_kv_blocks_used"]
        if len(durations) != repeat or len(kv_used) != repeat:
            raise ValueError(f"step record {rec.get('step')}: repeat {repeat} does not match "
                             "its per-step lists")
        start = rec["start_s"]
        for i in range(repeat):
            one = {key: value for key, value in rec.items()
                   if key not in ("repeat", "step_durations_s", "step_kv_blocks_used")}
            one["step"] = rec["step"] + i
            one["start_s"] = start
            one["duration_s"] = durations[i]
            one["kv_blocks_used"] = kv_used[i]
            one["scheduled"] = [list(x) for x in rec["scheduled"]]
            for key in ("preempted", "finished", "admitted", "shed"):
                one[key] = list(rec[key])
            out.append(one)
            start = start + durations[i]
    return out
