#!/usr/bin/env bash
# The Python package: lint (ruff), build and install it (maturin, release) into a virtual
# environment that has torch, then run its tests (pytest). The environment is made once and
# reused ($COLLSCHED_VENV); torch from PyPI is the CUDA build (about 5 GB with its wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/env.sh
venv="$COLLSCHED_VENV"
if [ ! -x "$venv/bin/python" ]; then
  echo "ci/python: python3 -m venv $venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
# maturin's build hooks run the maturin executable from PATH.
export PATH="$venv/bin:$PATH"
# transformers: python/tests/test_hf.py shards Hugging Face models (small configs, no download).
# expecttest: torch's test utilities import it (PyTorch's own suite, python/benchmarks/torch_suite.py).
if ! "$py" -c "import torch, maturin, pytest, ruff, safetensors, transformers, expecttest" >/dev/null 2>&1; then
  echo "ci/python: pip install torch maturin pytest ruff safetensors transformers expecttest into $venv"
  "$py" -m pip install -q --disable-pip-version-check --upgrade pip
  "$py" -m pip install -q --disable-pip-version-check 'torch==2.15.*' 'maturin>=1.9,<2' 'pytest>=8' 'ruff>=0.6' 'safetensors>=0.4' \
    'transformers>=5,<6' 'expecttest>=0.2'
fi
(cd python && "$venv/bin/ruff" check . && "$venv/bin/ruff" format --check .)
# The scripts of ci/ and gpu/ under the package's rules.
"$venv/bin/ruff" check --config python/pyproject.toml ci gpu
"$venv/bin/ruff" format --config python/pyproject.toml --check ci gpu
echo "ci/python: pip install ./python (maturin, release, with the mpi backend)"
# With the mpi feature (ci/setup.sh installs Open MPI and libclang), so that test_mpi.py runs.
MATURIN_PEP517_ARGS="--features mpi" \
  "$py" -m pip install -q --disable-pip-version-check --no-build-isolation --force-reinstall --no-deps ./python
log="${CARGO_TARGET_DIR:-target}/ci-pytest.log"
mkdir -p "$(dirname "$log")"
# From the repository root: the installed package is imported, not python/collsched.
"$venv/bin/pytest" -q -rs -p no:cacheprovider python/tests 2>&1 | tee "$log"
status="${PIPESTATUS[0]}"
# PyTorch's own distributed suite, a fast part of it, with collsched standing in for gloo: any
# failure that is not a gap recorded in torch_suite_gaps.json fails the step, and so does a
# recorded gap that passes (the record is then stale).
echo "ci/python: PyTorch's distributed suite (torch_suite.py --ci)"
suite=0
"$py" python/benchmarks/torch_suite.py --ci python/benchmarks/torch_suite_gaps.json || suite=$?
if [ "$status" -eq 0 ]; then status=$suite; fi
exit "$status"
