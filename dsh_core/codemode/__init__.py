"""Code Mode: the reserved ``run_code`` transport and everything around it.

* :mod:`.transport` — the ``run_code`` definition and its execution (nested dispatch);
* :mod:`.scheduler` — the per-program scheduler of nested calls;
* :mod:`.history` — the ``tool/code-dispatch-start`` / ``tool/code-dispatch`` session events;
* :mod:`.sdk` — the Python and TypeScript SDK renderers;
* :mod:`.prompt` — the core ``tools:code-only`` and ``tools:sdk`` prompt sections;
* :mod:`.cli` — ``dsh run-code`` and ``dsh sdk``.

The production wiring (a worker-process runtime built lazily from
``[code_runtime]``) is :func:`dsh_core.boot.start_harness`.
"""
