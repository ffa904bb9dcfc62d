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
import re
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from servetune.errors import ServetuneError
from servetune.io import decode_text, plain_data, read_bytes, write_text_atomic

API_VERSION = "servetune/v1"
# Validation context key set when a document is read from a file (its value: the file):
# checks that only a file must pass (a profile built in code may leave its step time
# out; a profile file may not) look for it with :func:`from_file`.
FROM_FILE = "source"


def from_file(info: ValidationInfo) -> bool:
    """Whether the document being validated was read from a file."""
    return isinstance(info.context, dict) and FROM_FILE in info.context


def _accepts_bool(annotation: Any) -> bool:
    """Whether a field's type admits a boolean anywhere (``bool``, ``Any``, a ``Literal``
    of one, a union or container holding one); a model type checks its own fields."""
    if annotation is bool or annotation is Any:
        return True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return any(isinstance(a, bool) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _accepts_bool(typing.get_args(annotation)[0])
    args = typing.get_args(annotation)
    if origin is None:  # a plain type: only an untyped container may hold a boolean
        return annotation in (dict, list, tuple, set, frozenset, object)
    if not args:
        return True
    if origin in (typing.Union, types.UnionType) or origin in (list, tuple, set, frozenset,
                                                                 dict):
        return any(_accepts_bool(a) for a in args if a is not Ellipsis)
    return True  # an unfamiliar generic: let pydantic decide


def _numbers_only(annotation: Any) -> bool:
    """Whether a field's type is a number (``int``, ``float``, optionally ``None``):
    pydantic's lax mode would read the text "3000" there as 3000."""
    if annotation in (int, float):
        return True
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    return (origin in (typing.Union, types.UnionType) and bool(args)
            and all(a in (int, float) for a in args))


def _find_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, list | tuple):
        return any(_find_bool(v) for v in value)
    if isinstance(value, dict):
        return any(_find_bool(v) for v in value.values())
    return False


INT64_MAX = 2**63 - 1


def _holds_model(annotation: Any) -> bool:
    """Whether a field's type is, or contains, a pydantic model."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_holds_model(a) for a in typing.get_args(annotation))


def _find_huge_int(value: Any) -> bool:
    """Whether ``value`` holds a whole number outside int64 (YAML reads any number of
    digits; numpy, the simulator and float() cannot take them)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return not -INT64_MAX <= value <= INT64_MAX
    if isinstance(value, list | tuple):
        return any(_find_huge_int(v) for v in value)
    if isinstance(value, dict):
        return any(_find_huge_int(v) for v in value.values())
    return False


