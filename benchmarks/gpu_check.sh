#!/usr/bin/env bash
# The GPU check of issue 17, prepared to run in one go on a lent GPU machine (one H200).
#
# What it measures:
#   1. setup   a Python with CUDA torch: reuses .venv-gpu or .venv when its torch sees a
#              CUDA device, else makes .venv-gpu and installs torch (PyPI's CUDA build),
#              transformers, pytest and gradientmail there. Log: install.log.
#   2. tests   the CUDA-only tests (TorchBackend("cuda") against numpy's bytes; rounds
#              closed on CUDA against numpy's) and the zero-copy / TorchAdapter tests
#              (load, apply, snapshot, delta, rebase), whose `device` fixture runs each
#              on "cpu" and on "cuda". On a GPU a skipped CUDA case fails the stage.
#              Output: tests.txt, tests.xml (JUnit).
#   3. learner benchmarks/learner.py, GPT-2 124M in bf16 on cuda, batch 8x1024: step()
#              costs, then steps/s with the learner over without it in paired blocks,
#              closer embedded and closer in a `gradientmail sync` process, beside a
#              without/without pairing that shows the noise of the pairing:
#              learner-h500  at the 124M recipe's cadence, H=500, P=4 (a round every 125
#                            steps): 3 blocks of 125 steps, so every block with the
#                            learner holds exactly one due round;
#              learner-h100  H=100, P=4 (a round every 25 steps): 6 blocks of 25 steps.
#              Tables: learner-h500.md, learner-h100.md; full output: learner-*.log.
#   summary.txt: each stage's exit code, seconds and budget, the CUDA test cases' count,
#   and the throughput rows of both tables; env.txt: GPU, driver, torch, tree state.
#   The script exits 1 when a stage failed, ran out of time or was skipped.
#
# How to run, from anywhere (it works in the repository root):
#   OUT=/path/to/empty/dir bash benchmarks/gpu_check.sh      # default OUT=./gpu-out
#   GPU_CHECK_ALLOW_CPU=1 OUT=/tmp/gpu-dry bash benchmarks/gpu_check.sh
# The second is a dry run of the plumbing on a machine without a GPU: it does not require
# CUDA torch (the CUDA cases skip) and runs the learner stages as --model tiny --device cpu
# --steps 5 --blocks 2 at the same H and P.
#
# Stage budgets (each stage runs under `timeout`; one that fails or runs out is recorded
# and the next one runs; rc 124 = timed out):
#   setup         150 s   (a fresh install downloads ~3 GB of torch + CUDA wheels;
#                          reusing a working venv takes seconds)
#   tests          60 s   (47 test cases, ~20 s with CUDA start-up)
#   learner-h500  180 s   (~30 s fixed: imports, model, step() timings, three learner
#                          start/close; then 6 x 3 x 125 = 2,250 timed steps at the
#                          ~53 ms/step an H200 gave before (19 steps/s without the
#                          learner, torch 2.11; benchmarks/RESULTS.md) = ~120 s)
#   learner-h100  120 s   (~30 s fixed + 6 x 6 x 25 = 900 steps = ~50 s)
#   total at most 510 s (8.5 min), expected ~6 min.
# Override with GPU_CHECK_{SETUP,TESTS,H500,H100}_S, and the learner sizes with
# GPU_CHECK_H500_STEPS / _BLOCKS, GPU_CHECK_H100_STEPS / _BLOCKS (raise the budget too).

set -uo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
ROOT=$(dirname "$(dirname "$SELF")")
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT" || exit 1
export OUT

