#!/usr/bin/env bash
# The GPU check of issue 29's device work (the TOPK_F8 encoder and the error feedback on
# the learner's device), in one call on a lent GPU machine (one H200, its own Python with
# CUDA torch, no package registry, no zstandard: nothing here needs it). About 2 minutes.
#
# How a session with a GPU runs it (the device tool's `run`; $OUT is set there):
#   run(command="bash benchmarks/gpu_check_sparse.sh", timeout_s=300)
# A dry run of the plumbing on a machine without a GPU (its numbers mean nothing):
#   GM_GPU_DRY=1 OUT=/tmp/sparse-dry bash benchmarks/gpu_check_sparse.sh
#
# Stages, each under its own `timeout` (rc 124 = ran out):
#   tests      120 s  the `device` fixture's cuda cases of tests/test_sparse_torch.py (the
#                     torch encoder's bytes and errors = numpy's on the GPU) and
#                     tests/test_feedback.py (residuals on the GPU, bit for bit numpy's;
#                     a checkpoint restored onto the GPU). A skipped cuda case fails it.
#   time-4      60 s  benchmarks/sparse_device.py --fragments 4: fragment 0 of 4 of GPT-2
#                     124M, sparsify_tensor and Residuals.encode, against numpy's bytes
#                     (goal: <= 10 ms).
#   time-1      60 s  the same, the whole model as one fragment.
# Writes under $OUT (default ./gpu-out): summary.txt, tests.txt, sparse-4.md, sparse-1.md.
# Exits 1 when a stage failed or ran out.

set -uo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
ROOT=$(dirname "$(dirname "$SELF")")
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT" || exit 1
DRY=${GM_GPU_DRY:-0}
PY=${GPU_CHECK_PYTHON:-$(command -v python3)}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
DEV=cuda
QUICK=()
if [ "$DRY" = 1 ]; then DEV=cpu; QUICK=(--quick --reps 2); fi
failed=0
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
: >"$OUT/summary.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
    2>&1 | tee -a "$OUT/summary.txt"

t0=$SECONDS
timeout 120 "$PY" -m pytest -rA -p no:cacheprovider -k cuda \
    tests/test_sparse_torch.py tests/test_feedback.py >"$OUT/tests.txt" 2>&1
rc=$?
ran=$(grep -c "^PASSED .*cuda" "$OUT/tests.txt")
skipped=$(grep -c "^SKIPPED" "$OUT/tests.txt")
# A cuda case that skipped on the GPU machine checked nothing.
if [ "$DRY" != 1 ] && { [ "$skipped" != 0 ] || [ "$ran" = 0 ]; }; then [ "$rc" = 0 ] && rc=1; fi
summary "tests: rc $rc, $((SECONDS - t0)) s, cuda cases passed $ran, skipped lines $skipped"
[ "$rc" = 0 ] || failed=1

for n in 4 1; do
    t0=$SECONDS
    timeout 60 "$PY" benchmarks/sparse_device.py --device "$DEV" --fragments "$n" \
        "${QUICK[@]}" >"$OUT/sparse-$n.md" 2>&1
    rc=$?
    summary "time-$n: rc $rc, $((SECONDS - t0)) s"
    grep "^| [sR]" "$OUT/sparse-$n.md" | tee -a "$OUT/summary.txt"
    [ "$rc" = 0 ] || failed=1
done
exit "$failed"
