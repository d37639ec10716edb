"""The worker is a hostile peer: forged frames on the protocol descriptor and stdout."""

from __future__ import annotations

import asyncio
import json
import re
import tracemalloc
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsh_core.coderuntime import CodeRuntimeConfig, PythonCodeRuntime
from dsh_core.coderuntime.host import _Run
from dsh_core.coderuntime.seam import validate_bindings

from .conftest import FORGE, arun, collect_leftovers, echo, tools, with_runtime

#: Program prelude (after FORGE) that reads one host frame from descriptor 3 itself.
RECV = (
    "def recv():\n"
    "    import time\n"
    "    def exact(n):\n"
    "        b = b''\n"
    "        while len(b) < n:\n"
    "            try:\n"
    "                chunk = os.read(3, n - len(b))\n"
    "            except BlockingIOError:\n"
    "                time.sleep(0.005)\n"
    "                continue\n"
    "            if not chunk:\n"
    "                raise EOFError\n"
    "            b += chunk\n"
    "        return b\n"
    "    return json.loads(exact(struct.unpack('>I', exact(4))[0]))\n"
)


def test_forged_traffic_is_dropped_and_the_real_result_stands() -> None:
    calls: list[Any] = []

    async def record(args: Any) -> Any:
        calls.append(args)
        return "ok"

    async def go(rt: PythonCodeRuntime) -> None:
        program = FORGE + (
            "send([1, 2])\nsend('str')\nsend(None)\nsend({'t': 'nope'})\nsend({'no': 'type'})\n"
            "send({'t': 'call', 'id': 'x', 'g': 'tools', 'n': 'record', 'a': [1]})\n"  # non-numeric id
            "send({'t': 'call', 'id': 9001, 'g': 5, 'n': 'record', 'a': [1]})\n"
            "send({'t': 'call', 'id': 9002, 'g': 'tools', 'n': '__class__', 'a': [{'o': []}]})\n"
            "send({'t': 'call', 'id': 9003, 'g': 'tools', 'n': 'mro', 'a': [{'o': []}]})\n"
            "send({'t': 'call', 'id': 9004, 'g': 'tools', 'n': '__dict__', 'a': [{'o': []}]})\n"
            "send({'t': 'call', 'id': 9005, 'g': '__builtins__', 'n': 'print', 'a': [1]})\n"
            "send({'t': 'call', 'id': 9006, 'g': 'tools', 'n': 'record', 'a': [{'a': 5}]})\n"  # malformed args
            "send({'t': 'call', 'id': 9007, 'g': 'tools', 'n': 'record', 'a': ['forged']})\n"
            "send({'t': 'call', 'id': 9007, 'g': 'tools', 'n': 'record', 'a': ['duplicate']})\n"
            "send({'t': 'log', 's': 5})\nsend({'t': 'log'})\nsend({'t': 'log', 's': 'forged log'})\n"
            "send({'t': 'done', 'e': 'bad'})\nsend({'t': 'done', 'e': {'k': 'timeout', 'm': 'x'}})\n"
            "send({'t': 'done', 'e': {'k': 'exception'}})\nsend({'t': 'done', 'v': [1], 'e': {'k': 1, 'm': 'x'}})\n"
            "send({'t': 'ready', 'd': 'L9'})\n"
            "os.write(3, struct.pack('>I', 5) + b'{{{{{')\n"
            'os.write(1, struct.pack(\'>I\', 20) + b\'{"t":"done","v":[7]}\')\n'
            "import asyncio\nawait asyncio.sleep(0.3)\n"
            "return await tools.record({'real': True})"
        )
        described = await rt.start()
        r = await rt.run(program, tools(record=record))
        assert r.error is None and r.value == "ok", r
        assert calls == ["forged", {"real": True}]  # the duplicate id was ignored
        assert "forged log" in r.logs
        assert rt.isolation == described  # the forged 'ready' changed nothing

    arun(with_runtime(go, isolation="auto"))


