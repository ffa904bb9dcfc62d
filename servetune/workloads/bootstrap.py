"""A window-stratified block bootstrap of a trace's request sequence (the non-parametric
arrival model of :mod:`servetune.workloads.fitting`, which decides when to use it).

Fitting (``fit_block_bootstrap``): the trace's span is cut into blocks of ``block_s``
seconds from its first arrival (the last block keeps what is left), and consecutive groups
of ``stratum_s / block_s`` blocks form the strata (the slow windows). Each request is
stored with its block (as per-block counts), its offset in the block, its class and its
two lengths. Traces over ``MAX_BOOTSTRAP_REQUESTS`` requests keep a systematic sample of
whole strata (every k-th, the smallest k that fits), with all times multiplied by one
factor so that the kept requests arrive at the whole trace's mean rate.

Sampling (``sample_blocks``): cycle c (``span_s`` seconds) lays out the strata in order
and, within each, its blocks in the order of keys drawn from a generator seeded by (seed,
c); each block takes its own length, its requests at their offsets. Whole cycles follow
each other, so a sample of whole cycles is a prefix of a longer one. A sample that ends
inside a cycle takes that cycle's blocks from every stratum, never the first strata only:
block ``b``, ``r``-th in its stratum's order of ``k`` blocks, ranks at ``(r + 1/2) / k``,
and the part cycle is the lowest-ranked blocks (ties: the earlier stratum), as many as
the requests still wanted need (the last of them keeps its first requests only) or as the
time left holds, laid out as a whole cycle is. So a quarter of a cycle is about a quarter
of each stratum, at the slow windows' own rates, and sees the whole trace's mix.
``rate_scale`` s divides all times by s.
"""

from __future__ import annotations

import math

import numpy as np

from servetune.schemas.workload import BlockBootstrap
from servetune.workloads.trace import Trace

BLOCK_S = 60.0
MAX_BOOTSTRAP_REQUESTS = 200_000
OFFSET_DECIMALS = 6  # microseconds: traces carry milliseconds at most


def blocks_per_stratum(window_s: float, block_s: float) -> int:
    """Whole blocks of ``block_s`` nearest to a window of ``window_s`` seconds."""
    return int(math.floor(window_s / block_s + 0.5))


