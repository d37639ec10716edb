"""Running programs: outcomes, logs, bindings, budgets, abort, disposal, hygiene."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from dsh_core.abort import AbortController
from dsh_core.coderuntime import (
    BindingNamespace,
    CodeRunResult,
    CodeRuntimeConfig,
    ErrorClassSpec,
    PythonCodeRuntime,
    RuntimeDisposedError,
    current_run,
)
from dsh_core.coderuntime.isolation import CgroupPool
from dsh_core.lossless import is_lossless

from .conftest import (
    LEVELS,
    arun,
    children_of,
    collect_leftovers,
    echo,
    run_dirs,
    run_one,
    tools,
    with_runtime,
    zygote_processes,
)


def _kind(result: CodeRunResult) -> str | None:
    return result.error.kind if result.error else None


def test_values_logs_and_exceptions() -> None:
    async def go(rt: PythonCodeRuntime) -> None:
        r = await rt.run(
            "print('a', 1)\nconsole.log('b', [2])\nconsole.warn('c')\nimport sys\n"
            "print('e', file=sys.stderr)\nsys.stdout.write('par')\nsys.stdout.write('tial\\n')\n"
            "print('multi\\nline')\nconsole.error('x\\ny')\nreturn {'v': [1, 2.5, None, True, 'é']}",
            [],
        )
        assert r.logs == ("a 1", "b [2]", "c", "e", "partial", "multi", "line", "x\ny")
        assert (r.value, r.has_value, r.error) == ({"v": [1, 2.5, None, True, "é"]}, True, None)
        r = await rt.run("x = 1", [])
        assert (r.value, r.has_value, r.error) == (None, False, None)
        r = await rt.run("return", [])
        assert (r.has_value, r.error) == (False, None)
        r = await rt.run("return None", [])
        assert (r.value, r.has_value) == (None, True)
        r = await rt.run("def f():\n    return 5\nreturn f()", [])
        assert r.value == 5
        r = await rt.run(
            "console.log('l', 1)\nconsole.info('i')\nconsole.warn('w')\nconsole.error('e')\nconsole.debug('d', None)",
            [],
        )
        assert r.logs == ("l 1", "i", "w", "e", "d None") and r.error is None
        r = await rt.run("print('kept')\nconsole.log('too')\n\nraise KeyError('boom')", [])
        assert r.logs == ("kept", "too") and _kind(r) == "exception"
        assert r.error is not None
        assert 'File "<program>", line 4' in r.error.message and "raise KeyError('boom')" in r.error.message
        assert r.error.message.endswith("KeyError: 'boom'") and "runner.py" not in r.error.message
        r = await rt.run("return float('nan')", [])
        assert _kind(r) == "invalid-output" and "lossless" in r.error.message  # type: ignore[union-attr]
        r = await rt.run("return (1, 2)", [])
        assert _kind(r) == "invalid-output"
        r = await rt.run("return {'avg_delta': round(-0.002, 2)}", [])
        assert r.error is not None and r.error.message == (
            "program completion must be lossless JSON: float -0.0 is not lossless JSON (it reads back as 0; "
            'use 0.0, e.g. x + 0.0) at result["avg_delta"]'
        )
        r = await rt.run("import os\nreturn [dict(os.environ), os.listdir('.') if os.getuid() == 0 else []]", [])
        assert r.value is not None and r.value[0] == {}
        r = await rt.run("import sys\nsys.exit(4)", [])
        assert _kind(r) == "exception" and "SystemExit: 4" in r.error.message  # type: ignore[union-attr]
        r = await rt.run("yield 1", [])
        assert _kind(r) == "exception" and "yield" in r.error.message  # type: ignore[union-attr]

    arun(with_runtime(go, isolation="auto"))


def test_an_int_too_long_for_json_text_is_refused_both_ways_even_with_the_limit_lifted() -> None:
    # Python writes no int past sys.get_int_max_str_digits() (4300) as text, and the host's
    # parser reads none: such a completion is invalid-output and such an argument or result
    # is refused like any lossy value, never a traceback from json or a frame the host drops.
    async def huge(args: Any) -> Any:
        return 10**5000

    bindings = [BindingNamespace("tools", {"echo": echo, "huge": huge})]
    lifted = "import sys\nsys.set_int_max_str_digits(0)\n"
    catch = "try:\n    return await tools.{}\nexcept ToolCallError as error:\n    return str(error)"

    async def go(rt: PythonCodeRuntime) -> None:
        for prelude in ("", lifted):
            for program in ("return 10**5000", "return [1, {'n': -10**5000}]"):
                r = await rt.run(prelude + program, bindings)
                assert _kind(r) == "invalid-output", (prelude, program, r)
                assert r.error is not None and "int of more than 4300 digits" in r.error.message
            r = await rt.run(prelude + catch.format("echo({'x': 10**5000})"), bindings)
            assert r.value == (
                "binding arguments must be lossless JSON: int of more than 4300 digits does not "
                "survive JSON (Python refuses to convert it to and from text)"
            ), r
        r = await rt.run(catch.format("huge({})"), bindings)
        assert r.value == (
            "binding resolution must be lossless JSON: int of more than 4300 digits does not "
            "survive JSON (Python refuses to convert it to and from text)"
        ), r
        r = await rt.run("return [10**4299, -10**4299]", bindings)  # 4300 digits: still fine
        assert r.error is None and r.value == [10**4299, -(10**4299)]

    arun(with_runtime(go, isolation="auto"))


def test_a_surrogate_pair_written_as_two_code_points_is_refused_both_ways_and_lone_surrogates_cross() -> None:
    # '\ud83d\ude00' (two code points) has no JSON text of its own: written as two escapes, it is
    # read back as one character, U+1F600. Such a completion is invalid-output and such an argument
    # or result is refused like any lossy value; lone surrogates (a file name that is not UTF-8),
    # and a low one before a high one, cross as they are.
    calls: list[Any] = []

    async def record(args: Any) -> Any:
        calls.append(args)
        return args

    async def pair(args: Any) -> Any:
        return {"name": "x\ud83d\ude00"}

    bindings = [BindingNamespace("tools", {"record": record, "pair": pair})]
    catch = "try:\n    return await tools.{}\nexcept ToolCallError as error:\n    return str(error)"
    why = (
        "a surrogate pair written as two code points ({} at character {}) does not survive JSON "
        "(a parser reads one character)"
    )

    async def go(rt: PythonCodeRuntime) -> None:
        r = await rt.run("return {'name': 'smile \\ud83d\\ude00'}", bindings)
        assert _kind(r) == "invalid-output" and r.error is not None, r
        assert r.error.message == (
            "program completion must be lossless JSON: " + why.format("U+D83D U+DE00", 6) + ' at result["name"]'
        )
        r = await rt.run("return [1, {'k\\udbff\\udfff': 1}]", bindings)
        assert r.error is not None and r.error.message == (
            "program completion must be lossless JSON: object key 'k\\udbff\\udfff' holds a surrogate pair written "
            "as two code points (U+DBFF U+DFFF at character 1), which does not survive JSON (a parser reads one "
            "character) at result[1]"
        ), r
        r = await rt.run(catch.format("record({'a': ['ok', '\\ud800\\udc00']})"), bindings)
        assert r.value == (
            "binding arguments must be lossless JSON: " + why.format("U+D800 U+DC00", 0) + ' at value["a"][1]'
        ), r
        r = await rt.run(catch.format("pair({})"), bindings)
        assert r.value == (
            "binding resolution must be lossless JSON: " + why.format("U+D83D U+DE00", 1) + ' at result["name"]'
        ), r
        assert calls == []
        lone = {"caf\udce9.txt": ["\ud83d", "\ude00\ud83d", "\ud83d \ude00", "\U0001f600"]}
        r = await rt.run(f"return [await tools.record({lone!r}), {lone!r}]", bindings)
        assert r.error is None and r.value == [lone, lone] and calls == [lone], r

    arun(with_runtime(go, isolation="auto"))


def test_printed_text_and_error_messages_join_a_surrogate_pair_into_its_character() -> None:
    # Logs and error messages are text, not values: print('\ud83d\ude00') (two code points, as a
    # model writing JSON-style escapes in Python spells an emoji) shows the character it spells,
    # as any JSON hop would, instead of making the run's result or its session event unrecordable.
    # Lone surrogates, and a low one before a high one, are kept as they are.
    async def go(rt: PythonCodeRuntime) -> None:
        r = await rt.run(
            "print('smile \\ud83d\\ude00', '\\udc80 \\ude00\\ud83d')\nconsole.error('e \\udbff\\udfff')\nreturn 1", []
        )
        assert r.error is None and r.logs == ("smile \U0001f600 \udc80 \ude00\ud83d", "e \U0010ffff"), r
        r = await rt.run("raise ValueError('x \\ud83d\\ude00')", [])
        assert _kind(r) == "exception" and r.error is not None, r
        assert r.error.message.endswith("ValueError: x \U0001f600"), r
        assert is_lossless([*r.logs, r.error.message])

    arun(with_runtime(go, isolation="auto"))


def test_a_host_with_the_int_limit_lifted_still_refuses_a_result_the_worker_cannot_read() -> None:
    # PYTHONINTMAXSTRDIGITS=0 reaches the host only: the worker (-I, empty environment) keeps
    # Python's default limit, so a 5000-digit binding result is refused, not written in a reply
    # frame the worker drops (leaving the program waiting until the wall clock ran out).
    script = (
        "import asyncio\nfrom dsh_core.coderuntime import BindingNamespace, CodeRuntimeConfig, PythonCodeRuntime\n"
        "async def huge(args):\n    return 10**5000\n"
        "async def main():\n"
        "    async with PythonCodeRuntime(CodeRuntimeConfig(isolation='L0', timeout_s=20)) as rt:\n"
        "        r = await rt.run('try:\\n    return await tools.huge({})\\nexcept ToolCallError as e:\\n"
        "    return str(e)', [BindingNamespace('tools', {'huge': huge})])\n"
        "        print(r.value if r.error is None else r.error.kind)\n"
        "asyncio.run(main())\n"
    )
    env = {**os.environ, "PYTHONINTMAXSTRDIGITS": "0", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert done.stdout.strip().startswith("binding resolution must be lossless JSON: int of more than 4300 digits"), (
        done.stdout,
        done.stderr,
    )


def test_syntax_error_starts_no_worker() -> None:
    async def go() -> None:
        rt = PythonCodeRuntime()
        try:
            r = await rt.run("x = 1\nif x\n    pass", [])
            assert _kind(r) == "exception" and rt._zygote is None
            assert r.error is not None
            assert "line 2" in r.error.message and "^" in r.error.message and "SyntaxError" in r.error.message
            r = await rt.run("nonlocal q", [])
            assert _kind(r) == "exception" and "nonlocal" in r.error.message  # type: ignore[union-attr]
            assert rt._zygote is None
        finally:
            await rt.aclose()

    arun(go())


def test_bindings_both_ways_and_error_class() -> None:
    seen: list[Any] = []

    async def record(args: Any) -> Any:
        seen.append(args)
        return {"ok": args}

    async def fail(args: Any) -> Any:
        raise RuntimeError("disk on fire")

    async def lossy(args: Any) -> Any:
        return {"x": float("inf")}

    async def go(rt: PythonCodeRuntime) -> None:
        ns = [
            BindingNamespace(
                "tools",
                {"read": record, "my-tool": record, "__class__": record, "mro": record, "fail": fail, "lossy": lossy},
            ),
            BindingNamespace("other", {"ping": echo}, ErrorClassSpec("OtherError", "which")),
            BindingNamespace("bare", {"fail": fail}, None),
        ]
        program = (
            "a = await tools.read({'path': 'a'})\n"
            "b = await tools.read(path='b', n=2)\n"
            "c = await tools['my-tool']({})\n"
            "d = await tools['__class__']({'k': 1})\n"
            "e = await tools['mro']()\n"
            "try:\n    await tools.fail({})\nexcept ToolCallError as err:\n"
            "    f = [err.tool_name, str(err), isinstance(err, Exception)]\n"
            "try:\n    await tools.lossy({})\nexcept ToolCallError as err:\n    g = str(err)\n"
            "try:\n    await tools.read({'x': {1, 2}})\nexcept ToolCallError as err:\n    h = str(err)\n"
            "try:\n    await tools.read({'a': 1}, b=2)\nexcept TypeError:\n    i = 'typeerror'\n"
            "try:\n    await tools['my-tool']({}, {})\nexcept TypeError as err:\n    i += ':' + str(err)\n"
            "try:\n    tools.nope\nexcept AttributeError:\n    j = 'noattr'\n"
            "try:\n    await other.ping(None)\n    k = 'ok'\nexcept OtherError:\n    k = 'bad'\n"
            "try:\n    await bare.fail({})\nexcept ToolCallError:\n    m = 'wrong'\n"
            "except Exception as err:\n    m = type(err).__name__ + ':' + str(err)\n"
            "return [a, b, c, d, e, f, g, h, i, j, k, m, type(tools).__name__ != 'dict', sorted(dir(tools))]"
        )
        r = await rt.run(program, ns)
        assert r.error is None, r.error
        a, b, c, d, e, f, g, h, i, j, k, m, plain, names = r.value
        assert a == {"ok": {"path": "a"}} and b == {"ok": {"path": "b", "n": 2}}
        assert c == {"ok": {}} and d == {"ok": {"k": 1}} and e == {"ok": {}}
        assert f == ["fail", "disk on fire", True]
        assert g == (
            "binding resolution must be lossless JSON: float inf is not lossless JSON "
            '(JSON has no NaN or infinity) at result["x"]'
        )
        assert h.startswith("binding arguments must be lossless JSON")
        assert (i, j, k, m) == (
            "typeerror:tools['my-tool']() takes one dict of arguments or keywords",
            "noattr",
            "ok",
            "Exception:disk on fire",
        )
        assert plain and names == sorted(["read", "my-tool", "__class__", "mro", "fail", "lossy"])
        # The lossy argument never reached the host.
        assert {"x": {1, 2}} not in seen and len(seen) == 5

    arun(with_runtime(go, isolation="auto"))


def test_an_unknown_binding_raises_the_declared_error_class_and_still_acts_as_missing() -> None:
    # The SDK tells the model "a failed, denied or unknown call raises ToolCallError".
    ns = [BindingNamespace("tools", {"read": echo}), BindingNamespace("bare", {"ping": echo}, None)]
    program = (
        "try:\n    await tools.nosuch({})\nexcept ToolCallError as err:\n"
        "    a = [err.tool_name, str(err), isinstance(err, AttributeError), type(err).__name__]\n"
        "try:\n    tools['no-such']\nexcept ToolCallError as err:\n"
        "    b = [err.tool_name, str(err), isinstance(err, KeyError)]\n"
        "c = [hasattr(tools, 'nosuch'), getattr(tools, 'nosuch', 'default'), hasattr(tools, 'read')]\n"
        "try:\n    bare.nosuch\nexcept AttributeError as err:\n    d = [type(err).__name__, str(err)]\n"
        "try:\n    tools.nosuch\nexcept ToolCallError as err:\n    err.tool_name\n    raise\n"
    )
    r = run_one(program + "return 1", ns)
    assert r.error is not None, r
    assert r.error.message.endswith("ToolCallError: tools has no binding 'nosuch' (it has: read)"), r
    r = run_one(program.rsplit("try:", 1)[0] + "return [a, b, c, d]", ns)
    assert r.error is None, r.error
    assert r.value == [
        ["nosuch", "tools has no binding 'nosuch' (it has: read)", True, "ToolCallError"],
        ["no-such", "tools has no binding 'no-such' (it has: read)", True],
        [False, "default", True],
        ["AttributeError", "bare has no binding 'nosuch' (it has: ping)"],
    ]


def test_an_unknown_binding_names_what_the_namespace_has() -> None:
    # "tools has no binding 'write'" alone left a program (and the model writing it) guessing.
    many = [BindingNamespace("tools", {f"t{i:02}": echo for i in range(45)}), BindingNamespace("none", {})]
    program = (
        "out = []\nfor ns in (tools, none):\n    try:\n        ns.wrte\n"
        "    except (ToolCallError, AttributeError) as err:\n        out.append(str(err))\nreturn out"
    )
    r = run_one(program, many)
    assert r.error is None, r.error
    listed = ", ".join(f"t{i:02}" for i in range(40))
    assert r.value == [
        f"tools has no binding 'wrte' (it has: {listed}, and 5 more)",
        "none has no binding 'wrte' (it has: none)",
    ]


def test_gather_and_deep_values_cross_both_ways() -> None:
    async def depth(args: Any) -> Any:
        n, node = 0, args
        while node:
            node, n = node[0], n + 1
        out: list[Any] = []
        for _ in range(n):
            out = [out]
        return out

    async def go(rt: PythonCodeRuntime) -> None:
        r = await rt.run(
            "import asyncio\nr = await asyncio.gather(*[tools.echo({'i': i}) for i in range(50)])\n"
            "v = []\nfor _ in range(200000): v = [v]\nback = await tools.depth(v)\nn = 0\n"
            "while back:\n    back = back[0]\n    n += 1\nreturn [len(r), r[49], n]",
            tools(echo=echo, depth=depth),
        )
        assert r.value == [50, {"i": 49}, 200000], r.error
        limit = sys.getrecursionlimit()
        r = await rt.run("v = []\nfor _ in range(1000000): v = [v]\nreturn v", [])
        node, n = r.value, 0
        while node:
            node, n = node[0], n + 1
        assert n == 1_000_000 and sys.getrecursionlimit() == limit

    arun(with_runtime(go, isolation="auto"))


def test_fresh_state_per_run_and_private_cwd(level: str) -> None:
    async def go(rt: PythonCodeRuntime) -> None:
        cwd = "def cwd():\n    try:\n        return os.getcwd()\n    except OSError:\n        return None\n"
        first = await rt.run("import json, os\n" + cwd + "json.marker = 1\nreturn [os.getpid(), cwd()]", [])
        second = await rt.run("import json, os\n" + cwd + "return [hasattr(json, 'marker'), os.getpid(), cwd()]", [])
        assert first.error is None and second.error is None, (first, second)
        assert second.value[0] is False
        assert first.value[0] != second.value[1] or level == "L3"  # L3: each run is pid 2.. of the sandbox
        if level in ("L0", "L1"):
            assert first.value[1] != second.value[2] and "dsh-run-" in first.value[1]
            assert not os.path.exists(first.value[1])  # removed once its result was delivered

    arun(with_runtime(go, isolation=level))


@pytest.mark.parametrize("isolation", ["L0", "L1"])  # L2 and up cannot write there
def test_private_cwd_left_full_is_removed_without_following_links(isolation: str, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    program = (
        "import os, pathlib\n"
        "os.makedirs('a/b')\n"
        "pathlib.Path('a/b/f.txt').write_text('x')\n"
        "pathlib.Path('g.txt').write_text('y')\n"
        f"os.symlink({str(outside)!r}, 'a/link')\n"
        "return os.getcwd()"
    )

    async def go() -> None:
        rt = PythonCodeRuntime(CodeRuntimeConfig(isolation=isolation))
        try:
            r = await rt.run(program, [])
            assert r.error is None, r
            await asyncio.sleep(0)  # removed once its result was delivered
            assert not os.path.exists(r.value)  # the whole tree, not just an empty directory
        finally:
            await rt.aclose()

    arun(go())
    assert outside.read_text() == "keep"


def test_run_directories_still_pending_are_removed_by_aclose_or_at_once_without_a_loop(tmp_path: Path) -> None:
    pending, later = tmp_path / "pending", tmp_path / "later"
    for path in (pending, later):
        (path / "sub").mkdir(parents=True)
        (path / "sub" / "f").write_text("x")

    async def go() -> None:
        rt = PythonCodeRuntime(CodeRuntimeConfig(isolation="L0"))
        rt._run_dirs.add(str(pending))  # as a teardown left it, its removal not yet run
        await rt.aclose()
        assert not pending.exists()

    arun(go())
    # A teardown finalised outside any running loop (a task destroyed after its loop closed).
    PythonCodeRuntime(CodeRuntimeConfig(isolation="L0"))._remove_run_dir_soon(str(later))
    assert not later.exists()


def test_abort_before_and_during() -> None:
    async def go(rt: PythonCodeRuntime) -> None:
        controller = AbortController()
        controller.abort("user said stop")
        r = await rt.run("return 1", [], controller.signal)
        assert (_kind(r), r.error.message if r.error else None) == ("abort", "user said stop")
        assert rt._zygote is None  # no worker was started for it
        controller = AbortController()
        started = asyncio.Event()

        async def mark_started(args: Any) -> Any:
            started.set()
            return None

        # The abort must land while the program runs: wait for the program to say so, not for a
        # fixed time a loaded machine may not give it.
        program = "print('started')\nawait tools.started({})\nimport time\nwhile True: time.sleep(0.01)"
        task = asyncio.ensure_future(rt.run(program, tools(started=mark_started), controller.signal))
        await asyncio.wait_for(started.wait(), 60)
        controller.abort("enough")
        r = await task
        assert _kind(r) == "abort" and r.error is not None and r.error.message == "enough"
        assert r.logs == ("started",)

    arun(with_runtime(go, isolation="auto"))


def test_wall_cpu_budgets_and_pause() -> None:
    decoy_started = asyncio.Event()

    async def decoy(args: Any) -> Any:
        decoy_started.set()
        await asyncio.sleep(3600)

    async def slow(args: Any) -> Any:
        await asyncio.sleep(1.2)  # waiting on the host costs no CPU
        return "slow"

    async def approval(args: Any) -> Any:
        control = current_run()
        assert control is not None and not control.signal.aborted
        with control.pause_wall_clock():
            await asyncio.sleep(2.2)  # longer than the whole wall budget
        return "approved"

    async def go(rt: PythonCodeRuntime) -> None:
        binds = tools(decoy=decoy, slow=slow, approval=approval)
        r = await rt.run("import asyncio\nt = asyncio.ensure_future(tools.decoy({}))\nwhile True: pass", binds)
        assert _kind(r) == "timeout" and "CPU" in r.error.message, r  # type: ignore[union-attr]
        r = await rt.run("return await tools.slow({})", binds)
        assert r.value == "slow", r
        r = await rt.run("return await tools.approval({})", binds)
        assert r.value == "approved", r

    # A wall budget well above both the CPU budget and the slow call: under load
    # (the full suite on two cores) 0.1 s of margin was seen to be too little.
    arun(with_runtime(go, isolation="auto", cpu_s=0.6, timeout_s=2.0))

    async def idle(rt: PythonCodeRuntime) -> None:
        r = await rt.run("import asyncio\nprint('waiting')\nawait asyncio.sleep(3600)", [])
        assert _kind(r) == "timeout" and "wall-clock" in r.error.message and r.logs == ("waiting",)  # type: ignore[union-attr]
        r = await rt.run("import time\ntime.sleep(3600)", [])
        assert _kind(r) == "timeout"

    arun(with_runtime(idle, isolation="auto", timeout_s=0.4))


def test_pause_wall_clock_nests_and_resumes() -> None:
    from dsh_core.coderuntime.host import _WallClock

    async def go() -> None:
        fired: list[int] = []
        loop = asyncio.get_running_loop()
        clock = _WallClock(loop, 0.2, lambda: fired.append(1))
        clock.pause()
        clock.pause()
        await asyncio.sleep(0.3)
        clock.resume()
        await asyncio.sleep(0.05)
        assert fired == []
        clock.resume()
        await asyncio.sleep(0.3)
        assert fired == [1]
        clock.stop()

    arun(go())


def test_memory_bomb_fork_and_exit() -> None:
    async def go(rt: PythonCodeRuntime) -> None:
        r = await rt.run("print('before')\nx = bytearray(1 << 34)", [])
        assert _kind(r) == "memory-limit" and r.logs == ("before",), r
        r = await rt.run("import os\nos._exit(3)", [])
        assert r.error is not None and r.error.kind == "worker-exit" and "code 3" in r.error.message
        r = await rt.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", [])
        assert _kind(r) == "worker-exit" and "SIGSEGV" in r.error.message  # type: ignore[union-attr]
        r = await rt.run("import os\ntry:\n    os.fork()\nexcept OSError as e:\n    return e.errno", [])
        assert r.value == 38, r  # ENOSYS from the seccomp allowlist

    arun(with_runtime(go, isolation="L2", memory_mb=128))


def test_output_limits_share_one_exact_ledger() -> None:
    async def go(rt: PythonCodeRuntime) -> None:
        cap = 200
        # Logs alone: ["aaaa",...] then a return value: exactly at the cap passes.
        value = "x" * (cap - 2 - 2)  # [] + "xxx..." quotes
        r = await rt.run(f"return {value!r}", [])
        assert r.value == value, r
        r = await rt.run(f"return {value + 'y'!r}", [])
        assert _kind(r) == "output-limit" and r.error.message == f"outer output exceeded {cap} bytes"  # type: ignore[union-attr]
        used = len(json.dumps(["é" * 40], ensure_ascii=False, separators=(",", ":")).encode())
        fit = cap - used - 2  # logs and value share one ledger, in exact UTF-8 bytes
        r = await rt.run(f"print('é' * 40)\nreturn 'z' * {fit}", [])
        assert r.value == "z" * fit and r.logs == ("é" * 40,)
        r = await rt.run(f"print('é' * 40)\nreturn 'z' * {fit + 1}", [])
        assert _kind(r) == "output-limit"
        r = await rt.run("while True: print('flood')", [])
        assert _kind(r) == "output-limit"
        total = json.dumps(list(r.logs), separators=(",", ":")) + json.dumps(r.error.message)  # type: ignore[union-attr]
        assert len(total.encode()) <= cap and r.logs and all(x == "flood" for x in r.logs[:-1])
        r = await rt.run("print('L' * 100000)", [])
        assert _kind(r) == "output-limit" and len(r.logs) == 1 and set(r.logs[0]) == {"L"}
        assert len((json.dumps(list(r.logs)) + json.dumps(r.error.message)).encode()) <= cap  # type: ignore[union-attr]
        r = await rt.run("raise ValueError('E' * 1000)", [])
        assert _kind(r) == "output-limit"
        r = await rt.run("import os\nos.write(1, b'raw\\n' * 1000)\nimport time\ntime.sleep(5)", [])
        assert _kind(r) == "output-limit" and "raw" in r.logs

    arun(with_runtime(go, isolation="auto", max_output_bytes=200, timeout_s=20))


def test_a_flood_of_short_lines_is_cut_at_one_log_entry_per_64_bytes_of_the_cap() -> None:
    """Each entry held costs the host about 60 bytes, but the budget counts ``"ab",`` as 5: 64 MiB of
    two-letter lines was 13 million entries, a gigabyte of the host's memory for one run."""
    cap = 64 * 1024
    message = (
        f"outer output exceeded 1024 log entries (one per 64 bytes of the {cap}-byte output cap); "
        "print fewer, longer lines"
    )

    async def go(rt: PythonCodeRuntime) -> None:
        r = await rt.run("for _ in range(1024):\n    print('ab')\nreturn 1", [])
        assert r.error is None and len(r.logs) == 1024 and r.value == 1
        for program in (
            "for _ in range(5000):\n    print('ab')",  # through the log frames
            "import os, time\nos.write(1, b'ab\\n' * 5000)\ntime.sleep(10)",
        ):  # raw writes
            r = await rt.run(program, [])
            assert r.error is not None and (r.error.kind, r.error.message) == ("output-limit", message), program
            assert r.logs == ("ab",) * 1024
        # Bytes over the cap, not entries: the message says bytes, as before.
        r = await rt.run(f"print('x' * {cap})", [])
        assert r.error is not None and r.error.message == f"outer output exceeded {cap} bytes"
        # As many entries as allowed, then a value over the cap: bytes again.
        r = await rt.run(f"for _ in range(1024):\n    print('ab')\nreturn 'y' * {cap}", [])
        assert r.error is not None and r.error.message == f"outer output exceeded {cap} bytes"

    arun(with_runtime(go, isolation="auto", max_output_bytes=cap, timeout_s=20))


