"""The prefix-reuse model of a Workload: fit it from a trace's block ids, and make a
sampled trace's sessions and block ids so that it re-sends prompts as the trace did, as
often and as soon.

The model (schema: :class:`~servetune.schemas.workload.PrefixReuse`) is the mechanism
that decides a prefix cache's hit rate. An LRU cache of C blocks hits a block reference
when fewer than C distinct blocks were touched since the block's last use (its stack
distance, :func:`servetune.workloads.reuse.stack_distances`). A later turn's reused blocks
were last touched by its previous turn, one think time earlier, so its distance is the
blocks the other sessions touched in that time: the think time times the rate of block
references. A sample keeps the trace's hit-rate curve when it keeps (a) which requests
are later turns and what they re-send, (b) the think times between turns, (c) the rate of
sessions, and (d) the system prompts' popularity. So a sample is generated as the
traffic is: sessions whose first turns arrive as the classes' (or the bootstrap's)
requests do, each turn followed by its next one a drawn think time later.

- first turns: the classes (or the bootstrap) make requests at the trace's full rate and
  lengths; a request of prompt band b is a later turn with the trace's share
  ``later_turn_share[b]`` and is left out (the bootstrap leaves out the requests that
  were later turns in the trace). The rest are first turns, with the first turns' length
  mix (band by band) and rate. The bands are quantile bands of prompt length, up to
  MAX_BANDS of at least BAND_MIN_REQUESTS requests each, fine enough to keep the tail
  apart: a later turn re-sends a long document, so the longest prompts are mostly later
  turns, and with 10 bands of at least 200 the top one (the longest 10% of half the
  Mooncake trace) kept too many of its longest prompts as first turns: their sessions
  made one sample's p99 prompt 191k tokens (the trace's: 67k);
- later turns: a first turn of band b has a next turn with probability
  ``next_after_first[b]``, a later turn with ``next_after_later``, ``think_time_s`` later
  (coupled to the turn's covered tokens by a Gaussian copula where the trace shows a
  correlation: in the session trace benchmarks/reuse_fidelity.py builds from Azure's,
  longer contexts wait longer for their next turn, r 0.17; without it, its sample hit 1-3
  points more at 1-10% cache sizes). Per band for first turns, since in Mooncake
  continued documents are long (the chance rises with the prompt length); one chance for
  later turns, since a session that went on once tends to go on: 16% of Mooncake's first
  turns have a next turn, and 64-83% of its later turns at each depth. One chance for all
  turns gave a Mooncake sample twice the trace's second turns and half its long sessions
  (20% more later turns in all); a chance per band for later turns too reached the cap in
  most bands (0.97 on the second half), and shrunk toward the pooled chance it cut
  Mooncake's reuse (57.8% at full cache against 64.0%). Its prompt is the turn's covered
  tokens plus ``growth_tokens`` (chat: the context so far and the new user text;
  Mooncake: the same document again), its output is drawn from the later turns'
  ``output_tokens`` (by a Gaussian copula with the later turns' prompt-output
  correlation: Mooncake's long documents come with short answers), its class is its first
  turn's. It re-sends its previous turn's blocks up to its own prompt;
- the chances are corrected for the trace's end: a turn ``left`` seconds before it shows
  its next turn only when the think time is below ``left``, so a chance is the turns'
  next turns over their exposure, the sum of P(think <= left), with the think times'
  distribution itself corrected the same way (:func:`think_time_weights`). Both chances
  are then scaled (:func:`_calibrate`) until sessions grown from the trace's own first
  turns, cut at its end, hold its second turns and its turns after those;
- the total rate stays the classes': first turns at (1 - later share) of it, plus their
  later turns;
- a first turn takes a system prompt that leaves it an own-token count within the
  trace's 1-99% range: Mooncake's shared prefixes are documents (median 61 blocks) with
  208-2,469 own tokens after them (1-99%), so the length picks the prompt; with short
  instruction prompts the range admits them all. Among those, each weighs the uses it
  has left in the cycle (its popularity at the cycle's start; all used up, the
  popularity again): drawn by popularity alone, a few prompts that fit many lengths
  took most uses, a Mooncake half-trace sample used 44-58 prompts where the trace used
  79, and re-sent them sooner. Each band keeps its share of first turns with a system
  prompt: one takes one when the band's shortfall so far plus one exceeds a uniform
  draw (capped at DEBT_REQUESTS);
- a sample longer than the trace repeats the trace's span, cycle by cycle: a session
  ends where the cycle of its first turn ends (at the session's pace: under a rate scale
  by sessions, the cycle's time left is in the trace's seconds). The chances were fitted
  on a trace that starts with no session open and ends with sessions cut short (Mooncake:
  13% of the first half's requests are later turns, 50% of the second half's); sessions
  carried on across cycles made a Mooncake sample three spans long 36% longer than three
  traces (16,296 requests against 11,979), beyond the classes' rate that the models read;
- the system prompts are those of the trace's span, with the popularity it showed there:
  a sample longer than the span makes them anew (new ids) for each span-long cycle.
  Kept for good, they would be hit ever more often, where a longer trace would have
  shown new ones;
- no sample re-sends more than the trace's infinite-cache bound (``trace_reuse_ratio``)
  of its block references, at any point: a request whose shared prefix would take the
  running share over it shares only what keeps it at the bound.

What a rate scale s does (``scale_by``): ``time`` divides every time by s, think times
too, so the sample's references come in the same order and the hit-rate curve against
cache size is the trace's at every load; ``sessions`` divides only the first turns'
times, so s times as many sessions run at once, each with the trace's think times, and
a reuse spans s times as many other blocks (a lower hit rate at a given cache size).

Sampling draws its uniforms from generators keyed by (seed, purpose, depth, chunk of
CHUNK rows), so it is deterministic, row j's draws do not depend on how many rows there
are, and a stream that is a prefix of a longer one gives sessions that are a prefix too.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from servetune.schemas.workload import (
    NonNegativeKnots,
    PrefixReuse,
    PrefixSessions,
    QuantileKnots,
    SignedKnots,
    SystemPrompts,
)
from servetune.workloads.copula import couple, fit_length_correlation, normal_ppf
from servetune.workloads.reuse import ReuseStats, reuse_stats
from servetune.workloads.trace import Trace

MAX_BANDS = 40
BAND_MIN_REQUESTS = 50
KNOT_GRID = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95,
             0.98, 0.99, 1.0)
RANGE_LOW, RANGE_HIGH = 0.01, 0.99  # a plausible own-token count
DEBT_REQUESTS = 4.0
MAX_NEXT_TURN_SHARE = 0.99  # a session has at most 100 turns on average
MIN_EXPOSURE = 0.1  # think-time weights: at most 10x
CALIBRATION_SEEDS = 4
CALIBRATION_STEPS = 16  # bisection steps: the factor to 4 / 2^16
CALIBRATION_MAX_FACTOR = 4.0
MAX_TURNS = 10_000  # a session's turns, at most (with the share above, never reached)
CHUNK = 4096
# spawn keys of the prefix streams: apart from the classes' streams (spawn keys 0..k-1)
STREAM_KEY = 0x70726566
LATER_KEY, TURN_KEY, PROMPT_KEY = 1, 2, 3


# ----------------------------------------------------------------------------- fitting


def _knots(x: np.ndarray, kind: type[QuantileKnots], decimals: int,
           weights: np.ndarray | None = None) -> QuantileKnots:
    if weights is None:
        q = np.quantile(x, KNOT_GRID)
    else:  # weighted: the sorted values at their weights' mid-points
        order = np.argsort(x, kind="stable")
        w = weights[order]
        mid = (np.cumsum(w) - 0.5 * w) / w.sum()
        q = np.interp(KNOT_GRID, mid, x[order])
    values = np.maximum.accumulate(np.round(q, decimals))
    return kind(quantiles=list(KNOT_GRID), values=[float(v) for v in values])


def think_time_weights(think_s: np.ndarray, left_s: np.ndarray) -> np.ndarray:
    """Per observed think time, 1 / the share of turns that had at least that long left
    before the trace's end (``left_s``, one per request): a long think time is seen only
    after the turns early enough to show it, so the observed ones under-represent it
    (inverse-probability weights for right censoring; the share is floored at
    MIN_EXPOSURE)."""
    ends = np.sort(left_s)
    share = 1.0 - np.searchsorted(ends, think_s, side="left") / len(ends)
    return 1.0 / np.maximum(share, MIN_EXPOSURE)


def prompt_bands(prompt_tokens: np.ndarray) -> list[float]:
    """Upper edges of the prompt-length bands (all but the last): quantiles at i/k for k =
    n // BAND_MIN_REQUESTS bands (1..MAX_BANDS), actual lengths, duplicates dropped."""
    k = min(MAX_BANDS, max(1, len(prompt_tokens) // BAND_MIN_REQUESTS))
    edges = np.quantile(prompt_tokens, np.arange(1, k) / k, method="higher")
    edges = np.unique(edges)
    return [float(e) for e in edges if e < prompt_tokens.max()]


FirstTurns = Callable[[PrefixReuse], list[tuple[np.ndarray, np.ndarray, np.ndarray]]]


def fit_prefix_reuse(trace: Trace, stats: ReuseStats | None = None,
                     first_turns: FirstTurns | None = None) -> PrefixReuse | None:
    """The prefix-reuse model of ``trace`` (None when it has no prefix ids).
    ``first_turns``: given the model before calibration, the first turns (arrival from 0,
    prompt, output) of the samples it will make over the trace's span, one set per
    calibration seed (:func:`_calibrate`); None: the trace's own first turns,
    CALIBRATION_SEEDS times."""
    if (trace.prefix_offsets is None or trace.prefix_block_ids is None
            or len(trace.prefix_block_ids) == 0):
        return None
    s = stats if stats is not None else reuse_stats(trace)
    edges = prompt_bands(trace.prompt_tokens)
    k = len(edges) + 1
    band = np.searchsorted(np.asarray(edges), trace.prompt_tokens, side="left")
    later = s.continues
    first = ~later
    has_prompt = s.system_prompt >= 0
    sessions = None
    if later.any():
        in_band = np.bincount(band, minlength=k).astype(np.float64)
        share = np.bincount(band[later], minlength=k) / np.maximum(in_band, 1.0)
        think = s.think_time_s()
        growth = s.growth_tokens().astype(np.float64)
        left = trace.arrival_s.max() - trace.arrival_s
        weight = think_time_weights(think, left)
        order = np.argsort(think, kind="stable")
        cdf = np.cumsum(weight[order]) / weight.sum()  # the uncensored think times' CDF
        at = np.searchsorted(think[order], left, side="right")
        seen = np.where(at > 0, cdf[np.maximum(at - 1, 0)], 0.0)
        has_next = np.bincount(s.parent[later], minlength=len(trace))

        def chance(turns: np.ndarray, bands: int) -> np.ndarray:
            """Per band (or for all, ``bands`` 1): next turns over exposure."""
            at = band[turns] if bands > 1 else np.zeros(int(turns.sum()), np.int64)
            exposure = np.bincount(at, weights=seen[turns], minlength=bands)
            nexts = np.bincount(at, weights=has_next[turns], minlength=bands)
            share = np.divide(nexts, exposure, out=np.zeros(bands), where=exposure > 0)
            return np.round(np.minimum(share, MAX_NEXT_TURN_SHARE), 6)
        sessions = PrefixSessions(
            later_turn_share=[round(float(x), 6) for x in share],
            next_after_first=[float(x) for x in chance(first, k)],
            next_after_later=float(chance(later, 1)[0]),
            think_time_s=_knots(think, NonNegativeKnots, 6, weight),
            growth_tokens=_knots(growth, SignedKnots, 2),
            output_tokens=_knots(trace.output_tokens[later].astype(np.float64),
                                 NonNegativeKnots, 2),
        )
        context = s.covered_tokens[s.parent[later]].astype(np.float64)
        r_think = fit_length_correlation(context, think)
        r_growth = fit_length_correlation(context, growth)
        if r_think is not None or r_growth is not None:
            sessions = sessions.model_copy(update={
                "think_context_correlation": r_think, "growth_context_correlation": r_growth,
                "context_tokens": _knots(context, NonNegativeKnots, 2)})
        r = fit_length_correlation(trace.prompt_tokens[later], trace.output_tokens[later])
        if r is not None:
            sessions = sessions.model_copy(update={
                "prompt_output_correlation": r,
                "prompt_tokens": _knots(trace.prompt_tokens[later].astype(np.float64),
                                        NonNegativeKnots, 2)})
    system_prompts = None
    if has_prompt.any():
        firsts = np.bincount(band[first], minlength=k).astype(np.float64)
        users = np.bincount(band[first & has_prompt], minlength=k)
        share = np.divide(users, firsts, out=np.zeros(k), where=firsts > 0)
        system_prompts = SystemPrompts(
            share=[round(float(x), 6) for x in share],
            own_tokens=_knots(s.own_tokens(), NonNegativeKnots, 2),
            tokens=[int(b) * s.block_tokens for b in s.system_prompt_blocks],
            sessions=[int(c) for c in s.system_prompt_sessions],
        )
    model = PrefixReuse(
        block_tokens=s.block_tokens, covers_output=s.covers_output, prompt_band_edges=edges,
        sessions=sessions, system_prompts=system_prompts,
        trace_reuse_ratio=round(s.reuse_ratio, 6))
    if sessions is None:
        return model
    start = float(trace.arrival_s.min())
    if first_turns is None:
        own = (trace.arrival_s[first] - start, trace.prompt_tokens[first],
               trace.output_tokens[first])
        sets = [own] * CALIBRATION_SEEDS
    else:
        sets = first_turns(model)
    calibrated = _calibrate(sessions, model, sets, float(trace.arrival_s.max()) - start,
                            _turn_counts(s.parent), int(trace.prompt_tokens.max()))
    return model.model_copy(update={"sessions": calibrated})


def _turn_counts(parent: np.ndarray) -> tuple[int, int]:
    """(second turns, later turns after those) of a parent array."""
    later = parent >= 0
    second = later & ~later[np.maximum(parent, 0)]
    return int(second.sum()), int((later & ~second).sum())


def _calibrate(sessions: PrefixSessions, model: PrefixReuse,
               first_turns: list[tuple[np.ndarray, np.ndarray, np.ndarray]], end_s: float,
               want: tuple[int, int], max_prompt_tokens: int) -> PrefixSessions:
    """Scale ``next_after_first`` and then ``next_after_later`` by the factors whose
    sessions, grown from each of ``first_turns`` ((arrival, prompt, output), session j's
    draws from seed j) up to ``end_s``, hold on average ``want``: the trace's second turns
    and its turns after those (bisection; the counts rise with the factor since the draws
    are fixed).

    The chances alone, each corrected for the trace's end on its own, miss the trace's
    number of later turns where sessions differ beyond their band (a few Mooncake
    documents are asked about again and again: the sample held 5-8% more), and where the
    sample's first turns come at other times than the trace's (parametric arrivals on the
    Mooncake trace: 16-19% fewer later turns)."""

    def scaled(which: str, factor: float, base: PrefixSessions) -> PrefixSessions:
        raw = np.round(np.minimum(np.asarray(getattr(sessions, which)) * factor,
                                  MAX_NEXT_TURN_SHARE), 6)
        return base.model_copy(update={
            which: [float(x) for x in raw] if raw.ndim else float(raw)})

    def counts(candidate: PrefixSessions) -> np.ndarray:
        trial = model.model_copy(update={"sessions": candidate})
        return np.mean([_turn_counts(grow_sessions(
            trial, t, np.zeros(len(t), np.int32), p, o, seed=seed, rate_scale=1.0,
            end_s=end_s, max_prompt_tokens=max_prompt_tokens, cycle_s=end_s)[4])
            for seed, (t, p, o) in enumerate(first_turns)], axis=0)

    out = sessions
    for which, pos in (("next_after_first", 0), ("next_after_later", 1)):
        low, high = 0.0, CALIBRATION_MAX_FACTOR
        for _ in range(CALIBRATION_STEPS):
            mid = 0.5 * (low + high)
            if counts(scaled(which, mid, out))[pos] < want[pos]:
                low = mid
            else:
                high = mid
        out = scaled(which, 0.5 * (low + high), out)
    return out


def summary(model: PrefixReuse) -> dict[str, object]:
    """The model's headline numbers as plain data (``workload show --json``)."""
    return {
        "block_tokens": model.block_tokens,
        "covers_output": model.covers_output,
        "trace_reuse_ratio": model.trace_reuse_ratio,
        "sessions": model.sessions is not None,
        "scale_by": model.sessions.scale_by if model.sessions is not None else None,
        "system_prompts": (len(model.system_prompts.tokens)
                           if model.system_prompts is not None else 0),
    }


def describe(model: PrefixReuse) -> str:
    """One line: "prefix reuse: 64.0% of the fitted trace's block references repeat ..."."""
    parts = []
    if model.trace_reuse_ratio is not None:
        parts.append(f"{model.trace_reuse_ratio:.1%} of the fitted trace's block references "
                     "repeat an earlier id")
    parts.append(f"sessions with later turns (load scales by {model.sessions.scale_by})"
                 if model.sessions is not None else "no later turns")
    n = len(model.system_prompts.tokens) if model.system_prompts is not None else 0
    parts.append(f"{n} system prompt{'' if n == 1 else 's'}")
    over = "prompt and output" if model.covers_output else "prompt"
    parts.append(f"{model.block_tokens}-token blocks over the {over}")
    return "prefix reuse: " + "; ".join(parts)


# ----------------------------------------------------------------------------- sampling


def _inverse(knots: QuantileKnots, u: np.ndarray) -> np.ndarray:
    return np.interp(u, knots.quantiles, knots.values)


class _SystemPrompts:
    """The model's system prompts sorted by length, the uses each has left in each cycle
    (its popularity at the start of one), and their ids (made at first use)."""

    def __init__(self, sp: SystemPrompts, block_tokens: int):
        tokens = np.asarray(sp.tokens, dtype=np.int64)
        self.order = np.argsort(tokens, kind="stable")
        self.tokens = tokens[self.order]
        self.sessions = np.asarray(sp.sessions, dtype=np.float64)[self.order]
        self.left: dict[int, np.ndarray] = {}
        low, high = np.interp([RANGE_LOW, RANGE_HIGH], sp.own_tokens.quantiles,
                              sp.own_tokens.values)
        self.own_low, self.own_high = float(low), float(high)
        self.block_tokens = block_tokens
        self.ids: dict[tuple[int, int], np.ndarray] = {}

    def pick(self, prompt_tokens: int, u: float, cycle: int) -> int | None:
        """A prompt (position in length order) leaving ``prompt_tokens`` an own-token
        count in range, weighted by its uses left in ``cycle``, and one use less; None
        when none fits or has uses left."""
        a = int(np.searchsorted(self.tokens, prompt_tokens - self.own_high, side="left"))
        z = int(np.searchsorted(self.tokens, min(prompt_tokens - self.own_low, prompt_tokens),
                                side="right"))
        if z <= a:
            return None
        left = self.left.setdefault(cycle, self.sessions.copy())
        weights = left[a:z] if left[a:z].sum() > 0 else self.sessions[a:z]
        cum = np.cumsum(weights)
        # the first prompt whose run of weight passes u * total
        i = a + int(np.searchsorted(cum, u * cum[-1], side="right"))
        left[i] = max(left[i] - 1, 0)
        return i

    def prompt_ids(self, i: int, cycle: int, fresh: _Fresh) -> np.ndarray:
        """Prompt ``i``'s ids in cycle ``cycle`` (new ones at its first use there)."""
        key = (cycle, i)
        if key not in self.ids:
            self.ids[key] = fresh.take(int(self.tokens[i]) // self.block_tokens)
        return self.ids[key]


class _Fresh:
    """New block ids, numbered from 0 in order of first use."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> np.ndarray:
        out = np.arange(self.next, self.next + n, dtype=np.int64)
        self.next += n
        return out


def _uniforms(seed: int, key: tuple[int, ...], rows: np.ndarray, width: int) -> np.ndarray:
    """(len(rows), width) uniforms: row j from chunk j // CHUNK of the stream keyed by
    (seed, STREAM_KEY, *key), so a row's draws never depend on which other rows are
    asked for."""
    rows = np.asarray(rows, dtype=np.int64)
    out = np.empty((len(rows), width))
    seed64 = int(seed) & 0xFFFFFFFFFFFFFFFF
    chunk = rows // CHUNK
    for c in np.unique(chunk):
        seq = np.random.SeedSequence(seed64, spawn_key=(STREAM_KEY, *key, int(c)))
        block = np.random.Generator(np.random.PCG64(seq)).random((CHUNK, width))
        at = chunk == c
        out[at] = block[rows[at] - c * CHUNK]
    return out


def later_turn_mask(model: PrefixReuse, prompt_tokens: np.ndarray, *, seed: int) -> np.ndarray:
    """Which of a stream's requests (in stream order) stand for later turns and are left
    out: each with its band's ``later_turn_share``."""
    if model.sessions is None:
        return np.zeros(len(prompt_tokens), dtype=bool)
    u = _uniforms(seed, (LATER_KEY,), np.arange(len(prompt_tokens)), 1)[:, 0]
    return u < np.asarray(model.sessions.later_turn_share)[model.band(prompt_tokens)]


def grow_sessions(
    model: PrefixReuse, arrival_s: np.ndarray, class_id: np.ndarray,
    prompt_tokens: np.ndarray, output_tokens: np.ndarray, *, seed: int,
    rate_scale: float, end_s: float, max_prompt_tokens: int, cycle_s: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """First turns (in time order) and their later turns up to ``end_s``: (arrival, class,
    prompt, output, parent: the previous turn's position or -1), in time order (a turn
    before its next one at equal times). Session j's turn d draws row j of stream d.
    ``cycle_s``: the fitted trace's span; a session also ends where the cycle of its first
    turn does (module docstring), in the session's own time scale."""
    sess = model.sessions
    n = len(arrival_s)
    if sess is None or n == 0:
        return arrival_s, class_id, prompt_tokens, output_tokens, np.full(n, -1, np.int64)
    think_scale = rate_scale if sess.scale_by == "time" else 1.0
    ends = np.full(n, float(end_s))
    if cycle_s:
        # the trace-time left in the first turn's cycle, at the sessions' pace
        left = cycle_s - np.mod(np.asarray(arrival_s) * rate_scale, cycle_s)
        ends = np.minimum(ends, arrival_s + left / think_scale)
    cols: dict[str, list[np.ndarray]] = {
        "t": [arrival_s], "cls": [class_id], "p": [prompt_tokens], "o": [output_tokens],
        "parent": [np.full(n, -1, np.int64)], "depth": [np.zeros(n, np.int64)]}
    session = np.arange(n)
    last = np.arange(n)  # position of each open session's last turn
    t, p, o, c, end = arrival_s, prompt_tokens, output_tokens, class_id, ends
    made = n
    for depth in range(1, MAX_TURNS):
        if len(session) == 0:
            break
        u = _uniforms(seed, (TURN_KEY, depth), session, 4)
        covered = p + (o if model.covers_output else 0)
        u_think, u_growth = u[:, 1], u[:, 2]
        if sess.context_tokens is not None:  # the copulas with the context
            z_context = normal_ppf(np.interp(covered, sess.context_tokens.values,
                                             sess.context_tokens.quantiles))
            if sess.think_context_correlation is not None:
                u_think = couple(z_context, u_think, sess.think_context_correlation)
            if sess.growth_context_correlation is not None:
                u_growth = couple(z_context, u_growth, sess.growth_context_correlation)
        t_next = t + _inverse(sess.think_time_s, u_think) / think_scale
        chance = (np.asarray(sess.next_after_first)[model.band(p)] if depth == 1
                  else sess.next_after_later)
        go = (u[:, 0] < chance) & (t_next <= end)
        p_next = np.clip(np.rint(covered + _inverse(sess.growth_tokens, u_growth)), 1,
                         max_prompt_tokens).astype(np.int64)
        u_out = u[:, 3]
        if sess.prompt_output_correlation is not None and sess.prompt_tokens is not None:
            knots = sess.prompt_tokens
            u_prompt = np.interp(p_next, knots.values, knots.quantiles)
            u_out = couple(normal_ppf(u_prompt), u_out, sess.prompt_output_correlation)
        o_next = np.maximum(1, np.rint(_inverse(sess.output_tokens, u_out))).astype(np.int64)
        k = int(go.sum())
        session, t, p, o, c = session[go], t_next[go], p_next[go], o_next[go], c[go]
        end = end[go]
        cols["t"].append(t)
        cols["cls"].append(c)
        cols["p"].append(p)
        cols["o"].append(o)
        cols["parent"].append(last[go])
        cols["depth"].append(np.full(k, depth, np.int64))
        last = np.arange(made, made + k)
        made += k
    merged = {name: np.concatenate(parts) for name, parts in cols.items()}
    order = np.lexsort((merged["depth"], merged["t"]))
    where = np.empty(made, dtype=np.int64)
    where[order] = np.arange(made)
    parent = merged["parent"][order]
    parent = np.where(parent >= 0, where[np.maximum(parent, 0)], -1)
    return (merged["t"][order], merged["cls"][order], merged["p"][order],
            merged["o"][order], parent)


def assign_prefix_ids(
    model: PrefixReuse, arrival_s: np.ndarray, prompt_tokens: np.ndarray,
    output_tokens: np.ndarray, parent: np.ndarray | None = None, *, seed: int,
    rate_scale: float = 1.0, cycle_s: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(prefix_offsets, prefix_block_ids) for requests in arrival order (see the module
    docstring); ``parent``: each later turn's previous turn (a position before it), -1
    for a first turn (None: all first turns); ``rate_scale``: the sample's; ``cycle_s``:
    the fitted trace's span (before the rate scale): system prompts get new ids in each
    cycle of that length (None: never)."""
    n = len(arrival_s)
    b = model.block_tokens
    parent = np.full(n, -1, np.int64) if parent is None else np.asarray(parent)
    covered = prompt_tokens + (output_tokens if model.covers_output else 0)
    n_ids = -(-covered // b)
    first = parent < 0
    u = np.zeros((n, 2))
    u[first] = _uniforms(seed, (PROMPT_KEY,), np.arange(int(first.sum())), 2)
    prompts, prompt_share = None, [0.0] * (len(model.prompt_band_edges) + 1)
    if model.system_prompts is not None:
        prompts = _SystemPrompts(model.system_prompts, b)
        prompt_share = list(model.system_prompts.share)
    prompt_debt = [0.0] * len(prompt_share)
    bound = model.trace_reuse_ratio
    references = repeated = 0
    fresh = _Fresh()
    out: list[np.ndarray] = []
    rows = zip(arrival_s.tolist(), prompt_tokens.tolist(), n_ids.tolist(), parent.tolist(),
               model.band(prompt_tokens).tolist(), u[:, 0].tolist(), u[:, 1].tolist(),
               strict=True)
    for t, p, nb, up, bj, u_prompt, u_which in rows:
        shared: np.ndarray | None = None
        reused = True  # the shared ids were sent before (not a system prompt's first use)
        if up >= 0:
            shared = out[up][: min(p, int(covered[up])) // b]
        elif prompts is not None:
            debt = min(prompt_debt[bj] + prompt_share[bj], DEBT_REQUESTS)
            if debt > u_prompt:
                cycle = int(t * rate_scale // cycle_s) if cycle_s else 0
                i = prompts.pick(p, u_which, cycle)
                if i is not None:
                    reused = (cycle, i) in prompts.ids
                    shared = prompts.prompt_ids(i, cycle, fresh)[: p // b]
                    debt -= 1.0
            prompt_debt[bj] = debt
        share = 0 if shared is None else min(len(shared), nb)
        if reused and bound is not None:  # never above the trace's bound
            share = max(0, min(share, math.floor(bound * (references + nb)) - repeated))
        references += nb
        repeated += share if reused else 0
        if share == 0:
            ids = fresh.take(nb)
        elif share >= nb:
            ids = shared[:nb]
        else:
            ids = np.concatenate([shared[:share], fresh.take(nb - share)])
        out.append(ids)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(n_ids, out=offsets[1:])
    flat = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
    return offsets, flat
