"""Draws a Chrome trace of one training step (``vs_fsdp2.py --trace DIR``) as an SVG timeline.

    python python/benchmarks/trace_svg.py TRACE.json OUT.svg [--title TEXT]

One lane per GPU stream (kernels, copies and sets from CUPTI, on whichever stream launched
them: torch's compute stream beside the library's and NCCL's) under one lane of the host's
top-level operator calls of each of the host's busiest threads (the Python thread's forward
and optimizer step, autograd's backward). Colours: collsched's kernels
(``collsched_*``), NCCL's (``nccl*``), copies and sets, everything else (the model's
compute). Below the lanes, each stream's busy time. Only the standard library is needed.
"""

from __future__ import annotations

import argparse
import html
import json
from collections import defaultdict

COLOURS = {"collsched": "#1f77b4", "nccl": "#ff7f0e", "copy": "#7f7f7f", "compute": "#2ca02c", "host": "#9467bd"}
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def kind(event: dict) -> str:
    name = event.get("name", "")
    if event.get("cat") in ("gpu_memcpy", "gpu_memset"):
        return "copy"
    if name.startswith("collsched_"):
        return "collsched"
    if "nccl" in name.lower():
        return "nccl"
    return "compute"


def lanes(trace: dict) -> tuple[dict[str, list[dict]], float, float]:
    """Events by lane (``stream N`` for the GPU's, ``host thread N`` for the top-level CPU operators)
    and the trace's first and last microsecond."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    if not gpu:
        raise SystemExit("the trace has no GPU activity (kernels, copies): was it taken with --device cuda?")
    out: dict[str, list[dict]] = defaultdict(list)
    for e in gpu:
        stream = e.get("args", {}).get("stream", e.get("tid"))
        out[f"stream {stream}"].append(e)
    cpu = [e for e in events if e.get("cat") == "cpu_op"]
    by_thread: dict[object, list[dict]] = defaultdict(list)
    for e in cpu:
        by_thread[e.get("tid")].append(e)
    # Each thread's outermost calls (the Python thread's forward and optimizer, autograd's
    # thread's backward), the busiest first.
    for n, es in enumerate(sorted(by_thread.values(), key=lambda es: -sum(e["dur"] for e in es))[:3]):
        es.sort(key=lambda e: (e["ts"], -e["dur"]))
        end = float("-inf")
        for e in es:
            if e["ts"] >= end:
                out[f"host thread {n}"].append(e)
                end = e["ts"] + e["dur"]
    everything = [e for es in out.values() for e in es]
    return out, min(e["ts"] for e in everything), max(e["ts"] + e["dur"] for e in everything)


def busy_us(events: list[dict]) -> float:
    """The time a lane has something running (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        start, stop = max(e["ts"], end), e["ts"] + e["dur"]
        if stop > start:
            total += stop - start
        end = max(end, stop)
    return total


def draw(trace: dict, title: str) -> str:
    by_lane, t0, t1 = lanes(trace)
    hosts = sorted(k for k in by_lane if k.startswith("host"))
    order = hosts + sorted((k for k in by_lane if k not in hosts), key=lambda k: -len(by_lane[k]))
    width, left, lane_h, top = 1400, 230, 26, 50
    scale = (width - left - 20) / max(t1 - t0, 1.0)
    height = top + lane_h * len(order) + 40 + 18 * (len(COLOURS) + 1)
    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="10" y="20" font-size="14">{html.escape(title)}: {(t1 - t0) / 1000:.2f} ms</text>',
    ]
    for i, lane in enumerate(order):
        y = top + i * lane_h
        kinds = defaultdict(int)
        for e in by_lane[lane]:
            kinds["host" if lane in hosts else kind(e)] += 1
        main = max(kinds, key=kinds.get)
        label = f"{lane} ({main}, {len(by_lane[lane])})"
        svg.append(f'<text x="10" y="{y + 17}">{html.escape(label)}</text>')
        svg.append(f'<line x1="{left}" y1="{y + lane_h}" x2="{width - 20}" y2="{y + lane_h}" stroke="#ddd"/>')
        for e in by_lane[lane]:
            x = left + (e["ts"] - t0) * scale
            w = max(e["dur"] * scale, 0.5)
            colour = COLOURS["host" if lane in hosts else kind(e)]
            name = html.escape(e.get("name", "")[:120])
            svg.append(
                f'<rect x="{x:.2f}" y="{y + 3}" width="{w:.2f}" height="{lane_h - 6}" fill="{colour}">'
                f"<title>{name} {e['dur']:.1f} us</title></rect>"
            )
    y = top + lane_h * len(order) + 20
    for lane in order:
        if lane in hosts:
            continue
        svg.append(f'<text x="10" y="{y}">{html.escape(lane)} busy {busy_us(by_lane[lane]) / 1000:.2f} ms</text>')
        y += 18
    for name, colour in COLOURS.items():
        svg.append(f'<rect x="10" y="{y - 10}" width="12" height="12" fill="{colour}"/>')
        svg.append(f'<text x="28" y="{y}">{name}</text>')
        y += 18
    svg.append("</svg>")
    return "\n".join(svg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("out")
    p.add_argument("--title", default=None)
    args = p.parse_args()
    with open(args.trace) as f:
        trace = json.load(f)
    with open(args.out, "w") as f:
        f.write(draw(trace, args.title or args.trace))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
