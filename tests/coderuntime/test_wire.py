"""The flat-token wire: round trips, depth, fail-closed decoding, exact sizes, frames."""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsh_core.coderuntime.worker import wire

from .wire_reference import decode_walk_before

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not (f == 0 and math.copysign(1, f) < 0))
    | st.text(),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=5), children, max_size=5),
    max_leaves=30,
)


@pytest.mark.parametrize("value", [None, True, False, 0, -5, 1.5, "", "x", [], {}, [[]], {"a": {}}, [1, "2", None]])
def test_every_root_round_trips(value: object) -> None:
    tokens = wire.encode(value)
    assert wire.decode(tokens) == value
    assert type(wire.decode(tokens)) is type(value)


@given(json_values)
@settings(max_examples=200, deadline=None)
def test_round_trip_and_exact_size(value: object) -> None:
    tokens = wire.encode(value)
    assert wire.decode(tokens) == value
    # Through a real frame too (JSON text, surrogates included).
    payload = wire.pack({"v": tokens})[4:]
    assert wire.decode(wire.unpack_payload(payload)["v"]) == value  # type: ignore[index]
    expected = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    assert wire.tokens_json_size(tokens) == len(expected.encode("utf-8", "backslashreplace"))


def test_million_deep_values_both_ways_without_recursion() -> None:
    limit = sys.getrecursionlimit()
    value: object = []
    for _ in range(1_000_000):
        value = [value]
    tokens = wire.encode(value)
    assert len(tokens) == 1_000_001
    frame = wire.pack({"t": "done", "v": tokens})  # whole frames too: 8 MB of flat JSON
    back = wire.decode(wire.unpack_payload(frame[wire.HEADER.size :])["v"])  # type: ignore[index]
    depth = 0
    node = back
    while node:
        node = node[0]  # type: ignore[index]
        depth += 1
    assert depth == 1_000_000
    deep_obj: object = {}
    for _ in range(100_000):
        deep_obj = {"k": deep_obj}
    assert wire.tokens_json_size(wire.encode(deep_obj)) == 6 * 100_000 + 2
    assert sys.getrecursionlimit() == limit


def test_short_array_markers_are_shared_read_only() -> None:
    nested, flat = wire.encode([[1, 2], [3]]), wire.encode([5, 6])
    assert nested[1] is flat[0] is wire._ARRAY_MARKERS[2]  # walk and fast path alike
    assert wire.encode(list(range(64)))[0] is not wire.encode(list(range(64)))[0]  # 64 and up: fresh
    # (conftest checks after the whole session that no consumer changed a shared marker)


class _Str(str):
    pass


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), -0.0, (1, 2), {1: "a"}, {"a": {1, 2}}, b"x", _Str("x"), [object()], True.__class__],
)
def test_lossy_values_are_refused(value: object) -> None:
    with pytest.raises(wire.WireError):
        wire.encode(value)


def test_cycles_are_refused() -> None:
    loop: list[object] = []
    loop.append([loop])
    with pytest.raises(wire.WireError, match="cycle"):
        wire.encode(loop)
    shared = [1]
    assert wire.decode(wire.encode([shared, shared])) == [[1], [1]]  # a DAG is fine


@pytest.mark.parametrize(
    "tokens",
    [
        None,
        [],
        "x",
        {"a": 0},  # not a non-empty list
        [{"a": 1}],  # claims a child that is not there
        [{"a": 2}, 1],
        [{"o": ["a", "b"]}, 1],
        [{"a": -1}],
        [{"a": 1.0}, 1],
        [{"a": True}, 1],
        [{"a": "1"}, 1],  # bad lengths
        [{"o": "ab"}],
        [{"o": [1]}, 2],
        [{"o": ["a", "a"]}, 1, 2],  # bad keys
        [{"a": 0, "o": []}],
        [{}],
        [{"kind": "array", "length": 0}],  # wrong marker fields
        [1, 2],
        [{"a": 0}, 1],  # trailing tokens
        [[1]],
        [{"a": 1}, [1]],  # nested lists are not tokens
        [float("nan")],
        [float("inf")],
        [-0.0],
        [{"a": 1}, float("-inf")],
        [{"a": 10**12}],
    ],
)
def test_decode_fails_closed(tokens: object) -> None:
    with pytest.raises(wire.WireError):
        wire.decode(tokens)


