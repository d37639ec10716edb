"""Lossless JSON: the only values that cross a dsh boundary.

A value is *lossless* when ``json.loads(json.dumps(value)) == value`` holds
exactly and type for type: ``None``, ``bool``, ``int``, finite ``float`` (not
``-0.0``), ``str``, ``list`` and ``dict`` with ``str`` keys, nested without
cycles. Tuples, sets, bytes, NaN/Infinity, non-string keys and subclasses of
the JSON types (``IntEnum``, ``OrderedDict``, a ``str`` subclass, ...) are
refused: they would come back as something else, so dsh fails closed instead
of converting "best effort". So is a ``str`` (value or key) holding a high
surrogate right before a low one, two code points that JSON text writes as
``"\\ud83d\\ude00"`` and every parser reads back as one character; lone
surrogates (a file name that is not UTF-8), and a low one before a high one,
come back as they were and are kept.

Every walk here is iterative: depth is bounded by memory, never by the
interpreter's recursion limit.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterator
from typing import Any, NoReturn, TypeAlias

__all__ = [
    "JSON",
    "FrozenDict",
    "FrozenList",
    "NotLosslessError",
    "find_loss",
    "is_lossless",
    "snapshot",
    "freeze",
    "thaw",
    "pointer",
    "dumps",
    "join_surrogate_pairs",
]

#: A lossless JSON value (kept as ``Any`` so it composes with typed callers).
JSON: TypeAlias = Any


class NotLosslessError(TypeError):
    """A value is not lossless JSON; ``path`` is a JSON pointer to the culprit."""

    def __init__(self, path: str, reason: str) -> None:
        where = f"at {path}" if path else "at the root"
        super().__init__(f"not lossless JSON {where}: {reason}")
        self.path = path
        self.reason = reason


def _immutable(self: object, *args: object, **kwargs: object) -> NoReturn:
    raise TypeError(f"{type(self).__name__} is immutable (a frozen lossless JSON value)")


class FrozenDict(dict[str, Any]):
    """A JSON object that refuses mutation. Built only by :func:`freeze`."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__()

    __setitem__ = __delitem__ = _immutable
    clear = pop = popitem = setdefault = update = __ior__ = _immutable

    def __copy__(self) -> FrozenDict:
        return self

    def __deepcopy__(self, memo: object) -> FrozenDict:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (freeze, (thaw(self),))


