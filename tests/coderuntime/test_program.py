"""How a program's source becomes ``__dsh_main__``: which returns carry a value, and what is refused."""

from __future__ import annotations

import ast
import asyncio
import glob
import os
import textwrap
import types
import warnings
from typing import Any

import pytest

from dsh_core.coderuntime.worker import program as programs

NO_VALUE = object()


def _result(source: str, **env: Any) -> Any:
    """Run the built program; its value, or NO_VALUE."""
    namespace: dict[str, Any] = dict(env)
    exec(programs.build(source), namespace)
    outcome = asyncio.run(namespace[programs.MAIN]())
    return NO_VALUE if outcome is None else outcome[0]


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("return 1", 1),
        ("", NO_VALUE),
        ("x = 1", NO_VALUE),
        ("return", NO_VALUE),
        ("return None", None),
        ("if flag:\n    return 'if'\nelse:\n    return 'else'", "if"),
        ("if not flag:\n    pass\nelif flag:\n    return 'elif'", "elif"),
        ("for i in range(3):\n    if i == 2:\n        return i\nelse:\n    return 'else'", 2),
        ("for i in range(3):\n    pass\nelse:\n    return 'for-else'", "for-else"),
        ("while True:\n    return 'while'", "while"),
        ("n = 0\nwhile n < 2:\n    n += 1\nelse:\n    return n", 2),
        ("try:\n    1 / 0\nexcept ZeroDivisionError:\n    return 'except'", "except"),
        ("try:\n    pass\nexcept Exception:\n    pass\nelse:\n    return 'try-else'", "try-else"),
        ("try:\n    return 'body'\nfinally:\n    pass", "body"),
        ("try:\n    pass\nfinally:\n    return 'finally'", "finally"),
        ("try:\n    return 'star-body'\nexcept* ValueError:\n    pass", "star-body"),
        ("try:\n    pass\nexcept* ValueError:\n    pass\nelse:\n    return 'star-else'", "star-else"),
        ("import contextlib\nwith contextlib.nullcontext(5) as v:\n    return v", 5),
        ("import contextlib\nasync with contextlib.AsyncExitStack():\n    return 'async-with'", "async-with"),
        ("async def gen():\n    yield 1\nasync for v in gen():\n    return v", 1),
        ("match flag:\n    case True:\n        return 'case'\n    case _:\n        return 'default'", "case"),
        ("def inner():\n    return 'inner'\nx = inner()", NO_VALUE),  # a nested function's return is its own
        ("class C:\n    def m(self):\n        return 'method'\nreturn C().m()", "method"),
        ("f = lambda: 3\nreturn f()", 3),
        ("def g():\n    yield 1\n    yield 2\nreturn list(g())", [1, 2]),
        ("return [x async for x in aiter_of([1, 2])]", [1, 2]),
        ("return await asyncio_sleep(0, 'awaited')", "awaited"),
        ("if flag:\n    return (1, 2)", (1, 2)),
    ],
)
def test_only_the_programs_own_returns_carry_a_value(source: str, expected: Any) -> None:
    async def aiter_of(values: list[int]) -> Any:
        for value in values:
            yield value

    assert _result(source, flag=True, aiter_of=aiter_of, asyncio_sleep=asyncio.sleep) == expected


@pytest.mark.parametrize(
    "source",
    [
        "yield 1",
        "x = yield",
        "if True:\n    for i in range(2):\n        yield i",
        "yield from []",
        "return (yield)",
        # Parts of a def, lambda or class that run in the program's own scope:
        "@(yield)\ndef f():\n    pass",
        "def f(x=(yield)):\n    pass",
        "def f(*, x=(yield)):\n    pass",
        "def f(x: (yield)):\n    pass",
        "def f() -> (yield):\n    pass",
        "f = lambda x=(yield): x",
        "class C((yield)):\n    pass",
        "class C(metaclass=(yield)):\n    pass",
        "@(yield)\nclass C:\n    pass",
    ],
)
def test_a_yield_in_the_program_itself_is_refused(source: str) -> None:
    with pytest.raises(SyntaxError, match="'yield' is not allowed in a program") as caught:
        programs.build(source)
    assert caught.value.filename == programs.FILENAME and caught.value.lineno is not None