def fit_block_bootstrap(
    trace: Trace, class_index: np.ndarray | None, block_s: float, stratum_s: float,
    max_requests: int = MAX_BOOTSTRAP_REQUESTS, later_turn: np.ndarray | None = None,
) -> BlockBootstrap | None:
    """The bootstrap section for ``trace`` (``class_index``: each request's class, or
    None for one class; ``later_turn``: a mask of the requests that are later turns of a
    session, or None); None when even one stratum holds more than ``max_requests``."""
    t = np.asarray(trace.arrival_s, dtype=np.float64)
    t = t - t[0]
    span = round(float(t[-1]), OFFSET_DECIMALS)
    nb = max(1, math.ceil(span / block_s))
    block = np.minimum((t // block_s).astype(np.int64), nb - 1)
    per = blocks_per_stratum(stratum_s, block_s)
    stratum = block // per
    lengths = np.full(nb, float(block_s))
    lengths[-1] = span - (nb - 1) * block_s
    keep_block = np.ones(nb, dtype=bool)
    factor = 1.0
    if len(t) > max_requests:
        n_strata = int(stratum[-1]) + 1
        in_stratum = np.bincount(stratum, minlength=n_strata)
        for k in range(2, n_strata + 1):
            if in_stratum[::k].sum() <= max_requests:
                break
        else:
            return None
        keep_block = (np.arange(nb) // per) % k == 0
        kept = keep_block[block]
        # the kept requests arrive at the whole trace's mean rate (n / span)
        factor = (kept.sum() / lengths[keep_block].sum()) / (len(t) / span)
        t, block = t[kept], block[kept]
        class_index = None if class_index is None else class_index[kept]
        later_turn = None if later_turn is None else later_turn[kept]
        prompt, output = trace.prompt_tokens[kept], trace.output_tokens[kept]
    else:
        prompt, output = trace.prompt_tokens, trace.output_tokens
    offset = np.clip(t - block * block_s, 0.0, lengths[block])
    renumber = np.cumsum(keep_block) - 1  # kept blocks, in order
    counts = np.bincount(renumber[block], minlength=int(keep_block.sum()))
    return BlockBootstrap(
        block_s=float(block_s) * factor,
        stratum_s=float(block_s) * factor * per,
        span_s=round(float(lengths[keep_block].sum()) * factor, OFFSET_DECIMALS),
        block_counts=[int(c) for c in counts],
        offset_s=[float(x) for x in np.round(offset * factor, OFFSET_DECIMALS)],
        class_index=None if class_index is None else [int(c) for c in class_index],
        prompt_tokens=[int(x) for x in prompt],
        output_tokens=[int(x) for x in output],
        later_turns=(None if later_turn is None or not later_turn.any()
                     else [int(i) for i in np.flatnonzero(later_turn)]),
    )


def sample_blocks(
    boot: BlockBootstrap, *, seed: int, n_requests: int | None, horizon_s: float,
    rate_scale: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(arrival seconds, class index, prompt, output, later-turn mask) of the first
    ``n_requests`` (None: all) arrivals at or before ``horizon_s`` (inf: none), in time
    order: whole cycles, then a part cycle from every stratum (module docstring)."""
    n = boot.n_requests
    span = boot.span_s / rate_scale
    whole = math.inf if n_requests is None else n_requests // n
    if math.isfinite(horizon_s):
        whole = min(whole, math.floor(horizon_s / span))
    whole = int(whole)
    lengths = boot.block_lengths()
    nb = len(lengths)
    per = boot.blocks_per_stratum
    stratum = np.arange(nb) // per
    in_stratum = np.bincount(stratum)
    block = np.repeat(np.arange(nb), boot.block_counts)
    counts = np.asarray(boot.block_counts, dtype=np.int64)
    offset = np.minimum(np.asarray(boot.offset_s, dtype=np.float64), lengths[block])
    cls = (np.zeros(n, dtype=np.int32) if boot.class_index is None
           else np.asarray(boot.class_index, dtype=np.int32))
    prompt = np.asarray(boot.prompt_tokens, dtype=np.int64)
    output = np.asarray(boot.output_tokens, dtype=np.int64)
    later = np.zeros(n, dtype=bool)
    if boot.later_turns:
        later[boot.later_turns] = True
    seed64 = int(seed) & 0xFFFFFFFFFFFFFFFF
    times, rows = [], []
    for c in range(whole + 1):
        gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed64, c])))
        order = np.lexsort((gen.random(nb), stratum))  # strata in order, blocks shuffled
        take = np.ones(nb, dtype=bool)
        if c == whole:  # the part cycle: the lowest-ranked blocks of every stratum
            rank = np.empty(nb)
            rank[order] = np.arange(nb) - np.repeat(np.cumsum(in_stratum) - in_stratum,
                                                    in_stratum)
            by_rank = np.lexsort((stratum, (rank + 0.5) / in_stratum[stratum]))
            m, spare = nb, 0  # blocks taken; requests to drop from the last one
            if n_requests is not None:
                wanted = n_requests - whole * n
                held = np.cumsum(counts[by_rank])
                m = min(m, int(np.searchsorted(held, wanted)) + 1 if wanted > 0 else 0)
                spare = int(held[m - 1] - wanted) if 0 < m and wanted <= held[-1] else 0
            if math.isfinite(horizon_s):
                left = (horizon_s - whole * span) * rate_scale
                fits = np.cumsum(lengths[by_rank]) <= left * (1 + 1e-12)
                if int(fits.sum()) < m:
                    m, spare = int(fits.sum()), 0
            take[:] = False
            take[by_rank[:m]] = True
            order = order[take[order]]
        start = np.zeros(nb)
        start[order] = np.concatenate([[0.0], np.cumsum(lengths[order])[:-1]])
        rows_c = np.flatnonzero(take[block])
        if c == whole and spare:  # the last-ranked block keeps its first requests only
            is_last = block[rows_c] == by_rank[m - 1]
            kept = np.cumsum(is_last) <= counts[by_rank[m - 1]] - spare
            rows_c = rows_c[~is_last | kept]
        t = (c * boot.span_s + start[block[rows_c]] + offset[rows_c]) / rate_scale
        within = np.argsort(t, kind="stable")
        times.append(t[within])
        rows.append(rows_c[within])
    t = np.concatenate(times)
    row = np.concatenate(rows)
    keep = np.flatnonzero(t <= horizon_s)
    if n_requests is not None:
        keep = keep[:n_requests]
    t, row = t[keep], row[keep]
    return t, cls[row], prompt[row], output[row], later[row]


def describe(boot: BlockBootstrap) -> str:
    """One line: "block bootstrap: 58 blocks of 60 s in 12 strata"."""
    nb = len(boot.block_counts)
    return (f"block bootstrap: {nb} blocks of {boot.block_s:.3g} s in {boot.n_strata} "
            f"strat{'a' if boot.n_strata > 1 else 'um'}")
