"""The SDK renderers (issue 4 item 2): Python and TypeScript, deterministic, iterative."""

from __future__ import annotations

import ast
import inspect
import json
import sys
import typing
import warnings
from typing import Any, Literal

import jsonschema
import pytest

from dsh_core.codemode.sdk import (
    MAX_TYPE_DEPTH,
    SdkTool,
    is_attribute_name,
    render_python_sdk,
    render_sdk,
    render_typescript_sdk,
    sdk_tools,
)
from dsh_core.define import define_tool

READ = SdkTool(
    "read",
    "Read a file.\nReturns its text.",
    {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "File path,\n relative to the root"},
            "offset": {"type": "integer"},
            "mode": {"enum": ["text", "bytes"]},
            "flag": {"const": True},
            "either": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
            "maybe": {"type": ["string", "null"]},
            "tags": {"type": "array", "items": {"type": "string"}},
            "anything": {},
            "raw": {"type": "array"},
        },
        "required": ["path"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "text": {"type": "string"},
            "lines": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"n": {"type": "integer"}},
                    "required": ["n"],
                    "additionalProperties": False,
                },
            },
            "meta": {"type": "object", "additionalProperties": {"type": "number"}},
        },
        "required": ["text"],
        "additionalProperties": False,
    },
)
EXOTIC = [
    SdkTool(
        "my-tool",
        'Hyphenated. Has */ and """ inside.',
        {
            "type": "object",
            "properties": {"a-b": {"type": "string"}, "class": {"type": "integer"}},
            "required": ["a-b"],
        },
        {"type": "string"},
    ),
    SdkTool("__proto__", "Proto.", {"type": "object"}, {}),
    SdkTool("__class__", "Class.", {"type": "object"}, {}),
    SdkTool("import", "A keyword.", {"type": "object"}, {"type": "boolean"}),
    SdkTool("_private", "Underscore.", {"type": "object"}, {"type": "null"}),
]


def python_block(text: str) -> str:
    return text.split("```python\n", 1)[1].rsplit("```", 1)[0]


def run_stub(code: str) -> dict[str, Any]:
    """Run ``code`` as written: not under this module's ``from __future__ import annotations``, which
    ``exec`` and ``compile`` would otherwise apply and so leave every annotation unevaluated."""
    namespace: dict[str, Any] = {}
    exec(compile(code, "<sdk>", "exec", dont_inherit=True), namespace)
    return namespace


def test_python_sdk_types() -> None:
    text = render_python_sdk([READ])
    code = python_block(text)
    ast.parse(code)  # the stub block is valid Python
    assert code.startswith("from typing import Any, Literal, NotRequired, Protocol, TypedDict\n")
    assert "class ToolCallError(Exception):\n    tool_name: str" in code
    assert "class ReadArgs(TypedDict):\n    path: str  # File path, relative to the root\n" in code
    for line in (
        "    offset: NotRequired[int]",
        '    mode: NotRequired[Literal["text", "bytes"]]',
        "    flag: NotRequired[Literal[True]]",
        "    either: NotRequired[str | int]",
        "    maybe: NotRequired[str | None]",
        "    tags: NotRequired[list[str]]",
        "    anything: NotRequired[Any]",
        "    raw: NotRequired[list[Any]]",
        "    lines: NotRequired[list[ReadOutputLinesItem]]",
        "    meta: NotRequired[dict[str, float]]",
    ):
        assert line + "\n" in code, line
    assert "class ReadOutputLinesItem(TypedDict):\n    n: int" in code
    # Nested classes come before the classes that use them.
    assert code.index("class ReadOutputLinesItem") < code.index("class ReadOutput(")
    assert '    async def read(self, args: ReadArgs) -> ReadOutput:\n        """Read a file.\n' in code
    assert code.rstrip().endswith("tools: Tools")
    for rule in ("asyncio.gather", "except ToolCallError", "print(...)", "return", 'tools["my-tool"]', "plain dicts"):
        assert rule in text


def test_open_objects_say_so() -> None:
    tool = SdkTool("t", "T.", {"type": "object", "properties": {"a": {"type": "string"}}}, {})
    assert "# Additional keys beyond those declared are allowed." in render_python_sdk([tool])
    closed = SdkTool(
        "t", "T.", {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}, {}
    )
    assert "Additional keys" not in render_python_sdk([closed])


def test_keys_that_pattern_properties_allow_are_not_shown_as_forbidden() -> None:
    """``patternProperties`` admits keys ``additionalProperties: false`` does not; no stub spells the
    patterns out, so the object shows as open (its other keys of any type), never as closed."""
    listed = {
        "type": "object",
        "properties": {"a": {"type": "string"}},
        "patternProperties": {"^x-": {}},
        "additionalProperties": False,
    }
    only = {"type": "object", "patternProperties": {"^n_": {"type": "integer"}}, "additionalProperties": False}
    typed = {
        "type": "object",
        "patternProperties": {"^n_": {"type": "integer"}},
        "additionalProperties": {"type": "string"},
    }
    needed = {
        "type": "object",
        "required": ["x-id"],
        "patternProperties": {"^x-": {"type": "string"}},
        "additionalProperties": False,
        "oneOf": [{"properties": {"x-id": {"const": "a"}}}, {"properties": {"x-id": {"const": "b"}}}],
    }
    for schema, instance in (
        (listed, {"a": "", "x-b": 1}),
        (only, {"n_a": 1}),
        (typed, {"n_a": 1}),
        (needed, {"x-id": "a"}),
    ):
        jsonschema.validate(instance, schema)  # the tool accepts it
    tools = [
        SdkTool(name, "T.", schema, {})
        for name, schema in (("listed", listed), ("only", only), ("typed", typed), ("needed", needed))
    ]
    code = python_block(render_python_sdk(tools))
    assert "class ListedArgs(TypedDict):\n    # Additional keys beyond those declared are allowed.\n" in code
    assert "async def only(self, args: dict[str, Any])" in code
    assert "async def typed(self, args: dict[str, Any])" in code
    assert "not spelled out" not in code  # x-id is allowed: the oneOf variants hold
    assert 'NeededArgs1 = TypedDict("NeededArgs1", {\n    "x-id": Literal["a"],\n' in code
    text = render_typescript_sdk(tools)
    assert "listed: { a?: string } & Record<string, JsonValue>;" in text
    assert "only: Record<string, JsonValue>;" in text


