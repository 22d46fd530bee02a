#!/usr/bin/env bash
# The GPU check of issue 15's integrations, prepared to run in one go on a lent GPU machine.
#
# What CPU cannot check here, and this does, with one rank per GPU (NCCL for the training
# collectives, the gloo side group for the ranks' mailing):
#   1. setup       a Python with CUDA torch, lightning and accelerate: reuses .venv-gpu or
#                  .venv when its torch sees a CUDA device and both import, else makes
#                  .venv-gpu (torch from PyPI's CUDA build). Log: install.log.
#   2. lightning   tests/workers/lightning_sharded.py --device cuda under torchrun: the
#                  DiLoCoCallback under ModelParallelStrategy, the module sharded by
#                  fully_shard in configure_model, 12 steps (2 fragments, a round every 2
#                  steps), alone in its run; then the check below. Log: lightning.log.
#   3. accelerate  tests/workers/accelerate_worker.py --fsdp-plugin under
#                  `accelerate launch --use_fsdp --fsdp_version 2`: Accelerate's own FSDP2
#                  plugin shards the model in accelerator.prepare (on CPU Accelerate
#                  ignores the plugin: AcceleratorState turns MULTI_GPU into FSDP, never
#                  MULTI_CPU, and `launch --cpu --use_fsdp` is refused); 12 steps, H=4;
#                  then the check below. Log: accelerate.log.
#   The check (benchmarks/gpu_sharded_verify.py; its "verify" line in each stage log):
#   the launch ended on its run's newest commits (every parameter, gathered whole, equal
#   to the committed theta) and committed at least 3 rounds; for Lightning every rank
#   wrote its own part of every round (the worker's key log); for Accelerate,
#   distributed_type was FSDP with FSDP2.
#   4. bench       benchmarks/sharded.py --device cuda at 1, 2, 4 ranks (as many as the
#                  GPUs allow): per-rank peaks of publish and apply on the device's
#                  counters, bytes, the due step against a clone on the GPU, throughput
#                  at the XL recipe's cadence. Tables: RESULTS-sharded.md. Log: bench.log.
#   summary.txt: each stage's exit code, seconds and budget; env.txt: GPU, torch, tree.
#   Exits 1 when a stage failed, ran out of time or was skipped.
#
# How to run, from anywhere (it works in the repository root):
#   OUT=/path/to/empty/dir bash benchmarks/gpu_sharded_check.sh   # default OUT=./gpu-sharded
# RANKS (default: the number of GPUs, at most 4) sets the ranks per launch; with one GPU
# the learner is one rank whose parameters are still DTensors (FSDP2 over a mesh of 1),
# which is what exercises NCCL against the callback's collectives.
#
# Stage budgets (each under `timeout`; rc 124 = timed out):
#   setup 200 s (a fresh install downloads ~3 GB; a reused venv takes seconds),
#   lightning 150 s, accelerate 150 s (each ~30 s of imports and CUDA start-up, then 12
#   toy steps with a round every 2-4 steps), bench 240 s (three launches per rank count,
#   ~20 s of start-up each): at most 740 s, expected ~4 min when reused.

set -uo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
ROOT=$(dirname "$(dirname "$SELF")")
OUT=${OUT:-gpu-sharded}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT" || exit 1
export OUT PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
TORCH_SPEC=${GPU_CHECK_TORCH:-torch==2.13.0}
export TORCH_SPEC

PROBE='import torch, lightning, accelerate, numpy, gradientmail
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device"'
export PROBE

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
    [ -x .venv-gpu/bin/python ] || python3 -m venv .venv-gpu || return 1
    local pip=(.venv-gpu/bin/python -m pip install --no-cache-dir --progress-bar off
               "$TORCH_SPEC" -e '.[torch,lightning,accelerate]')
    # A find-links folder holding torch+cpu would win over PyPI's CUDA build (see
    # gpu_check.sh): PyPI alone first, then the machine's pip config.
    if ! env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "${pip[@]}"; then
        echo "install from PyPI alone failed; retrying with the machine's pip config"
        "${pip[@]}" || return 1
    fi
    .venv-gpu/bin/python -c "$PROBE" || return 1
    echo "$ROOT/.venv-gpu/bin/python" >"$WORK/python"
}

torchrun_of() { echo "$(dirname "$PY")/torchrun"; }

