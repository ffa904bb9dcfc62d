"""Validated documents: every YAML file servetune reads or writes."""

from servetune.schemas.base import (
    API_VERSION,
    Document,
    Strict,
    document_from_data,
    dump_yaml,
    load_document,
    save_document,
)
from servetune.schemas.gateway import GatewayRules
from servetune.schemas.policy import Admission, Batching, ClassPolicy, LongRequests, Policy
from servetune.schemas.slo import ClassSLO, SLOSet
from servetune.schemas.space import SearchSpace, apply_knobs, knob_paths

__all__ = [
    "API_VERSION",
    "Admission",
    "Batching",
    "ClassPolicy",
    "ClassSLO",
    "Document",
    "GatewayRules",
    "LongRequests",
    "Policy",
    "SLOSet",
    "SearchSpace",
    "Strict",
    "apply_knobs",
    "document_from_data",
    "dump_yaml",
    "knob_paths",
    "load_document",
    "save_document",
]
