#!/usr/bin/env bash
# The device checks in one go, on a machine with a CUDA GPU and this repository: the `gpu` tests,
# then benchmarks/gpu_bench.py (llmq against transformers' static batching, bfloat16, 1.1 B), within
# 8 minutes. Installs nothing from the network. Needs a Python whose torch is a CUDA build, with
# transformers, safetensors, tokenizers and pytest (PYTHON, default .venv/bin/python, else python3);
# project packages it lacks can come as wheels in WHEELS (default .whl/), installed with --no-index.
#
#     bash benchmarks/gpu_check.sh
#     PYTHON=python3 WHEELS=.whl bash benchmarks/gpu_check.sh --requests 128
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
WHEELS=${WHEELS:-.whl}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
started=$(date +%s)

if compgen -G "$WHEELS/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/llmq-site "$WHEELS"/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/llmq-site"
fi
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; \
print('gpu_check:', torch.__version__, torch.cuda.get_device_name(0))"

echo "== the gpu tests"
timeout 170 "$PYTHON" -m pytest -q -p no:cacheprovider -m "gpu or gpu2" tests/test_gpu.py tests/model
echo "== the Triton kernel compiled for the GPU, against the torch path"
timeout 60 "$PYTHON" -m pytest -q -p no:cacheprovider tests/model/test_triton_attention.py
echo "== llmq against transformers on the GPU"
timeout 240 "$PYTHON" benchmarks/gpu_bench.py "$@"
echo "gpu_check: done in $(( $(date +%s) - started )) s"
