"""How long a simulated run must last before its verdict on a rate can be trusted.

A run starts with an empty engine. A fixed number of requests spans less and less time as
the rate grows, and a short burst never fills the KV cache nor lets the queue grow past
the TTFT target: it "meets" the SLOs at rates the replica cannot sustain, and overstates
capacity several times over (500 requests of the Azure conversation bucket
p0-1024/o256-inf pass on one H100 at 112 req/s because they arrive in 4 s; runs of 200 s
and more settle at 26-27 req/s). So every run that judges a rate must cover a window of
arrivals, and :func:`steady_window_s` is the one rule for how long:

    window = min(cap_s, max(floor_s, ttft_multiple * max TTFT target / rate_tolerance))

- ``rate_tolerance``: an overload by this share of the rate builds a backlog of about
  ``rate_tolerance * window`` seconds of extra wait; only once that reaches the TTFT
  target can a run tell a sustainable rate from one ``rate_tolerance`` too high (the
  goodput search's tolerance: 67 s for a 2 s target at 3%);
- ``ttft_multiple``: how many TTFT targets of backlog that takes (1: as soon as the
  target is missed; more for a margin);
- ``floor_s``: a fixed minimum, for runs with no TTFT target and for callers whose runs
  must last longer whatever the target (capacity measurement, background placement);
- ``cap_s``: the most a caller can afford to simulate per run.

Callers differ only in these arguments; what a window costs in requests depends on how
the caller builds its sample (:func:`arrivals_in`).
"""

from __future__ import annotations

import math

from servetune.schemas.slo import SLOSet

# The longest trace a run lengthened to its window uses (the simulation's cost bound).
MAX_WINDOW_REQUESTS = 20000


def steady_window_s(
    slo: SLOSet | None = None,
    *,
    floor_s: float = 0.0,
    ttft_multiple: float = 1.0,
    rate_tolerance: float = 1.0,
    cap_s: float = math.inf,
) -> float:
    """The seconds of arrivals a run must span (module docstring); the TTFT term counts
    only with an SLO that sets a TTFT target and a positive ``rate_tolerance``."""
    ttfts = [] if slo is None else [c.ttft_s for c in slo.classes.values()
                                    if c.ttft_s is not None]
    window = floor_s
    if ttfts and rate_tolerance > 0:
        window = max(floor_s, ttft_multiple * max(ttfts) / rate_tolerance)
    return min(window, cap_s)


def arrivals_in(rate_per_s: float, window_s: float) -> int:
    """How many arrivals at ``rate_per_s`` a window of ``window_s`` seconds holds
    (rounded up)."""
    return int(math.ceil(rate_per_s * window_s))