class FrozenList(list[Any]):
    """A JSON array that refuses mutation. Built only by :func:`freeze`."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__()

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _immutable
    append = extend = insert = pop = remove = clear = sort = reverse = _immutable

    def __copy__(self) -> FrozenList:
        return self

    def __deepcopy__(self, memo: object) -> FrozenList:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (freeze, (thaw(self),))


_SCALARS = (type(None), bool, int, str)
#: Exact types that every walk returns unchanged (floats are not here: they need their checks; so do
#: ints beyond ``_SAFE_INT``).
_IMMUTABLE_SCALARS: frozenset[type] = frozenset(_SCALARS)
_CONTAINERS = (dict, list, FrozenDict, FrozenList)
#: Ints strictly between -_SAFE_INT and _SAFE_INT always have a JSON text: Python refuses int <-> str
#: conversions past ``sys.get_int_max_str_digits()``, which can be set no lower than 640 digits.
_SAFE_INT = 10**600
_SAFE_INT_FLOOR = -_SAFE_INT  # once: negating it in every check allocates a 2,000-bit int each time
_DICTS = (dict, FrozenDict)
_LISTS = (list, FrozenList)


#: A high surrogate then a low one: two code points of a ``str`` that JSON text makes one character.
_SPLIT_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]").search


def _split_pair(text: str) -> bool:
    """Whether a non-ASCII ``text`` holds a high surrogate immediately followed by a low one.

    Callers ask only for a non-ASCII ``str`` (``isascii`` is O(1)): an ASCII one holds no surrogate.
    A ``str`` that UTF-8 can hold has none either, and encoding is a C loop twice as fast as the
    search; only one that cannot (rare: a name that was not UTF-8, through ``surrogateescape``) is
    searched.
    """
    try:
        text.encode()
    except UnicodeEncodeError:
        return _SPLIT_PAIR(text) is not None
    return False


def join_surrogate_pairs(text: str) -> str:
    """``text`` with each high surrogate right before a low one joined into the character they spell.

    For text that is shown, not a value (a result's content, an error message): what every JSON
    hop gives back, so it can be recorded. Lone surrogates, and a low one before a high one, are kept.
    """
    if text.isascii() or not _split_pair(text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


def _pair_loss(text: str) -> str | None:
    """Why a non-ASCII ``text`` does not survive JSON, or ``None``."""
    if not _split_pair(text):
        return None
    return f"{_pair_at(text)} does not survive JSON (a parser reads one character)"


def _key_loss(key: str) -> str:
    shown = repr(key) if len(key) <= 40 else repr(key[:40]) + "..."  # repr escapes every surrogate
    return f"object key {shown} holds {_pair_at(key)}, which does not survive JSON (a parser reads one character)"


def _pair_at(text: str) -> str:
    found = _SPLIT_PAIR(text)
    assert found is not None
    high, low = map(ord, found.group())
    return f"a surrogate pair written as two code points (U+{high:04X} U+{low:04X} at character {found.start()})"


def pointer(parts: Iterator[str | int] | list[str | int] | tuple[str | int, ...]) -> str:
    """Render path parts as a JSON pointer (RFC 6901): ``["a", 0]`` -> ``/a/0``."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _scalar_loss(value: object) -> str | None:
    kind = type(value)
    if kind in _SCALARS:
        if kind is int:
            if not _SAFE_INT_FLOOR < value < _SAFE_INT:  # type: ignore[operator]
                return _int_loss(value)  # type: ignore[arg-type]
        elif kind is str and not value.isascii():  # type: ignore[attr-defined]
            return _pair_loss(value)  # type: ignore[arg-type]
        return None
    if kind is float:
        if not math.isfinite(value):  # type: ignore[arg-type]
            return f"float {value!r} is not finite"
        if value == 0.0 and math.copysign(1.0, value) < 0:
            return "float -0.0 does not survive JSON (it reads back as 0)"
        return None
    if kind in _CONTAINERS:
        return None
    return _describe(value)


def _int_loss(value: int) -> str | None:
    try:
        int.__repr__(value)
    except ValueError:
        return (
            f"int of more than {sys.get_int_max_str_digits()} digits does not survive JSON "
            "(Python refuses to convert it to and from text)"
        )
    return None


def _describe(value: object) -> str:
    kind = type(value)
    for base in (bool, int, float, str, dict, list):
        if isinstance(value, base):
            return f"{kind.__qualname__} is a subclass of {base.__name__}, not a plain {base.__name__}"
    if isinstance(value, tuple):
        return "tuple is not a JSON array (use a list)"
    if isinstance(value, (set, frozenset)):
        return f"{kind.__name__} is not JSON (use a list)"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"{kind.__name__} is not JSON (decode it to a str)"
    return f"{kind.__qualname__} is not a JSON type"


def _walk(value: object, build: int) -> Any:
    """Shared iterative walker. ``build``: 0 check only, 1 plain copy, 2 frozen copy.

    Raises :class:`NotLosslessError` at the first problem, in document order.
    """
    if type(value) is dict and _flat_scalars(value):
        # The common case (tool arguments): one object of strings, ints, bools and nulls.
        if build == 0:
            return None
        out: dict[str, Any] = _new_frozen_dict() if build == 2 else {}
        dict.update(out, value)
        return out
    reason = _scalar_loss(value)
    if reason is not None:
        raise NotLosslessError("", reason)
    if not isinstance(value, (dict, list)):
        return value
    if build == 2 and _is_sealed(value):
        return value

    # Each frame: (source container, its items iterator, the key path, the output container).
    root_out = _new_container(value, build)
    stack: list[tuple[Any, Iterator[tuple[str | int, Any]], str | int | None, Any]] = [
        (value, _items(value), None, root_out)
    ]
    on_path: set[int] = {id(value)}
    while stack:
        source, items, _, out = stack[-1]
        advanced = False
        for key, child in items:
            if type(key) is not str:
                if isinstance(source, dict):
                    path = pointer(_path(stack))
                    raise NotLosslessError(path, f"object key {key!r} ({type(key).__name__}) is not a string")
            elif not key.isascii() and _split_pair(key):
                raise NotLosslessError(pointer(_path(stack)), _key_loss(key))
            reason = _scalar_loss(child)
            if reason is not None:
                raise NotLosslessError(pointer([*_path(stack), key]), reason)
            if isinstance(child, (dict, list)):
                if id(child) in on_path:
                    raise NotLosslessError(pointer([*_path(stack), key]), "cycle: a container contains itself")
                if build == 2 and _is_sealed(child):
                    _store(out, key, child, build)
                    continue
                child_out = _new_container(child, build)
                _store(out, key, child_out, build)
                on_path.add(id(child))
                stack.append((child, _items(child), key, child_out))
                advanced = True
                break
            _store(out, key, child, build)
        if not advanced:
            stack.pop()
            on_path.discard(id(source))
    return root_out


def _flat_scalars(value: dict[Any, Any]) -> bool:
    # A plain loop: all() over a generator costs a frame per item on this hot path.
    # Every str pays one O(1) isascii(); only a non-ASCII one is searched for a surrogate pair.
    scalars = _IMMUTABLE_SCALARS
    split_pair = _split_pair
    for key, child in value.items():
        kind = type(child)
        if type(key) is not str or kind not in scalars or (not key.isascii() and split_pair(key)):
            return False  # the walk says why
        if kind is int:
            if not _SAFE_INT_FLOOR < child < _SAFE_INT:
                return False
        elif kind is str and not child.isascii() and split_pair(child):
            return False
    return True


def _path(stack: list[tuple[Any, Any, str | int | None, Any]]) -> list[str | int]:
    return [frame[2] for frame in stack[1:]]  # type: ignore[misc]


def _items(container: Any) -> Iterator[tuple[str | int, Any]]:
    if isinstance(container, dict):
        return iter(dict.items(container))
    return enumerate(list.__iter__(container))


def _new_container(source: Any, build: int) -> Any:
    if build == 0:
        return None
    if isinstance(source, dict):
        return _new_frozen_dict() if build == 2 else {}
    return _new_frozen_list() if build == 2 else []


def _new_frozen_dict() -> FrozenDict:
    # The same empty object FrozenDict() builds, without running its Python-level __init__.
    return dict.__new__(FrozenDict)


def _new_frozen_list() -> FrozenList:
    return list.__new__(FrozenList)


def _store(out: Any, key: str | int, child: Any, build: int) -> None:
    if build == 0:
        return
    if isinstance(out, dict):
        dict.__setitem__(out, key, child)
    else:
        list.append(out, child)


def _is_sealed(value: Any) -> bool:
    # FrozenDict/FrozenList refuse construction with content and every
    # mutating method, so only freeze() can fill one: its type is its seal.
    return type(value) in (FrozenDict, FrozenList)


def find_loss(value: object) -> NotLosslessError | None:
    """Return the first reason ``value`` is not lossless JSON, or ``None``."""
    try:
        _walk(value, 0)
    except NotLosslessError as error:
        return error
    return None


def is_lossless(value: object) -> bool:
    """True when ``value`` is lossless JSON."""
    return find_loss(value) is None


def snapshot(value: object) -> JSON:
    """Return a detached, plain (mutable) deep copy; raise :class:`NotLosslessError`."""
    kind = type(value)
    if kind is str:
        if value.isascii() or not _split_pair(value):  # type: ignore[attr-defined,arg-type]
            return value
    elif kind in _IMMUTABLE_SCALARS and (kind is not int or _SAFE_INT_FLOOR < value < _SAFE_INT):  # type: ignore[operator]
        return value  # what _walk returns for them, minus its checks (tool values are often scalars)
    return _walk(value, 1)


def freeze(value: object) -> JSON:
    """Return a detached, immutable deep copy; raise :class:`NotLosslessError`.

    Objects become :class:`FrozenDict` and arrays :class:`FrozenList` (still
    ``dict``/``list`` instances, so ``json`` and ``jsonschema`` accept them).
    Freezing a value that :func:`freeze` produced returns it unchanged.
    """
    kind = type(value)
    if kind is str:
        if value.isascii() or not _split_pair(value):  # type: ignore[attr-defined,arg-type]
            return value
    elif (
        (kind in _IMMUTABLE_SCALARS and (kind is not int or _SAFE_INT_FLOOR < value < _SAFE_INT))  # type: ignore[operator]
        or kind is FrozenDict
        or kind is FrozenList
    ):
        # What _walk returns for these, without its checks: a nested call freezes the same
        # already-frozen arguments and result several times on its way through the pipeline.
        return value
    return _walk(value, 2)


def thaw(value: object) -> JSON:
    """Return a plain mutable deep copy of a (frozen or plain) lossless value."""
    kind = type(value)
    if kind is str:
        if value.isascii() or not _split_pair(value):  # type: ignore[attr-defined,arg-type]
            return value
    elif kind in _IMMUTABLE_SCALARS and (kind is not int or _SAFE_INT_FLOOR < value < _SAFE_INT):  # type: ignore[operator]
        return value
    return _walk(value, 1)


_SCALAR_TEXT = json.JSONEncoder(ensure_ascii=False).encode
_END = object()


def dumps(value: object, *, indent: int | None = None, max_indent: int | None = None) -> str:
    """JSON text of a lossless value, at any depth; the same text as ``json.dumps``.

    ``indent=None`` gives one line with ``", "``/``": "`` separators; an integer
    gives ``json.dumps(value, indent=n)``'s layout, and ``max_indent`` caps the
    leading spaces of a line (deeper levels still break lines, without more
    indentation). The stdlib encoders recurse and fail past about a thousand
    levels; this one keeps an explicit stack.
    """
    item_sep = ", " if indent is None else ","
    out: list[str] = []
    stack: list[tuple[Iterator[Any], bool, int, list[bool]]] = []
    cap = max_indent if max_indent is not None else -1

    def newline(depth: int) -> str:
        if indent is None:
            return ""
        spaces = indent * depth
        return "\n" + " " * (spaces if cap < 0 else min(spaces, cap))

    def begin(item: Any, depth: int) -> None:
        if isinstance(item, dict):
            if not item:
                out.append("{}")
                return
            out.append("{")
            stack.append((iter(dict.items(item)), True, depth + 1, [True]))
        elif isinstance(item, list):
            if not item:
                out.append("[]")
                return
            out.append("[")
            stack.append((iter(list.__iter__(item)), False, depth + 1, [True]))
        else:
            out.append(_SCALAR_TEXT(item))

    begin(value, 0)
    while stack:
        items, is_object, depth, first = stack[-1]
        item: Any = next(items, _END)
        if item is _END:
            stack.pop()
            out.append(newline(depth - 1) + ("}" if is_object else "]"))
            continue
        out.append(("" if first[0] else item_sep) + newline(depth))
        first[0] = False
        if is_object:
            key, child = item
            out.append(_SCALAR_TEXT(key) + ": ")
            begin(child, depth)
        else:
            begin(item, depth)
    return "".join(out)