def test_an_array_with_prefix_items_does_not_type_every_element_as_its_items() -> None:
    """Draft 2020-12 ``items`` holds only past ``prefixItems``: ``["a", 1, True]`` is a valid ``pair``."""
    pair = {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": {"type": "boolean"}}
    schema = {"type": "object", "properties": {"pair": pair}, "required": ["pair"], "additionalProperties": False}
    jsonschema.Draft202012Validator(schema).validate({"pair": ["a", 1, True]})
    tool = SdkTool("t", "T.", schema, {})
    assert "    pair: list[Any]\n" in python_block(render_python_sdk([tool]))
    assert "t: { pair: JsonValue[] };" in render_typescript_sdk([tool])


def test_enum_values_the_type_refuses_are_not_offered() -> None:
    """``{"type": "string", "enum": ["a", null]}`` refuses ``null`` (a common slip for a nullable enum)."""
    mode = {"type": "string", "enum": ["a", None]}
    nullable = {"type": ["string", "null"], "enum": ["a", None]}
    schema = {
        "type": "object",
        "properties": {"mode": mode, "nullable": nullable, "fixed": {"type": "integer", "const": "x"}},
        "required": ["mode", "nullable"],
        "additionalProperties": False,
    }
    assert not jsonschema.Draft202012Validator(mode).is_valid(None)
    tool = SdkTool("t", "T.", schema, {})
    code = python_block(render_python_sdk([tool]))
    assert '    mode: Literal["a"]\n    nullable: Literal["a", None]\n' in code
    assert '    fixed: NotRequired[Literal["x"]]\n' in code  # nothing holds: shown as written
    assert 't: { mode: "a"; nullable: "a" | null; fixed?: "x" };' in render_typescript_sdk([tool])


def test_required_keys_that_properties_do_not_list_are_shown_required() -> None:
    """``required`` may name a key ``properties`` does not list: a call without it is refused, so the
    stub lists it as required, of the type the schema gives its other keys."""
    bare = {"type": "object", "required": ["path"]}
    typed = {
        "type": "object",
        "properties": {"a": {"type": "string"}},
        "required": ["a", "n"],
        "additionalProperties": {"type": "integer"},
    }
    assert not jsonschema.Draft202012Validator(bare).is_valid({})
    tools = [SdkTool("bare", "B.", bare, {}), SdkTool("typed", "T.", typed, {})]
    namespace = run_stub(python_block(render_python_sdk(tools)))
    assert namespace["BareArgs"].__required_keys__ == {"path"}
    assert typing.get_type_hints(namespace["TypedArgs"]) == {"a": str, "n": int}
    assert namespace["TypedArgs"].__required_keys__ == {"a", "n"}
    text = render_typescript_sdk(tools)
    assert "bare: { path: JsonValue } & Record<string, JsonValue>;" in text
    assert "typed: { a: string; n: number } & Record<string, JsonValue>;" in text


def test_exotic_names_are_listed_for_subscript_access() -> None:
    code = python_block(render_python_sdk(EXOTIC))
    ast.parse(code)
    assert '    # tools["my-tool"](args: MyToolArgs) -> str: Hyphenated. Has */ and """ inside.' in code
    for name in ("__proto__", "__class__", "import", "_private"):
        assert f'    # tools["{name}"](args: ' in code
        assert f"async def {name}(" not in code
    # Keys that cannot be class attributes use the functional TypedDict syntax.
    assert 'MyToolArgs = TypedDict("MyToolArgs", {\n    "a-b": str,\n    "class": NotRequired[int],\n})' in code


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("read", True),
        ("read_file", True),
        ("match", True),
        ("class", False),
        ("__proto__", False),
        ("_x", False),
        ("my-tool", False),
        ("9lives", False),
        ("ﬁle", False),
    ],
)
def test_attribute_names(name: str, ok: bool) -> None:
    assert is_attribute_name(name) is ok


def test_docstrings_escape_quotes_and_backslashes() -> None:
    tool = SdkTool("quote", 'Ends with a quote" and has \\ and """ and \\"""', {"type": "object"}, {})
    code = python_block(render_python_sdk([tool]))
    tree = ast.parse(code)
    protocol = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Tools")
    method = protocol.body[0]
    assert isinstance(method, ast.AsyncFunctionDef)
    assert ast.get_docstring(method) == tool.description


def test_class_names_are_unique_and_capped() -> None:
    long = "x" * 200
    tools = [
        SdkTool(
            long,
            "Long.",
            {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}}},
            {},
        ),
        SdkTool(long + "y", "Long too.", {"type": "object", "properties": {"a": {"type": "string"}}}, {}),
    ]
    code = python_block(render_python_sdk(tools))
    ast.parse(code)
    classes = [n.name for n in ast.parse(code).body if isinstance(n, ast.ClassDef)]
    assert len(classes) == len(set(classes))
    assert all(len(name) <= 121 for name in classes)


def test_an_empty_tool_set_renders_a_valid_stub() -> None:
    code = python_block(render_python_sdk([]))
    ast.parse(code)
    assert "class Tools(Protocol):\n    pass" in code


def test_rendering_is_deterministic_and_sorted() -> None:
    tools = [READ, *EXOTIC]
    first = render_python_sdk(tools)
    assert render_python_sdk(list(reversed(tools))) == first
    assert render_typescript_sdk(tools) == render_typescript_sdk(list(reversed(tools)))


def test_deep_schemas_render_without_recursion_and_are_capped() -> None:
    schema: Any = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "array", "items": {"type": "object", "properties": {"c": schema}}}
    tool = SdkTool("deep", "Deep.", {"type": "object", "properties": {"v": schema}}, schema)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(120)  # well below the type depth: only an iterative walker gets through
    try:
        python = render_python_sdk([tool])
        typescript = render_typescript_sdk([tool])
    finally:
        sys.setrecursionlimit(limit)
    assert "Any" in python and "JsonValue" in typescript
    assert python.count("class DeepArgs(TypedDict)") == 1
    ast.parse(python_block(python))
    assert typescript.count("[]") > MAX_TYPE_DEPTH // 4


