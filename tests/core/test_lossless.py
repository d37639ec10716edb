"""Lossless JSON: what passes, what fails, where, and at any depth."""

from __future__ import annotations

import copy
import enum
import json
import math
import pickle
import sys
from collections import OrderedDict
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsh_core.lossless import FrozenDict, FrozenList, NotLosslessError, find_loss, freeze, is_lossless, snapshot, thaw

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not (f == 0 and str(f).startswith("-")))
    | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=40,
)


@given(json_values)
def test_json_values_round_trip_and_freeze(value: Any) -> None:
    assert is_lossless(value)
    frozen = freeze(value)
    assert frozen == value
    assert json.loads(json.dumps(frozen)) == value
    assert freeze(frozen) is frozen
    assert thaw(frozen) == value


class Color(enum.IntEnum):
    RED = 1


class Text(str):
    pass


@pytest.mark.parametrize(
    ("value", "path", "reason"),
    [
        ({"a": [1, float("nan")]}, "/a/1", "not finite"),
        ({"a": float("inf")}, "/a", "not finite"),
        ({"z": -0.0}, "/z", "-0.0"),
        ({1: "x"}, "", "not a string"),
        ({"t": (1, 2)}, "/t", "tuple"),
        ({"s": {1}}, "/s", "set"),
        ({"b": b"x"}, "/b", "bytes"),
        ({"e": Color.RED}, "/e", "subclass of int"),
        ({"s": Text("x")}, "/s", "subclass of str"),
        (OrderedDict(a=1), "", "subclass of dict"),
        ({"a/b": {"c~d": object()}}, "/a~1b/c~0d", "not a JSON type"),
        # A high surrogate then a low one: JSON text writes them as "\\ud83d\\ude00", read back as one character.
        ("\ud83d\ude00", "", "surrogate pair written as two code points"),
        ({"s": "smile \ud83d\ude00"}, "/s", "U+D83D U+DE00 at character 6"),
        ({"a": [1, {"b": ["x", "\udbff\udfff"]}]}, "/a/1/b/1", "a parser reads one character"),
        ({"k\ud800\udc00": 1}, "", "object key 'k\\ud800\\udc00' holds a surrogate pair"),
        ({"a": [{"ok": 1, "\ud83d\ude00": [1.5]}]}, "/a/0", "object key '\\ud83d\\ude00'"),
    ],
)
def test_non_lossless_values_are_located(value: Any, path: str, reason: str) -> None:
    loss = find_loss(value)
    assert loss is not None and loss.path == path and reason in loss.reason
    with pytest.raises(NotLosslessError):
        freeze(value)


def test_cycles_are_refused_but_shared_references_are_fine() -> None:
    shared = [1]
    assert freeze({"a": shared, "b": shared}) == {"a": [1], "b": [1]}
    cyclic: dict[str, Any] = {}
    cyclic["self"] = [cyclic]
    error = find_loss(cyclic)
    assert error is not None and error.path == "/self/0" and "cycle" in error.reason


def test_deep_values_need_no_recursion_limit() -> None:
    depth = 200_000
    deep: list[Any] = []
    node = deep
    for _ in range(depth):
        child: list[Any] = []
        node.append(child)
        node = child
    limit = sys.getrecursionlimit()
    frozen = freeze(deep)
    assert sys.getrecursionlimit() == limit
    count, node = 0, frozen
    while node:
        node, count = node[0], count + 1
    assert count == depth
    assert snapshot(deep) is not deep


def test_frozen_values_refuse_mutation_and_survive_copy_and_pickle() -> None:
    frozen = freeze({"a": [1, {"b": 2}]})
    assert isinstance(frozen, FrozenDict) and isinstance(frozen["a"], FrozenList)
    for mutate in (
        lambda: frozen.__setitem__("x", 1),
        lambda: frozen["a"].append(3),
        lambda: frozen.update({}),
        frozen["a"].sort,
    ):
        with pytest.raises(TypeError, match="immutable"):
            mutate()
    assert copy.deepcopy(frozen) is frozen
    assert pickle.loads(pickle.dumps(frozen)) == frozen
    detached = snapshot(frozen)
    detached["a"].append(3)
    assert frozen["a"] == [1, {"b": 2}]


@given(json_values)
def test_dumps_writes_what_json_dumps_writes(value: Any) -> None:
    from dsh_core.lossless import dumps

    assert dumps(value) == json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    assert dumps(value, indent=2) == json.dumps(value, ensure_ascii=False, indent=2)


def test_dumps_and_the_default_renderer_handle_any_depth() -> None:
    from dsh_core.lossless import dumps
    from dsh_core.model import render_json

    deep: list[Any] = []
    node = deep
    for _ in range(5000):
        child: list[Any] = []
        node.append(child)
        node = child
    text = dumps(deep)
    assert text == "[" * 5001 + "]" * 5001
    assert json.loads(dumps({"a": [1, {"b": "é"}]}, indent=2)) == {"a": [1, {"b": "é"}]}
    assert render_json({}, freeze(deep))[0].text == text


# -- fast paths: freeze/thaw/snapshot skip the walk for some types; the answer must be the walk's ------------


class _Str(str):
    pass


