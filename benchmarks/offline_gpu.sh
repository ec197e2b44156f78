#!/usr/bin/env bash
# The GPU benchmark and device checks on a GPU machine without network (docs/benchmarks.md, "On a GPU").
#
#   bash benchmarks/offline_gpu.sh prepare   # here, with access to PyPI: peers' wheels + workload into .device/
#   bash benchmarks/offline_gpu.sh run       # there (python3 with CUDA torch + transformers): writes to $OUT
#
# The GPU machine's python3 must already hold torch (CUDA), transformers, accelerate, pyarrow, pandas and
# huggingface_hub; prepare fetches what the peers add (Python 3.12 wheels: PY_VERSION=3.11 for another).
# CoMLRL imports wandb at import time; the benchmark never logs to it, so a stand-in module replaces it there.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
    mkdir -p .device/whl .device/stub/wandb
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any \
        -d .device/whl trl==1.16.0 comlrl==1.4.3 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
    cat > .device/stub/wandb/__init__.py <<'PY'
"""Stand-in for wandb on an offline machine: CoMLRL imports it; with run = None it never calls it."""
run = None


def init(*args, **kwargs):
    raise RuntimeError("wandb stand-in: not available offline")


def log(*args, **kwargs):
    pass


def finish(*args, **kwargs):
    pass


class Html:
    def __init__(self, *args, **kwargs):
        pass
PY
    py="${PYTHON:-python3}"
    [ -x .venv/bin/python ] && py="${PYTHON:-$PWD/.venv/bin/python}"  # the workload needs transformers + tokenizers
    (cd benchmarks && "$py" -c "from pathlib import Path; from workload import build_workload; build_workload(Path('.workload'))")
    echo "ready: carry .device and benchmarks/.workload to the GPU machine, then: bash benchmarks/offline_gpu.sh run"
    ;;
run)
    OUT="${OUT:-benchmarks/results}"
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/comarl-site \
        .device/whl/*.whl
    export PYTHONPATH="$PWD/src:/tmp/comarl-site:$PWD/.device/stub"
    nvidia-smi -L || true
    python3 -c "import torch, transformers, trl, comlrl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, torch.cuda.get_device_name(0))"
    echo "== bench $(date +%T)"
    # one repeat of every case the targets name, plus agents as processes sharing the GPU
    timeout "${BENCH_S:-330}" python3 benchmarks/bench.py --device cuda --peers-here --keep-going --repeats 1 \
        --agents 1,2 --floor-agents 1 --timeout 120 --out "$OUT" 2>&1 | tee "$OUT/bench.txt" || true
    echo "== device_check $(date +%T)"
    timeout "${CHECK_S:-240}" python3 benchmarks/device_check.py --device cuda 2>&1 | grep -v "it/s\]" \
        | tee "$OUT/device_check.txt" || true
    echo "== done $(date +%T)"
    ;;
*)
    echo "usage: bash benchmarks/offline_gpu.sh prepare|run" >&2
    exit 2
    ;;
esac