@given(
    st.lists(
        st.one_of(json_values, st.dictionaries(st.sampled_from(["a", "o", "x"]), json_values, max_size=2)), max_size=12
    )
)
@settings(max_examples=150, deadline=None)
def test_fuzz_decoder_only_ever_raises_wire_error(tokens: list[object]) -> None:
    try:
        value = wire.decode(tokens)
    except wire.WireError:
        return
    assert wire.encode(value) == tokens  # whatever decodes is canonical


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_fuzz_frame_payloads(payload: bytes) -> None:
    with contextlib.suppress(wire.WireError):
        wire.unpack_payload(payload)


def test_payload_rejects_nan_literals_and_deep_nesting() -> None:
    for text in (b'{"v":NaN}', b"[Infinity]", b"[-Infinity]", b"\xff", b"[" * 100_000, b"[1," * 30_000):
        with pytest.raises(wire.WireError):
            wire.unpack_payload(text)
        assert gc.isenabled()  # large payloads are parsed with the GC paused, and it comes back
    assert wire.unpack_payload(b'{"s":"\\ud800"}') == {"s": "\ud800"}


def test_frame_buffer_reassembles_and_caps() -> None:
    frames = wire.pack({"t": "a"}) + wire.pack({"t": "b"})
    buffer = wire.FrameBuffer(100)
    got = []
    for i in range(len(frames)):
        got += buffer.feed(frames[i : i + 1])
    assert [wire.unpack_payload(p) for p in got] == [{"t": "a"}, {"t": "b"}]
    with pytest.raises(wire.WireError, match="exceeds"):
        wire.FrameBuffer(100).feed(struct.pack(">I", 101))