def test_typescript_sdk() -> None:
    text = render_typescript_sdk([READ, *EXOTIC])
    assert "```ts\ntype JsonValue =" in text
    assert "  /** Read a file. Returns its text. */\n  read: { path: string; offset?: number; " in text
    assert 'mode?: "text" | "bytes"; flag?: true; either?: string | number; maybe?: string | null; ' in text
    assert "tags?: string[]; anything?: JsonValue; raw?: JsonValue[] };" in text
    assert '  "my-tool": { "a-b": string; class?: number } & Record<string, JsonValue>;' in text
    assert "/** Hyphenated. Has *\\/ and" in text
    assert "  read: { text: string; lines?: { n: number }[]; meta?: Record<string, number> };" in text
    assert "type ToolName = keyof ToolOutputMap;" in text
    assert 'readonly name: "ToolCallError";' in text and "readonly toolName: ToolName;" in text
    assert "declare const tools: { [K in ToolName]: (args: ToolArgsMap[K]) => Promise<ToolOutputMap[K]> };" in text


def test_a_property_name_with_a_trailing_newline_is_quoted_in_typescript() -> None:
    """``^...$`` with match() also accepts a name ending in a newline: it went in unquoted."""
    tool = SdkTool(
        "write",
        "Write.",
        {
            "type": "object",
            "properties": {"path\n": {"type": "string"}, "ok": {"type": "string"}, "$x_1": {"type": "string"}},
        },
        None,
    )
    text = render_typescript_sdk([tool])
    assert 'write: { "path\\n"?: string; ok?: string; $x_1?: string } & Record<string, JsonValue>;' in text


def test_a_map_keeps_the_type_of_its_values_in_typescript_as_in_python() -> None:
    """An object of ``additionalProperties`` only is a map: both stubs type its values (parity)."""
    output = {
        "type": "object",
        "properties": {
            "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
            "groups": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "string"}}},
            "closed": {"type": "object", "additionalProperties": False},
            "open": {"type": "object", "additionalProperties": True},
        },
        "required": ["counts", "groups", "closed", "open"],
        "additionalProperties": False,
    }
    tool = SdkTool("stats", "Stats.", {"type": "object"}, output)
    assert (
        "    counts: dict[str, int]\n    groups: dict[str, list[str]]\n    closed: dict[str, Any]\n"
        "    open: dict[str, Any]"
    ) in render_python_sdk([tool])
    assert (
        "stats: { counts: Record<string, number>; groups: Record<string, string[]>; "
        "closed: Record<string, never>; open: Record<string, JsonValue> };"
    ) in render_typescript_sdk([tool])


def test_render_sdk_selects_by_language() -> None:
    assert "```python" in render_sdk("python", [READ])
    assert "```ts" in render_sdk("typescript", [READ])
    for bad in ("cobol", "__class__", "constructor"):
        with pytest.raises(ValueError, match="no SDK renderer"):
            render_sdk(bad, [READ])


def test_sdk_tools_projects_definitions_sorted() -> None:
    async def body(args: Any, ctx: Any) -> Any:
        return None

    defs = [
        define_tool(
            name=n, description=f"{n}.", parameters={"type": "object"}, execute=body, output_schema={"type": "string"}
        )
        for n in ("b", "a")
    ]
    tools = sdk_tools(defs)
    assert [t.name for t in tools] == ["a", "b"] and tools[0].output == {"type": "string"}


@pytest.mark.parametrize("description", ['Say "hi"', 'Ends in two quotes ""', '"', 'Four """"', 'x\\"'])
def test_a_docstring_may_end_with_quotes(description: str) -> None:
    """A quote next to the closing ``\"\"\"`` ended the docstring early: invalid Python, or the wrong text."""
    code = python_block(render_python_sdk([SdkTool("quote", description, {"type": "object"}, {})]))
    tree = ast.parse(code)
    protocol = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Tools")
    method = protocol.body[0]
    assert isinstance(method, ast.AsyncFunctionDef)
    assert ast.get_docstring(method) == description


def test_nul_characters_in_descriptions_keep_the_stub_valid() -> None:
    """Python source cannot contain NUL: a description with one made the stub unparseable."""
    tools = [
        SdkTool(
            "nul",
            "a\x00b",
            {"type": "object", "properties": {"k": {"type": "string", "description": "note\x00here"}}},
            {},
        ),
        SdkTool("nul-sub", "c\x00d", {"type": "object"}, {}),
    ]
    code = python_block(render_python_sdk(tools))
    tree = ast.parse(code)
    protocol = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Tools")
    method = protocol.body[0]
    assert isinstance(method, ast.AsyncFunctionDef)
    assert ast.get_docstring(method) == "a\x00b"
    assert "# note\\x00here" in code and "c\\x00d" in code


@pytest.mark.parametrize("key", ["\ufb01le", "__secret", "\u212bngstrom"])
def test_keys_python_would_rename_in_a_class_body_use_the_functional_syntax(key: str) -> None:
    """In a class body ``ﬁle`` reads as ``file`` (NFKC) and ``__secret`` as ``_QArgs__secret``."""
    tool = SdkTool(
        "q",
        "Q.",
        {"type": "object", "properties": {key: {"type": "string"}, "ok": {"type": "integer"}}, "required": [key, "ok"]},
        {},
    )
    namespace = run_stub(python_block(render_python_sdk([tool])))
    assert list(namespace["QArgs"].__annotations__) == [key, "ok"]
    assert namespace["QArgs"].__required_keys__ == {key, "ok"}


def test_dunder_keys_keep_the_class_syntax() -> None:
    tool = SdkTool("q", "Q.", {"type": "object", "properties": {"__proto__": {"type": "string"}}}, {})
    assert "class QArgs(TypedDict):" in render_python_sdk([tool])


