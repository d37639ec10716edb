"""The lossless flat-token wire shared by the host and the worker.

Standard library only: the worker loads this file by path inside a bare
``-I -S`` interpreter, and the host imports it as
``dsh_core.coderuntime.worker.wire``.

Values
    A JSON value travels as one flat list of tokens in pre-order. Scalar
    tokens are ``None``, ``bool``, ``int``, finite ``float`` (never ``-0.0``)
    and ``str``. A container is a marker dict with exactly one key followed by
    its children: ``{"a": n}`` for an array of ``n`` items, ``{"o": [k, ...]}``
    for an object whose (unique, string) keys are listed in order. Encoding and
    decoding walk explicit stacks, so depth is bounded by memory only and the
    recursion limit is never touched. Decoding fails closed (:class:`WireError`)
    on anything malformed; nothing is ever converted "best effort". A ``str``
    (value or key) holding a high surrogate right before a low one is refused
    both ways: JSON text writes the two as escapes that every parser reads back
    as one character (lone surrogates cross as they are). An int
    longer than Python's int/str digit limit (4,300 by default) has no JSON
    text: writing it (:func:`pack`, :func:`tokens_json_size`) fails the same way.

Frames
    A frame is a 4-byte big-endian length and a UTF-8 JSON message (lone
    surrogates pass through with ``surrogatepass`` so every ``str`` survives).
    Messages are shallow JSON objects; values inside them are token lists, so
    the C JSON parser never needs deep recursion for legitimate traffic.

Output ledger
    :class:`Ledger` counts the exact UTF-8 bytes of the compact JSON of the
    logs array plus the value (or failure message), the same way on both sides.
"""

from __future__ import annotations

import functools
import gc
import json
import math
import re
import struct
import sys
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "WireError",
    "encode",
    "decode",
    "tokens_json_size",
    "json_str_size",
    "join_pairs",
    "truncate_json_str",
    "pack",
    "unpack_payload",
    "FrameBuffer",
    "Ledger",
    "HEADER",
]

HEADER = struct.Struct(">I")

_NONE = type(None)
_SCALAR = frozenset((str, int, bool, _NONE))
#: The int <-> str digit limit text is written under, on both sides: the worker's, which runs in a
#: bare ``-I`` interpreter with an empty environment and so starts with Python's default whatever
#: the host's environment or ``-X int_max_str_digits`` say. An int past it (one the worker's parser
#: would refuse) is refused as :class:`WireError` and never sent, whatever a program or the host
#: later sets. Checked while writing the text, not in :func:`encode`: a check per int there would
#: slow every value down for a case this rare.
_INT_DIGITS = sys.int_info.default_max_str_digits
_INT_BOUND = 10**_INT_DIGITS
_isfinite = math.isfinite
_copysign = math.copysign


_F = TypeVar("_F", bound=Callable[..., object])


def _no_gc(function: _F) -> _F:
    # The walks allocate one container per node; letting the cyclic GC
    # traverse a large, still-growing value on every generation-0 threshold
    # makes them quadratic in practice. Nothing they build can form a cycle.
    @functools.wraps(function)
    def wrapper(*args: object) -> object:
        if not gc.isenabled():
            return function(*args)
        try:  # disabled inside the try: a signal raised just after it still re-enables
            gc.disable()
            return function(*args)
        finally:
            gc.enable()

    return wrapper  # type: ignore[return-value]


class WireError(ValueError):
    """A value is not lossless JSON, or a token stream / frame is malformed.

    For a value :func:`encode` refused, ``path`` holds the keys and indexes
    from the value to the culprit, and the message names where it is (see
    :meth:`describe`); ``reason`` is the message without the place.
    """

    def __init__(self, reason: str, path: tuple[str | int, ...] | None = None) -> None:
        self.reason = reason
        self.path = path
        super().__init__(self.describe("value"))

    def describe(self, root: str) -> str:
        """The reason and, for a culprit inside the value, where: ``... at result["rows"][2]``."""
        if not self.path:
            return self.reason
        return f"{self.reason} at {root}{_subscripts(self.path)}"


def _subscripts(path: tuple[str | int, ...]) -> str:
    parts = [
        f"[{json.dumps(key[:40] + '...' if len(key) > 40 else key)}]" if type(key) is str else f"[{key}]"
        for key in path
    ]
    if len(parts) > 16:  # a deep culprit: its first and last steps
        parts[8:-8] = ["..."]
    return "".join(parts)


