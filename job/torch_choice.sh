#!/bin/sh
# Which torch build the local venv gets, and from where: prints the pip arguments for
# `pip install` on stdout (the Makefile puts them before numpy pyyaml submitit) and one line
# saying what it chose, and why, on stderr.
#
#   sh job/torch_choice.sh              # the arguments, and the choice on stderr
#   sh job/torch_choice.sh --dry-run    # only the choice, as one line on stdout
#
# In order, the first that applies:
#   1. PIP_EXTRA given (make … PIP_EXTRA='--index-url …'): exactly that, as given.
#   2. pip is configured with its own wheels or index (find-links, index-url, extra-index-url or
#      no-index in `pip config list`, which covers PIP_* variables, /etc/pip.conf,
#      /etc/xdg/pip and the user's file): pip resolves TORCH_SPEC from there, no other index.
#      Offline machines with local wheels are served from them, never from the internet.
#   3. an NVIDIA GPU (`nvidia-smi -L` lists one, or the driver shows /proc/driver/nvidia): PyPI's
#      torch, the CUDA build.
#   4. otherwise the CPU-only build from PyTorch's CPU wheel index (about 200 MB instead of
#      several GB of CUDA libraries for a gloo smoke test), PyPI for everything else.
# TORCH_SPEC (default torch==2.13.0) is the requirement in every case.
#
# For tests: DDP_SMOKE_GPU=1|0 stands in for the GPU probe; PIP (default `python3 -m pip`) is
# the pip whose configuration is read.
set -eu

CPU_INDEX=https://download.pytorch.org/whl/cpu
PYPI=https://pypi.org/simple
spec=${TORCH_SPEC:-torch==2.13.0}
pip=${PIP:-python3 -m pip}

has_gpu() {
    case "${DDP_SMOKE_GPU:-}" in
        1) return 0 ;;
        0) return 1 ;;
    esac
    { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; } \
        || [ -e /proc/driver/nvidia ]
}

# `pip config list` prints one `scope.key='value'` line per setting.
configured=$($pip config list 2>/dev/null \
    | grep -E "^[^=]*\.(find-links|index-url|extra-index-url|no-index)='[^']" | head -n 1 || true)

if [ -n "${PIP_EXTRA:-}" ]; then
    args="$PIP_EXTRA $spec"
    why="$spec with PIP_EXTRA as given ($PIP_EXTRA)"
elif [ -n "$configured" ]; then
    args="$spec"
    why="$spec from pip's own configuration ($configured)"
elif has_gpu; then
    args="$spec"
    why="$spec, the CUDA build from PyPI (an NVIDIA GPU is present)"
else
    args="--index-url $CPU_INDEX --extra-index-url $PYPI $spec"
    why="$spec, the CPU-only build from $CPU_INDEX (no NVIDIA GPU here)"
fi

if [ "${1:-}" = "--dry-run" ]; then
    echo "torch: $why"
else
    echo "ddp-smoke: torch: $why" >&2
    echo "$args"
fi
