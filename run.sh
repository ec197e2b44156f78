#!/usr/bin/env bash
# Set up comarl in ./.venv and run the demo or the test suite.
#   ./run.sh demo [comarl demo options]   train two tiny agents to coordinate (offline, CPU)
#   ./run.sh test [pytest options]        run the whole test suite (2 pytest-xdist workers; -n 0 for one process)
# torch is installed only when the venv lacks it, as torch==2.13.0 from pip's indexes (the CPU build
# where the index serves it, as here; PyPI's default elsewhere is a CUDA build, see README);
# a torch you installed into .venv yourself (e.g. a CUDA build) is left alone.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
fi
.venv/bin/python -m pip install --quiet -e ".[dev]"
cmd="${1:-demo}"
shift || true
case "$cmd" in
    demo) exec .venv/bin/comarl demo "$@" ;;
    test) exec .venv/bin/python -m pytest -n 2 "$@" ;;  # two workers: the suite is sized for 2 cores
    *) echo "usage: ./run.sh demo|test [args...]" >&2; exit 2 ;;
esac