ALLOW_CPU=${GPU_CHECK_ALLOW_CPU:-0}
TORCH_SPEC=${GPU_CHECK_TORCH:-torch==2.13.0}             # the developers' torch, CUDA build
TRANSFORMERS_SPEC=${GPU_CHECK_TRANSFORMERS:-transformers==5.24.0}
export ALLOW_CPU TORCH_SPEC TRANSFORMERS_SPEC
# GPT-2 is built from a config (no weights); nothing may try the hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# This tree's gradientmail, whatever a reused venv has installed.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# What a usable interpreter must import; with a GPU, its torch must see the device.
PROBE=$(cat <<'EOF'
import os, hypothesis, ml_dtypes, numpy, pytest, safetensors, torch, transformers
import gradientmail
if os.environ.get("ALLOW_CPU") != "1":
    assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device"
EOF
)
export PROBE

# -- stages, each run as `bash gpu_check.sh _stage NAME ARGS...` under timeout ------------

stage_setup() {
    local venv why
    for venv in .venv-gpu .venv; do
        [ -x "$venv/bin/python" ] || continue
        if why=$("$venv/bin/python" -c "$PROBE" 2>&1); then
            echo "reusing $venv"
            echo "$ROOT/$venv/bin/python" >"$WORK/python"
            return 0
        fi
        echo "$venv is not usable: $(tail -n 1 <<<"$why")"
    done
    python3 -m venv .venv-gpu || return 1
    local pip=(.venv-gpu/bin/python -m pip install --no-cache-dir --progress-bar off
               "$TORCH_SPEC" "$TRANSFORMERS_SPEC" -e '.[torch,zstd]'
               pytest pytest-timeout hypothesis)
    # The developers' machines configure pip with a find-links folder holding
    # torch-2.13.0+cpu, which pip prefers to PyPI's CUDA build of the same version (a
    # local label sorts higher): install from PyPI alone, and fall back to the machine's
    # config if that fails (the probe below then says whether torch sees the GPU).
    if [ "$ALLOW_CPU" = 1 ]; then
        "${pip[@]}" || return 1
    elif ! env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "${pip[@]}"; then
        echo "install from PyPI alone failed; retrying with the machine's pip config"
        "${pip[@]}" || return 1
    fi
    .venv-gpu/bin/python -c "$PROBE" || return 1
    echo "$ROOT/.venv-gpu/bin/python" >"$WORK/python"
}

stage_tests() {
    # The CUDA-only tests of test_backends and test_diloco_aggregator (today
    # test_cuda_values_match_numpy_bytes, test_cuda_closes_rounds_to_the_numpy_bytes) and
    # every zero-copy and adapter test. Chosen by -k, not node ids: a node id not found
    # stops pytest before it runs anything, so one renamed test would cost them all.
    "$PY" -m pytest -rA --junitxml="$OUT/tests.xml" --continue-on-collection-errors \
        -k "cuda or test_zero_copy or test_adapter_torch" \
        tests/test_backends.py tests/test_diloco_aggregator.py \
        tests/test_zero_copy.py tests/test_adapter_torch.py
    local rc=$?
    # A CUDA case that skipped on the GPU machine checked nothing: say so, and fail.
    if ! "$PY" - "$OUT/tests.xml" >"$WORK/cuda-cases" <<'EOF'
import os, sys
import xml.etree.ElementTree as ET

cases = [c for c in ET.parse(sys.argv[1]).iter("testcase") if "cuda" in c.get("name", "")]
bad = {k: sum(c.find(k) is not None for c in cases) for k in ("skipped", "failure", "error")}
ran = len(cases) - bad["skipped"]
print(f"cuda cases: {len(cases)}, ran {ran}, skipped {bad['skipped']}, "
      f"failed {bad['failure'] + bad['error']}")
sys.exit(0 if os.environ["ALLOW_CPU"] == "1" or (cases and not bad["skipped"]) else 1)
EOF
    then
        [ "$rc" = 0 ] && rc=1
    fi
    cat "$WORK/cuda-cases"
    return "$rc"
}

