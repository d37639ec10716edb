"""``dsh sessions show``'s tree and ``dsh sessions list``'s table."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
from click.testing import CliRunner

from dsh_core.cli import main
from dsh_core.errors import DshError
from dsh_core.sessions.cli import render_list, render_session
from dsh_core.sessions.events import SessionEvent, SessionInfo
from dsh_core.sessions.sqlite import DB_FILENAME, SqliteSessionStore


def ev(
    seq: int,
    kind: str,
    payload: dict[str, Any],
    at: float,
    root: str | None = None,
    parent: str | None = None,
    sub: str | None = None,
) -> SessionEvent:
    return SessionEvent("s1", seq, kind, payload, at, root, parent, sub)


def test_show_renders_outer_calls_with_nested_calls_outcomes_and_durations() -> None:
    program = json.dumps({"code": "await tools.read({'path': 'a'})", "description": "read two files"})
    events = [
        ev(1, "run/start", {"task": "survey", "provider": "scripted", "mode": "code", "resumed": False}, 0.0),
        ev(2, "message/user", {"message": {"role": "user", "content": "survey"}}, 0.0),
        ev(
            3,
            "message/assistant",
            {
                "message": {
                    "role": "assistant",
                    "content": "on it",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "run_code", "arguments": program}},
                        {"id": "d", "type": "function", "function": {"name": "read", "arguments": "{}"}},
                    ],
                }
            },
            0.0,
        ),
        ev(4, "tool/call", {"name": "run_code", "arguments": program}, 0.0, "1.1"),
        ev(5, "tool/call", {"name": "read", "arguments": "{}"}, 0.0, "1.2"),
        ev(
            6,
            "tool/code-dispatch-start",
            {"name": "read", "arguments": {"path": "a"}},
            1.000,
            "1.1",
            "1.1",
            "1.1:code:1",
        ),
        ev(
            7,
            "tool/code-dispatch-start",
            {"name": "write", "arguments": {"path": "b"}},
            1.001,
            "1.1",
            "1.1",
            "1.1:code:2",
        ),
        ev(
            8,
            "approval",
            {"name": "write", "call_id": "1.1:code:2", "reason": "writes", "outcome": "rejected"},
            1.002,
            "1.1",
        ),
        ev(
            9,
            "tool/code-dispatch",
            {"name": "write", "is_error": True, "error_code": "DENIED"},
            1.003,
            "1.1",
            "1.1",
            "1.1:code:2",
        ),
        ev(
            10,
            "tool/code-dispatch",
            {"name": "read", "is_error": False, "error_code": None},
            1.0125,
            "1.1",
            "1.1",
            "1.1:code:1",
        ),
        ev(11, "tool/result", {"name": "run_code", "ok": True, "error": None, "duration_ms": 20.04}, 1.1, "1.1"),
        ev(
            12,
            "tool/result",
            {"name": "read", "ok": False, "error": {"code": "UNKNOWN_TOOL", "message": "no"}, "duration_ms": 0.5},
            1.1,
            "1.2",
        ),
        ev(
            13,
            "message/user",
            {"message": {"role": "user", "content": "a context"}, "context_source": "guard"},
            1.1,
            "1.2",
        ),
        ev(14, "message/assistant", {"message": {"role": "assistant", "content": "Done."}}, 1.2),
        ev(15, "run/end", {"reason": "final-answer", "turns": 2, "answer": "Done."}, 1.2),
    ]
    info = SessionInfo("s1", 0.0, 1.2, len(events), {"agent": "main"})
    text = render_session(info, events)
    lines = text.splitlines()
    assert lines[0].startswith("session s1 · agent main · 15 events · created ")
    assert lines[1:] == [
        "└─ run 1: survey · provider scripted · mode code",
        "   ├─ user: survey",
        "   ├─ assistant → run_code, read (on it)",
        "   ├─ run_code [1.1] 'read two files' — ok · 20.0 ms",
        '   │  ├─ read [#1] {"path": "a"} — ok · 12.5 ms',
        '   │  ├─ write [#2] {"path": "b"} — DENIED · 2.0 ms',
        "   │  └─ approval for write: rejected (writes)",
        "   ├─ read [1.2] {} — UNKNOWN_TOOL: no · 0.5 ms",
        "   ├─ context (guard): a context",
        "   ├─ assistant: Done.",
        "   └─ end: final-answer after 2 turn(s)",
    ]


def test_show_marks_a_nested_call_that_never_settled_and_a_run_without_end() -> None:
    events = [
        ev(1, "run/start", {"task": "t", "provider": "p", "mode": "code"}, 0.0),
        ev(2, "tool/call", {"name": "run_code", "arguments": "{}"}, 0.0, "1.1"),
        ev(3, "tool/code-dispatch-start", {"name": "read", "arguments": {}}, 0.0, "1.1", "1.1", "1.1:code:1"),
    ]
    text = render_session(SessionInfo("s", 0.0, 0.0, 3, {}), events)
    assert text.splitlines()[1:] == [
        "└─ run 1: t · provider p · mode code",
        "   ├─ run_code [1.1] {} — no result (interrupted)",
        "   │  └─ read [#1] {} — no result (interrupted)",
        "   └─ end: none recorded (interrupted)",
    ]


def test_show_marks_a_model_direct_call_without_result_in_each_run() -> None:
    events = [
        ev(1, "run/start", {"task": "one", "provider": "p", "mode": "native"}, 0.0),
        ev(2, "tool/call", {"name": "slow", "arguments": "{}"}, 0.0, "1.1"),
        ev(3, "tool/call", {"name": "read", "arguments": "{}"}, 0.0, "1.2"),
        ev(4, "tool/result", {"name": "read", "ok": True, "duration_ms": 1.0}, 0.0, "1.2"),
        ev(5, "run/start", {"task": "two", "provider": "p", "mode": "native", "resumed": True}, 1.0),
        ev(6, "tool/call", {"name": "slow", "arguments": "{}"}, 1.0, "2.1"),
        ev(7, "run/end", {"reason": "aborted", "turns": 1, "answer": None, "error": "cancelled"}, 2.0),
    ]
    text = render_session(SessionInfo("s", 0.0, 0.0, 7, {}), events)
    assert text.splitlines()[1:] == [
        "├─ run 1: one · provider p · mode native",
        "│  ├─ slow [1.1] {} — no result (interrupted)",
        "│  ├─ read [1.2] {} — ok · 1.0 ms",
        "│  └─ end: none recorded (interrupted)",
        "└─ run 2 (resumed): two · provider p · mode native",
        "   ├─ slow [2.1] {} — no result (interrupted)",
        "   └─ end: aborted after 1 turn(s): cancelled",
    ]


def test_show_says_when_the_model_saw_a_result_cut_to_the_cap() -> None:
    cut = {"chars": 2_000_000, "left_out": 1_995_100, "max_tool_result_chars": 5_000}
    events = [
        ev(1, "run/start", {"task": "t", "provider": "p", "mode": "native"}, 0.0),
        ev(2, "tool/call", {"name": "dump", "arguments": "{}"}, 0.0, "1.1"),
        ev(3, "tool/result", {"name": "dump", "ok": True, "duration_ms": 3.0, "cut": cut}, 0.0, "1.1"),
        ev(4, "tool/call", {"name": "odd", "arguments": "{}"}, 0.0, "1.2"),
        ev(5, "tool/result", {"name": "odd", "ok": True, "duration_ms": 1.0, "cut": "junk"}, 0.0, "1.2"),
        ev(
            6,
            "message/user",
            {
                "message": {"role": "user", "content": "head"},
                "context_source": "guard",
                "content": "x" * 90_000,
                "cut": {**cut, "chars": 90_000, "left_out": 85_100},
            },
            0.0,
            "1.2",
        ),
    ]
    text = render_session(SessionInfo("s", 0.0, 0.0, 6, {}), events)
    assert text.splitlines()[2:5] == [
        "   ├─ dump [1.1] {} — ok · 3.0 ms · the model saw it cut to fit 5,000 characters (1,995,100 left out)",
        "   ├─ odd [1.2] {} — ok · 1.0 ms",
        "   ├─ context (guard): head · the model saw it cut to fit 5,000 characters (85,100 left out)",
    ]


def test_list_renders_a_table() -> None:
    assert render_list([]) == "no sessions"
    rows = render_list([SessionInfo("a-1", 0.0, 0.0, 7, {"agent": "main", "task": "do it"})]).splitlines()
    assert rows[0].split() == ["ID", "UPDATED", "EVENTS", "AGENT", "TASK"]
    assert rows[1].startswith("a-1") and rows[1].endswith("7       main   do it")


def test_nothing_a_model_or_tool_wrote_can_drive_the_terminal() -> None:
    """Escape sequences, separators and bidi overrides from a session are shown, not obeyed."""
    clear, clipboard, rtl = "\x1b[2J", "\x1b]52;c;ZWNobyBoaQ==\x07", "\u202eexe.txt"
    events = [
        ev(1, "run/start", {"task": f"fix {clear}", "provider": "p", "mode": "native"}, 0.0),
        ev(2, "tool/call", {"name": f"bad{clear}", "arguments": "{}"}, 0.0, "1.1"),
        ev(
            3,
            "tool/result",
            {"name": f"bad{clear}", "ok": False, "error": {"code": "UNKNOWN_TOOL", "message": clipboard}},
            0.0,
            "1.1",
        ),
        ev(4, "assistant/message", {"message": {"role": "assistant", "content": f"see {rtl}\u2028more"}}, 0.0),
        ev(5, "run/end", {"reason": "final-answer", "turns": 1, "answer": "x", "error": None}, 0.0),
    ]
    text = render_session(SessionInfo("s", 0.0, 0.0, 5, {}), events)
    assert not any(ch in text for ch in "\x1b\x07\u202e\u2028")
    assert "fix \\x1b[2J" in text and "bad\\x1b[2J [1.1]" in text and "\\u202eexe.txt" in text
    table = render_list([SessionInfo("a-1", 0.0, 0.0, 1, {"agent": "m\x1b[31m", "task": clipboard})])
    assert "\x1b" not in table and "m\\x1b[31m" in table
    # An API caller names its session: the id is shown, not obeyed, by show and by list.
    named = SessionInfo(f"s{clear}{rtl}", 0.0, 0.0, 5, {})
    for shown in (render_session(named, events), render_list([named])):
        assert not any(ch in shown for ch in "\x1b\x07\u202e\u2028")
        assert "s\\x1b[2J\\u202eexe.txt" in shown


def _two_runs_the_second_unfinished(second: float = 1.0) -> list[SessionEvent]:
    """The second run starts at ``second`` (a run starts after it takes its lease)."""
    return [
        ev(1, "run/start", {"task": "one", "provider": "p", "mode": "native"}, 0.0),
        ev(2, "tool/call", {"name": "slow", "arguments": "{}"}, 0.0, "1.1"),
        ev(3, "run/start", {"task": "two", "provider": "p", "mode": "code", "resumed": True}, second),
        ev(4, "tool/call", {"name": "run_code", "arguments": "{}"}, second, "2.1"),
        ev(5, "tool/code-dispatch-start", {"name": "read", "arguments": {}}, second, "2.1", "2.1", "2.1:code:1"),
    ]


def test_show_marks_the_unfinished_run_of_a_session_in_use_as_running_not_interrupted() -> None:
    from dsh_core.sessions.lease import SessionLease

    holder = SessionLease.for_this_run()
    events = _two_runs_the_second_unfinished(holder.since + 0.5)
    lines = render_session(SessionInfo("s", 0.0, 0.0, 5, {}, holder), events).splitlines()
    assert lines[0].endswith(
        f" · in use by pid {os.getpid()} on host {holder.host!r} since "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.since))}"
    )
    assert lines[1:] == [
        "├─ run 1: one · provider p · mode native",
        "│  ├─ slow [1.1] {} — no result (interrupted)",
        "│  └─ end: none recorded (interrupted)",
        "└─ run 2 (resumed): two · provider p · mode code",
        "   ├─ run_code [2.1] {} — running",
        "   │  └─ read [#1] {} — running",
        "   └─ end: none yet (running)",
    ]
    # A holder that is gone (here: another process start time for this pid) holds nothing.
    gone = attrs.evolve(holder, started=(holder.started or 0) + 1)
    lines = render_session(SessionInfo("s", 0.0, 0.0, 5, {}, gone), events).splitlines()
    assert "in use" not in lines[0] and lines[-1] == "   └─ end: none recorded (interrupted)"
    assert lines[-2] == "   │  └─ read [#1] {} — no result (interrupted)"


def test_show_does_not_give_a_killed_run_to_the_run_that_has_just_taken_its_lease_over() -> None:
    """A resumed run holds the lease while it loads the history, before its run/start: the last run
    then is the one that was killed, and its calls are not running."""
    from dsh_core.sessions.lease import SessionLease

    holder = SessionLease.for_this_run()
    events = _two_runs_the_second_unfinished(holder.since - 60)
    lines = render_session(SessionInfo("s", 0.0, 0.0, 5, {}, holder), events).splitlines()
    assert " · in use by pid " in lines[0]
    assert lines[-3:] == [
        "   ├─ run_code [2.1] {} — no result (interrupted)",
        "   │  └─ read [#1] {} — no result (interrupted)",
        "   └─ end: none recorded (interrupted)",
    ]


def test_list_names_the_run_using_a_session_only_while_it_runs() -> None:
    from dsh_core.sessions.lease import SessionLease

    holder = SessionLease.for_this_run()
    gone = attrs.evolve(holder, started=(holder.started or 0) + 1)
    rows = render_list(
        [
            SessionInfo("a-1", 0.0, 0.0, 7, {"agent": "main", "task": "do it"}, holder),
            SessionInfo("b-2", 0.0, 0.0, 3, {"agent": "main", "task": "done"}, gone),
        ]
    ).splitlines()
    assert rows[0].split() == ["ID", "UPDATED", "EVENTS", "AGENT", "IN", "USE", "BY", "TASK"]
    assert rows[1].endswith(f"main   pid {os.getpid()} on {holder.host}  do it")
    assert rows[2].endswith(f"main   {' ' * len(f'pid {os.getpid()} on {holder.host}')}  done")
    assert render_list([SessionInfo("b-2", 0.0, 0.0, 3, {}, gone)]).splitlines()[0].split() == [
        "ID",
        "UPDATED",
        "EVENTS",
        "AGENT",
        "TASK",
    ]


def test_show_renders_arguments_nested_deeper_than_json_recurses() -> None:
    deep = "[" * 100_000 + "]" * 100_000  # what a model sent as a call's arguments, kept as sent
    events = [
        ev(1, "run/start", {"task": "t", "provider": "p", "mode": "native"}, 0.0),
        ev(2, "tool/call", {"name": "read", "arguments": deep}, 0.0, "1.1"),
        ev(3, "tool/result", {"name": "read", "ok": False, "duration_ms": 1.0}, 0.0, "1.1"),
    ]
    lines = render_session(SessionInfo("s", 0.0, 0.0, 3, {}), events).splitlines()
    assert lines[2].startswith("   ├─ read [1.1] " + "[" * 20)


def test_show_renders_messages_of_an_odd_shape_instead_of_failing() -> None:
    # A store takes any payload, and show reads every other field defensively; a message that was not
    # an object (or a tool call, or its function) failed the whole command with an AttributeError traceback.
    events = [
        ev(1, "run/start", {"task": "t", "provider": "p", "mode": "native"}, 0.0),
        ev(2, "message/user", {"message": "plain text"}, 0.0),
        ev(3, "message/assistant", {"message": "said"}, 0.0),
        ev(
            4,
            "message/assistant",
            {"message": {"content": None, "tool_calls": ["x", {"function": "f"}, {"function": {"name": "read"}}]}},
            0.0,
        ),
        ev(5, "message/assistant", {"message": {"content": "hm", "tool_calls": "not a list"}}, 0.0),
        ev(6, "message/user", {"message": None}, 0.0),
        ev(7, "run/end", {"reason": "final-answer", "turns": 1}, 0.0),
    ]
    lines = render_session(SessionInfo("s", 0.0, 0.0, 7, {}), events).splitlines()
    assert lines[2:] == [
        "   ├─ user: plain text",
        "   ├─ assistant: said",
        "   ├─ assistant → ?, ?, read",
        "   ├─ assistant: hm",
        "   ├─ user: ",
        "   └─ end: final-answer after 1 turn(s)",
    ]


def test_sessions_list_show_and_release_take_a_corrupt_lease_for_an_unreadable_one(tmp_path: Path) -> None:
    # A tampered lease record (since 1e300) made `sessions show` and `release` fail with an
    # OverflowError traceback and `list --json` print it as in use since 1e+300.
    home = Path(os.environ["DSH_HOME"])

    async def create() -> str:
        store = SqliteSessionStore.open(home)
        try:
            return (await store.create()).id
        finally:
            await store.close()

    session_id = asyncio.run(create())
    conn = sqlite3.connect(home / DB_FILENAME, isolation_level=None)
    try:
        conn.execute(
            "INSERT INTO leases (session_id, token, holder, acquired_at) VALUES (?, 'x', ?, 0)",
            (session_id, json.dumps({"token": "x", "pid": 1234, "host": "elsewhere", "since": 1e300})),
        )
    finally:
        conn.close()

    def dsh(*args: str) -> str:
        result = CliRunner().invoke(main, list(args))
        assert result.exit_code == 0 and result.exception is None, (args, result.output, result.exception)
        return result.output

    assert "IN USE BY" not in dsh("sessions", "list")
    assert [s["in_use_by"] for s in json.loads(dsh("sessions", "list", "--json"))] == [None]
    assert "in use by" not in dsh("sessions", "show", session_id)
    assert dsh("sessions", "release", session_id) == (
        f"released session {session_id} (held by a lease whose record is unreadable, so which run it was is unknown)\n"
    )


def test_sessions_release_shows_an_odd_session_id_escaped() -> None:
    # An API caller names its session; release echoes the id back, shown, not obeyed.
    odd = "s\x1b[2J\u202e"

    async def create() -> None:
        store = SqliteSessionStore.open(Path(os.environ["DSH_HOME"]))
        try:
            await store.create(session_id=odd)
        finally:
            await store.close()

    asyncio.run(create())
    result = CliRunner().invoke(main, ["sessions", "release", odd])
    assert result.exit_code == 0 and result.exception is None, (result.output, result.exception)
    assert result.output == "session s\\x1b[2J\\u202e was not held by any run\n"


def _session_of(events: list[Any], session_id: str = "s") -> None:
    from dsh_core.sessions.events import NewEvent

    async def create() -> None:
        store = SqliteSessionStore.open(Path(os.environ["DSH_HOME"]))
        try:
            await store.create(session_id=session_id)
            if events:
                await store.append(
                    session_id, [NewEvent(kind, payload, root_call_id=root) for kind, payload, root in events]
                )
        finally:
            await store.close()

    asyncio.run(create())


def test_show_json_is_json_dumps_text_of_the_events() -> None:
    _session_of(
        [
            ("run/start", {"task": "café ✓", "n": [1, {"a": None}]}, None),
            ("tool/result", {"content": "line\nbreak \x1b[2J", "ok": True}, "1.1"),
            ("run/end", {"reason": "final-answer"}, None),
        ]
    )
    _session_of([], "empty")
    shown = {}
    for session_id in ("s", "empty"):
        result = CliRunner().invoke(main, ["sessions", "show", session_id, "--json"])
        assert result.exit_code == 0, result.output
        shown[session_id] = events = json.loads(result.stdout)
        assert result.stdout == json.dumps(events, indent=2, ensure_ascii=False) + "\n"
    assert [(e["seq"], e["kind"]) for e in shown["s"]] == [(1, "run/start"), (2, "tool/result"), (3, "run/end")]
    assert shown["s"][1]["payload"]["content"] == "line\nbreak \x1b[2J" and shown["empty"] == []


def test_show_json_of_a_long_session_does_not_build_the_whole_document(tmp_path: Path) -> None:
    # The document was built whole, and its pieces before that: `show --json` of a session took
    # several times its size in memory (1 GB for 130 MB of output), more than the tree view.
    import sys
    import tracemalloc

    _session_of([("tool/result", {"content": "x" * 20_000, "n": n}, f"c{n}") for n in range(250)], "big")

    def peak(*args: str) -> tuple[int, int]:
        target = tmp_path / "out"
        saved = sys.stdout
        with target.open("w", encoding="utf-8") as out:
            sys.stdout = out
            tracemalloc.start()
            try:
                main(list(args), standalone_mode=False)
            finally:
                highest = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                sys.stdout = saved
        return highest, target.stat().st_size

    tree, _ = peak("sessions", "show", "big")  # loads the same events, and writes little
    document, size = peak("sessions", "show", "big", "--json")
    assert size > 5_000_000
    assert document < tree + size // 2, (document, tree, size)


def test_list_says_on_stderr_when_more_sessions_exist_than_it_shows() -> None:
    # `list` stopped at --limit (20 by default) and said nothing of the sessions it left out.
    for n in range(3):
        _session_of([], f"s{n}")

    def listed(*args: str) -> tuple[str, str]:
        result = CliRunner().invoke(main, ["sessions", "list", *args])
        assert result.exit_code == 0 and result.exception is None, (result.output, result.exception)
        return result.stdout, result.stderr

    note = "(showing the 2 most recently updated sessions; more exist: --limit N to see more)\n"
    table, said = listed("--limit", "2")
    assert len(table.splitlines()) == 3 and said == note  # the header and two rows: stdout as before
    documents, said = listed("--limit", "2", "--json")
    assert len(json.loads(documents)) == 2 and said == note  # stdout is still only the JSON list
    for args in (("--limit", "3"), ("--limit", "4"), ()):
        table, said = listed(*args)
        assert len(table.splitlines()) == 4 and said == ""
        documents, said = listed(*args, "--json")
        assert len(json.loads(documents)) == 3 and said == ""


def test_list_at_the_largest_limit_sqlite_takes() -> None:
    # Asking the store for limit + 1 overflowed SQLite's INTEGER at --limit 2**63 - 1 (OverflowError,
    # a traceback), which listed every session before the note; and a larger --limit did so already.
    for n in range(2):
        _session_of([], f"s{n}")
    for limit in (2**63 - 2, 2**63 - 1, 2**63, 10**30):
        result = CliRunner().invoke(main, ["sessions", "list", "--limit", str(limit), "--json"])
        assert result.exit_code == 0 and result.exception is None, (limit, result.output, result.exception)
        assert len(json.loads(result.stdout)) == 2 and result.stderr == ""


def test_read_only_commands_create_no_database() -> None:
    # `sessions list` and `show` created DSH_HOME and an empty sessions.db where none was.
    home = Path(os.environ["DSH_HOME"])

    def dsh(*args: str) -> tuple[int, str, str]:
        result = CliRunner().invoke(main, ["sessions", *args])
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        return result.exit_code, result.stdout, result.stderr

    assert dsh("list") == (0, "no sessions\n", "")
    assert dsh("list", "--json") == (0, "[]\n", "")
    unknown = (2, "", f"dsh: error: no session 'nope' in {home / DB_FILENAME}\n")
    assert dsh("show", "nope") == unknown
    assert dsh("show", "nope", "--json") == unknown
    assert dsh("release", "nope") == unknown
    assert not home.exists()
    _session_of([], "s")  # as an agent run does, the store creates it
    assert (home / DB_FILENAME).is_file()
    assert dsh("show", "nope") == unknown  # the same answer as where there is none


def test_list_json_writes_utf8_as_show_json_does_and_stays_json_on_a_narrower_stdout() -> None:
    # `list --json` wrote `caf\u00e9` where `show --json` writes `café`.
    import io
    import sys

    meta = {"agent": "main", "task": "café ✓ 😀", "odd": "caf\udce9"}  # a name that was not UTF-8, too

    async def create() -> None:
        store = SqliteSessionStore.open(Path(os.environ["DSH_HOME"]))
        try:
            await store.create(session_id="s", meta=meta)
        finally:
            await store.close()

    asyncio.run(create())
    result = CliRunner().invoke(main, ["sessions", "list", "--json"])
    assert result.exit_code == 0 and result.exception is None, (result.output, result.exception)
    (listed,) = json.loads(result.stdout)
    assert listed["meta"] == meta
    assert "café ✓ 😀" in result.stdout and "caf\\udce9" in result.stdout
    for encoding in ("ascii", "latin-1"):
        raw = io.BytesIO()
        saved = sys.stdout
        sys.stdout = out = io.TextIOWrapper(raw, encoding=encoding)
        try:
            main(["sessions", "list", "--json"], standalone_mode=False)
            out.flush()
        finally:
            sys.stdout = saved
        text = raw.getvalue().decode(encoding)
        assert [s["meta"] for s in json.loads(text)] == [meta], text
        assert ("café" in text) is (encoding == "latin-1") and "\\ud83d\\ude00" in text


def test_show_of_a_session_longer_than_a_page_shows_every_event_in_order() -> None:
    from dsh_core.sessions.store import PAGE_EVENTS

    count = 2 * PAGE_EVENTS + 7  # three pages, the last one short
    _session_of(
        [
            ("run/start", {"task": "t", "provider": "p", "mode": "native"}, None),
            *[("tool/call", {"name": "read", "arguments": str(n)}, f"c{n}") for n in range(count - 1)],
        ],
        "long",
    )
    result = CliRunner().invoke(main, ["sessions", "show", "long", "--json"])
    assert result.exit_code == 0 and result.exception is None, (result.output, result.exception)
    events = json.loads(result.stdout)
    assert result.stdout == json.dumps(events, indent=2, ensure_ascii=False) + "\n"
    assert [e["seq"] for e in events] == list(range(1, count + 1))
    assert [e["payload"].get("arguments") for e in events[1:]] == [str(n) for n in range(count - 1)]
    result = CliRunner().invoke(main, ["sessions", "show", "long"])
    assert result.exit_code == 0 and result.exception is None, (result.output, result.exception)
    lines = result.stdout.splitlines()
    assert f" · {count} events · " in lines[0] and len(lines) == 1 + 1 + (count - 1) + 1
    assert [line.split(" [")[1].split("]")[0] for line in lines[2:-1]] == [f"c{n}" for n in range(count - 1)]


def test_show_holds_a_page_of_a_long_session_not_all_of_it(tmp_path: Path) -> None:
    # `show` (the tree and --json alike) loaded every event of the session before it drew the
    # first: a session of millions of events took all of them in memory at once.
    import sys
    import tracemalloc

    _session_of([("tool/result", {"content": "x" * 20_000, "n": n}, f"c{n}") for n in range(600)], "big")
    stored = 600 * 20_000

    def peak(*args: str) -> int:
        saved = sys.stdout
        with (tmp_path / "out").open("w", encoding="utf-8") as out:
            sys.stdout = out
            tracemalloc.start()
            try:
                main(list(args), standalone_mode=False)
            finally:
                highest = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                sys.stdout = saved
        return highest

    for args in (("sessions", "show", "big"), ("sessions", "show", "big", "--json")):
        used = peak(*args)
        assert used < stored // 3, (args, used, stored)


def test_show_and_list_of_a_corrupt_row_fail_naming_it_not_with_a_traceback() -> None:
    _session_of([("run/start", {"task": "t"}, None), ("tool/call", {"name": "n"}, "1")], "a")
    conn = sqlite3.connect(Path(os.environ["DSH_HOME"]) / DB_FILENAME, isolation_level=None)
    try:
        conn.execute("UPDATE events SET payload = '{broken' WHERE session_id = 'a' AND seq = 2")
    finally:
        conn.close()
    for args in (["show", "a"], ["show", "a", "--json"]):
        result = CliRunner().invoke(main, ["sessions", *args])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
        assert result.stdout == ""
        assert (
            result.stderr.startswith("dsh: error: session store ")
            and "session 'a' event 2: payload is not JSON" in result.stderr
        ), result.stderr


def test_list_shows_a_session_it_cannot_read_as_unreadable_and_lists_the_rest() -> None:
    # A session whose meta is no JSON object stopped `dsh sessions list` (and --json) for every session.
    home = Path(os.environ["DSH_HOME"])

    async def create() -> None:
        store = SqliteSessionStore.open(home)
        try:
            for session_id in ("a", "b", "c"):
                await store.create(session_id=session_id, meta={"agent": "main", "task": f"task {session_id}"})
        finally:
            await store.close()

    asyncio.run(create())
    conn = sqlite3.connect(home / DB_FILENAME, isolation_level=None)
    try:
        conn.execute("UPDATE sessions SET meta = '[1]' WHERE id = 'b'")
        conn.execute("UPDATE sessions SET updated_at = CASE id WHEN 'a' THEN 3 WHEN 'b' THEN 2 ELSE 1 END")
    finally:
        conn.close()

    def dsh(*args: str) -> str:
        result = CliRunner().invoke(main, ["sessions", *args])
        assert result.exit_code == 0 and result.exception is None, (args, result.output, result.exception)
        assert result.stderr == "", result.stderr
        return result.stdout

    rows = dsh("list").splitlines()
    assert [row.split()[0] for row in rows] == ["ID", "a", "b", "c"]
    assert rows[1].endswith("main   task a") and rows[3].endswith("main   task c")
    assert rows[2].endswith("?      (unreadable: meta is not a JSON object: '[1]')"), rows[2]
    listed = json.loads(dsh("list", "--json"))
    keys = ["id", "created_at", "updated_at", "event_count", "meta", "in_use_by", "unreadable"]
    assert [list(s) for s in listed] == [keys] * 3
    assert [(s["id"], s["meta"], s["unreadable"]) for s in listed] == [
        ("a", {"agent": "main", "task": "task a"}, None),
        ("b", None, "meta is not a JSON object: '[1]'"),
        ("c", {"agent": "main", "task": "task c"}, None),
    ]
    result = CliRunner().invoke(main, ["sessions", "show", "b"])  # what cannot be read is not shown
    assert result.exit_code == 1 and "session 'b': meta is not a JSON object: '[1]'" in result.stderr


def test_list_shows_a_session_whose_row_has_a_column_of_the_wrong_type_as_unreadable() -> None:
    # An updated_at or event_count edited to text made `dsh sessions list` fail with a TypeError
    # traceback (and --json print it as it was); a non-text id the same. `show` printed such a session.
    home = Path(os.environ["DSH_HOME"])

    async def create() -> None:
        store = SqliteSessionStore.open(home)
        try:
            for session_id in ("a", "b", "c", "d"):
                await store.create(session_id=session_id, meta={"agent": "main", "task": f"task {session_id}"})
        finally:
            await store.close()

    asyncio.run(create())
    conn = sqlite3.connect(home / DB_FILENAME, isolation_level=None)
    try:
        conn.execute(
            "UPDATE sessions SET updated_at = CASE id WHEN 'a' THEN 4 WHEN 'b' THEN 3 WHEN 'c' THEN 2 ELSE 1 END"
        )
        conn.execute("UPDATE sessions SET created_at = 'soon', event_count = 'many' WHERE id = 'b'")
        conn.execute("UPDATE sessions SET id = x'64' WHERE id = 'd'")
    finally:
        conn.close()

    def dsh(*args: str) -> str:
        result = CliRunner().invoke(main, ["sessions", *args])
        assert result.exit_code == 0 and result.exception is None, (args, result.output, result.exception)
        assert result.stderr == "", result.stderr
        return result.stdout

    rows = dsh("list").splitlines()
    assert [row.split()[0] for row in rows] == ["ID", "a", "b", "c", "?"]
    assert rows[1].endswith("main   task a") and rows[3].endswith("main   task c")
    assert rows[2].split()[3:5] == ["?", "?"], rows[2]  # its event count and agent: unknown
    assert rows[2].endswith("(unreadable: created_at is not a time: 'soon'; event_count is not an integer: 'many')"), (
        rows[2]
    )
    assert rows[4].endswith("0       ?      (unreadable: id is not text: b'd')"), rows[4]
    listed = json.loads(dsh("list", "--json"))
    keys = ["id", "created_at", "updated_at", "event_count", "meta", "in_use_by", "unreadable"]
    assert [list(s) for s in listed] == [keys] * 4
    assert [(s["id"], s["updated_at"], s["event_count"], s["meta"]) for s in listed] == [
        ("a", 4, 0, {"agent": "main", "task": "task a"}),
        ("b", 3, None, None),
        ("c", 2, 0, {"agent": "main", "task": "task c"}),
        (None, 1, 0, None),
    ]
    assert listed[1]["created_at"] is None and all(isinstance(listed[i]["created_at"], float) for i in (0, 2, 3))
    assert [s["unreadable"] for s in listed] == [
        None,
        "created_at is not a time: 'soon'; event_count is not an integer: 'many'",
        None,
        "id is not text: b'd'",
    ]
    for args in (["show", "b"], ["show", "b", "--json"]):
        result = CliRunner().invoke(main, ["sessions", *args])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
        assert result.stdout == ""
        assert result.stderr.startswith("dsh: error: session store ") and result.stderr.endswith(
            ": session 'b': created_at is not a time: 'soon'; event_count is not an integer: 'many'\n"
        ), result.stderr


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("kind = x'00'", "kind is not text: b'\\x00'"),
        ("at = 'noon'", "at is not a time: 'noon'"),
        ("sub_call_id = x'01'", "sub_call_id is not text: b'\\x01'"),
        ("root_call_id = NULL, parent_call_id = 1.5e300", None),  # TEXT columns: SQLite stores the number as text
    ],
)
def test_show_of_an_event_whose_column_has_the_wrong_type_fails_naming_it(change: str, reason: str | None) -> None:
    # A BLOB kind or call id made `show --json` fail with a TypeError traceback (bytes are no JSON),
    # and an `at` of text was written out as a string, where every other event has a number.
    _session_of([("run/start", {"task": "t"}, None), ("tool/call", {"name": "n"}, "1")], "a")
    conn = sqlite3.connect(Path(os.environ["DSH_HOME"]) / DB_FILENAME, isolation_level=None)
    try:
        conn.execute(f"UPDATE events SET {change} WHERE session_id = 'a' AND seq = 2")
    finally:
        conn.close()
    for args in (["show", "a"], ["show", "a", "--json"]):
        result = CliRunner().invoke(main, ["sessions", *args])
        if reason is None:
            assert result.exit_code == 0 and result.exception is None, (result.output, result.exception)
            continue
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
        assert result.stdout == ""
        assert result.stderr.startswith("dsh: error: session store ") and result.stderr.endswith(
            f": session 'a' event 2: {reason}\n"
        ), result.stderr


@pytest.mark.parametrize("command", [["show"], ["show", "--json"], ["release"]])
def test_a_session_id_that_is_not_utf8_is_an_unknown_session_not_a_traceback(command: list[str]) -> None:
    # A command-line argument that is not UTF-8 reaches dsh as lone surrogates (surrogateescape),
    # which SQLite cannot be asked for: `show` and `release` died with a UnicodeEncodeError traceback.
    _session_of([("run/start", {"task": "t"}, None)], "a")
    result = CliRunner().invoke(main, ["sessions", command[0], "a\udcff", *command[1:]])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    assert result.stdout == ""
    assert result.stderr.startswith("dsh: error: no session 'a\\udcff' in "), result.stderr


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_stored_number_json_has_not_is_named_not_written_out_as_invalid_json(number: str) -> None:
    # Python's json reads NaN, Infinity and 1e400 (as inf), which no JSON holds; a meta or payload
    # edited to hold one was written out by `list --json` and `show --json` as `NaN` or `Infinity`:
    # output that a JSON parser refuses. dsh itself never stores them (encode_payload refuses them).
    home = Path(os.environ["DSH_HOME"])
    _session_of([("message/user", {"message": {"role": "user", "content": "x"}}, None)], "a")
    _session_of([], "b")
    conn = sqlite3.connect(home / DB_FILENAME, isolation_level=None)
    try:
        conn.execute(f"UPDATE sessions SET meta = '{{\"task\": {number}}}' WHERE id = 'b'")
        conn.execute(f"UPDATE events SET payload = '{{\"content\": {number}}}' WHERE session_id = 'a'")
    finally:
        conn.close()

    def refuse(constant: str) -> object:
        raise AssertionError(f"{constant} is no JSON")

    result = CliRunner().invoke(main, ["sessions", "list", "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    listed = {s["id"]: s for s in json.loads(result.stdout, parse_constant=refuse)}
    assert listed["b"]["meta"] is None, listed["b"]
    assert listed["b"]["unreadable"].startswith("meta is not a JSON object: "), listed["b"]
    assert listed["a"]["unreadable"] is None
    for args in (["show", "a"], ["show", "a", "--json"]):
        result = CliRunner().invoke(main, ["sessions", *args])
        assert result.exit_code == 1 and result.stdout == "", (result.output, result.exception)
        assert "session 'a' event 1: payload is not JSON: " in result.stderr, result.stderr


@pytest.mark.parametrize("as_json", [False, True])
def test_show_shows_the_session_as_it_was_when_its_count_was_read(
    monkeypatch: pytest.MonkeyPatch, as_json: bool
) -> None:
    # The header's count (read with the session's record) and the events (read a page at a time after
    # it) came from separate statements: an append between them, by a run still recording the session,
    # made the header say 2 events over a tree of 3.
    from dsh_core.sessions.events import NewEvent

    _session_of(
        [
            ("run/start", {"task": "t", "provider": "p", "mode": "native"}, None),
            ("message/user", {"message": {"role": "user", "content": "early"}}, None),
        ],
        "a",
    )
    read_page = SqliteSessionStore.load_page
    appended = []

    async def load_page(self: SqliteSessionStore, session_id: str, **options: Any) -> list[SessionEvent]:
        if not appended:  # a writer's commit between the record's read and the first page's
            appended.extend(
                await self.append(
                    session_id, [NewEvent("message/user", {"message": {"role": "user", "content": "late"}})]
                )
            )
        return await read_page(self, session_id, **options)

    monkeypatch.setattr(SqliteSessionStore, "load_page", load_page)
    args = ["sessions", "show", "a", *(["--json"] if as_json else [])]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and result.exception is None, (result.output, result.exception)
    assert [event.seq for event in appended] == [3]
    if as_json:
        assert [event["seq"] for event in json.loads(result.stdout)] == [1, 2]
    else:
        lines = result.stdout.splitlines()
        assert " · 2 events · " in lines[0] and "late" not in result.stdout, result.stdout
        assert lines[1:] == [
            "└─ run 1: t · provider p · mode native",
            "   ├─ user: early",
            "   └─ end: none recorded (interrupted)",
        ]
    monkeypatch.setattr(SqliteSessionStore, "load_page", read_page)
    result = CliRunner().invoke(main, args)  # the next show has it
    assert result.exit_code == 0 and "late" in result.stdout, (result.output, result.exception)


def test_show_json_that_fails_part_way_writes_no_part_of_the_document() -> None:
    # The document was written as it was read: an event that could not be read in a later page
    # left the events before it on stdout, a JSON list cut off mid-way, under the error.
    _session_of([("tool/result", {"content": "x" * 20_000, "n": n}, f"c{n}") for n in range(100)], "a")
    conn = sqlite3.connect(Path(os.environ["DSH_HOME"]) / DB_FILENAME, isolation_level=None)
    try:
        conn.execute("UPDATE events SET payload = '{broken' WHERE session_id = 'a' AND seq = 90")
    finally:
        conn.close()
    result = CliRunner().invoke(main, ["sessions", "show", "a", "--json"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    assert (
        result.stderr.startswith("dsh: error: session store ")
        and "session 'a' event 90: payload is not JSON" in result.stderr
    ), result.stderr
    assert result.stdout == "", result.stdout[:200]


def test_show_json_that_cannot_spool_its_document_says_where_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    _session_of([("tool/result", {"content": "x" * 20_000, "n": n}, f"c{n}") for n in range(10)], "a")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    result = CliRunner().invoke(main, ["sessions", "show", "a", "--json"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    assert result.stdout == ""
    assert result.stderr == (
        f"dsh: error: cannot show session 'a' as JSON: cannot spool it to a temporary file in "
        f"{str(tmp_path / 'gone')!r} (TMPDIR): No such file or directory\n"
    ), result.stderr


def _three_events_counted_as(count: int) -> None:
    """Session ``a`` of three stored events whose record counts ``count`` (a crash mid-write, a foreign writer)."""
    _session_of(
        [
            ("run/start", {"task": "t", "provider": "p", "mode": "native"}, None),
            ("message/user", {"message": {"role": "user", "content": "early"}}, None),
            ("message/user", {"message": {"role": "user", "content": "late"}}, None),
        ],
        "a",
    )
    conn = sqlite3.connect(Path(os.environ["DSH_HOME"]) / DB_FILENAME, isolation_level=None)
    try:
        conn.execute("UPDATE sessions SET event_count = ? WHERE id = 'a'", (count,))
    finally:
        conn.close()


@pytest.mark.parametrize("count", [1, 7])
def test_show_shows_every_stored_event_and_warns_on_stderr_when_the_record_counts_otherwise(count: int) -> None:
    # show read as many events as the session's record counted: a record counting fewer than are
    # stored (a foreign writer, a crash mid-write) hid the rest, silently.
    _three_events_counted_as(count)
    warning = f"dsh: warning: session 'a': its record counts {count} events, but 3 are stored; showing the 3 stored\n"
    result = CliRunner().invoke(main, ["sessions", "show", "a"])
    assert result.exit_code == 0 and result.exception is None, (result.output, result.exception)
    assert result.stderr == warning
    lines = result.stdout.splitlines()
    assert " · 3 events · " in lines[0], lines[0]
    assert lines[1:] == [
        "└─ run 1: t · provider p · mode native",
        "   ├─ user: early",
        "   ├─ user: late",
        "   └─ end: none recorded (interrupted)",
    ]
    result = CliRunner().invoke(main, ["sessions", "show", "a", "--json"])
    assert result.exit_code == 0 and result.exception is None, (result.output, result.exception)
    assert result.stderr == warning
    assert [event["seq"] for event in json.loads(result.stdout)] == [1, 2, 3]


def test_show_of_a_session_whose_record_counts_its_events_right_warns_of_nothing() -> None:
    _three_events_counted_as(3)
    for args in (["sessions", "show", "a"], ["sessions", "show", "a", "--json"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0 and result.exception is None, (result.output, result.exception)
        assert result.stderr == "" and "early" in result.stdout and "late" in result.stdout


def _wide_and_deep_session(runs: int = 3, calls: int = 40) -> tuple[list[SessionEvent], list[str]]:
    """Events filling every level of the tree (runs, calls, nested calls and approvals), and the tree's lines.

    The lines are written out here as the tree is specified (the module docstring), not drawn by the renderer.
    """
    events: list[SessionEvent] = []

    def add(kind: str, payload: dict[str, Any], root: str | None = None, sub: str | None = None) -> None:
        events.append(ev(len(events) + 1, kind, payload, float(len(events)), root, root if sub else None, sub))

    lines = [f"├─ run {run}: task {run} · provider p · mode code" for run in range(1, runs)]
    lines.append(f"└─ run {runs}: task {runs} · provider p · mode code")
    expected: list[str] = []
    for run in range(1, runs + 1):
        last_run = run == runs
        outer = "   " if last_run else "│  "
        expected.append(lines[run - 1])
        add("run/start", {"task": f"task {run}", "provider": "p", "mode": "code"})
        for call in range(calls):
            root = f"{run}.{call}"
            add("tool/call", {"name": "run_code", "arguments": "{}"}, root)
            nested = []
            for sub in range(call % 4):  # none, one, two or three nested calls
                add("tool/code-dispatch-start", {"name": "read", "arguments": {"n": sub}}, root, f"{root}:code:{sub}")
                if call % 5 == 0 and sub == 1:  # one never settles
                    nested.append(f'read [#{sub}] {{"n": {sub}}} — no result (interrupted)')
                    continue
                add(
                    "tool/code-dispatch",
                    {"name": "read", "is_error": sub == 2, "error_code": "DENIED", "duration_ms": sub + 0.25},
                    root,
                    f"{root}:code:{sub}",
                )
                outcome = "DENIED" if sub == 2 else "ok"
                nested.append(f'read [#{sub}] {{"n": {sub}}} — {outcome} · {sub + 0.25:.1f} ms')
            if call % 7 == 3:
                add("approval", {"name": "write", "outcome": "approved"}, root)
                nested.append("approval for write: approved")
            if call == calls - 1 and last_run:  # the last call of the last run has no result
                label = f"run_code [{root}] {{}} — no result (interrupted)"
            else:
                add("tool/result", {"name": "run_code", "ok": True, "duration_ms": call * 1.5}, root)
                label = f"run_code [{root}] {{}} — ok · {call * 1.5:.1f} ms"
            expected.append(f"{outer}├─ {label}")
            for index, text in enumerate(nested):
                expected.append(f"{outer}│  {'└─ ' if index == len(nested) - 1 else '├─ '}{text}")
        if last_run:
            expected.append(f"{outer}└─ end: none recorded (interrupted)")
        else:
            add("run/end", {"reason": "final-answer", "turns": call})
            expected.append(f"{outer}└─ end: final-answer after {call} turn(s)")
    return events, expected


def test_show_draws_a_wide_tree_with_every_level_of_nesting_line_for_line() -> None:
    events, expected = _wide_and_deep_session()
    text = render_session(SessionInfo("s1", 0.0, 1.0, len(events), {"agent": "main"}), events)
    lines = text.splitlines()
    assert lines[0].startswith(f"session s1 · agent main · {len(events)} events · created ")
    assert lines[1:] == expected
    # The command draws the same tree of the same events stored, line for line, and nothing more.
    from dsh_core.sessions.events import NewEvent

    async def store() -> None:
        sessions = SqliteSessionStore.open(Path(os.environ["DSH_HOME"]))
        try:
            await sessions.create(session_id="s1", meta={"agent": "main"})
            await sessions.append(
                "s1", [NewEvent(e.kind, e.payload, e.root_call_id, e.parent_call_id, e.sub_call_id) for e in events]
            )
        finally:
            await sessions.close()

    asyncio.run(store())
    result = CliRunner().invoke(main, ["sessions", "show", "s1"])
    assert result.exit_code == 0 and result.exception is None, (result.output, result.exception)
    assert result.stdout.endswith("\n") and result.stdout.splitlines()[1:] == expected and result.stderr == ""


#: Wraps sqlite3.connect in a child process so that a connection to SQLite's private temporary database
#: (``""``) can hold at most a few pages: its writes then fail as they would on a full temporary directory.
_FULL_TEMPORARY_DATABASE = """
import sqlite3, sys
real = sqlite3.connect
def connect(database, *args, **options):
    conn = real(database, *args, **options)
    if database == "":
        conn.execute("PRAGMA max_page_count=3")
    return conn
