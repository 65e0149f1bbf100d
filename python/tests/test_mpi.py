"""collsched.torch on the mpi backend: ranks started by Open MPI's ``mpirun`` (not by the
tests), ``init(backend="mpi")``, training against plain unsharded PyTorch. Skipped, saying
why, without ``mpirun`` or with a package built without the ``mpi`` feature."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from collsched import _native

import models
import parity

HERE = os.path.dirname(os.path.abspath(__file__))


def _mpirun(world: int, spec: dict, out: str) -> subprocess.CompletedProcess:
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(world)]
    cmd += ["-x", "COLLSCHED_TIMEOUT_SECS=60", "-x", "OMP_NUM_THREADS=1"]
    cmd += [sys.executable, os.path.join(HERE, "mpi_worker.py"), json.dumps(spec), out]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (apt install openmpi-bin)")
@pytest.mark.skipif(not _native.HAS_MPI, reason="package built without the mpi feature")
@pytest.mark.parametrize("world", [2, 3])
def test_fully_shard_on_mpi_matches_plain_pytorch(world, tmp_path):
    spec = {"model": "mlp", "steps": 3, "strategy": "even", "bucket_mb": 0.0005, "backend": "mpi"}
    done = _mpirun(world, spec, str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    runs = []
    for r in range(world):
        with open(tmp_path / f"rank-{r}.json") as f:
            runs.append(json.load(f))
    parity.check(runs, models.reference(spec, world))
