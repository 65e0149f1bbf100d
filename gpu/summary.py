"""gpu/run.sh's summary as JSON: the device and versions (from the probe step's log), and each
step's name, result, seconds, reason and figures (the lines of its log that hold them).

    python3 gpu/summary.py SUMMARY.txt LOGDIR > summary.json

Also run here over logs brought back from a GPU machine (``benches/gpu/*.json``)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

# The lines of a step's log that carry its figures, by step.
FIGURES = {
    "bench": re.compile(r"^(==|# collsched bench|# memcpy reference|# host in launch|\s+\d+\s+\d+\s)"),
    "kernels": re.compile(r"^(==|# collsched bench|# reference|# wrong|# from \d+ MiB|\s+\d+\s+\d+\s)"),
    "vs-nccl": re.compile(r"^(NVIDIA|H\d|all_gather|reduce_scatter|\s+\d+\s)"),
    "vs-fsdp2": re.compile(r"^(model:|fsdp2 |collsched |floor |ratio |losses compared)"),
    "rust-runtime": re.compile(r"(fetch returned after|^test result)"),
    "python": re.compile(r"^(=+ )?\d+ (passed|failed).* in [\d.]+s"),
}
FIGURES["vs-fsdp2-1b"] = FIGURES["vs-fsdp2-offload"] = FIGURES["vs-fsdp2"]
FIGURES["host-profile"] = re.compile(r"^(model:|fsdp2 |collsched |ratio |pyprofile )")
FIGURES["fidelity"] = re.compile(r"^(# |\s+\d+\s+\d+\s+(none|trace)\s)")


def probe(logdir: str) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        text = Path(logdir, "probe.log").read_text()
    except OSError:
        return out
    for key, pattern in (
        ("driver", r"Driver Version: (\S+)"),
        ("cuda_driver", r"CUDA Version: (\S+)"),
        ("torch", r"^torch (\S+)"),
        ("torch_cuda", r"^torch \S+ cuda (\S+)"),
        ("nccl", r"^nccl \((\d+), (\d+), (\d+)\)"),
        ("device", r"^device 0: ([^,]+)"),
        ("python", r"^python: Python (\S+)"),
        ("commit", r"^commit (.+)$"),
    ):
        m = re.search(pattern, text, re.MULTILINE)
        if m:
            out[key] = ".".join(m.groups()) if key == "nccl" else m.group(1)
    return out


def main() -> None:
    summary, logdir = sys.argv[1], sys.argv[2]
    steps = []
    for line in Path(summary).read_text().splitlines():
        m = re.match(r"^(\S+)\s+(ok|FAILED|skipped)\s+(\d+)s\s*(.*)$", line.rstrip("\n"))
        if not m:
            continue
        name, result, secs, why = m.groups()
        figures = []
        pattern = FIGURES.get(name)
        if pattern is not None:
            try:
                log = Path(logdir, f"{name}.log").read_text().splitlines()
                figures = [x.rstrip() for x in log if pattern.search(x)]
            except OSError:
                pass
        steps.append(
            {
                "step": name,
                "result": result,
                "seconds": int(secs),
                "why": why,
                "figures": figures,
            }
        )
    json.dump({**probe(logdir), "steps": steps}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