def test_frame_buffer_copies_a_frame_out_once() -> None:
    # A frame that arrives in pieces is cut out of the buffer with one copy: the host holds the
    # buffer and the payload, not a third copy (a bytearray slice) as well.
    import tracemalloc

    frame = wire.HEADER.pack(16 << 20) + b"x" * (16 << 20)
    buffer = wire.FrameBuffer(1 << 30)
    tracemalloc.start()
    try:
        got = []
        for start in range(0, len(frame), 4 << 20):
            got += buffer.feed(frame[start : start + (4 << 20)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(got) == 1 and len(got[0]) == 16 << 20 and not buffer.buffer
    assert peak < 2.25 * (16 << 20), peak  # 3x with a slice


@pytest.mark.parametrize("text", ["plain", 'q"uote', "back\\slash", "nl\n", "\x01ctl", "é€😀", "\ud800lone", ""])
def test_json_str_size_is_exact_utf8(text: str) -> None:
    expected = json.dumps(text, ensure_ascii=False).encode("utf-8", "backslashreplace")
    assert wire.json_str_size(text) == len(expected)


@given(st.text(), st.integers(min_value=0, max_value=80))
@settings(max_examples=300, deadline=None)
def test_truncate_keeps_the_longest_fitting_prefix(text: str, budget: int) -> None:
    prefix = wire.truncate_json_str(text, budget)
    assert text.startswith(prefix)
    if budget >= 2:
        assert wire.json_str_size(prefix) <= budget
    if len(prefix) < len(text) and budget >= 2:
        assert wire.json_str_size(text[: len(prefix) + 1]) > budget


def test_ledger_counts_logs_array_and_fits_message() -> None:
    ledger = wire.Ledger(20)
    assert ledger.add("abc")  # ["abc"] = 7
    assert ledger.add("de")  # ["abc","de"] = 12
    assert ledger.used == len(json.dumps(["abc", "de"], separators=(",", ":")))
    assert ledger.fits(8) and not ledger.fits(9)
    assert not ledger.add("x" * 50)
    logs, message = ledger.fitted("over")
    total = json.dumps(logs, separators=(",", ":")) + json.dumps(message)
    assert len(total) <= 20 and message == "over" and logs[:1] == ["abc"]
    tiny = wire.Ledger(4)
    assert tiny.fitted("outer output exceeded 4 bytes") == ([], "")


# --------------------------------------------------------------------------- fast paths
# ``encode``/``decode`` take shortcuts for scalars and small flat containers;
# ``unpack_payload`` and ``FrameBuffer.feed`` for whole single payloads. Each must
# give exactly what the general path gives: the same tokens/value (types
# included) or the same refusal with the same message.


def _outcome(function: object, argument: object) -> tuple[str, object]:
    try:
        return "ok", function(argument)  # type: ignore[operator]
    except wire.WireError as error:
        return "error", error.reason  # encode alone looks for the culprit's place


def _same(left: tuple[str, object], right: tuple[str, object]) -> None:
    assert left == right
    if left[0] == "ok":
        assert repr(left[1]) == repr(right[1])  # no 1 == True == 1.0 conflation


#: Text made mostly of surrogates: lone ones (kept) and, by chance, a high one right before a low one (refused).
_surrogate_text = st.text(
    st.sampled_from(["a", "\u00e9", "\U0001f600", "\ud800", "\udbff", "\udc00", "\udfff"]), max_size=6
)

_odd_scalars = st.sampled_from(
    [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, (1,), b"x", _Str("s"), 1 + 2j, object()]
)
_maybe_lossy = st.recursive(
    json_values | _odd_scalars | _surrogate_text,
    lambda children: (
        st.lists(children, max_size=40)
        | st.dictionaries(st.text(max_size=3) | st.integers(0, 3) | _surrogate_text, children, max_size=40)
    ),
    max_leaves=60,
)


@given(_maybe_lossy)
@settings(max_examples=300, deadline=None)
def test_fuzz_encode_fast_path_matches_the_walk(value: object) -> None:
    _same(_outcome(wire.encode, value), _outcome(wire._encode_walk, value))


@given(_maybe_lossy)
@settings(max_examples=300, deadline=None)
def test_fuzz_a_refusal_names_the_path_to_its_culprit(value: object) -> None:
    try:
        wire.encode(value)
    except wire.WireError as error:
        assert error.path is not None
        node = value
        for key in error.path:
            node = node[key]  # type: ignore[index]
        if error.reason.startswith("object key"):
            assert type(node) is dict and any(type(key) is not str or _split(key) for key in node)
        elif type(node) is str:
            assert _split(node) and "surrogate pair written as two code points" in error.reason
        else:
            assert error.reason == wire._scalar_error(node)
        assert str(error) == error.describe("value")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            {"avg_delta": round(-0.002, 2)},
            'float -0.0 is not lossless JSON (it reads back as 0; use 0.0, e.g. x + 0.0) at result["avg_delta"]',
        ),
        ((1, 2), "tuple is not a JSON type (use a list)"),
        (
            {"rows": [{"n": 1}, {"n": 2, "at": (1, 2)}]},
            'tuple is not a JSON type (use a list) at result["rows"][1]["at"]',
        ),
        ({"by": {1: "a"}}, 'object key 1 (int) is not a str at result["by"]'),
        ([1] * 40 + [float("nan")], "float nan is not lossless JSON (JSON has no NaN or infinity) at result[40]"),
        (
            {"k": {"c": collections.Counter("a")}},
            'Counter is a subclass of dict, not a plain dict (convert it: dict(x)) at result["k"]["c"]',
        ),
        ({"x" * 50: b"x"}, 'bytes is not a JSON type (decode it to a str) at result["' + "x" * 40 + '..."]'),
    ],
)
def test_a_refusal_says_where_the_culprit_is(value: object, message: str) -> None:
    with pytest.raises(wire.WireError) as caught:
        wire.encode(value)
    assert caught.value.describe("result") == message


def test_the_path_of_a_deep_culprit_is_shortened() -> None:
    value: object = {1j}
    for _ in range(1000):
        value = [value]
    with pytest.raises(wire.WireError) as caught:
        wire.encode({"a": value})
    assert caught.value.path == ("a", *[0] * 1000)
    assert caught.value.describe("r") == 'set is not a JSON type (use a list) at r["a"]' + "[0]" * 7 + "..." + "[0]" * 8


_token = st.one_of(
    json_values.filter(lambda v: not isinstance(v, (list, dict))),
    _odd_scalars,
    _surrogate_text,
    st.builds(lambda keys: {"o": keys}, st.lists(_surrogate_text, max_size=3)),
    st.builds(lambda n: {"a": n}, st.integers(-2, 40) | st.sampled_from([True, 1.0, "1"])),
    st.builds(lambda keys: {"o": keys}, st.lists(st.sampled_from(["a", "b", "c", "d", 1]), max_size=40)),
    st.sampled_from([{}, {"a": 1, "o": []}, {"x": 1}, {"o": "ab"}, [1]]),
)


@given(st.lists(_token, max_size=42) | json_values.map(wire.encode) | json_values | st.lists(_token, min_size=34))
@settings(max_examples=600, deadline=None)
def test_fuzz_decode_fast_path_matches_the_walk(tokens: object) -> None:
    _same(_outcome(wire.decode, tokens), _outcome(wire._decode_walk, tokens))