# --------------------------------------------------------------------------- values


def _bad_float(value: float) -> bool:
    return not _isfinite(value) or (value == 0.0 and _copysign(1.0, value) < 0)


def _scalar_error(value: object) -> str:
    kind = type(value)
    if kind is float:
        if _isfinite(value):  # type: ignore[arg-type]
            return "float -0.0 is not lossless JSON (it reads back as 0; use 0.0, e.g. x + 0.0)"
        return f"float {value!r} is not lossless JSON (JSON has no NaN or infinity)"
    for base in (bool, int, float, str, dict, list):
        if isinstance(value, base):
            name = base.__name__
            return f"{kind.__qualname__} is a subclass of {name}, not a plain {name} (convert it: {name}(x))"
    if isinstance(value, (tuple, set, frozenset)):
        return f"{kind.__qualname__} is not a JSON type (use a list)"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"{kind.__qualname__} is not a JSON type (decode it to a str)"
    return f"{kind.__qualname__} is not a JSON type"


#: A high surrogate then a low one: two code points of a ``str`` that JSON text makes one character.
_SPLIT_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]").search


def _split_pair(text: str) -> bool:
    """Whether a non-ASCII ``text`` holds a high surrogate immediately followed by a low one.

    Callers ask only for a non-ASCII ``str`` (``isascii`` is O(1)): an ASCII one holds no surrogate.
    A ``str`` that UTF-8 can hold has none either, and encoding is a C loop twice as fast as the
    search; only one that cannot (rare: a name that was not UTF-8) is searched.
    """
    try:
        text.encode()
    except UnicodeEncodeError:
        return _SPLIT_PAIR(text) is not None
    return False


_isascii = str.isascii


def _has_split_pair(items: list[object], only_str: bool) -> bool:
    """Whether a ``str`` among ``items`` (all of them, with ``only_str``) holds a surrogate pair as two code points."""
    if only_str and all(map(_isascii, items)):  # type: ignore[arg-type]
        return False  # a C loop: a long array of strings pays no Python step per item
    for item in items:  # noqa: SIM110 - any() over a generator costs a frame per item on this hot path
        if type(item) is str and not item.isascii() and _split_pair(item):
            return True
    return False


