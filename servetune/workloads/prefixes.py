"""The prefix-reuse model of a Workload: fit it from a trace's block ids, and give a
sampled trace's requests block ids that reuse prompts as the trace did.

The model (schema: :class:`~servetune.schemas.workload.PrefixReuse`) is what decides a
prefix cache's hit rate in :mod:`servetune.workloads.reuse`'s terms: sessions (which
requests are later turns, the think time between turns, the prompt growth per turn) and
shared system prompts (how many, their lengths, their popularity). Why this form, from the
Mooncake trace (numbers in :mod:`servetune.workloads.reuse`):

- the sample's arrivals and lengths stay exactly the classes' (or the bootstrap's): the
  model only adds ids, so every other fidelity the sampler has is kept;
- so a later turn must find a session its length fits: a 60k-token prompt cannot re-send
  a 5k-token document. It continues an open session whose context its prompt extends by
  a drawn growth (searched in windows around that target that widen 4x at a time, up to
  the growth's 1-99% range or a quarter of the prompt, whichever is wider), and among
  those the one whose drawn think time ends nearest its arrival;
- which requests are later turns depends on their length (Mooncake: 1-4% of the
  shortest 30% of prompts, up to 913 tokens, and 39-72% of the longer ones: continued
  documents are long), so the shares are per band of prompt length (up to MAX_BANDS
  quantile bands of at least BAND_MIN_REQUESTS requests), weighted by ids (what the
  reuse ratio counts);
- the sampler keeps each band on its share: a request becomes a later turn when the
  band's shortfall so far plus its own expected ids exceeds a uniform draw of its ids,
  and a later turn that finds no session leaves the shortfall to the next request of its
  band (capped at DEBT_REQUESTS requests' worth). Independent draws with request-count
  shares instead put Mooncake samples 1.5-4.5 points low (a few 100k-token prompts
  decide whether a sample hits);
- a cap on turns per session drawn from the trace's turn counts cut the sampled share of
  later turns from 37% to 20% (87% of Mooncake's sessions have one turn, while its long
  documents take most later turns): turns follow from the shares instead;
- a first turn takes a system prompt that leaves it an own-token count within the
  trace's 1-99% range, weighted by popularity: Mooncake's shared prefixes are documents
  (median 61 blocks) with 208-2,469 own tokens after them (1-99%), so the length picks
  the prompt; with short instruction prompts the range admits them all and the
  popularity picks;
- the system prompts are those of the trace's span, with the popularity it showed there:
  a sample longer than the span makes them anew (new ids) for each span-long cycle.
  Kept for good, they would be hit ever more often (a Mooncake sample of 3 spans: 67%
  reuse against the trace's 64%), where a longer trace would have shown new ones.

Sampling is sequential in arrival order with DRAWS uniforms per request from a generator
of its own (seeded by the sample's seed), so it is deterministic, and a shorter sample's
ids are a prefix of a longer one's. ``rate_scale`` s divides think times by s, as it
divides arrival times: a time-compressed sample gets the same sessions. On a block
bootstrap the ids are drawn the same way (nothing of the trace's own ids is kept), so a
block replayed in a later cycle is new traffic with the same lengths, never the same
conversation again.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

import numpy as np

from servetune.schemas.workload import (
    NonNegativeKnots,
    PrefixReuse,
    PrefixSessions,
    QuantileKnots,
    SignedKnots,
    SystemPrompts,
)
from servetune.workloads.reuse import ReuseStats, reuse_stats
from servetune.workloads.trace import Trace

MAX_BANDS = 10
BAND_MIN_REQUESTS = 200
KNOT_GRID = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95,
             0.98, 0.99, 1.0)
RANGE_LOW, RANGE_HIGH = 0.01, 0.99  # a plausible growth / own-token count
WIDEN_FRACTION = 0.25  # a later turn's search reaches this share of its prompt at least
WIDEN_STEPS = 32  # the first window: the growth range / this (at least one block)
DEBT_REQUESTS = 4.0
DRAWS = 5  # uniforms per request: later turn?, think, growth, system prompt?, which one
CHUNK = 4096
# the prefix stream's spawn key: apart from the classes' streams (spawn keys 0..k-1)
STREAM_KEY = 0x70726566


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


def fit_prefix_reuse(trace: Trace, stats: ReuseStats | None = None) -> PrefixReuse | None:
    """The prefix-reuse model of ``trace`` (None when it has no prefix ids)."""
    if (trace.prefix_offsets is None or trace.prefix_block_ids is None
            or len(trace.prefix_block_ids) == 0):
        return None
    s = stats if stats is not None else reuse_stats(trace)
    edges = prompt_bands(trace.prompt_tokens)
    k = len(edges) + 1
    band = np.searchsorted(np.asarray(edges), trace.prompt_tokens, side="left")
    blocks = np.diff(trace.prefix_offsets).astype(np.float64)
    later = s.continues
    first = ~later
    has_prompt = s.system_prompt >= 0
    sessions = None
    if later.any():
        in_band = np.bincount(band, weights=blocks, minlength=k)
        later_ids = np.bincount(band[later], weights=blocks[later], minlength=k)
        share = np.divide(later_ids, in_band, out=np.zeros(k), where=in_band > 0)
        sessions = PrefixSessions(
            continue_share=[round(float(x), 6) for x in share],
            think_time_s=_knots(s.think_time_s(), NonNegativeKnots, 6),
            growth_tokens=_knots(s.growth_tokens(), SignedKnots, 2),
        )
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


def summary(model: PrefixReuse) -> dict[str, object]:
    """The model's headline numbers as plain data (``workload show --json``)."""
    return {
        "block_tokens": model.block_tokens,
        "covers_output": model.covers_output,
        "trace_reuse_ratio": model.trace_reuse_ratio,
        "sessions": model.sessions is not None,
        "system_prompts": (len(model.system_prompts.tokens)
                           if model.system_prompts is not None else 0),
    }