def test_forged_completions_are_revalidated() -> None:
    async def go(rt: PythonCodeRuntime) -> None:
        # A forged lossy completion: invalid-output, never a string.
        r = await rt.run(FORGE + "send({'t': 'done', 'v': [{'a': 2}, 1]})\nimport time\ntime.sleep(5)", [])
        assert r.error is not None and r.error.kind == "invalid-output"
        # A forged value larger than the cap is re-measured by the host.
        r = await rt.run(FORGE + "send({'t': 'done', 'v': ['x' * 500]})\nimport time\ntime.sleep(5)", [])
        assert r.error is not None and r.error.kind == "output-limit"
        # Forged log and value exactly at the cap are accepted; one byte more is not. The
        # ledger: compact JSON of the logs array (["a..."] = 100 + 4) plus the value ("x..." = m + 2).
        exact = "send({'t': 'log', 's': 'a' * 100})\nsend({'t': 'done', 'v': ['x' * %d]})\nimport time\ntime.sleep(5)"
        r = await rt.run(FORGE + exact % 194, [])
        assert (r.error, r.value, r.logs) == (None, "x" * 194, ("a" * 100,)), r
        r = await rt.run(FORGE + exact % 195, [])
        assert r.error is not None and r.error.kind == "output-limit", r
        # Forged over-limit error text.
        r = await rt.run(
            FORGE + "send({'t': 'done', 'e': {'k': 'exception', 'm': 'E' * 500}})\nimport time\ntime.sleep(5)", []
        )
        assert r.error is not None and r.error.kind == "output-limit"
        # A forged log flood through the same ledger, fitting prefix kept.
        r = await rt.run(
            FORGE + "for i in range(100):\n    send({'t': 'log', 's': 'é' * 30})\nimport time\ntime.sleep(5)", []
        )
        assert r.error is not None and r.error.kind == "output-limit"
        assert (
            len(
                (
                    json.dumps(list(r.logs), ensure_ascii=False, separators=(",", ":"))
                    + json.dumps(r.error.message, ensure_ascii=False)
                ).encode()
            )
            <= 300
        )
        # A single oversized forged log keeps its fitting escaped prefix.
        r = await rt.run(FORGE + "send({'t': 'log', 's': '\\n' * 1000})\nimport time\ntime.sleep(5)", [])
        assert r.error is not None and r.error.kind == "output-limit" and r.logs and set(r.logs[0]) == {"\n"}
        # A forged worker-side output-limit is honoured.
        r = await rt.run(FORGE + "send({'t': 'output-limit'})\nreturn 1", [])
        assert r.error is not None and r.error.kind == "output-limit"
        # A deeply nested forged completion is measured without recursion.
        r = await rt.run(
            FORGE + "send({'t': 'done', 'v': [{'a': 1}] * 50000 + [{'a': 0}]})\nimport time\ntime.sleep(5)", []
        )
        assert r.error is not None and r.error.kind == "output-limit"
        # A frame over max_frame_bytes settles the run.
        r = await rt.run(FORGE + "os.write(3, struct.pack('>I', 10**9))\nimport time\ntime.sleep(5)", [])
        assert r.error is not None and r.error.kind == "output-limit" and "max_frame_bytes" in r.error.message
        # Closing the channel and idling ends at the wall clock, not a hang.
        r = await rt.run("import os, time\nos.close(3)\ntime.sleep(30)", [])
        assert r.error is not None and r.error.kind == "timeout"

    arun(with_runtime(go, isolation="auto", max_output_bytes=300, timeout_s=3.0, max_frame_bytes=4096))


def test_forged_surrogate_pairs_written_as_two_code_points_are_refused_as_values_joined_in_text() -> None:
    # Written raw (surrogatepass) next to an escape, a high and a low surrogate parse as two code
    # points: a str JSON text cannot carry. The host's decoding refuses it in arguments and results.
    calls: list[Any] = []

    async def record(args: Any) -> Any:
        calls.append(args)
        return "ok"

    raw = (
        "def raw(text):\n    b = text.encode('utf-8', 'surrogatepass')\n"
        "    os.write(3, struct.pack('>I', len(b)) + b)\n"
    )

    high, low = "\ud83d", "\\ude00"  # a raw high surrogate; a low one as its JSON escape
    call = '{"t":"call","id":9001,"g":"tools","n":"record","a":[{"o":["k"]},"' + high + low + '"]}'
    completions = (
        '{"t":"done","v":["' + high + low + '"]}',
        '{"t":"done","v":[{"o":["\\ud83d' + "\ude00" + '"]},1]}',
    )  # an escaped high one, a raw low one

    async def go(rt: PythonCodeRuntime) -> None:
        r = await rt.run(
            FORGE + raw + f"raw({call!r})\nimport asyncio\nawait asyncio.sleep(0.3)\n"
            "return await tools.record({'real': '\\udc80'})",
            tools(record=record),
        )
        assert r.error is None and r.value == "ok" and calls == [{"real": "\udc80"}], (r, calls)
        for done in completions:
            r = await rt.run(FORGE + raw + f"raw({done!r})\nimport time\ntime.sleep(5)", [])
            assert r.error is not None and r.error.kind == "invalid-output", (done, r)
        log = '{"t":"log","s":"' + high + low + '"}'  # text, not a value: the pair becomes its character
        r = await rt.run(FORGE + raw + f"raw({log!r})\nreturn 1", [])
        assert r.error is None and r.logs == ("\U0001f600",), r
        error = '{"t":"done","e":{"k":"exception","m":"' + high + low + '"}}'
        r = await rt.run(FORGE + raw + f"raw({error!r})\nimport time\ntime.sleep(5)", [])
        assert r.error is not None and r.error.message == "\U0001f600", r
        lone = '{"t":"done","v":["' + "\ude00" + '\\ud83d"]}'  # a low one then a high one: kept
        r = await rt.run(FORGE + raw + f"raw({lone!r})\nimport time\ntime.sleep(5)", [])
        assert r.error is None and r.value == "\ude00\ud83d", r

    arun(with_runtime(go, isolation="auto"))


