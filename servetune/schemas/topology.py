"""Topology: the replicas of a simulated cluster, its router and its KV transfer link.

``servetune simulate --topology FILE`` reads one. Each group of ``replicas`` names a
profile, a policy, an engine, a role and a count; groups may differ (a fleet mixes GPU
types). Either every group serves whole requests (``role: both``), or the cluster is
disaggregated: prefill groups and decode groups, at least one replica of each. Relative
paths resolve against the file's folder. The semantics are in :mod:`servetune.sim.cluster`.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from servetune.engines import ENGINE_NAMES, MAX_REPLICAS
from servetune.routers import ROUTER_NAMES
from servetune.schemas.base import Document, Strict

ROLES: tuple[str, ...] = ("both", "prefill", "decode")
LINK_NAMES: tuple[str, ...] = ("nvlink", "infiniband", "roce")


class ReplicaGroup(Strict):
    profile: str | None = Field(
        None, min_length=1, description="Profile YAML or shipped profile name (default: the "
        "command's --profile)")
    policy: str | None = Field(
        None, min_length=1, description="Policy YAML (default: the command's --policy)")
    engine: Literal[ENGINE_NAMES] = Field(  # type: ignore[valid-type]
        "vllm", description="engine model (decode replicas: vllm)")
    role: Literal[ROLES] = Field(  # type: ignore[valid-type]
        "both", description="both (whole requests), prefill or decode")
    count: int = Field(1, ge=1, le=MAX_REPLICAS, description="replicas in this group")


class Topology(Document):
    KIND: ClassVar[str] = "Topology"
    kind: Literal["Topology"] = "Topology"
    name: str = "cluster"
    router: Literal[ROUTER_NAMES] = Field(  # type: ignore[valid-type]
        "round_robin", description="how each request (and, disaggregated, each decode "
        "hand-over) picks a replica")
    link: Literal[LINK_NAMES] = Field(  # type: ignore[valid-type]
        "infiniband", description="KV transfer link between prefill and decode replicas")
    replicas: list[ReplicaGroup] = Field(min_length=1, description="replica groups")

    @model_validator(mode="after")
    def _roles(self) -> Topology:
        roles = [g.role for g in self.replicas]
        if "both" in roles and len(set(roles)) > 1:
            raise ValueError("replicas: mix of role both with prefill/decode; a cluster is "
                             "either aggregated (every group both) or disaggregated")
        if "both" not in roles and {"prefill", "decode"} - set(roles):
            raise ValueError("replicas: a disaggregated cluster needs prefill and decode groups")
        total = sum(g.count for g in self.replicas)
        if total > MAX_REPLICAS:
            raise ValueError(f"replicas: {total} in all; at most {MAX_REPLICAS}")
        return self
