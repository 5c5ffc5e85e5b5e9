#!/usr/bin/env bash
# The device checks in one go, on a machine with a CUDA GPU and this repository: the `gpu` tests,
# the Triton kernel's tests compiled for the GPU, then benchmarks/gpu_bench.py (llmq against
# transformers' static batching, bfloat16, 1.1 B), within 8 minutes. Installs nothing from the
# network. Needs a Python whose torch is a CUDA build, with transformers, safetensors, tokenizers and
# pytest (PYTHON, default .venv/bin/python, else python3); project packages it lacks can come as
# wheels in WHEELS (default .whl/), installed with --no-index. Every part runs even when an earlier
# one fails (a failing test should not hide the figures); the exit status says whether all passed.
#
#     bash benchmarks/gpu_check.sh
#     PYTHON=python3 WHEELS=.whl bash benchmarks/gpu_check.sh --requests 128
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
WHEELS=${WHEELS:-.whl}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
started=$(date +%s)

if compgen -G "$WHEELS/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/llmq-site "$WHEELS"/*.whl || exit
    export PYTHONPATH="$PYTHONPATH:/tmp/llmq-site"
fi
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; \
print('gpu_check:', torch.__version__, torch.cuda.get_device_name(0))" || exit

failed=()
part() {  # part NAME SECONDS COMMAND...: runs one part under a time limit and remembers a failure
    local name=$1 seconds=$2
    shift 2
    echo "== $name ($(( $(date +%s) - started )) s in)"
    timeout "$seconds" "$@" || failed+=("$name (exit $?)")
}
part "the gpu tests" 170 "$PYTHON" -m pytest -q -p no:cacheprovider -m "gpu or gpu2" tests/test_gpu.py tests/model
part "the Triton kernel compiled for the GPU, against the torch path" 90 \
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/model/test_paged_attention_kernels.py
part "llmq against transformers on the GPU" 240 "$PYTHON" benchmarks/gpu_bench.py "$@"
echo "gpu_check: done in $(( $(date +%s) - started )) s"
if (( ${#failed[@]} )); then
    printf 'gpu_check: FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "gpu_check: all parts passed"
