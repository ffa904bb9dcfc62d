"""Base of every servetune document: strict pydantic models, YAML load/save.

Every file servetune reads or writes carries ``apiVersion: servetune/v1`` and a
``kind``. Models forbid unknown keys; a validation failure becomes one
:class:`~servetune.errors.ServetuneError` line naming the file, the field path and
what is allowed. Saving is atomic (temporary file, then rename) and deterministic
(fields in declaration order, no Python-specific tags), so ``load(save(x)) == x`` and
the same object always gives the same bytes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from servetune.errors import ServetuneError
from servetune.io import decode_text, plain_data, read_bytes, write_text_atomic

API_VERSION = "servetune/v1"


class Strict(BaseModel):
    """A nested section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class Document(Strict):
    """A top-level file. Subclasses set ``kind`` to a ``Literal`` of their own name."""

    KIND: ClassVar[str] = ""
    # Optional sections a file leaves out while they are empty (see document_data).
    OMIT_WHEN_EMPTY: ClassVar[tuple[str, ...]] = ()
    apiVersion: Literal["servetune/v1"] = API_VERSION
    kind: str


D = TypeVar("D", bound=Document)


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line: ``source: field.path: what is wrong (allowed: ...)`` for the first error,
    with a count of the others."""
    errors = err.errors(include_url=False)
    first = errors[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "__root__") or "(document)"
    msg = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        msg = "unknown key; remove it or check its spelling"
    elif first.get("type") == "missing":
        msg = "required field is missing"
    elif first.get("type") == "value_error":
        msg = msg.removeprefix("Value error, ")  # pydantic's prefix says nothing to a user
    value = first.get("input")
    shown = ""
    if first.get("type") not in ("missing", "extra_forbidden") and not isinstance(
        value, dict | list
    ):
        shown = f" (got {value!r})"
    more = f" [+{len(errors) - 1} more]" if len(errors) > 1 else ""
    if loc == "(document)" and first.get("type") == "value_error":
        return f"{source}: {msg}{more}"  # a whole-document check names its fields itself
    return f"{source}: {loc}: {msg}{shown}{more}"


def _read_yaml(path: Path) -> Any:
    text = decode_text(read_bytes(path, "YAML"), path, "YAML")
    return parse_yaml_text(text, str(path))


def parse_yaml_text(text: str, source: str) -> Any:
    """Parse YAML text, turning parser errors into one-line ServetuneErrors."""
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ServetuneError(f"{source}:{where}: invalid YAML: {exc.problem}") from None
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        raise ServetuneError(f"{source}: invalid YAML: {exc}") from None


def document_from_data(data: Any, cls: type[D], source: str) -> D:
    """Validate already-parsed data as a document of type ``cls``."""
    if not isinstance(data, dict):
        raise ServetuneError(
            f"{source}: expected a mapping with apiVersion: {API_VERSION} and kind: {cls.KIND}"
        )
    api = data.get("apiVersion")
    if api != API_VERSION:
        raise ServetuneError(f"{source}: apiVersion: must be {API_VERSION!r} (got {api!r})")
    kind = data.get("kind")
    if kind != cls.KIND:
        raise ServetuneError(f"{source}: kind: expected {cls.KIND!r} (got {kind!r})")
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ServetuneError(format_validation_error(err, source)) from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise ServetuneError(f"{source}: {exc}") from None


def load_document(path: str | os.PathLike[str], cls: type[D]) -> D:
    """Load and validate a YAML document of type ``cls`` from ``path``."""
    p = Path(path)
    return document_from_data(_read_yaml(p), cls, str(p))


def dump_yaml(data: Any) -> str:
    """Deterministic block-style YAML (keys in insertion order)."""
    return yaml.safe_dump(plain_data(data), sort_keys=False, default_flow_style=False, width=100)


def document_data(doc: Document) -> dict[str, Any]:
    """The document as plain data in field order, as its file holds it: every field,
    except those in ``OMIT_WHEN_EMPTY`` while they are empty."""
    data = doc.model_dump(mode="json", exclude_none=False)
    for name in doc.OMIT_WHEN_EMPTY:
        if not data.get(name):
            data.pop(name, None)
    return data


def document_to_yaml(doc: Document, *, header: str = "") -> str:
    text = dump_yaml(document_data(doc))
    if header:
        text = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + text
    return text


def save_document(doc: Document, path: str | os.PathLike[str], *, header: str = "") -> None:
    """Write ``doc`` as YAML to ``path`` atomically."""
    write_text_atomic(path, document_to_yaml(doc, header=header))