def _fake_run(**functions: Any) -> tuple[_Run, list[bytes], list[Any]]:
    """A run with no worker behind it: bindings ``f`` and ``__class__`` (echoes), or ``functions``."""
    called: list[Any] = []

    async def f(args: Any) -> Any:
        called.append(args)
        return args

    runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L0", max_output_bytes=1000))
    run = _Run(runtime)
    run.assign("", validate_bindings(tools(**(functions or {"f": f, "__class__": f}))), None)
    assert run.clock is not None
    run.clock.stop()  # no worker behind this run: only its message handling is exercised
    run.ready = True
    written: list[bytes] = []
    run._write = written.append  # type: ignore[method-assign]
    return run, written, called


message_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(["tools", "f", "__class__", "mro", "record"]),  # names a call may target
    lambda c: (
        st.lists(c, max_size=4)
        | st.dictionaries(st.sampled_from(["t", "id", "g", "n", "a", "s", "v", "e", "k", "m", "o"]), c, max_size=5)
    ),
    max_leaves=12,
)
message_types = st.sampled_from(["call", "cancel", "log", "done", "output-limit", "ready", "reply", "junk"])


@given(
    st.lists(
        st.one_of(
            message_values,
            st.builds(
                lambda t, rest: {**rest, "t": t} if isinstance(rest, dict) else rest, message_types, message_values
            ),
        ),
        max_size=8,
    )
)
@settings(max_examples=150, deadline=None)
def test_fuzz_bridge_message_validation_never_raises(messages: list[Any]) -> None:
    async def go() -> None:
        run, written, called = _fake_run()
        for message in messages:
            run._on_message(message)
        await asyncio.sleep(0)
        await asyncio.gather(*run.tasks.values(), return_exceptions=True)  # a valid cancel may cut one
        # Only declared bindings were ever invoked, each id answered at most once.
        replies = [json.loads(frame[4:]) for frame in written]
        ids = [reply["id"] for reply in replies]
        assert len(ids) == len(set(ids))
        declared = [
            m
            for m in messages
            if type(m) is dict and m.get("t") == "call" and m.get("g") == "tools" and m.get("n") in ("f", "__class__")
        ]
        assert len(called) <= len(declared)
        answered = {m.get("id") for m in declared if type(m.get("id")) is int}
        assert all(reply["id"] in answered for reply in replies if "v" in reply)
        if run.outcome is not None:
            assert run.outcome[0] in ("limit", "error", "value", "novalue")
            if run.outcome[0] == "error":
                assert run.outcome[1][0] in ("exception", "invalid-output", "memory-limit")

    arun(go())


def _without_poll(reply: dict[str, Any]) -> dict[str, Any]:
    """A reply without its ``poll`` hint (a bool whose value depends on the CPUs and the live runs)."""
    assert type(reply.pop("poll")) is bool, reply
    return reply


def _replies(written: list[bytes]) -> dict[int, Any]:
    return {m["id"]: _without_poll(m) for m in (json.loads(frame[4:]) for frame in written)}


async def _turns() -> None:
    """A few event-loop turns: cancelled tasks end, then their done-callbacks run."""
    for _ in range(3):
        await asyncio.sleep(0)


def _holder(events: list[Any], release: asyncio.Event) -> Any:
    async def hold(args: Any) -> Any:
        try:
            await release.wait()
        except asyncio.CancelledError:
            events.append(("cancelled", args))
            raise
        return args

    return hold


def test_cancel_messages_are_validated_field_by_field() -> None:
    # A cancel names a call of this run that is still running; anything else is ignored, never raised on.
    async def go() -> None:
        events: list[Any] = []
        release = asyncio.Event()
        run, written, _ = _fake_run(hold=_holder(events, release))
        for call_id in (1, 2, 3):
            run._on_message({"t": "call", "id": call_id, "g": "tools", "n": "hold", "a": [call_id]})
        await asyncio.sleep(0)
        for call_id in (None, "2", 2.0, True, [2], {"o": []}, 0, -2, 4, 2**70):
            run._on_message({"t": "cancel", "id": call_id})
        run._on_message({"t": "cancel"})
        run._on_message({"t": "cancel", "i": 2})
        run._on_message({"t": "Cancel", "id": 2})
        await asyncio.sleep(0)
        assert events == [] and set(run.tasks) == {1, 2, 3} and not run.cancelled_ids
        run._on_message({"t": "cancel", "id": 2, "extra": "ignored"})
        run._on_message({"t": "cancel", "id": 2})  # a duplicate: ignored
        await _turns()
        assert events == [("cancelled", 2)]
        assert set(run.tasks) == {1, 3} and not run.cancelled_ids  # forgotten once it ended
        release.set()
        await asyncio.gather(*run.tasks.values(), return_exceptions=True)
        assert _replies(written) == {
            1: {"t": "reply", "id": 1, "ok": True, "v": [1]},
            3: {"t": "reply", "id": 3, "ok": True, "v": [3]},
        }  # none for 2
        release.clear()
        run._on_message({"t": "cancel", "id": 1})  # late: answered already
        run._on_message({"t": "call", "id": 4, "g": "tools", "n": "hold", "a": [4]})
        await asyncio.sleep(0)
        assert set(run.tasks) == {4}
        run.settle("novalue")
        run._on_message({"t": "cancel", "id": 4})  # after settlement: ignored
        await asyncio.sleep(0)
        assert events == [("cancelled", 2)] and not run.tasks[4].done()
        run.tasks[4].cancel()

    arun(go())


