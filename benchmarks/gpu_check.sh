#!/usr/bin/env bash
# Everything that needs a GPU, in one call on a lent machine (see benchmarks/README.md):
# versions, the CUDA tests, the digits demo on the GPU, the GPU benchmark, then the
# CPU-only parts of the suite with a GPU visible (defaults now pick it). Each part has
# its own time limit, so one that hangs cannot take the others' time. Logs go to $OUT.
set -u
cd "$(dirname "$0")/.."
# .gpu_deps: pure-Python dependencies the lent machine may lack (lazy_loader, pytest-xdist),
# installed here with `pip install --target .gpu_deps --no-deps ...` and carried over.
DEPS=""; [ -d .gpu_deps ] && DEPS=":$PWD/.gpu_deps"
export PYTHONPATH="$PWD/src:$PWD$DEPS${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/unison-gpu-check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
SKIP=" ${SKIP:-} "  # e.g. SKIP="profile suite_with_gpu": parts to leave out of a short call
part() {  # part NAME SECONDS COMMAND...: runs it under a limit, output to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  if [[ "$SKIP" == *" $name "* ]]; then echo "=== $name: skipped (SKIP)"; return; fi
  echo "=== $name (limit ${limit}s)"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-15}" "$OUT/$name.log"
  echo "=== $name: exit $rc in $((SECONDS - start))s"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
part real_models 200 "$PY" -m pytest -q -s -p no:cacheprovider -rs -n 0 tests/gpu/test_real_models_cuda.py
part cuda_tests 170 "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu --deselect tests/gpu/test_real_models_cuda.py \
  tests/input/test_input_iterator.py \
  tests/collectives/compat/test_gradients.py tests/strategies/test_configuration.py
part bench 130 "$PY" benchmarks/gpu.py --rounds "${ROUNDS:-6}" --out "$OUT"
TAIL=60 part profile 60 "$PY" benchmarks/gpu.py --profile D:mwms,ddp
part demo 90 "$PY" -m unison.launch --workers 2 examples/digits.py --epochs 3 --checkpoint "$OUT/ck/digits.pt" \
  --backup-dir "$OUT/ck/backup" --eval-dir "$OUT/ck/eval"
part suite_with_gpu "${SUITE_S:-270}" "$PY" -m pytest -q -rf -p no:cacheprovider -n 14 --timeout 100 tests/strategies \
  tests/values tests/gradient_sync tests/interpose tests/devices tests/architecture/test_public_names_and_stubs.py \
  tests/collectives tests/input tests/multi_worker tests/checkpoint tests/ps tests/cluster/test_slurm_jobs.py \
  tests/coordinator/test_coordinator_strategy.py