sqlite3.connect = connect
from dsh_core.cli import main
main(sys.argv[1:], prog_name="dsh")
"""


def _dsh_show(
    tmpdir: Path,
    session_id: str,
    *,
    python: tuple[str, ...] = ("-m", "dsh_core"),
) -> subprocess.Popen[bytes]:
    """``dsh sessions show SESSION_ID`` in a child whose temporary directory (TMPDIR) is ``tmpdir``."""
    environ = {k: v for k, v in os.environ.items() if k != "SQLITE_TMPDIR"}
    environ["TMPDIR"] = str(tmpdir)
    return subprocess.Popen(
        [sys.executable, *python, "sessions", "show", session_id],
        env=environ,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _open_files_in(pid: int, directory: Path) -> list[str]:
    """What the files process ``pid`` has open in ``directory`` are (``… (deleted)`` once unlinked)."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith(str(directory) + os.sep):
            found.append(target)
    return found


@pytest.mark.parametrize("ending", ["whole", "error part-way", "SIGTERM", "SIGKILL"])
def test_show_leaves_nothing_in_its_temporary_directory_however_it_ends(tmp_path: Path, ending: str) -> None:
    # show drew its tree in $TMPDIR/dsh-show-*/tree.db (the session's text) and removed it when it was
    # done: a show killed while it printed (SIGTERM, SIGHUP, SIGKILL) left it there. The tree is now in
    # SQLite's private temporary database, whose file is unlinked as soon as it is opened.
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    signalled = ending.startswith("SIG")
    calls = 20_000 if signalled else 50  # a tree larger than SQLite's cache: its file is written
    _session_of(
        [
            ("run/start", {"task": "t", "provider": "p", "mode": "native"}, None),
            *[("tool/call", {"name": "read", "arguments": str(n)}, f"c{n}") for n in range(calls)],
        ],
        "a",
    )
    if ending == "error part-way":  # the tree drawn up to event 40 when event 41 cannot be read
        conn = sqlite3.connect(Path(os.environ["DSH_HOME"]) / DB_FILENAME, isolation_level=None)
        try:
            conn.execute("UPDATE events SET payload = '{broken' WHERE session_id = 'a' AND seq = 41")
        finally:
            conn.close()
    child = _dsh_show(tmpdir, "a")
    try:
        assert child.stdout is not None
        if signalled:
            # Printing, and blocked on a pipe no one reads after these bytes: the tree is drawn.
            assert len(child.stdout.read(100)) == 100
            assert all(name.endswith(" (deleted)") for name in _open_files_in(child.pid, tmpdir))
            child.send_signal(getattr(signal, ending))
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if ending == "whole":
        assert child.returncode == 0 and len(out.splitlines()) == 53 and err == b"", err
    elif ending == "error part-way":
        assert child.returncode == 1 and out == b"" and b"session 'a' event 41: payload is not JSON" in err, err
    else:
        assert child.returncode == -getattr(signal, ending), err
    assert list(tmpdir.iterdir()) == []


