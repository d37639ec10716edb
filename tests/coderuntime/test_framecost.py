"""framecost.read_cost bounds what reading a frame takes the host, measured with tracemalloc."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsh_core.coderuntime import framecost
from dsh_core.coderuntime.worker import wire

N = 20_000


def _done(tokens_json: bytes) -> bytes:
    return b'{"t":"done","v":[' + tokens_json + b"]}"


def _call(tokens_json: bytes) -> bytes:
    return b'{"t":"call","id":1,"g":"tools","n":"f","a":[' + tokens_json + b"]}"


def _tokens_of(value: Any) -> bytes:
    text = json.dumps(wire.encode(value), separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8", "surrogatepass")[1:-1]


def _read_peak(payload: bytes) -> int:
    """What the host's reading of ``payload`` allocates at its peak, plus the payload itself."""
    tracemalloc.start()
    try:
        try:
            message = wire.unpack_payload(payload)
        except wire.WireError:
            message = None
        if type(message) is dict:
            for field in ("v", "a"):
                if field in message:
                    try:
                        decoded = wire.decode(message[field])
                    except wire.WireError:
                        decoded = None
                    del decoded
        del message
        return tracemalloc.get_traced_memory()[1] + len(payload)
    finally:
        tracemalloc.stop()


#: Frames a forger can write, each element as small as JSON allows for what it builds.
ADVERSARIAL = {
    "floats": _done(b'{"a":%d},' % N + b"1e5," * N + b"0"),
    "ints outside the small-int cache": _done(b'{"a":%d},' % N + b"-6," * N + b"0"),
    "19-digit ints": _done(b'{"a":%d},' % N + b"1000000000000000000," * N + b"0"),
    "empty array markers": _done(b'{"a":%d},' % N + b'{"a":0},' * N + b"0"),
    "empty object markers": _done(b'{"a":%d},' % N + b'{"o":[]},' * N + b"0"),
    "nested array markers": _done(b'{"a":1},' * N + b"0"),
    "nested object markers": _done(b'{"o":[""]},' * N + b"0"),
    "unique keys": _done(b'{"o":[' + b",".join(b'"k%d"' % i for i in range(N)) + b"]}," + b"0," * (N - 1) + b"0"),
    # Decoding hashes an object marker's keys into a set (up to 133 bytes a key while it grows):
    # only once the values they claim are known to follow, which pay for it.
    "an object marker of unique keys and no values": _done(
        b'{"o":[' + b",".join(b'"%x"' % i for i in range(N)) + b"]}"
    ),
    "junk dicts": _call(b"{}," * N + b"0"),
    "junk lists": _call(b"[]," * N + b"0"),
    "junk dict of unique keys": _call(b"{" + b",".join(b'"k%d":0' % i for i in range(N)) + b"},0"),
    "empty strings": _call(b'{"a":%d},' % N + b'"",' * N + b"0"),
    "astral characters": _done(b'{"a":%d},' % N + '"😀",'.encode() * N + b"0"),
    "escaped surrogate pairs": _done(b'{"a":%d},' % N + b'"\\ud83d\\ude00",' * N + b"0"),
    "one escaped astral character in a long string": _done(b'"\\ud83d\\ude00' + b"a" * (1 << 20) + b'"'),
    "one astral character in a long string": _done('"😀'.encode() + b"a" * (1 << 20) + b'"'),
    "BMP text": _done(b'"' + "中文".encode() * (1 << 18) + b'"'),
    "lone surrogates": _done(b'"' + "\ud800".encode("utf-8", "surrogatepass") * (1 << 18) + b'"'),
    # A frame the C scanner reads whole but with text after it used to be parsed a second time
    # (by JSONDecoder.decode) while the first parse was still held.
    "ints and a trailing space": _done(b'{"a":%d},' % N + b"-6," * N + b"0") + b" ",
    "ints and trailing junk": _call(b"-6," * N + b"0") + b"x",
    # The scanner copies a number's digits out as bytes before converting them (an int past the
    # 4,300-digit limit is refused only then): a frame of one number holds it three times.
    "one long int": _done(b"1" * (1 << 20)),
    "one long float": _done(b"1." + b"0" * (1 << 20) + b"e5"),
    # Decoding UTF-8 widens the text as wider characters come (1, 2, then 4 bytes a character),
    # holding the narrower copy meanwhile; a lone surrogate adds the error handler's copy of the
    # payload. Outside strings (not JSON: decoded before it is parsed) the recount paid neither.
    "text widened to 2 bytes by a lone surrogate": b"a" * (1 << 20) + "\ud800".encode("utf-8", "surrogatepass"),
    "text widened to 2 then 4 bytes, with a lone surrogate": (
        b"a" * (1 << 20) + "\u0100\ud800\U0001f600".encode("utf-8", "surrogatepass")
    ),
    "a realistic result": _done(_tokens_of([[i, {"k": [i], "s": "x" * (i % 7)}] for i in range(N // 4)])),
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_the_bound_holds_for_frames_built_to_cost_the_most(name: str) -> None:
    payload = ADVERSARIAL[name]
    assert len(payload) >= framecost.EXACT_FROM
    peak = _read_peak(payload)
    # Counted in full and after taking the strings out: both are bounds.
    for budget in (1 << 62, 0):
        assert framecost.read_cost(payload, budget) >= peak, (name, budget, peak)


def test_a_plain_string_costs_about_three_times_its_size() -> None:
    # The payload, the text it is decoded into and the string: a genuine 64 MiB result in ASCII
    # fits the default 512 MiB budget.
    payload = _done(b'"' + b"a" * (1 << 20) + b'"')
    cost = framecost.read_cost(payload, 1 << 62)
    assert _read_peak(payload) <= cost <= 3.5 * len(payload), cost


def test_strings_full_of_separators_are_counted_again_without_their_strings() -> None:
    payload = _done(b'"' + b"{[,:" * (1 << 18) + b'"')
    counted = framecost.read_cost(payload, 1 << 62)
    recounted = framecost.read_cost(payload, 0)
    assert recounted < 4 * len(payload) < counted
    assert recounted >= _read_peak(payload)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=4), children, max_size=6),
    max_leaves=60,
)


@settings(max_examples=150, deadline=None)
@given(value=json_values, as_call=st.booleans())
def test_the_bound_holds_for_any_value(value: Any, as_call: bool) -> None:
    try:
        tokens = _tokens_of(value)
    except wire.WireError:
        return  # not lossless (say -0.0): never sent
    payload = (_call if as_call else _done)(tokens)
    assert framecost.read_cost(payload, 1 << 62) >= _read_peak(payload)
    assert framecost.read_cost(payload, 0) >= _read_peak(payload)