stage_lightning() {
    rm -rf "$WORK/lightning-run"
    "$(torchrun_of)" --nproc_per_node "$RANKS" --master_addr 127.0.0.1 \
        --master_port "$((29000 + RANDOM % 1000))" tests/workers/lightning_sharded.py \
        "$WORK/lightning-run" "$OUT/lightning" --steps 12 --device cuda \
        --key-log "$OUT/lightning-keys" || return 1
    "$PY" "$ROOT/benchmarks/gpu_sharded_verify.py" lightning "$WORK/lightning-run" \
        "$OUT/lightning.end.json" "$RANKS" "$OUT/lightning-keys"
}

stage_bench() {
    # benchmarks/sharded.py on NCCL: 1, 2, ... RANKS ranks (powers of two), a GPT-2-medium
    # shape (24 blocks, width 1024: 1.4 GB in F32) so a shard's clone is not all overhead.
    local ranks=1 list=""
    while [ "$ranks" -le "$RANKS" ]; do list="$list $ranks"; ranks=$((ranks * 2)); done
    # shellcheck disable=SC2086
    "$PY" benchmarks/sharded.py --device cuda --ranks $list --layers 24 --embd 1024 \
        --rounds 6 --steps 186 --results "$OUT/RESULTS-sharded.md"
}

stage_accelerate() {
    rm -rf "$WORK/accelerate-run"
    mkdir -p "$OUT/accelerate"
    "$(dirname "$PY")/accelerate" launch --use_fsdp --fsdp_version 2 --num_processes "$RANKS" \
        --num_machines 1 --mixed_precision no --dynamo_backend no \
        --main_process_port "$((30000 + RANDOM % 1000))" \
        tests/workers/accelerate_worker.py "$WORK/accelerate-run" fsdp --out "$OUT/accelerate" \
        --fsdp-plugin --steps 12 --sync-every 4 --quorum 1 --wait-for 1 || return 1
    "$PY" "$ROOT/benchmarks/gpu_sharded_verify.py" accelerate "$WORK/accelerate-run" \
        "$OUT/accelerate/fsdp.rank0.json" "$RANKS"
}

if [ "${1:-}" = _stage ]; then
    case $2 in
        setup) stage_setup ;;
        lightning) stage_lightning ;;
        accelerate) stage_accelerate ;;
        bench) stage_bench ;;
        *) echo "unknown stage $2" >&2; exit 2 ;;
    esac
    exit
fi

WORK=$(mktemp -d)
export WORK
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
SUMMARY=$OUT/summary.txt
{
    echo "gpu_sharded_check $(date -u '+%F %T UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    printf '%-12s %-5s %8s %8s\n' stage rc seconds budget
} >"$SUMMARY"

failed=0
run_stage() {  # name budget stage
    local name=$1 budget=$2 t0=$SECONDS rc
    echo "== $name (budget ${budget}s) $(date -u +%T)"
    timeout -k 15 "$budget" bash "$SELF" _stage "$3" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    printf '%-12s %-5s %8s %8s\n' "$name" "$rc" "$((SECONDS - t0))" "$budget" >>"$SUMMARY"
    [ "$rc" = 0 ] || failed=1
}

run_stage setup "${GPU_CHECK_SETUP_S:-200}" setup
PY=$(cat "$WORK/python" 2>/dev/null)
if [ -z "$PY" ]; then
    echo "lightning, accelerate: skipped, no Python with CUDA torch (see setup.log)" >>"$SUMMARY"
    failed=1
else
    GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
    RANKS=${RANKS:-$(( GPUS < 4 ? GPUS : 4 ))}
    export PY RANKS
    {
        echo "python: $PY; ranks per launch: $RANKS of $GPUS GPUs"
        "$PY" -c 'import torch, lightning, accelerate
print("torch", torch.__version__, "cuda", torch.version.cuda, "lightning",
      lightning.__version__, "accelerate", accelerate.__version__,
      "device", torch.cuda.get_device_name())'
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
        git status --short 2>/dev/null | sed 's/^/tree: /'
    } >"$OUT/env.txt" 2>&1
    run_stage lightning "${GPU_CHECK_LIGHTNING_S:-150}" lightning
    run_stage accelerate "${GPU_CHECK_ACCELERATE_S:-150}" accelerate
    run_stage bench "${GPU_CHECK_BENCH_S:-240}" bench
    grep -h '^verify' "$OUT/lightning.log" "$OUT/accelerate.log" >>"$SUMMARY"
fi
echo "total $((SECONDS - START)) s; $([ "$failed" = 0 ] && echo 'every stage passed' || echo 'a stage failed or was skipped')" >>"$SUMMARY"
echo
cat "$SUMMARY"
exit "$failed"