class Strict(BaseModel):
    """A nested section: unknown keys are errors, values are validated on assignment, a
    boolean is never taken for a number (pydantic's lax mode reads ``true`` as 1), nor is
    text in a file ("3000" in quotes), and no whole number in a file lies outside int64."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    @field_validator("*", mode="before")
    @classmethod
    def _strict_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is None:
            return value
        field = cls.model_fields.get(info.field_name)
        # a nested model checks its own fields, so the error names the deepest one
        holds_model = field is not None and _holds_model(field.annotation)
        if from_file(info) and not holds_model and _find_huge_int(value):
            raise ValueError(f"a whole number beyond +-{INT64_MAX:,} (int64) is out of range; "
                             "check the value")
        if (isinstance(value, str) and from_file(info) and field is not None
                and _numbers_only(field.annotation)):
            raise ValueError("text where a number belongs (quoted, or not a number); give "
                             "the number itself, without quotes")
        if not _find_bool(value):
            return value
        if field is not None and not _accepts_bool(field.annotation):
            raise ValueError("a boolean (true/false) is not allowed here; give a number or "
                             "the value the field documents")
        return value


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
        shown = f" (got {_short_repr(value)})"
    more = f" [+{len(errors) - 1} more]" if len(errors) > 1 else ""
    if loc == "(document)" and first.get("type") == "value_error":
        return f"{source}: {msg}{more}"  # a whole-document check names its fields itself
    return f"{source}: {loc}: {msg}{shown}{more}"


def _short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: a message shows a bad value, not a
    page of it."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_nested(data: Any, cls: type[BaseModel]) -> None:
    """Validate ``data`` (a mapping a document keeps as plain data, e.g. a plan's policy)
    as ``cls``; a failure is a ValueError whose message names the nested field, for a
    pydantic validator to report under the field that holds the data."""
    try:
        cls.model_validate(data)
    except ValidationError as err:
        name = cls.__name__
        text = format_validation_error(err, name).removeprefix(f"{name}: ")
        raise ValueError(f"not a valid {name}: {text}") from None


def read_yaml(path: Path) -> Any:
    """The YAML data of ``path``, read as every servetune document is (size limit, text
    decoding and the strict parser: one error naming the file otherwise)."""
    text = decode_text(read_bytes(path, "YAML"), path, "YAML")
    return parse_yaml_text(text, str(path))


def _key_text(node: yaml.Node, key: Any) -> Any:
    """A key as the file writes it (``on``, not ``True``)."""
    return node.value if isinstance(node, yaml.ScalarNode) else key


MAX_ALIAS_EXPANSION = 100_000


def _check_aliases(root: yaml.Node) -> None:
    """Refuse a node graph that aliases make cyclic or blow up: YAML builds each alias as
    a shared reference, but validation, hashing and printing walk the tree it stands for
    ("billion laughs": nine levels of nine aliases are 9**9 values). A document may reuse
    nodes through aliases as long as that adds at most MAX_ALIAS_EXPANSION values."""
    size: dict[int, int] = {}  # expanded size of each finished node
    distinct = 0
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    open_nodes: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            children = _children(node)
            size[key] = 1 + sum(size[id(c)] for c in children)
            open_nodes.discard(key)
            if size[key] - distinct > MAX_ALIAS_EXPANSION:
                raise yaml.constructor.ConstructorError(
                    None, None,
                    f"aliases (*name) expand to over {MAX_ALIAS_EXPANSION:,} values; write "
                    "the values out instead of repeating an anchor", node.start_mark)
            continue
        if key in size:
            continue
        if key in open_nodes:
            raise yaml.constructor.ConstructorError(
                None, None, "an alias (*name) refers to a node that contains it; a document "
                "must be a tree", node.start_mark)
        open_nodes.add(key)
        distinct += 1
        stack.append((node, True))
        for child in _children(node):
            if id(child) not in size:
                stack.append((child, False))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error (the
    plain loader keeps the last value silently), and aliases may neither make the document
    cyclic nor multiply its size (:func:`_check_aliases`). Keys merged in with ``<<`` may
    still be overridden, as YAML intends."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _check_aliases(node)
        return self.construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: the constructor reports it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None,
                        f"duplicate key {_key_text(key_node, key)!r} (first given on line "
                        f"{first.start_mark.line + 1}); give each key once",
                        key_node.start_mark,
                    )
                seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 reads 50:00 as the number 3000 (base 60) and 1:30.5 as 90.5: a typo or a time
# of day would become a count without a word. The loader resolves numbers as YAML 1.2
# does: no base 60, and an exponent without a point (1e5) is a number too, so any text
# left in a numeric field was quoted, and the field's check names it (Strict).
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
UniqueKeyLoader.add_implicit_resolver(_FLOAT, re.compile(r"""^(?:
    [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))
UniqueKeyLoader.add_implicit_resolver(_INT, re.compile(r"""^(?:
    [-+]?0b[0-1_]+
    |[-+]?0[0-7_]+
    |[-+]?(?:0|[1-9][0-9_]*)
    |[-+]?0x[0-9a-fA-F_]+)$""", re.X), list("-+0123456789"))


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` with duplicate keys as errors (:class:`UniqueKeyLoader`): every
    YAML servetune reads goes through this."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def parse_yaml_text(text: str, source: str) -> Any:
    """Parse YAML text, turning parser errors (and duplicate keys) into one-line
    ServetuneErrors naming the file, the line and the key."""
    try:
        return load_yaml(text)
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
        raise ServetuneError(
            f"{source}: apiVersion: must be {API_VERSION!r} (got {_short_repr(api)})"
        )
    kind = data.get("kind")
    if kind != cls.KIND:
        raise ServetuneError(f"{source}: kind: expected {cls.KIND!r} (got {_short_repr(kind)})")
    try:
        return cls.model_validate(data, context={FROM_FILE: source})
    except ValidationError as err:
        raise ServetuneError(format_validation_error(err, source)) from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise ServetuneError(f"{source}: {exc}") from None


def load_document(path: str | os.PathLike[str], cls: type[D]) -> D:
    """Load and validate a YAML document of type ``cls`` from ``path``."""
    p = Path(path)
    return document_from_data(read_yaml(p), cls, str(p))


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
