"""Property tests: whatever text a tool registers, both SDK stubs stay well-formed.

Tool names, descriptions and schema texts (property names, notes, titles, enum and
const values) come from third-party plugins. Any ``str`` is legal, lone surrogates
included. Here each is arbitrary text spiked with what has broken a stub before
(quotes, backslashes, line breaks, NUL, surrogates, comment closers, names Python
would read as other names).
"""

from __future__ import annotations

import ast
import json
import re
import types
import typing
import unicodedata
import urllib.parse
import warnings
from collections.abc import Iterator
from typing import Any

import jsonschema
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dsh_core.codemode.sdk import SdkTool, is_attribute_name, render_python_sdk, render_typescript_sdk

#: Pieces that ended a docstring, a comment or a string early, that source cannot hold, that Python
#: reads as another name (NFKC, ``__`` mangling), or that would not show as themselves.
TRICKY = st.sampled_from(
    [
        '"',
        '"""',
        "'",
        "'" * 3,
        "\\",
        "\\u",
        "\\N{",
        "\\x",
        "\r",
        "\r\n",
        "\n",
        "\t",
        "\x00",
        "\x0b",
        "\x0c",
        "\x1b",
        "\x7f",
        "\x85",
        "\u2028",
        "\u2029",
        "\u202e",
        "\u2066",
        "\ufeff",
        "\u200d",
        "\ud800",
        "\udfff",
        "\U000e0041",
        "*/",
        "/*",
        "//",
        "#",
        "`",
        "${",
        " ",
        "\u3000",
        "é",
        "😀",
        "__",
        "\ufb01",
        "\u212b",
    ]
)
IDENTIFIER = st.from_regex(r"[A-Za-z_$][A-Za-z0-9_$]{0,6}", fullmatch=True)
#: Any code point (surrogates included), ASCII names and the tricky pieces, in any order.
TEXT = st.lists(
    st.one_of(TRICKY, IDENTIFIER, st.text(st.characters(exclude_categories=()), max_size=6)), max_size=6
).map("".join)
#: Names of the types annotations use, which a method of ``Tools`` would shadow.
TYPE_NAME = st.sampled_from(["list", "dict", "str", "int", "float", "bool", "Any", "Literal", "builtins", "typing"])
NAME = st.one_of(IDENTIFIER, TYPE_NAME, TEXT).filter(bool)
LITERAL = st.one_of(TEXT, st.integers(-(10**20), 10**20), st.booleans(), st.none())
NOTES = {"description": TEXT, "title": TEXT, "default": TEXT}


BOOLEANS = st.booleans()


def objects(
    children: st.SearchStrategy[Any], names: st.SearchStrategy[str] = NAME, closed: st.SearchStrategy[bool] = BOOLEANS
) -> st.SearchStrategy[dict[str, Any]]:
    """Object schemas of ``children`` properties, each required or not, open or closed."""

    def build(fields: dict[str, tuple[Any, bool]], closed: bool) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {key: child for key, (child, _) in fields.items()},
            "required": [key for key, (_, required) in fields.items() if required],
            "additionalProperties": not closed,
        }

    return st.builds(build, st.dictionaries(names, st.tuples(children, st.booleans()), max_size=3), closed)


LEAVES = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["string", "integer", "number", "boolean", "null"])}, optional=NOTES
    ),
    st.fixed_dictionaries({"enum": st.lists(LITERAL, min_size=1, max_size=4)}, optional=NOTES),
    st.fixed_dictionaries({"const": LITERAL}, optional=NOTES),
)


#: Property names a parent and its variants share (merged key by key), two of them not class attributes.
SHARED = st.one_of(st.sampled_from(["path", "mode", "__x", "\ufb01le"]), NAME)


