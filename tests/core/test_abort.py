"""AbortSignal: every listener hears of an abort, even when one of them raises."""

from __future__ import annotations

import pytest

from dsh_core.abort import AbortController


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
