"""The SDK a ``run_code`` program is written against, rendered from the caller's visible tools.

Two renderers share one iterative schema walker (an explicit stack, so a deep
schema never meets the interpreter's recursion limit; nesting deeper than
:data:`MAX_TYPE_DEPTH` renders as ``Any``/``JsonValue``):

* :func:`render_python_sdk`: usage rules, then a ``python`` block with
  ``TypedDict`` classes for every argument and output object (``NotRequired``
  for optional keys, ``Literal`` for ``const``/``enum``, ``A | B`` for
  ``oneOf``/``anyOf``/type lists, ``list[...]``, ``Any`` where untyped), a
  ``ToolCallError`` class and a ``Tools`` protocol with one
  ``async def name(self, args) -> Output`` per tool whose name is a plain
  identifier, its description as the docstring. Other names (keywords, a
  leading underscore, punctuation) are listed as comments to be called by
  subscript: ``tools["my-tool"]({...})``. In that class body a method shadows a builtin
  or ``typing`` name (the default workspace has a tool named ``list``): the signatures
  after it write ``builtins.list[str]``, and no generated class is named like a method.
* :func:`render_typescript_sdk`: the same information as TypeScript
  declarations (``ToolArgsMap``, ``ToolOutputMap``, ``ToolCallError``,
  ``declare const tools``), for parity.

A parent's own keywords hold in each of its ``oneOf``/``anyOf`` variants, and ``allOf``
members merge into one type (:func:`_variants`): ``properties`` and ``required`` are united,
``type``, ``const``/``enum`` and ``additionalProperties`` intersect, and a variant that cannot
hold is left out. Past :data:`MAX_VARIANTS`, or when none holds, the parent renders alone with
a comment saying so; a variant never drops a key its parent requires.

A local ``$ref`` (``#/$defs/Point``, ``#/definitions/Point``, ``#``: JSON pointers into the
tool's root schema, as pydantic's ``model_json_schema()`` emits them) names one type per
definition: a ``TypedDict`` class or ``TypeAlias`` (Python), a ``type`` (TypeScript), named
after the definition and shared by tools that define it alike. A definition that refers to
itself names itself (in Python as a string, the class not being defined yet). A ``$ref`` this
SDK cannot resolve (remote, an anchor, a missing pointer, or under a subschema's own ``$id``,
which it is relative to) renders as ``Any``/``JsonValue``
with a comment saying so.

Output is deterministic: tools are sorted by name, properties keep their
declared order, and class names are minted in traversal order, so an
unchanged tool set renders byte-identically.

Names, descriptions and schema strings come from plugins and may be any
``str``: both stubs stay valid and UTF-8 whatever they hold. Text shows as
itself except what would not (NUL, lone surrogates, controls, line separators,
bidi and invisible format characters), which is written as its escape; nothing
can end a docstring, comment or string early (``tests/codemode/test_sdk_properties.py``).
A docstring with backslashes is raw, so they read as written (``\\d+``), unless
it needs an escape or cannot close as a raw string; then they are doubled.
"""

from __future__ import annotations

import collections
import itertools
import json
import keyword
import re
import unicodedata
import urllib.parse
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence, Set
from typing import Any, Final

from attrs import frozen

from dsh_core.lossless import thaw
from dsh_core.model import ToolDefinition

__all__ = [
    "MAX_TYPE_DEPTH",
    "MAX_VARIANTS",
    "SdkTool",
    "SDK_RENDERERS",
    "render_sdk",
    "render_python_sdk",
    "render_typescript_sdk",
    "sdk_tools",
    "is_attribute_name",
]

#: Types nested deeper than this render as ``Any`` (Python) / ``JsonValue`` (TypeScript).
MAX_TYPE_DEPTH: Final = 180
#: Longest generated class name (before a de-duplication suffix).
MAX_CLASS_NAME: Final = 120


@frozen
class SdkTool:
    """What a renderer needs of one tool: name, description and the two schemas."""

    name: str
    description: str
    parameters: Any
    output: Any


def sdk_tools(definitions: Iterable[ToolDefinition]) -> list[SdkTool]:
    """Project definitions for rendering, sorted by name (``run_code`` is never among them)."""
    tools = [SdkTool(d.name, d.description, d.parameters, d.output.schema) for d in definitions if d.name != "run_code"]
    return sorted(tools, key=lambda tool: tool.name)


def is_attribute_name(name: str) -> bool:
    """True when ``tools.<name>`` works and reads well: an NFKC-stable identifier, no keyword, no ``_`` prefix."""
    return (
        name.isidentifier()
        and not keyword.iskeyword(name)
        and not name.startswith("_")
        and unicodedata.normalize("NFKC", name) == name
    )


def _is_field_name(key: str) -> bool:
    """True when ``key: T`` in a class body declares exactly ``key``.

    Python reads identifiers NFKC-normalized (``ﬁle`` is ``file``) and mangles a
    ``__name`` without trailing underscores in a class body (``_Cls__name``).
    """
    return (
        key.isidentifier()
        and not keyword.iskeyword(key)
        and unicodedata.normalize("NFKC", key) == key
        and not (key.startswith("__") and not key.endswith("__"))
    )


def _one_line(text: str) -> str:
    return " ".join(text.split())


#: Characters both stubs write as escapes. Some cannot be there at all: NUL (Python source cannot
#: hold it) and lone surrogates (a ``str`` may carry them, e.g. a non-UTF-8 file name through
#: ``surrogateescape``, but a stub is compiled, and sent, as UTF-8). The others would not show as
#: themselves: controls (ESC drives a terminal; ``\x0b``, ``\x0c`` and ``\x85`` end a line for some
#: readers and not for Python), line and paragraph separators, bidi controls that reorder what a
#: reader sees, and invisible format characters (soft hyphen, zero-width space, BOM, tag
#: characters). Tab, line feed and carriage return are the layout of a docstring; a string literal
#: or a comment never holds them raw. Zero-width (non-)joiners stay: emoji and several scripts are
#: spelled with them.
_UNSHOWABLE: Final = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\xad\u061c\u180e\u200b\u200e\u200f\u2028-\u202e"
    "\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\ud800-\udfff\U000e0000-\U000e007f]"
)


def _py_escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _py_escaped(text: str) -> str:
    """``text`` with every character of :data:`_UNSHOWABLE` written as its Python escape."""
    return _UNSHOWABLE.sub(_py_escape, text)


def _py_comment(text: str) -> str:
    """One line for a Python ``#`` comment, what would not show as itself written as its escape (``\\x00``)."""
    return _py_escaped(_one_line(text))


def _py_string(text: str) -> str:
    """A double-quoted Python string literal of ``text`` (JSON escapes are Python escapes too)."""
    return _py_escaped(json.dumps(text, ensure_ascii=False))


# -- the iterative walker -------------------------------------------------------------------------------


class _Node:
    """An inner type: its children (schema, name hint) and how to combine their texts."""

    __slots__ = ("children", "combine")

    def __init__(self, children: list[tuple[Any, str]], combine: Callable[[list[str]], str]) -> None:
        self.children = children
        self.combine = combine


Visit = Callable[[Any, str, int], "str | _Node"]