def test_a_cancelled_call_gets_no_reply_however_its_binding_ends() -> None:
    # A plain function's future is cancelled at once; a body that swallows the cancellation
    # and returns stays counted in flight until it ends, and its value is not sent either.
    async def go() -> None:
        futures: list[asyncio.Future[Any]] = []
        finish = asyncio.Event()

        def plain(args: Any) -> asyncio.Future[Any]:
            futures.append(asyncio.get_running_loop().create_future())
            return futures[-1]

        async def stubborn(args: Any) -> Any:
            while True:
                try:
                    await finish.wait()
                    return "finished anyway"
                except asyncio.CancelledError:
                    continue

        run, written, _ = _fake_run(plain=plain, stubborn=stubborn)
        run._on_message({"t": "call", "id": 1, "g": "tools", "n": "plain", "a": [{"o": []}]})
        run._on_message({"t": "call", "id": 2, "g": "tools", "n": "stubborn", "a": [{"o": []}]})
        await asyncio.sleep(0)
        run._on_message({"t": "cancel", "id": 1})
        run._on_message({"t": "cancel", "id": 2})
        assert futures[0].cancelled()
        await asyncio.sleep(0)
        assert set(run.tasks) == {2}  # still running: still counted against the bounds
        finish.set()
        await asyncio.gather(*run.tasks.values())
        await _turns()
        assert not run.tasks and not run.cancelled_ids and written == []

    arun(go())


def test_a_cancel_flood_is_ignored_in_bounded_memory() -> None:
    async def go() -> None:
        events: list[Any] = []
        release = asyncio.Event()
        run, written, _ = _fake_run(hold=_holder(events, release))
        for call_id in range(1, 101):
            run._on_message({"t": "call", "id": call_id, "g": "tools", "n": "hold", "a": [call_id]})
        await asyncio.sleep(0)
        for n in range(50_000):
            run._on_message({"t": "cancel", "id": (n * 7919) % 1000})  # the 50 odd ids below 100, many times
            if n % 1000 == 0:
                assert len(run.cancelled_ids) <= len(run.tasks)
        await _turns()
        cancelled = sorted(args for _, args in events)
        assert cancelled == sorted({(n * 7919) % 1000 for n in range(50_000)} & set(range(1, 101)))
        assert len(run.tasks) == 100 - len(cancelled) and not run.cancelled_ids
        release.set()
        await asyncio.gather(*run.tasks.values())
        assert sorted(_replies(written)) == sorted(set(range(1, 101)) - set(cancelled))

    arun(go())


def test_forged_cancels_reach_only_the_forgers_own_calls_in_flight() -> None:
    # Run A holds a call (id 1). Run B forges cancels of id 1 (A's id, not yet one of B's),
    # junk ids and a flood; then B makes a real call, which frees A's. Nothing of A's is cut.
    events: list[Any] = []

    async def go(rt: PythonCodeRuntime) -> None:
        release = asyncio.Event()
        started = asyncio.Event()
        hold = _holder(events, release)

        async def held(args: Any) -> Any:
            started.set()
            return await hold(args)

        async def free(args: Any) -> Any:
            release.set()
            return "freed"

        binds = tools(held=held, free=free)
        a = asyncio.ensure_future(rt.run("return await tools.held('a')", binds))
        await started.wait()
        forger = FORGE + (
            "for i in (1, 0, -1, 2, 10**30, 'x', None, 1.5, True, [1], {'id': 1}):\n"
            "    send({'t': 'cancel', 'id': i})\n"
            "for i in range(20000):\n    send({'t': 'cancel', 'id': i % 50})\n"
            "send({'t': 'cancel'})\nreturn await tools.free({})"
        )
        b = await rt.run(forger, binds)
        assert b.error is None and b.value == "freed", b
        result = await a
        assert result.error is None and result.value == "a", result
        assert events == []

    arun(with_runtime(go, isolation="auto", timeout_s=20.0))


