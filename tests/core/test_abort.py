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


def test_until_returns_when_the_work_is_done_or_the_signal_aborts_and_leaves_the_work_alone() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        controller = AbortController()
        signal = controller.signal
        work: asyncio.Future[int] = loop.create_future()
        loop.call_later(0.01, work.set_result, 7)
        assert await signal.until(work) is True and work.result() == 7
        assert not signal._waiters  # nothing left behind

        failed: asyncio.Future[int] = loop.create_future()
        loop.call_later(0.01, failed.set_exception, ValueError("the work's own error"))
        assert await signal.until(failed) is True  # done: its error is the caller's to read
        assert isinstance(failed.exception(), ValueError)

        slow: asyncio.Future[int] = loop.create_future()
        loop.call_later(0.01, controller.abort, "stop")
        assert await signal.until(slow) is False
        assert not slow.done() and not slow.cancelled()  # the abort overtook it; it was not touched
        assert await signal.until(slow) is False  # already aborted: at once
        slow.set_result(1)
        assert await signal.until(slow) is True
        assert await AbortSignal.never().until(slow) is True

    asyncio.run(go())


def test_cancelling_until_leaves_the_work_running_and_removes_its_waiter() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        signal = AbortController().signal
        work: asyncio.Future[int] = loop.create_future()
        waiting = asyncio.ensure_future(signal.until(work))
        await asyncio.sleep(0)
        assert signal._waiters
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not work.cancelled() and not signal._waiters
        work.set_result(1)  # no callback of the cancelled wait is left on it
        await asyncio.sleep(0)

    asyncio.run(go())


def test_until_refuses_a_coroutine_with_a_type_error() -> None:
    async def work() -> int:
        return 1

    async def go() -> None:
        coroutine = work()
        with pytest.raises(TypeError, match="ensure_future"):
            await AbortSignal().until(coroutine)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="ensure_future"):
            await AbortSignal.aborted_with("stop").until(coroutine)  # type: ignore[arg-type]
        assert await coroutine == 1  # untouched: still the caller's to run

    asyncio.run(go())