def _expand(schema: Any, hint: str, visit: Visit) -> str:
    """Post-order over the type tree with an explicit stack: children are combined before parents."""
    first = visit(schema, hint, 0)
    if isinstance(first, str):
        return first
    frames: list[tuple[_Node, Iterable[tuple[Any, str]], list[str], int]] = [(first, iter(first.children), [], 0)]
    while True:
        node, children, done, depth = frames[-1]
        child = next(children, None)  # type: ignore[call-overload]
        if child is None:
            frames.pop()
            text = node.combine(done)
            if not frames:
                return text
            frames[-1][2].append(text)
            continue
        visited = visit(child[0], child[1], depth + 1)
        if isinstance(visited, str):
            done.append(visited)
        else:
            frames.append((visited, iter(visited.children), [], depth + 1))


def _types_of(schema: Mapping[str, Any]) -> list[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return list(dict.fromkeys(kind))
    if isinstance(schema.get("properties"), dict):
        return ["object"]
    if "items" in schema:
        return ["array"]
    return []


#: Keywords that give a subschema a type of its own (see :func:`_constrains_only`).
_TYPING_KEYWORDS: Final = frozenset(
    {"type", "properties", "items", "const", "enum", "oneOf", "anyOf", "allOf", "$ref", "$dynamicRef"}
)


def _constrains_only(schema: Any) -> bool:
    """True for a subschema that only narrows its parent's type (``{"required": ["path"]}``)."""
    return isinstance(schema, dict) and not _TYPING_KEYWORDS.intersection(schema)


# -- combinators: a parent's keywords hold in each of its variants ----------------------------------------


#: Most variants one schema's ``oneOf``/``anyOf`` lists multiply out to before its stub stops spelling
#: them out (and shows the parent alone, with a note).
MAX_VARIANTS: Final = 16
#: Most variants one render spells out in all: alternatives nested in alternatives multiply.
_VARIANT_BUDGET: Final = 512
#: Keywords whose meaning a stub shows: a parent with none of them adds nothing to its variants.
_SHAPE_KEYWORDS: Final = frozenset({"type", "properties", "required", "additionalProperties", "items", "const", "enum"})
_COMBINATORS: Final = ("oneOf", "anyOf", "allOf")


class _Noted:
    """A schema to render with a comment: ``note`` on its own class, ``elsewhere`` on the class or
    tool around it when it has none."""

    __slots__ = ("elsewhere", "note", "schema")

    def __init__(self, schema: dict[str, Any], note: str, elsewhere: str) -> None:
        self.schema = schema
        self.note = note
        self.elsewhere = elsewhere


def _variants_not_shown(own: dict[str, Any]) -> _Noted:
    """``own`` (a parent's keywords) to render alone: its ``oneOf``/``anyOf`` variants are too many,
    or none holds together with it."""
    return _Noted(
        own,
        "Must also match one of the oneOf/anyOf variants of its schema, not spelled out here.",
        "A type here must also match one of the oneOf/anyOf variants of its schema, not spelled out.",
    )


def _says_nothing(schema: Any) -> bool:
    """True for ``true``, ``{}`` and what is no schema: nothing a stub could show."""
    return schema is True or (isinstance(schema, dict) and not schema) or not isinstance(schema, (bool, dict))


class _Conjunction(dict[str, Any]):
    """The ``allOf`` :func:`_conjunction` makes: one more conjunct joins its list."""


def _same(first: Any, second: Any) -> bool:
    try:
        return bool(first is second or first == second)
    except RecursionError:  # too deep to compare: count them as two
        return False


def _conjunction(first: Any, second: Any) -> Any:
    """A schema ``first`` and ``second`` both hold in: their ``allOf`` (merged when it is visited)."""
    if first is False or second is False:
        return False
    if _says_nothing(first):
        return second
    if _says_nothing(second) or _same(first, second):
        return first
    members = list(first["allOf"]) if isinstance(first, _Conjunction) else [first]
    if any(_same(member, second) for member in members):
        return first
    note = next(
        (
            schema["description"]
            for schema in (first, second)
            if isinstance(schema, dict) and isinstance(schema.get("description"), str)
        ),
        None,
    )
    return _Conjunction({"allOf": [*members, second], **({"description": note} if note is not None else {})})


def _type_list(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(kind, str) for kind in value):
        return list(dict.fromkeys(value))
    return None


def _allows(types: Sequence[str], kind: str) -> bool:
    return kind in types or (kind == "integer" and "number" in types)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    kinds: tuple[tuple[type, str], ...] = ((float, "number"), (str, "string"), (list, "array"), (dict, "object"))
    return next((name for kind, name in kinds if isinstance(value, kind)), "")


def _value_key(value: Any) -> tuple[str, Any]:
    """Equal for JSON-equal values (``1`` and ``1.0``; not ``true`` and ``1``)."""
    if value is None or isinstance(value, (bool, str)):
        return type(value).__name__, value
    if isinstance(value, (int, float)):
        return "number", value
    try:
        return "json", json.dumps(value, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        return "object", id(value)


def _conjoin(own: dict[str, Any], part: Mapping[str, Any], conflict: Callable[[list[Any]], bool] | None) -> bool:
    """Add what ``part`` asks for (its combinators aside) to ``own``; False when nothing can meet both.

    ``type`` and ``const``/``enum`` intersect, ``required`` is the union, ``properties`` merge key by
    key, each under the other side's ``additionalProperties`` where that side does not list it, and
    ``additionalProperties`` intersect too. A key is ``false`` (forbidden) where a side forbids it
    or where the two schemas of a key ``conflict`` (if given).
    """
    for key, value in part.items():
        if key == "type":
            types = _type_list(value)
            if types is not None and "type" in own:
                mine = own["type"]
                types = [kind for kind in mine if _allows(types, kind)] + [
                    kind for kind in types if kind not in mine and _allows(mine, kind)
                ]
                if not types:
                    return False
            if types is not None:
                own["type"] = types
        elif key in ("const", "enum"):
            values = [value] if key == "const" else value
            if isinstance(values, list):
                if "enum" in own:
                    keys = {_value_key(item) for item in values}
                    values = [item for item in own["enum"] if _value_key(item) in keys]
                if not values:
                    return False
                own["enum"] = values
        elif key == "required":
            if isinstance(value, list):
                own["required"] = list(
                    dict.fromkeys([*own.get("required", ()), *(name for name in value if isinstance(name, str))])
                )
        elif key == "items":
            own["items"] = _conjunction(own["items"], value) if "items" in own else value
        elif key not in ("properties", "additionalProperties", "$defs", "definitions", "$ref", *_COMBINATORS):
            own.setdefault(key, value)  # annotations, and constraints no stub shows
    properties = part.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    extra = _extra(part)
    if properties or not _says_nothing(extra):
        mine, mine_extra = own.get("properties", {}), _extra(own)
        merged: dict[str, Any] = {}
        for name in [*mine, *(name for name in properties if name not in mine)]:
            schema = _conjunction(mine.get(name, mine_extra), properties.get(name, extra))
            if conflict is not None and isinstance(schema, _Conjunction) and conflict(schema["allOf"]):
                schema = False
            merged[name] = schema
        own["properties"] = merged
        own["additionalProperties"] = _conjunction(mine_extra, extra)
    return True


class _TooComplex(Exception):
    """More schemas to merge than :data:`_MAX_MERGED` (``allOf`` nests without bound)."""


class _Opaque(Exception):
    """A ``$ref`` to merge into a value inside the definition it names, while that definition is
    being rendered (a recursion): it can only be named."""

    def __init__(self, ref: str) -> None:
        super().__init__(ref)
        self.ref = ref


#: Most schemas :meth:`_Types.merge` merges into one: past it, the variants are not spelled out.
_MAX_MERGED: Final = 64


class _Merged(dict[str, Any]):
    """A schema :meth:`_Types.variants` made, with the definitions merged into it: a ``$ref`` to
    one of them again, on the same value, adds nothing."""

    def __init__(self, schema: Mapping[str, Any], inlined: frozenset[Hashable]) -> None:
        super().__init__(schema)
        self.inlined = inlined


@frozen
class _MergeResult:
    own: dict[str, Any]
    lists: list[list[Any]]
    inlined: frozenset[Hashable]
    unresolved: list[Any]


def _opaque(ref: str) -> _Noted:
    """A recursive ``$ref`` that more keywords narrow: it is named, the keywords are not shown."""
    return _Noted(
        {"$ref": ref},
        "Must also match keywords of its schema that are not spelled out here.",
        "A type here must also match keywords of its schema that are not spelled out.",
    )


def _allowed_properties(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The keys an object stub lists, with their schemas: ``schema``'s properties but those it
    forbids (``false``), then each key it requires that they do not list, of the schema its other
    keys take. A call without such a key is refused, so the stub must show it (a key the schema
    also forbids makes it one nothing meets: it is not listed)."""
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    allowed = {key: value for key, value in properties.items() if value is not False}
    required = schema.get("required")
    extra = _extra(schema)
    if isinstance(required, list) and extra is not False:
        allowed.update((key, extra) for key in required if isinstance(key, str) and key not in properties)
    return allowed


def _extra(schema: Mapping[str, Any]) -> Any:
    """What ``schema`` allows of a key its ``properties`` do not list: its ``additionalProperties``,
    or anything (``True``) when it has ``patternProperties``. A key a pattern matches takes that
    pattern's schema, not ``additionalProperties`` (``false`` does not forbid it), and no stub spells
    the patterns out: it must not show such keys as forbidden, nor typed as the other keys are."""
    patterns = schema.get("patternProperties")
    return True if isinstance(patterns, dict) and patterns else schema.get("additionalProperties", True)


def _items(schema: Mapping[str, Any]) -> Any:
    """The schema every element of the array ``schema`` holds in: its ``items``, unless it has
    ``prefixItems`` (Draft 2020-12), whose members the first elements take instead of ``items``
    and which no stub spells out; ``None`` when the elements are not typed alike."""
    prefix = schema.get("prefixItems")
    items = schema.get("items")
    return items if isinstance(items, dict) and not (isinstance(prefix, list) and prefix) else None


def _values(schema: Mapping[str, Any]) -> list[Any] | None:
    """The values ``schema``'s ``const``/``enum`` lists, less those its ``type`` refuses (``null`` in
    ``{"type": "string", "enum": ["a", null]}``); ``None`` when it lists none. When its ``type``
    refuses them all, nothing holds and they are shown as written."""
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if not isinstance(values, list) or not values:
        return None
    types = _type_list(schema.get("type"))
    allowed = values if types is None else [value for value in values if _allows(types, _json_type(value))]
    return allowed or values


def _has_combinators(schema: Mapping[str, Any]) -> bool:
    return any(isinstance(value := schema.get(key), list) and value for key in _COMBINATORS)


# -- $ref: local JSON pointers, one named type per definition ----------------------------------------------


_MISSING: Final = object()
#: A JSON pointer token that indexes an array.
_INDEX: Final = re.compile(r"0|[1-9][0-9]*")
#: Most schema nodes :func:`_canonical` writes out (a definition compared across tools).
_MAX_CANONICAL: Final = 20_000
#: Most definitions one refers to, directly or not, for it to be compared across tools.
_MAX_CLOSURE: Final = 64


def _pointer_token(token: str) -> str:
    return urllib.parse.unquote(token).replace("~1", "/").replace("~0", "~")


def _follow(root: Any, ref: str) -> Any:
    """What the local JSON pointer ``ref`` (``#/$defs/Point``, percent- and ``~``-escaped) names
    in ``root``, or :data:`_MISSING`."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return _MISSING  # an anchor (#name) or not local
    target = root
    for token in map(_pointer_token, ref[2:].split("/")):
        if isinstance(target, dict) and token in target:
            target = target[token]
        elif isinstance(target, list) and _INDEX.fullmatch(token) and int(token) < len(target):
            target = target[int(token)]
        else:
            return _MISSING
    return target


class _Foreign(str):
    """A ``$ref`` at or under a subschema (not the root) that declares ``$id``: it resolves against
    that ``$id`` (Draft 2020-12), not the tool's root, which is all :func:`_follow` knows, so
    :meth:`_Types.resolve` leaves it unresolved (``Any``, with a note) rather than show the type of
    whatever the root holds under the same pointer."""

    __slots__ = ()


def _foreign_refs_marked(root: Any) -> Any:
    """``root``, or a plain copy of it whose ``$ref``\\ s under a subschema's own ``$id`` are :class:`_Foreign`.

    Every dict and list is walked, not only schema keywords: a ``$id`` found in a value (a ``const``,
    a ``default``) only makes more references ``Any``, which the runtime still validates exactly.
    """
    stack: list[tuple[Any, bool]] = [(root, False)]
    found = False
    while stack and not found:
        node, nested = stack.pop()
        if isinstance(node, dict):
            found = nested and isinstance(node.get("$id"), str)
            stack.extend((value, True) for value in node.values())
        elif isinstance(node, list):
            stack.extend((value, True) for value in node)
    if not found:
        return root
    copy = thaw(root)
    marking: list[tuple[Any, bool, bool]] = [(copy, False, False)]
    while marking:
        node, nested, foreign = marking.pop()
        if isinstance(node, dict):
            foreign = foreign or (nested and isinstance(node.get("$id"), str))
            if foreign and isinstance(ref := node.get("$ref"), str):
                node["$ref"] = _Foreign(ref)
            marking.extend((value, True, foreign) for value in node.values())
        elif isinstance(node, list):
            marking.extend((value, True, foreign) for value in node)
    return copy


class _Raw:
    """Text :func:`_canonical` writes as is."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _canonical(value: Any) -> tuple[str, list[str]] | None:
    """A text equal for equal JSON values (keys sorted) and the ``$ref`` strings inside, without
    recursion; ``None`` for what is not JSON or is too big to compare."""
    out: list[str] = []
    refs: list[str] = []
    stack: list[Any] = [value]
    count = 0
    while stack:
        item = stack.pop()
        if isinstance(item, _Raw):
            out.append(item.text)
            continue
        count += 1
        if count > _MAX_CANONICAL:
            return None
        if isinstance(item, dict):
            if not all(isinstance(key, str) for key in item):
                return None
            if isinstance(ref := item.get("$ref"), str):
                refs.append(ref)
            stack.append(_Raw("}"))
            for key in sorted(item, reverse=True):
                stack.extend((_Raw(","), item[key], _Raw(json.dumps(key) + ":")))
            stack.append(_Raw("{"))
        elif isinstance(item, list):
            stack.append(_Raw("]"))
            for element in reversed(item):
                stack.extend((_Raw(","), element))
            stack.append(_Raw("["))
        elif item is None or isinstance(item, (bool, int, float, str)):
            out.append(json.dumps(item))
        else:
            return None
    return "".join(out), refs


class _Def:
    """A definition (a ``$defs`` entry, or a tool's root schema) while and after it renders."""

    __slots__ = ("active", "expr", "hint", "is_class", "name", "named")

    def __init__(self, hint: str, named: bool) -> None:
        self.hint = hint
        #: A ``$defs`` entry always gets its name; a root only if something refers to it.
        self.named = named
        self.name: str | None = None
        self.is_class = False  # its name is the class its schema rendered as
        self.active = False  # rendering: a $ref to it now is a recursion
        self.expr: str | None = None


@frozen
class _Resolved:
    key: Hashable
    schema: Any
    hint: str


class _Owned:
    """A definition's schema, to render as that definition."""

    __slots__ = ("key", "schema")

    def __init__(self, key: Hashable, schema: Any) -> None:
        self.key = key
        self.schema = schema


class _Types:
    """What both renderers share: names, definitions, merging variants, and the notes a stub shows
    as comments. A subclass renders types in its language."""

    def __init__(self, reserved: Iterable[str]) -> None:
        #: Comments waiting for the class (Python) or tool around the type that asked for them.
        self.notes: list[str] = []
        self._budget = _VARIANT_BUDGET
        self._names = set(reserved)
        self._defs: dict[Hashable, _Def] = {}
        self._def_keys: dict[tuple[int, str], Hashable] = {}
        self._canonicals: dict[tuple[int, str], tuple[str, list[str]] | None] = {}
        #: Definitions merged into a value being rendered, by how many nodes on the path merged them.
        self._inlined: collections.Counter[Hashable] = collections.Counter()
        self._roots = 0
        self._root: Any = None
        self._root_key: Hashable = None
        #: Copies made by :func:`_foreign_refs_marked`, kept alive: memos are keyed by ``id(root)``.
        self._copies: list[Any] = []

    # -- what a language renders

    def visit(self, schema: Any, hint: str, depth: int) -> str | _Node:
        raise NotImplementedError

    def any_type(self) -> str:
        raise NotImplementedError

    def forward(self, name: str) -> str:
        """A reference to the definition ``name`` from inside it."""
        raise NotImplementedError

    def alias(self, name: str, text: str) -> None:
        """Declare ``name`` as the type ``text``."""
        raise NotImplementedError

    def unresolved(self, ref: Any) -> str:
        """The note on a ``$ref`` this renderer cannot resolve."""
        raise NotImplementedError

    # -- shared

    def class_name(self, hint: str) -> str:
        """A new type name from ``hint``, capped, unique (``Point``, ``Point2``, ...)."""
        base = hint[:MAX_CLASS_NAME]
        name, suffix = base, 2
        while name in self._names:
            name = f"{base}{suffix}"
            suffix += 1
        self._names.add(name)
        return name

    def expression(self, schema: Any, hint: str) -> str:
        """The type of a tool's ``schema`` (the root its local ``$ref``\\ s resolve against)."""
        self._roots += 1
        marked = _foreign_refs_marked(schema)
        if marked is not schema:
            self._copies.append(marked)
            schema = marked
        self._root, self._root_key = schema, ("#", self._roots)
        definition = self._defs[self._root_key] = _Def(hint, named=False)
        return self._finish(definition, _expand(_Owned(self._root_key, schema), hint, self.visit))

    def take_notes(self, start: int = 0) -> list[str]:
        """The notes added since ``start``, which are then gone."""
        notes = list(dict.fromkeys(self.notes[start:]))
        del self.notes[start:]
        return notes

    def owned(self, owned: _Owned) -> Any:
        """Start rendering a definition: the schema to render for it."""
        self._defs[owned.key].active = True
        schema = owned.schema
        if isinstance(schema, dict) and ("$ref" in schema or _has_combinators(schema)):
            # A $ref to itself on this same value adds nothing (it does not recurse).
            return _Merged(schema, frozenset([owned.key, *getattr(schema, "inlined", ())]))
        return schema

    def def_name(self, key: Hashable) -> str:
        """The name of the definition ``key``, minted now if it has none yet."""
        definition = self._defs[key]
        if definition.name is None:
            definition.name = self.class_name(definition.hint)
        return definition.name

    def resolve(self, ref: Any) -> _Resolved | None:
        """The definition a local ``$ref`` names in the current root, or ``None``."""
        if not isinstance(ref, str) or isinstance(ref, _Foreign):
            return None
        if ref == "#":
            return _Resolved(self._root_key, self._root, self._defs[self._root_key].hint)
        target = _follow(self._root, ref)
        if target is _MISSING:
            return None
        memo = (id(self._root), ref)
        key = self._def_keys.get(memo)
        if key is None:
            key = self._def_keys[memo] = self._definition_key(ref, target)
        return _Resolved(key, target, _camel(_pointer_token(ref.rsplit("/", 1)[-1]), "Definition"))

    def _definition_key(self, ref: str, target: Any) -> Hashable:
        """Equal for a definition that renders the same in another tool: the same pointer, and the
        same text for it and every local definition it refers to (so ``Point`` renders once)."""
        closure: dict[str, str] = {}
        pending = [ref]
        while pending:
            pointer = pending.pop()
            if pointer in closure:
                continue
            memo = (id(self._root), pointer)
            if memo not in self._canonicals:
                self._canonicals[memo] = _canonical(target if pointer == ref else _follow(self._root, pointer))
            canonical = self._canonicals[memo]
            # A _Foreign $ref reads like a local one but stays unresolved here only.
            if (
                canonical is None
                or pointer == "#"
                or len(closure) >= _MAX_CLOSURE
                or any(isinstance(inner, _Foreign) for inner in canonical[1])
            ):
                return "in", id(self._root), ref  # this root's only
            closure[pointer], refs = canonical
            pending.extend(inner for inner in refs if inner.startswith("#"))
        return "def", ref, tuple(sorted(closure.items()))

    def reference(self, schema: Mapping[str, Any]) -> str | _Node | None:
        """A ``$ref`` with nothing beside it but annotations, as its definition's name (rendering
        the definition the first time); ``None`` for any other schema."""
        if "$ref" not in schema or _SHAPE_KEYWORDS.intersection(schema) or _has_combinators(schema):
            return None
        resolved = self.resolve(schema["$ref"])
        if resolved is None:
            self.notes.append(self.unresolved(schema["$ref"]))
            return self.any_type()
        definition = self._defs.get(resolved.key)
        if definition is None:
            definition = self._defs[resolved.key] = _Def(resolved.hint, named=True)
        if definition.expr is not None:
            return definition.expr
        if definition.active:
            return self.forward(self.def_name(resolved.key))
        return _Node(
            [(_Owned(resolved.key, resolved.schema), resolved.hint)], lambda parts: self._finish(definition, parts[0])
        )

    def _finish(self, definition: _Def, text: str) -> str:
        definition.active = False
        if definition.is_class:
            assert definition.name is not None
            definition.expr = definition.name
        elif definition.named or definition.name is not None:
            definition.expr = definition.name or self.class_name(definition.hint)
            definition.name = definition.expr
            self.alias(definition.expr, text)
        else:
            definition.expr = text
        return definition.expr

    # -- combinators

    def combinators(self, schema: Mapping[str, Any], hint: str) -> _Node | None:
        """A node for ``schema``'s variants (see :meth:`variants`), or ``None`` when it has none."""
        found = self.variants(schema)
        if found is None:
            return None
        variants, inlined = found
        if isinstance(variants, _Noted) or len(variants) == 1:
            node = _Node([(variants if isinstance(variants, _Noted) else variants[0], hint)], _first)
        else:
            node = _Node([(variant, f"{hint}{i + 1}") for i, variant in enumerate(variants)], self.variant_union)
        if inlined:
            # While its variants render, a $ref to a definition merged into them is a recursion.
            self._inlined.update(inlined)
            combine = node.combine

            def release(parts: list[str]) -> str:
                self._inlined.subtract(inlined)
                return combine(parts)

            node.combine = release
        return node

    def variant_union(self, parts: list[str]) -> str:
        """The union of the types of a schema's variants."""
        return _union(parts)

    def variants(self, schema: Mapping[str, Any]) -> tuple[list[Any] | _Noted, frozenset[Hashable]] | None:
        """The schemas ``schema`` stands for, and the definitions merged into them: its
        ``oneOf``/``anyOf`` alternatives, each merged with ``schema``'s own keywords, ``allOf``
        members and ``$ref``; ``None`` if it has no combinator (or ``$ref``) to render.

        Past :data:`MAX_VARIANTS`, or the budget of a render, or when no variant can hold, the
        parent's keywords render alone with a note.
        """
        if not _has_combinators(schema) and "$ref" not in schema:
            return None
        try:
            result = self.merge([schema])
        except _TooComplex:
            result = None
        except _Opaque as opaque:
            return _opaque(opaque.ref), frozenset()
        if result is None:
            return _variants_not_shown(
                {key: value for key, value in schema.items() if key not in (*_COMBINATORS, "$ref")}
            ), frozenset()
        self.notes.extend(self.unresolved(ref) for ref in result.unresolved)
        own, lists, inlined = result.own, result.lists, result.inlined
        if _types_of(own):
            # e.g. "path or text is required": the parent's type, with both optional, is the stub
            lists = [alternatives for alternatives in lists if not all(_constrains_only(alt) for alt in alternatives)]
        if not lists:
            return ([_Merged(own, inlined)], inlined) if schema.get("allOf") or "$ref" in schema else None
        count = 1
        for alternatives in lists:
            count *= len(alternatives)
            if count > min(MAX_VARIANTS, self._budget):
                return _variants_not_shown(own), inlined
        self._budget -= count
        variants: list[Any] = []
        everything = set(inlined)
        adds_nothing = not _SHAPE_KEYWORDS.intersection(own)
        for combination in itertools.product(*lists):
            if adds_nothing and len(combination) == 1:
                alternative = combination[0]
                variants.append(
                    _Merged(alternative, inlined) if inlined and isinstance(alternative, dict) else alternative
                )
                continue
            try:
                variant = self.merge([_Merged(own, inlined), *combination])
            except _TooComplex:
                return _variants_not_shown(own), inlined
            except _Opaque as opaque:
                variants.append(_opaque(opaque.ref))
                continue
            if variant is not None:
                self.notes.extend(self.unresolved(ref) for ref in variant.unresolved)
                everything.update(variant.inlined)
                more = [{"anyOf": alternatives} for alternatives in variant.lists]
                variants.append(_Merged({**variant.own, "allOf": more} if more else variant.own, variant.inlined))
        return variants or _variants_not_shown(own), frozenset(everything)

    def conflict(self, parts: list[Any]) -> bool:
        """True when nothing can meet all of ``parts`` (looking one level deep, into no property)."""
        try:
            return self.merge(parts, deep=False) is None
        except (_TooComplex, _Opaque):
            return False

    def merge(self, parts: Iterable[Any], deep: bool = True) -> _MergeResult | None:
        """One schema all of ``parts`` hold in (their ``allOf`` members and ``$ref`` targets merged
        in too) and the ``oneOf``/``anyOf`` lists it must also match; ``None`` when nothing can meet
        them all. A single ``$ref`` the rest adds nothing to stays a ``$ref`` (a named type).

        Raises :class:`_TooComplex` past :data:`_MAX_MERGED` schemas and :class:`_Opaque` for a
        ``$ref`` to merge into a value of its own definition while that renders.
        """
        parts = list(parts)
        first = self._merge(parts, deep, inline=False)
        if first is None or not first.unresolved:  # here: the $refs set aside
            return first
        refs = first.unresolved
        if len(refs) == 1 and not first.lists and self._adds_nothing(first.own, refs[0]):
            return _MergeResult({"$ref": refs[0]}, [], first.inlined, [])
        return self._merge(parts, deep, inline=True)

    def _adds_nothing(self, own: Mapping[str, Any], ref: Any) -> bool:
        """True when ``own`` says nothing a stub shows beyond what ``ref``'s definition does."""
        shape = _SHAPE_KEYWORDS.intersection(own)
        if not shape:
            return True
        resolved = self.resolve(ref)
        if shape != {"type"} or resolved is None or not isinstance(resolved.schema, dict):
            return False
        return all(_allows(own["type"], kind) for kind in _types_of(resolved.schema))

    def _merge(self, parts: list[Any], deep: bool, inline: bool) -> _MergeResult | None:
        own: dict[str, Any] = {}
        lists: list[list[Any]] = []
        inlined: set[Hashable] = set()
        refs: list[Any] = []  # unresolved, or (not inline) set aside
        stack = parts[::-1]
        merged = 0
        conflict = self.conflict if deep else None
        while stack:
            part = stack.pop()
            if part is False:
                return None
            if not isinstance(part, dict):
                continue
            merged += 1
            if merged > _MAX_MERGED:
                raise _TooComplex
            inlined.update(getattr(part, "inlined", ()))
            if "$ref" in part:
                ref = part["$ref"]
                rest = {key: value for key, value in part.items() if key != "$ref"}
                resolved = self.resolve(ref) if inline else None
                if resolved is None or resolved.key in inlined:
                    if resolved is None:
                        refs.append(ref)
                    stack.append(rest)
                    continue
                definition = self._defs.get(resolved.key)
                if (definition is not None and definition.active) or self._inlined[resolved.key]:
                    raise _Opaque(ref)
                inlined.add(resolved.key)
                stack.extend((rest, resolved.schema))  # the definition's keys first
                continue
            lists.extend(value for key in ("oneOf", "anyOf") if isinstance(value := part.get(key), list) and value)
            if isinstance(members := part.get("allOf"), list):
                stack.extend(reversed(members))
            if not _conjoin(own, part, conflict):
                return None
        properties, extra = own.get("properties", {}), _extra(own)
        if any(properties.get(name, extra) is False for name in own.get("required", ())):
            return None  # a required key is forbidden
        if "enum" in own and "type" in own:
            own["enum"] = [value for value in own["enum"] if _allows(own["type"], _json_type(value))]
            if not own["enum"]:
                return None
        return _MergeResult(own, lists, frozenset(inlined), refs)


def _first(parts: list[str]) -> str:
    return parts[0]


#: What :func:`_union_members` looks at: an escape, a quote, a bracket, a top-level ``|``.
_UNION_TOKENS: Final = re.compile(r'\\.|"|[\[({]|[\])}]| \| ')


def _union_members(text: str) -> list[str]:
    """``text`` split at its top-level `` | `` (not one inside brackets or a string literal)."""
    if " | " not in text:
        return [text]
    members: list[str] = []
    depth, start, quoted = 0, 0, False
    for token in _UNION_TOKENS.finditer(text):
        mark = token.group()
        if mark == '"':
            quoted = not quoted
        elif quoted:
            continue
        elif mark in "([{":
            depth += 1
        elif mark in ")]}":
            depth -= 1
        elif mark == " | " and depth == 0:
            members.append(text[start : token.start()])
            start = token.end()
    members.append(text[start:])
    return members


def _union(parts: Sequence[str]) -> str:
    """The union of ``parts``, each member once (``str | None`` and ``None`` make ``str | None``)."""
    unique = list(dict.fromkeys(member for part in parts for member in _union_members(part)))
    return " | ".join(unique) if unique else "Any"


def _camel(text: str, default: str = "Tool") -> str:
    words = re.split(r"[^0-9A-Za-z]+", text)
    name = "".join(word[:1].upper() + word[1:] for word in words if word)
    if not name:
        name = default
    if name[0].isdigit():
        name = "T" + name
    return name


# -- Python -------------------------------------------------------------------------------------------


_PY_SCALARS: Final = {"string": "str", "number": "float", "integer": "int", "boolean": "bool", "null": "None"}


def _py_literal(value: Any) -> str | None:
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _py_string(value)
    return None


#: A name :class:`_PythonTypes` marked as shadowed by a method of ``Tools``.
_MARKED: Final = re.compile("([\x01\x02])([A-Za-z]+)")


class _PythonTypes(_Types):
    """Renders schemas as Python type expressions, collecting the TypedDict classes they need."""

    def __init__(self, methods: Iterable[str] = ()) -> None:
        #: The ``Tools`` methods: inside that class body such a name is the method, not the type.
        self._methods = frozenset(methods)
        # ``None``, ``True`` and ``False`` too: a definition ``none`` camel-cases to a keyword.
        super().__init__(
            {
                "ToolCallError",
                "Tools",
                "Any",
                "Literal",
                "NotRequired",
                "Protocol",
                "TypeAlias",
                "TypedDict",
                "None",
                "True",
                "False",
                *self._methods,
            }
        )
        #: The classes (and type aliases) by name, in the order they are defined (each after those it uses).
        self.classes: dict[str, str] = {}
        #: What each class declares: two classes that declare the same are the same type.
        self._bodies: dict[str, tuple[object, ...]] = {}
        #: Classes and aliases named for a definition: other types use them too.
        self._pinned: set[str] = set()
        #: The note of the :class:`_Noted` schema being visited, until its class takes it.
        self._note: str | None = None
        #: The definition whose schema is being visited, until its class takes its name.
        self._owner: Hashable = None
        #: What the stub imports: names from ``typing``, and the modules ``builtins`` and ``typing``.
        self.used: set[str] = set()

    def any_type(self) -> str:
        return self._any()

    def forward(self, name: str) -> str:
        # Marked: an annotation that holds it is written as a string (the class is not defined yet).
        return f"\x00{name}"

    def alias(self, name: str, text: str) -> None:
        self.used.add("TypeAlias")
        self.classes[name] = f"{name}: TypeAlias = {self.annotation(text)}"
        self._pinned.add(name)

    def unresolved(self, ref: Any) -> str:
        shown = json.dumps(ref) if isinstance(ref, str) else "that is not a string"
        return f"Any here stands for a $ref this SDK does not resolve: {shown}."

    def annotation(self, text: str) -> str:
        """``text`` as a module-level annotation: a string if it names a class not defined yet."""
        text = self.module_level(text)
        return _py_string(text.replace("\x00", "")) if "\x00" in text else text

    # A name a method shadows is written with a mark (``\x01list``, ``\x02Any``; marks are control
    # characters, which no other text of the stub holds raw) that module-level code drops and a
    # signature in ``Tools`` resolves to ``builtins.list`` / ``typing.Any``.

    def builtin(self, name: str) -> str:
        """``name`` (``list``, ``str``, ...), marked if a method of ``Tools`` shadows it."""
        return name if name not in self._methods else f"\x01{name}"

    def typing(self, name: str) -> str:
        """``Any`` or ``Literal``, imported, or marked if a method of ``Tools`` shadows it."""
        if name in self._methods:
            return f"\x02{name}"
        self.used.add(name)
        return name

    def module_level(self, text: str) -> str:
        """``text`` for the module body, where the builtins and ``typing`` names are not shadowed."""
        if "\x02" in text:
            self.used.update(name for name in ("Any", "Literal") if f"\x02{name}" in text)
        return text.replace("\x01", "").replace("\x02", "")

    def signature(self, text: str, defined: Set[str]) -> str:
        """``text`` for a signature in ``Tools`` after the methods ``defined``: a name one of them
        shadows is qualified by its module (``builtins.list``)."""

        def resolve(match: re.Match[str]) -> str:
            name = match.group(2)
            if name not in defined:
                if match.group(1) == "\x02":
                    self.used.add(name)
                return name
            module = "builtins" if match.group(1) == "\x01" else "typing"
            self.used.add(module)
            return f"{self.module(module)}.{name}"

        return _MARKED.sub(resolve, text.replace("\x00", ""))

    def module(self, module: str) -> str:
        """The name the stub imports ``module`` as: itself, unless a method shadows that too."""
        return module if module not in self._methods else f"_{module}"

    def variant_union(self, parts: list[str]) -> str:
        """The union of a schema's variants, each class once: a class that declares what another
        variant's does (they differ in what no stub shows) is dropped."""
        kept: dict[tuple[object, ...] | str, str] = {}
        for member in (member for part in parts for member in _union_members(part)):
            body = self._bodies.get(member)
            if body is not None and body in kept and member not in self._pinned:
                del self.classes[member], self._bodies[member]  # no other type uses a variant's class
            else:
                kept[member if body is None else body] = member
        return _union(list(kept.values()))

    def _any(self) -> str:
        return self.typing("Any")

    def _value_type(self, value: Any) -> str:
        if value is None:
            return "None"
        for kind, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str")):
            if isinstance(value, kind):
                return self.builtin(name)
        if isinstance(value, list):
            return f"{self.builtin('list')}[{self._any()}]"
        return f"{self.builtin('dict')}[{self.builtin('str')}, {self._any()}]"

    def visit(self, schema: Any, hint: str, depth: int) -> str | _Node:
        if isinstance(schema, _Owned):
            self._owner = schema.key
            try:
                return self._visit_schema(self.owned(schema), hint, depth)
            finally:
                self._owner = None
        if not isinstance(schema, _Noted):
            return self._visit_schema(schema, hint, depth)
        self._note = schema.note
        try:
            return self._visit_schema(schema.schema, hint, depth)
        finally:
            if self._note is not None:  # no class of its own: the class or tool around it says it
                self.notes.append(schema.elsewhere)
                self._note = None

    def _visit_schema(self, schema: Any, hint: str, depth: int) -> str | _Node:
        if not isinstance(schema, dict) or depth > MAX_TYPE_DEPTH:
            return self._any()
        values = _values(schema)
        if values is not None:
            return self._literals(values)
        reference = self.reference(schema)
        if reference is not None:
            return reference
        variants = self.combinators(schema, hint)
        if variants is not None:
            return variants
        types = _types_of(schema)
        if not types:
            return self._any()
        if len(types) > 1:
            return _Node([({**schema, "type": kind}, hint) for kind in types], _union)
        kind = types[0]
        if kind in _PY_SCALARS:
            return _PY_SCALARS[kind] if kind == "null" else self.builtin(_PY_SCALARS[kind])
        if kind == "array":
            items = _items(schema)
            array = self.builtin("list")
            if items is not None:
                return _Node([(items, hint + "Item")], lambda parts: f"{array}[{parts[0]}]")
            return f"{array}[{self._any()}]"
        if kind == "object":
            return self._object(schema, hint)
        return self._any()

    def _literals(self, values: list[Any]) -> str:
        literals = [_py_literal(v) for v in values]
        if all(item is not None for item in literals):
            return f"{self.typing('Literal')}[{', '.join(dict.fromkeys(literals))}]"  # type: ignore[arg-type]
        return _union([self._value_type(v) for v in values])

    def _object(self, schema: Mapping[str, Any], hint: str) -> str | _Node:
        properties = _allowed_properties(schema)
        extra = _extra(schema)
        if not properties:
            mapping = f"{self.builtin('dict')}[{self.builtin('str')}, "
            if isinstance(extra, dict):
                return _Node([(extra, hint + "Value")], lambda parts: f"{mapping}{parts[0]}]")
            return f"{mapping}{self._any()}]"
        if self._owner is not None:  # a definition's class: it takes the definition's name
            name = self.def_name(self._owner)
            self._defs[self._owner].is_class = True
            self._pinned.add(name)
            self._owner = None
        else:
            name = self.class_name(hint)
        keys = list(properties)
        required = schema.get("required")
        required_set = set(required) if isinstance(required, list) else set()
        children = [(properties[key], name + _camel(key)) for key in keys]
        open_object = extra is not False
        own_notes = [] if self._note is None else [self._note]
        self._note = None
        start = len(self.notes)

        def combine(parts: list[str]) -> str:
            notes = [f"# {_py_comment(note)}" for note in dict.fromkeys([*own_notes, *self.take_notes(start)])]
            if open_object:
                notes.append("# Additional keys beyond those declared are allowed.")
            self.used.add("TypedDict")
            fields: list[tuple[str, str, str]] = []
            for key, part in zip(keys, parts, strict=True):
                annotation = self.annotation(part)
                if key not in required_set:
                    self.used.add("NotRequired")
                    annotation = f"NotRequired[{annotation}]"
                prop = properties[key]
                note = prop.get("description") if isinstance(prop, dict) else None
                fields.append((key, annotation, _py_comment(note) if isinstance(note, str) and note.strip() else ""))
            if all(_is_field_name(key) for key in keys):
                lines = [f"class {name}(TypedDict):", *(f"    {note}" for note in notes)]
                for key, annotation, note in fields:
                    lines.append(f"    {key}: {annotation}" + (f"  # {note}" if note else ""))
            else:
                # Keys that cannot be class attributes still get a precise type: the functional syntax.
                lines = [*notes, f"{name} = TypedDict({json.dumps(name)}, {{"]
                for key, annotation, note in fields:
                    lines.append(f"    {_py_string(key)}: {annotation}," + (f"  # {note}" if note else ""))
                lines.append("})")
            self.classes[name] = self.module_level("\n".join(lines))
            self._bodies[name] = (tuple(notes), tuple(fields), lines[0].startswith("class "))
            return name

        return _Node(children, combine)


def _raw_docstring_quote(text: str) -> str | None:
    """The quotes of a raw docstring that holds ``text`` as written, or ``None`` if none can.

    In a raw string a backslash is itself (``\\bTODO\\b`` reads as the description wrote it), but
    it still keeps a quote from closing the string: ``text`` must not hold the closing quotes, end
    in their quote or in an odd run of backslashes, nor need an escape (:data:`_UNSHOWABLE`).
    """
    if _UNSHOWABLE.search(text) or (len(text) - len(text.rstrip("\\"))) % 2:
        return None
    return next((quote for quote in ('"""', "'''") if quote not in text and not text.endswith(quote[0])), None)


def _docstring(text: str, indent: str) -> str:
    """A docstring of ``text``: raw when it has backslashes, so the model reads them as written."""
    # CR LF and CR end a line in Python source too: they become line feeds, not escapes.
    text = text.strip().replace("\r\n", "\n").replace("\r", "\n")
    quote = _raw_docstring_quote(text) if "\\" in text else None
    if quote is not None:
        start, end, body = "r" + quote, quote, text
    else:
        start = end = '"""'
        body = _py_escaped(text.replace("\\", "\\\\"))  # after the backslashes: escapes stay escapes
        # Quotes next to the closing """ would end the docstring early: escape every trailing one.
        unquoted = body.rstrip('"')
        body = unquoted.replace('"""', '\\"\\"\\"') + '\\"' * (len(body) - len(unquoted))
    lines = body.split("\n")  # splitlines() would also break at characters now escaped
    if len(lines) == 1:
        return f"{indent}{start}{lines[0]}{end}"
    rest = "\n".join((indent + line) if line.strip() else "" for line in lines[1:])
    return f"{indent}{start}{lines[0]}\n{rest}\n{indent}{end}"


PYTHON_RULES: Final = """\
## Writing code for run_code

`run_code` runs a Python program: the body of an `async def` (top-level `await` and `return` work) in a \
fresh sandboxed worker. Only `tools` and `ToolCallError` are predefined at run time; everything in the \
block below is a static stub for reading, not importable: build plain dicts (calling a TypedDict stub \
raises `NameError`).

- Call a tool with one dict or with keywords: `await tools.read({"path": "a.txt"})` or \
`await tools.read(path="a.txt")`. Names that are not plain identifiers (keywords, a leading `_`, \
punctuation) are reached by subscript: `await tools["my-tool"]({...})`.
- Arguments and results are JSON values (dict, list, str, int, float, bool, None); a result has the \
tool's `...Output` type. Return lists, not tuples or sets, and `0.0`, not `-0.0` (which `round()` can give).
- The program already runs in an event loop: `await` directly, never `asyncio.run(...)`. Run independent \
calls together with `asyncio.gather(...)` (`import asyncio`): concurrency-safe tools overlap, the others \
run one at a time in call order. A call you cancel (`asyncio.wait_for`, `task.cancel()`) is stopped.
- A failed, denied or unknown call raises `ToolCallError` (`.tool_name` names the tool): \
`try: ... except ToolCallError as e: ...` and go on.
- Program output is only what you `print(...)` and/or `return`: keep it short and curated; \
intermediate tool results stay out of the conversation.

The available tools:"""


def render_python_sdk(tools: Sequence[SdkTool]) -> str:
    """The Python SDK section: rules, then a ``python`` block with the typed stubs."""
    types = _PythonTypes(tool.name for tool in tools if is_attribute_name(tool.name))
    types.used.add("Protocol")
    members: list[str] = []
    methods: set[str] = set()  # defined so far: in the class body, the names after them are theirs
    for tool in sorted(tools, key=lambda t: t.name):
        stem = _camel(tool.name)
        args = types.signature(types.expression(tool.parameters, stem + "Args"), methods)
        output = types.signature(types.expression(tool.output, stem + "Output"), methods)
        members.extend(f"    # {_py_comment(note)}" for note in types.take_notes())
        if is_attribute_name(tool.name):
            methods.add(tool.name)
            members.append(
                f"    async def {tool.name}(self, args: {args}) -> {output}:\n"
                f"{_docstring(tool.description, '        ')}"
            )
        else:
            members.append(
                f"    # tools[{_py_string(tool.name)}](args: {args}) -> {output}: {_py_comment(tool.description)}"
            )
    imports = [
        name for name in ("Any", "Literal", "NotRequired", "Protocol", "TypeAlias", "TypedDict") if name in types.used
    ]
    modules = "".join(
        f"import {name}\n" if types.module(name) == name else f"import {name} as _{name}\n"
        for name in ("builtins", "typing")
        if name in types.used
    )
    blocks = [
        f"{modules}from typing import {', '.join(imports)}",
        "class ToolCallError(Exception):\n    tool_name: str",
        *types.classes.values(),
        # A class body of comments only is not valid Python: ``pass`` keeps the stub parseable.
        "class Tools(Protocol):\n" + "\n".join([*members, *([] if methods else ["    pass"])]),
        "tools: Tools",
    ]
    return f"{PYTHON_RULES}\n\n```python\n" + "\n\n".join(blocks) + "\n```"


# -- TypeScript -----------------------------------------------------------------------------------------


_TS_SCALARS: Final = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null"}
#: A bare TypeScript property name; anything else (even one with a trailing newline) is quoted.
_TS_KEY: Final = re.compile(r"\A[A-Za-z_$][A-Za-z0-9_$]*\Z")


def _ts_escaped(text: str) -> str:
    """``text`` with every character of :data:`_UNSHOWABLE` written as its JSON (and JavaScript) escape."""
    return _UNSHOWABLE.sub(lambda match: json.dumps(match.group())[1:-1], text)


def _ts_string(text: str) -> str:
    """A double-quoted TypeScript string literal of ``text`` (a JSON string is one)."""
    return _ts_escaped(json.dumps(text, ensure_ascii=False))


def _ts_comment(text: str) -> str:
    """One line for a ``/** ... */`` comment that no ``*/`` in ``text`` can close early."""
    return _ts_escaped(_one_line(text).replace("*/", "*\\/"))


def _ts_key(key: str) -> str:
    return key if _TS_KEY.fullmatch(key) else _ts_string(key)


def _ts_literal(value: Any) -> str:
    if isinstance(value, str):
        return _ts_string(value)
    return "JsonValue" if isinstance(value, (dict, list)) else json.dumps(value)


def _ts_array(item: str) -> str:
    return f"({item})[]" if ("|" in item or "&" in item) else f"{item}[]"


#: Names a generated TypeScript type must not take: the stub's own, and globals it could hide.
_TS_RESERVED: Final = frozenset(
    {
        "JsonValue",
        "ToolArgsMap",
        "ToolOutputMap",
        "ToolName",
        "ToolCallError",
        "Array",
        "Boolean",
        "Error",
        "Function",
        "Number",
        "Object",
        "Promise",
        "Record",
        "String",
        "Symbol",
    }
)


class _TypeScriptTypes(_Types):
    """Renders schemas as TypeScript type expressions: object types inline, a named ``type`` per definition."""

    def __init__(self) -> None:
        super().__init__(_TS_RESERVED)
        self.declarations: list[str] = []

    def any_type(self) -> str:
        return "JsonValue"

    def forward(self, name: str) -> str:
        return name

    def alias(self, name: str, text: str) -> None:
        self.declarations.append(f"type {name} = {text};")

    def unresolved(self, ref: Any) -> str:
        shown = json.dumps(ref) if isinstance(ref, str) else "that is not a string"
        return f"JsonValue here stands for a $ref this SDK does not resolve: {shown}."

    def visit(self, schema: Any, hint: str, depth: int) -> str | _Node:
        if isinstance(schema, _Owned):
            schema = self.owned(schema)
        if isinstance(schema, _Noted):  # no class to carry it: the tool's comment says it
            self.notes.append(schema.elsewhere)
            schema = schema.schema
        if not isinstance(schema, dict):
            return "JsonValue" if schema is True else "unknown"
        if depth > MAX_TYPE_DEPTH:
            return "JsonValue"
        values = _values(schema)
        if values is not None:
            return _union([_ts_literal(v) for v in values])
        reference = self.reference(schema)
        if reference is not None:
            return reference
        variants = self.combinators(schema, hint)
        if variants is not None:
            return variants
        types = _types_of(schema)
        if not types:
            return "JsonValue"
        if len(types) > 1:
            return _Node([({**schema, "type": kind}, hint) for kind in types], _union)
        kind = types[0]
        if kind in _TS_SCALARS:
            return _TS_SCALARS[kind]
        if kind == "array":
            items = _items(schema)
            if items is not None:
                return _Node([(items, hint)], lambda parts: _ts_array(parts[0]))
            return "JsonValue[]"
        if kind != "object":
            return "unknown"
        properties = _allowed_properties(schema)
        extra = _extra(schema)
        if not properties:
            if extra is False:
                return "Record<string, never>"
            if isinstance(extra, dict):  # a map: its values are typed, as in the Python stub
                return _Node([(extra, hint)], lambda parts: f"Record<string, {parts[0]}>")
            return "Record<string, JsonValue>"
        keys = list(properties)
        required = schema.get("required")
        required_set = set(required) if isinstance(required, list) else set()

        def combine(parts: list[str]) -> str:
            fields = "; ".join(
                f"{_ts_key(k)}{'' if k in required_set else '?'}: {p}" for k, p in zip(keys, parts, strict=True)
            )
            text = f"{{ {fields} }}"
            return text if extra is False else f"{text} & Record<string, JsonValue>"

        return _Node([(properties[k], hint) for k in keys], combine)


TYPESCRIPT_RULES: Final = """\
## Writing code for run_code

`run_code` runs a TypeScript program: the body of an async function (erasable syntax only: no `enum` or \
`namespace`; types are advisory; top-level `await` and `return` work).

- Call a tool as `await tools.name(args)`; names that are not identifiers: `await tools["my-tool"](args)`.
- Every call resolves to the tool's JSON value; arguments must be plain JSON.
- A failed call rejects with `ToolCallError` (`toolName` names the tool): use `try`/`catch`.
- Independent calls may overlap under `Promise.all` (concurrency-safe tools run together, the others alone \
in submission order).
- Program output is only what you `return` and/or `console.log`: curate it; everything else stays out of \
the conversation.

The available tools:"""


def render_typescript_sdk(tools: Sequence[SdkTool]) -> str:
    """The TypeScript SDK section (parity renderer)."""
    ordered = sorted(tools, key=lambda t: t.name)
    types = _TypeScriptTypes()
    args_members: list[str] = []
    output_members: list[str] = []
    for tool in ordered:
        key = _ts_key(tool.name)
        stem = _camel(tool.name)  # the name of a root schema a $ref names
        args, output = types.expression(tool.parameters, stem + "Args"), types.expression(tool.output, stem + "Output")
        doc = f"  /** {_ts_comment(' '.join([tool.description, *types.take_notes()]))} */"
        args_members.append(f"{doc}\n  {key}: {args};")
        output_members.append(f"  {key}: {output};")
    blocks = [
        "type JsonValue = string | number | boolean | null | JsonValue[] | { [key: string]: JsonValue };",
        *types.declarations,
        "interface ToolArgsMap {\n" + "\n".join(args_members) + ("\n" if args_members else "") + "}",
        "interface ToolOutputMap {\n" + "\n".join(output_members) + ("\n" if output_members else "") + "}",
        "type ToolName = keyof ToolOutputMap;",
        'declare class ToolCallError extends Error {\n  readonly name: "ToolCallError";\n'
        "  readonly toolName: ToolName;\n}",
        "declare const tools: { [K in ToolName]: (args: ToolArgsMap[K]) => Promise<ToolOutputMap[K]> };",
    ]
    return f"{TYPESCRIPT_RULES}\n\n```ts\n" + "\n\n".join(blocks) + "\n```"


#: Renderers by code-runtime language (looked up as own keys only).
SDK_RENDERERS: Final[Mapping[str, Callable[[Sequence[SdkTool]], str]]] = {
    "python": render_python_sdk,
    "typescript": render_typescript_sdk,
}


def render_sdk(language: str, tools: Sequence[SdkTool]) -> str:
    """Render with the renderer of ``language``; an unknown language raises ``ValueError``."""
    renderer = SDK_RENDERERS.get(language) if isinstance(language, str) else None
    if renderer is None:
        known = ", ".join(f'"{name}"' for name in SDK_RENDERERS)
        raise ValueError(f'dsh: no SDK renderer for code runtime language "{language}" (known: {known})')
    return renderer(tools)