def test_a_yield_in_a_nested_scope_is_its_own() -> None:
    source = "def g():\n    yield 1\nclass C:\n    def m(self):\n        yield 2\nreturn [*g(), *C().m()]"
    assert _result(source) == [1, 2]


def _reference_build(source: str) -> types.CodeType:
    # The construction this module had before it stopped walking the whole tree:
    # every node visited, then fix_missing_locations over the result.
    tree = compile(source, programs.FILENAME, "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
    body = tree.body or [ast.Pass(lineno=1, col_offset=0, end_lineno=1, end_col_offset=0)]
    for node in programs._top_level(body):
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            raise SyntaxError("yield")
        if isinstance(node, ast.Return) and node.value is not None:
            node.value = ast.copy_location(ast.List(elts=[node.value], ctx=ast.Load()), node.value)
    function = ast.AsyncFunctionDef(
        name=programs.MAIN,
        args=ast.arguments(
            posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]
        ),
        body=body,
        decorator_list=[],
        returns=None,
        type_comment=None,
        lineno=1,
        col_offset=0,
    )
    module = ast.Module(body=[function], type_ignores=[])
    ast.fix_missing_locations(module)
    return programs._named_as_in_a_script(compile(module, programs.FILENAME, "exec", dont_inherit=True, optimize=0))


def _function_bodies() -> list[str]:
    """The body of every function in the standard library's asyncio and json packages, as programs."""
    root = os.path.dirname(asyncio.__file__)
    bodies = []
    for path in sorted(glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "..", "json", "*.py"))):
        with open(path) as handle:
            text = handle.read()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                bodies.append(textwrap.dedent("\n".join(lines[node.body[0].lineno - 1 : node.body[-1].end_lineno])))
    return bodies


def test_the_code_is_identical_to_a_whole_tree_construction() -> None:
    # Hundreds of real function bodies (returns in every kind of block, nested scopes,
    # decorators, comprehensions): the same code object, positions included.
    bodies = _function_bodies()
    assert len(bodies) > 500
    compared = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for source in bodies:
            try:
                expected = _reference_build(source)
            except SyntaxError:
                continue
            # Code objects compare by bytecode, constants (nested code included), names and
            # line and column tables; marshal bytes would not do (they depend on refcounts).
            assert programs.build(source) == expected, source
            compared += 1
    assert compared > 500


def test_the_programs_code_is_named_as_a_scripts() -> None:
    source = textwrap.dedent("""\
        import dataclasses
        @dataclasses.dataclass
        class Point:
            x: int
            class Inner:
                def m(self):
                    def deep():
                        pass
                    return deep
        def f(x):
            pass
        try:
            f()
        except TypeError as error:
            message = str(error)
        text = "__dsh_main__"  # a program's own strings are left alone
        return [repr(Point(1)), Point.__qualname__, Point.Inner.m.__qualname__, Point.Inner().m().__qualname__,
                f.__qualname__, (lambda: 0).__qualname__, message, text]
        """)
    assert _result(source, __name__="__main__") == [
        "Point(x=1)",
        "Point",
        "Point.Inner.m",
        "Point.Inner.m.<locals>.deep",
        "f",
        "<lambda>",
        "f() missing 1 required positional argument: 'x'",
        "__dsh_main__",
    ]
    namespace: dict[str, Any] = {}
    exec(programs.build("return 1"), namespace)
    main = namespace[programs.MAIN]  # still found by its name; its frames read "in <module>"
    assert (main.__name__, main.__qualname__) == ("<module>", "<module>")


def test_annotations_are_evaluated_as_in_a_script_not_postponed() -> None:
    # The compiling module's own ``from __future__ import annotations`` must not leak into the program.
    source = textwrap.dedent("""\
        import dataclasses, typing
        @dataclasses.dataclass
        class A:
            x: int
            k: typing.ClassVar[int] = 5
            y: dataclasses.InitVar[int] = 0
            def __post_init__(self, y):
                self.x += y
        return [repr(A(1, 2)), A.__annotations__["x"] is int]
        """)
    assert _result(source, __name__="__main__") == ["A(x=3)", True]
