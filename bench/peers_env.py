"""The benchmark peers' own venv, made by the project from ``bench/requirements-peers.txt``.

The peers (smolagents, pydantic-monty) and the tokenizer never enter the project's
venv. The benchmarks run them from a separate venv that this module creates on
first use, so a fresh machine needs no hand-made set-up:

* the venv lives at ``$DSH_BENCH_VENV``, or ``.bench-venv`` in the repository;
* it is made with the running interpreter (``sys.executable -m venv``) and filled
  by the project's own pip (``pip --python``), from the pinned file;
* a stamp in the venv records the requirements it was filled from: a venv whose
  stamp matches is reused as it is, one whose stamp differs (or is missing) is
  made again from scratch, and a failed install leaves no stamp, so the next
  run tries again;
* only a directory this module made is ever removed: anything else found at the
  venv's path is left alone, and the benchmark runs without its peers.

Progress goes to stderr: the benchmarks print their figures on stdout.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements-peers.txt"
STAMP = ".dsh-requirements"
MADE = ".dsh-made"


def default_venv() -> Path:
    """Where the peers' venv lives: ``$DSH_BENCH_VENV``, else ``.bench-venv`` in the repository."""
    return Path(os.environ.get("DSH_BENCH_VENV") or HERE.parent / ".bench-venv")


def _stamp_of(requirements: Path) -> str:
    return hashlib.sha256(requirements.read_bytes()).hexdigest() + "\n"


def ensure_peers_python(
    venv: Path | None = None,
    requirements: Path = REQUIREMENTS,
    pip_args: Sequence[str] = ("--quiet",),
) -> tuple[Path | None, str]:
    """The peers' interpreter, making or refreshing its venv first if needed.

    Returns ``(python, note)``. ``python`` is None when the venv could not be
    made; ``note`` then says why (the command that failed and the end of its
    output), and otherwise what was done. Never raises for a failed install:
    a benchmark without its peers still prints its own figures.
    """
    venv = default_venv() if venv is None else venv
    python = venv / "bin" / "python"
    try:
        wanted = _stamp_of(requirements)
    except OSError as error:
        return None, f"cannot read the peers' requirements {requirements}: {error.strerror}"
    stamp = venv / STAMP
    try:
        if stamp.read_text(encoding="utf-8") == wanted and os.access(python, os.X_OK):
            return python, f"peers' venv {venv} is up to date"
    except OSError:
        pass  # no stamp: never filled, or a failed or older fill
    if venv.exists() and not (venv / MADE).exists():
        return None, (
            f"{venv} exists and was not made by {Path(__file__).name}: remove it, or set DSH_BENCH_VENV to another path"
        )
    try:
        if venv.exists():
            # A venv filled from other requirements (or half-filled) may hold packages the
            # pinned file no longer lists; only a fresh venv installs exactly that file.
            shutil.rmtree(venv)
        venv.mkdir(parents=True)
        (venv / MADE).touch()  # before anything can fail: a half-made venv is ours to remove
    except OSError as error:
        return None, f"could not make the peers' venv {venv}: {error}"
    print(f"making the peers' venv {venv} from {requirements} ...", file=sys.stderr, flush=True)
    steps = (
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        [sys.executable, "-m", "pip", "--python", str(python), "install", *pip_args, "-r", str(requirements)],
    )
    for command in steps:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip()[-1500:]
            return None, f"could not make the peers' venv {venv}: {' '.join(command)} exited {done.returncode}: {tail}"
    stamp.write_text(wanted, encoding="utf-8")
    return python, f"made the peers' venv {venv} from {requirements}"
