#!/usr/bin/env bash
# The single-GPU measurements, on a machine with one CUDA GPU and jax[cuda]:
#
#   bash launch/gpu_bench.sh OUTDIR            # PYTHON=... to pick the interpreter
#
# 1. the device's copy bandwidths (launch.experiments.bandwidth);
# 2. launch.train on the GPU: per-layer profile every step (host callbacks on the
#    GPU stream), the in-memory tier + an Orbax step every 4 steps; then a
#    --resume from the memory tier, and one from the persistent tier (pinned_host
#    buffers) after the RAM store is deleted;
# 3. launch.bench single-process: none, blocking, orbax_async, inmem, pec on the
#    `small` model and on gpt_moe_125m_8e (fixed dispatch: no recompiles).
# Each part has its own time limit; all output goes to OUTDIR/gpu_bench.log (the
# tail of each part to stdout), results to OUTDIR/*.json; a failed part does not
# stop the next; the script exits non-zero if any part failed.
set -uo pipefail
OUT=${1:?usage: bash launch/gpu_bench.sh OUTDIR}
PY=${PYTHON:-python3}
SMALL_STEPS=${SMALL_STEPS:-10}
BIG_MODEL=${BIG_MODEL:-gpt_moe_125m_8e}
BIG_STEPS=${BIG_STEPS:-5}
BIG_BATCH=${BIG_BATCH:-16}  # 64 (the config's) needs > 100 GiB of activations on one GPU
mkdir -p "$OUT"
WORK=$(mktemp -d)
# The RAM store: /dev/shm when it has room for the bench's versions, else local disk (logged).
STORE=/dev/shm/capricorn_jax_gpu
if [ "$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print $4}')" -lt $((16 << 20)) ] 2>/dev/null; then
  STORE=$WORK/store
fi
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
failed=()

LOG="$OUT/gpu_bench.log"
part() {  # part NAME LIMIT_S CMD...: run, log, remember failures
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$WORK/part.log" 2>&1
  local rc=$?
  cat "$WORK/part.log" >>"$LOG"
  grep -v "xla_bridge" "$WORK/part.log" | tail -n "${TAIL:-20}"
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  [ $rc -eq 0 ] || failed+=("$name")
}

part env 120 "$PY" -c "
import jax, flax, optax, orbax.checkpoint as ocp, numpy
d = jax.devices()[0]
print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__,
      'orbax', ocp.__version__, 'numpy', numpy.__version__)
print(jax.devices(), [m.kind for m in d.addressable_memories()])"
echo "store: $STORE"; df -h /dev/shm "$WORK" | tee -a "$LOG"; nvidia-smi -L 2>&1 | tee -a "$LOG"
part bandwidth 120 "$PY" -m launch.experiments.bandwidth --mib=1024 --repeats=5 --json="$OUT/bandwidth.json"

TRAIN=(--platform=gpu --hosts=1 --replicas=1 --model=small --dispatch=fixed --ckpt=inmem
       --persist_every=4 --store_root="$STORE" --workdir="$WORK/train" --eval_sequences=2)
rm -rf "$STORE"
part train 300 "$PY" -m launch.train "${TRAIN[@]}" --steps=8 --profile=every --fresh
part resume_memory 300 "$PY" -m launch.train "${TRAIN[@]}" --steps=10 --resume
rm -rf "$STORE"
part resume_persistent 300 "$PY" -m launch.train "${TRAIN[@]}" --steps=12 --resume
cp "$WORK/train/metrics.jsonl" "$OUT/train_metrics.jsonl" 2>/dev/null
# The profiles measured on the GPU: marks in layer order (forward, then backward),
# their durations against the step's wall time; the recoveries' tiers.
part profile_check 60 "$PY" -c "
import json, statistics, sys
events = [json.loads(line) for line in open('$WORK/train/metrics.jsonl')]
profiles = [e for e in events if e.get('event') == 'profile' and not e['compiled']]
bad = [p['step'] for p in profiles
       if [l['start_s'] for l in p['layers']] != sorted(l['start_s'] for l in p['layers'])
       or [l['direction'] for l in p['layers']] != sorted((l['direction'] for l in p['layers']),
                                                          key=('fwd', 'bwd').index)]
ratios = [sum(l['duration_s'] for l in p['layers']) / p['total_s'] for p in profiles]
last = profiles[-1]
print('profiled steps', [p['step'] for p in profiles], 'out of order:', bad)
print('sum of segments / step wall time: median %.3f, min %.3f, max %.3f'
      % (statistics.median(ratios), min(ratios), max(ratios)))
print('last profile (ms):', last['total_s'] * 1e3, [(l['name'], l['direction'],
      round(l['duration_s'] * 1e3, 2)) for l in last['layers']])
print('recoveries:', [(e['step'], e['tier'], e['seconds']) for e in events
                      if e.get('event') == 'recovery'])
sys.exit(1 if bad or not profiles else 0)"

BENCH=(--platform=gpu --hosts=1 --replicas=1 --dispatch=fixed
       --strategies=none,blocking,orbax_async,inmem,pec --store_root="$STORE")
part bench_small 400 "$PY" -m launch.bench "${BENCH[@]}" --model=small --steps="$SMALL_STEPS" \
  --reps=3 --workdir="$WORK/bench_small" --json="$OUT/bench_small.json"
part bench_big 900 "$PY" -m launch.bench "${BENCH[@]}" --model="$BIG_MODEL" --global_batch="$BIG_BATCH" --steps="$BIG_STEPS" \
  --reps=3 --warmup=2 --workdir="$WORK/bench_big" --json="$OUT/bench_big.json"
rm -rf "$STORE" "$WORK"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_bench: failed: ${failed[*]}"
  exit 1
fi
echo "gpu_bench: all parts passed"