_encoded = json_values.map(wire.encode)
#: Well-formed token streams, and ones made malformed in one place: cut short, a token left out, tokens put in.
_mangled_tokens = st.one_of(
    _encoded,
    st.tuples(_encoded, st.integers(0, 80)).map(lambda t: t[0][: t[1]]),
    st.tuples(_encoded, st.integers(0, 80)).map(lambda t: t[0][: t[1]] + t[0][t[1] + 1 :]),
    st.tuples(_encoded, st.integers(0, 80), st.lists(_token, min_size=1, max_size=3)).map(
        lambda t: t[0][: t[1]] + t[2] + t[0][t[1] :]
    ),
    st.lists(_token, max_size=60),
    json_values,
)


@given(_mangled_tokens)
@settings(max_examples=800, deadline=None)
def test_fuzz_the_decoder_walk_decides_as_its_previous_version(tokens: object) -> None:
    # The walk keeps the innermost container in locals and checks claims against one index: what it
    # builds and each refusal (the first one, with its message) must be the previous walk's.
    _same(_outcome(wire._decode_walk, tokens), _outcome(decode_walk_before, tokens))


@pytest.mark.parametrize(
    "tokens",
    [
        [{"a": 2}, {"a": 0}, {"o": []}],
        [{"a": 1}, {"a": 1}, {"a": 1}, {"o": ["k"]}, {"a": 0}],
        [{"o": ["a", "b"]}, {"a": 2}, 1, {"o": ["x"]}, None, "z"],
        [{"a": 2}, {"a": 1}, 5],
        [{"a": 1}, {"a": 2}, 1],
        [{"a": 0}, {"a": 1}],
        [{"a": 0}, {"a": 1}, 1],
        [1, {"o": ["k", "k"]}],
        [{"o": ["k", "k"]}, 1],
        [{"a": 1}, {"o": ["a", "a"]}, 1, 2],
        [{"a": 3}, {"a": 1}, {"a": 1}, {"a": 1}, 7, 8],
    ],
)
def test_nested_and_empty_containers_close_and_fail_as_before(tokens: list[object]) -> None:
    _same(_outcome(wire._decode_walk, tokens), _outcome(decode_walk_before, tokens))


@pytest.mark.parametrize(
    "value",
    [5, "x", None, True, 2.5, [], {}, [1, "a", None, 2.5, True], {"a": 1, "b": "x"}, list(range(32)), {"k": [1]}],
)
def test_fast_paths_round_trip_small_values(value: object) -> None:
    tokens = wire.encode(value)
    assert tokens == wire._encode_walk(value)
    back = wire.decode(tokens)
    assert back == value and repr(back) == repr(wire._decode_walk(tokens))


def _general_unpack(payload: bytes) -> object:
    try:
        return wire._DECODER.decode(payload.decode("utf-8", "surrogatepass"))
    except wire.WireError:
        raise
    except (ValueError, RecursionError, MemoryError) as error:
        raise wire.WireError(f"malformed frame: {type(error).__name__}") from None


@given(
    st.binary(max_size=60)
    | st.builds(lambda v: json.dumps(v).encode(), json_values)
    | st.builds(
        lambda v, pad: pad[0] + json.dumps(v) + pad[1],
        json_values,
        st.sampled_from([(" ", ""), ("", " "), ("\n", "\t"), ("", "x"), ("", "]"), ("[", "")]),
    ).map(str.encode)
)
@settings(max_examples=400, deadline=None)
def test_fuzz_unpack_fast_path_matches_the_full_decoder(payload: bytes) -> None:
    _same(_outcome(wire.unpack_payload, payload), _outcome(_general_unpack, payload))


@given(st.lists(st.binary(max_size=20), max_size=4), st.integers(1, 30))
@settings(max_examples=300, deadline=None)
def test_fuzz_frame_buffer_fast_path_matches_byte_by_byte(payloads: list[bytes], cap: int) -> None:
    stream = b"".join(struct.pack(">I", len(p)) + p for p in payloads)

    def run(chunks: list[bytes]) -> tuple[str, object]:
        buffer = wire.FrameBuffer(cap)
        got: list[bytes] = []
        try:
            for chunk in chunks:
                got += buffer.feed(chunk)
        except wire.WireError as error:
            return "error", (got, str(error))
        return "ok", (got, bytes(buffer.buffer))

    whole = run([struct.pack(">I", len(p)) + p for p in payloads])  # one frame per read: the fast path
    single = run([stream[i : i + 1] for i in range(len(stream))])
    assert whole == single


