#!/usr/bin/env bash
# Fresh-machine setup: a virtual environment in .venv with the pinned dependencies,
# and wiola_kernels (+ the model package wiola) installed editable with its C++
# extension built. Safe to run again (it reuses .venv and rebuilds incrementally).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0          # first, alone: the CPU build from local disk
python -m pip install -q -r requirements.txt
MAX_JOBS=${MAX_JOBS:-2} python -m pip install -q -e . --no-build-isolation --no-deps
python -c "import wiola_kernels as wk; import json; print(json.dumps(wk.backends('cpu'), indent=1))"
