#!/usr/bin/env bash
# The GPU lane in one lease: the `gpu` tests, then lab/benchmarks/train_step.py, one report.
#
#   PYTHON=python scripts/gpu_check.sh [OUT_DIR]      # on the lent GPU machine (< 8 min)
#   PYTHON=.venv/bin/python FNRL_GPU_CHECK_QUICK=1 scripts/gpu_check.sh /tmp/out   # CPU, CI
#
# Runs from the tree (PYTHONPATH=repo root; nothing is installed). It finds the platform
# (JAX's default backend, asked with preallocation off), runs `pytest -m gpu` with
# FNRL_GPU_LANE=1 (tests/conftest.py then leaves JAX its real devices), then the train-step
# benchmark, each side alone on the device: on a GPU the real Qwen2.5-0.5B (8 x 1,024),
# -1.5B and -3B (8 x 2,048) configs, 2 warm-up + 5 timed steps, one round; on CPU the cpu
# preset in 2 steps (FNRL_GPU_CHECK_QUICK=1: one layer, 2 x 32 tokens). Override the
# presets with FNRL_GPU_CHECK_PRESETS="qwen0.5b qwen3b".
#
# Writes OUT_DIR/gpu_check.md (the report: platform, device, versions, tests, the
# benchmark table, the targets met or missed) and gpu_check.json beside it, logs under
# OUT_DIR/logs. OUT_DIR: the argument, else $OUT (the device runner returns what is
# written there), else gpu_check_out.
#
# Exit status (scripts/gpu_report.py decides): non-zero when a test failed or could not
# run, or a benchmark run crashed, timed out or failed other than by running out of
# memory; a side out of memory and targets missed are reported, exit 0.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
OUT_DIR=${1:-${OUT:-gpu_check_out}}
QUICK=${FNRL_GPU_CHECK_QUICK:-0}
mkdir -p "$OUT_DIR/logs"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOGS=$OUT_DIR/logs
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS
timings=()

probe=$(XLA_PYTHON_CLIENT_PREALLOCATE=false "$PYTHON" -c \
  'import jax; d = jax.devices()[0]; print(d.platform + "|" + d.device_kind)' \
  2>"$LOGS/probe.log" | tail -n 1) || probe="unknown|$(tail -n 1 "$LOGS/probe.log")"
PLATFORM=${probe%%|*}
DEVICE=${probe#*|}
echo "gpu_check: platform $PLATFORM ($DEVICE), quick=$QUICK, report in $OUT_DIR"

# The tests: only files that carry the marker are collected (the rest of the suite
# imports packages the device image lacks, vLLM among them).
t0=$SECONDS
# FNRL_GPU_CHECK_TEST_FILES narrows them (CI's CPU run of this script checks the lane's
# plumbing on one file: the suite itself runs every gpu test on CPU already).
if [ -n "${FNRL_GPU_CHECK_TEST_FILES:-}" ]; then
  read -r -a test_files <<< "$FNRL_GPU_CHECK_TEST_FILES"
else
  mapfile -t test_files < <(grep -rlE --include='test_*.py' 'pytest\.mark\.gpu' tests | sort)
fi
tests_rc=0
if ! "$PYTHON" -c 'import pytest' 2>/dev/null; then
  echo "no pytest in $PYTHON: the gpu tests cannot run" > "$LOGS/pytest.log"
  tests_rc=3
elif [ "${#test_files[@]}" -eq 0 ]; then
  echo "no test file carries the gpu marker" > "$LOGS/pytest.log"
  tests_rc=5
else
  # -o addopts: one process (one JAX per device) and no xdist, which the image may lack.
  FNRL_GPU_LANE=1 "$PYTHON" -m pytest -o addopts="-ra" -m gpu -x -q -p no:cacheprovider \
    "${test_files[@]}" \
    > "$LOGS/pytest.log" 2>&1 || tests_rc=$?
fi
timings+=("tests=$((SECONDS - t0))")
echo "gpu_check: tests exit $tests_rc ($(tail -n 1 "$LOGS/pytest.log"))"

if [ "$PLATFORM" = "gpu" ]; then
  default_presets="qwen0.5b qwen1.5b qwen3b"
  [ "$QUICK" = "1" ] && default_presets="qwen0.5b"
  bench_args=(--steps 5 --warmup 2 --rounds 1 --child-timeout 240)
else
  default_presets="cpu"
  bench_args=(--steps 2 --warmup 1 --rounds 1 --child-timeout 300)
  [ "$QUICK" = "1" ] && bench_args+=(--layers 1 --batch 2 --seq 32)
fi
read -r -a presets <<< "${FNRL_GPU_CHECK_PRESETS:-$default_presets}"
# In turns on every platform: the schedule a GPU needs is the one CI exercises on CPU.
bench_platform=$PLATFORM
[ "$bench_platform" = "gpu" ] || bench_platform=cpu
bench_results=()
for preset in "${presets[@]}"; do
  t0=$SECONDS
  rc=0
  "$PYTHON" lab/benchmarks/train_step.py --preset "$preset" --platform "$bench_platform" \
    --schedule turns "${bench_args[@]}" --json "$LOGS/bench_$preset.json" \
    > "$LOGS/bench_$preset.log" 2>&1 || rc=$?
  timings+=("$preset=$((SECONDS - t0))")
  bench_results+=("$preset=$rc")
  echo "gpu_check: benchmark $preset exit $rc in $((SECONDS - t0)) s"
done
timings+=("total=$((SECONDS - start))")

report_rc=0
"$PYTHON" scripts/gpu_report.py "$OUT_DIR" --platform "$PLATFORM" --device "$DEVICE" \
  --quick "$QUICK" --tests-rc "$tests_rc" --tests-log "$LOGS/pytest.log" \
  --bench "${bench_results[@]}" --timings "${timings[@]}" || report_rc=$?
exit "$report_rc"
