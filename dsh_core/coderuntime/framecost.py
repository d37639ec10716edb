"""What reading one inbound frame can cost the host, bounded from above before it is read.

The host parses every frame a worker sends with the C JSON parser and then
decodes the token lists inside it (:mod:`dsh_core.coderuntime.worker.wire`).
Both build Python objects far larger than the bytes they come from: a
4-byte ``1e5,`` becomes a 24-byte float and two 8-byte slots, a 3-byte ``{},``
a 64-byte dict, and a string with one astral character in it stores every
character in 4 bytes. Measured on CPython 3.11, a forged frame of floats took
ten times its size (a 128 MiB frame: 1.3 GB and 9.6 s of the host's loop), and
nested markers up to 48 times.

:func:`read_cost` bounds that from above, from a few linear scans of the
bytes (no parse), so the host can refuse a frame before reading it and can
count what the binding arguments it holds may take. The constants are upper
bounds of what CPython allocates per JSON element, checked against measured
peaks in ``tests/coderuntime/test_framecost.py``:

* every value inside a container is preceded by ``[``, ``{``, ``,`` or ``:``,
  so those bytes bound the number of values;
* each ``,`` or ``:`` pays for the value after it: its slot in the parsed list
  or dict, its slot in the decoded value, and the number object (ints and
  floats up to 19 digits);
* a number's digits are copied out as bytes before they are converted (an
  int past the 4,300-digit limit is refused only then), so the bytes outside
  strings are paid once more (the first count, which takes every byte for a
  string's, already pays each at least once for the string);
* each ``[`` or ``{`` pays for a container (a marker dict, its key list, the
  decoded list or dict);
* each pair of quotes pays for a string object's header, and the characters
  are paid by the byte: once for the text the frame is decoded into, once
  for the strings parsed out of it, each at up to 4 bytes a character
  unless the bytes show that no character needs that many.

Decoding the bytes into text takes, at its peak, the payload, a copy of it
(held by the exception a lone surrogate raises inside ``surrogatepass``) and
the text both at its final width and at the narrower one it is widened from:
up to 8 times the payload when a character needs 4 bytes. Neither count goes
below that.

Bytes that sit inside strings are counted as separators and brackets too,
which only overestimates; a frame over budget by that first count is
counted again with its strings taken out, unless it has so many strings that
taking them out would itself hold the loop.
"""

from __future__ import annotations

import re

__all__ = ["read_cost", "EXACT_FROM"]

#: Frames shorter than this are bounded by their length alone (:data:`_PER_BYTE` times it),
#: without a scan: on the path of every small binding call, a scan would cost more than it saves.
#: Not higher: the binding arguments in flight are counted by this bound, and at 1 KiB a genuine
#: call of a 900-byte string counted 65 KB (against about 10 KB scanned), so a program with
#: about 1,030 such calls running at once exceeded a 64 MiB budget. Below 256 bytes a frame counts
#: at most 20 KB; a scan costs about 1 to 5 microseconds from there to 1 KiB.
EXACT_FROM = 256
#: Bytes of host memory per frame byte at most, whatever the frame (measured worst: 48, for
#: nested ``{"o":[""]}`` markers), plus the parse's fixed overhead.
_PER_BYTE = 64
_FIXED = 4096
_PER_SEPARATOR = 56  # measured up to 48 (a float, or an int outside the small-int cache)
_PER_CONTAINER = 256  # measured up to 376 with two separators and a string (a nested marker)
_PER_STRING = 80  # a str header and its slot; unique object keys also fill the parser's memo
#: A JSON string (possessive: linear, whatever the bytes), its closing quote optional (an
#: unterminated string ends the parse there).
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"?', re.DOTALL)
#: Up to how many quotes a frame over the first count has its strings taken out and is counted
#: again (each string costs a regex match: about 0.6 s a million).
_RECOUNT_MAX_QUOTES = 1 << 20
#: UTF-8 lead bytes of characters outside the BMP (stored in 4 bytes each, and making every
#: other character of their string take 4 bytes too).
_ASTRAL_BYTE = re.compile(rb"[\xf0-\xf4]")
#: A JSON escape of a high surrogate: with a low one it makes an astral character.
_ASTRAL_ESCAPE = re.compile(rb"\\u[dD][89abAB]")


def read_cost(payload: bytes, budget: int) -> int:
    """An upper bound of the host memory, in bytes, that parsing ``payload`` and decoding its tokens take.

    Includes the payload itself. ``budget`` only decides how hard to look: a
    frame whose first count is within it is not counted again; one over it
    is counted again without its strings where that is cheap. The result is
    an upper bound either way; compare it with the budget.
    """
    size = len(payload)
    if size < EXACT_FROM:
        return size * _PER_BYTE + _FIXED
    if payload.isascii():
        text_width = 1
        string_width = 1 if b"\\u" not in payload else _escaped_width(payload)
    else:
        text_width = 4 if _ASTRAL_BYTE.search(payload) else 2
        string_width = max(text_width, _escaped_width(payload) if b"\\u" in payload else 1)
    if b"\\" in payload:
        # A string with an escape is built in a growing buffer, then copied out: up to twice its size at once.
        string_width *= 2
    quotes = payload.count(b'"')
    cost = _cost(payload, size, text_width, string_width, quotes, size)
    if cost > budget and quotes <= _RECOUNT_MAX_QUOTES:
        # Where the parser gets, it sees the strings this sees; past where it fails, it builds nothing.
        bare = _JSON_STRING.sub(b"", payload)
        cost = min(cost, _cost(bare, size, text_width, string_width, quotes, size - len(bare)))
    if text_width > 1:
        # Before any parse, decoding widens the text as wider characters come and holds the
        # narrower copy meanwhile, and a lone surrogate or invalid byte has the error handler's
        # exception hold a copy of the payload. The first count pays that; a recount that finds
        # the bytes outside strings (not JSON, but decoded all the same) may not go below it.
        cost = max(cost, size * (2 + text_width + text_width // 2) + _FIXED)
    return cost + cost // 8  # slack for the allocator's rounding and other CPython versions' sizes


def _escaped_width(payload: bytes) -> int:
    # \u escapes of a BMP character need 2 bytes a character at most; a surrogate pair, 4.
    return 4 if _ASTRAL_ESCAPE.search(payload) else 2


def _cost(counted: bytes, size: int, text_width: int, string_width: int, quotes: int, in_strings: int) -> int:
    separators = counted.count(b",") + counted.count(b":")
    containers = counted.count(b"[") + counted.count(b"{")
    return (
        size * (1 + text_width)  # the payload, and the text it is decoded into
        + in_strings * string_width
        + (size - in_strings)  # the bytes a number is copied into before it is converted
        + (quotes // 2 + 1) * _PER_STRING
        + (separators + 1) * _PER_SEPARATOR
        + containers * _PER_CONTAINER
        + _FIXED
    )