def join_pairs(text: str) -> str:
    """``text`` with each high surrogate right before a low one joined into the character they spell.

    For text that is shown, not a value (logs, error messages): what any JSON hop would give
    back, so it can be recorded. Lone surrogates, and a low one before a high one, are kept.
    """
    if text.isascii() or not _split_pair(text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


def _pair_at(text: str) -> str:
    found = _SPLIT_PAIR(text)
    assert found is not None
    high, low = map(ord, found.group())
    return f"a surrogate pair written as two code points (U+{high:04X} U+{low:04X} at character {found.start()})"


def _pair_error(text: str) -> str:
    return f"{_pair_at(text)} does not survive JSON (a parser reads one character)"


def _key_pair_error(key: str) -> str:
    shown = repr(key) if len(key) <= 40 else repr(key[:40]) + "..."  # repr escapes every surrogate
    return f"object key {shown} holds {_pair_at(key)}, which does not survive JSON (a parser reads one character)"


def _plain_keys(keys: list[object]) -> bool:
    """Whether every key is a ``str`` that survives JSON text."""
    for key in keys:  # noqa: SIM110 - all() over a generator costs a frame per item on this hot path
        if type(key) is not str or (not key.isascii() and _split_pair(key)):
            return False
    return True


def _all_plain_scalars(children: list[object]) -> bool:
    types = set(map(type, children))
    if types <= _SCALAR:
        return str not in types or not _has_split_pair(children, len(types) == 1)
    if float in types and types <= _SCALAR_OR_FLOAT:
        if any(map(_bad_float, [c for c in children if type(c) is float])):
            return False
        return str not in types or not _has_split_pair(children, False)
    return False


_SCALAR_OR_FLOAT = _SCALAR | {float}


#: Containers up to this many children may take the flat fast paths below.
_FLAT_MAX = 32

#: Shared markers for short arrays. Token lists are only ever read (packed,
#: measured, decoded), so one marker dict can stand for every array of its
#: length: a value with a million small arrays then costs a million
#: references, not a million dicts.
_ARRAY_MARKERS = tuple({"a": n} for n in range(64))


def encode(value: object) -> list[object]:
    """Encode ``value`` as a flat token list; raise :class:`WireError` if it is lossy.

    Only exact ``dict``/``list``/``str``/``int``/``float``/``bool``/``None``
    are accepted (no subclasses, no tuples), dict keys must be ``str``, floats
    finite and not ``-0.0``; cycles are refused.

    A scalar, or a small container whose children are all plain scalars (the
    shape of most binding arguments and results), is encoded directly; the
    tokens are exactly those of the general walk (:func:`_encode_walk`), which
    handles everything else, including every refusal and its message.

    The result is read-only: the markers of arrays shorter than 64 items are
    shared by every token list (changing one would change them all).
    """
    kind = type(value)
    if kind is str:
        if value.isascii() or not _split_pair(value):  # type: ignore[attr-defined,arg-type]
            return [value]
    elif kind is int or kind is bool or value is None:
        return [value]
    elif kind is dict:
        if len(value) <= _FLAT_MAX:  # type: ignore[arg-type]
            pairs: list[tuple[object, object]] = list(dict.items(value))  # type: ignore[arg-type]  # one snapshot
            keys = [pair[0] for pair in pairs]
            children = [pair[1] for pair in pairs]
            if _plain_keys(keys) and _all_plain_scalars(children):
                return [{"o": keys}, *children]
    elif kind is list:
        if len(value) <= _FLAT_MAX:  # type: ignore[arg-type]
            children = list.copy(value)  # type: ignore[arg-type]
            if _all_plain_scalars(children):
                return [_ARRAY_MARKERS[len(children)], *children]
    elif kind is float and not _bad_float(value):  # type: ignore[arg-type]
        return [value]
    try:
        return _encode_walk(value)
    except WireError as error:  # only now is the place of the culprit looked for
        raise _located(value, error) from None


@_no_gc
def _located(value: object, error: WireError) -> WireError:
    """``error`` with the path to its culprit: the walk of :func:`_encode_walk` again, keeping keys.

    On the error path only, so the encoder itself keeps no path. A value that
    changed meanwhile (a thread) may hold no culprit any more: ``error`` as it is.
    """
    keys: list[str | int] = []  # the key of each open container but the root
    stack: list[Any] = []
    ids: list[int] = []
    on_path: set[int] = set()
    iterator: Any = iter([(None, value)])
    while True:
        for key, child in iterator:
            kind = type(child)
            if kind is int or kind is bool or child is None:
                continue
            path = (*keys, key) if stack else ()
            if kind is str:
                if not child.isascii() and _split_pair(child):
                    return WireError(_pair_error(child), path)
            elif kind is float:
                if _bad_float(child):
                    return WireError(_scalar_error(child), path)
            elif kind is list or kind is dict:
                ident = id(child)
                if ident in on_path:
                    return WireError("cycle: a container contains itself", path)
                if kind is list:
                    items: list[Any] = list(enumerate(list.copy(child)))
                else:
                    items = list(dict.items(child))
                    for name, _ in items:
                        if type(name) is not str:
                            return WireError(f"object key {name!r} ({type(name).__name__}) is not a str", path)
                        if not name.isascii() and _split_pair(name):
                            return WireError(_key_pair_error(name), path)
                if stack:
                    keys.append(key)
                stack.append(iterator)
                ids.append(ident)
                on_path.add(ident)
                iterator = iter(items)
                break
            else:
                return WireError(_scalar_error(child), path)
        else:
            if not stack:
                return error
            on_path.discard(ids.pop())
            iterator = stack.pop()
            if stack:
                keys.pop()


@_no_gc
def _encode_walk(value: object) -> list[object]:
    """The general encoder: an explicit-stack walk of any value (see :func:`encode`)."""
    out: list[object] = []
    append = out.append
    # One explicit frame per open container: its children iterator and id
    # (``on_path`` holds the ids of the open containers, to refuse cycles).
    stack: list[object] = []
    ids: list[int] = []
    on_path: set[int] = set()
    pending = [value]
    iterator: object = iter(pending)
    while True:
        for child in iterator:  # type: ignore[attr-defined]
            kind = type(child)
            if kind is str:
                if not child.isascii() and _split_pair(child):
                    raise WireError(_pair_error(child))
                append(child)
            elif kind is int or kind is bool or child is None:
                append(child)
            elif kind is float:
                if _bad_float(child):
                    raise WireError(_scalar_error(child))
                append(child)
            elif kind is list or kind is dict:
                ident = id(child)
                if ident in on_path:
                    raise WireError("cycle: a container contains itself")
                if kind is list:
                    children = list.copy(child)  # a snapshot: threads may mutate the original
                    count = len(children)
                    append(_ARRAY_MARKERS[count] if count < 64 else {"a": count})
                else:
                    pairs = list(dict.items(child))
                    keys = [pair[0] for pair in pairs]
                    for key in keys:
                        if type(key) is not str:
                            raise WireError(f"object key {key!r} ({type(key).__name__}) is not a str")
                        if not key.isascii() and _split_pair(key):
                            raise WireError(_key_pair_error(key))
                    append({"o": keys})
                    children = [pair[1] for pair in pairs]
                if not children:
                    continue
                if len(children) > 8 and _all_plain_scalars(children):
                    out.extend(children)  # fast path: no frame for a flat container
                    continue
                stack.append(iterator)
                ids.append(ident)
                on_path.add(ident)
                iterator = iter(children)
                break
            else:
                raise WireError(_scalar_error(child))
        else:
            if not stack:
                return out
            on_path.discard(ids.pop())
            iterator = stack.pop()


def decode(tokens: object) -> object:
    """Rebuild the value of a token list; raise :class:`WireError` when malformed.

    Fails closed on: a non-list or empty input, a marker with wrong/extra
    fields, a bad length, non-string or duplicate keys, a claim of more
    children than tokens remain, non-finite numbers or ``-0.0``, a ``str`` or
    key holding a surrogate pair written as two code points, nested lists
    used as tokens, trailing tokens, and frames left open.

    A lone scalar, or one marker followed by exactly its plain scalar
    children, is accepted directly when it is well-formed; anything else
    (including everything malformed) goes through :func:`_decode_walk`, so the
    accepted values and the refusals are exactly the general walk's.
    """
    if type(tokens) is list:
        count = len(tokens)
        if count == 1:
            token = tokens[0]
            kind = type(token)
            if kind is str:
                if token.isascii() or not _split_pair(token):
                    return token
            elif kind is int or kind is bool or token is None:
                return token
            if kind is float and not _bad_float(token):
                return token
        elif 1 < count <= _FLAT_MAX + 1:
            marker = tokens[0]
            if type(marker) is dict and len(marker) == 1:
                children = tokens[1:]
                if "a" in marker:
                    length = marker["a"]
                    if type(length) is int and length == count - 1 and _all_plain_scalars(children):
                        return children
                elif "o" in marker:
                    keys = marker["o"]
                    if (
                        type(keys) is list
                        and len(keys) == count - 1
                        and _plain_keys(keys)
                        and len(set(keys)) == len(keys)
                        and _all_plain_scalars(children)
                    ):
                        return dict(zip(keys, children, strict=True))
    return _decode_walk(tokens)


@_no_gc
def _decode_walk(tokens: object) -> object:
    """The general decoder: one pass over the tokens with an explicit stack (see :func:`decode`).

    The innermost open container is held in locals (its values list's ``append``, its keys for an
    object, how many children it still awaits: ``left``, 0 when none is open), the ones around it
    on ``stack``; ``claimed`` is the index of the last token an open marker claims, so a marker's
    claim is checked against the tokens that remain without counting each token down.
    """
    if type(tokens) is not list or not tokens:
        raise WireError("a value must be a non-empty token list")
    total = len(tokens)
    stack: list[tuple[Any, Any, Any, int]] = []  # (container, keys-or-None, values, left) of each outer one
    container: Any = None
    keys: Any = None
    values: Any = None
    append: Any = None
    left = 0
    claimed = 0
    root: object = None
    for index, token in enumerate(tokens, 1):
        kind = type(token)
        if kind is dict:
            if len(token) != 1:
                raise WireError("a marker has exactly one field")
            if "a" in token:
                count = token["a"]
                if type(count) is not int or count < 0:
                    raise WireError("array marker length must be an int >= 0")
                child_keys = None
            elif "o" in token:
                child_keys = token["o"]
                if type(child_keys) is not list:
                    raise WireError("object marker keys must be a list")
                for key in child_keys:
                    if type(key) is not str:
                        raise WireError("object keys must be strings")
                    if not key.isascii() and _split_pair(key):
                        raise WireError("an object key holds " + _pair_error(key)[2:])
                count = len(child_keys)
                if (claimed if left else index) + count > total:  # before the set: only keys whose values follow
                    raise WireError("a marker claims more children than tokens remain")
                if len(set(child_keys)) != count:
                    raise WireError("duplicate object key")
            else:
                raise WireError("unknown marker field")
            # Inside a container every token up to ``claimed`` is claimed already; outside, none after this one.
            claimed = (claimed if left else index) + count
            if claimed > total:
                raise WireError("a marker claims more children than tokens remain")
            child: Any = [] if child_keys is None else {}
            if left:
                append(child)
                left -= 1
            elif index == 1:
                root = child
            else:
                raise WireError("trailing tokens after the root value")
            if count:
                if container is not None:
                    stack.append((container, keys, values, left))
                container, keys = child, child_keys
                values = child if child_keys is None else []
                append = values.append
                left = count
                continue
        else:
            if kind is str:
                if not token.isascii() and _split_pair(token):
                    raise WireError("a str token holds " + _pair_error(token)[2:])
            elif kind is float:
                if _bad_float(token):
                    raise WireError("non-finite number or -0.0 in token stream")
            elif not (kind is int or kind is bool or token is None):
                raise WireError(f"{kind.__name__} is not a valid token")
            if left:
                append(token)
                left -= 1
            elif index == 1:
                root = token
                continue
            else:
                raise WireError("trailing tokens after the root value")
        while not left and container is not None:  # the innermost open container is complete
            if keys is not None:
                container.update(zip(keys, values, strict=True))
            if stack:
                container, keys, values, left = stack.pop()
                append = values.append
            else:
                container = None
    if left:
        raise WireError("the token stream ends with open containers")
    return root


# --------------------------------------------------------------------------- sizes


def _utf8_len(text: str) -> int:
    # Lone surrogates are counted as their 6-byte ``\\udXXX`` JSON escape.
    return len(text.encode("utf-8", "backslashreplace"))


_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def json_str_size(text: str) -> int:
    """Exact UTF-8 bytes of ``text`` as a compact JSON string (quotes included)."""
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return len(text) + 2
    return _utf8_len(_COMPACT.encode(text))


def tokens_json_size(tokens: list[object]) -> int:
    """Exact UTF-8 bytes of the compact JSON text of the value that ``tokens`` encode.

    Works on a token list that :func:`decode` accepted (or :func:`encode`
    produced) without rebuilding the value, so deep values are measured
    without recursion.
    """
    scalars: list[object] = []
    keys: list[str] = []
    overhead = 0
    for token in tokens:
        if type(token) is dict:
            if "a" in token:
                n = token["a"]
                overhead += 2 + (n - 1 if n else 0)
            else:
                names = token["o"]
                n = len(names)
                keys.extend(names)
                overhead += 2 + n + (n - 1 if n else 0)
        else:
            scalars.append(token)
    size = overhead
    for group in (scalars, keys):
        if group:
            size += _utf8_len(_json_text(_COMPACT, group)) - 2 - (len(group) - 1)
    return size


def _json_text(encoder: json.JSONEncoder, value: object) -> str:
    """``encoder.encode(value)``; WireError for an int of more than ``_INT_DIGITS`` digits.

    Never changes the digit limit, which is process-wide: a host thread (or a program's) that
    lifted it may be converting a long int right now. Under a lifted limit the text is written
    and the ints checked after (rare: only then is the walk paid); under a lowered one an int
    past that limit is refused too (it cannot be written without lifting it).
    """
    limit = sys.get_int_max_str_digits()
    try:
        text = encoder.encode(value)
    except ValueError:  # the only one tokens can raise: NaN and infinities never get this far
        raise _long_int_error(limit if 0 < limit < _INT_DIGITS else _INT_DIGITS) from None
    if (limit == 0 or limit > _INT_DIGITS) and _has_long_int(value):
        raise _long_int_error(_INT_DIGITS)
    return text


def _long_int_error(digits: int) -> WireError:
    return WireError(
        f"int of more than {digits} digits does not survive JSON (Python refuses to convert it to and from text)"
    )


def _has_long_int(value: object) -> bool:
    """Whether a (shallow) message or token list holds an int of more than ``_INT_DIGITS`` digits."""
    bound = _INT_BOUND
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is int:
            if not -bound < item < bound:
                return True
        elif kind is list:
            stack.extend(item)
        elif kind is dict:
            stack.extend(item.values())
    return False


def truncate_json_str(text: str, budget: int) -> str:
    """The longest prefix of ``text`` whose compact JSON string fits ``budget`` bytes."""
    if budget < 2:
        return ""
    if json_str_size(text) <= budget:
        return text
    escaped = _COMPACT.encode(text)[1:-1].encode("utf-8", "backslashreplace")
    cut = escaped[: budget - 2].decode("utf-8", "ignore")
    # Back off over a partial escape sequence (at most 6 characters long).
    for _ in range(8):
        try:
            prefix = json.loads('"' + cut + '"')
        except ValueError:
            cut = cut[:-1]
            continue
        if type(prefix) is str and text.startswith(prefix) and json_str_size(prefix) <= budget:
            return prefix
        cut = cut[:-1]
    return ""


#: A log entry held costs its reader (the host, and whatever shows the result) about 60 bytes beyond
#: its text, while the output budget counts it as 3 (two quotes and a comma): a flood of two-letter
#: lines within 64 MiB would be 13 million entries, a gigabyte on the host. So a run may also write
#: at most one entry per this many bytes of its budget (at least ``MIN_LOG_ENTRIES``).
LOG_ENTRY_BYTES = 64
MIN_LOG_ENTRIES = 1024


class Ledger:
    """The output budget: compact JSON bytes of the logs array plus the outcome.

    ``[]`` costs 2, each log its JSON string bytes plus a comma after the
    first. :meth:`add` refuses the first log that does not fit and keeps a
    bounded copy of it so the final result can carry its fitting prefix.
    It also refuses a log past ``max_entries`` (one per ``LOG_ENTRY_BYTES``
    of the cap), which bounds what holding the logs takes.
    """

    __slots__ = ("cap", "logs", "used", "overflow", "tail", "max_entries", "counted_out")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.logs: list[str] = []
        self.used = 2
        self.overflow = False
        self.tail: str | None = None
        self.max_entries = max(cap // LOG_ENTRY_BYTES, MIN_LOG_ENTRIES)
        self.counted_out = False  # a log was refused for the number of entries, not for its bytes

    def add(self, text: str) -> bool:
        """Append one log entry; return False (and remember a prefix) on overflow."""
        if self.overflow:
            return False
        if self.entries_full:
            self.overflow = self.counted_out = True  # no tail: no bytes of it were over
            return False
        cost = json_str_size(text) + (1 if self.logs else 0)
        if self.used + cost <= self.cap:
            self.logs.append(text)
            self.used += cost
            return True
        self.overflow = True
        self.tail = text[: self.cap]
        return False

    def fits(self, size: int) -> bool:
        """True when an outcome of ``size`` JSON bytes still fits after the logs."""
        return not self.overflow and self.used + size <= self.cap

    @property
    def entries_full(self) -> bool:
        """True when no further log entry may be added, whatever its size."""
        return len(self.logs) >= self.max_entries

    def limit_message(self) -> str:
        """The output-limit diagnostic: the byte cap, or the entry cap when that is what was reached."""
        if self.counted_out:
            floor = f", at least {MIN_LOG_ENTRIES}" if self.cap // LOG_ENTRY_BYTES < MIN_LOG_ENTRIES else ""
            return (
                f"outer output exceeded {self.max_entries} log entries (one per {LOG_ENTRY_BYTES} bytes "
                f"of the {self.cap}-byte output cap{floor}); print fewer, longer lines"
            )
        return f"outer output exceeded {self.cap} bytes"

    def fitted(self, message: str) -> tuple[list[str], str]:
        """Logs prefix and (possibly truncated) ``message`` that fit the cap together."""
        message_size = json_str_size(message)
        if 2 + message_size > self.cap:
            return [], truncate_json_str(message, self.cap - 2)
        room = self.cap - message_size
        kept: list[str] = []
        used = 2
        entries = list(self.logs)
        if self.tail is not None:
            entries.append(self.tail)
        for entry in entries:
            sep = 1 if kept else 0
            cost = json_str_size(entry) + sep
            if used + cost <= room:
                kept.append(entry)
                used += cost
                continue
            prefix = truncate_json_str(entry, room - used - sep)
            if prefix:
                kept.append(prefix)
            break
        return kept, message


# --------------------------------------------------------------------------- frames


def _reject_constant(name: str) -> object:
    raise WireError(f"{name} is not JSON")


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


_pack_header = HEADER.pack
# The C scanner behind ``_DECODER`` (same parse_constant hook). Calling it
# directly skips ``JSONDecoder.decode``'s two whitespace regex matches where
# there is no whitespace around the value; where there is, :func:`_unpack`
# skips it with the same pattern ``JSONDecoder.decode`` uses, so it accepts and
# refuses exactly what the full decoder does. It never parses a text twice: a
# fallback to ``_DECODER.decode`` after a whole parse would hold both results
# at once (twice what reading the frame takes, past ``framecost``'s bound).
_scan_once: Callable[[str, int], tuple[object, int]] = _DECODER.scan_once  # type: ignore[attr-defined]
# json.decoder.WHITESPACE; it matches (maybe nothing) at every offset.
_skip_space: Callable[[str, int], re.Match[str]] = re.compile(r"[ \t\n\r]*").match  # type: ignore[assignment]


def pack(message: dict[str, object]) -> bytes:
    """Serialize one message as a length-prefixed frame; WireError for an int too long to write."""
    payload = _json_text(_ENCODER, message).encode("utf-8", "surrogatepass")
    return _pack_header(len(payload)) + payload


#: Payloads from this size on are parsed with the cyclic GC paused (see :func:`_no_gc`):
#: the parser allocates one container per marker, and nothing it builds can form a cycle.
_LARGE_PAYLOAD = 1 << 16


def unpack_payload(payload: bytes) -> object:
    """Parse one frame payload; raise :class:`WireError` on anything malformed."""
    if len(payload) >= _LARGE_PAYLOAD:
        return _unpack_large(payload)
    return _unpack(payload)


@_no_gc
def _unpack_large(payload: bytes) -> object:
    return _unpack(payload)


def _unpack(payload: bytes) -> object:
    try:
        text = payload.decode("utf-8", "surrogatepass")
        size = len(text)
        try:
            value, end = _scan_once(text, 0)
        except StopIteration:  # no value at offset 0 (empty, or leading whitespace)
            start = _skip_space(text, 0).end()
            if not start:
                raise WireError("malformed frame: JSONDecodeError") from None
            try:
                value, end = _scan_once(text, start)
            except StopIteration:
                raise WireError("malformed frame: JSONDecodeError") from None
        if end == size or _skip_space(text, end).end() == size:
            return value
        del value  # extra data: refused, and not held while the refusal propagates
        raise WireError("malformed frame: JSONDecodeError")
    except WireError:
        raise
    except (ValueError, RecursionError, MemoryError) as error:
        raise WireError(f"malformed frame: {type(error).__name__}") from None


class FrameBuffer:
    """Reassembles frames from a byte stream and enforces the frame size cap."""

    __slots__ = ("buffer", "max_frame")

    def __init__(self, max_frame: int) -> None:
        self.buffer = bytearray()
        self.max_frame = max_frame

    def feed(self, data: bytes) -> list[bytes]:
        """Add bytes; return the complete payloads; raise WireError on an oversized frame."""
        buffer = self.buffer
        if not buffer and type(data) is bytes and len(data) >= 4:
            # Fast path: exactly one whole frame in one read (the common case).
            (size,) = HEADER.unpack_from(data)
            if size > self.max_frame:
                raise WireError(f"frame of {size} bytes exceeds the {self.max_frame}-byte cap")
            if len(data) == size + 4:
                return [data[4:]]
        buffer += data
        frames: list[bytes] = []
        start = 0
        end = len(buffer)
        with memoryview(buffer) as view:  # one copy per frame: a bytearray slice would be a second
            while end - start >= 4:
                (size,) = HEADER.unpack_from(buffer, start)
                if size > self.max_frame:
                    raise WireError(f"frame of {size} bytes exceeds the {self.max_frame}-byte cap")
                if end - start - 4 < size:
                    break
                frames.append(bytes(view[start + 4 : start + 4 + size]))
                start += 4 + size
        if start:
            del buffer[:start]
        return frames