def describe(model: PrefixReuse) -> str:
    """One line: "prefix reuse: 64.0% of the fitted trace's block references repeat ..."."""
    parts = []
    if model.trace_reuse_ratio is not None:
        parts.append(f"{model.trace_reuse_ratio:.1%} of the fitted trace's block references "
                     "repeat an earlier id")
    parts.append("later turns continue sessions" if model.sessions is not None
                 else "no later turns")
    n = len(model.system_prompts.tokens) if model.system_prompts is not None else 0
    parts.append(f"{n} system prompt{'' if n == 1 else 's'}")
    over = "prompt and output" if model.covers_output else "prompt"
    parts.append(f"{model.block_tokens}-token blocks over the {over}")
    return "prefix reuse: " + "; ".join(parts)


# ----------------------------------------------------------------------------- sampling


def _inverse(knots: QuantileKnots, u: np.ndarray) -> np.ndarray:
    return np.interp(u, knots.quantiles, knots.values)


class _Sessions:
    """Open sessions, searchable by context length: per session its context (covered
    tokens of its last turn), ids, last arrival and the end of its drawn think time. A
    session idle longer than ``max_idle_s`` ends."""

    def __init__(self, max_idle_s: float):
        self.by_context: list[tuple[int, int]] = []  # sorted (context tokens, session)
        self.context: list[int] = []
        self.ids: list[np.ndarray] = []
        self.last: list[float] = []
        self.due: list[float] = []
        self.turns: deque[tuple[float, int]] = deque()  # (arrival, session), in order
        self.max_idle_s = max_idle_s

    def _drop(self, sid: int) -> None:
        entry = (self.context[sid], sid)
        del self.by_context[bisect.bisect_left(self.by_context, entry)]

    def expire(self, t: float) -> None:
        """End the sessions idle for more than ``max_idle_s`` at time ``t``."""
        while self.turns and t - self.turns[0][0] > self.max_idle_s:
            last, sid = self.turns.popleft()
            if self.last[sid] == last:  # no later turn since
                self._drop(sid)
                self.last[sid] = -math.inf

    def pick(self, target: float, half_width: float, widest: float, t: float) -> int | None:
        """The session with a context in the first non-empty window around ``target``
        (half-width ``half_width``, 4x per step up to ``widest``) whose think time ends
        nearest ``t``."""
        w = half_width
        while True:
            a = bisect.bisect_left(self.by_context, (math.ceil(target - w), -1))
            z = bisect.bisect_right(self.by_context, (math.floor(target + w), 1 << 62))
            if z > a:
                due = self.due
                return min((sid for _, sid in self.by_context[a:z]),
                           key=lambda sid: abs(due[sid] - t))
            if w >= widest:
                return None
            w = min(4.0 * w, widest)

    def turn(self, sid: int | None, context: int, ids: np.ndarray, t: float,
             think_s: float) -> None:
        """Record a turn: of session ``sid``, or of a new session when None."""
        if sid is None:
            sid = len(self.context)
            self.context.append(0)
            self.ids.append(ids)
            self.last.append(t)
            self.due.append(t)
        else:
            self._drop(sid)
        self.context[sid], self.ids[sid] = context, ids
        self.last[sid], self.due[sid] = t, t + think_s
        bisect.insort(self.by_context, (context, sid))
        self.turns.append((t, sid))