def test_unknown_binding_replies_by_own_name_lookup() -> None:
    async def go() -> None:
        run, written, called = _fake_run()
        for call_id, name in enumerate(["__class__", "mro", "__dict__", "__init__", "f", "get", "keys"]):
            run._on_message({"t": "call", "id": call_id, "g": "tools", "n": name, "a": [{"o": []}]})
        run._on_message({"t": "call", "id": 99, "g": "__class__", "n": "f", "a": [1]})
        for task in list(run.tasks.values()):
            await task
        replies = _replies(written)
        assert replies[0]["ok"] is True  # a binding literally named __class__
        assert replies[1] == {"t": "reply", "id": 1, "ok": False, "m": 'unknown binding "tools.mro"'}
        assert replies[2]["m"] == 'unknown binding "tools.__dict__"'
        assert replies[5]["m"] == 'unknown binding "tools.get"'
        assert replies[99]["m"] == 'unknown binding "__class__.f"'
        assert called == [{}, {}]
        run.settle("novalue")
        run._on_message({"t": "call", "id": 100, "g": "tools", "n": "f", "a": [1]})
        assert 100 not in {json.loads(frame[4:])["id"] for frame in written}  # ignored after settlement
        assert called == [{}, {}]

    arun(go())


def test_long_forged_names_are_truncated_in_replies() -> None:
    async def go(rt: PythonCodeRuntime) -> None:
        program = (
            FORGE + RECV + ("send({'t': 'call', 'id': 10**6, 'g': 'tools', 'n': 'x' * 5000, 'a': [1]})\nreturn recv()")
        )
        r = await rt.run(program, tools(f=echo))
        assert r.error is None, r
        assert _without_poll(r.value) == {
            "t": "reply",
            "id": 10**6,
            "ok": False,
            "m": 'unknown binding "tools.' + "x" * 94 + '... [4906 more characters]"',
        }

    arun(with_runtime(go, isolation="auto", timeout_s=10.0))


def test_call_flood_without_reading_replies_is_bounded() -> None:
    # Forged calls with near-frame-sized unknown names, replies never read: the
    # host echoes truncated names and stops once a frame cap of replies is queued.
    async def go(rt: PythonCodeRuntime) -> None:
        assert (await rt.run("return 1", [])).value == 1  # zygote up before measuring
        program = FORGE + (
            "name = 'x' * 60000\n"
            "for i in range(1, 3001):\n"
            "    send({'t': 'call', 'id': i, 'g': 'tools', 'n': name, 'a': [1]})\n"
            "import time\ntime.sleep(60)"
        )
        tracemalloc.start()
        try:
            r = await rt.run(program, tools(f=echo))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert r.error is not None and r.error.kind == "output-limit", r
        assert "stopped reading binding replies" in r.error.message
        assert "65536-byte max_frame_bytes cap" in r.error.message
        undelivered = int(re.search(r"\((\d+) bytes undelivered", r.error.message).group(1))  # type: ignore[union-attr]
        assert 65536 < undelivered <= 65536 + 1024  # one short reply past the cap
        assert peak < 48 * 1024 * 1024, peak  # unbounded, 3,000 echoed names would be ~180 MB

    arun(with_runtime(go, isolation="auto", timeout_s=30.0, max_frame_bytes=65536))


def test_forged_call_ids_are_bounded() -> None:
    async def go(rt: PythonCodeRuntime) -> None:
        # Consecutive ids (as a real worker sends) cost nothing to remember...
        program = FORGE + (
            "for i in range(1, 20001):\n"
            "    send({'t': 'call', 'id': i, 'g': 'tools', 'n': 'nope', 'a': [1]})\n"
            "    send({'t': 'call', 'id': i, 'g': 'tools', 'n': 'nope', 'a': [1]})\n"  # duplicate: ignored
            "send({'t': 'done', 'v': ['ok']})\nimport time\ntime.sleep(60)"
        )
        r = await rt.run(program, tools(f=echo))
        assert r.error is None and r.value == "ok", r
        # ...scattered (forged) ones are capped: the run settles.
        program = FORGE + (
            "for i in range(20000):\n"
            "    send({'t': 'call', 'id': 10**9 + 7 * i, 'g': 'tools', 'n': 'nope', 'a': [1]})\n"
            "import time\ntime.sleep(60)"
        )
        r = await rt.run(program, tools(f=echo))
        assert r.error is not None and r.error.kind == "output-limit", r
        assert "more than 10000 forged or out-of-order call ids" in r.error.message

    arun(with_runtime(go, isolation="auto", timeout_s=30.0))


def test_binding_calls_in_flight_are_bounded() -> None:
    started: list[int] = []
    ended: list[int] = []

    async def hold(args: Any) -> Any:
        started.append(args)
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(args)

    async def go(rt: PythonCodeRuntime) -> None:
        program = (
            FORGE
            + RECV
            + (
                "for i in range(1, 10002):\n"
                "    send({'t': 'call', 'id': i, 'g': 'tools', 'n': 'hold', 'a': [i]})\n"
                "return recv()"
            )
        )
        r = await rt.run(program, tools(hold=hold))
        assert r.error is None, r
        message = "too many binding calls in flight (at most 10000)"
        assert _without_poll(r.value) == {"t": "reply", "id": 10001, "ok": False, "m": message}
        assert sorted(started) == list(range(1, 10001))
        assert sorted(ended) == sorted(started)  # every one was cancelled and finished before run() returned

    arun(with_runtime(go, isolation="auto", timeout_s=30.0))


