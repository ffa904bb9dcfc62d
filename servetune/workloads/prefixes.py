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
requests do, each followed by the later turns of a session of the trace.

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
- later turns: each first turn replays a donor, one of the trace's sessions: its later
  turns at their times after the first turn, each re-sending its parent turn's context
  (the session may branch: a Mooncake document is asked about several times from the
  same first turn) with the prompt tokens the donor's turn had beyond its own first
  turn's covered tokens, and the donor turn's output. So whether a turn goes on, how long
  it waits and how far it grows the context keep the dependence on each other and on the
  context that the trace shows. Fitted parametrically (a chance of a next turn per band
  after a first turn, one after a later turn, think times and growth drawn apart), the
  session trace benchmarks/reuse_fidelity.py builds from Azure's got later turns 18%
  longer than the trace's (mean 1,600 tokens against 1,350): there a later turn goes on
  with a chance that falls from 0.95 to 0.2 as its context grows, so long contexts went
  on too often, and its samples promised 0.78x (bootstrap) and 0.89x (parametric) the
  trace's goodput (vLLM defaults, p99 TTFT 10 s, caching on; 0.97x and 0.84x replayed);
- the donor: among the sessions whose first turn is in the first turn's band (widened to
  the neighbouring bands until it holds DONOR_NEIGHBOURS), one of the DONOR_NEIGHBOURS
  with the least time left before the trace's end that is still at least the time the
  first turn has left in its cycle (fewer where fewer were watched that long; where none
  was, the one watched longest). A donor watched at least as long shows every turn the
  first turn has time for, so the trace's end cuts no session short (the censoring a
  chance fitted per turn had to be corrected for), and a donor that began near the same
  time keeps a trace whose sessions change over time (Mooncake's documents asked about
  again and again begin early) as it was. Taking the five watched longest where fewer
  than five were watched as long cut the sessions of a band's first fifth short (in a
  Mooncake half, some 25 first turns a band, that is the first fifth of the time, where
  the sessions that go on longest begin): grown from the second half's own first turns
  they held 8-21% too few of its later turns, now 0-11%. With the trace's own first
  turns and one neighbour the sessions are the trace's, turn by turn (a test);