def test_the_entry_cap_follows_the_output_cap_with_a_floor() -> None:
    from dsh_core.coderuntime.worker.wire import Ledger

    assert Ledger(64 * 1024 * 1024).max_entries == 1024 * 1024
    assert Ledger(200).max_entries == 1024


@pytest.mark.parametrize(
    ("cap", "entries", "rule"),
    [
        (32 * 1024, 1024, "one per 64 bytes of the 32768-byte output cap, at least 1024"),  # the floor: not 512
        (128 * 1024, 2048, "one per 64 bytes of the 131072-byte output cap"),
    ],
)
def test_the_entry_cap_message_names_the_floor_when_the_floor_is_the_cap(cap: int, entries: int, rule: str) -> None:
    from dsh_core.coderuntime.worker.wire import Ledger

    ledger = Ledger(cap)
    while ledger.add(""):
        pass
    assert len(ledger.logs) == entries and ledger.counted_out
    assert ledger.limit_message() == (
        f"outer output exceeded {entries} log entries ({rule}); print fewer, longer lines"
    )


def test_default_cap_exactly_64_mib() -> None:
    async def go(rt: PythonCodeRuntime) -> None:
        cap = 64 * 1024 * 1024
        r = await rt.run(f"return 'x' * {cap - 4}", [])
        assert r.has_value and len(r.value) == cap - 4
        r = await rt.run(f"return 'x' * {cap - 3}", [])
        assert _kind(r) == "output-limit"

    arun(with_runtime(go, isolation="L2"))