def test_combinators_that_only_constrain_keep_the_object_type() -> None:
    """ "path or text is required" (anyOf of required lists) rendered the whole argument object as Any."""
    either = {
        "type": "object",
        "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
        "anyOf": [{"required": ["path"]}, {"required": ["text"]}],
        "additionalProperties": False,
    }
    tool = SdkTool("w", "W.", either, {"type": "string", "oneOf": [{"minLength": 1}, {"pattern": "x"}]})
    code = python_block(render_python_sdk([tool]))
    assert "class WArgs(TypedDict):\n    path: NotRequired[str]\n    text: NotRequired[str]" in code
    assert "async def w(self, args: WArgs) -> str:" in code
    assert "  w: { path?: string; text?: string };" in render_typescript_sdk([tool])
    # Alternatives that carry types of their own still render as a union.
    typed = SdkTool(
        "u", "U.", {"type": "object", "properties": {"v": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}}, {}
    )
    assert "v: NotRequired[str | int]" in render_python_sdk([typed])


def test_lone_surrogates_show_as_escapes_in_the_python_stub() -> None:
    """A lone surrogate (a non-UTF-8 file name, say) is a legal ``str`` but not UTF-8: the stub
    neither compiled nor encoded. It shows as its escape, and a docstring or string keeps its value."""
    tool = SdkTool(
        "s",
        "a\ud800b",
        {
            "type": "object",
            "properties": {"k\udfff": {"enum": ["x\ud800"], "description": "note\udc80here"}},
            "required": ["k\udfff"],
        },
        {},
    )
    other = SdkTool("s-sub", "c\udbffd", {"type": "object"}, {})
    text = render_python_sdk([tool, other])
    text.encode("utf-8")
    code = python_block(text)
    namespace = run_stub(code)
    assert namespace["SArgs"].__annotations__["k\udfff"].__args__ == ("x\ud800",)
    assert namespace["Tools"].s.__doc__ == "a\ud800b"
    assert "# note\\udc80here" in code and "c\\udbffd" in code


def test_lone_surrogates_show_as_escapes_in_the_typescript_stub() -> None:
    """Written raw, a lone surrogate made the TypeScript stub impossible to encode as UTF-8."""
    tool = SdkTool(
        "s\ud800",
        "a\ud800b */",
        {"type": "object", "properties": {"k\udfff": {"enum": ["x\udbff"]}}, "required": ["k\udfff"]},
        {"const": "\udc00"},
    )
    text = render_typescript_sdk([tool])
    text.encode("utf-8")
    assert '  /** a\\ud800b *\\/ */\n  "s\\ud800": { "k\\udfff": "x\\udbff" } & Record<string, JsonValue>;' in text
    assert '  "s\\ud800": "\\udc00";' in text


#: Characters that do not show as themselves: ESC (drives a terminal), DEL, a C1 control, line
#: breaks only some readers honor, a bidi override (reorders what follows), BOM, an invisible tag.
HIDDEN = [
    "\x1b",
    "\x7f",
    "\x9b",
    "\x0b",
    "\x0c",
    "\x85",
    "\xad",
    "\u2028",
    "\u2029",
    "\u202e",
    "\u2066",
    "\ufeff",
    "\U000e0041",
]


@pytest.mark.parametrize("char", HIDDEN)
def test_characters_that_would_not_show_are_escaped_in_the_python_stub(char: str) -> None:
    """They went into docstrings, comments and strings raw (and docstrings broke lines at some of them)."""
    tool = SdkTool(
        "h",
        f"a{char}b\nc{char}d",
        {
            "type": "object",
            "properties": {f"k{char}": {"enum": [f"x{char}"], "description": f"note{char}here"}},
            "required": [f"k{char}"],
        },
        {},
    )
    other = SdkTool("h-sub", f"c{char}d", {"type": "object"}, {})
    code = python_block(render_python_sdk([tool, other]))
    assert char not in code
    namespace = run_stub(code)
    assert namespace["HArgs"].__annotations__[f"k{char}"].__args__ == (f"x{char}",)
    assert inspect.getdoc(namespace["Tools"].h) == f"a{char}b\nc{char}d"
    escape = char.encode("unicode_escape").decode("ascii")
    spaced = " " if char.isspace() else escape  # a comment is one line: whitespace joins its words
    assert f"# note{spaced}here" in code and f"c{spaced}d" in code


@pytest.mark.parametrize("char", HIDDEN)
def test_characters_that_would_not_show_are_escaped_in_the_typescript_stub(char: str) -> None:
    tool = SdkTool(
        "h",
        f"a{char}b",
        {"type": "object", "properties": {f"k{char}": {"const": f"x{char}"}}, "required": [f"k{char}"]},
        {},
    )
    text = render_typescript_sdk([tool])
    assert char not in text
    escape = json.dumps(char)[1:-1]
    assert f'{{ "k{escape}": "x{escape}" }}' in text
    assert f"/** a{' ' if char.isspace() else escape}b */" in text


def test_docstring_line_ends_are_line_feeds() -> None:
    tool = SdkTool("crlf", "One.\r\nTwo.\rThree.\tTabbed.", {"type": "object"}, {})
    namespace = run_stub(python_block(render_python_sdk([tool])))
    assert inspect.getdoc(namespace["Tools"].crlf) == "One.\nTwo.\nThree.\tTabbed.".expandtabs()


def test_a_subscript_tool_name_shows_its_own_letters() -> None:
    """The comment naming a tool to call by subscript wrote every non-ASCII letter as an escape."""
    code = python_block(
        render_python_sdk(
            [
                SdkTool("café-crème", "Brew.", {"type": "object"}, {}),
                SdkTool("x\u202e", "Hidden.", {"type": "object"}, {}),
            ]
        )
    )
    assert '    # tools["café-crème"](args: ' in code
    assert '    # tools["x\\u202e"](args: ' in code