def combined(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """An object with ``oneOf``/``anyOf``/``allOf`` members (objects or ``children``) merged into it."""
    return st.builds(
        lambda parent, key, members: {**parent, key: members},
        objects(children, SHARED),
        st.sampled_from(["oneOf", "anyOf", "allOf"]),
        st.lists(st.one_of(objects(children, SHARED), children), min_size=1, max_size=2),
    )


#: Names of the definitions a root schema holds: ``/``, ``~`` and ``%`` are escaped in a pointer.
DEFINITIONS = ["Point", "a/b~c%", "\u00e9", "Any"]


def pointer(name: str) -> str:
    return "#/$defs/" + urllib.parse.quote(name.replace("~", "~0").replace("/", "~1"), safe="~")


#: Local refs to those definitions (recursive ones too), to the root, and refs no stub resolves.
REFS = st.fixed_dictionaries(
    {
        "$ref": st.sampled_from(
            [*map(pointer, DEFINITIONS), "#", "#/$defs/missing", "#anchor", "https://example.com/schema.json"]
        )
    },
    optional={"description": TEXT},
)
SCHEMAS = st.recursive(
    LEAVES | REFS,
    lambda children: st.one_of(
        objects(children), combined(children), st.fixed_dictionaries({"type": st.just("array"), "items": children})
    ),
    max_leaves=5,
)
#: A root schema: an object, maybe with combinators, maybe with definitions its refs name.
ROOTS = st.builds(
    lambda root, definitions: {**root, **({"$defs": definitions} if definitions else {})},
    st.one_of(objects(SCHEMAS), combined(SCHEMAS)),
    st.none() | st.fixed_dictionaries({name: SCHEMAS for name in DEFINITIONS}),
)
TOOLS = st.lists(
    st.builds(SdkTool, name=NAME, description=TEXT, parameters=ROOTS, output=SCHEMAS),
    max_size=3,
    unique_by=lambda tool: tool.name,
)


def schema_texts(schema: Any) -> Iterator[tuple[str, str, bool, bool]]:
    """``("key", k, in_class, shown)`` for every property name and ``("value", v, in_class, shown)``
    for every string enum/const value; ``in_class`` when it is rendered in a class (under some
    property), ``shown`` unless under a combinator (a variant that cannot hold is left out, and
    merged ``enum`` lists intersect)."""
    stack = [(schema, False, True)]
    while stack:
        node, in_class, shown = stack.pop()
        if not isinstance(node, dict):
            continue
        shown = shown and not any(key in node for key in ("oneOf", "anyOf", "allOf"))
        values = [node["const"]] if "const" in node else node.get("enum", [])
        yield from (("value", value, in_class, shown) for value in values if isinstance(value, str))
        for key, child in node.get("properties", {}).items():
            yield "key", key, True, shown
            stack.append((child, True, shown))
        stack.append((node.get("items"), in_class, shown))
        for key in ("oneOf", "anyOf", "allOf"):
            stack.extend((member, in_class, False) for member in node.get(key, ()))
        stack.extend((definition, True, False) for definition in node.get("$defs", {}).values())


def texts(tools: list[SdkTool]) -> tuple[set[str], set[str], set[str], set[tuple[str, str]]]:
    """(every tool and property name, every string enum/const value, the values Python shows in code,
    the ``("key", name)`` and ``("value", value)`` pairs TypeScript shows for sure).

    A tool reached by subscript has its signature in a comment: only values inside classes are code.
    """
    keys = {tool.name for tool in tools}
    values: set[str] = set()
    in_code: set[str] = set()
    shown = {("key", name) for name in keys}
    for tool in tools:
        for kind, text, in_class, certain in (*schema_texts(tool.parameters), *schema_texts(tool.output)):
            (keys if kind == "key" else values).add(text)
            if certain:
                shown.add((kind, text))
                if kind == "value" and (in_class or is_attribute_name(tool.name)):
                    in_code.add(text)
    return keys, values, in_code, shown


BIDI_CONTROLS = {"LRE", "RLE", "PDF", "LRO", "RLO", "LRI", "RLI", "FSI", "PDI"}


def hidden(text: str, layout: str) -> list[str]:
    """Characters of ``text`` that would not show as themselves: controls (but ``layout``),
    surrogates, line and paragraph separators, bidi controls."""
    return [
        char
        for char in text
        if char not in layout
        and (unicodedata.category(char) in {"Cc", "Cs", "Zl", "Zp"} or unicodedata.bidirectional(char) in BIDI_CONTROLS)
    ]


def plain(description: str) -> SdkTool:
    return SdkTool("plain", description, {"type": "object"}, {})


def strings(tree: ast.AST, docstrings: set[int]) -> set[str]:
    """The string constants of ``tree`` but docstrings; an annotation written as a string (it names
    a class defined later) counts as the strings of the expression it holds, which must parse."""
    annotations: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign):
            annotations.add(id(node.annotation))
            if isinstance(node.annotation, ast.Name) and node.annotation.id == "TypeAlias" and node.value:
                annotations.add(id(node.value))
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "NotRequired":
            annotations.add(id(node.slice))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "TypedDict":
            annotations.update(id(value) for value in getattr(node.args[1], "values", ()))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if id(node) in annotations:
                found |= strings(ast.parse(node.value, mode="eval"), set())
            else:
                found.add(node.value)
    return found