class _SystemPrompts:
    """The model's system prompts sorted by length, their cumulative popularity, and
    their ids (made at first use)."""

    def __init__(self, sp: SystemPrompts, block_tokens: int):
        tokens = np.asarray(sp.tokens, dtype=np.int64)
        self.order = np.argsort(tokens, kind="stable")
        self.tokens = tokens[self.order]
        self.cum = np.cumsum(np.asarray(sp.sessions, dtype=np.float64)[self.order])
        low, high = np.interp([RANGE_LOW, RANGE_HIGH], sp.own_tokens.quantiles,
                              sp.own_tokens.values)
        self.own_low, self.own_high = float(low), float(high)
        self.block_tokens = block_tokens
        self.ids: dict[tuple[int, int], np.ndarray] = {}

    def pick(self, prompt_tokens: int, u: float) -> int | None:
        """A prompt (position in length order) leaving ``prompt_tokens`` an own-token
        count in range, by popularity; None when none fits."""
        a = int(np.searchsorted(self.tokens, prompt_tokens - self.own_high, side="left"))
        z = int(np.searchsorted(self.tokens, min(prompt_tokens - self.own_low, prompt_tokens),
                                side="right"))
        if z <= a:
            return None
        base = self.cum[a - 1] if a > 0 else 0.0
        i = a + int(np.searchsorted(self.cum[a:z] - base, u * (self.cum[z - 1] - base),
                                    side="right"))
        return min(i, z - 1)

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


def _draws(seed: int, n: int) -> np.ndarray:
    """(n, DRAWS) uniforms, CHUNK rows at a time: row j does not depend on n."""
    seq = np.random.SeedSequence(int(seed) & 0xFFFFFFFFFFFFFFFF, spawn_key=(STREAM_KEY,))
    gen = np.random.Generator(np.random.PCG64(seq))
    chunks = -(-n // CHUNK)
    return gen.random((chunks * CHUNK, DRAWS))[:n]


def assign_prefix_ids(
    model: PrefixReuse, arrival_s: np.ndarray, prompt_tokens: np.ndarray,
    output_tokens: np.ndarray, *, seed: int, rate_scale: float = 1.0,
    cycle_s: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(prefix_offsets, prefix_block_ids) for requests in arrival order (see the module
    docstring); ``rate_scale``: the sample's, dividing think times; ``cycle_s``: the
    fitted trace's span (before the rate scale): system prompts get new ids in each
    cycle of that length (None: never)."""
    n = len(arrival_s)
    b = model.block_tokens
    covered = prompt_tokens + (output_tokens if model.covers_output else 0)
    n_ids = -(-covered // b)
    u = _draws(seed, n)
    k = len(model.prompt_band_edges) + 1
    sess = model.sessions
    sessions = None
    later_share, think, growth = [0.0] * k, [0.0] * n, [0.0] * n
    if sess is not None:
        later_share = list(sess.continue_share)
        think = (_inverse(sess.think_time_s, u[:, 1]) / rate_scale).tolist()
        growth = _inverse(sess.growth_tokens, u[:, 2]).tolist()
        g_low, g_high = np.interp([RANGE_LOW, RANGE_HIGH], sess.growth_tokens.quantiles,
                                  sess.growth_tokens.values)
        growth_range = float(g_high - g_low)
        first_width = max(1.0, growth_range / WIDEN_STEPS)
        sessions = _Sessions(sess.think_time_s.values[-1] / rate_scale)
    prompts, prompt_share = None, [0.0] * k
    if model.system_prompts is not None:
        prompts = _SystemPrompts(model.system_prompts, b)
        prompt_share = list(model.system_prompts.share)
    later_debt, prompt_debt = [0.0] * k, [0.0] * k
    fresh = _Fresh()
    out: list[np.ndarray] = []
    rows = zip(arrival_s.tolist(), prompt_tokens.tolist(), covered.tolist(), n_ids.tolist(),
               model.band(prompt_tokens).tolist(), u[:, 0].tolist(), u[:, 3].tolist(),
               u[:, 4].tolist(), think, growth, strict=True)
    for t, p, c, nb, bj, u_later, u_prompt, u_which, think_s, grow in rows:
        shared: np.ndarray | None = None
        sid = None
        if sessions is not None:
            sessions.expire(t)
            debt = min(later_debt[bj] + later_share[bj] * nb, DEBT_REQUESTS * nb)
            if debt > u_later * nb:
                widest = max(growth_range, WIDEN_FRACTION * p, first_width)
                sid = sessions.pick(p - grow, first_width, widest, t)
                if sid is not None:
                    shared = sessions.ids[sid][: min(p, sessions.context[sid]) // b]
                    debt -= nb
            later_debt[bj] = debt
        if shared is None and prompts is not None:
            debt = min(prompt_debt[bj] + prompt_share[bj], DEBT_REQUESTS)
            if debt > u_prompt:
                i = prompts.pick(p, u_which)
                if i is not None:
                    cycle = int(t * rate_scale // cycle_s) if cycle_s else 0
                    shared = prompts.prompt_ids(i, cycle, fresh)[: p // b]
                    debt -= 1.0
            prompt_debt[bj] = debt
        if shared is None or len(shared) == 0:
            ids = fresh.take(nb)
        elif len(shared) >= nb:
            ids = shared[:nb]
        else:
            ids = np.concatenate([shared, fresh.take(nb - len(shared))])
        out.append(ids)
        if sessions is not None:
            sessions.turn(sid, c, ids, t, think_s)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(n_ids, out=offsets[1:])
    flat = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
    return offsets, flat