def test_tools_named_like_the_types_of_annotations_keep_the_stub_valid() -> None:
    """A method named ``list`` (the default workspace has one) became ``list`` in the rest of the
    ``Tools`` body: ``-> list[str]`` after it subscripted the function and the stub did not run."""
    every = {
        "anyOf": [
            {"type": "string"},
            {"type": "integer"},
            {"type": "number"},
            {"type": "boolean"},
            {"const": "x"},
            {"enum": [[1], {"a": 1}]},
            {},
        ]
    }
    output = {"type": "object", "additionalProperties": {"type": "array", "items": every}}
    names = [
        "Any",
        "FooArgs",
        "Literal",
        "bool",
        "builtins",
        "dict",
        "float",
        "foo",
        "int",
        "list",
        "str",
        "typing",
        "zz",
    ]
    foo = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    tools = [SdkTool(name, f"{name}.", foo if name == "foo" else {"type": "object"}, output) for name in names]
    code = python_block(render_python_sdk(tools))
    namespace = run_stub(code)
    expected = dict[str, list[str | int | float | bool | Literal["x"] | list[Any] | dict[str, Any] | Any]]
    for name in names:
        annotations = getattr(namespace["Tools"], name).__annotations__
        assert annotations["return"] == expected, name
        if name != "foo":
            assert annotations["args"] == dict[str, Any], name
    # A generated class is never named like a method either.
    assert namespace["Tools"].foo.__annotations__["args"].__required_keys__ == {"a"}
    # Only what a method defined before shadows is qualified, and module-level code needs none.
    assert "    async def Any(self, args: dict[str, Any]) -> dict[str, list[str | int | float | bool | " in code
    assert "    async def zz(self, args: _builtins.dict[_builtins.str, _typing.Any]) -> " in code
    assert "import builtins as _builtins\nimport typing as _typing\nfrom typing import Any, Literal," in code
    assert "class FooArgs2(TypedDict):\n    # Additional keys beyond those declared are allowed.\n    a: str\n" in code


