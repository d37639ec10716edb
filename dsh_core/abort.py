"""Abort signals: the Python counterpart of the web platform's AbortController.

A caller owns an :class:`AbortController`; everything it starts receives the
controller's read-only :class:`AbortSignal`. Aborting is one-way and happens
once: the first reason sticks, listeners run once, in registration order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from dsh_core.errors import describe_callable

__all__ = ["AbortController", "AbortSignal", "AbortedError"]

Listener = Callable[[object], None]


class AbortedError(Exception):
    """Raised by :meth:`AbortSignal.raise_if_aborted` and available to tool bodies."""

    def __init__(self, reason: object) -> None:
        super().__init__(f"aborted: {reason}")
        self.reason = reason


class AbortSignal:
    """A read-only view of an abort state that can be observed and awaited."""

    __slots__ = ("_aborted", "_listeners", "_reason", "_waiters")

    def __init__(self) -> None:
        self._aborted = False
        self._reason: object = None
        self._listeners: list[Listener] | None = None
        self._waiters: list[asyncio.Future[None]] | None = None

    @property
    def aborted(self) -> bool:
        """True once the owning controller aborted."""
        return self._aborted

    @property
    def reason(self) -> object:
        """The reason given to the first :meth:`AbortController.abort` call."""
        return self._reason

    def raise_if_aborted(self) -> None:
        """Raise :class:`AbortedError` when the signal is aborted."""
        if self._aborted:
            raise AbortedError(self._reason)

    def add_listener(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(reason)`` once on abort (at once if already aborted).

        Returns a function that removes the listener; removing twice is harmless.
        """
        if self._aborted:
            listener(self._reason)
            return _noop
        if self._listeners is None:
            self._listeners = []
        self._listeners.append(listener)

        def remove() -> None:
            if self._listeners is not None and listener in self._listeners:
                self._listeners.remove(listener)

        return remove

    async def wait(self) -> object:
        """Wait until the signal aborts; return the reason."""
        if self._aborted:
            return self._reason
        await self._park(asyncio.get_running_loop().create_future())
        return self._reason

    async def until(self, future: asyncio.Future[Any]) -> bool:
        """Wait until ``future`` is done or the signal aborts, whichever comes first; True if ``future`` is done.

        ``future`` is neither cancelled nor awaited, whichever wins, and neither is it when
        the caller is cancelled: what becomes of work the abort overtook (cancel it, wait for
        it, leave it running) is the caller's decision. One waiting future, no task: cheaper
        than racing :meth:`wait` against ``future`` in ``asyncio.wait``.
        """
        if not asyncio.isfuture(future):
            # A coroutine would otherwise fail on .done() and be reported as never awaited; and
            # until could not leave it to the caller, who has no handle on it once it is wrapped.
            raise TypeError(
                f"until() needs a future or task, not {type(future).__name__}: "
                "pass asyncio.ensure_future(...) and keep it to cancel or await"
            )
        if future.done() or self._aborted:
            return future.done()
        waiter: asyncio.Future[None] = future.get_loop().create_future()

        def wake(_: object) -> None:
            if not waiter.done():
                waiter.set_result(None)

        future.add_done_callback(wake)
        try:
            await self._park(waiter)
        finally:
            future.remove_done_callback(wake)
        return future.done()

    async def _park(self, waiter: asyncio.Future[None]) -> None:
        """Await ``waiter``, which the abort resolves, and forget it however the wait ends."""
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            if self._waiters is not None and waiter in self._waiters:
                self._waiters.remove(waiter)

    def _fire(self, reason: object) -> None:
        if self._aborted:
            return
        self._aborted = True
        self._reason = reason
        listeners, self._listeners = self._listeners or [], None
        waiters, self._waiters = self._waiters or [], None
        for future in waiters:
            if not future.done():
                future.set_result(None)
        # Every listener hears of it, even after one raised; then the caller does, with a note
        # naming the listener, since the aborting caller is rarely the one that added it.
        errors: list[Exception] = []
        interrupt: BaseException | None = None
        for listener in listeners:
            try:
                listener(reason)
            except Exception as error:
                error.add_note(f"raised by abort listener {_describe(listener)}")
                errors.append(error)
            except BaseException as stop:
                # KeyboardInterrupt, SystemExit, CancelledError: the rest still hear of the
                # abort (their clean-up is why they listen), then the first of these wins.
                if interrupt is None:
                    stop.add_note(f"raised by abort listener {_describe(listener)}")
                    interrupt = stop
        if interrupt is not None:
            for other in errors:
                interrupt.add_note(f"another abort listener also raised {type(other).__name__}: {other}")
            raise interrupt
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ExceptionGroup("abort listeners raised", errors)

    @staticmethod
    def never() -> AbortSignal:
        """A signal that never aborts (no controller can reach it)."""
        return AbortSignal()

    @staticmethod
    def aborted_with(reason: object) -> AbortSignal:
        """A signal that is already aborted with ``reason``."""
        signal = AbortSignal()
        signal._fire(reason)
        return signal

    @staticmethod
    def any(signals: Iterable[AbortSignal]) -> AbortSignal:
        """A signal that aborts as soon as any of ``signals`` aborts, with its reason.

        Its listeners stay on ``signals`` until they abort: for a signal that lives
        shorter than its sources (one call under a session's signal), use :meth:`fuse`.
        """
        return AbortSignal.fuse(signals)[0]

    @staticmethod
    def fuse(signals: Iterable[AbortSignal]) -> tuple[AbortSignal, Callable[[], None]]:
        """Like :meth:`any`, with a function that removes its listeners from ``signals``.

        Call the function once the fused signal is no longer needed, so that a
        long-lived source does not collect one dead listener per fused signal.
        Calling it twice is harmless; the fused signal keeps its state.
        """
        controller = AbortController()
        removers: list[Callable[[], None]] = []
        for signal in signals:
            if signal.aborted:
                controller.abort(signal.reason)
                break
            removers.append(signal.add_listener(controller.abort))

        def release() -> None:
            for remove in removers:
                remove()
            removers.clear()

        if controller.signal.aborted:
            release()
        return controller.signal, release


class AbortController:
    """Owns an :class:`AbortSignal` and is the only way to abort it."""

    __slots__ = ("signal",)

    def __init__(self) -> None:
        self.signal = AbortSignal()

    def abort(self, reason: object = "aborted") -> None:
        """Abort the signal; later calls are ignored (the first reason wins).

        Every listener is called, even after one raised; then the error is
        raised here (an ``ExceptionGroup`` when several listeners raised).
        """
        self.signal._fire(reason)


def _noop() -> None:
    return None


def _describe(listener: Listener) -> str:
    """The listener's qualified name and where it is defined (for the note on its error)."""
    name = describe_callable(listener)
    code = getattr(listener, "__code__", None)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name
