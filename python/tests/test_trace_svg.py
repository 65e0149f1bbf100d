"""python/benchmarks/trace_svg.py: lanes, colours and busy time of a small made-up trace."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "trace_svg.py")


def event(cat: str, name: str, ts: float, dur: float, tid: int, stream: int | None = None) -> dict:
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}
    if stream is not None:
        e["args"] = {"stream": stream}
    return e


def draw(tmp_path, events: list[dict]) -> tuple[subprocess.CompletedProcess, str]:
    src, out = tmp_path / "t.json", tmp_path / "t.svg"
    src.write_text(json.dumps({"traceEvents": events}))
    proc = subprocess.run([sys.executable, SCRIPT, str(src), str(out), "--title", "T"], capture_output=True, text=True)
    return proc, out.read_text() if out.exists() else ""


def test_lanes_busy_time_and_colours(tmp_path):
    events = [
        # The host: an outer call with a nested one (drawn once), and a second thread.
        event("cpu_op", "aten::linear", 0, 100, tid=1),
        event("cpu_op", "aten::addmm", 10, 50, tid=1),
        event("cpu_op", "autograd::engine::evaluate_function", 200, 40, tid=2),
        # Stream 7: two overlapping kernels (busy 0..150 once) and a copy; stream 13: ours and NCCL's.
        event("kernel", "gemm", 0, 100, tid=7, stream=7),
        event("kernel", "gemm", 50, 100, tid=7, stream=7),
        event("gpu_memcpy", "Memcpy DtoD", 300, 20, tid=7, stream=7),
        event("kernel", "collsched_copy_in", 20, 30, tid=13, stream=13),
        event("kernel", "ncclDevKernel_ReduceScatter", 60, 40, tid=13, stream=13),
        {"ph": "i", "cat": "instant", "name": "ignored", "ts": 5},
    ]
    proc, svg = draw(tmp_path, events)
    assert proc.returncode == 0, proc.stderr
    labels = re.findall(r'<text x="10" y="\d+">([^<]*)</text>', svg)
    assert labels[:4] == [
        "host thread 0 (host, 1)",
        "host thread 1 (host, 1)",
        "stream 7 (compute, 3)",
        "stream 13 (collsched, 2)",
    ]
    assert "stream 7 busy 0.17 ms" in labels
    assert "stream 13 busy 0.07 ms" in labels
    # The span: the first event's start to the last one's end.
    assert "T: 0.32 ms" in svg
    box = r'<rect x="[\d.]+" y="\d+" width="[\d.]+" height="\d+" fill="(#[0-9a-f]+)"><title>([^<]*)</title>'
    fills = re.findall(box, svg)
    by_name = {name.split(" ")[0]: fill for fill, name in fills}
    assert by_name == {
        "aten::linear": "#9467bd",
        "autograd::engine::evaluate_function": "#9467bd",
        "gemm": "#2ca02c",
        "Memcpy": "#7f7f7f",
        "collsched_copy_in": "#1f77b4",
        "ncclDevKernel_ReduceScatter": "#ff7f0e",
    }
    assert len(fills) == 7  # the nested host call is not drawn


def test_a_trace_without_gpu_activity_is_refused(tmp_path):
    proc, svg = draw(tmp_path, [event("cpu_op", "aten::add", 0, 5, tid=1)])
    assert proc.returncode != 0
    assert "no GPU activity" in proc.stderr
    assert svg == ""


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