_FAST_PATH_EDGES: list[Any] = [
    None,
    True,
    False,
    0,
    -7,
    2**80,
    "",
    "text",
    1.5,
    0.0,
    -0.0,
    float("nan"),
    float("inf"),
    "\udc80",
    "\ud83d\ude00",
    "caf\u00e9 \U0001f600",
    {"a": "\ud83d\ude00"},
    {"\ud83d\ude00": 1},
    {"a\udc80": "\udc80"},
    {},
    [],
    {"a": 1, "b": "x", "c": None, "d": True},
    {"a": 1.5},
    {"a": [1]},
    [1, "x"],
    {1: "int key"},
    _Str("sub"),
    enum.IntEnum("E", "A").A,
    OrderedDict(a=1),
    (1, 2),
    b"bytes",
    {"a": _Str("x")},
]


def _outcome(function: Any, value: Any) -> tuple[Any, ...]:
    try:
        result = function(value)
    except NotLosslessError as error:
        return ("error", str(error), error.path, error.reason)
    comparable = "nan" if isinstance(result, float) and math.isnan(result) else result
    return ("ok", type(result), comparable, result is value)


@pytest.mark.parametrize("value", [*_FAST_PATH_EDGES, freeze({"a": [1, {"b": 2}]}), freeze([1, [2]])])
def test_the_fast_paths_answer_exactly_what_the_walk_answers(value: Any) -> None:
    from dsh_core.lossless import _walk

    assert _outcome(freeze, value) == _outcome(lambda v: _walk(v, 2), value)
    assert _outcome(thaw, value) == _outcome(lambda v: _walk(v, 1), value)
    assert _outcome(snapshot, value) == _outcome(lambda v: _walk(v, 1), value)


@given(json_values)
def test_the_fast_paths_match_the_walk_on_any_json(value: Any) -> None:
    from dsh_core.lossless import _walk

    for source in (value, _walk(value, 2)):
        assert _outcome(freeze, source) == _outcome(lambda v: _walk(v, 2), source)
        assert _outcome(thaw, source) == _outcome(lambda v: _walk(v, 1), source)


def test_frozen_containers_built_without_init_are_the_same_empty_frozen_objects() -> None:
    from dsh_core.lossless import _new_frozen_dict, _new_frozen_list

    for made, reference in ((_new_frozen_dict(), FrozenDict()), (_new_frozen_list(), FrozenList())):
        assert type(made) is type(reference) and made == reference and not made
        with pytest.raises(TypeError, match="immutable"):
            made.clear()


def test_ints_python_cannot_write_as_json_text_are_refused() -> None:
    """Past ``sys.get_int_max_str_digits()`` json.dumps raises ValueError: such an int is not lossless."""
    huge = 10 ** (sys.get_int_max_str_digits() + 10)
    for value, path in ((huge, ""), (-huge, ""), ({"a": huge}, "/a"), ({"a": [1, huge]}, "/a/1"), ([huge], "/0")):
        loss = find_loss(value)
        assert loss is not None and loss.path == path and "digits" in loss.reason, path
        for function in (freeze, snapshot, thaw):
            with pytest.raises(NotLosslessError):
                function(value)
    big = 10 ** (sys.get_int_max_str_digits() - 10)  # still writable: accepted
    assert freeze({"a": big}) == {"a": big} and json.loads(json.dumps(big)) == big


# -- surrogates: a str may hold them as code points; JSON text keeps each apart unless a high one precedes a low one --

_SPLIT_PAIRS = ["\ud83d\ude00", "a\ud800\udc00b", "\udbff\udfff", "x" * 100 + "\u00e9\ud83d\ude00"]
_LONE_SURROGATES = [
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
]


@pytest.mark.parametrize("text", _SPLIT_PAIRS)
def test_a_surrogate_pair_written_as_two_code_points_is_refused_as_value_and_as_key(text: str) -> None:
    assert json.loads(json.dumps(text)) != text  # the reason: a parser reads one character
    for value, path in (
        (text, ""),
        ({"a": text}, "/a"),
        ([1, text], "/1"),
        ({"a": [{"b": text}]}, "/a/0/b"),
        ({text: 1}, ""),
        ({"a": [{text: None, "b": 1.5}]}, "/a/0"),
    ):
        loss = find_loss(value)
        assert loss is not None and loss.path == path and "does not survive JSON" in loss.reason, value
        for function in (freeze, snapshot, thaw):
            with pytest.raises(NotLosslessError, match="surrogate pair written as two code points"):
                function(value)


@pytest.mark.parametrize("text", _LONE_SURROGATES)
def test_surrogates_that_are_not_a_high_then_a_low_one_are_kept(text: str) -> None:
    for value in (text, {"a": text}, [text], {text: text}, {"a": [{text: [text, 1.5]}]}):
        assert json.loads(json.dumps(value)) == value
        assert is_lossless(value) and freeze(value) == value and snapshot(value) == value and thaw(value) == value


_SURROGATE_HEAVY = st.text(st.sampled_from(["a", "\u00e9", "\U0001f600", "\ud800", "\udbff", "\udc00", "\udfff"]))


@given(_SURROGATE_HEAVY, _SURROGATE_HEAVY)
def test_lossless_strings_and_keys_are_exactly_those_json_text_gives_back(text: str, key: str) -> None:
    for value in (text, {key: 1}, {"k": [text]}):
        assert is_lossless(value) == (json.loads(json.dumps(value)) == value), value
