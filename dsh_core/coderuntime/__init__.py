"""The ``CodeRuntime`` seam and its Python backend.

``PythonCodeRuntime`` runs each program (the body of an ``async def``) in a
fresh worker forked by a warm zygote, locked down at the strongest isolation
level available (L0-L3, see :mod:`dsh_core.coderuntime.isolation`), and
bridges binding calls back to the host over a lossless flat-token wire.
"""

from dsh_core.coderuntime.host import STDLIB_PRELOAD, PythonCodeRuntime, RuntimeDisposedError
from dsh_core.coderuntime.seam import (
    ERROR_KINDS,
    BindingNamespace,
    CodeRunError,
    CodeRunResult,
    CodeRuntime,
    CodeRuntimeConfig,
    ErrorClassSpec,
    RunControl,
    current_run,
)

__all__ = [
    "ERROR_KINDS",
    "STDLIB_PRELOAD",
    "BindingNamespace",
    "CodeRunError",
    "CodeRunResult",
    "CodeRuntime",
    "CodeRuntimeConfig",
    "ErrorClassSpec",
    "PythonCodeRuntime",
    "RunControl",
    "RuntimeDisposedError",
    "current_run",
]
