#!/usr/bin/env bash
# The GPU check (issues 14 and 33), as one bounded script for a lent GPU host with no package
# index (../shared/gpu.md): it installs the wheels carried in .whl/ and the checkout, runs the
# GPU tests, then the measurements of benchmarks/gpu_check.py, one step each: ResNet-152
# served (the lone client, bf16 and fp32, 1 and 2 workers, py-spy on the bf16 worker),
# ResNet-50 JPEG -> label, TorchServe 0.12 beside it (skipped, saying why, where this host
# cannot run it), and workers sharing the GPU's weights (share_weights: cuda_ipc). Every step
# runs under `timeout`, within what is left of TOTAL_S, and a failing step does not stop the
# next. The output ends with the worker's profile summary and exactly one line:
#   RESULT card=<name> resnet152_bf16_img_s=<n> resnet152_fp32_img_s=<n> lone_p50_ms=<n>
#     resnet50_jpeg_img_s=<n> torchserve_resnet152_img_s=<n> gpu_busy_pct=<n>   (one line)
# Logs, results.json and the profiles land in $OUT.
#
#   OUT=/tmp/gpu-out bash benchmarks/gpu_check.sh                       # a lent GPU, ~9 min
#   DEVICE=cpu TINY=1 SETUP=0 TESTS= TORCHSERVE=0 STEPS=all PY=.venv/bin/python \
#     PYTHONPATH=$PWD OUT=/tmp/dry DURATION=0.5 WARMUP=0.3 bash benchmarks/gpu_check.sh
#                                     # the CPU dry run (tests/integration/test_gpu_check_dry_run.py)
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
TOTAL_S=${TOTAL_S:-540}     # the whole script, setup to RESULT line
RESERVE_S=${RESERVE_S:-15}  # kept for the summary at the end
DURATION=${DURATION:-5}     # seconds measured per served run
WARMUP=${WARMUP:-3}
SETUP=${SETUP:-1}           # 0: use the Python environment as it is (no pip)
TINY=${TINY:-0}             # 1: small models and JPEGs (with DEVICE=cpu: the dry run)
TORCHSERVE=${TORCHSERVE:-1} # 0: TorchServe not looked for (its note says so)
STEPS=${STEPS:-each}        # each: one call a step, each under timeout; all: one call
started=$(date +%s)
stamp() { echo "== $(( $(date +%s) - started )) s: $*"; }
# The seconds a step may take: what it asks for, within what is left less the reserve.
limit_for() {
    local left=$(( TOTAL_S - RESERVE_S - ($(date +%s) - started) ))
    echo $(( $1 < left ? $1 : left ))
}
# bounded NAME SECONDS COMMAND...: COMMAND under `timeout`, its output in $OUT/NAME.log, the
# end of it shown; its failure is reported, never fatal.
bounded() {
    local name=$1 limit
    limit=$(limit_for "$2")
    shift 2
    if (( limit < 20 )); then echo "$name: skipped, no time left"; return; fi
    stamp "$name (at most $limit s)"
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$?"
    tail -n "${TAIL:-20}" "$OUT/$name.log"
}
# measure STEP SECONDS [OPTIONS]: one step of benchmarks/gpu_check.py, told its budget (a
# little less than its timeout, so that it skips the runs it has no time for and ends itself).
measure() {
    local step=$1 limit
    limit=$(limit_for "$2")
    shift 2
    local options=()
    if [ "$TINY" = 1 ]; then options=(--tiny); fi
    if [ "$TORCHSERVE" = 0 ]; then options+=(--no-torchserve); fi
    bounded "$step" "$limit" "$PY" -m benchmarks.gpu_check "$step" --out "$OUT" \
        --device "$DEVICE" --duration "$DURATION" --warmup "$WARMUP" \
        --budget $(( limit > 30 ? limit - 15 : limit )) "${options[@]}" "$@"
}

setup() {
    if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; fi
    if [ "$SETUP" = 1 ]; then
        # TorchServe's own packages stay out of the environment: TorchServe runs from a folder
        # of its own (benchmarks/torchserve.py, find_install), and its `ts` would shadow
        # batchserve's shim in the workers.
        wheels=$(ls .whl/*.whl 2>/dev/null | grep -v -e '/torchserve-' -e '/torch_model_archiver-' \
            -e '/torch_workflow_archiver-')
        # shellcheck disable=SC2086
        if [ -n "$wheels" ]; then "$PY" -m pip install -q --no-index --no-deps --no-compile $wheels; fi
        "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
    fi
    "$PY" -m benchmarks.gpu_check versions
    for tool in py-spy java; do command -v "$tool" || echo "no $tool on PATH"; done
}
export PY SETUP
if [ "$SETUP" = 1 ]; then bounded setup 60 bash -c "$(declare -f setup); setup"; fi
# Scripts installed with the wheels (py-spy) are found on the interpreter's scripts folder.
PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null):$PATH"
export PATH
if [ "$DEVICE" = cpu ]; then CARD=cpu; else
    CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
fi

# The GPU tests: the gpu-marked ones and those that run on CUDA when a GPU is there (TESTS=
# empty: none). Other parts of issue 33 add their files to this list.
TESTS=${TESTS-tests/unit/test_images.py tests/unit/test_weights_ipc.py
tests/unit/test_cuda_graphs.py
tests/integration/test_shared_weights.py::test_on_cuda_a_second_worker_sharing_through_cuda_ipc_adds_no_copy_of_the_weights
tests/integration/test_forked_workers.py::test_forked_workers_run_on_the_gpu_and_answer_as_a_fresh_one_does
tests/integration/test_forked_workers.py::test_a_fork_server_that_initialised_cuda_refuses_to_fork
tests/integration/test_vision.py}
if [ -z "$TESTS" ]; then echo "tests: none asked for"
elif ! "$PY" -c 'import pytest' 2>/dev/null; then echo "tests: skipped, no pytest (add its wheels to .whl/)"
else
    # shellcheck disable=SC2086
    bounded tests 75 "$PY" -m pytest -q -rs -p no:cacheprovider -W default ${PYTEST_ARGS:-} $TESTS
fi

if [ "${STEPS:-each}" = all ]; then
    # The dry run: every step in one call, sharing one server (seconds, not minutes).
    measure all 200
else
    measure resnet152 165 --profile
    measure resnet50 70
    measure torchserve 85
    measure ipc 110
fi

stamp summary
# This run's servers' logs (gpu_check.py lists their folders), nobody else's.
if [ -s "$OUT/servers.txt" ]; then
    xargs -d '\n' tar czf "$OUT/logs.tgz" --ignore-failed-read < "$OUT/servers.txt" 2>/dev/null
fi
for summary in "$OUT"/profile/*.summary.txt; do
    if [ -f "$summary" ]; then cat "$summary"; fi
done
"$PY" -m benchmarks.gpu_result "$OUT/results.json" --card "${CARD:-unknown}" \
    > "$OUT/result.txt" 2> "$OUT/result.err"
if tail -n 1 "$OUT/result.txt" | grep -q '^RESULT '; then
    grep -v '^RESULT ' "$OUT/result.txt"
    tail -n 1 "$OUT/result.txt"
else
    cat "$OUT/result.err"
    echo "RESULT card=$(echo "${CARD:-na}" | tr ' ' '_') resnet152_bf16_img_s=na" \
        "resnet152_fp32_img_s=na lone_p50_ms=na resnet50_jpeg_img_s=na" \
        "torchserve_resnet152_img_s=na gpu_busy_pct=na"
fi
