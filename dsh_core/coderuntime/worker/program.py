"""Compile a program (the body of an ``async def``) the same way on host and worker.

Standard library only. The source is parsed as a module, its statements
become the body of ``async def __dsh_main__()`` with unchanged line
numbers, and every top-level ``return X`` becomes ``return [X]`` so the
runner can tell ``return None`` (a value) from falling off the end or a bare
``return`` (no value). ``yield`` at top level is refused: a program is a
coroutine, not a generator. The code is named as a script's (frames read
``in <module>``, a class ``MyErr`` is ``MyErr``, not ``__dsh_main__.<locals>.MyErr``).
"""

from __future__ import annotations

import ast
import traceback
import types
import warnings

__all__ = ["FILENAME", "MAIN", "build", "format_syntax_error"]

FILENAME = "<program>"
MAIN = "__dsh_main__"

_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _top_level(nodes: list[ast.stmt]) -> list[ast.AST]:
    # Iterative walk that does not descend into nested scopes, but does into the
    # parts of a def, lambda or class that run in the enclosing scope.
    found: list[ast.AST] = []
    stack: list[ast.AST] = list(nodes)
    while stack:
        node = stack.pop()
        found.append(node)
        if isinstance(node, _NESTED):
            stack.extend(_evaluated_outside(node))  # its body's returns and yields are its own
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def _evaluated_outside(node: ast.AST) -> list[ast.AST]:
    """The expressions of a def, lambda or class that the enclosing scope evaluates."""
    parts: list[ast.expr | None] = []
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        parts += node.decorator_list
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        arguments = node.args
        parts += arguments.defaults + arguments.kw_defaults
        if not isinstance(node, ast.Lambda):
            every = arguments.posonlyargs + arguments.args + arguments.kwonlyargs
            every += [arg for arg in (arguments.vararg, arguments.kwarg) if arg is not None]
            parts += [arg.annotation for arg in every] + [node.returns]
    if isinstance(node, ast.ClassDef):
        parts += node.bases + [keyword.value for keyword in node.keywords]
    return [part for part in parts if part is not None]


def build(source: str, warned: list[str] | None = None) -> types.CodeType:
    """Return the code object of the module defining ``__dsh_main__``; raise SyntaxError.

    Asserts are always kept (``optimize=0``), whatever the compiling
    interpreter's ``-O``: the worker's own ``-I`` ignores ``PYTHONOPTIMIZE``.
    With ``warned``, compile-time warnings (e.g. ``SyntaxWarning``) are not
    shown but appended to it, formatted as Python prints them, for the worker
    to show in the program's output; without it they are shown as usual.
    """
    if warned is None:
        return _build(source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = _build(source)
    for warning in caught:
        if warning.filename != FILENAME:
            # Not the program's: another thread warned while the filters were swapped
            # (catch_warnings is process-wide). Give it back to the host, not the program.
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
            continue
        warned.append(
            warnings.formatwarning(
                warning.message, warning.category, warning.filename, warning.lineno, _line(source, warning.lineno)
            )
        )
    return code


def _build(source: str) -> types.CodeType:
    # dont_inherit: this module's ``from __future__ import annotations`` is not the program's.
    tree = compile(source, FILENAME, "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
    assert isinstance(tree, ast.Module)
    body = tree.body or [ast.Pass(lineno=1, col_offset=0, end_lineno=1, end_col_offset=0)]
    if "yield" in source:  # only then can there be one to refuse (the full walk is dearer)
        for node in _top_level(body):
            if isinstance(node, (ast.Yield, ast.YieldFrom)):
                raise SyntaxError(
                    "'yield' is not allowed in a program (it is the body of an async function)",
                    (FILENAME, node.lineno, node.col_offset + 1, _line(source, node.lineno)),
                )
    for node in _top_level_returns(body):
        if node.value is not None:
            wrapped = ast.List(elts=[node.value], ctx=ast.Load())
            node.value = ast.copy_location(wrapped, node.value)
    # Every node made here has the locations compile needs (the parser's have theirs),
    # so no fix_missing_locations: its walk of the whole tree cost more than the parse.
    function = ast.AsyncFunctionDef(
        name=MAIN,
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
    return _named_as_in_a_script(compile(module, FILENAME, "exec", dont_inherit=True, optimize=0))


_LOCALS = MAIN + ".<locals>."


def _named_as_in_a_script(code: types.CodeType) -> types.CodeType:
    """``code`` with the names of the program's code as a script's: ``<module>``, ``f``, ``A.m``.

    The program's statements are the body of ``__dsh_main__``, so its frames
    would read ``in __dsh_main__`` and its functions and classes be named
    ``__dsh_main__.<locals>.f``: that would show in tracebacks (an exception
    class's name), reprs (a dataclass's) and error messages (``f() missing 1
    required positional argument``). ``__dsh_main__``'s code is renamed
    ``<module>``; each code nested in it loses the prefix, and so does the
    ``__qualname__`` a class body assigns (a constant equal to the body's own
    qualified name). The function keeps its global name, ``MAIN``.
    """
    consts = code.co_consts
    qualname = code.co_qualname
    if qualname == MAIN:
        renamed = name = "<module>"
    else:
        renamed, name = qualname.removeprefix(_LOCALS), code.co_name
    if renamed == qualname and not any(type(const) is types.CodeType for const in consts):
        return code  # the module's code with nothing to rename
    nested = qualname not in (renamed, MAIN)
    fixed = tuple(
        _named_as_in_a_script(const)
        if type(const) is types.CodeType
        else renamed
        if nested and type(const) is str and const == qualname
        else const
        for const in consts
    )
    return code.replace(co_name=name, co_qualname=renamed, co_consts=fixed)


def _top_level_returns(nodes: list[ast.stmt]) -> list[ast.Return]:
    # A return is a statement: walk statement blocks only, not expressions, and not
    # into nested scopes (their returns are their own).
    found: list[ast.Return] = []
    stack: list[ast.stmt] = list(nodes)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Return):
            found.append(node)
        elif isinstance(node, (ast.If, ast.For, ast.AsyncFor, ast.While)):
            stack += node.body + node.orelse
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            stack += node.body
        elif isinstance(node, (ast.Try, ast.TryStar)):
            stack += node.body + node.orelse + node.finalbody
            for handler in node.handlers:
                stack += handler.body
        elif isinstance(node, ast.Match):
            for case in node.cases:
                stack += case.body
    return found


def _line(source: str, lineno: int | None) -> str | None:
    if not lineno:
        return None
    lines = source.splitlines()
    return lines[lineno - 1] if 0 < lineno <= len(lines) else None


def format_syntax_error(error: SyntaxError, source: str) -> str:
    """``SyntaxError: msg`` with the file, line and caret, like the interpreter prints it."""
    if error.text is None and error.lineno:
        text = _line(source, error.lineno)
        if text is not None:
            error.text = text
            if not error.offset:
                error.offset = 1
    return "".join(traceback.format_exception_only(type(error), error)).rstrip("\n")