def test_disposal_aborts_live_runs_and_awaits_workers() -> None:
    before = zygote_processes()

    async def go() -> None:
        rt = PythonCodeRuntime()
        started = asyncio.Event()

        async def mark(args: Any) -> Any:
            started.set()
            return None

        runs = [
            asyncio.ensure_future(rt.run("await tools.mark({})\nwhile True: pass", tools(mark=mark))) for _ in range(3)
        ]
        await asyncio.wait_for(started.wait(), 30)
        assert zygote_processes() - before  # the scan sees this runtime's zygote and workers...
        await rt.aclose()
        assert zygote_processes() <= before  # ...and none after: every worker awaited, orphaned or not
        results = await asyncio.gather(*runs)
        assert all(_kind(r) == "abort" and r.error.message == "runtime disposed" for r in results)  # type: ignore[union-attr]
        with pytest.raises(RuntimeDisposedError):
            await rt.run("return 1", [])

    arun(go())


async def _first_run_while_the_zygote_starts(rt: PythonCodeRuntime) -> asyncio.Future[CodeRunResult]:
    """The runtime's first run, caught while it is still starting the zygote."""
    _ = rt.isolation  # detected once per host: what remains is this runtime's own zygote start
    run = asyncio.ensure_future(rt.run("return 1", []))
    await asyncio.sleep(0.01)
    assert rt._zygote is None  # still starting
    return run


