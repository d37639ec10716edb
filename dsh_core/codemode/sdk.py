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

import json
import keyword
import re
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import Any, Final

from attrs import frozen

from dsh_core.model import ToolDefinition

__all__ = [
    "MAX_TYPE_DEPTH",
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
    tools = [SdkTool(d.name, d.description, d.parameters, d.output.schema) for d in definitions
             if d.name != "run_code"]
    return sorted(tools, key=lambda tool: tool.name)


def is_attribute_name(name: str) -> bool:
    """True when ``tools.<name>`` works and reads well: an NFKC-stable identifier, no keyword, no ``_`` prefix."""
    return (name.isidentifier() and not keyword.iskeyword(name) and not name.startswith("_")
            and unicodedata.normalize("NFKC", name) == name)


def _is_field_name(key: str) -> bool:
    """True when ``key: T`` in a class body declares exactly ``key``.

    Python reads identifiers NFKC-normalized (``ﬁle`` is ``file``) and mangles a
    ``__name`` without trailing underscores in a class body (``_Cls__name``).
    """
    return (key.isidentifier() and not keyword.iskeyword(key) and unicodedata.normalize("NFKC", key) == key
            and not (key.startswith("__") and not key.endswith("__")))


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
_UNSHOWABLE: Final = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\xad\u061c\u180e\u200b\u200e\u200f\u2028-\u202e"
                                "\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\ud800-\udfff\U000e0000-\U000e007f]")


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
_TYPING_KEYWORDS: Final = frozenset({"type", "properties", "items", "const", "enum", "oneOf", "anyOf", "allOf",
                                     "$ref", "$dynamicRef"})


def _constrains_only(schema: Any) -> bool:
    """True for a subschema that only narrows its parent's type (``{"required": ["path"]}``)."""
    return isinstance(schema, dict) and not _TYPING_KEYWORDS.intersection(schema)


def _alternatives(schema: Mapping[str, Any]) -> list[Any] | None:
    found: list[Any] | None = None
    for key in ("oneOf", "anyOf"):
        value = schema.get(key)
        if isinstance(value, list) and value:
            found = value
            break
    else:
        value = schema.get("allOf")
        if isinstance(value, list) and len(value) == 1:
            found = value
    if found is not None and _types_of(schema) and all(_constrains_only(alt) for alt in found):
        return None  # e.g. "path or text is required": the schema's own type says more than Any would
    return found


def _union(parts: Sequence[str]) -> str:
    unique = list(dict.fromkeys(parts))
    return " | ".join(unique) if unique else "Any"


def _camel(text: str) -> str:
    words = re.split(r"[^0-9A-Za-z]+", text)
    name = "".join(word[:1].upper() + word[1:] for word in words if word)
    if not name:
        name = "Tool"
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