def test_an_int_too_long_to_write_is_refused_when_written_whatever_the_current_limit() -> None:
    tokens = wire.encode([1, 10**5000])  # encode stays check-free for ints: the text is where it fails
    previous = sys.get_int_max_str_digits()
    for limit in (previous, 0, 100_000):
        sys.set_int_max_str_digits(limit)
        try:
            with pytest.raises(wire.WireError, match="int of more than 4300 digits"):
                wire.pack({"v": tokens})
            with pytest.raises(wire.WireError, match="int of more than 4300 digits"):
                wire.tokens_json_size(tokens)
        finally:
            sys.set_int_max_str_digits(previous)
        assert sys.get_int_max_str_digits() == previous  # restored after the write
    assert wire.tokens_json_size(wire.encode(10**4299)) == 4300


def test_writing_never_changes_the_process_wide_digit_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    # The limit is one per process: lowering it for a moment, as writes once did under a lifted
    # limit, fails another thread's int(text) in that moment and undoes its own set_int_max_str_digits.
    long, short = wire.encode([1, 10**5000]), wire.encode([1, -(10**4299)])
    previous = sys.get_int_max_str_digits()
    for limit in (0, 100_000):
        sys.set_int_max_str_digits(limit)
        try:
            with monkeypatch.context() as patch:
                patch.setattr(sys, "set_int_max_str_digits", lambda _: pytest.fail("the limit was changed"))
                for write in (lambda t: wire.pack({"t": "done", "v": t}), wire.tokens_json_size):
                    with pytest.raises(wire.WireError, match="int of more than 4300 digits"):
                        write(long)
                    write(short)
        finally:
            sys.set_int_max_str_digits(previous)


def test_an_int_is_written_under_the_workers_limit_not_the_hosts() -> None:
    # The worker runs in a bare `-I` interpreter with an empty environment: its parser refuses
    # ints past Python's default limit whatever the host's environment says, so a host started
    # with PYTHONINTMAXSTRDIGITS=0 must not write one (the worker would drop the frame).
    script = (
        "import sys\nfrom dsh_core.coderuntime.worker import wire\nassert sys.get_int_max_str_digits() == 0\n"
        "try:\n    wire.pack({'v': wire.encode(10**5000)})\nexcept wire.WireError as e:\n    print(e)\n"
    )
    env = {**os.environ, "PYTHONINTMAXSTRDIGITS": "0", "PYTHONPATH": str(Path(wire.__file__).parents[3])}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert "int of more than 4300 digits" in done.stdout, (done.stdout, done.stderr)


# --------------------------------------------------------------------------- surrogates
# A str may hold surrogates as code points. Lone ones (a file name that is not UTF-8) cross as
# they are; a high one right before a low one does not survive JSON text (written as two
# escapes, it is read back as one character), so neither side lets it through.


def _split(text: str) -> bool:
    return json.loads(json.dumps(text)) != text


_PAIR = "\ud83d\ude00"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            _PAIR,
            "a surrogate pair written as two code points (U+D83D U+DE00 at character 0) does not survive JSON "
            "(a parser reads one character)",
        ),
        (
            {"name": "smile " + _PAIR, "n": 1},
            "a surrogate pair written as two code points (U+D83D U+DE00 at character 6) does not survive JSON "
            '(a parser reads one character) at result["name"]',
        ),
        (
            ["a", "\udbff\udfff"],
            "(U+DBFF U+DFFF at character 0) does not survive JSON (a parser reads one character) at result[1]",
        ),
        (
            [*range(40), "\u00e9" + _PAIR],
            "at character 1) does not survive JSON (a parser reads one character) at result[40]",
        ),
        ({"rows": [{"ok": "\udc80"}, {"x": [1, 2, 3, 4, 5, 6, 7, 8, 9, _PAIR]}]}, 'at result["rows"][1]["x"][9]'),
        (
            {"k" + _PAIR: 1},
            "object key 'k\\ud83d\\ude00' holds a surrogate pair written as two code points "
            "(U+D83D U+DE00 at character 1), which does not survive JSON (a parser reads one "
            "character)",
        ),
        ({"a": [{"b": 1, _PAIR * 30: 2}]}, "object key '" + "\\ud83d\\ude00" * 20 + "'... holds "),
        ({"a": {str(i): i for i in range(40)} | {_PAIR: None}}, '(a parser reads one character) at result["a"]'),
    ],
)
def test_a_surrogate_pair_written_as_two_code_points_is_refused_where_it_is(value: object, message: str) -> None:
    with pytest.raises(wire.WireError) as caught:
        wire.encode(value)
    assert message in caught.value.describe("result")
    assert _outcome(wire.encode, value) == _outcome(wire._encode_walk, value)