def test_disposal_while_the_zygote_starts_leaves_no_process() -> None:
    children_before = _children()
    zygotes_before = zygote_processes()

    async def go() -> None:
        rt = PythonCodeRuntime()
        run = await _first_run_while_the_zygote_starts(rt)
        await rt.aclose()
        assert _children() == children_before  # nothing outlives aclose, not even a zygote mid-start
        assert zygote_processes() <= zygotes_before
        result = await run
        assert (_kind(result), result.error.message if result.error else None) == ("abort", "runtime disposed")

    arun(go())


def test_cancelling_the_run_that_starts_the_zygote_leaves_no_process() -> None:
    children_before = _children()
    zygotes_before = zygote_processes()

    async def go() -> None:
        rt = PythonCodeRuntime()
        run = await _first_run_while_the_zygote_starts(rt)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        assert _children() == children_before  # the half-started zygote was closed with it
        assert zygote_processes() <= zygotes_before
        assert (await rt.run("return 2", [])).value == 2  # and the next run starts a new one
        await rt.aclose()

    arun(go())


def test_a_probe_worker_that_never_reports_ready_neither_hangs_runs_nor_aclose(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsh_core.coderuntime import host

    collect_leftovers()  # an earlier test's child, reaped mid-test, is not counted as ours
    children_before = _children()
    run_one("return 1")  # the level is detected (once per host) while workers still report ready
    monkeypatch.setattr(host._Run, "_on_ready", lambda self, text: None)  # from now on every worker stays silent

    async def go(start_timeout: float) -> CodeRunResult:  # the probe's bound
        monkeypatch.setattr(host, "_PROBE_READY_TIMEOUT_S", start_timeout)
        rt = PythonCodeRuntime()
        run = asyncio.ensure_future(rt.run("return 1", []))
        if start_timeout < 5:
            result = await asyncio.wait_for(run, 20)  # bounded by the probe's timeout
            await rt.aclose()
            return result
        for _ in range(200):  # until the zygote is up and its probe worker waits
            await asyncio.sleep(0.01)
            if rt._probing is not None and rt._probing.pidfd >= 0:
                break
        assert rt._probing is not None
        await asyncio.wait_for(rt.aclose(), 10)  # the probe is aborted, not waited for
        return await run

    timed_out = arun(go(0.5))
    assert _kind(timed_out) == "worker-exit" and "did not report ready in time" in timed_out.error.message  # type: ignore[union-attr]
    disposed = arun(go(60.0))
    assert (_kind(disposed), disposed.error.message if disposed.error else None) == ("abort", "runtime disposed")
    assert _children() == children_before


def _children() -> set[int]:
    return children_of(os.getpid())


def test_no_zombie_orphan_or_leaked_descriptor() -> None:
    collect_leftovers()  # else the 20 runs below set off a collection that closes an earlier test's descriptors
    fds_before = set(os.listdir("/proc/self/fd"))
    children_before = _children()

    async def go(rt: PythonCodeRuntime) -> None:
        programs = ["return 1", "1/0", "import os\nos._exit(1)", "while True: pass", "print('x' * 10)"]
        results = await asyncio.gather(*[rt.run(p, tools(echo=echo)) for p in programs * 4])
        assert len(results) == 20

    arun(with_runtime(go, isolation="auto", cpu_s=0.5))
    assert set(os.listdir("/proc/self/fd")) == fds_before
    assert _children() == children_before
    assert run_dirs() == set()
    for group in dict.fromkeys(CgroupPool.own_groups() or ()):  # L3's per-run cgroups, made in dsh's own, are removed
        assert not [d for d in os.listdir(group) if d.startswith(f"dsh-{os.getpid()}-")]


@pytest.mark.parametrize("level", LEVELS)
def test_logs_written_before_the_worker_dies_are_kept(level: str) -> None:
    # The worker itself dies (no exception, no host-side kill): what it printed and what
    # it wrote raw to descriptor 1 before that is drained and kept, in order per channel.
    program = (
        "import os\nprint('via print')\nconsole.log('via console')\n"
        "os.write(1, b'raw one\\nraw two\\n')\nos.write(2, b'raw tail without newline')\nos._exit(3)"
    )
    result = run_one(program, [], isolation=level)
    assert result.error is not None and result.error.kind == "worker-exit", result
    assert "exited with code 3" in result.error.message
    logs = list(result.logs)
    assert [line for line in logs if line.startswith("via")] == ["via print", "via console"]
    assert [line for line in logs if line.startswith("raw")] == ["raw one", "raw two", "raw tail without newline"]
    assert len(logs) == 5


@pytest.mark.parametrize("level", ["L0", "L1"])
def test_l0_l1_fork_children_are_killed_with_the_run(level: str) -> None:
    async def go(rt: PythonCodeRuntime) -> None:
        r = await rt.run(
            "import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(60)\n    os._exit(0)\nreturn pid", []
        )
        pid = r.value
        assert isinstance(pid, int)
        for _ in range(100):
            if not os.path.exists(f"/proc/{pid}"):
                break
            await asyncio.sleep(0.02)
        assert not os.path.exists(f"/proc/{pid}")

    arun(with_runtime(go, isolation=level))


def test_binding_results_after_settlement_are_dropped() -> None:
    released = asyncio.Event()
    finished: list[str] = []

    async def late(args: Any) -> Any:
        # Teardown cancels binding calls still running; this one finishes anyway,
        # after settlement, so its result arrives late and must be dropped.
        with contextlib.suppress(asyncio.CancelledError):
            await released.wait()
        finished.append("late")
        return "too late"

    async def go(rt: PythonCodeRuntime) -> None:
        r = await rt.run(
            "import asyncio\nasyncio.ensure_future(tools.late({}))\nawait asyncio.sleep(0.2)\nreturn 'done'",
            tools(late=late),
        )
        assert r.value == "done"
        released.set()
        await asyncio.sleep(0.05)
        assert finished == ["late"]

    arun(with_runtime(go, isolation="auto"))


def test_binding_calls_do_not_outlive_the_run() -> None:
    events: list[str] = []

    async def sleepy(args: Any) -> Any:
        events.append(f"start {args['n']}")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            events.append(f"cancelled {args['n']}")
            raise
        finally:
            await asyncio.sleep(0.05)  # a cleanup that itself awaits is awaited too
            events.append(f"finally {args['n']}")
        return "never"

    async def go(rt: PythonCodeRuntime) -> None:
        binds = tools(sleepy=sleepy)
        # The program exits while its call is still running on the host.
        r = await rt.run(
            "import asyncio\nasyncio.ensure_future(tools.sleepy(n=1))\nawait asyncio.sleep(0.2)\nreturn 'done'", binds
        )
        assert r.value == "done", r
        assert events == ["start 1", "cancelled 1", "finally 1"]
        # The program awaits its call and hits the wall clock.
        r = await rt.run("return await tools.sleepy(n=2)", binds)
        assert _kind(r) == "timeout", r
        assert events[3:] == ["start 2", "cancelled 2", "finally 2"]
        assert not [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "_Run._invoke"]

    arun(with_runtime(go, isolation="auto", timeout_s=1.0))


def test_program_tasks_run_on_while_a_binding_call_waits() -> None:
    # A call made while other work is pending in the program (here a timer of
    # a ticking task) must wait through the program's event loop, not block it.
    async def slow(args: Any) -> Any:
        await asyncio.sleep(0.3)
        return "done"

    program = (
        "import asyncio\nticks = []\n"
        "async def ticker():\n    while True:\n        ticks.append(1)\n        await asyncio.sleep(0.02)\n"
        "task = asyncio.create_task(ticker())\nawait asyncio.sleep(0)\n"
        "result = await tools.slow({})\ntask.cancel()\nreturn [result, len(ticks)]"
    )

    result = run_one(program, tools(slow=slow), isolation="auto")
    assert result.error is None, result.error
    assert result.value[0] == "done" and result.value[1] >= 5


def test_sequential_and_concurrent_calls_agree() -> None:
    # A lone call waits for its reply in place; concurrent ones go through the
    # event loop. Values and errors are the same either way, for bindings that
    # answer at once and for bindings that wait first.
    async def direct(args: Any) -> Any:
        if args["i"] % 3 == 0:
            raise RuntimeError(f"bad {args['i']}")
        assert current_run() is not None
        return args["i"] * 2

    async def waits(args: Any) -> Any:
        assert current_run() is not None
        await asyncio.sleep(0)
        assert current_run() is not None
        return await direct(args)

    program = (
        "import asyncio\n"
        "async def one(name, i):\n    try:\n        return await tools[name]({'i': i})\n"
        "    except ToolCallError as error:\n        return [error.tool_name, str(error)]\n"
        "out = []\nfor name in ('direct', 'waits'):\n"
        "    out.append([await one(name, i) for i in range(7)])\n"
        "    out.append(await asyncio.gather(*[one(name, i) for i in range(7)]))\n"
        "return out"
    )

    result = run_one(program, tools(direct=direct, waits=waits), isolation="auto")
    assert result.error is None, result.error
    direct_seq, direct_par, waits_seq, waits_par = result.value
    assert direct_seq == direct_par == [["direct", "bad 0"], 2, 4, ["direct", "bad 3"], 8, 10, ["direct", "bad 6"]]
    assert waits_seq == waits_par == [["waits", "bad 0"], 2, 4, ["waits", "bad 3"], 8, 10, ["waits", "bad 6"]]


def test_bindings_run_inside_a_task() -> None:
    # Host functions may rely on asyncio's task context from their first line:
    # asyncio.timeout() refuses to run outside a task, as do anyio's cancel scopes.
    async def timed(args: Any) -> Any:
        assert asyncio.current_task() is not None
        async with asyncio.timeout(5):
            return args

    result = run_one("return [await tools.timed(1), await tools.timed(2)]", tools(timed=timed), isolation="auto")
    assert result.value == [1, 2], result.error


def test_a_binding_that_aborts_the_run_before_it_waits_is_still_cancelled_and_awaited() -> None:
    controller = AbortController()
    events: list[str] = []

    async def stop_then_wait(args: Any) -> Any:
        controller.abort("stopped by a binding")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        return "never"

    async def go(runtime: PythonCodeRuntime) -> CodeRunResult:
        result = await runtime.run("return await tools.stop(1)", tools(stop=stop_then_wait), controller.signal)
        assert not [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "_Run._invoke"]
        return result

    result = arun(with_runtime(go, isolation="auto"))
    assert _kind(result) == "abort" and result.error is not None
    assert "stopped by a binding" in result.error.message
    assert events == ["cancelled"]


def test_a_plain_function_returning_a_future_is_awaited_without_a_task() -> None:
    # The form the run_code scheduler uses: the function runs as the call arrives, outside
    # any task but with the run visible, and its future settles the program's call.
    seen: list[tuple[bool, bool]] = []

    def later(args: Any) -> asyncio.Future[Any]:
        seen.append((asyncio.current_task() is None, current_run() is not None))
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if args == "fail":
            loop.call_soon(future.set_exception, RuntimeError("no such row"))
        else:
            loop.call_soon(future.set_result, {"got": args})
        return future

    program = (
        "import asyncio\nout = [await tools.later(1)]\n"
        "out += await asyncio.gather(tools.later(2), tools.later(3))\n"
        "try:\n    await tools.later('fail')\nexcept ToolCallError as error:\n"
        "    out.append([error.tool_name, str(error)])\nreturn out"
    )

    result = run_one(program, tools(later=later), isolation="auto")
    assert result.error is None, result.error
    assert result.value == [{"got": 1}, {"got": 2}, {"got": 3}, ["later", "no such row"]]
    assert seen == [(True, True)] * 4


def test_a_plain_binding_that_raises_or_returns_no_awaitable_fails_only_that_call() -> None:
    def raises(args: Any) -> Any:
        raise ValueError("refused at once")

    def not_awaitable(args: Any) -> Any:
        return 42

    program = (
        "out = []\nfor name in ('raises', 'not_awaitable', 'echo'):\n"
        "    try:\n        out.append(await tools[name]({'n': name}))\n"
        "    except ToolCallError as error:\n        out.append([error.tool_name, str(error)])\nreturn out"
    )

    result = run_one(program, tools(raises=raises, not_awaitable=not_awaitable, echo=echo), isolation="auto")
    assert result.error is None, result.error
    assert result.value == [
        ["raises", "refused at once"],
        ["not_awaitable", "binding tools.not_awaitable returned int, not an awaitable"],
        {"n": "echo"},
    ]


def test_a_future_still_pending_when_the_run_settles_is_cancelled() -> None:
    futures: list[asyncio.Future[Any]] = []

    def never(args: Any) -> asyncio.Future[Any]:
        futures.append(asyncio.get_running_loop().create_future())
        return futures[-1]

    program = "import asyncio\nasyncio.ensure_future(tools.never({}))\nawait asyncio.sleep(0.05)\nreturn 'done'"

    result = run_one(program, tools(never=never), isolation="auto")
    assert result.value == "done", result.error
    assert len(futures) == 1 and futures[0].cancelled()


def test_a_programs_own_timeout_interrupts_a_binding_call() -> None:
    # The lone-call wait in place must not swallow the program's own timers.
    async def slow(args: Any) -> Any:
        await asyncio.sleep(2)
        return "late"

    program = (
        "import asyncio\n"
        "try:\n    async with asyncio.timeout(0.2):\n        await tools.slow({})\n"
        "except TimeoutError:\n    first = 'timed out'\n"
        "try:\n    await asyncio.wait_for(tools.slow({}), 0.2)\nexcept TimeoutError:\n    second = 'timed out'\n"
        "return [first, second]"
    )

    result = run_one(program, tools(slow=slow), isolation="auto")
    assert result.value == ["timed out", "timed out"], result


_CANCELS = {
    "wait_for": "try:\n    await asyncio.wait_for(tools.NAME({}), 0.1)\nexcept TimeoutError:\n    out.append('cut')\n",
    "timeout": "try:\n    async with asyncio.timeout(0.1):\n        await tools.NAME({})\n"
    "except TimeoutError:\n    out.append('cut')\n",
    "task.cancel": "task = asyncio.ensure_future(tools.NAME({}))\nawait asyncio.sleep(0.1)\ntask.cancel()\n"
    "try:\n    await task\nexcept asyncio.CancelledError:\n    out.append('cut')\n",
}


@pytest.mark.parametrize("form", sorted(_CANCELS))
def test_a_call_the_program_cancels_is_cancelled_on_the_host_without_a_reply(
    form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker tells the host; the host cancels the binding's task, or the future a plain
    # function returned, while the run goes on (its signal is not aborted), and sends no reply.
    from dsh_core.coderuntime import host

    written: list[Any] = []
    original = host._Run._write

    def write(self: Any, data: bytes) -> None:
        written.append(json.loads(data[4:]))
        original(self, data)

    monkeypatch.setattr(host._Run, "_write", write)
    events: list[Any] = []

    async def held(args: Any) -> Any:
        control = current_run()
        assert control is not None
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            events.append(["task cancelled", control.signal.aborted])
            raise
        return "never"

    def plain(args: Any) -> asyncio.Future[Any]:
        control = current_run()
        assert control is not None
        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda f: events.append(["future cancelled", f.cancelled(), control.signal.aborted]))
        return future

    async def probe(args: Any) -> Any:
        await asyncio.sleep(0.05)
        return list(events)

    program = "import asyncio\nout = []\n" + "".join(_CANCELS[form].replace("NAME", name) for name in ("held", "plain"))
    program += "out.append(await tools.probe({}))\nreturn out"
    result = run_one(program, tools(held=held, plain=plain, probe=probe), isolation="auto")
    assert result.error is None, result.error
    assert result.value == ["cut", "cut", [["task cancelled", False], ["future cancelled", True, False]]]
    replies = [message["id"] for message in written if message.get("t") == "reply"]
    assert replies == [3]  # the probe's; none for the two cancelled calls


def test_a_lone_call_does_not_stall_threads_or_signal_handlers() -> None:
    # The reply this program waits for depends on work that a thread (or an asyncio
    # signal handler) hands back to the program's loop: waiting in place would hang.
    through_thread = (
        "import asyncio, time, threading\nloop = asyncio.get_running_loop()\n"
        "async def bg():\n    done = loop.create_future()\n"
        "    def work():\n        time.sleep(0.05)\n        loop.call_soon_threadsafe(done.set_result, None)\n"
        "    threading.Thread(target=work).start()\n    await done\n    await tools.release({})\n"
        "task = asyncio.create_task(bg())\nawait asyncio.sleep(0)\nreturn await tools.wait_released({})"
    )
    through_signal = (
        "import asyncio, signal\nloop = asyncio.get_running_loop()\n"
        "def on_alarm():\n    asyncio.ensure_future(tools.release({}))\n"
        "loop.add_signal_handler(signal.SIGALRM, on_alarm)\nsignal.setitimer(signal.ITIMER_REAL, 0.05)\n"
        "return await tools.wait_released({})"
    )

    def runs(*programs: str) -> Callable[[PythonCodeRuntime], Awaitable[list[CodeRunResult]]]:
        async def go(rt: PythonCodeRuntime) -> list[CodeRunResult]:
            released = asyncio.Event()  # of this event loop

            async def wait_released(args: Any) -> Any:
                await released.wait()
                released.clear()
                return "released"

            async def release(args: Any) -> Any:
                released.set()
                return None

            binds = tools(wait_released=wait_released, release=release)
            return [await rt.run(program, binds) for program in programs]

        return go

    results = arun(with_runtime(runs(through_thread), isolation="auto", timeout_s=5.0))
    # Seccomp (L2 and up) refuses what add_signal_handler needs; L0 allows it.
    results += arun(with_runtime(runs(through_thread, through_signal), isolation="L0", timeout_s=5.0))
    for result in results:
        assert result.value == "released", result


def test_a_signal_handler_raising_during_a_call_reaches_the_program() -> None:
    # Even an OSError subclass raised by a plain signal handler while a call waits
    # surfaces from the call; it does not look like a closed channel.
    async def slow(args: Any) -> Any:
        await asyncio.sleep(1)
        return "late"

    program = (
        "import signal\ndef on_alarm(*_):\n    raise TimeoutError('alarm')\n"
        "signal.signal(signal.SIGALRM, on_alarm)\nsignal.setitimer(signal.ITIMER_REAL, 0.05)\n"
        "try:\n    return await tools.slow({})\nexcept TimeoutError as error:\n    return 'caught ' + str(error)"
    )

    result = run_one(program, tools(slow=slow), isolation="auto")
    assert result.value == "caught alarm", result


def test_asserts_and_compile_warnings_do_not_depend_on_the_host(capfd: pytest.CaptureFixture[str]) -> None:
    # The host compiles each program to check it; that compile keeps asserts even
    # under `python -O`, and its warnings go to the program's output, not the host's.
    script = (
        "import asyncio\nfrom dsh_core.coderuntime import CodeRuntimeConfig, PythonCodeRuntime\n"
        "async def main():\n"
        "    async with PythonCodeRuntime(CodeRuntimeConfig(isolation='L0')) as rt:\n"
        '        r = await rt.run("try:\\n    assert False\\nexcept AssertionError:\\n    return [1, __debug__]\\n'
        'return [0, __debug__]", [])\n'
        "        print(r.value)\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.stdout.strip() == "[1, True]", done.stderr

    result = run_one("x = 1\nif x is 1:\n    return 'one'", [], isolation="auto")
    assert result.value == "one", result
    assert result.logs[0].startswith('<program>:2: SyntaxWarning: "is" with a literal'), result.logs
    assert "SyntaxWarning" not in capfd.readouterr().err


def test_the_start_frame_fits_a_small_frame_cap() -> None:
    # The host's compiled code rides the start frame only when the frame still fits.
    program = "".join(f"v{i} = {i}\n" for i in range(200)) + "return v199"
    assert 1500 < len(program) < 3000

    result = run_one(program, [], isolation="auto", max_frame_bytes=4096)
    assert result.value == 199, result


def test_a_flushed_partial_line_is_its_own_entry_and_survives_a_killed_run() -> None:
    async def slow(args: Any) -> Any:
        await asyncio.sleep(30)

    async def go(rt: PythonCodeRuntime) -> None:
        r = await rt.run(
            "import sys\nsys.stdout.write('a')\nsys.stdout.flush()\nprint('b')\n"
            "print('c', end='')\nprint('d')\nprint('e', end='', flush=True)\nsys.stdout.flush()",
            [],
        )
        assert r.logs == ("a", "b", "cd", "e") and r.error is None
        r = await rt.run(
            "print('step 1 done')\nprint('step 2: calling slow ... ', end='', flush=True)\n"
            "await tools.slow({})\nprint('ok')",
            tools(slow=slow),
        )
        assert _kind(r) == "timeout", r
        assert r.logs == ("step 1 done", "step 2: calling slow ... ")

    arun(with_runtime(go, isolation="auto", timeout_s=1))


def test_the_program_is_the_main_module_and_exits_as_a_script_does() -> None:
    async def go(rt: PythonCodeRuntime) -> None:
        r = await rt.run(
            "import sys\nclass A:\n    pass\nif __name__ == '__main__':\n    print('guarded')\n"
            "return [__name__, A.__module__, sys.modules['__main__'].__dict__.get('console') is console]",
            [],
        )
        assert (r.logs, r.value, r.error) == (("guarded",), ["__main__", "__main__", True], None)
        for ending in ("sys.exit(0)", "sys.exit()", "sys.exit(None)", "exit()", "quit(0)", "raise SystemExit"):
            r = await rt.run(f"import sys\nprint('partial', end='')\n{ending}\nprint('never')\nreturn 1", [])
            assert (r.logs, r.has_value, r.error) == (("partial",), False, None), ending
        r = await rt.run("import asyncio, sys\nasync def f():\n    sys.exit(0)\nprint('a')\nawait f()\nreturn 1", [])
        assert (r.logs, r.has_value, r.error) == (("a",), False, None)
        failures = (("sys.exit(4)", "SystemExit: 4"), ("exit('fatal: no input')", "SystemExit: fatal: no input"))
        for ending, last in failures:
            r = await rt.run(f"import sys\n{ending}", [])
            assert _kind(r) == "exception" and r.error is not None, ending
            assert r.error.message.endswith(last) and "runner.py" not in r.error.message
        r = await rt.run(
            "import asyncio\nasync def main():\n    print('never')\n"
            "if __name__ == '__main__':\n    asyncio.run(main())",
            [],
        )
        assert _kind(r) == "exception" and r.error is not None and r.logs == ()  # no "never awaited" warning
        assert r.error.message.endswith(
            "RuntimeError: asyncio.run() cannot be called from a running event loop: the program already "
            "runs inside one, so await main() instead of asyncio.run(main())"
        )
        assert "runner.py" not in r.error.message

    arun(with_runtime(go, isolation="auto"))


def test_tracebacks_read_as_a_scripts_exception_groups_included() -> None:
    async def boom(args: Any) -> Any:
        raise RuntimeError("tool broke")

    async def go(rt: PythonCodeRuntime) -> None:
        namespace = [BindingNamespace("tools", {"boom": boom}, ErrorClassSpec(name="ToolCallError"))]
        r = await rt.run("class MyErr(Exception):\n    pass\nraise MyErr('boom')", namespace)
        assert r.error is not None and r.error.message == (
            'Traceback (most recent call last):\n  File "<program>", line 3, in <module>\n'
            "    raise MyErr('boom')\nMyErr: boom"
        )
        r = await rt.run(
            "import asyncio\nasync def f():\n    await tools.boom({})\n"
            "async with asyncio.TaskGroup() as g:\n    g.create_task(f())",
            namespace,
        )
        assert r.error is not None
        message = r.error.message
        assert "runner.py" not in message and "__dsh_main__" not in message, message
        assert message.startswith("  + Exception Group Traceback (most recent call last):\n")
        assert message.endswith(
            '    | Traceback (most recent call last):\n    |   File "<program>", line 3, in f\n'
            "    |     await tools.boom({})\n    | ToolCallError: tool broke\n"
            "    +------------------------------------"
        )

    arun(with_runtime(go, isolation="auto"))
