"""Agent runs: model providers and session stores."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from dsh_hookspecs import hookspec

if TYPE_CHECKING:
    from dsh_core.agent.provider import Provider
    from dsh_core.sessions.store import SessionStoreFactory


@hookspec
def dsh_register_providers(register: Callable[[str, Provider], None]) -> None:
    """Register model providers: ``register(name, provider)``.

    A provider is one async function from OpenAI chat-completions messages and
    tool schemas to one assistant message (see
    :class:`dsh_core.agent.provider.Provider`). Agents pick a provider by name
    (``[[agents]] provider``). A name registered twice is an error naming
    both plugins. Providers are unregistered with the plugin's scope.
    """


@hookspec
def dsh_register_session_stores(register: Callable[[str, SessionStoreFactory], None]) -> None:
    """Register session stores: ``register(name, factory)``.

    ``factory(home: pathlib.Path) -> SessionStore`` opens an append-only event
    log with a lease per session, so that one run at a time continues it (see
    :class:`dsh_core.sessions.store.SessionStore`); the deployment picks one
    by name (``[sessions] store``). A name registered twice is an error
    naming both plugins.

    A factory with a parameter named ``create`` (``def factory(home, *,
    create=True)``) is called ``factory(home, create=False)`` by ``dsh
    sessions list``, ``show`` and ``release``: its store then creates
    nothing (no directory, no file) and, where nothing exists yet, reads as
    an empty store (``list`` finds none; ``get``, ``load`` and
    ``break_lease`` raise ``SessionNotFoundError``). A factory without one,
    ``**options`` alone included, is called ``factory(home)`` by them as by
    an agent run; one that names ``create`` gets ``create=True`` from an
    agent run (see :func:`dsh_core.sessions.store.open_store`).

    ``dsh sessions show`` reads a session a page at a time with the store's
    ``load_page(session_id, after=seq, limit=n)`` (the events after ``seq``;
    an empty page ends it), so that it holds one page however long the
    session; a store without ``load_page`` is read whole with ``load``.
    """
