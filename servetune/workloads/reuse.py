"""Prefix reuse of a trace from its chain-hash block ids (pure functions, no I/O).

Definitions (``Trace`` holds the ids: block ``m`` of a request names its first
``(m + 1) * B`` tokens, ``B = prefix_block_tokens``):

- **block reuse ratio**: the share of all block references (ids over all requests) that
  repeat an id seen in an earlier request (in arrival order; ids repeated inside one
  request count from their second occurrence). An unbounded prefix cache would hit
  exactly these blocks, so it is the hit-rate ceiling;
- **coverage**: ids cover the prompt (``ceil(prompt / B)`` ids, Mooncake) or the prompt
  and the output (``ceil((prompt + output) / B)``, the ids a session column makes, see
  :mod:`servetune.workloads.sessions`); ``covered_tokens`` is that many tokens;
- **lead**: a request's leading ids that an earlier request already had;
- **sessions**: request ``j`` *continues* an earlier request ``i`` (is its next turn) when
  it shares at least one block and every block of ``i`` but possibly the last (the last
  is partial, so its hash changes as the text grows): ``lcp(i, j) >= max(1, len_i - 1)``.
  Of several such ``i``, the one sharing the most blocks, then the latest. Chains of
  continuations are sessions; a request that continues none starts one (its first turn).
  Per continuation: the think time (arrival minus its parent's arrival) and the prompt
  growth (its prompt tokens minus the parent's covered tokens: the new user text, or
  with prompt-only ids the change in prompt length);
- **system prompts**: leading id runs shared by the first turns of different sessions. A
  first turn's system prompt is its longest leading run of ids that some other first turn
  also has (before or after it); distinct runs (by their last id) are the distinct system
  prompts, each with its length (blocks) and popularity (the sessions whose first turn
  starts with exactly it). A shorter run nested in a longer one is another prompt.

What the Mooncake trace (``../shared/traces/mooncake_synthetic_trace.jsonl.gz``: 3,993
requests, 121,877 references, ids cover the prompt) shows, with these definitions:

- 64.0% of the references repeat an earlier id. Each request is a run of reused ids
  followed by new ones (never new then reused), and the ids form one tree: a chain hash;
- 1,477 requests (37.0%) continue an earlier one: 1,264 share all of its blocks but the
  last (partial) one, 213 are exact repeats (same ids and prompt length). Together they
  make 50.1 of the 64.0 points. 2,516 sessions: 2,194 of one turn, the rest 2-24 turns;
- prompts barely grow between turns (median 0 tokens, 5-95%: -47 to +491): a session
  here is one long document asked again, not a chat whose context grows. The think time
  is long (median 64 s, 5-95%: 2.3 to 446 s);
- continued prompts are long: mean 21.4k tokens against 11.7k for first turns, so the
  share of requests that continue a session rises with the prompt length;
- 443 first turns (17.6%) start with one of 143 system prompts, runs of 1-115 blocks
  (median 61: a shared document rather than an instruction header) used by 2-10
  sessions each (two by one: runs nested in a longer one); after it a first turn has
  208-2,469 own prompt tokens (1-99%). They
  make the other 13.9 points; modelled as independent prompts (no nesting), they would
  make 13.6.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from servetune.errors import ServetuneError
from servetune.workloads.trace import Trace


@dataclass(frozen=True, eq=False)
class ReuseStats:
    """Per-request prefix structure of a trace (arrays in trace order) and its summary."""

    block_tokens: int
    covers_output: bool
    references: int  # block ids over all requests
    repeated: int  # ... that repeat an id of an earlier request
    covered_tokens: np.ndarray  # int64: the tokens a request's ids cover
    lead_blocks: np.ndarray  # int64: leading ids an earlier request had
    parent: np.ndarray  # int64: the request this one continues, -1 for a first turn
    session: np.ndarray  # int64: session index, in order of first turns
    system_prompt: np.ndarray  # int64: first turns: index of its system prompt, else -1
    system_prompt_blocks: np.ndarray  # int64 per distinct system prompt: its length
    system_prompt_sessions: np.ndarray  # int64 per distinct system prompt: its sessions
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray

    @property
    def reuse_ratio(self) -> float:
        """Share of block references that repeat an earlier id (0 without ids)."""
        return self.repeated / self.references if self.references else 0.0

    @property
    def continues(self) -> np.ndarray:
        """Mask of requests that continue a session (later turns)."""
        return self.parent >= 0

    def turns_per_session(self) -> np.ndarray:
        return np.bincount(self.session)

    def think_time_s(self) -> np.ndarray:
        """Arrival gap from the previous turn, per later turn (trace order)."""
        c = self.continues
        return self.arrival_s[c] - self.arrival_s[self.parent[c]]

    def growth_tokens(self) -> np.ndarray:
        """Prompt tokens beyond the previous turn's covered tokens, per later turn."""
        c = self.continues
        return self.prompt_tokens[c] - self.covered_tokens[self.parent[c]]

    def own_tokens(self) -> np.ndarray:
        """Prompt tokens after the system prompt, per first turn that has one."""
        has = self.system_prompt >= 0
        own = (self.prompt_tokens[has]
               - self.system_prompt_blocks[self.system_prompt[has]] * self.block_tokens)
        return np.maximum(own, 0)  # ids that cover more than the prompt (odd traces)

    def summary(self) -> dict[str, float | int]:
        """The headline numbers (plain data, for reports and ``--json``)."""
        n = len(self.parent)
        first = ~self.continues
        turns = self.turns_per_session()
        think = self.think_time_s()
        growth = self.growth_tokens()

        def pct(x: np.ndarray, q: float) -> float:
            return float(np.percentile(x, q)) if len(x) else 0.0

        return {
            "requests": n,
            "block_tokens": self.block_tokens,
            "covers_output": self.covers_output,
            "references": self.references,
            "repeated": self.repeated,
            "reuse_ratio": self.reuse_ratio,
            "continuing_share": float(self.continues.mean()) if n else 0.0,
            "sessions": len(turns),
            "turns_mean": float(turns.mean()) if len(turns) else 0.0,
            "turns_max": int(turns.max()) if len(turns) else 0,
            "think_time_p50_s": pct(think, 50),
            "growth_p50_tokens": pct(growth, 50),
            "system_prompts": len(self.system_prompt_blocks),
            "system_prompt_share": float((self.system_prompt[first] >= 0).mean())
            if first.any() else 0.0,
            "system_prompt_blocks_p50": pct(self.system_prompt_blocks, 50),
        }


