#!/usr/bin/env bash
# The GPU check of the prefix-KV transfer's CUDA path (tests/test_kv_transfer_cuda.py), for a machine with
# a CUDA GPU, Python 3.12, torch, pytest, grpcio and protobuf, but no vLLM and no openai package.
# The wheels in .whl/ bring the runtime versions the generated protos and the kv_offload client
# need (protobuf >= 7.35.1, grpcio >= 1.85.1, grpcio-status, googleapis-common-protos; numpy if missing),
# into /tmp/site only.
# The wheels go in .whl/ (git-ignored: add `/.whl/` to .git/info/exclude), fetched on a machine with pip:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl protobuf==7.36.2 grpcio==1.85.3 grpcio-status==1.85.3 googleapis-common-protos==1.76.0
#   (and numpy into .whl/if-missing/ for a machine without it)
# Run from anywhere: bash tests/gpu_check.sh   (the log goes to $OUT/cuda_check.log)
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/cuda_check}"
mkdir -p "$OUT"
{
    echo "== $(date -u +%FT%TZ) in $PWD"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD \
        || { echo "installing the wheels failed"; exit 2; }
    # torch's .numpy() (the transfer code's byte views) needs numpy; only installed where there is none.
    python3 -c "import numpy" 2>/dev/null \
        || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/if-missing/*.whl \
        || { echo "installing numpy failed"; exit 2; }
    nvidia-smi -L
    df -h /dev/shm
    python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'available:', torch.cuda.is_available())"
    python3 -c "import google.protobuf as p, grpc, numpy; print('protobuf', p.__version__, p.__file__); print('grpcio', grpc.__version__, 'numpy', numpy.__version__)"
    export PYTHONUNBUFFERED=1
    time timeout 300 python3 -m pytest --noconftest -p no:cacheprovider tests/test_kv_transfer_cuda.py -v -rA
    status=$?
    echo "== pytest exit status $status"
    exit "$status"
} 2>&1 | tee "$OUT/cuda_check.log"
exit "${PIPESTATUS[0]}"