stage_learner() {  # H, steps, blocks, name
    local dev=(--model 124m --device cuda)
    rm -f "$OUT/$4.md"  # a table left by an earlier run in this OUT is not this run's
    [ "$ALLOW_CPU" = 1 ] && dev=(--model tiny --device cpu)
    "$PY" benchmarks/learner.py "${dev[@]}" --sync-every "$1" --fragments 4 \
        --steps "$2" --blocks "$3" --no-append --table-out "$OUT/$4.md"
}

if [ "${1:-}" = _stage ]; then
    case $2 in
        setup) stage_setup ;;
        tests) stage_tests ;;
        learner) stage_learner "${@:3}" ;;
        *) echo "unknown stage $2" >&2; exit 2 ;;
    esac
    exit
fi

# -- the run ------------------------------------------------------------------------------

WORK=$(mktemp -d)
export WORK
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
SUMMARY=$OUT/summary.txt
mode=gpu
[ "$ALLOW_CPU" = 1 ] && mode="cpu dry run (GPU_CHECK_ALLOW_CPU=1)"
{
    echo "gpu_check $(date -u '+%F %T UTC'), $mode, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    printf '%-14s %-5s %8s %8s\n' stage rc seconds budget
} >"$SUMMARY"

run_stage() {  # name budget log stage-args...
    local name=$1 budget=$2 log=$3 t0=$SECONDS rc
    shift 3
    echo "== $name (budget ${budget}s) $(date -u +%T)"
    # timeout signals its whole process group, so the `gradientmail sync` process a
    # learner run starts goes with it.
    timeout -k 15 "$budget" bash "$SELF" _stage "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    printf '%-14s %-5s %8s %8s\n' "$name" "$rc" "$((SECONDS - t0))" "$budget" >>"$SUMMARY"
    [ "$rc" = 0 ] || failed=1
}

skip() {  # reason names...
    local reason=$1 name
    shift
    for name in "$@"; do
        printf '%-14s %-5s %8s %8s  skipped: %s\n' "$name" - 0 - "$reason" >>"$SUMMARY"
    done
    failed=1
}

if [ "$ALLOW_CPU" = 1 ]; then
    h500=(500 5 2) h100=(100 5 2)
else
    h500=(500 "${GPU_CHECK_H500_STEPS:-125}" "${GPU_CHECK_H500_BLOCKS:-3}")
    h100=(100 "${GPU_CHECK_H100_STEPS:-25}" "${GPU_CHECK_H100_BLOCKS:-6}")
fi

failed=0
run_stage setup "${GPU_CHECK_SETUP_S:-150}" "$OUT/install.log" setup
PY=$(cat "$WORK/python" 2>/dev/null)
if [ -z "$PY" ]; then
    skip "no Python with CUDA torch (see install.log)" tests learner-h500 learner-h100
else
    export PY
    {
        echo "python: $PY"
        "$PY" -c 'import sys, torch, transformers, numpy as np
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__, "numpy", np.__version__)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())'
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1
        echo "cpus: $(nproc)"
        git status --short 2>/dev/null | sed 's/^/tree: /'
    } >"$OUT/env.txt" 2>&1
    run_stage tests "${GPU_CHECK_TESTS_S:-60}" "$OUT/tests.txt" tests
    grep -h '^cuda cases' "$OUT/tests.txt" >>"$SUMMARY"
    run_stage learner-h500 "${GPU_CHECK_H500_S:-180}" "$OUT/learner-h500.log" \
        learner "${h500[@]}" learner-h500
    run_stage learner-h100 "${GPU_CHECK_H100_S:-120}" "$OUT/learner-h100.log" \
        learner "${h100[@]}" learner-h100
    for name in learner-h500 learner-h100; do
        [ -f "$OUT/$name.md" ] || continue
        echo "$name:"
        grep -E '^\| (with|without|steps/s)' "$OUT/$name.md"
    done >>"$SUMMARY"
fi
echo "total $((SECONDS - START)) s; $([ "$failed" = 0 ] && echo 'every stage passed' || echo 'a stage failed or was skipped')" >>"$SUMMARY"
echo
cat "$SUMMARY"
exit "$failed"