@pytest.mark.parametrize(
    ("description", "source"),
    [
        (
            r"Search with a regex such as \bTODO\b or \d+ (C:\work)",
            r'r"""Search with a regex such as \bTODO\b or \d+ (C:\work)"""',
        ),
        ('A path such as "C:\\dir\\"', "r'''A path such as \"C:\\dir\\\"'''"),
        ('Has """ and \\d', "r'''Has \"\"\" and \\d'''"),
        ("Two lines \\n\nand \\N{x} \\u12 \\", None),  # ends in a backslash: a raw string cannot
        ("Both \"\"\" and ''' and \\d", None),
        ("A control \x1b and \\d", None),
        ('Ends in \\"', "r'''Ends in \\\"'''"),
    ],
)
def test_docstrings_show_backslashes_as_written(description: str, source: str | None) -> None:
    """A description's backslashes were doubled in the docstring, so the model read ``\\\\bTODO\\\\b``
    for ``\\bTODO\\b``. A raw docstring shows them as written; what no raw string can hold is escaped."""
    code = python_block(render_python_sdk([SdkTool("grep", description, {"type": "object"}, {})]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an escape Python does not know would warn
        namespace = run_stub(code)
    assert inspect.getdoc(namespace["Tools"].grep) == inspect.cleandoc(description)
    if source is not None:
        assert f"        {source}\n" in code


SLICE = {
    "type": "object",
    "properties": {"path": {"type": "string", "description": "The file."}},
    "required": ["path"],
    "oneOf": [
        {"properties": {"mode": {"const": "lines"}, "start": {"type": "integer"}}, "required": ["mode", "start"]},
        {"properties": {"mode": {"const": "bytes"}, "offset": {"type": "integer"}}, "required": ["mode", "offset"]},
    ],
}


def test_variants_keep_the_keys_of_their_parent() -> None:
    """An object with ``properties`` and ``oneOf`` variants rendered as the variants alone: the model
    was told to leave out ``path``, which every call needs."""
    tool = SdkTool("slice", "Slice.", SLICE, {"type": "string"})
    code = python_block(render_python_sdk([tool]))
    namespace = run_stub(code)
    assert "    async def slice(self, args: SliceArgs1 | SliceArgs2) -> str:" in code
    first, second = namespace["SliceArgs1"], namespace["SliceArgs2"]
    assert list(first.__annotations__) == ["path", "mode", "start"] and first.__required_keys__ == {
        "path",
        "mode",
        "start",
    }
    assert list(second.__annotations__) == ["path", "mode", "offset"]
    assert second.__required_keys__ == {"path", "mode", "offset"}
    assert '    path: str  # The file.\n    mode: Literal["lines"]\n' in code
    validator = jsonschema.Draft202012Validator(SLICE)
    assert validator.is_valid({"path": "a", "mode": "lines", "start": 1})
    assert not validator.is_valid({"mode": "lines", "start": 1})
    assert (
        '  slice: { path: string; mode: "lines"; start: number } & Record<string, JsonValue> | '
        '{ path: string; mode: "bytes"; offset: number } & Record<string, JsonValue>;'
    ) in render_typescript_sdk([tool])


def test_variants_that_narrow_a_closed_parent() -> None:
    """Variants that narrow the parent's own keys: each key once, typed by both, required by either."""
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["path", "mode"],
        "properties": {
            "path": {"type": "string"},
            "mode": {"enum": ["lines", "bytes"]},
            "start": {"type": "integer"},
            "offset": {"type": "integer"},
        },
        "oneOf": [
            {"properties": {"mode": {"const": "lines"}}, "required": ["start"]},
            {"properties": {"mode": {"const": "bytes"}}, "required": ["offset"]},
        ],
    }
    code = python_block(render_python_sdk([SdkTool("s", "S.", schema, {})]))
    assert (
        'class SArgs1(TypedDict):\n    path: str\n    mode: Literal["lines"]\n    start: int\n'
        "    offset: NotRequired[int]\n"
    ) in code
    assert (
        'class SArgs2(TypedDict):\n    path: str\n    mode: Literal["bytes"]\n    start: NotRequired[int]\n'
        "    offset: int\n"
    ) in code
    run_stub(code)
    assert (
        '  s: { path: string; mode: "lines"; start: number; offset?: number } | '
        '{ path: string; mode: "bytes"; start?: number; offset: number };'
    ) in render_typescript_sdk([SdkTool("s", "S.", schema, {})])


def test_all_of_merges_its_members() -> None:
    """A multi-member ``allOf`` rendered as ``Any``; its members' keys now make one class."""
    schema = {
        "type": "object",
        "properties": {
            "both": {
                "description": "Both.",
                "allOf": [
                    {"type": "object", "properties": {"p": {"type": "string"}}, "required": ["p"]},
                    {
                        "type": "object",
                        "properties": {"q": {"type": "integer"}, "p": {"description": "The p."}},
                        "additionalProperties": False,
                    },
                ],
            }
        },
    }
    code = python_block(render_python_sdk([SdkTool("m", "M.", schema, {})]))
    assert "    both: NotRequired[MArgsBoth]  # Both.\n" in code
    assert "class MArgsBoth(TypedDict):\n    p: str  # The p.\n    q: NotRequired[int]\n" in code
    assert run_stub(code)["MArgsBoth"].__required_keys__ == {"p"}
    assert "  m: { both?: { p: string; q?: number } } & Record<string, JsonValue>;" in render_typescript_sdk(
        [SdkTool("m", "M.", schema, {})]
    )


def test_variants_that_cannot_be_spelled_out_leave_the_parent_with_a_note() -> None:
    """Too many variants, or none that can hold with the parent: the parent's class, and a note;
    never the variants alone."""
    many = {
        "type": "object",
        "properties": {"path": {"type": "string"}},
        "required": ["path"],
        "allOf": [
            {"oneOf": [{"properties": {f"a{i}": {"type": "string"}}, "required": [f"a{i}"]} for i in range(5)]},
            {"anyOf": [{"properties": {f"b{i}": {"type": "string"}}, "required": [f"b{i}"]} for i in range(5)]},
        ],
    }
    # A closed parent forbids the keys its variants add (additionalProperties sees its own properties only).
    closed = {
        "type": "object",
        "properties": {"path": {"type": "string"}},
        "required": ["path"],
        "additionalProperties": False,
        "oneOf": [
            {"properties": {"x": {"type": "string"}}, "required": ["x"]},
            {"properties": {"y": {"type": "string"}}, "required": ["y"]},
        ],
    }
    for schema in (many, closed):
        tool = SdkTool("t", "T.", schema, {})
        code = python_block(render_python_sdk([tool]))
        assert (
            "class TArgs(TypedDict):\n    # Must also match one of the oneOf/anyOf variants of its schema, "
            "not spelled out here.\n" in code
        )
        assert run_stub(code)["TArgs"].__required_keys__ == {"path"}
        text = render_typescript_sdk([tool])
        assert (
            "  /** T. A type here must also match one of the oneOf/anyOf variants of its schema, "
            "not spelled out. */\n  t: { path: string }" in text
        )
    # A variant that cannot hold is left out, the others stay.
    closed["oneOf"].append({"properties": {"path": {"const": "p"}}})
    tool = SdkTool("t", "T.", closed, {})
    code = python_block(render_python_sdk([tool]))
    assert 'class TArgs(TypedDict):\n    path: Literal["p"]\n' in code and "(self, args: TArgs) -> Any:" in code
    assert '  t: { path: "p" };' in render_typescript_sdk([tool])


def test_a_parent_type_holds_in_its_variants() -> None:
    schema = {
        "type": "object",
        "properties": {
            "v": {"type": ["string", "null"], "anyOf": [{"minLength": 1}, {"type": "null"}]},
            "w": {"type": "string", "oneOf": [{"type": "integer"}, {"enum": ["a", 1, None]}]},
        },
    }
    code = python_block(render_python_sdk([SdkTool("t", "T.", schema, {})]))
    assert '    v: NotRequired[str | None]\n    w: NotRequired[Literal["a"]]\n' in code
    assert '  t: { v?: string | null; w?: "a" } & Record<string, JsonValue>;' in render_typescript_sdk(
        [SdkTool("t", "T.", schema, {})]
    )


def test_a_key_whose_schemas_conflict_is_left_out_of_a_variant() -> None:
    """A key typed two ways cannot be sent: an optional one is not listed, a required one rules
    the variant out; variants that differ only in what no stub shows render once."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
        "anyOf": [
            {"properties": {"a": {"type": "integer"}}},
            {"properties": {"b": {"const": 1}}, "required": ["b"]},
            {"properties": {"b": {"const": 1, "minimum": 0}}, "required": ["b"]},
        ],
    }
    code = python_block(render_python_sdk([SdkTool("t", "T.", schema, {})]))
    assert (
        "class TArgs1(TypedDict):\n    # Additional keys beyond those declared are allowed.\n"
        "    b: NotRequired[int]\n\n" in code
    )
    assert "    a: NotRequired[str]\n    b: Literal[1]\n\n" in code
    assert "(self, args: TArgs1 | TArgs2) -> Any:" in code and "TArgs3" not in code
    schema["required"] = ["a"]
    code = python_block(render_python_sdk([SdkTool("t", "T.", schema, {})]))
    assert (
        "class TArgs1(TypedDict):\n    # Additional keys beyond those declared are allowed.\n"
        "    a: str\n    b: Literal[1]\n\n" in code
    )
    assert "(self, args: TArgs1) -> Any:" in code


def test_deep_combinators_merge_without_recursion_in_bounded_time() -> None:
    """Variants nested in variants, ``allOf`` nested without bound, and a parent key narrowed at
    every level: merging stays iterative, and bounded (past the limits the parent renders alone)."""
    nested: Any = {"type": "string"}
    chained: Any = {"type": "object", "properties": {"x": {"type": "string"}}}
    narrowed: Any = {"type": "object", "properties": {"x": {"type": "string"}}}
    for level in range(5000):
        nested = {
            "type": "object",
            "properties": {"p": {"type": "string"}},
            "required": ["p"],
            "oneOf": [nested, {"properties": {"q": {"type": "integer"}}}],
        }
        chained = {"allOf": [chained, {"properties": {f"k{level % 3}": {"type": "integer"}}}]}
        narrowed = {
            "type": "object",
            "properties": {"x": {"type": "string"}, "c": narrowed},
            "allOf": [{"properties": {"x": {"minLength": 1}, "c": {"required": ["x"]}}}],
        }
    tools = [
        SdkTool(name, "Deep.", schema, schema)
        for name, schema in (("nested", nested), ("chained", chained), ("narrowed", narrowed))
    ]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(120)
    try:
        python = render_python_sdk(tools)
        typescript = render_typescript_sdk(tools)
    finally:
        sys.setrecursionlimit(limit)
    run_stub(python_block(python))
    assert len(python) < 200_000 and len(typescript) < 100_000
    assert python.count("class NestedArgs") < 5  # variants that declare the same render once


#: What pydantic's ``model_json_schema()`` emits for ``class Move(BaseModel): start: Point; end: Point | None = None``.
MOVE = {
    "$defs": {
        "Point": {
            "properties": {"x": {"title": "X", "type": "integer"}, "y": {"title": "Y", "type": "integer"}},
            "required": ["x", "y"],
            "title": "Point",
            "type": "object",
        }
    },
    "properties": {
        "start": {"$ref": "#/$defs/Point"},
        "end": {"anyOf": [{"$ref": "#/$defs/Point"}, {"type": "null"}], "default": None},
    },
    "required": ["start"],
    "title": "Move",
    "type": "object",
}


def test_local_refs_render_as_one_named_type_per_definition() -> None:
    """``$ref``/``$defs`` rendered as ``Any``/``JsonValue``, though the runtime enforces them."""
    tools = [
        SdkTool("move", "Move.", MOVE, {"$defs": MOVE["$defs"], "$ref": "#/$defs/Point"}),
        SdkTool(
            "place",
            "Place.",
            {
                "type": "object",
                "definitions": {"Point": MOVE["$defs"]["Point"]},
                "properties": {"at": {"$ref": "#/definitions/Point"}},
            },
            {},
        ),
    ]
    code = python_block(render_python_sdk(tools))
    assert (
        "class Point(TypedDict):\n    # Additional keys beyond those declared are allowed.\n"
        "    x: int\n    y: int\n" in code
    )
    assert "    start: Point\n    end: NotRequired[Point | None]\n" in code
    assert "    async def move(self, args: MoveArgs) -> Point:" in code
    assert code.count("class Point(") == 1  # the same definition in another tool is the same class
    assert "    at: NotRequired[Point2]\n" in code  # ...under another pointer it is another
    namespace = run_stub(code)
    assert typing.get_type_hints(namespace["MoveArgs"], namespace)["start"] is namespace["Point"]
    text = render_typescript_sdk(tools)
    assert "\ntype Point = { x: number; y: number } & Record<string, JsonValue>;\n" in text
    assert "  move: { start: Point; end?: Point | null } & Record<string, JsonValue>;" in text
    assert "  move: Point;" in text


def test_recursive_definitions_refer_to_their_own_name() -> None:
    schema = {
        "$defs": {
            "Node": {
                "type": "object",
                "required": ["value"],
                "properties": {
                    "value": {"type": "integer"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
                    "parent": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]},
                },
            },
            "Tree": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"$ref": "#/$defs/Tree"}}]},
            "Color": {"enum": ["red", "green"], "type": "string"},
        },
        "type": "object",
        "properties": {
            "root": {"$ref": "#/$defs/Node"},
            "tree": {"$ref": "#/$defs/Tree"},
            "color": {"$ref": "#/$defs/Color"},
            "again": {"$ref": "#"},
        },
    }
    code = python_block(render_python_sdk([SdkTool("graph", "Graph.", schema, {})]))
    assert (
        "class Node(TypedDict):\n    # Additional keys beyond those declared are allowed.\n    value: int\n"
        '    children: NotRequired["list[Node]"]\n    parent: NotRequired["Node | None"]\n' in code
    )
    assert 'Tree: TypeAlias = "str | list[Tree]"\n' in code
    assert 'Color: TypeAlias = Literal["red", "green"]\n' in code
    assert '    again: NotRequired["GraphArgs"]\n' in code
    namespace = run_stub(code)
    node = namespace["Node"]
    hints = typing.get_type_hints(node, namespace)
    assert hints["children"] == list[node] and hints["parent"] == node | None
    assert typing.get_type_hints(namespace["GraphArgs"], namespace)["again"] is namespace["GraphArgs"]
    text = render_typescript_sdk([SdkTool("graph", "Graph.", schema, {})])
    for line in (
        "type Node = { value: number; children?: Node[]; parent?: Node | null } & Record<string, JsonValue>;",
        "type Tree = string | Tree[];",
        'type Color = "red" | "green";',
        "type GraphArgs = { root?: Node; tree?: Tree; color?: Color; again?: GraphArgs } & Record<string, JsonValue>;",
        "  graph: GraphArgs;",
    ):
        assert f"\n{line}\n" in text, line


def test_refs_that_cannot_be_resolved_stay_any_with_a_comment() -> None:
    schema = {
        "type": "object",
        "properties": {
            "remote": {"$ref": "https://example.com/x.json"},
            "anchor": {"$ref": "#point"},
            "missing": {"$ref": "#/$defs/Nope"},
        },
    }
    code = python_block(render_python_sdk([SdkTool("t", "T.", schema, {"$ref": "other.json#/x"})]))
    for ref in ("https://example.com/x.json", "#point", "#/$defs/Nope"):
        assert f'\n    # Any here stands for a $ref this SDK does not resolve: "{ref}".\n' in code
    assert "    remote: NotRequired[Any]\n" in code
    assert (
        '    # Any here stands for a $ref this SDK does not resolve: "other.json#/x".\n'
        "    async def t(self, args: TArgs) -> Any:" in code
    )
    text = render_typescript_sdk([SdkTool("t", "T.", schema, {})])
    assert 'JsonValue here stands for a $ref this SDK does not resolve: "https://example.com/x.json".' in text
    assert "remote?: JsonValue;" in text


def test_refs_inside_a_subschema_with_its_own_id_are_not_resolved_against_the_root() -> None:
    """Under ``$id`` a ``$ref`` resolves against that subschema (Draft 2020-12): ``p`` holds integers, which
    check_schema accepts and validation enforces; the stub showed the root's ``T`` (``str``) instead."""
    schema = {
        "type": "object",
        "$defs": {"T": {"type": "string"}},
        "properties": {
            "p": {
                "$id": "https://example.com/p",
                "$defs": {"T": {"type": "integer"}, "U": {"$ref": "#/$defs/T"}},
                "$ref": "#/$defs/T",
            },
            "q": {"$ref": "#/properties/p/$defs/U"},  # the root's pointer into p: U's own $ref is still p's
            "r": {"$ref": "#/$defs/T"},
        },
        "required": ["p", "q", "r"],
    }

    async def body(args: Any, ctx: Any) -> Any:
        return None

    definition = define_tool(name="t", description="T.", parameters=schema, execute=body)  # accepted
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"p": 1, "q": 1, "r": "s"}) and not validator.is_valid({"p": "s", "q": 1, "r": "s"})
    code = python_block(render_python_sdk(sdk_tools([definition])))
    assert "    p: Any\n    q: U\n    r: T\n" in code, code
    assert "\nU: TypeAlias = Any\n" in code and "\nT: TypeAlias = str\n" in code
    assert '# Any here stands for a $ref this SDK does not resolve: "#/$defs/T".' in code
    run_stub(code)
    text = render_typescript_sdk(sdk_tools([definition]))
    assert "{ p: JsonValue; q: U; r: T }" in text, text
    # Nor is such a definition shared with a tool whose schema reads alike but has no $id (there U is T).
    plain = {**schema, "properties": {**schema["properties"], "p": {"$defs": schema["properties"]["p"]["$defs"]}}}
    code = python_block(render_python_sdk([SdkTool("a", "A.", plain, {}), *sdk_tools([definition])]))
    assert "\nU: TypeAlias = T\n" in code and "\nU2: TypeAlias = Any\n" in code, code
    assert "    q: U\n" in code and "    q: U2\n" in code