class _PythonTypes:
    """Renders schemas as Python type expressions, collecting the TypedDict classes they need."""

    def __init__(self, methods: Iterable[str] = ()) -> None:
        self.classes: list[str] = []
        #: What the stub imports: names from ``typing``, and the modules ``builtins`` and ``typing``.
        self.used: set[str] = set()
        #: The ``Tools`` methods: inside that class body such a name is the method, not the type.
        self._methods = frozenset(methods)
        self._names: set[str] = {"ToolCallError", "Tools", "Any", "Literal", "NotRequired", "Protocol",
                                 "TypedDict", *self._methods}

    def class_name(self, hint: str) -> str:
        base = hint[:MAX_CLASS_NAME]
        name, suffix = base, 2
        while name in self._names:
            name = f"{base}{suffix}"
            suffix += 1
        self._names.add(name)
        return name

    def expression(self, schema: Any, hint: str) -> str:
        return _expand(schema, hint, self._visit)

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

        return _MARKED.sub(resolve, text)

    def module(self, module: str) -> str:
        """The name the stub imports ``module`` as: itself, unless a method shadows that too."""
        return module if module not in self._methods else f"_{module}"

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

    def _visit(self, schema: Any, hint: str, depth: int) -> str | _Node:
        if not isinstance(schema, dict) or depth > MAX_TYPE_DEPTH:
            return self._any()
        if "const" in schema:
            return self._literals([schema["const"]])
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return self._literals(enum)
        alternatives = _alternatives(schema)
        if alternatives is not None:
            return _Node([(alt, f"{hint}{i + 1}" if len(alternatives) > 1 else hint)
                          for i, alt in enumerate(alternatives)], _union)
        types = _types_of(schema)
        if not types:
            return self._any()
        if len(types) > 1:
            return _Node([({**schema, "type": kind}, hint) for kind in types], _union)
        kind = types[0]
        if kind in _PY_SCALARS:
            return _PY_SCALARS[kind] if kind == "null" else self.builtin(_PY_SCALARS[kind])
        if kind == "array":
            items = schema.get("items")
            array = self.builtin("list")
            if isinstance(items, dict):
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
        properties = schema.get("properties")
        extra = schema.get("additionalProperties", True)
        if not isinstance(properties, dict) or not properties:
            mapping = f"{self.builtin('dict')}[{self.builtin('str')}, "
            if isinstance(extra, dict):
                return _Node([(extra, hint + "Value")], lambda parts: f"{mapping}{parts[0]}]")
            return f"{mapping}{self._any()}]"
        name = self.class_name(hint)
        keys = list(properties)
        required = schema.get("required")
        required_set = set(required) if isinstance(required, list) else set()
        children = [(properties[key], name + _camel(key)) for key in keys]
        open_object = extra is not False

        def combine(parts: list[str]) -> str:
            self.used.add("TypedDict")
            fields: list[tuple[str, str, str]] = []
            for key, part in zip(keys, parts, strict=True):
                annotation = part
                if key not in required_set:
                    self.used.add("NotRequired")
                    annotation = f"NotRequired[{part}]"
                prop = properties[key]
                note = prop.get("description") if isinstance(prop, dict) else None
                fields.append((key, annotation, _py_comment(note) if isinstance(note, str) and note.strip() else ""))
            if all(_is_field_name(key) for key in keys):
                lines = [f"class {name}(TypedDict):"]
                if open_object:
                    lines.append("    # Additional keys beyond those declared are allowed.")
                for key, annotation, note in fields:
                    lines.append(f"    {key}: {annotation}" + (f"  # {note}" if note else ""))
            else:
                # Keys that cannot be class attributes still get a precise type: the functional syntax.
                lines = []
                if open_object:
                    lines.append("# Additional keys beyond those declared are allowed.")
                lines.append(f"{name} = TypedDict({json.dumps(name)}, {{")
                for key, annotation, note in fields:
                    lines.append(f"    {_py_string(key)}: {annotation},"
                                 + (f"  # {note}" if note else ""))
                lines.append("})")
            self.classes.append(self.module_level("\n".join(lines)))
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
tool's `...Output` type.
- Run independent calls together with `asyncio.gather(...)` (`import asyncio`): concurrency-safe tools \
overlap, the others run one at a time in call order.
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
        if is_attribute_name(tool.name):
            methods.add(tool.name)
            members.append(f"    async def {tool.name}(self, args: {args}) -> {output}:\n"
                           f"{_docstring(tool.description, '        ')}")
        else:
            members.append(f"    # tools[{_py_string(tool.name)}](args: {args}) -> {output}: "
                           f"{_py_comment(tool.description)}")
    imports = [name for name in ("Any", "Literal", "NotRequired", "Protocol", "TypedDict") if name in types.used]
    modules = "".join(f"import {name}\n" if types.module(name) == name else f"import {name} as _{name}\n"
                      for name in ("builtins", "typing") if name in types.used)
    blocks = [f"{modules}from typing import {', '.join(imports)}",
              "class ToolCallError(Exception):\n    tool_name: str",
              *types.classes,
              # A class body of comments only is not valid Python: ``pass`` keeps the stub parseable.
              "class Tools(Protocol):\n" + "\n".join([*members, *([] if methods else ["    pass"])]),
              "tools: Tools"]
    return f"{PYTHON_RULES}\n\n```python\n" + "\n\n".join(blocks) + "\n```"


# -- TypeScript -----------------------------------------------------------------------------------------


_TS_SCALARS: Final = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean",
                      "null": "null"}
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


def _ts_visit(schema: Any, hint: str, depth: int) -> str | _Node:
    if not isinstance(schema, dict):
        return "JsonValue" if schema is True else "unknown"
    if depth > MAX_TYPE_DEPTH:
        return "JsonValue"
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list) and values:
        return _union([_ts_literal(v) for v in values])
    alternatives = _alternatives(schema)
    if alternatives is not None:
        return _Node([(alt, hint) for alt in alternatives], _union)
    types = _types_of(schema)
    if not types:
        return "JsonValue"
    if len(types) > 1:
        return _Node([({**schema, "type": kind}, hint) for kind in types], _union)
    kind = types[0]
    if kind in _TS_SCALARS:
        return _TS_SCALARS[kind]
    if kind == "array":
        items = schema.get("items")
        if isinstance(items, dict):
            return _Node([(items, hint)], lambda parts: _ts_array(parts[0]))
        return "JsonValue[]"
    if kind != "object":
        return "unknown"
    properties = schema.get("properties")
    extra = schema.get("additionalProperties", True)
    if not isinstance(properties, dict) or not properties:
        return "Record<string, never>" if extra is False else "Record<string, JsonValue>"
    keys = list(properties)
    required = schema.get("required")
    required_set = set(required) if isinstance(required, list) else set()

    def combine(parts: list[str]) -> str:
        fields = "; ".join(f"{_ts_key(k)}{'' if k in required_set else '?'}: {p}"
                           for k, p in zip(keys, parts, strict=True))
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
    args_members: list[str] = []
    output_members: list[str] = []
    for tool in ordered:
        doc = f"  /** {_ts_comment(tool.description)} */"
        key = _ts_key(tool.name)
        args_members.append(f"{doc}\n  {key}: {_expand(tool.parameters, tool.name, _ts_visit)};")
        output_members.append(f"  {key}: {_expand(tool.output, tool.name, _ts_visit)};")
    blocks = [
        "type JsonValue = string | number | boolean | null | JsonValue[] | { [key: string]: JsonValue };",
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
