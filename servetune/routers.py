"""The routers a cluster simulation puts in front of its replicas: one row each, the one
list of them.

Every router name list in the code (the topology schema's ``router``, the simulator's
check, the CLI's ``--router`` help, ``plan``'s router of disaggregated units) is
:data:`ROUTER_NAMES` or read from :data:`ROUTERS`. A row holds:

- ``reads_replicas``: whether the router reads every replica's state at each arrival. One
  that does advances every replica to each arrival in one compiled loop over a tuple of
  replicas (:func:`servetune.sim._kernel.pick_replica`), at most MAX_ROUTED_REPLICAS of
  them; one that does not lets each replica run on its own, in one pass;
- ``kernel_code``: the integer the kernel's ``pick_replica`` knows it by (the ``ROUTE_*``
  constants of :mod:`servetune.sim._kernel` read this table); None for a router that reads
  no state;
- ``rule``: how it picks, one line (the CLI's help and the cluster module's docstring).

Ties go to the lowest replica index. This module imports nothing heavy: the CLI reads it
at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from servetune.errors import ServetuneError

# Replicas behind a router that reads their state at every arrival. The compiled loop
# takes the replicas as a tuple, and numba compiles it once per replica count, in time and
# memory that grow fast with the count (measured on 2 cores: 12 s for 4, 29 s for 8, about
# 2 minutes for 16; 64 ran past 10 minutes and 4.9 GB). Routers that read no state run each
# replica on its own, to engines.MAX_REPLICAS.
MAX_ROUTED_REPLICAS = 16


@dataclass(frozen=True)
class Router:
    """One router (module docstring)."""

    name: str
    reads_replicas: bool
    kernel_code: int | None
    rule: str


ROUTERS: tuple[Router, ...] = (
    Router("round_robin", False, None, "the i-th request to replica i mod N"),
    Router("least_loaded", True, 0, "the fewest waiting + running requests"),
    Router("least_kv", True, 1, "the least KV committed (blocks in use plus the blocks of "
           "queued prompts) as a share of the replica's pool"),
    Router("prefix_aware", True, 2, "the lowest cost: prompt blocks not cached there plus "
           "blocks committed there (Dynamo's KV router, weight 1 on the prefill term)"),
    Router("session", False, None, "by the request's first prefix id, id mod N (requests "
           "that start alike go to the same replica; none: round robin)"),
)
ROUTER_NAMES: tuple[str, ...] = tuple(r.name for r in ROUTERS)
BY_NAME: dict[str, Router] = {r.name: r for r in ROUTERS}


def router(name: str) -> Router:
    """The row of router ``name``; an error naming the routers when it is unknown."""
    if name not in BY_NAME:
        raise ServetuneError(f"router {name!r} is unknown; choose one of "
                             f"{', '.join(ROUTER_NAMES)}")
    return BY_NAME[name]


def kernel_code(name: str) -> int:
    """The kernel's code of a router that reads the replicas (``ROUTE_*``)."""
    code = BY_NAME[name].kernel_code
    assert code is not None, f"{name} reads no replica state"
    return code