def test_binding_arguments_in_flight_are_bounded_by_the_memory_budget() -> None:
    # A forger writes one 4 MiB argument buffer as 40 calls (writev: it holds it once).
    # The host must not hold 40 decoded copies at once for bindings still running:
    # past the worker's memory budget (64 MiB here) a call gets an error reply.
    started: list[int] = []

    def hold(args: Any) -> Any:
        started.append(len(args["s"]))
        return asyncio.get_running_loop().create_future()  # never resolved: cancelled at teardown

    async def go(rt: PythonCodeRuntime) -> None:
        program = (
            "import os, struct\n"
            "body = b'\"' + b'a' * (4 << 20) + b'\"]}'\n"
            "for i in range(1, 41):\n"
            '    head = b\'{"t":"call","id":%d,"g":"tools","n":"hold","a":[{"o":["s"]},\' % i\n'
            "    os.writev(3, [struct.pack('>I', len(head) + len(body)), head, body])\n"
            "return 'sent'"
        )
        r = await rt.run(program, tools(hold=hold))
        assert r.error is None and r.value == "sent", r
        assert 1 <= len(started) <= 16, len(started)  # 40 without the bound
        # Calls that end release their share: sequential large calls all go through.
        started.clear()
        r = await rt.run(
            "s = 'a' * (4 << 20)\nreturn sum([len((await tools.echo({'s': s}))['s']) for _ in range(40)])",
            tools(echo=echo),
        )
        assert r.error is None and r.value == 40 * (4 << 20), r

    arun(with_runtime(go, isolation="auto", timeout_s=60.0, memory_mb=64))


def test_exit_status_is_read_when_eof_arrives_before_the_exit_callback() -> None:
    # The zygote's exit report resolves the exit future; its _on_exit callback runs a
    # loop turn later. Channel EOF handled in between must still see the real status.
    async def go() -> Any:
        run, _, _ = _fake_run()
        run.exit_future = asyncio.get_running_loop().create_future()
        run.exit_future.add_done_callback(run._on_exit)
        run.exit_future.set_result(3 << 8)  # exited with code 3; the callback is only scheduled
        run.sock_eof = True
        run._check_eof()
        return run.outcome

    assert arun(go()) == ("error", ("worker-exit", "worker exited with code 3 before completing"))


def test_a_burst_of_spawns_waits_for_a_busy_zygote() -> None:
    # The control socket's send buffer holds a few hundred spawn requests; more than
    # that, while the zygote is busy, wait in order: none is lost and the zygote is
    # not taken for dead. Each request's descriptors travel with it.
    import array
    import os
    import socket

    from dsh_core.coderuntime.host import _Zygote

    burst = 1000  # about 280 fit in the socket here

    async def go() -> None:
        collect_leftovers()  # the 1000 pipes below would set off a collection of an earlier test's descriptors
        fds_before = set(os.listdir("/proc/self/fd"))
        host_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        host_end.setblocking(False)
        zygote = _Zygote(None, asyncio.get_running_loop())  # type: ignore[arg-type]
        zygote.ctrl, zygote.alive = host_end, True
        for n in range(burst):
            read_end, write_end = os.pipe()
            zygote.spawn(f"r{n}", read_end, write_end, "/")
            os.close(read_end)
            os.close(write_end)
        assert zygote.alive and zygote.outbox  # the socket filled up; the rest waits
        received: list[str] = []
        while len(received) < burst:
            await asyncio.sleep(0.01)  # the event loop flushes the outbox as room appears
            zygote_end.setblocking(False)
            while True:
                try:
                    data, ancdata, _, _ = zygote_end.recvmsg(4096, socket.CMSG_SPACE(8))
                except BlockingIOError:
                    break
                ((level, kind, payload),) = ancdata
                fds = array.array("i", payload)
                assert (level, kind, len(fds)) == (socket.SOL_SOCKET, socket.SCM_RIGHTS, 2)
                for fd in fds:
                    os.close(fd)
                received.append(json.loads(data)["r"])
        assert received == [f"r{n}" for n in range(burst)]
        assert zygote.alive and not zygote.outbox and not any(f.done() for f in zygote.exits.values())
        await zygote.close()
        zygote_end.close()
        assert set(os.listdir("/proc/self/fd")) == fds_before

    arun(go())


def test_a_frame_too_dear_to_parse_is_refused_before_it_is_parsed() -> None:
    # 3 bytes of JSON make a 64-byte dict: a frame of nothing but empty containers used to take
    # about 26 times its size of host memory (and seconds of the host's loop) just to be dropped.
    async def go(rt: PythonCodeRuntime) -> None:
        assert (await rt.run("return 1", [])).value == 1  # zygote up before measuring
        program = (
            "import os, struct\n"
            "body = b'[' + b'{},' * 2_000_000 + b'{}]'\n"
            "os.write(3, struct.pack('>I', len(body)) + body)\n"
            "import time\ntime.sleep(60)"
        )
        tracemalloc.start()
        try:
            r = await rt.run(program, [])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert r.error is not None and r.error.kind == "output-limit", r
        assert r.error.message.startswith("a frame of 6000004 bytes could take up to "), r.error.message
        assert "bytes of host memory to read, more than the memory budget (64 MiB)" in r.error.message
        assert peak < 48 * 1024 * 1024, peak  # parsed, the 2 million dicts alone would be over 120 MB
        ok = await rt.run("return [[i, {'k': [i]}] for i in range(30000)]", [])  # 1.1 MB of containers: in budget
        assert ok.error is None and len(ok.value) == 30000

    arun(with_runtime(go, isolation="auto", timeout_s=30.0, memory_mb=64))


