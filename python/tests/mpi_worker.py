"""A rank of the MPI jobs ``test_mpi.py`` starts with ``mpirun``: joins with
``collsched.torch.init(backend="mpi")``, trains the spec (argv 1, JSON) as the other tests'
ranks do, and writes what it returns to ``rank-R.json`` in the directory argv 2."""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workers  # noqa: E402


def main() -> None:
    spec, out = json.loads(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    import collsched.torch as cst

    world = cst.init(backend="mpi")
    result = workers.train(world.rank, world.world, spec)
    with open(os.path.join(out, f"rank-{world.rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