- where the sample's first turns come at other times than the trace's (parametric
  arrivals; a half trace that begins with the other half's sessions open), a donor
  watched longer than the first turn has left spreads its turns over more time than the
  first turn has: its turn times are drawn in by (time left / donor's time left) ^
  ``time_left_exponent``, the smallest exponent (0..1, :func:`calibrate`) whose samples
  over the trace's span hold the trace's later turns (0 where they hold 95% without).
  It is 0 on the session traces (their sessions do not depend on the time left), 0.74
  on Mooncake with its bootstrap, 0.85 on its first half, 0.73 on its second with the
  bootstrap and 0.95 parametric, and 1 (the cap) on the whole trace with parametric
  arrivals, which still hold 10% fewer later turns;
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
  by sessions, the cycle's time left is in the trace's seconds). The trace starts with no
  session open and ends with sessions cut short (Mooncake: 13% of the first half's
  requests are later turns, 50% of the second half's); sessions carried on across cycles
  made a Mooncake sample three spans long 36% longer than three traces (16,296 requests
  against 11,979), beyond the classes' rate that the models read;
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

Sampling draws its uniforms from generators keyed by (seed, purpose, chunk of CHUNK
rows), so it is deterministic, row j's draws do not depend on how many rows there
are, and a stream that is a prefix of a longer one gives sessions that are a prefix too.
"""

from __future__ import annotations

import math

import numpy as np

from servetune.schemas.workload import (
    NonNegativeKnots,
    PrefixReuse,
    PrefixSessions,
    QuantileKnots,
    SystemPrompts,
)
from servetune.workloads.reuse import ReuseStats, reuse_stats
from servetune.workloads.trace import Trace

MAX_BANDS = 40
BAND_MIN_REQUESTS = 50
KNOT_GRID = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95,
             0.98, 0.99, 1.0)
RANGE_LOW, RANGE_HIGH = 0.01, 0.99  # a plausible own-token count
DEBT_REQUESTS = 4.0
DONOR_NEIGHBOURS = 5  # a first turn's donor: one of this many sessions of its band
CALIBRATION_SEEDS = 4
CALIBRATION_STEPS = 12  # bisection steps: the exponent to 1 / 2^12
# Samples that hold this close to the trace's later turns keep the donors' times: the
# chat trace's hold 95-96% whatever the exponent, and drawing its turns in only brought
# its reuse sooner (33.2% against 29.7% at 2% of the blocks)
HELD_TOLERANCE = 0.05
CHUNK = 4096
# spawn keys of the prefix streams: apart from the classes' streams (spawn keys 0..k-1)
STREAM_KEY = 0x70726566
LATER_KEY, TURN_KEY, PROMPT_KEY = 1, 2, 3


# ----------------------------------------------------------------------------- fitting


def _knots(x: np.ndarray, kind: type[QuantileKnots], decimals: int) -> QuantileKnots:
    values = np.maximum.accumulate(np.round(np.quantile(x, KNOT_GRID), decimals))
    return kind(quantiles=list(KNOT_GRID), values=[float(v) for v in values])


def prompt_bands(prompt_tokens: np.ndarray) -> list[float]:
    """Upper edges of the prompt-length bands (all but the last): quantiles at i/k for k =
    n // BAND_MIN_REQUESTS bands (1..MAX_BANDS), actual lengths, duplicates dropped."""
    k = min(MAX_BANDS, max(1, len(prompt_tokens) // BAND_MIN_REQUESTS))
    edges = np.quantile(prompt_tokens, np.arange(1, k) / k, method="higher")
    edges = np.unique(edges)
    return [float(e) for e in edges if e < prompt_tokens.max()]


FirstTurns = list[tuple[np.ndarray, np.ndarray, np.ndarray]]


def fit_prefix_reuse(trace: Trace, stats: ReuseStats | None = None) -> PrefixReuse | None:
    """The prefix-reuse model of ``trace`` (None when it has no prefix ids), its
    ``time_left_exponent`` 0 (:func:`calibrate` sets it)."""
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
        sessions = PrefixSessions(
            later_turn_share=[round(float(x), 6) for x in share], **_donors(trace, s))
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
    return PrefixReuse(
        block_tokens=s.block_tokens, covers_output=s.covers_output, prompt_band_edges=edges,
        sessions=sessions, system_prompts=system_prompts,
        trace_reuse_ratio=round(s.reuse_ratio, 6))


def later_turns_held(model: PrefixReuse, first_turns: FirstTurns, trace: Trace,
                     exponent: float | None = None) -> float:
    """The later turns that sessions grown from each of ``first_turns`` ((arrival from 0,
    prompt, output), session j's draws from seed j) hold over ``trace``'s span, on
    average, as a share of the trace's; ``exponent``: the ``time_left_exponent`` to grow
    them with (None: the model's)."""
    sess = model.sessions
    assert sess is not None
    if exponent is not None:
        model = model.model_copy(update={"sessions": sess.model_copy(
            update={"time_left_exponent": exponent})})
    span = float(trace.arrival_s.max() - trace.arrival_s.min())
    longest = int(trace.prompt_tokens.max())
    held = np.mean([(grow_sessions(
        model, t, np.zeros(len(t), np.int32), p, o, seed=seed, rate_scale=1.0, end_s=span,
        max_prompt_tokens=longest, cycle_s=span)[4] >= 0).sum()
        for seed, (t, p, o) in enumerate(first_turns)])
    return float(held) / max(int(sum(sess.later_turns)), 1)


def calibrate(model: PrefixReuse, trace: Trace, first_turns: FirstTurns) -> PrefixReuse:
    """``model`` with the smallest ``time_left_exponent`` (0..1, bisection) whose sessions,
    grown from ``first_turns`` (the first turns of the samples the workload will make
    over the trace's span, one set per calibration seed), hold the trace's later turns:
    0 where they hold all but HELD_TOLERANCE of them without drawing turns in. The count
    rises with the exponent since the draws are fixed."""
    if (model.sessions is None
            or later_turns_held(model, first_turns, trace, 0.0) >= 1.0 - HELD_TOLERANCE):
        return model
    low, high = 0.0, 1.0
    for _ in range(CALIBRATION_STEPS):
        mid = 0.5 * (low + high)
        if later_turns_held(model, first_turns, trace, mid) < 1.0:
            low = mid
        else:
            high = mid
    return model.model_copy(update={"sessions": model.sessions.model_copy(
        update={"time_left_exponent": round(high, 4)})})


def _donors(trace: Trace, s: ReuseStats) -> dict[str, list]:
    """The trace's sessions as :class:`PrefixSessions` lists them: per session (in order
    of first turns) its first prompt, time left and later turns; per later turn (session
    by session, in arrival order) its parent, time after the first turn, extra tokens and
    output."""
    firsts = np.flatnonzero(~s.continues)
    turns = np.flatnonzero(s.continues)
    turns = turns[np.argsort(s.session[turns], kind="stable")]  # session by session
    counts = np.bincount(s.session[turns], minlength=len(firsts))
    start = np.repeat(np.cumsum(counts) - counts, counts)
    local = np.full(len(trace), -1, np.int64)  # a later turn's position in its session
    local[turns] = np.arange(len(turns)) - start
    root = firsts[s.session[turns]]
    covered = trace.prompt_tokens + (trace.output_tokens if s.covers_output else 0)
    end = float(trace.arrival_s.max())
    return {
        "first_prompt_tokens": [int(x) for x in trace.prompt_tokens[firsts]],
        "time_left_s": [round(float(end - t), 6) for t in trace.arrival_s[firsts]],
        "later_turns": [int(x) for x in counts],
        "parent": [int(x) for x in local[s.parent[turns]]],
        "after_s": [round(float(x), 6)
                    for x in trace.arrival_s[turns] - trace.arrival_s[root]],
        "extra_tokens": [int(x) for x in trace.prompt_tokens[turns] - covered[root]],
        "output_tokens": [int(x) for x in trace.output_tokens[turns]],
    }


def summary(model: PrefixReuse) -> dict[str, object]:
    """The model's headline numbers as plain data (``workload show --json``)."""
    sess = model.sessions
    return {
        "block_tokens": model.block_tokens,
        "covers_output": model.covers_output,
        "trace_reuse_ratio": model.trace_reuse_ratio,
        "sessions": sess is not None,
        "scale_by": sess.scale_by if sess is not None else None,
        "donor_sessions": len(sess.later_turns) if sess is not None else 0,
        "donor_later_turns": len(sess.parent) if sess is not None else 0,
        "time_left_exponent": sess.time_left_exponent if sess is not None else None,
        "system_prompts": (len(model.system_prompts.tokens)
                           if model.system_prompts is not None else 0),
    }


def describe(model: PrefixReuse) -> str:
    """One line: "prefix reuse: 64.0% of the fitted trace's block references repeat ..."."""
    parts = []
    if model.trace_reuse_ratio is not None:
        parts.append(f"{model.trace_reuse_ratio:.1%} of the fitted trace's block references "
                     "repeat an earlier id")
    sess = model.sessions
    parts.append(f"{len(sess.later_turns):,} sessions of the trace replayed "
                 f"({len(sess.parent):,} later turns; load scales by {sess.scale_by})"
                 if sess is not None else "no later turns")
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


class _Donors:
    """A model's donor sessions as arrays, and per prompt band the pool a first turn draws
    its donor from (module docstring)."""

    def __init__(self, model: PrefixReuse):
        sess = model.sessions
        assert sess is not None
        self.time_left_s = np.asarray(sess.time_left_s, dtype=np.float64)
        self.later_turns = np.asarray(sess.later_turns, dtype=np.int64)
        self.first_turn = np.cumsum(self.later_turns) - self.later_turns  # flat position
        self.parent = np.asarray(sess.parent, dtype=np.int64)
        self.after_s = np.asarray(sess.after_s, dtype=np.float64)
        self.extra_tokens = np.asarray(sess.extra_tokens, dtype=np.int64)
        self.output_tokens = np.asarray(sess.output_tokens, dtype=np.int64)
        band = model.band(np.asarray(sess.first_prompt_tokens))
        bands = len(model.prompt_band_edges) + 1
        self.pools: list[np.ndarray] = []
        for b in range(bands):
            r = 0  # the band, widened to its neighbours until it holds enough donors
            while True:
                pool = np.flatnonzero((band >= b - r) & (band <= b + r))
                if len(pool) >= DONOR_NEIGHBOURS or r >= bands:
                    break
                r += 1
            # least time left first (ties: trace order)
            self.pools.append(pool[np.argsort(self.time_left_s[pool], kind="stable")])

    def pick(self, band: np.ndarray, left_s: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Per first turn (its band, its trace-seconds left in its cycle, a uniform): a
        donor among the DONOR_NEIGHBOURS of its band's pool with the least time left that
        is at least its own (fewer where fewer were watched as long; the one watched
        longest where none was)."""
        donor = np.empty(len(band), dtype=np.int64)
        for b in np.unique(band):
            at = band == b
            pool = self.pools[int(b)]
            # (time_left_s is stored to the microsecond)
            low = np.searchsorted(self.time_left_s[pool], left_s[at] - 1e-6, side="left")
            k = np.clip(len(pool) - low, 1, DONOR_NEIGHBOURS)  # those watched as long
            low = np.minimum(low, len(pool) - 1)
            donor[at] = pool[low + np.minimum((u[at] * k).astype(np.int64), k - 1)]
        return donor


def grow_sessions(
    model: PrefixReuse, arrival_s: np.ndarray, class_id: np.ndarray,
    prompt_tokens: np.ndarray, output_tokens: np.ndarray, *, seed: int,
    rate_scale: float, end_s: float, max_prompt_tokens: int, cycle_s: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """First turns (in time order) and their later turns up to ``end_s``: (arrival, class,
    prompt, output, parent: the previous turn's position or -1), in time order (a turn
    before its next one at equal times). Each first turn replays a donor session's later
    turns (module docstring); session j's donor is drawn from row j of its stream.
    ``cycle_s``: the fitted trace's span; a session also ends where the cycle of its first
    turn does, in the session's own time scale."""
    sess = model.sessions
    n = len(arrival_s)
    if sess is None or n == 0:
        return arrival_s, class_id, prompt_tokens, output_tokens, np.full(n, -1, np.int64)
    donors = _Donors(model)
    think_scale = rate_scale if sess.scale_by == "time" else 1.0
    # the trace-seconds left in the first turn's cycle (the sessions' pace undone)
    left = (cycle_s - np.mod(np.asarray(arrival_s) * rate_scale, cycle_s) if cycle_s
            else np.full(n, np.inf))
    end = np.minimum(float(end_s), arrival_s + left / think_scale)
    u = _uniforms(seed, (TURN_KEY,), np.arange(n), 1)[:, 0]
    donor = donors.pick(model.band(prompt_tokens), left, u)
    # every donor turn, session by session: its session and flat position among the donor's
    count = donors.later_turns[donor]
    session = np.repeat(np.arange(n), count)
    first_of = np.repeat(np.cumsum(count) - count, count)  # the session's first, expanded
    turn = np.repeat(donors.first_turn[donor], count) + np.arange(len(session)) - first_of
    # a donor watched longer than the first turn has left draws its turns in by
    # (left / donor's left) ^ time_left_exponent (module docstring)
    drawn_in = np.ones(n)
    if sess.time_left_exponent > 0:
        drawn_in = np.minimum(1.0, left / np.maximum(donors.time_left_s[donor], 1e-9)) ** (
            sess.time_left_exponent)
    t = arrival_s[session] + donors.after_s[turn] * drawn_in[session] / think_scale
    # a turn comes after its parent, so a kept turn's parent is kept too
    kept = t <= end[session]
    covered = prompt_tokens + (output_tokens if model.covers_output else 0)
    p = np.clip(covered[session] + donors.extra_tokens[turn], 1, max_prompt_tokens)
    local = donors.parent[turn]
    parent = np.where(local >= 0, n + first_of + local, session)  # positions in all rows
    rows = np.concatenate([np.arange(n), n + np.flatnonzero(kept)])
    renumber = np.full(n + len(session), -1, np.int64)
    renumber[rows] = np.arange(len(rows))
    all_t = np.concatenate([arrival_s, t[kept]])
    order = np.argsort(all_t, kind="stable")  # a parent's row comes before its turns'
    where = np.empty(len(rows), dtype=np.int64)
    where[order] = np.arange(len(rows))
    all_parent = np.concatenate([np.full(n, -1, np.int64), renumber[parent[kept]]])
    all_parent = np.where(all_parent >= 0, where[np.maximum(all_parent, 0)], -1)
    return (all_t[order], np.concatenate([class_id, class_id[session[kept]]])[order],
            np.concatenate([prompt_tokens, p[kept]]).astype(np.int64)[order],
            np.concatenate([output_tokens, donors.output_tokens[turn][kept]])[order],
            all_parent[order])


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
