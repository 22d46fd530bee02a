#!/usr/bin/env bash
# The GPU check of issue 30, in one call on a lent GPU machine (one H200, 16 cores, its own
# Python with CUDA torch, no package registry). At most ~8.5 minutes.
#
# How a session with a GPU runs it (the device tool's `run`; $OUT is set there and every
# file this writes under it comes back):
#   run(command="bash benchmarks/gpu_check_all.sh", timeout_s=600)
# No `carry` is needed: nothing here needs a package the machine lacks (no zstandard, no
# tokenizer). The machine's `python3` is used (GPU_CHECK_PYTHON to change it); this tree
# is put on PYTHONPATH. A later call can rerun some stages only:
#   run(command="GPU_CHECK_STAGES='learner sharded-time' bash benchmarks/gpu_check_all.sh",
#       timeout_s=300)
# On a machine without a GPU, the dry run runs every stage's code path at tiny sizes
# (~1.5 minutes on 2 CPU cores); its numbers mean nothing:
#   GM_GPU_DRY=1 OUT=/tmp/gpu-dry bash benchmarks/gpu_check_all.sh
#
# What it measures, and each stage's budget (each under its own `timeout`, so one that
# overruns is recorded as rc 124 and the next one still runs):
#   tests         30 s  the CUDA cases: the `device` fixture's cuda cases (zero-copy, the
#                       TorchAdapter) and the CUDA-only tests (TorchBackend("cuda") against
#                       numpy's bytes, rounds closed on CUDA, row pieces copied onto the
#                       device); 17 cases, ~15 s with CUDA start-up. A skipped CUDA case
#                       fails the stage on a GPU.
#   convergence  300 s  benchmarks/gpu_convergence.py: a 39.6M-parameter GPT-2 (8 × 640,
#                       byte vocabulary) on the standard library's source, held-out loss
#                       against tokens for the DDP equivalent (one process, batch 4B),
#                       DiLoCo M = 1 (batch 4B) and DiLoCo M = 4 (4 processes, batch B),
#                       H = 30, 19.7M tokens per arm, all three at once under a 200 s
#                       training limit (an arm past it stops at its next round and the
#                       comparison is read at the tokens every arm reached), 40 s grace.
#                       Goals: M = 4 ≤ 1.02×, M = 1 ≤ 1.00× the DDP equivalent's loss.
#   learner       90 s  benchmarks/learner.py --model 124m --device cuda --sync-every 100
#                       --fragments 4 --steps 25 --blocks 6, as on 2026-12-04 (75 s then):
#                       GPT-2 124M bf16, batch 8×1024, a round every 25 steps; throughput
#                       with the learner over without it, closer embedded and closer in a
#                       `gradientmail sync` process (goal ≥ 0.99× each); due step / clone.
#   sharded-time  55 s  benchmarks/sharded.py --device cuda --ranks 1 --modes time at 12
#                       blocks × 512, GPT-2's vocabulary (63.5M parameters, 243 MiB F32),
#                       4 rounds of 4 steps: the due step against a clone of the shard on
#                       the GPU beside it, warm and cold (goal ≤ 1.5×). Not GPT-2-medium
#                       (1.35 GB F32), where on 2026-12-04 the memory part and the start of
#                       the time part used all of 270 s: each standard-DiLoCo round moves
#                       the shard through a local directory, with fsync, several times.
#                       This shape is 1/5.6 of those bytes (its time part took 56 s on 2
#                       busy CPU cores here, CPU training included) and still a shard
#                       whose clone is more than launch overhead.
#   sharded-tput  35 s  the same shape, --modes throughput --steps 186: training with the
#                       learner (a round every 62 steps, F4 deltas, BF16 commits, never
#                       waiting) over without it (goal ≥ 0.99×).
#   total ≤ 510 s of stages + a few seconds of probing and packing.
# Override a budget with GPU_CHECK_{TESTS,CONVERGENCE,LEARNER,SHARDED_TIME,SHARDED_TPUT}_S,
# the convergence limit with GPU_CHECK_CONV_LIMIT (seconds of training; keep it ≤ the
# stage budget − 100) and its arguments with GPU_CHECK_CONV_ARGS (e.g. "--tokens 9830400"),
# the sharded shape with GPU_CHECK_SHARDED_SHAPE ("LAYERS EMBD", default "12 512").
#
# Writes under $OUT (default ./gpu-out): summary.txt (each stage's rc, seconds, budget and
# its key lines), env.txt (GPU, driver, torch, tree), convergence.md, convergence.csv,
# learner-h100.md, sharded.md, logs.tar.gz (every log, tests.xml, the convergence
# workers' logs): 7 files. Exits 1 when a stage failed, ran out of time or was skipped.

