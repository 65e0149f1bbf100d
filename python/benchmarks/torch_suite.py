"""PyTorch's own distributed test suite (``torch.testing._internal.distributed.distributed_test``,
what torch's ``test/distributed/test_distributed_spawn.py`` runs per backend) on "gloo" and
with collsched standing in for gloo, side by side.

    python python/benchmarks/torch_suite.py [--world 2 3] [-k EXPR | --all] [--write FILE]
    python python/benchmarks/torch_suite.py --ci python/benchmarks/torch_suite_gaps.json

Modes, each in processes of its own (the suite reads ``BACKEND`` when imported):

- ``gloo``: torch's gloo, the reference.
- ``as-gloo``: every gloo group the suite makes (its default group and the gloo groups inside
  tests) is collsched's process group, registered under gloo's name before any group exists;
  the suite's gates and test names are then gloo's, and the two runs compare test by test.

Each test spawns ``WORLD_SIZE`` ranks (spawn start method); tests that need a GPU skip. Needs
``pip install expecttest pytest`` (torch's test utilities import expecttest). The default
selection (``-k``) is the collective tests that run in a few minutes on 2 cores; ``--all``
runs the whole suite (about half an hour per mode and world size there). Prints per test the
outcome of each mode, then the tests gloo passes and collsched does not, with the first line of
collsched's error; ``--write`` keeps that as JSON. Exits 1 when there is any. ``--ci`` is
CI's check (``ci/python.sh``): a fast part of the selection (``CI_K``) in as-gloo mode at 2
ranks against the recorded gaps.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

MODE = os.environ.get("COLLSCHED_SUITE_MODE")

# The collective tests of the default selection (pytest -k).
DEFAULT_K = " or ".join(
    f"{name}"
    for name in (
        "test_get_backend",
        "test_barrier_full_group",
        "test_broadcast_full_group",
        "test_all_reduce_sum",
        "test_all_reduce_max",
        "test_reduce_sum",
        "test_all_gather",
        "test_gather",
        "test_scatter",
        "test_all_reduce_coalesced_sum",
        "test_all_gather_coalesced_simple",
        "test_all_to_all_single_equal_split",
        "test_barrier_timeout_full_group",
        "test_DistributedDataParallelCPU",
        "test_get_future",
        # Point to point.
        "test_send_recv",
        "test_isend",
        "test_irecv",
        "test_batch_isend_irecv",
        "test_send_recv_any_source",
    )
)

# What CI runs (--ci): a fast part of the default selection, in as-gloo mode at 2 ranks (no
# GPU variants, no Kineto profiler variants: the autograd profiler's check the same events).
CI_K = (
    "("
    + " or ".join(
        (
            "test_all_reduce_sum",
            "test_all_reduce_max",
            "test_broadcast_full_group",
            "test_all_gather_coalesced_simple",
            "test_reduce_sum",
            "test_barrier_full_group",
            "test_send_recv",
            "test_isend",
            "test_irecv",
            "test_batch_isend_irecv_gloo",
            "test_batch_isend_irecv_op_list_err",
        )
    )
    + ") and not nccl and not cuda and not torch_profiler"
)

if MODE is not None:
    # A process of the suite (the runner's pytest, or a rank it spawned: ranks import this
    # module to find the test class): set up before the suite is imported.
    os.environ["BACKEND"] = "gloo"
    import torch.distributed as dist

    from collsched.torch import distributed as _collsched

    if MODE == "as-gloo":
        dist.Backend.register_backend(
            "gloo",
            _collsched.creator("gloo"),
            extended_api=True,
            devices=["cpu"],
        )
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    class TestSuite(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self) -> None:
            super().setUp()
            self._spawn_processes()


def reason(text: str) -> str:
    """The innermost exception line of a test's failure text (a rank's, past the runner's
    "Process N exited" wrapper), or its first line."""
    # pytest prefixes an exception's lines with "E".
    lines = [ln for ln in (re.sub(r"^E(\s+|$)", "", raw.strip()) for raw in text.splitlines()) if ln]
    errors = [
        ln
        for ln in lines
        if re.match(r"^[\w.]*(Error|Exception|Failure|Timeout)\b", ln) and "exited with error code" not in ln
    ]
    if not errors:
        return (lines[0] if lines else "")[:240]
    # An assertion's detail is often on the line after its headline.
    at = len(lines) - 1 - lines[::-1].index(errors[-1])
    detail = lines[at + 1] if errors[-1].endswith("!") and at + 1 < len(lines) else ""
    return f"{errors[-1]} {detail}".strip()[:240]


def run_mode(mode: str, world: int, select: str | None, out: str) -> dict[str, tuple[str, str]]:
    """Runs the selection in ``mode`` at ``world`` ranks; returns each test's outcome (passed,
    failed, skipped) and its first message line."""
    xml = os.path.join(out, f"{mode}-{world}.xml")
    env = {
        **os.environ,
        "COLLSCHED_SUITE_MODE": mode,
        "WORLD_SIZE": str(world),
        "TEMP_DIR": tempfile.mkdtemp(dir=out),
        "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": "120",
        "COLLSCHED_TIMEOUT_SECS": os.environ.get("COLLSCHED_TIMEOUT_SECS", "60"),
        "COLLSCHED_SHM_ARENA_BYTES": os.environ.get("COLLSCHED_SHM_ARENA_BYTES", "1G"),
        "OMP_NUM_THREADS": "1",
    }
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__)]
    cmd += ["--junitxml", xml, "-o", "python_files=torch_suite.py"]
    if select:
        cmd += ["-k", select]
    subprocess.run(cmd, env=env, cwd=out, check=False)
    got: dict[str, tuple[str, str]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = case.get("name", "")
        outcome, text = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = "skipped" if kind == "skipped" else "failed"
                text = reason(f"{node.get('message') or ''}\n{node.text or ''}")
                break
        got[name] = (outcome, text)
    return got


def check(gaps_file: str, world: int = 2) -> int:
    """CI's check (``--ci``): 0 when every test of ``CI_K`` passes in as-gloo mode except the
    gaps recorded in ``gaps_file`` at ``world`` ranks, and those fail."""
    with open(gaps_file) as f:
        recorded = {g["test"] for g in json.load(f) if g["world"] == world}
    with tempfile.TemporaryDirectory() as out:
        got = run_mode("as-gloo", world, CI_K, out)
    if not got:
        print("torch_suite.py --ci: no test ran (is expecttest installed?)")
        return 1
    bad = []
    for name, (outcome, text) in sorted(got.items()):
        if outcome == "failed" and name not in recorded:
            bad.append(f"  {name}: fails and is not a recorded gap: {text}")
        elif outcome == "passed" and name in recorded:
            bad.append(f"  {name}: passes but is recorded as a gap in {gaps_file}: rerun the suite with --write")
    counts = {o: sum(1 for v in got.values() if v[0] == o) for o in ("passed", "failed", "skipped")}
    print(f"torch_suite.py --ci: world {world}, {len(got)} tests in as-gloo mode: {counts}")
    print("\n".join(bad) if bad else "  every failure is a recorded gap")
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2])
    ap.add_argument("-k", dest="select", default=DEFAULT_K, help="pytest -k expression over the suite's tests")
    ap.add_argument("--all", action="store_true", help="the whole suite")
    ap.add_argument("--write", help="JSON file for the tests gloo passes and collsched does not")
    ap.add_argument(
        "--ci",
        metavar="GAPS",
        help="CI's check: the CI selection in as-gloo mode at 2 ranks; fails if a test outside GAPS (the "
        "recorded JSON) fails, or a test recorded there passes",
    )
    args = ap.parse_args()
    if args.ci:
        sys.exit(check(args.ci))
    select = None if args.all else args.select
    gaps = []
    with tempfile.TemporaryDirectory() as out:
        for world in args.world:
            runs = {mode: run_mode(mode, world, select, out) for mode in ("gloo", "as-gloo")}
            names = sorted(set(runs["gloo"]) | set(runs["as-gloo"]))
            if not names:
                sys.exit("torch_suite.py: no test ran (is expecttest installed?)")
            counts = {
                m: {o: sum(1 for v in r.values() if v[0] == o) for o in ("passed", "failed", "skipped")}
                for m, r in runs.items()
            }
            print(f"\nworld {world}: {len(names)} tests; gloo {counts['gloo']}; collsched as gloo {counts['as-gloo']}")
            for name in names:
                g = runs["gloo"].get(name, ("missing", ""))
                c = runs["as-gloo"].get(name, ("missing", ""))
                print(f"  {name:<60} gloo {g[0]:<8} collsched {c[0]}")
                if g[0] == "passed" and c[0] != "passed":
                    gaps.append({"world": world, "test": name, "collsched": c[0], "reason": c[1]})
    print(f"\n{len(gaps)} tests pass on gloo and not on collsched:")
    for g in gaps:
        print(f"  world {g['world']} {g['test']}: {g['collsched']}: {g['reason']}")
    if args.write:
        with open(args.write, "w") as f:
            json.dump(gaps, f, indent=1)
            f.write("\n")
    sys.exit(1 if gaps else 0)


if __name__ == "__main__":
    main()