def test_braces_inside_strings_do_not_make_a_frame_too_dear() -> None:
    # A string of braces parses into one str of its own size: a 1.1 MB result or argument of
    # "{" characters (an escaped quote and backslash among them) was refused as 1.1 million
    # containers, 70 MB for a 64 MiB budget, though it is far within max_output_bytes.
    async def go(rt: PythonCodeRuntime) -> None:
        text = "{" * 550_000 + '\\"' + "[" * 550_000
        r = await rt.run(f"return {text!r}", [])
        assert r.error is None and r.value == text, r.error
        r = await rt.run(f"return await tools.echo({{'content': {text!r}}})", tools(echo=echo))
        assert r.error is None and r.value == {"content": text}, r.error
        # Real containers after a string that ends in an escaped backslash still count.
        program = (
            "import os, struct\n"
            "body = b'[\"\\\\\\\\\",' + b'{},' * 2_000_000 + b'{}]'\n"
            "assert body.startswith(b'[\"' + bytes([92, 92]) + b'\",{},')\n"
            "os.write(3, struct.pack('>I', len(body)) + body)\n"
            "import time\ntime.sleep(60)"
        )
        r = await rt.run(program, [])
        assert r.error is not None and r.error.kind == "output-limit", r
        assert r.error.message.startswith("a frame of 6000009 bytes could take up to "), r.error.message

    arun(with_runtime(go, isolation="auto", timeout_s=30.0, memory_mb=64))


def test_a_frame_of_tiny_scalars_too_dear_to_parse_is_refused() -> None:
    # No containers, so the old count let it through: 16 MiB of "1e5," parse into 4 million
    # floats and their slots, ten times the frame (160 MB, over a second of the host's loop).
    async def go(rt: PythonCodeRuntime) -> None:
        assert (await rt.run("return 1", [])).value == 1  # zygote up before measuring
        program = (
            "import os, struct, time\n"
            'body = b\'{"t":"call","id":1,"g":"tools","n":"nope","a":[{"a":4194304},\''
            " + b'1e5,' * 4194303 + b'1e5]}'\n"
            "os.write(3, struct.pack('>I', len(body)) + body)\n"
            "time.sleep(3)\n"
            "return 'not refused'"
        )
        tracemalloc.start()
        try:
            r = await rt.run(program, [])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert r.error is not None and r.error.kind == "output-limit", r
        assert r.error.message.startswith("a frame of 16777278 bytes could take up to "), r.error.message
        assert peak < 64 * 1024 * 1024, peak  # within the budget; parsed, the floats alone would take 160 MB
        # A genuine result of the same kind, a tenth the size, is read.
        ok = await rt.run("return [1e5] * 400_000", [])
        assert ok.error is None and len(ok.value) == 400_000, ok.error

    arun(with_runtime(go, isolation="auto", timeout_s=30.0, memory_mb=64))


def test_binding_arguments_in_flight_are_bounded_by_what_they_take_once_read() -> None:
    # 256 KiB of empty-array markers decode into 32,768 lists: ten times the frame. Counted by
    # frame bytes, 40 such calls (10 MiB of frames, 100 MB decoded) fitted a 64 MiB budget.
    started: list[int] = []

    def hold(args: Any) -> Any:
        started.append(len(args))
        return asyncio.get_running_loop().create_future()  # never resolved: cancelled at teardown

    async def go(rt: PythonCodeRuntime) -> None:
        program = (
            "import os, struct\n"
            "body = b'{\"a\":32768},' + b'{\"a\":0},' * 32767 + b'{\"a\":0}]}'\n"
            "for i in range(1, 41):\n"
            '    head = b\'{"t":"call","id":%d,"g":"tools","n":"hold","a":[\' % i\n'
            "    os.writev(3, [struct.pack('>I', len(head) + len(body)), head, body])\n"
            "return 'sent'"
        )
        r = await rt.run(program, tools(hold=hold))
        assert r.error is None and r.value == "sent", r
        assert 1 <= len(started) <= 8 and set(started) == {32768}, started  # 40 when counted by frame bytes

    arun(with_runtime(go, isolation="auto", timeout_s=60.0, memory_mb=64))