set -uo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
ROOT=$(dirname "$(dirname "$SELF")")
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT" || exit 1
DRY=${GM_GPU_DRY:-0}
PY=${GPU_CHECK_PYTHON:-$(command -v python3)}
export OUT DRY PY PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
read -r SH_LAYERS SH_EMBD <<<"${GPU_CHECK_SHARDED_SHAPE:-12 512}"
export SH_LAYERS SH_EMBD

# -- stages, each run as `bash gpu_check_all.sh _stage NAME` under timeout ----------------

stage_tests() {
    # Chosen by -k, not node ids: a node id not found stops pytest before it runs
    # anything, so one renamed test would cost them all.
    "$PY" -m pytest -rA -p no:cacheprovider --junitxml="$WORK/logs/tests.xml" \
        -k "cuda or on_a_gpu" tests/test_backends.py tests/test_diloco_aggregator.py \
        tests/test_zero_copy.py tests/test_adapter_torch.py tests/test_sharded_pieces.py
    local rc=$?
    # A CUDA case that skipped on the GPU machine checked nothing: say so, and fail.
    if ! "$PY" - "$WORK/logs/tests.xml" >"$WORK/cuda-cases" <<'EOF'
import os, sys
import xml.etree.ElementTree as ET

cases = [c for c in ET.parse(sys.argv[1]).iter("testcase")
         if "cuda" in c.get("name", "") or "on_a_gpu" in c.get("name", "")]
bad = {k: sum(c.find(k) is not None for c in cases) for k in ("skipped", "failure", "error")}
ran = len(cases) - bad["skipped"]
print(f"cuda cases: {len(cases)}, ran {ran}, skipped {bad['skipped']}, "
      f"failed {bad['failure'] + bad['error']}")
sys.exit(0 if os.environ["DRY"] == "1" or (cases and not bad["skipped"]) else 1)
EOF
    then
        [ "$rc" = 0 ] && rc=1
    fi
    cat "$WORK/cuda-cases"
    return "$rc"
}

stage_convergence() {
    local args=(--out "$WORK/conv")
    if [ "$DRY" = 1 ]; then
        args+=(--dry)
    else
        args+=(--device cuda --time-limit "${GPU_CHECK_CONV_LIMIT:-200}" --grace 40)
    fi
    # shellcheck disable=SC2086
    "$PY" benchmarks/gpu_convergence.py "${args[@]}" ${GPU_CHECK_CONV_ARGS:-}
    local rc=$?
    cp "$WORK/conv/convergence.md" "$WORK/conv/convergence.csv" "$OUT/" 2>/dev/null
    return "$rc"
}

stage_learner() {
    local dev=(--model 124m --device cuda --steps 25 --blocks 6)
    [ "$DRY" = 1 ] && dev=(--model tiny --device cpu --steps 25 --blocks 2)
    "$PY" benchmarks/learner.py "${dev[@]}" --sync-every 100 --fragments 4 \
        --no-append --table-out "$OUT/learner-h100.md"
}

stage_sharded() {  # mode
    local size=(--device cuda --layers "$SH_LAYERS" --embd "$SH_EMBD" --rounds 4 --steps 186)
    [ "$DRY" = 1 ] && size=(--device cpu --layers 2 --embd 64 --vocab 1024 --rounds 2
                            --cadence 8 --steps 16)
    "$PY" benchmarks/sharded.py --ranks 1 --modes "$1" "${size[@]}" \
        --results "$WORK/sharded-$1.md"
}

if [ "${1:-}" = _stage ]; then
    case $2 in
        tests) stage_tests ;;
        convergence) stage_convergence ;;
        learner) stage_learner ;;
        sharded-time) stage_sharded time ;;
        sharded-tput) stage_sharded throughput ;;
        *) echo "unknown stage $2" >&2; exit 2 ;;
    esac
    exit
fi

# -- the run ------------------------------------------------------------------------------

WORK=$(mktemp -d)
export WORK
mkdir -p "$WORK/logs"
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
SUMMARY=$OUT/summary.txt
# Tables of an earlier run in this OUT are not this run's.
rm -f "$OUT"/{convergence.md,convergence.csv,learner-h100.md,sharded.md,logs.tar.gz}
mode=gpu
[ "$DRY" = 1 ] && mode="CPU DRY RUN (GM_GPU_DRY=1): numbers meaningless"
{
    echo "gpu_check_all $(date -u '+%F %T UTC'), $mode, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git status --porcelain 2>/dev/null | grep -q . && echo ' + local changes')"
    printf '%-14s %-5s %8s %8s\n' stage rc seconds budget
} >"$SUMMARY"

