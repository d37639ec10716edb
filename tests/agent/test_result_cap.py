"""What one tool result puts into the conversation is capped (``max_tool_result_chars``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from agent_kit import ToolsPlugin, call, calls, final, scripted, start, tool, write_script

from dsh_core.agent.loop import run_agent
from dsh_core.agent.resultcap import DEFAULT_MAX_TOOL_RESULT_CHARS, cap_call_texts, cap_tool_text, shares
from dsh_core.boot import start_harness
from dsh_core.config import compose
from dsh_core.model import ContextMessage
from dsh_core.plugins import PluginCatalog
from dsh_core.sessions.sqlite import SqliteSessionStore

pytestmark = pytest.mark.anyio

MARKER = re.compile(
    r"\[\.\.\. ([\d,]+) characters left out of this tool result \(max_tool_result_chars = (\d+)\); "
    r"ask for less, e.g\. a narrower query, a range or a limit \.\.\.\]"
)


def left_out(text: str) -> int:
    found = MARKER.search(text)
    assert found is not None, text[-300:]
    return int(found.group(1).replace(",", ""))


# -- the cut itself -----------------------------------------------------------------------------------------


def test_a_huge_text_keeps_its_head_and_tail_around_a_marker_within_the_cap() -> None:
    text = "".join(f"line {n}\n" for n in range(300_000))  # ≈3.4 M characters
    capped = cap_tool_text(text, 10_000)
    assert len(capped.text) <= 10_000
    head, _, rest = capped.text.partition("\n\n[...")
    marker, _, tail = rest.partition("...]\n\n")
    assert len(head) > 4_000 and len(tail) > 4_000  # both ends are kept, not just the head
    assert text.startswith(head) and text.endswith(tail) and tail.endswith("line 299999\n")
    assert capped.left_out == left_out(capped.text) == len(text) - len(head) - len(tail)
    assert f"{capped.left_out:,} characters" in marker and "max_tool_result_chars = 10000" in marker


@pytest.mark.parametrize("size", [1, 9_999, 10_000])
def test_a_text_up_to_the_cap_is_untouched(size: int) -> None:
    text = "é" * size
    capped = cap_tool_text(text, 10_000)
    assert capped.text is text and capped.left_out == 0


def test_one_character_over_the_cap_is_cut() -> None:
    capped = cap_tool_text("a" * 10_001, 10_000)
    assert capped.left_out > 0 and len(capped.text) <= 10_000 and "[..." in capped.text


@pytest.mark.parametrize("limit", range(150, 420))
def test_the_cut_fits_every_cap_exactly_and_reports_what_it_left_out(limit: int) -> None:
    text = "0123456789" * 1_000
    capped = cap_tool_text(text, limit)
    assert len(capped.text) <= limit
    marker = MARKER.search(capped.text)
    assert marker is not None and left_out(capped.text) == capped.left_out
    kept = len(capped.text) - len(marker.group(0)) - 4
    assert kept + capped.left_out == len(text)
    assert limit - len(capped.text) <= 2  # the cap is used, not wasted (a digit or a comma of slack)


@pytest.mark.parametrize("limit", [1, 5, 40, 100])
def test_a_cap_too_small_for_the_marker_still_holds(limit: int) -> None:
    capped = cap_tool_text("x" * 1_000, limit)
    assert 0 < len(capped.text) <= limit and capped.left_out >= 1_000 - limit


@pytest.mark.parametrize(
    "unit",
    [
        "\U0001f600",  # one code point
        "\ud83d\ude00",  # a surrogate pair held as two code points (JSON text decoded by a plugin)
        "e\u0301",  # a combining accent
        "\U0001f469\u200d\U0001f4bb",  # a ZWJ sequence
        "\U0001f44d\U0001f3fd",  # an emoji with a skin-tone modifier
        "\U0001f1eb\U0001f1f7",  # a flag: two regional indicators
        "\r\n",
        "\u2764\ufe0f",  # a variation selector
    ],
)
@pytest.mark.parametrize("limit", [997, 1_000, 1_001, 1_002, 1_003])
def test_the_cut_never_splits_a_surrogate_pair_or_a_grapheme(unit: str, limit: int) -> None:
    text = unit * 2_000
    capped = cap_tool_text(text, limit)
    assert len(capped.text) <= limit
    head, _, rest = capped.text.partition("\n\n[...")
    tail = rest.partition("...]\n\n")[2]
    assert head and tail
    assert len(head) % len(unit) == 0 and head == unit * (len(head) // len(unit))
    assert len(tail) % len(unit) == 0 and tail == unit * (len(tail) // len(unit))
    assert capped.left_out == len(text) - len(head) - len(tail)


def test_endless_marks_or_lone_surrogates_are_cut_a_bounded_distance_from_the_middle() -> None:
    """A grapheme never ends in "Zalgo" text: the cut moves a bounded distance, then cuts between marks."""
    for text in ("\u0301" * 50_000, "\udc00" * 50_000, "\u200d" * 50_000, "\U0001f1eb" * 50_001):
        capped = cap_tool_text(text, 1_000)
        head, _, rest = capped.text.partition("\n\n[...")
        tail = rest.partition("...]\n\n")[2]
        assert len(capped.text) <= 1_000 and capped.left_out == len(text) - len(head) - len(tail)
        assert len(head) > 300 and len(tail) > 300


def test_the_default_is_about_25k_tokens() -> None:
    assert DEFAULT_MAX_TOOL_RESULT_CHARS == 100_000


# -- the agent loop ------------------------------------------------------------------------------------------


async def events_of(harness: Any, session_id: str) -> list[Any]:
    store = SqliteSessionStore(Path(harness.deployment.sessions.home) / "sessions.db")
    try:
        return await store.load(session_id)
    finally:
        await store.close()


def verbose(size: int) -> Any:
    async def body(args: Any, ctx: Any) -> Any:
        return "".join(f"{n:07d}\n" for n in range(size // 8)) + "z" * (size % 8)

    return body


async def test_a_huge_result_reaches_the_model_cut_and_the_session_keeps_it_whole(tmp_path: Path) -> None:
    turns = [
        calls(call("dump", {}, "c1")),
        final("ok", expect={"last_role": "tool", "last_content_contains": "left out of this tool result"}),
    ]
    harness = await start(
        tmp_path, tools=[tool("dump", verbose(2_000_000))], turns=turns, agent={"max_tool_result_chars": 5_000}
    )
    try:
        result = await run_agent(harness, "dump it")
        assert result.ok, result.error
        sent = scripted(harness).requests[-1]["messages"][-1]
        assert sent["role"] == "tool" and sent["tool_call_id"] == "c1"
        assert len(sent["content"]) <= 5_000 and sent["content"].startswith("0000000\n0000001\n")
        assert sent["content"].endswith("0249999\n")
        assert left_out(sent["content"]) > 1_990_000
        assert result.messages[2] == sent
        assert result.session_id is not None
        [event] = [e for e in await events_of(harness, result.session_id) if e.kind == "tool/result"]
        assert len(event.payload["content"]) == 2_000_000  # the durable record keeps the whole result
        assert event.payload["message"] == sent  # and what the model saw
        assert event.payload["cut"] == {
            "chars": 2_000_000,
            "left_out": left_out(sent["content"]),
            "max_tool_result_chars": 5_000,
        }
    finally:
        await harness.aclose()


async def test_a_result_exactly_at_the_cap_is_untouched_and_records_no_cut(tmp_path: Path) -> None:
    turns = [calls(call("dump", {}, "c1")), final("ok")]
    harness = await start(
        tmp_path, tools=[tool("dump", verbose(4_000))], turns=turns, agent={"max_tool_result_chars": 4_000}
    )
    try:
        result = await run_agent(harness, "dump it")
        sent = scripted(harness).requests[-1]["messages"][-1]["content"]
        assert len(sent) == 4_000 and "[..." not in sent
        assert result.session_id is not None
        [event] = [e for e in await events_of(harness, result.session_id) if e.kind == "tool/result"]
        assert "cut" not in event.payload and event.payload["content"] == sent
    finally:
        await harness.aclose()


async def test_the_default_cap_applies_when_the_row_sets_none(tmp_path: Path) -> None:
    turns = [calls(call("dump", {}, "c1")), final("ok")]
    harness = await start(tmp_path, tools=[tool("dump", verbose(300_000))], turns=turns)
    try:
        await run_agent(harness, "dump it")
        sent = scripted(harness).requests[-1]["messages"][-1]["content"]
        assert len(sent) <= DEFAULT_MAX_TOOL_RESULT_CHARS and "max_tool_result_chars = 100000" in sent
    finally:
        await harness.aclose()


async def test_a_failed_result_is_cut_too(tmp_path: Path) -> None:
    async def failing(args: Any, ctx: Any) -> Any:
        raise RuntimeError("boom " + "x" * 50_000)

    harness = await start(
        tmp_path,
        tools=[tool("fail", failing)],
        turns=[calls(call("fail", {}, "c1")), final("ok")],
        agent={"max_tool_result_chars": 2_000},
    )
    try:
        await run_agent(harness, "fail")
        sent = scripted(harness).requests[-1]["messages"][-1]["content"]
        assert len(sent) <= 2_000 and sent.startswith("Error: ") and left_out(sent) > 0
    finally:
        await harness.aclose()


async def test_a_resumed_session_replays_exactly_the_cut_text(tmp_path: Path) -> None:
    turns = [
        calls(call("dump", {}, "c1")),
        final("first"),
        final("second", expect={"last_content_contains": "and now?"}),
    ]
    harness = await start(
        tmp_path, tools=[tool("dump", verbose(1_000_000))], turns=turns, agent={"max_tool_result_chars": 3_000}
    )
    try:
        first = await run_agent(harness, "dump it")
        seen = scripted(harness).requests[-1]["messages"]
        second = await run_agent(harness, "and now?", session_id=first.session_id)
        assert second.ok, second.error
        replayed = scripted(harness).requests[-1]["messages"]
        # The resumed request starts with exactly the conversation the model saw before.
        assert replayed[: len(seen) + 1] == [*seen, {"role": "assistant", "content": "first"}]
        cut = replayed[3]["content"]
        assert replayed[3]["role"] == "tool" and len(cut) <= 3_000 and left_out(cut) > 990_000
    finally:
        await harness.aclose()


async def test_code_mode_caps_run_code_but_the_program_sees_full_values(tmp_path: Path) -> None:
    """The real transport: a nested call's value is whole inside the program; run_code's result is cut."""
    program = 'page = await tools.dump({})\nprint("chars", len(page))\nreturn page\n'
    script = write_script(
        tmp_path / "script.jsonl",
        [
            calls(
                call("run_code", {"code": program, "description": "dump"}, "p1"), expect={"tools_include": ["run_code"]}
            ),
            final("ok", expect={"last_role": "tool"}),
        ],
    )
    deployment = compose(
        [
            (
                "test",
                {
                    "tools": {"mode": "code"},
                    "sessions": {"home": str(tmp_path / "home")},
                    "agents": [{"id": "main", "provider": "scripted", "max_tool_result_chars": 4_000}],
                    "plugins": [
                        {"id": "tools", "use": "test-tools"},
                        {"id": "scripted", "use": "scripted", "config": {"script": str(script)}},
                        {"id": "sessions", "use": "sqlite-sessions"},
                    ],
                },
            )
        ],
        env={},
    )
    plugin = ToolsPlugin([tool("dump", verbose(400_000))])
    catalog = PluginCatalog(extra={"test-tools": lambda scope, config: plugin}, strict=True)
    harness = await start_harness(deployment, catalog=catalog)
    try:
        result = await run_agent(harness, "dump it")
        assert result.ok, result.error
        sent = scripted(harness).requests[-1]["messages"][-1]
        assert sent["tool_call_id"] == "p1" and len(sent["content"]) <= 4_000
        assert "chars 400000" in sent["content"]  # the program saw the whole value
        assert left_out(sent["content"]) > 390_000
        assert result.session_id is not None
        events = await events_of(harness, result.session_id)
        [nested] = [e for e in events if e.kind == "tool/code-dispatch"]
        assert len(nested.payload["content"][0]["text"]) == 400_000  # the nested call's record is whole
        [outer] = [e for e in events if e.kind == "tool/result"]
        assert outer.payload["message"] == sent and outer.payload["cut"]["max_tool_result_chars"] == 4_000
    finally:
        await harness.aclose()


# -- a result's context messages share its cap ---------------------------------------------------------------

CONTEXT_MARKER = re.compile(
    r"\[\.\.\. ([\d,]+) characters left out of this context message of a tool result "
    r"\(max_tool_result_chars = (\d+), shared by the result and its context messages\); "
    r"ask for less, e.g\. a narrower query, a range or a limit \.\.\.\]"
)


def context_left_out(text: str) -> int:
    found = CONTEXT_MARKER.search(text)
    assert found is not None, text[-300:]
    return int(found.group(1).replace(",", ""))


@pytest.mark.parametrize(
    ("lengths", "limit", "expected"),
    [
        ([10, 20, 30], 100, [10, 20, 30]),  # all fit: all whole
        ([10, 1_000, 1_000], 100, [10, 45, 45]),  # a short one keeps its length, the long ones split the rest
        ([1_000, 10, 1_000, 3], 101, [44, 10, 44, 3]),
        ([50, 50, 50], 100, [34, 33, 33]),  # the shares add up to the budget exactly
        ([5, 5, 5], 2, [1, 1, 0]),  # more texts than characters
    ],
)
def test_one_budget_is_shared_max_min_fairly(lengths: list[int], limit: int, expected: list[int]) -> None:
    assert shares(lengths, limit) == expected


def test_a_call_and_its_contexts_stay_within_the_cap_together() -> None:
    result, contexts = cap_call_texts("r" * 50_000, ["c" * 50_000, "small", "d" * 30_000], 10_000)
    assert len(result.text) + sum(len(c.text) for c in contexts) <= 10_000
    assert contexts[1].text == "small" and not contexts[1].cut
    assert result.cut and "characters left out of this tool result" in result.text
    assert all(c.cut and context_left_out(c.text) == c.left_out for c in (contexts[0], contexts[2]))


def with_contexts(result: str, *contexts: str) -> Any:
    async def body(args: Any, ctx: Any) -> Any:
        for n, text in enumerate(contexts):
            ctx.defer_context(ContextMessage(text, source=f"plugin{n}"))
        return result

    return body


def lines(size: int) -> str:
    return "".join(f"{n:07d}\n" for n in range(size // 8))


async def test_a_huge_context_message_is_cut_within_the_cap_and_recorded_whole(tmp_path: Path) -> None:
    turns = [calls(call("dump", {}, "c1")), final("ok", expect={"last_role": "user"})]
    harness = await start(
        tmp_path,
        tools=[tool("dump", with_contexts("small result", lines(1_000_000)))],
        turns=turns,
        agent={"max_tool_result_chars": 5_000},
    )
    try:
        result = await run_agent(harness, "dump it")
        assert result.ok, result.error
        *_, answer, note = scripted(harness).requests[-1]["messages"]
        assert answer == {"role": "tool", "tool_call_id": "c1", "content": "small result"}
        assert note["role"] == "user" and note["content"].startswith("0000000\n")
        assert note["content"].endswith("0124999\n")
        # One budget for the call: the result and its context message together stay within the cap.
        assert len(answer["content"]) + len(note["content"]) <= 5_000
        assert context_left_out(note["content"]) > 990_000
        assert result.session_id is not None
        [event] = [
            e
            for e in await events_of(harness, result.session_id)
            if e.kind == "message/user" and e.root_call_id is not None
        ]
        assert event.payload["message"] == note and event.payload["context_source"] == "plugin0"
        assert len(event.payload["content"]) == 1_000_000  # the whole context message, as for a result
        assert event.payload["cut"] == {
            "chars": 1_000_000,
            "left_out": context_left_out(note["content"]),
            "max_tool_result_chars": 5_000,
        }
    finally:
        await harness.aclose()


async def test_many_context_messages_cannot_flood_the_conversation(tmp_path: Path) -> None:
    big = lines(200_000)
    turns = [calls(call("dump", {}, "c1")), final("ok")]
    harness = await start(
        tmp_path,
        tools=[tool("dump", with_contexts(big, *[big] * 20, "tiny"))],
        turns=turns,
        agent={"max_tool_result_chars": 20_000},
    )
    try:
        result = await run_agent(harness, "dump it")
        assert result.ok, result.error
        sent = scripted(harness).requests[-1]["messages"][3:]
        assert [m["role"] for m in sent] == ["tool"] + ["user"] * 21
        assert sum(len(m["content"]) for m in sent) <= 20_000
        assert sent[-1]["content"] == "tiny"  # a small one is untouched
        assert all(len(m["content"]) > 500 for m in sent[:-1])  # the budget is shared fairly, none is starved
        assert (
            "shared by the result and its context messages" in sent[0]["content"]
            and left_out(sent[0]["content"].replace(", shared by the result and its context messages", "")) > 0
        )
    finally:
        await harness.aclose()


async def test_small_context_messages_and_result_are_untouched(tmp_path: Path) -> None:
    turns = [calls(call("dump", {}, "c1")), final("ok")]
    harness = await start(
        tmp_path,
        tools=[tool("dump", with_contexts("r" * 2_000, "a" * 1_500, "b" * 1_500))],
        turns=turns,
        agent={"max_tool_result_chars": 5_000},
    )
    try:
        result = await run_agent(harness, "dump it")
        sent = scripted(harness).requests[-1]["messages"][3:]
        assert [m["content"] for m in sent] == ["r" * 2_000, "a" * 1_500, "b" * 1_500]
        assert result.session_id is not None
        events = [
            e
            for e in await events_of(harness, result.session_id)
            if e.root_call_id is not None and e.kind in ("message/user", "tool/result")
        ]
        assert all("cut" not in e.payload for e in events)
    finally:
        await harness.aclose()


async def test_a_small_context_message_beside_a_huge_result_is_untouched(tmp_path: Path) -> None:
    turns = [calls(call("dump", {}, "c1")), final("ok")]
    harness = await start(
        tmp_path,
        tools=[tool("dump", with_contexts(lines(1_000_000), "remember this"))],
        turns=turns,
        agent={"max_tool_result_chars": 5_000},
    )
    try:
        await run_agent(harness, "dump it")
        *_, answer, note = scripted(harness).requests[-1]["messages"]
        assert note == {"role": "user", "content": "remember this"}
        assert len(answer["content"]) + len(note["content"]) <= 5_000 and len(answer["content"]) > 4_900
    finally:
        await harness.aclose()


async def test_a_resumed_session_replays_exactly_the_cut_context_message(tmp_path: Path) -> None:
    turns = [
        calls(call("dump", {}, "c1")),
        final("first"),
        final("second", expect={"last_content_contains": "and now?"}),
    ]
    harness = await start(
        tmp_path,
        tools=[tool("dump", with_contexts("done", lines(1_000_000), "tiny"))],
        turns=turns,
        agent={"max_tool_result_chars": 3_000},
    )
    try:
        first = await run_agent(harness, "dump it")
        seen = scripted(harness).requests[-1]["messages"]
        second = await run_agent(harness, "and now?", session_id=first.session_id)
        assert second.ok, second.error
        replayed = scripted(harness).requests[-1]["messages"]
        assert replayed[: len(seen) + 1] == [*seen, {"role": "assistant", "content": "first"}]
        note = replayed[4]
        assert note["role"] == "user" and len(note["content"]) <= 3_000 and context_left_out(note["content"]) > 990_000
        assert replayed[5] == {"role": "user", "content": "tiny"}
    finally:
        await harness.aclose()


async def test_an_interrupted_step_cuts_a_result_alone_as_its_context_messages_are_not_kept(tmp_path: Path) -> None:
    """A step cut off mid-way keeps the finished results but not their context messages: such a result
    was still cut to a share of the budget, left to contexts the resumed model never sees."""
    import asyncio

    from dsh_core.agent.loop import history_from_events

    started = asyncio.Event()

    async def stubborn(args: Any, ctx: Any) -> Any:
        started.set()
        await asyncio.sleep(30)

    turns = [calls(call("dump", {}, "c1"), call("stubborn", {}, "s")), final("never")]
    harness = await start(
        tmp_path,
        tools=[tool("dump", with_contexts(lines(1_000_000), lines(1_000_000))), tool("stubborn", stubborn, safe=True)],
        turns=turns,
        agent={"max_tool_result_chars": 5_000},
    )
    try:
        task = asyncio.ensure_future(run_agent(harness, "dump it"))
        await asyncio.wait_for(started.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        store = SqliteSessionStore(Path(harness.deployment.sessions.home) / "sessions.db")
        try:
            (info,) = await store.list()
            events = await store.load(info.id)
        finally:
            await store.close()
        assert not [e for e in events if e.kind == "message/user" and e.root_call_id is not None]
        answer = next(m for m in history_from_events(events) if m.get("tool_call_id") == "c1")
        assert len(answer["content"]) > 4_900 and left_out(answer["content"]) > 990_000
    finally:
        await harness.aclose()


async def test_a_context_message_the_cap_leaves_nothing_of_is_not_sent_empty(tmp_path: Path) -> None:
    """With more texts than characters in the cap, a context message's share is 0: it was sent as an empty
    user message, which some providers refuse. It is recorded (whole, as ever) but not sent, and not replayed."""
    turns = [calls(call("dump", {}, "c1")), final("ok")]
    harness = await start(
        tmp_path,
        tools=[tool("dump", with_contexts("r", "abc", "def", "ghi"))],
        turns=turns,
        agent={"max_tool_result_chars": 3},
    )
    try:
        result = await run_agent(harness, "dump it")
        assert result.ok, result.error
        sent = scripted(harness).requests[-1]["messages"][3:]
        assert all(m["content"] for m in sent if m["role"] == "user"), sent
        assert [m["role"] for m in sent] == ["tool", "user", "user"]
        assert result.session_id is not None
        noted = [
            e
            for e in await events_of(harness, result.session_id)
            if e.kind == "message/user" and e.root_call_id is not None
        ]
        assert [e.payload["content"] for e in noted] == ["abc", "def", "ghi"]  # every one recorded whole
        assert [e.payload["message"] for e in noted].count(None) == 1
    finally:
        await harness.aclose()
