"""The production composition: a :class:`~dsh_core.harness.Harness` with dsh's own run_code transport.

:func:`start_harness` boots a deployment whose registry carries the real
``run_code`` transport (:class:`~dsh_core.codemode.transport.RunCodeTransport`)
backed by a :class:`LazyCodeRuntime`: the worker-process
``PythonCodeRuntime`` configured from ``[code_runtime]`` is built on first use
(a native deployment that never runs a program never builds one) and closed
when the harness's root scope is disposed. The root scope also provides:

* ``"code_runtime"``: the :class:`LazyCodeRuntime`;
* ``"run_code"``: the :class:`RunCodeTransport` (its ``watch`` lets the CLI
  observe one run's nested calls);
* ``"prompt"``: a :class:`~dsh_core.prompt.PromptAssembler` whose core
  sections are the Code Mode ones (``tools:code-only``, ``tools:sdk``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from dsh_core.abort import AbortSignal
from dsh_core.codemode.prompt import code_mode_sections
from dsh_core.codemode.transport import RunCodeTransport
from dsh_core.coderuntime import BindingNamespace, CodeRunResult, CodeRuntime, CodeRuntimeConfig
from dsh_core.config import CodeRuntimeSection, Deployment
from dsh_core.harness import Harness
from dsh_core.model import ToolDefinition
from dsh_core.plugins import PluginCatalog
from dsh_core.prompt import PromptAssembler

__all__ = ["start_harness", "LazyCodeRuntime", "runtime_config"]


def runtime_config(section: CodeRuntimeSection) -> CodeRuntimeConfig:
    """The code runtime config a deployment's ``[code_runtime]`` section describes."""
    return CodeRuntimeConfig(
        isolation=section.isolation,
        timeout_s=section.timeout_s,
        cpu_s=section.cpu_s,
        memory_mb=section.memory_mb,
        max_output_bytes=section.max_output_bytes,
        preload=cast(Any, section.preload),
    )


class LazyCodeRuntime:
    """A :class:`CodeRuntime` that builds the worker-process backend on first use.

    ``language`` is known without building (the backend runs Python);
    ``isolation`` and ``run`` build it. :meth:`aclose` closes it if it was built
    and makes later runs raise, like any closed runtime.
    """

    language = "python"

    def __init__(self, config: CodeRuntimeConfig) -> None:
        self.config = config
        self._runtime: CodeRuntime | None = None
        self._closed = False

    @property
    def built(self) -> bool:
        """True once the backend exists."""
        return self._runtime is not None

    def _get(self) -> CodeRuntime:
        if self._closed:
            raise RuntimeError("the code runtime is closed")
        if self._runtime is None:
            from dsh_core.coderuntime import PythonCodeRuntime

            self._runtime = PythonCodeRuntime(self.config)
        return self._runtime

    @property
    def isolation(self) -> str:
        """The backend's isolation descriptor (builds it)."""
        return self._get().isolation

    async def start(self) -> str:
        """Build the backend, start its first worker without blocking the loop, and return :attr:`isolation`."""
        return await self._get().start()  # type: ignore[attr-defined, no-any-return]

    async def run(
        self, program: str, bindings: Sequence[BindingNamespace], signal: AbortSignal | None = None
    ) -> CodeRunResult:
        """Run ``program`` on the backend (built on the first call)."""
        return await self._get().run(program, bindings, signal=signal)

    async def aclose(self) -> None:
        """Close the backend if it was built; later runs raise."""
        self._closed = True
        runtime, self._runtime = self._runtime, None
        if runtime is not None:
            await runtime.aclose()


async def start_harness(deployment: Deployment, *, catalog: PluginCatalog | None = None) -> Harness:
    """Boot ``deployment`` with the installed plugins and the real ``run_code`` transport."""
    code_runtime = LazyCodeRuntime(runtime_config(deployment.code_runtime))
    holder: list[Harness] = []
    transport = RunCodeTransport(
        lambda: holder[0].runtime, code_runtime, max_parallel_sub_calls=deployment.tools.max_parallel_sub_calls
    )

    def make_transport(harness: Harness) -> ToolDefinition:
        # The registry asks for run_code on first need, possibly while plugins are still starting.
        if not holder:
            holder.append(harness)
        return transport.definition()

    try:
        harness = await Harness.start(deployment, catalog=catalog, transport=make_transport)
    except BaseException:
        await code_runtime.aclose()
        raise
    if not holder:
        holder.append(harness)
    root = harness.root
    root.provide("code_runtime", code_runtime)
    root.provide("run_code", transport)
    root.provide(
        "prompt",
        PromptAssembler(harness.hooks, harness.registry, core=code_mode_sections(harness.registry, code_runtime)),
    )
    # Registered after the plugins and agents started, so it runs after they are disposed
    # (children first): no run can still need the runtime when it closes.
    root.on_dispose(code_runtime.aclose)
    return harness