failed=0
run_stage() {  # name budget
    local name=$1 budget=$2 t0=$SECONDS rc
    echo "== $name (budget ${budget}s) $(date -u +%T)"
    # timeout signals its whole process group: the workers, torchrun ranks and
    # `gradientmail sync` processes a stage starts go with it.
    timeout -k 10 "$budget" bash "$SELF" _stage "$name" 2>&1 | tee "$WORK/logs/$name.log"
    rc=${PIPESTATUS[0]}
    printf '%-14s %-5s %8s %8s\n' "$name" "$rc" "$((SECONDS - t0))" "$budget" >>"$SUMMARY"
    [ "$rc" = 0 ] || failed=1
}

PROBE='import torch, transformers, numpy, pytest, gradientmail, os
print("python", __import__("sys").version.split()[0], "torch", torch.__version__, "cuda",
      torch.version.cuda, "transformers", transformers.__version__, "numpy", numpy.__version__)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
elif os.environ["DRY"] != "1":
    raise SystemExit(f"torch {torch.__version__} sees no CUDA device")'
if ! {
    echo "python: $PY"
    timeout 60 "$PY" -c "$PROBE"
} >"$OUT/env.txt" 2>&1; then
    cat "$OUT/env.txt"
    echo "probe failed: no Python with CUDA torch and this tree's gradientmail; see env.txt" \
        | tee -a "$SUMMARY"
    exit 1
fi
{
    # compute_mode: "Exclusive_Process" would refuse the 4 learners their shared GPU.
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,compute_mode --format=csv 2>&1
    echo "cpus: $(nproc)"
    df -h /dev/shm /tmp 2>&1
    git status --short 2>/dev/null | sed 's/^/tree: /'
} >>"$OUT/env.txt"

STAGES=${GPU_CHECK_STAGES:-tests convergence learner sharded-time sharded-tput}
for name in $STAGES; do
    case $name in
        tests) run_stage tests "${GPU_CHECK_TESTS_S:-30}" ;;
        convergence) run_stage convergence "${GPU_CHECK_CONVERGENCE_S:-300}" ;;
        learner) run_stage learner "${GPU_CHECK_LEARNER_S:-90}" ;;
        sharded-time) run_stage sharded-time "${GPU_CHECK_SHARDED_TIME_S:-55}" ;;
        sharded-tput) run_stage sharded-tput "${GPU_CHECK_SHARDED_TPUT_S:-35}" ;;
        *) echo "unknown stage $name" | tee -a "$SUMMARY"; failed=1 ;;
    esac
done

# The tables each stage wrote, and their key lines in the summary.
cat "$WORK"/sharded-{time,throughput}.md >"$OUT/sharded.md" 2>/dev/null
[ -s "$OUT/sharded.md" ] || rm -f "$OUT/sharded.md"
{
    grep -h '^cuda cases' "$WORK/logs/tests.log" 2>/dev/null
    if [ -f "$OUT/convergence.md" ]; then
        echo "convergence:"
        grep -E '^\| [0-9]' "$OUT/convergence.md" | tail -n 1
        grep -E '^\| (ddp|diloco)' "$OUT/convergence.md"
        grep -E '^- ' "$OUT/convergence.md"
    fi
    if [ -f "$OUT/learner-h100.md" ]; then
        echo "learner (a round every 25 steps):"
        grep -E '^\| (due step|steps/s|with / without|without / without)' "$OUT/learner-h100.md"
    fi
    if [ -f "$OUT/sharded.md" ]; then
        echo "sharded:"
        grep -E '^\| 1 \| ' "$OUT/sharded.md"
        grep -E '^- ' "$OUT/sharded.md"
    fi
} >>"$SUMMARY"
[ -d "$WORK/conv/convergence-logs" ] && cp -r "$WORK/conv/convergence-logs" "$WORK/logs/"
tar czf "$OUT/logs.tar.gz" -C "$WORK" logs
echo "total $((SECONDS - START)) s; $([ "$failed" = 0 ] && echo 'every stage passed' || echo 'a stage failed or was skipped')" >>"$SUMMARY"
echo
cat "$SUMMARY"
exit "$failed"
