"""The fast validity check agrees with jsonschema on every schema of its subset."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from dsh_core.schema import fast_check

TYPES = ["object", "array", "string", "number", "integer", "boolean", "null"]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.sampled_from([0.0, 1.0, 1.5, -2.0])
    | st.sampled_from(["", "a", "b"])
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3),
    max_leaves=8,
)


def schemas() -> st.SearchStrategy[Any]:
    leaf = st.one_of(
        st.just({}),
        st.just(True),
        st.just(False),
        st.builds(lambda t: {"type": t}, st.sampled_from(TYPES)),
        st.builds(lambda ts: {"type": ts}, st.lists(st.sampled_from(TYPES), min_size=1, max_size=3, unique=True)),
    )

    def extend(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.builds(
                lambda props, req, extra, typed: {
                    **({"type": "object"} if typed else {}),
                    "properties": props,
                    "required": req,
                    "additionalProperties": extra,
                    "description": "d",
                },
                st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3),
                st.lists(st.sampled_from(["a", "b"]), unique=True, max_size=2),
                st.one_of(st.booleans(), inner),
                st.booleans(),
            ),
            st.builds(
                lambda items, typed: {**({"type": "array"} if typed else {}), "items": items}, inner, st.booleans()
            ),
        )

    return st.recursive(leaf, extend, max_leaves=6)


@settings(max_examples=400, deadline=None)
@given(schemas(), values)
def test_fast_check_agrees_with_jsonschema(schema: Any, value: Any) -> None:
    check = fast_check(schema)
    assert check is not None
    assert check(value) == Draft202012Validator(schema).is_valid(value), (schema, value)


def test_schemas_outside_the_subset_fall_back() -> None:
    for schema in (
        {"type": "string", "minLength": 1},
        {"enum": [1, 2]},
        {"$ref": "#/$defs/x"},
        {"type": "object", "properties": {"a": {"pattern": "x"}}},
        {"anyOf": [{}]},
        {"type": "object", "patternProperties": {"x": {}}},
    ):
        assert fast_check(schema) is None, schema
