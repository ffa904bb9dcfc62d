"""The in-memory request trace: flat, columnar numpy arrays (no Python object per row).

Arrivals are seconds from the first request, sorted; requests with equal arrival times
keep their file order (stable sort). Optional columns: a class label per request (an
index into ``class_names``), a priority (lower is served first), a ``max_tokens`` cap,
and prefix block ids for prefix reuse, stored as CSR (``prefix_offsets`` of length n+1
into the flat ``prefix_block_ids``). Block ``m`` of a request's ids covers its tokens
``[m * B, (m + 1) * B)`` with ``B = prefix_block_tokens`` (512 in the Mooncake traces), and
an id names the whole prefix up to the end of its block (a chain hash): two requests
whose ``m``-th ids are equal share their first ``(m + 1) * B`` tokens. Ids may cover the
prompt only (Mooncake) or the prompt and the output (a session's next turn re-sends both).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from servetune.errors import ServetuneError


@dataclass(frozen=True, eq=False)
class Trace:
    arrival_s: np.ndarray  # float64, sorted ascending, arrival_s[0] == 0
    prompt_tokens: np.ndarray  # int64 >= 1
    output_tokens: np.ndarray  # int64 >= 1
    class_id: np.ndarray | None = None  # int32 index into class_names
    class_names: tuple[str, ...] = ("default",)
    priority: np.ndarray | None = None  # int32, lower value served first
    max_tokens: np.ndarray | None = None  # int64, the request's declared output cap
    prefix_offsets: np.ndarray | None = None  # int64, len n+1 (CSR)
    prefix_block_ids: np.ndarray | None = None  # int64 flat
    prefix_block_tokens: int = 512  # tokens per prefix block id
    source: str = ""
    notices: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        for name in ("prompt_tokens", "output_tokens", "class_id", "priority", "max_tokens"):
            col = getattr(self, name)
            if col is not None and len(col) != n:
                raise ValueError(f"Trace.{name} has {len(col)} rows, arrival_s has {n}")
        if self.prefix_offsets is not None and len(self.prefix_offsets) != n + 1:
            raise ValueError("Trace.prefix_offsets must have n+1 entries")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) > 1 else 0.0

    def class_ids(self) -> np.ndarray:
        """Class index per request (all zeros when the trace has no class column)."""
        if self.class_id is None:
            return np.zeros(len(self), dtype=np.int32)
        return self.class_id

    def priorities(self) -> np.ndarray:
        if self.priority is None:
            return np.zeros(len(self), dtype=np.int32)
        return self.priority

    def take(self, index: np.ndarray | slice) -> Trace:
        """A sub-trace of the selected rows (order kept), arrivals re-based to 0."""
        idx = np.arange(len(self))[index] if isinstance(index, slice) else np.asarray(index)
        arrival = self.arrival_s[idx]
        if len(arrival):
            arrival = arrival - arrival[0]
        offsets = ids = None
        if self.prefix_offsets is not None and self.prefix_block_ids is not None:
            lengths = (self.prefix_offsets[1:] - self.prefix_offsets[:-1])[idx]
            offsets = np.zeros(len(idx) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            ids = (
                np.concatenate(
                    [self.prefix_block_ids[self.prefix_offsets[i] : self.prefix_offsets[i + 1]]
                     for i in idx]
                )
                if len(idx)
                else np.zeros(0, dtype=np.int64)
            )

        def sel(col: np.ndarray | None) -> np.ndarray | None:
            return None if col is None else col[idx]

        return Trace(
            arrival_s=arrival,
            prompt_tokens=self.prompt_tokens[idx],
            output_tokens=self.output_tokens[idx],
            class_id=sel(self.class_id),
            class_names=self.class_names,
            priority=sel(self.priority),
            max_tokens=sel(self.max_tokens),
            prefix_offsets=offsets,
            prefix_block_ids=ids,
            prefix_block_tokens=self.prefix_block_tokens,
            source=self.source,
            notices=self.notices,
        )

    def head(self, n: int) -> Trace:
        """The first ``n`` requests."""
        if n < 1:
            raise ServetuneError(f"argument `n` must be >= 1 (got {n})")
        return self.take(slice(0, min(n, len(self))))

    def rate_scaled(self, rate_scale: float) -> Trace:
        """Time-compressed replay: arrivals divided by ``rate_scale`` (2.0 = twice the rate)."""
        if not rate_scale > 0:
            raise ServetuneError(f"rate scale must be > 0 (got {rate_scale})")
        return Trace(
            arrival_s=self.arrival_s / rate_scale,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            class_id=self.class_id,
            class_names=self.class_names,
            priority=self.priority,
            max_tokens=self.max_tokens,
            prefix_offsets=self.prefix_offsets,
            prefix_block_ids=self.prefix_block_ids,
            prefix_block_tokens=self.prefix_block_tokens,
            source=self.source,
            notices=self.notices,
        )


def from_arrays(
    arrival_s: np.ndarray,
    prompt_tokens: np.ndarray,
    output_tokens: np.ndarray,
    **optional: object,
) -> Trace:
    """Build a Trace from unsorted columns: stable-sort by arrival, re-base to 0,
    and check that lengths are positive. Optional columns are passed by name."""
    arrival = np.asarray(arrival_s, dtype=np.float64)
    prompt = np.asarray(prompt_tokens, dtype=np.int64)
    output = np.asarray(output_tokens, dtype=np.int64)
    if len(arrival) == 0:
        raise ServetuneError("trace has no requests")
    if not np.all(np.isfinite(arrival)):
        raise ServetuneError("trace has a non-finite arrival time")
    if (prompt < 1).any() or (output < 1).any():
        raise ServetuneError("trace has a request with fewer than 1 prompt or output token")
    order = np.argsort(arrival, kind="stable")
    sorted_already = bool(np.all(order == np.arange(len(order))))
    trace = Trace(
        arrival_s=arrival - arrival.min(),
        prompt_tokens=prompt,
        output_tokens=output,
        **optional,  # type: ignore[arg-type]
    )
    return trace if sorted_already else trace.take(order)