def test_many_concurrent_small_calls_fit_the_budget_their_arguments_fit() -> None:
    # 1,500 concurrent calls of 900-byte strings hold about 3 MB of arguments on the host. Counted
    # at 64 times a frame under 1 KiB, they took 98 MB of a 64 MiB budget: the calls past about
    # 1,000 were refused, while 1,100-byte strings (scanned) were not.
    async def hold(args: Any) -> Any:
        await asyncio.sleep(1.0)
        return len(args)

    async def go(rt: PythonCodeRuntime) -> None:
        program = (
            "import asyncio\ngot = await asyncio.gather(*[tools.hold('x' * 900) for _ in range(1500)])\nreturn sum(got)"
        )
        r = await rt.run(program, tools(hold=hold))
        assert r.error is None and r.value == 1500 * 900, r.error

    arun(with_runtime(go, isolation="auto", timeout_s=60.0, memory_mb=64))


def test_the_hosts_time_reading_large_frames_is_charged_to_the_cpu_budget() -> None:
    # Each 4 MiB frame of floats is within the memory budget but holds the host's loop for a
    # fraction of a second; sent one after another, only the wall-clock ceiling ended them,
    # while every other run on the host waited. The worker itself spends almost no CPU.
    async def go(rt: PythonCodeRuntime) -> None:
        assert (await rt.run("return 1", [])).value == 1
        program = (
            "import os, struct\n"
            'body = b\'{"t":"call","id":%d,"g":"tools","n":"nope","a":[{"a":1048576},\''
            " + b'1e5,' * 1048575 + b'1e5]}'\n"
            "for i in range(1, 1000):\n"
            "    frame = body % i\n"
            "    os.write(3, struct.pack('>I', len(frame)) + frame)\n"
            "return 'not charged'"
        )
        r = await rt.run(program, [])
        # The CPU budget ended it, not the 60 s wall-clock ceiling (which says so in other words).
        assert r.error is not None and r.error.kind == "timeout", r
        assert r.error.message.startswith("CPU budget exhausted (1 s of CPU time, "), r.error.message
        assert "s of it the host reading the program's frames)" in r.error.message, r.error.message

    arun(with_runtime(go, isolation="auto", timeout_s=60.0, cpu_s=1.0))


# Uncharged, a flood runs its ``seconds`` and returns 'not charged' (the program's own CPU stays far
# below the budget); charged, it ends within about a second, which a loaded machine may make a few.
@pytest.mark.parametrize(
    ("elements", "frame_under", "seconds", "pause"),
    [
        # Frames just under 64 KiB, read about 64 KiB at a time: only frames of 64 KiB or more had the
        # host's reading time charged, and such a flood held the host's loop for about 50 times the
        # CPU the program spent itself (measured: 2.4 s against 0.05 s), until the wall clock.
        pytest.param(30000, 1 << 16, 30, False, id="frames-under-64-kib"),
        # Small reads: past a run's first 64 KiB of them, one read in eight (at random) is timed and
        # charged eight times over, since reading the thread's clock on each costs more than the read.
        pytest.param(1500, 4096, 30, True, id="small-reads-sampled"),
    ],
)
def test_the_hosts_time_reading_a_flood_of_junk_frames_is_charged_to_the_cpu_budget(
    elements: int, frame_under: int, seconds: int, pause: bool
) -> None:
    async def go(rt: PythonCodeRuntime) -> None:
        assert (await rt.run("return 1", [])).value == 1
        program = (
            "import os, struct, time\n"
            f"body = b'{{\"t\":\"x\",\"a\":[' + b','.join([b'0'] * {elements}) + b']}}'\n"
            "frame = struct.pack('>I', len(body)) + body\n"
            f"assert len(frame) < {frame_under}\n"
            f"end = time.monotonic() + {seconds}\n"
            "while time.monotonic() < end:\n"
            "    os.write(3, frame)\n" + ("    time.sleep(0)\n" if pause else "") + "return 'not charged'"
        )
        r = await rt.run(program, [])
        assert r.error is not None and r.error.kind == "timeout", r
        assert "s of it the host reading the program's frames)" in r.error.message, r.error.message

    arun(with_runtime(go, isolation="auto", timeout_s=60.0, cpu_s=0.5))


def test_only_the_hosts_cpu_time_reading_a_frame_is_charged_not_its_wall_time(monkeypatch: Any) -> None:
    # The host's loop may be off the CPU while it reads a frame (other processes on the machine,
    # the GIL held by another thread, the host stopped with Ctrl-Z): that is not the program's
    # CPU time. Here reading each large frame takes 0.4 s of wall time and almost no CPU.
    import time

    from dsh_core.coderuntime.worker import wire

    unpack = wire.unpack_payload

    def slow_unpack(payload: Any) -> Any:
        if len(payload) >= 1 << 16:
            time.sleep(0.4)
        return unpack(payload)

    monkeypatch.setattr(wire, "unpack_payload", slow_unpack)

    async def size(args: Any) -> Any:
        return len(args["s"])

    async def go(rt: PythonCodeRuntime) -> None:
        program = "s = 'a' * 100_000\nreturn sum([await tools.size({'s': s}) for _ in range(5)])"
        r = await rt.run(program, tools(size=size))
        assert r.error is None and r.value == 500_000, r.error

    arun(with_runtime(go, isolation="auto", timeout_s=60.0, cpu_s=1.0))
