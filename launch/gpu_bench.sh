#!/usr/bin/env bash
# The single-GPU measurements, one JSON summary, at most 8 minutes:
#
#   bash launch/gpu_bench.sh OUT                  # one CUDA GPU, jax[cuda12]
#   bash launch/gpu_bench.sh OUT --platform=cpu   # the dry run: same parts, small sizes
#
# PYTHON=... picks the interpreter. Writes OUT/summary.json (the headline numbers
# at the top, each part's result under "parts"), OUT/gpu_bench.log and the parts'
# own logs and bench JSONs. The parts, their sizes and time limits are in
# launch/gpu_bench.py; a failed part is recorded and the next one runs; the exit
# code is non-zero if any part failed.
set -uo pipefail
OUT=${1:?usage: bash launch/gpu_bench.sh OUT [--platform=cpu]}
shift
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
timeout -k 10 480 "$PY" -m launch.gpu_bench --out="$OUT" "$@"
rc=$?
[ $rc -eq 124 ] && echo "gpu_bench: stopped at the 8-minute limit" >&2
[ -f "$OUT/summary.json" ] && echo "gpu_bench: summary in $OUT/summary.json"
exit $rc
