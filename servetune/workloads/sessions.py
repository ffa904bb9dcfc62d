"""Prefix block ids from a session column (traces without hashes that say which
requests are turns of one conversation).

The rule: the rows of one session, in arrival order (file order for equal times), are its
turns. Turn ``k``'s covered text is its prompt followed by its output, ``P_k + O_k``
tokens, and its prompt starts with the previous turn's covered text: it shares its first
``min(P_k, P_{k-1} + O_{k-1})`` tokens with turn ``k - 1`` (a prompt shorter than that
context, e.g. history cut by the client, shares only its own length's worth, from the
start). Ids are chain ids of ``SESSION_BLOCK_TOKENS`` tokens over each turn's prompt and
output: block ``m`` of turn ``k`` has turn ``k - 1``'s ``m``-th id when the shared part
covers the whole block, else a new id. So the next turn's shared blocks have equal ids,
and a partial last block, or one the prompt does not wholly repeat, gets a new one. New
ids are numbered 0, 1, ... in the order of (arrival, block): a trace's first request has
ids 0..n-1.

Why 16 tokens: vLLM's default KV block, so a simulated vLLM cache sees the sharing to the
token block (a larger engine block is a multiple of it); the ids cost 8 bytes per 16
tokens of prompt and output.
"""

from __future__ import annotations

import numpy as np

SESSION_BLOCK_TOKENS = 16


def session_prefix_ids(
    session: np.ndarray, arrival_s: np.ndarray, prompt_tokens: np.ndarray,
    output_tokens: np.ndarray, block_tokens: int = SESSION_BLOCK_TOKENS,
) -> tuple[np.ndarray, np.ndarray]:
    """(prefix_offsets, prefix_block_ids) in the rows' own order, by the rule above;
    ``session``: an integer code per row (equal codes, one session)."""
    n = len(session)
    b = int(block_tokens)
    prompt = np.asarray(prompt_tokens, dtype=np.int64)
    covered = prompt + np.asarray(output_tokens, dtype=np.int64)
    n_ids = -(-covered // b)
    by_arrival = np.argsort(arrival_s, kind="stable")
    rank = np.empty(n, dtype=np.int64)
    rank[by_arrival] = np.arange(n)
    # session order: by session, then arrival (file order for ties, as ``rank`` has it)
    order = np.lexsort((rank, session))
    same = np.zeros(n, dtype=bool)
    same[1:] = session[order][1:] == session[order][:-1]
    shared = np.zeros(n, dtype=np.int64)
    prev_covered = np.concatenate([[0], covered[order][:-1]])
    shared[same] = np.minimum(prompt[order][same], prev_covered[same]) // b
    # flat layout in session order; each inherited position points at the same block
    # of the previous turn, resolved to its first holder by pointer jumping
    counts = n_ids[order]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    total = int(offsets[-1])
    row = np.repeat(np.arange(n), counts)
    pos = np.arange(total, dtype=np.int64)
    m = pos - offsets[row]
    inherited = m < shared[row]
    ptr = np.where(inherited, offsets[np.maximum(row - 1, 0)] + m, pos)
    while True:
        nxt = ptr[ptr]
        if np.array_equal(nxt, ptr):
            break
        ptr = nxt
    fresh = np.flatnonzero(~inherited)
    number = np.empty(total, dtype=np.int64)
    number[fresh[np.lexsort((m[fresh], rank[order][row[fresh]]))]] = np.arange(len(fresh))
    ids_session_order = number[ptr]
    # back to the rows' own order
    where = np.empty(n, dtype=np.int64)
    where[order] = np.arange(n)
    own_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(n_ids, out=own_offsets[1:])
    own_row = np.repeat(np.arange(n), n_ids)
    src = offsets[where[own_row]] + (np.arange(total) - own_offsets[own_row])
    return own_offsets, ids_session_order[src]