@pytest.mark.parametrize(
    "tokens",
    [
        [_PAIR],
        ["x\ud800\udc00y"],
        [{"a": 2}, "ok", _PAIR],
        [{"o": ["a", _PAIR]}, 1, 2],
        [{"o": [_PAIR]}, {"a": 0}],
        [{"a": 40}, *["\udc80"] * 39, "\udbff\udfff"],
        [{"a": 1}, {"o": ["k"]}, {"a": 2}, 1, "\u00e9" + _PAIR],
    ],
)
def test_a_surrogate_pair_written_as_two_code_points_fails_decoding_closed(tokens: list[object]) -> None:
    # The host decodes what a hostile worker sends: such a str never reaches a binding or a result.
    with pytest.raises(wire.WireError, match="surrogate pair written as two code points"):
        wire.decode(tokens)
    assert _outcome(wire.decode, tokens) == _outcome(wire._decode_walk, tokens)


@pytest.mark.parametrize(
    "text",
    [
        "\udc80",
        "caf\udce9.txt",
        "\ud83d",
        "\ude00",
        "\ude00\ud83d",
        "\ud83d \ude00",
        "\ud83d\ud83d",
        "\ude00\ude00",
        "\U0001f600",
        "\ud83d\U0001f600\ude00",
    ],
)
def test_lone_surrogates_cross_as_they_are(text: str) -> None:
    for value in (text, [text], {text: text}, {"a": [text] * 40, text: {str(i): text for i in range(40)}}):
        tokens = wire.encode(value)
        assert wire.decode(tokens) == value
        assert wire.decode(wire.unpack_payload(wire.pack({"v": tokens})[4:])["v"]) == value  # type: ignore[index]
        assert json.loads(json.dumps(value)) == value  # they survive JSON text too


@given(_surrogate_text, _surrogate_text)
@settings(max_examples=300, deadline=None)
def test_fuzz_the_wire_keeps_exactly_the_strings_json_text_gives_back(text: str, key: str) -> None:
    for value in (text, {key: 1}, {"k": [text, 1]}, [text] * 10):
        kept = json.loads(json.dumps(value)) == value
        assert (_outcome(wire.encode, value)[0] == "ok") == kept, value
        assert (_outcome(wire.decode, wire._encode_walk(value) if kept else _tokens(value))[0] == "ok") == kept


def _tokens(value: object) -> list[object]:
    """Tokens of ``value`` written by hand, as a hostile worker would (``encode`` refuses it)."""
    if type(value) is str:
        return [value]
    if type(value) is dict:
        return [{"o": list(value)}, *value.values()]
    return [{"a": len(value)}, *value]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "joined"),
    [
        ("plain", "plain"),
        ("caf\u00e9", "caf\u00e9"),
        (_PAIR, "\U0001f600"),
        ("a\ud800\udc00b", "a\U00010000b"),
        ("\udc80", "\udc80"),
        ("\ude00\ud83d", "\ude00\ud83d"),
        ("\ud83d\ud83d\ude00\ude00", "\ud83d\U0001f600\ude00"),
    ],
)
def test_join_pairs_gives_the_text_a_json_hop_gives_back(text: str, joined: str) -> None:
    assert wire.join_pairs(text) == joined == json.loads(json.dumps(text))
    assert wire.join_pairs(joined) == joined


#: Text dense in surrogates (lone, paired, reversed) next to ASCII and astral characters.
_surrogate_heavy_text = st.text(st.sampled_from(["a", "\u00e9", "\U0001f600", "\ud83d", "\ude00", "\ud800", "\udfff"]))


@settings(max_examples=300)
@given(_surrogate_heavy_text)
def test_the_worker_copy_of_the_surrogate_pair_rule_agrees_with_the_host_one(text: str) -> None:
    # The rule is written twice on purpose (the worker's wire is loaded by path, stdlib only, and cannot
    # import dsh_core): this pins the two copies to one behaviour.
    from dsh_core import lossless

    assert wire.join_pairs(text) == lossless.join_surrogate_pairs(text)
    split = not text.isascii() and wire._split_pair(text)
    assert split == (not text.isascii() and lossless._split_pair(text))
    if split:
        assert wire._pair_at(text) == lossless._pair_at(text)
