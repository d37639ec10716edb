"""AbortSignal: every listener hears of an abort, even when one of them raises."""

from __future__ import annotations

import asyncio

import pytest

from dsh_core.abort import AbortController, AbortSignal


def test_every_listener_is_called_and_then_the_error_is_raised() -> None:
    controller = AbortController()
    heard: list[str] = []

    def failing(reason: object) -> None:
        heard.append(f"failing {reason}")
        raise ValueError("listener failed")

    controller.signal.add_listener(failing)
    controller.signal.add_listener(lambda reason: heard.append(f"second {reason}"))
    with pytest.raises(ValueError, match="listener failed"):
        controller.abort("stop")
    assert heard == ["failing stop", "second stop"]
    assert controller.signal.aborted and controller.signal.reason == "stop"
    controller.abort("again")  # later aborts are ignored, listeners are not called twice
    assert heard == ["failing stop", "second stop"]


def test_several_failing_listeners_are_raised_together() -> None:
    controller = AbortController()

    def fail(message: str) -> None:
        raise RuntimeError(message)

    controller.signal.add_listener(lambda _: fail("one"))
    controller.signal.add_listener(lambda _: fail("two"))
    with pytest.raises(ExceptionGroup) as raised:
        controller.abort()
    assert [str(error) for error in raised.value.exceptions] == ["one", "two"]


def test_a_listener_error_names_the_listener() -> None:
    controller = AbortController()

    def close_socket(reason: object) -> None:
        raise OSError("already closed")

    controller.signal.add_listener(close_socket)
    with pytest.raises(OSError) as raised:
        controller.abort()
    assert any("close_socket" in note for note in raised.value.__notes__)


def test_fuse_aborts_with_the_first_reason_and_release_removes_its_listeners() -> None:
    session, timeout = AbortController(), AbortController()
    for _ in range(3):
        fused, release = AbortSignal.fuse((session.signal, timeout.signal))
        release()
        release()  # twice is harmless
    assert not session.signal._listeners and not timeout.signal._listeners
    fused, release = AbortSignal.fuse((session.signal, timeout.signal))
    timeout.abort("timeout")
    assert fused.aborted and fused.reason == "timeout"
    release()
    assert not session.signal._listeners
    already, release = AbortSignal.fuse((AbortSignal.aborted_with("gone"), session.signal))
    assert already.aborted and already.reason == "gone" and not session.signal._listeners
    assert AbortSignal.any((session.signal,)) is not session.signal and len(session.signal._listeners or []) == 1


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit, asyncio.CancelledError])
def test_an_interrupt_in_a_listener_still_lets_the_others_hear_and_then_wins(
    interrupt: type[BaseException],
) -> None:
    controller = AbortController()
    heard: list[str] = []

    def interrupted(reason: object) -> None:
        heard.append("interrupted")
        raise interrupt()

    def failing(reason: object) -> None:
        heard.append("failing")
        raise ValueError("listener failed")

    controller.signal.add_listener(interrupted)
    controller.signal.add_listener(failing)
    controller.signal.add_listener(lambda reason: heard.append(f"last {reason}"))
    with pytest.raises(interrupt) as raised:
        controller.abort("stop")
    assert heard == ["interrupted", "failing", "last stop"]
    notes = raised.value.__notes__
    assert any("interrupted" in note for note in notes)
    assert any("also raised ValueError: listener failed" in note for note in notes)
