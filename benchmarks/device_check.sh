#!/usr/bin/env bash
# On a lent GPU machine (benchmarks/device_check.sh), from the repository root, with `.whl` carried:
# the CUDA tests, then benchmarks/so_paper_round.py on cuda (batched, vmap and one-at-a-time clients, the server)
# and benchmarks/batched_memory.py (the batched path's peak memory per user on the device). Output under $OUT (default ./device-out).
# Always exits 0; the last lines say which part failed. Time limits: TEST_TIMEOUT_S, BENCH_TIMEOUT_S.
set -u
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-120}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-300}
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
started=$(date +%s)
nvidia-smi -L || true
python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" || true
status=()
if ls .whl/*.whl >/dev/null 2>&1; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
    status+=("wheels: ok")
  else
    status+=("wheels: FAILED")
  fi
else
  status+=("wheels: none carried (.whl/*.whl)")
fi
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import sqlalchemy, alembic, dp_accounting, fedmf.ledger, fedmf.tasks; print('imports ok')" || status+=("imports: FAILED")

# every CUDA test in tests/ (the files that touch a device; -k selects the cuda/gpu ones)
timeout "$TEST_TIMEOUT_S" python3 -m pytest -q -p no:cacheprovider -rs -k "cuda or gpu" \
  tests/mechanisms/test_blt.py tests/round/test_noise.py tests/tasks/test_vectorized.py \
  tests/tasks/test_batched_clients.py tests/run/test_federated.py tests/round/test_privatize.py \
  2>&1 | tee "$OUT/cuda-tests.log"
rc=${PIPESTATUS[0]}
status+=("cuda tests: rc=$rc ($(tail -n 1 "$OUT/cuda-tests.log"))")
echo "# tests done at +$(( $(date +%s) - started )) s"

# client paths: check (batched on cuda vs sequential on the CPU), batched (a whole 1,000-user round),
# vmap (512 users), one-module, one-vmap; and the server's side (clip + sum, noise, step, commit)
timeout "$BENCH_TIMEOUT_S" python3 benchmarks/so_paper_round.py --device cuda --batched-users 1000 \
  --json "$OUT/so_paper_round.json" "$@" \
  2>&1 | tee "$OUT/so_paper_round.log"
rc=${PIPESTATUS[0]}
status+=("benchmark: rc=$rc$([ "$rc" = 124 ] && echo ' (timed out; the JSON holds the paths finished)')")
timeout 120 python3 benchmarks/batched_memory.py --device cuda --chunks 64,256 --json "$OUT/batched_memory.json" \
  2>&1 | tee "$OUT/batched_memory.log"
status+=("memory: rc=${PIPESTATUS[0]}")
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
echo "# total +$(( $(date +%s) - started )) s"
for s in "${status[@]}"; do echo "# $s"; done
exit 0
