"""SLO tiers on a trace: classes by prompt length, and whether an SLO set can judge a trace.

An SLO set's classes reach a trace in one of three ways: the trace's own class column (a
tenant, endpoint or priority column mapped to ``class``, or the ``class`` column of an
Azure-format CSV), a workload's class list (a sample's classes are the workload's), or the
set's ``length_bands``, which :func:`classify` applies to a trace, overriding its labels.
:func:`check_fits` then says, in one error, which classes of the trace the set has no
entry for.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from servetune.errors import ServetuneError
from servetune.schemas.slo import SLOSet
from servetune.workloads.trace import Trace


def classify(trace: Trace, slo: SLOSet) -> Trace:
    """``trace`` with each request in the class of its prompt's length band of ``slo``
    (``class_names``: the bands' classes in band order); ``trace`` itself when the set has
    no bands. Band ``i`` takes prompts of more than band ``i-1``'s ``max_prompt_tokens``
    and at most its own."""
    if slo.length_bands is None:
        return trace
    names = slo.band_classes()
    band_class = np.array([names.index(b.class_name) for b in slo.length_bands], dtype=np.int32)
    edges = np.array([b.max_prompt_tokens for b in slo.length_bands[:-1]], dtype=np.int64)
    # side="left": a prompt equal to a band's maximum stays in that band
    band = np.searchsorted(edges, np.asarray(trace.prompt_tokens, dtype=np.int64), side="left")
    return replace(trace, class_id=band_class[band], class_names=names)


def unjudged_classes(trace: Trace, slo: SLOSet) -> dict[str, int]:
    """The classes of ``trace`` that ``slo`` has no entry for (and no ``default``, and more
    than one class, to fall back on), with their request counts, in the trace's order."""
    counts = np.bincount(trace.class_ids(), minlength=len(trace.class_names))
    out = {}
    for cid, name in enumerate(trace.class_names):
        try:
            slo.for_class(name)
        except KeyError:
            out[name] = int(counts[cid])
    return out


def check_fits(trace: Trace, slo: SLOSet, slo_file: str = "") -> None:
    """Raise one ServetuneError naming every class of ``trace`` that ``slo`` cannot judge,
    the trace's file and the SLO set's (``slo_file``, when known); nothing when it fits."""
    missing = unjudged_classes(trace, slo)
    if not missing:
        return
    listed = ", ".join(f"{name!r} ({n:,} requests)" for name, n in missing.items())
    where = trace.source or "the trace"
    slo_name = f"{slo_file} ({slo.name!r})" if slo_file else repr(slo.name)
    plural = "es" if len(missing) > 1 else ""
    raise ServetuneError(
        f"{where}: request class{plural} {listed} not in SLO set {slo_name}, which has "
        f"{', '.join(slo.classes)}; add {'them' if plural else 'it'} or a 'default' class "
        "to the set, or give the set length_bands"
    )
