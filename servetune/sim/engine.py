"""Engine models of continuous batching: vLLM V1 (default), SGLang, TensorRT-LLM, TGI.

:func:`run_engine` replays a :class:`~servetune.workloads.trace.Trace` through one engine's
scheduler under a :class:`~servetune.schemas.policy.Policy`, a KV pool of ``kv_blocks``
blocks of ``block_size`` tokens, and a :class:`~servetune.profiles.steptime.StepTimeModel`, and
returns per-request timestamps and run totals (:class:`EngineOutput`).

Semantics (``reference/engines.md``; the step loop is in :mod:`servetune.sim._kernel`):

- **vllm** (section 1.1): each step first serves the running list in admission order,
  each request getting its remaining tokens capped by ``long_prefill_token_threshold``
  and the remaining budget (``max_num_batched_tokens``); blocks are allocated for those
  tokens only; when they run out, the last admitted running request (``priority``: the
  max (priority, arrival)) is recompute-preempted: its blocks are freed, its computed
  tokens lost (generated tokens kept and re-prefilled) and it goes to the front of the
  waiting queue; a step that preempted admits nothing. Then waiting requests are
  admitted in FCFS or (priority, arrival) order with strict head-of-line blocking, up to
  ``max_num_seqs``: the whole (re-)prefill's blocks plus those that in-flight prefills
  still need must fit with ``kv_watermark`` headroom when ``reserve_full_prompt``
  (else only this chunk's). With ``enable_chunked_prefill`` off, a prompt that does not
  fit the remaining budget waits and blocks the queue (a resumed request whose re-prefill
  exceeds the whole budget is chunked: vLLM's own config check rules that case out).
- **sglang** (2.2, 2.3): a step is a prefill batch when one can be formed (the chunked
  request first, then admissions in queue order whose re-prefill plus
  ``min(max_tokens - generated, 4096) * new_token_ratio`` fits the free KV tokens less
  the same estimate for every running request), else a decode batch of every running
  request (decode is not budgeted). The ratio starts at 0.7, decays linearly to 0.098
  over 600 decode steps, resets when idle, and after a retraction jumps to
  ``(decoded + 20 * running) / sum(max_tokens)``. When a decode batch does not fit,
  requests are retracted fewest-generated first (longest prompt, then latest among
  ties) back to the front of the queue. The whole re-prefill's KV is allocated at
  admission.
- **trtllm** (4, GUARANTEED_NO_EVICT) and **tgi** (3): a request is admitted only when
  blocks for ``prompt + max_tokens - 1`` tokens can be reserved beside the running
  requests' reservations, so nothing is ever evicted. TensorRT-LLM budgets all tokens
  of a step; TGI budgets only prefill tokens (decode rows ride along).

For every engine: ``max_num_seqs`` caps the running batch, ``kv_watermark`` blocks are
kept free at admission, and ``long_prefill_token_threshold`` applies only to vLLM (the
others have no such knob). Where the trace has no ``max_tokens`` column, a request's declared
maximum output is its output length (the engine "knows" it); with ``max_tokens``, a
request generates ``min(output_tokens, max_tokens)`` tokens. Priorities come from the
trace's ``priority`` column, else from the policy's class priorities (lower first).
The policy's extensions act at admission for every engine:

- long-request lanes (Policy docstring): a request is long when its prompt plus expected
  output (``max_tokens``, else ``expected_output``, else its class's mean output in the
  trace) reaches ``threshold_tokens``. Short requests are admitted only while they leave
  ``reserved_seqs`` seats and ``reserved_kv_fraction`` of the blocks (less what long
  requests hold) free; running long requests never exceed ``max_seqs``, nor
  ``max_kv_fraction`` of the blocks counted by their lane footprint (blocks of prompt +
  expected output, so the cap holds without preempting). The two lanes are separate
  queues merged by queue order; each is head-of-line blocking only within itself, so a
  long request that does not fit its lane does not block short ones behind it.
- queue caps: an arrival is shed (status 1, as HTTP 503) when waiting + running
  requests reach ``max_queued_requests``, or when the prompt tokens of accepted requests
  not yet past their first token would exceed ``max_queued_prompt_tokens``.
- a request that could never run (prompt + output exceed the pool; its admission, i.e. its
  prompt (vLLM without ``reserve_full_prompt``: its first chunk) or TensorRT-LLM/TGI's
  reservation, exceeds the pool less the watermark and lane reserve; its lane; or the
  step budget with chunking off) is rejected at arrival (status 2) with a reason instead
  of blocking the queue forever. A preempted request whose re-prefill has outgrown the
  pool less that headroom is rejected when even an empty engine could not re-admit it.

Time: arrivals enter the waiting queue at step boundaries; an idle engine jumps to the
next arrival; a step's duration is ``step_seconds(T, S, D, C, W)`` with T tokens, S rows
sampled, D decoding requests, C = sum over decoding requests of their context after this
step's token, W = sum over prefill chunks of ``chunk * (prefix + chunk / 2)``.
A request's first token comes at the end of the step that completes its prefill; it
finishes at the end of the step that samples its last token.

Step log (issue 7; ``step_log=True``): one dict per step, in order, with ``step``
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
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from servetune.errors import ServetuneError
from servetune.profiles.steptime import StepTimeModel
from servetune.schemas.policy import Policy
from servetune.sim import _kernel as K
from servetune.workloads.trace import Trace

ENGINES = ("vllm", "sglang", "trtllm", "tgi")

REASONS = (
    "",
    "shed: max_queued_requests reached (HTTP 503)",
    "shed: max_queued_prompt_tokens reached (HTTP 503)",
    "rejected: needs more KV blocks than the pool (less watermark/lane reserve at admission)",
    "rejected: the request's footprint exceeds the long-request lane (max_kv_fraction)",
    "rejected: prompt longer than max_num_batched_tokens with chunked prefill off",
    "rejected: prompt + max output reservation exceeds the KV pool",
    "rejected: preempted, its re-prefill no longer fits the pool less watermark/lane reserve",
)
REASON_SHED_REQUESTS = 1
REASON_SHED_TOKENS = 2
REASON_KV_POOL = 3
REASON_LANE = 4
REASON_BUDGET = 5
REASON_RESERVATION = 6
REASON_READMIT = K.RJ_READMIT  # rejected by the kernel when even an empty engine cannot re-admit

# SGLang environment defaults (engines.md 2.2).
SGLANG_CLIP_MAX_NEW_TOKENS = 4096
SGLANG_INIT_NEW_TOKEN_RATIO = 0.7
SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS = 600
SGLANG_RETRACT_DECODE_STEPS = 20

SERIES_BINS = 2048
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


def _blocks(tokens: np.ndarray, block_size: int) -> np.ndarray:
    return (tokens + block_size - 1) // block_size


def _expected_output(
    trace: Trace, declared: np.ndarray, expected_output: np.ndarray | None
) -> np.ndarray:
    """Expected output per request for the long-request test (Policy docstring)."""
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


def _validate(
    trace: Trace, kv_blocks: int, block_size: int, engine: str
) -> None:
    if engine not in ENGINES:
        raise ServetuneError(f"engine {engine!r} is unknown; choose one of {', '.join(ENGINES)}")
    if int(kv_blocks) < 1:
        raise ServetuneError(
            f"KV pool has {kv_blocks} blocks; the profile must leave at least one block "
            "(raise gpu_memory_utilization or set kv_blocks_override)"
        )
    if int(block_size) < 1:
        raise ServetuneError(f"block_size must be >= 1 (got {block_size})")
    if len(trace) == 0:
        raise ServetuneError("trace has no requests")


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
) -> EngineOutput:
    """Simulate ``trace`` on one engine; see the module docstring for the semantics.

    ``reference=True`` runs every step in plain Python (no jumps); otherwise the loop is
    compiled with numba and stretches of identical decode steps are jumped. Both give
    identical records. ``step_log=True`` also returns the issue-7 step log (jumped
    stretches as one record with ``repeat``; :func:`expand_repeats` expands them).
    ``progress(done, total)`` is called between chunks of steps with the number of
    requests resolved so far. ``expected_output`` (per request or per class) overrides
    the trace's class mean output in the long-request test when the trace has no
    ``max_tokens``.
    """
    _validate(trace, kv_blocks, block_size, engine)
    n = len(trace)
    bs = int(block_size)
    total = int(kv_blocks)
    b = policy.batching
    adm = policy.admission
    lr = policy.long_requests
    eng = ENGINES.index(engine)

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
    arrival = np.ascontiguousarray(trace.arrival_s, dtype=np.float64)
    if not (np.all(np.isfinite(arrival)) and np.all(np.diff(arrival) >= 0)):
        raise ServetuneError("trace arrivals must be finite and sorted (use trace.from_arrays)")

    wm = int(np.floor(adm.kv_watermark * total))
    lanes = lr.enabled
    r_kv = int(np.floor(lr.reserved_kv_fraction * total)) if lanes else 0
    m_kv = int(np.floor(lr.max_kv_fraction * total)) if lanes else total
    m_seq = int(lr.max_seqs) if (lanes and lr.max_seqs is not None) else int(b.max_num_seqs)
    r_seq = int(lr.reserved_seqs) if lanes else 0
    if lanes:
        expected = _expected_output(trace, declared, expected_output)
        footprint = prompt + expected
        is_long = (footprint >= int(lr.threshold_tokens)).astype(np.int8)
        lane_blocks = _blocks(footprint, bs) * is_long
    else:
        is_long = np.zeros(n, dtype=np.int8)
        lane_blocks = np.zeros(n, dtype=np.int64)

    # Requests that could never run are rejected at arrival (no head-of-line deadlock).
    reject = np.zeros(n, dtype=np.int8)
    headroom = wm + np.where(is_long == 1, 0, r_kv)
    final_kv = prompt + out - 1  # tokens in KV when the last token is sampled
    resv = np.zeros(n, dtype=np.int64)
    if eng in (K.E_TRTLLM, K.E_TGI):
        resv = _blocks(prompt + declared - 1, bs)
        reject[resv + headroom > total] = REASON_RESERVATION
    if eng == K.E_SGLANG:
        worst = prompt + np.minimum(declared, out - 1 + SGLANG_CLIP_MAX_NEW_TOKENS)
        reject[worst > total * bs] = REASON_RESERVATION
    if not b.enable_chunked_prefill:
        # Only the prompt's first chunk must fit the budget (engines.md 1.1). A resumed
        # request's re-prefill (prompt + generated) may exceed it: vLLM then requires
        # max_num_batched_tokens >= max_model_len, so it cannot happen there, and the
        # kernel chunks such a re-prefill instead of blocking the queue forever.
        first_chunk = prompt
        if eng == K.E_VLLM and b.long_prefill_token_threshold > 0:
            first_chunk = np.minimum(prompt, b.long_prefill_token_threshold)
        reject[first_chunk > b.max_num_batched_tokens] = REASON_BUDGET
    if lanes:
        reject[(is_long == 1) & (lane_blocks > m_kv)] = REASON_LANE
    if eng in (K.E_TRTLLM, K.E_TGI):
        reject[_blocks(final_kv, bs) + headroom > total] = REASON_KV_POOL
    else:
        # The watermark and the long lane's reserve bind at admission only (engines.md
        # 1.1): a request is turned away when it could never be admitted (its prompt, all
        # of which is reserved or allocated at admission, does not fit the pool less the
        # headroom) or never fit the pool at all. A preempted request whose re-prefill has
        # outgrown the headroom is rejected by the kernel once even an empty engine could
        # not take it back (REASON_READMIT).
        first = prompt  # what the first admission allocates or reserves, engine empty
        if eng == K.E_VLLM and not adm.reserve_full_prompt:
            first = np.minimum(prompt, b.max_num_batched_tokens)
            if b.long_prefill_token_threshold > 0:
                first = np.minimum(first, b.long_prefill_token_threshold)
        admit_blocks = _blocks(first, bs)
        reject[(admit_blocks + headroom > total) | (_blocks(final_kv, bs) > total)] = (
            REASON_KV_POOL
        )

    pi = np.zeros(K.N_PI, dtype=np.int64)
    pi[K.P_ENGINE] = eng
    pi[K.P_PRIO_MODE] = 1 if policy.scheduling == "priority" else 0
    pi[K.P_MAX_SEQS] = b.max_num_seqs
    pi[K.P_BUDGET] = b.max_num_batched_tokens
    pi[K.P_THRESH] = b.long_prefill_token_threshold
    pi[K.P_CHUNKED] = 1 if b.enable_chunked_prefill else 0
    pi[K.P_RESERVE_FULL] = 1 if adm.reserve_full_prompt else 0
    pi[K.P_WM] = wm
    pi[K.P_TOTAL] = total
    pi[K.P_BS] = bs
    pi[K.P_QREQ] = adm.max_queued_requests if adm.max_queued_requests is not None else -1
    pi[K.P_QTOK] = (
        adm.max_queued_prompt_tokens if adm.max_queued_prompt_tokens is not None else -1
    )
    pi[K.P_LANES] = 1 if lanes else 0
    pi[K.P_RSEQ] = r_seq
    pi[K.P_RKV] = r_kv
    pi[K.P_MSEQ] = m_seq
    pi[K.P_MKV] = m_kv
    pi[K.P_JUMP] = 0 if reference else 1
    pi[K.P_LOG] = 1 if step_log else 0
    pi[K.P_CLIP] = SGLANG_CLIP_MAX_NEW_TOKENS
    pi[K.P_RETRACT_STEPS] = SGLANG_RETRACT_DECODE_STEPS
    pf = np.zeros(K.N_PF, dtype=np.float64)
    ratio_init = min(SGLANG_INIT_NEW_TOKEN_RATIO, 1.0)
    ratio_floor = ratio_init * SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
    pf[K.F_RATIO_INIT] = ratio_init
    pf[K.F_RATIO_FLOOR] = ratio_floor
    pf[K.F_RATIO_DECAY] = (ratio_init - ratio_floor) / SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
    coef, pieces = step_time.as_arrays()

    n_long = int(is_long.sum())
    state: dict[str, np.ndarray] = {
        "comp": np.zeros(n, dtype=np.int64),
        "gen": np.zeros(n, dtype=np.int64),
        "held": np.zeros(n, dtype=np.int64),
        "in_prefill": np.zeros(n, dtype=np.int8),
        "admitted_s": np.full(n, np.nan),
        "first_s": np.full(n, np.nan),
        "finish_s": np.full(n, np.nan),
        "npre": np.zeros(n, dtype=np.int32),
        "status": np.full(n, -1, dtype=np.int8),
        "reason": np.zeros(n, dtype=np.int8),
    }
    hk0 = np.zeros(max(n - n_long, 1), dtype=np.int64)
    hid0 = np.zeros_like(hk0)
    hk1 = np.zeros(max(n_long, 1), dtype=np.int64)
    hid1 = np.zeros_like(hk1)
    width = min(int(b.max_num_seqs), n) + 1
    run = np.zeros(width, dtype=np.int64)
    sched_r = np.zeros(width, dtype=np.int64)
    sched_n = np.zeros(width, dtype=np.int64)
    hist = np.zeros(K.WINDOW_MAX + 2, dtype=np.int64)
    si = np.zeros(K.N_SI, dtype=np.int64)
    si[K.S_CHUNKED_REQ] = -1
    sf = np.zeros(K.N_SF, dtype=np.float64)
    sf[K.T_RATIO] = ratio_init
    sf[K.T_BIN_W] = max(float(arrival[-1]), 1.0) / (SERIES_BINS // 2)
    ser = np.zeros((3, SERIES_BINS), dtype=np.float64)
    if step_log:
        rec_i = np.zeros((4096, K.N_RI), dtype=np.int64)
        rec_f = np.zeros((4096, 2), dtype=np.float64)
        ev = np.zeros((65536 + 8 * width, 3), dtype=np.int64)
        rep_f = np.zeros(65536, dtype=np.float64)
        rep_i = np.zeros(65536, dtype=np.int64)
    else:
        rec_i = np.zeros((1, K.N_RI), dtype=np.int64)
        rec_f = np.zeros((1, 2), dtype=np.float64)
        ev = np.zeros((1, 3), dtype=np.int64)
        rep_f = np.zeros(1, dtype=np.float64)
        rep_i = np.zeros(1, dtype=np.int64)

    kernel = _kernel_module(reference).run_kernel
    chunk = _CHUNK_STEPS_REFERENCE if reference else _CHUNK_STEPS_FAST
    while True:
        rc = kernel(
            pi, pf, coef, pieces, arrival, prompt, out, declared, prio, is_long, lane_blocks,
            reject, resv, state["comp"], state["gen"], state["held"], state["in_prefill"],
            state["admitted_s"], state["first_s"], state["finish_s"], state["npre"],
            state["status"], state["reason"], hk0, hid0, hk1, hid1, run, sched_r, sched_n,
            hist, si, sf, ser, rec_i, rec_f, ev, rep_f, rep_i, chunk,
        )
        if rc == K.RC_DONE:
            break
        if rc == K.RC_LOG_FULL:
            if si[K.S_REC] + 2 > rec_i.shape[0]:
                rec_i = np.concatenate([rec_i, np.zeros_like(rec_i)])
                rec_f = np.concatenate([rec_f, np.zeros_like(rec_f)])
            if si[K.S_EV] + 8 * width + n > ev.shape[0] // 2:
                ev = np.concatenate([ev, np.zeros((ev.shape[0] + n, 3), dtype=np.int64)])
            if si[K.S_REP] + 2 > rep_f.shape[0] // 2:
                rep_f = np.concatenate([rep_f, np.zeros_like(rep_f)])
                rep_i = np.concatenate([rep_i, np.zeros_like(rep_i)])
        elif rc == K.RC_STUCK:
            raise RuntimeError(
                f"engine {engine} made no progress at t={sf[K.T_NOW]:.6f} s with "
                f"{si[K.S_H0] + si[K.S_H1]} waiting and {si[K.S_NRUN]} running (a bug)"
            )
        if progress is not None:
            progress(int(si[K.S_DONE]), n)
    if progress is not None:
        progress(int(si[K.S_DONE]), n)

    status = state["status"]
    if (status < 0).any():
        raise RuntimeError(f"{int((status < 0).sum())} requests unresolved at the end (a bug)")
    sim_end = float(sf[K.T_NOW])
    steps = int(si[K.S_STEPS])
    kv_peak = float(si[K.S_PEAK]) / total
    kv_mean = float(sf[K.T_KV_INT]) / (sim_end * total) if sim_end > 0 else 0.0
    kv_mean = min(kv_mean, kv_peak)  # rounding of the time integral can exceed the peak
    series = _series(ser, float(sf[K.T_BIN_W]), sim_end, total)
    log = _step_log(rec_i, rec_f, ev, rep_f, rep_i, si, total) if step_log else None
    return EngineOutput(
        admitted_s=state["admitted_s"],
        first_token_s=state["first_s"],
        finish_s=state["finish_s"],
        preemptions=state["npre"],
        status=status,
        reason=state["reason"],
        generated=state["gen"],
        steps=steps,
        kv_blocks_total=total,
        kv_util_mean=kv_mean,
        kv_util_peak=kv_peak,
        sim_end_s=sim_end,
        series=series,
        step_log=log,
        engine=engine,
        jumps=int(si[K.S_JUMPS]),
        kv_blocks_in_use_end=int(si[K.S_USED]),
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
    }


def _step_log(
    rec_i: np.ndarray, rec_f: np.ndarray, ev: np.ndarray, rep_f: np.ndarray,
    rep_i: np.ndarray, si: np.ndarray, total: int,
) -> list[dict[str, Any]]:
    """Issue-7 records from the kernel's flat buffers."""
    out: list[dict[str, Any]] = []
    ev_start = 0
    rep_start = 0
    names = {K.EV_PREEMPT: "preempted", K.EV_FINISH: "finished", K.EV_ADMIT: "admitted",
             K.EV_SHED: "shed"}
    for k in range(int(si[K.S_REC])):
        row = rec_i[k]
        ev_end = int(row[K.R_EV_END])
        rep_end = int(row[K.R_REP_END])
        lists: dict[str, list[Any]] = {
            "scheduled": [], "preempted": [], "finished": [], "admitted": [], "shed": []
        }
        for kind, req, val in ev[ev_start:ev_end].tolist():
            if kind == K.EV_SCHED:
                lists["scheduled"].append([req, val])
            else:
                lists[names[kind]].append(req)
        rec: dict[str, Any] = {
            "step": int(row[K.R_STEP]),
            "start_s": float(rec_f[k, 0]),
            "duration_s": float(rec_f[k, 1]),
            "scheduled": lists["scheduled"],
            "preempted": lists["preempted"],
            "finished": lists["finished"],
            "admitted": lists["admitted"],
            "shed": lists["shed"],
            "kv_blocks_used": int(row[K.R_KV]),
            "kv_blocks_total": total,
            "waiting": int(row[K.R_WAITING]),
            "running": int(row[K.R_RUNNING]),
        }
        repeat = int(row[K.R_REPEAT])
        if repeat == 1 and rep_end == rep_start + 1:
            # a stretch cut to one step by an arrival: an ordinary record
            rec["duration_s"] = float(rep_f[rep_start])
            rec["kv_blocks_used"] = int(rep_i[rep_start])
        elif rep_end > rep_start:
            rec["repeat"] = repeat
            rec["step_durations_s"] = rep_f[rep_start:rep_end].tolist()
            rec["step_kv_blocks_used"] = rep_i[rep_start:rep_end].tolist()
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