def test_refs_merge_with_what_narrows_them() -> None:
    """A ``$ref`` alone (or beside annotations, or in a one-member ``allOf``) is its definition's
    name; with keywords of its own, or under a parent with properties, it merges."""
    defs = {
        "Cat": {
            "type": "object",
            "properties": {"kind": {"const": "cat"}, "meow": {"type": "boolean"}},
            "required": ["kind"],
        },
        "Dog": {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"]},
        "Base": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]},
    }
    schema = {
        "$defs": defs,
        "type": "object",
        "properties": {
            "pet": {
                "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                "discriminator": {"propertyName": "kind"},
            },
            "owner": {"allOf": [{"$ref": "#/$defs/Base"}], "description": "Owner."},
            "typed": {"type": "object", "anyOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]},
            "both": {
                "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"name": {"type": "string"}}, "required": ["name"]}]
            },
            "narrowed": {"$ref": "#/$defs/Cat", "required": ["meow"]},
            "tagged": {
                "type": "object",
                "properties": {"tag": {"type": "string"}},
                "required": ["tag"],
                "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
            },
        },
    }
    code = python_block(render_python_sdk([SdkTool("adopt", "Adopt.", schema, {})]))
    for line in (
        "pet: NotRequired[Cat | Dog]",
        "owner: NotRequired[Base]  # Owner.",
        "typed: NotRequired[Cat | Dog]",
        "both: NotRequired[AdoptArgsBoth]",
        "narrowed: NotRequired[AdoptArgsNarrowed]",
        "tagged: NotRequired[AdoptArgsTagged1 | AdoptArgsTagged2]",
    ):
        assert f"\n    {line}\n" in code, line
    namespace = run_stub(code)
    assert namespace["AdoptArgsBoth"].__required_keys__ == {"id", "name"}
    assert namespace["AdoptArgsNarrowed"].__required_keys__ == {"kind", "meow"}
    assert namespace["AdoptArgsTagged1"].__required_keys__ == {"tag", "kind"}
    assert namespace["AdoptArgsTagged2"].__annotations__["kind"] == Literal["dog"]
    text = render_typescript_sdk([SdkTool("adopt", "Adopt.", schema, {})])
    assert (
        'tagged?: { tag: string; kind: "cat"; meow?: boolean } & Record<string, JsonValue> | '
        '{ tag: string; kind: "dog" } & Record<string, JsonValue> }'
    ) in text


def test_definition_names_are_escaped_and_unique() -> None:
    schema = {
        "$defs": {
            "a/b~c%": {"type": "string"},
            "Any": {"type": "integer"},
            "Point": {"type": "number"},
            "": {"type": "boolean"},
            "9": {"type": "null"},
        },
        "type": "object",
        "properties": {
            "a": {"$ref": "#/$defs/a~1b~0c%25"},
            "b": {"$ref": "#/$defs/Any"},
            "c": {"$ref": "#/$defs/Point"},
            "d": {"$ref": "#/$defs/"},
            "e": {"$ref": "#/$defs/9"},
        },
    }
    tools = [SdkTool("t", "T.", schema, {}), SdkTool("Point", "P.", {"type": "object"}, {})]
    code = python_block(render_python_sdk(tools))
    for line in (
        "ABC: TypeAlias = str",
        "Any2: TypeAlias = int",
        "Point2: TypeAlias = float",
        "Definition: TypeAlias = bool",
        "T9: TypeAlias = None",
    ):
        assert f"\n{line}\n" in code, line
    run_stub(code)
    assert "\ntype Any = number;\n" in render_typescript_sdk(tools)


@pytest.mark.parametrize("key", ["none", "true", "False"])
def test_definitions_named_like_python_constants_get_another_name(key: str) -> None:
    """``none`` camel-cases to ``None``: ``class None(TypedDict)`` is a syntax error and ``p: None``
    would read as the null type."""
    schema = {
        "$defs": {key: {"type": "object", "properties": {"a": {"type": "string"}}}},
        "type": "object",
        "properties": {"p": {"$ref": f"#/$defs/{key}"}},
        "required": ["p"],
    }
    namespace = run_stub(python_block(render_python_sdk([SdkTool("t", "T.", schema, {})])))
    point = typing.get_type_hints(namespace["TArgs"])["p"]
    assert typing.get_type_hints(point, include_extras=True)["a"] == typing.NotRequired[str]


def test_the_rules_say_what_the_worker_refuses_or_does_that_a_script_writer_would_not_expect() -> None:
    """Each sentence answers an error the worker gives (or a behaviour it has) for ordinary script habits."""
    from dsh_core.codemode.sdk import PYTHON_RULES

    for said in [
        "not tuples or sets",
        "not `-0.0`",
        "never `asyncio.run(...)`",
        "A call you cancel",
        "`ToolCallError`",
    ]:
        assert said in PYTHON_RULES, said