def test_a_renderer_left_part_way_is_closed() -> None:
    from dsh_core.sessions.cli import SessionRenderer

    events, _ = _wide_and_deep_session(runs=1, calls=5)
    with pytest.raises(RuntimeError, match=r"^stop$"), SessionRenderer(SessionInfo("s", 0.0, 0.0, 1, {})) as renderer:
        for event in events:
            renderer.add(event)
        lines = renderer.lines()
        assert next(lines).startswith("session s · ")
        raise RuntimeError("stop")
    with pytest.raises(DshError, match=r"^cannot show session 's': its renderer was closed$"):
        renderer.add(events[0])


def test_show_whose_temporary_database_cannot_be_written_names_tmpdir_and_writes_nothing(tmp_path: Path) -> None:
    # A full temporary directory fails the tree's first write out of SQLite's cache, not its opening.
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    _session_of(
        [
            ("run/start", {"task": "t", "provider": "p", "mode": "native"}, None),
            *[("tool/call", {"name": "read", "arguments": str(n)}, f"c{n}") for n in range(5000)],
        ],
        "a",
    )
    child = _dsh_show(tmpdir, "a", python=("-c", _FULL_TEMPORARY_DATABASE))
    out, err = child.communicate(timeout=120)
    assert (child.returncode, out) == (1, b""), err
    assert err.decode() == (
        f"dsh: error: cannot show session 'a': cannot draw its tree in a temporary database in "
        f"{str(tmpdir)!r} (SQLite's temporary directory: TMPDIR, or SQLITE_TMPDIR if set): "
        "OperationalError: database or disk is full\n"
    )
    assert list(tmpdir.iterdir()) == []