# Cache sizes of a hit-rate curve, as shares of the trace's distinct blocks.
CURVE_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def _require_ids(trace: Trace) -> None:
    if trace.prefix_offsets is None or trace.prefix_block_ids is None:
        raise ServetuneError(
            f"{trace.source or 'trace'}: has no prefix block ids (Mooncake hash_ids or a "
            "session column) to measure reuse on")


def stack_distances(trace: Trace) -> np.ndarray:
    """Per block reference, the LRU stack distance (Mattson et al., 1970): how many
    distinct blocks were referenced since the last reference to the same block; -1 for a
    first reference. An LRU cache of ``C`` blocks hits exactly the references whose
    distance is below ``C``.

    References go in arrival order, each request's ids last to first: an engine frees a
    finished request's blocks tail first (vLLM's free-block queue), so a prefix block is
    always at least as recent as the blocks after it, and the LRU hits of a request are
    a prefix of its ids, as a prefix cache's are."""
    _require_ids(trace)
    offsets = trace.prefix_offsets.tolist()
    flat = trace.prefix_block_ids.tolist()
    refs: list[int] = []
    for j in range(len(offsets) - 1):
        refs.extend(reversed(flat[offsets[j]:offsets[j + 1]]))
    n = len(refs)
    # A Fenwick tree over reference times holding 1 at each block's latest reference:
    # the blocks referenced after time p are the markers after p.
    tree = [0] * (n + 1)
    markers = 0
    latest: dict[int, int] = {}
    out = np.full(n, -1, dtype=np.int64)
    for t, block in enumerate(refs):
        p = latest.get(block)
        if p is not None:
            i, upto = p + 1, 0
            while i > 0:
                upto += tree[i]
                i -= i & -i
            out[t] = markers - upto
            i = p + 1
            while i <= n:
                tree[i] -= 1
                i += i & -i
            markers -= 1
        i = t + 1
        while i <= n:
            tree[i] += 1
            i += i & -i
        markers += 1
        latest[block] = t
    return out


def hit_rate_curve(trace: Trace, fractions: tuple[float, ...] = CURVE_FRACTIONS,
                   sizes: tuple[int, ...] = ()) -> dict[str, Any]:
    """The LRU prefix-cache hit rate (share of block references) at cache sizes of
    ``fractions`` of the trace's distinct blocks, then at ``sizes`` blocks
    (:func:`stack_distances`); at a fraction of 1.0 it is the infinite-cache bound, the
    block reuse ratio. Plain data."""
    distances = stack_distances(trace)
    distinct = int((distances < 0).sum())
    refs = len(distances)
    reused = np.sort(distances[distances >= 0])
    points = []
    asked = [(f, max(1, int(round(f * distinct)))) for f in fractions] + [
        (b / distinct if distinct else 0.0, int(b)) for b in sizes]
    for fraction, blocks in asked:
        hits = int(np.searchsorted(reused, blocks, side="left"))
        points.append({"fraction": fraction, "blocks": blocks,
                       "hit_rate": hits / refs if refs else 0.0})
    return {"block_tokens": int(trace.prefix_block_tokens), "references": refs,
            "distinct_blocks": distinct, "bound": len(reused) / refs if refs else 0.0,
            "points": points}


