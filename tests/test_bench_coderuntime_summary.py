"""The summary bench/bench_coderuntime.py prints: what it says when a peer is missing, and its ratios."""

from __future__ import annotations

import importlib.util
import os
import resource
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _bench() -> ModuleType:
    sys.path.insert(0, str(ROOT / "bench"))  # the script imports peers_env as its neighbour
    try:
        spec = importlib.util.spec_from_file_location("bench_coderuntime", ROOT / "bench" / "bench_coderuntime.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "bench"))


bench = _bench()


def _dsh() -> dict[str, Any]:
    return {
        "isolation": "L3 test",
        "cold_spawn_ms": 20.0,
        "trivial_ms_idle_gap": 4.0,
        "trivial_ms_back_to_back": 8.0,
        "trivial_ms_idle_gap_by_level": {},
        "binding_round_trip_us": 150.0,
        "in_flight10_calls_per_s": 21_000.0,
        "compute_ms": 100.0,
        "wire_1mb": {"value_bytes": 929_032, "wire_ms": 300.0, "json_ms": 150.0, "json_gc_paused_ms": 75.0},
        "memory": {
            "idle_worker": {"Pss_kib": 7000},
            "workers20_total_pss_kib": 90_000,
            "host_ru_maxrss_kib_after_20": 30_000,
        },
    }


def _monty() -> dict[str, Any]:
    return {"compute_ms": 200.0, "trivial_fresh_worker_ms": 5.0, "async_call_us": 570.0, "gather_calls_per_s": 2000.0}


def test_a_peer_that_failed_is_named_with_its_error() -> None:
    peers = {"smolagents": {"error": "ImportError: no smolagents"}, "monty": _monty(), "exit_status": -6}
    text = "\n".join(bench.summary(_dsh(), peers))
    assert "vs smolagents" not in text
    assert "peer smolagents failed, no figures: ImportError: no smolagents" in text
    assert "vs monty 200.0 ms: 2.00x" in text
    assert "exited with status -6" in text


def test_peers_that_ran_add_no_failure_line() -> None:
    peers = {"smolagents": {"compute_ms": 13_000.0}, "monty": _monty()}
    text = "\n".join(bench.summary(_dsh(), peers))
    assert "vs smolagents 13000 ms: 130.0x" in text
    assert "failed" not in text and "exited" not in text


def test_ten_in_flight_is_a_ratio_to_monty_gather_as_the_target_names_it() -> None:
    text = "\n".join(bench.summary(_dsh(), {"monty": _monty()}))
    assert "10 in flight: 21000 calls/s (target >= 20,000; monty gather 2000 calls/s: 10.5x, target >= 3x)" in text
    alone = "\n".join(bench.summary(_dsh(), {"skipped": "--no-peers"}))
    assert "10 in flight: 21000 calls/s (target >= 20,000)" in alone


def test_the_host_peak_is_reset_before_the_twenty_runs() -> None:
    held = bytearray(64 * 1024 * 1024)
    held[::4096] = b"x" * len(held[::4096])  # touch every page: resident
    del held
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - bench.proc_mem(os.getpid())["VmRSS_kib"] > 48 * 1024
    assert bench.reset_peak_rss()
    status = bench.proc_mem(os.getpid())
    assert status["VmHWM_kib"] - status["VmRSS_kib"] < 16 * 1024
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - status["VmRSS_kib"] < 16 * 1024