@pytest.mark.parametrize("buffered", [1, 2, 3, None])
def test_show_draws_the_same_tree_whatever_it_holds_in_memory_before_writing_it_out(
    monkeypatch: pytest.MonkeyPatch, buffered: int | None
) -> None:
    # The renderer holds a few lines and calls before it writes them to its database: a call of an id
    # drawn again, a result of a call written out already, a lone surrogate (a name that was not
    # UTF-8) come out of the database as they went in.
    import dsh_core.sessions.cli

    if buffered is not None:
        monkeypatch.setattr(dsh_core.sessions.cli, "_BUFFERED", buffered)
    nested = ("1.1", "1.1", "1.1:code:1")
    events = [
        ev(1, "run/start", {"task": "t", "provider": "p", "mode": "code"}, 0.0),
        ev(2, "tool/call", {"name": "a", "arguments": "{}"}, 0.0, "1.1"),
        ev(3, "tool/code-dispatch-start", {"name": "read", "arguments": {}}, 0.0, *nested),
        ev(4, "tool/call", {"name": "b", "arguments": "{}"}, 0.0, "1.1"),  # the same id again: it replaces a
        ev(5, "tool/code-dispatch-start", {"name": "read", "arguments": {}}, 0.5, *nested),
        ev(6, "tool/result", {"name": "b", "ok": True, "duration_ms": 1.0}, 1.0, "1.1"),
        ev(7, "tool/code-dispatch", {"name": "read", "ok": True}, 2.5, *nested),
        ev(8, "tool/code-dispatch-start", {"name": "write", "arguments": {}}, 3, None, None, "x"),
        ev(9, "tool/code-dispatch-start", {"name": "write", "arguments": {}}, 3, "", None, "x"),
        ev(10, "tool/code-dispatch", {"name": "write", "ok": True}, 4, "", None, "x"),
        ev(11, "tool/result", {"name": "c", "ok": True}, 4, "9.9"),
        ev(12, "tool/call", {"name": "n\udcff", "arguments": "{}"}, 5, "r\udcff"),
        ev(
            13, "tool/code-dispatch-start", {"name": "read", "arguments": {}}, 5, "r\udcff", "r\udcff", "r\udcff:code:1"
        ),
        ev(14, "tool/result", {"name": "n\udcff", "ok": True, "duration_ms": 3.0}, 6, "r\udcff"),
        ev(15, "tool/call", {"name": "d", "arguments": "{}"}, 7, "1.2"),
    ]
    assert render_session(SessionInfo("s", 0.0, 0.0, len(events), {}), events).splitlines()[1:] == [
        "└─ run 1: t · provider p · mode code",
        "   ├─ a [1.1] {}",
        "   │  └─ read [#1] {}",
        "   ├─ b [1.1] {} — ok · 1.0 ms",
        "   │  └─ read [#1] {} — ok · 2000.0 ms",
        "   ├─ write [sub x] {} — no result (interrupted)",
        "   ├─ write [sub x] {} — ok · 1000.0 ms",
        "   ├─ c [9.9] — ok · ? ms",
        "   ├─ n\udcff [r\udcff] {} — ok · 3.0 ms",
        "   │  └─ read [#1] {} — no result (interrupted)",
        "   ├─ d [1.2] {} — no result (interrupted)",
        "   └─ end: none recorded (interrupted)",
    ]
    events, expected = _wide_and_deep_session(runs=2, calls=12)
    assert render_session(SessionInfo("s", 0.0, 0.0, len(events), {}), events).splitlines()[1:] == expected


