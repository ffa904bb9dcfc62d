"""Search space: policy field paths mapped to the candidate values to try.

``knobs: {batching.max_num_seqs: [64, 128, 256], long_requests.max_seqs: [2, 4]}``.
A bare field name that is unique across the policy sections (``max_num_seqs``) is
accepted and normalised to its dotted path. Every value is validated against the
policy field it sets, so a space can only produce well-typed policies.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator

from servetune.schemas.base import Document
from servetune.schemas.policy import SECTIONS as _SECTIONS
from servetune.schemas.policy import Policy


def knob_paths() -> list[str]:
    """Every dotted path a search space may name."""
    paths = ["scheduling"]
    for section, model in _SECTIONS.items():
        paths += [f"{section}.{name}" for name in model.model_fields]
    return paths


def normalise_path(path: str) -> str:
    """``max_num_seqs`` -> ``batching.max_num_seqs``; dotted paths are checked."""
    paths = knob_paths()
    if path in paths:
        return path
    matches = [p for p in paths if p.split(".")[-1] == path]
    if len(matches) == 1:
        return matches[0]
    raise ValueError(f"unknown policy knob {path!r}; allowed: {', '.join(paths)}")


def _field_adapter(path: str) -> TypeAdapter:
    """A validator for one knob's values: the policy field's type and constraints."""
    if path == "scheduling":
        return TypeAdapter(Policy.model_fields["scheduling"].annotation)
    section, name = path.split(".")
    field = _SECTIONS[section].model_fields[name]
    if not field.metadata:  # Annotated needs at least one annotation (a bare bool field)
        return TypeAdapter(field.annotation)
    return TypeAdapter(Annotated[field.annotation, *field.metadata])


def apply_knobs(base: Policy, values: dict[str, Any]) -> Policy:
    """A copy of ``base`` with the dotted-path ``values`` set, validated as a whole."""
    data = base.model_dump()
    for path, value in values.items():
        parts = normalise_path(path).split(".")
        target = data
        for part in parts[:-1]:
            target = target[part]
        target[parts[-1]] = value
    return Policy.model_validate(data)


# A search space is a grid every method enumerates (the MILP has a binary per point), so
# its size is bounded: the default space has 1,332 points.
MAX_VALUES_PER_KNOB = 1_000
MAX_SPACE_POINTS = 100_000


class SearchSpace(Document):
    KIND: ClassVar[str] = "SearchSpace"
    kind: Literal["SearchSpace"] = "SearchSpace"
    name: str = "space"
    knobs: dict[str, list[Any]] = Field(min_length=1)

    @field_validator("knobs")
    @classmethod
    def _check_knobs(cls, knobs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for raw, values in knobs.items():
            path = normalise_path(raw)
            if path in out:
                raise ValueError(f"knob {path!r} is given twice")
            if not values:
                raise ValueError(f"knob {path!r}: list at least one value")
            if len(values) > MAX_VALUES_PER_KNOB:
                raise ValueError(
                    f"knob {path!r}: {len(values):,} values; at most {MAX_VALUES_PER_KNOB:,} "
                    "(the space is a grid every method enumerates)")
            adapter = _field_adapter(path)
            for value in values:
                try:
                    adapter.validate_python(value, strict=True)
                except ValidationError as exc:
                    reason = exc.errors(include_url=False)[0]["msg"]
                    raise ValueError(
                        f"knob {path!r}: value {value!r} is not allowed: {reason}"
                    ) from None
            if len(set(map(repr, values))) != len(values):
                raise ValueError(f"knob {path!r}: values repeat")
            out[path] = list(values)
        return out

    @model_validator(mode="after")
    def _bounded(self) -> SearchSpace:
        if self.size() > MAX_SPACE_POINTS:
            raise ValueError(
                f"{self.size():,} combinations of knob values; at most {MAX_SPACE_POINTS:,} "
                "(the space is a grid every method enumerates): list fewer values")
        return self

    def size(self) -> int:
        return math.prod(len(values) for values in self.knobs.values())

    def points(self) -> Iterator[dict[str, Any]]:
        """Every combination, in a fixed order (last knob varies fastest)."""
        names = list(self.knobs)
        for combo in itertools.product(*(self.knobs[n] for n in names)):
            yield dict(zip(names, combo, strict=True))

    def policies(self, base: Policy) -> Iterator[tuple[dict[str, Any], Policy | None]]:
        """Each point with its policy, or None where the combination is inconsistent
        (e.g. ``max_num_batched_tokens < max_num_seqs``)."""
        for point in self.points():
            try:
                yield point, apply_knobs(base, point)
            except ValueError:
                yield point, None