def curve_text(curve: dict[str, Any]) -> str:
    """One line: "LRU prefix-cache hit rate by cache size (share of the 43,924 distinct
    blocks -> share of references hit): 1% -> 3.4%, ..., 100% -> 64.0%"."""
    return (f"LRU prefix-cache hit rate by cache size (share of the "
            f"{curve['distinct_blocks']:,} distinct blocks -> share of references hit): "
            + ", ".join(f"{p['fraction']:.0%} -> {p['hit_rate']:.1%}" for p in curve["points"]))


def pool_blocks(kv_tokens: int, trace: Trace) -> int:
    """A KV pool of ``kv_tokens`` tokens in ``trace``'s prefix blocks (at least one)."""
    return max(1, int(kv_tokens) // int(trace.prefix_block_tokens))


def covers_output(trace: Trace) -> bool:
    """Whether the ids cover prompt and output: every request has ``ceil((prompt +
    output) / B)`` ids and some request has more than its prompt needs."""
    if trace.prefix_offsets is None:
        return False
    b = trace.prefix_block_tokens
    n_ids = np.diff(trace.prefix_offsets)
    total = -(-(trace.prompt_tokens + trace.output_tokens) // b)
    return bool(np.all(n_ids == total) and np.any(n_ids > -(-trace.prompt_tokens // b)))


def reuse_stats(trace: Trace) -> ReuseStats:
    """The prefix structure of ``trace`` (see the module docstring); an error when the
    trace has no prefix ids."""
    _require_ids(trace)
    b = int(trace.prefix_block_tokens)
    if b < 1:
        raise ServetuneError(f"prefix_block_tokens must be >= 1 (got {b})")
    n = len(trace)
    offsets = trace.prefix_offsets
    flat = trace.prefix_block_ids.tolist()
    output_too = covers_output(trace)
    covered = trace.prompt_tokens + (trace.output_tokens if output_too else 0)
    n_ids = np.diff(offsets)
    covered = np.minimum(covered, n_ids * b)
    lead = np.zeros(n, dtype=np.int64)
    parent = np.full(n, -1, dtype=np.int64)
    seen: set[int] = set()
    # id -> (latest request, position) for which it is the last id (``whole``) or the
    # last id but one (``full``: the request's blocks but a partial last one)
    whole: dict[int, tuple[int, int]] = {}
    full: dict[int, tuple[int, int]] = {}
    repeated = 0
    for j in range(n):
        ids = flat[offsets[j]:offsets[j + 1]]
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        lead[j] = k
        # the deepest earlier request whose blocks (but the last) j's leading ids hold
        for m in range(k - 1, -1, -1):
            found = [hit[0] for hit in (whole.get(ids[m]), full.get(ids[m]))
                     if hit is not None and hit[1] == m]
            if found:
                parent[j] = max(found)
                break
        for h in ids:
            if h in seen:
                repeated += 1
            else:
                seen.add(h)
        if ids:
            whole[ids[-1]] = (j, len(ids) - 1)
        if len(ids) >= 2:
            full[ids[-2]] = (j, len(ids) - 2)
    session = np.empty(n, dtype=np.int64)
    first = parent < 0
    session[first] = np.arange(int(first.sum()))
    for j in np.flatnonzero(~first):  # parents come first: one pass resolves chains
        session[j] = session[parent[j]]
    sp, sp_blocks, sp_sessions = _system_prompts(flat, offsets, np.flatnonzero(first), n)
    return ReuseStats(
        block_tokens=b, covers_output=output_too, references=len(flat), repeated=repeated,
        covered_tokens=covered.astype(np.int64), lead_blocks=lead, parent=parent,
        session=session, system_prompt=sp, system_prompt_blocks=sp_blocks,
        system_prompt_sessions=sp_sessions, arrival_s=trace.arrival_s,
        prompt_tokens=trace.prompt_tokens)


def _system_prompts(flat: list[int], offsets: np.ndarray, firsts: np.ndarray,
                    n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(per request: its system prompt or -1, per prompt: blocks, per prompt: sessions)
    from the first turns' leading runs shared with another first turn."""
    uses: dict[int, int] = {}
    for j in firsts:
        for h in set(flat[offsets[j]:offsets[j + 1]]):
            uses[h] = uses.get(h, 0) + 1
    index: dict[int, int] = {}
    blocks: list[int] = []
    sessions: list[int] = []
    sp = np.full(n, -1, dtype=np.int64)
    for j in firsts:
        ids = flat[offsets[j]:offsets[j + 1]]
        k = 0
        while k < len(ids) and uses[ids[k]] >= 2:
            k += 1
        if k == 0:
            continue
        key = ids[k - 1]
        if key not in index:
            index[key] = len(blocks)
            blocks.append(k)
            sessions.append(0)
        sp[j] = index[key]
        sessions[index[key]] += 1
    return sp, np.array(blocks, dtype=np.int64), np.array(sessions, dtype=np.int64)