def test_show_closes_its_renderer_when_closing_the_store_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tree was drawn, then the store's close (or the harness's) raised: the renderer, returned
    # by the work that drew it, was never handed to the caller, and its database never closed.
    from dsh_core.sessions.store import SessionStoreError

    _session_of([("run/start", {"task": "t", "provider": "p", "mode": "native"}, None)], "a")
    real_connect, real_close = sqlite3.connect, SqliteSessionStore.close
    trees: list[sqlite3.Connection] = []

    def connect(database: Any, *args: Any, **options: Any) -> sqlite3.Connection:
        conn = real_connect(database, *args, **options)
        if database == "":
            trees.append(conn)
        return conn

    async def close(self: SqliteSessionStore) -> None:
        await real_close(self)
        raise SessionStoreError("the store failed to close")

    monkeypatch.setattr(sqlite3, "connect", connect)
    monkeypatch.setattr(SqliteSessionStore, "close", close)
    result = CliRunner().invoke(main, ["sessions", "show", "a"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    assert (result.stdout, result.stderr) == ("", "dsh: error: the store failed to close\n")
    (tree,) = trees
    with pytest.raises(sqlite3.ProgrammingError, match="closed database"):
        tree.execute("SELECT 1")


def test_the_renderers_public_names_are_those_that_draw() -> None:
    # Node, an in-memory tree the renderer no longer draws with (it draws from SQLite's temporary
    # database), was still exported: a public name nothing used, kept as if it were a contract.
    import dsh_core.sessions.cli as sessions_cli

    assert "Node" not in sessions_cli.__all__
    assert all(callable(getattr(sessions_cli, name)) for name in sessions_cli.__all__)
    assert not hasattr(sessions_cli, "Node")
