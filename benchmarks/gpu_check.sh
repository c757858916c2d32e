#!/usr/bin/env bash
# The GPU check, as one script for a lent GPU host with no package index (../shared/gpu.md):
# installs the missing wheels from .whl/ and the checkout, runs the GPU tests (the gpu-marked
# ones, the image pipeline, the image classifier and ResNet-152 through the real server, on
# CUDA), then `python -m benchmarks.resnet152 --device cuda`. Every step is bounded in time
# and a failing one does not stop the next; logs and the results land in $OUT.
#
#   OUT=/tmp/gpu-out TESTS_S=150 BENCH_S=300 DURATION=6 bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
TESTS_S=${TESTS_S:-150}
BENCH_S=${BENCH_S:-300}
DURATION=${DURATION:-6}
PYTEST_ARGS=${PYTEST_ARGS:-}
started=$(date +%s)
stamp() { echo "== $(( $(date +%s) - started )) s: $*"; }

{
    stamp setup
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
    python3 -c 'import torch, torchvision; print(torch.__version__, torchvision.__version__,
torch.cuda.is_available(), torch.cuda.get_device_name(0))'
    stamp setup done
} > "$OUT/setup.log" 2>&1
tail -3 "$OUT/setup.log"

TESTS=${TESTS:-tests/unit/test_images.py tests/unit/test_weights_ipc.py
tests/unit/test_cuda_graphs.py
tests/integration/test_forked_workers.py::test_forked_workers_run_on_the_gpu_and_answer_as_a_fresh_one_does
tests/integration/test_forked_workers.py::test_a_fork_server_that_initialised_cuda_refuses_to_fork
tests/integration/test_vision.py tests/e2e/test_resnet152.py}
# shellcheck disable=SC2086
timeout "$TESTS_S" python3 -m pytest -q -rs -p no:cacheprovider -W default $PYTEST_ARGS \
    $TESTS > "$OUT/tests.log" 2>&1
echo "tests rc=$?"
tail -15 "$OUT/tests.log"
stamp tests done

# BENCH_ARGS: more options for the benchmark (--plan, --no-in-process, --properties,
# --profile "$OUT/profile"); BENCH2_ARGS: a second run after it, with its own options.
bench() {
    # shellcheck disable=SC2086
    timeout "$BENCH_S" python3 -m benchmarks.resnet152 --device cuda --duration "$DURATION" \
        --out "$OUT/gpu$1.json" $2 > "$OUT/bench$1.log" 2>&1
    echo "bench$1 rc=$?"
    tail -40 "$OUT/bench$1.log"
    stamp "bench$1 done"
}
bench "" "${BENCH_ARGS:-}"
if [ -n "${BENCH2_ARGS:-}" ]; then bench 2 "$BENCH2_ARGS"; fi

# The servers' and workers' logs, for what failed.
tar czf "$OUT/logs.tgz" /tmp/bench-*/logs /tmp/pytest-of-*/pytest-*/*/logs /tmp/profile* 2>/dev/null
nvidia-smi --query-gpu=memory.used --format=csv