@given(TOOLS)
@example(
    [
        plain('Ends in a quote"'),
        SdkTool(
            "n",
            "NUL\x00",
            {"type": "object", "properties": {"__secret": {"type": "string"}, "\ufb01le": {"enum": ["\x00", '"""']}}},
            {},
        ),
    ]
)
@settings(max_examples=100, deadline=None)
def test_the_python_stub_compiles_encodes_and_keeps_every_text(tools: list[SdkTool]) -> None:
    text = render_python_sdk(tools)
    text.encode("utf-8")
    code = text.split("```python\n", 1)[1].rsplit("```", 1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no escape Python does not know (a docstring is raw or escaped)
        compile(code, "<sdk>", "exec")
    tree = ast.parse(code)
    assert hidden(code, "\n\t") == []

    keys, values, in_code, _ = texts(tools)
    by_name = {tool.name: tool for tool in tools}
    protocol = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Tools")
    docstrings: set[int] = set()
    for method in protocol.body:
        if isinstance(method, ast.AsyncFunctionDef):
            # Every method is a tool, its docstring the description (up to layout whitespace).
            docstring = ast.get_docstring(method, clean=False)
            assert docstring is not None
            assert docstring.split() == by_name[method.name].description.split()
            docstrings.add(id(method.body[0].value))  # type: ignore[attr-defined]
    class_names = {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    constants = strings(tree, docstrings)
    # No text closed a string early (the pieces would be strings of their own), and each value shows.
    assert constants <= keys | values | class_names
    assert in_code <= constants
    # The stub runs as written (not under this module's future import), and each TypedDict
    # declares keys of the schemas only: none renamed (NFKC, mangling).
    namespace: dict[str, Any] = {}
    exec(compile(code, "<sdk>", "exec", dont_inherit=True), namespace)
    for value in namespace.values():
        if isinstance(value, type) and hasattr(value, "__required_keys__"):
            assert set(value.__annotations__) <= keys


def ts_tokens(code: str) -> tuple[list[str], list[str]]:
    """(the bodies of the ``/* */`` comments, the values of the string literals) of ``code``."""
    comments: list[str] = []
    strings: list[str] = []
    string = re.compile(r'"(?:[^"\\\n\r\u2028\u2029]|\\.)*"')
    at = 0
    while at < len(code):
        if code.startswith("/*", at):
            end = code.find("*/", at + 2)
            assert end >= 0, code[at : at + 80]
            assert code[end + 2] == "\n", code[at : end + 80]  # each comment is a line of its own: it ended there
            comments.append(code[at + 2 : end])
            at = end + 2
        elif code[at] == '"':
            match = string.match(code, at)
            assert match is not None, code[at : at + 80]
            strings.append(json.loads(match.group()))
            at = match.end()
        else:
            assert not code.startswith("//", at)  # the stub has none: one would be text out of its comment
            at += 1
    return comments, strings


def utf16(text: str) -> str:
    """``text`` as a JavaScript string holds it: a high and a low surrogate are one character."""
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


@given(TOOLS)
@example(
    [
        plain("Closes */ its comment"),
        SdkTool("n", "N.", {"type": "object", "properties": {"path\n": {"const": '"'}, "ok": {"type": "string"}}}, {}),
    ]
)
@settings(max_examples=100, deadline=None)
def test_the_typescript_stub_encodes_and_no_text_leaves_its_comment_or_string(tools: list[SdkTool]) -> None:
    text = render_typescript_sdk(tools)
    text.encode("utf-8")
    code = text.split("```ts\n", 1)[1].rsplit("```", 1)[0]
    assert hidden(code, "\n") == []
    comments, strings = ts_tokens(code)
    # One comment per tool, each on its line: a closer in a description would have split one.
    assert len(comments) == len(tools)
    assert all(body.startswith("* ") and body.endswith(" ") and "\n" not in body for body in comments)
    keys, values, _, certain = texts(tools)
    shown = {utf16(string) for string in strings}
    assert shown <= {utf16(text) for text in (*keys, *values, "ToolCallError")}
    assert {utf16(value) for value in values if ("value", value) in certain} <= shown
    assert {
        utf16(key) for key in keys if ("key", key) in certain and not re.fullmatch(r"[A-Za-z_$][A-Za-z0-9_$]*", key)
    } <= shown


#: Objects with a few keys in common, seldom closed (a closed one forbids the keys the others add).
FLAT_OBJECTS = objects(LEAVES, st.sampled_from(["a", "b", "c", "d"]), st.sampled_from([False] * 4 + [True]))
#: Such objects as members, some by ``$ref`` (merged in like the others: they have keys to merge).
FLAT_MEMBERS = FLAT_OBJECTS | st.sampled_from([{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}])
FLAT = st.builds(
    lambda parent, key, members, definitions: {**parent, key: members, "$defs": definitions},
    FLAT_OBJECTS,
    st.sampled_from(["anyOf", "allOf"]),
    st.builds(list.__add__, st.lists(FLAT_MEMBERS, min_size=1, max_size=3), st.lists(LEAVES, max_size=1)),
    st.fixed_dictionaries({"A": FLAT_OBJECTS, "B": FLAT_OBJECTS}),
)


def sample(annotation: Any) -> Any:
    """A value of ``annotation`` (a type of the stub), or ``Ellipsis`` for ``Any``."""
    if annotation is Any:
        return ...
    if typing.is_typeddict(annotation):
        values = {key: sample(annotation.__annotations__[key]) for key in annotation.__required_keys__}
        return ... if ... in values.values() else values
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return annotation.__args__[0]
    if origin in (typing.Union, types.UnionType):
        return sample(annotation.__args__[0])
    if origin in (list, dict):
        return origin()
    return {str: "s", int: 0, float: 0.5, bool: True, type(None): None}[annotation]


@given(FLAT)
@settings(max_examples=100, deadline=None)
def test_each_variant_keeps_what_its_parent_requires_and_validates(schema: dict[str, Any]) -> None:
    """Every class the arguments may take requires the parent's required keys, and (``anyOf`` and
    ``allOf``, where more than one variant may match) a value built from it validates."""
    code = render_python_sdk([SdkTool("t", "T.", schema, {})]).split("```python\n", 1)[1].rsplit("```", 1)[0]
    namespace: dict[str, Any] = {}
    exec(compile(code, "<sdk>", "exec", dont_inherit=True), namespace)
    args = namespace["Tools"].t.__annotations__["args"]
    variants = args.__args__ if isinstance(args, types.UnionType) else (args,)
    for variant in variants:
        if not typing.is_typeddict(variant):
            continue
        assert set(schema["required"]) <= variant.__required_keys__
        value = sample(variant)
        if value is not ... and "not spelled out" not in code:
            assert jsonschema.Draft202012Validator(schema).is_valid(value), (value, code)
