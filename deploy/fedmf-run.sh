#!/usr/bin/env bash
# fedmf-run.sh APP_DIR CONNECTION RUN_CONFIG_TOML [STATUS_TIMEOUT_S=120]
#
# Submit the fedmf ServerApp with `flwr run APP_DIR CONNECTION --stream --run-config RUN_CONFIG_TOML`,
# follow its log, then exit 0 only if the Flower run really finished `finished:completed`
# (`flwr run` itself exits 0 even when the ServerApp failed). Used by systemd/fedmf-run.service and
# by tests/flower/test_deploy.py. Starting it again with the same run config resumes a stopped run after its
# last committed round. Needs `flwr` and `python3` on PATH, and FLWR_HOME with the connection.
set -uo pipefail
if [[ $# -lt 3 ]]; then
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
app=$1 conn=$2 cfg=$3 wait_s=${4:-120}
log=$(mktemp)
trap 'rm -f "$log"' EXIT

flwr run "$app" "$conn" --stream --run-config "$cfg" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
run_id=$(sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -oE 'Successfully started run [0-9]+' | grep -oE '[0-9]+$' | head -n 1)
if [[ -z "$run_id" ]]; then
    echo "fedmf-run.sh: flwr run started no run (exit $rc)" >&2
    exit 1
fi
status=""
for ((i = 0; i < wait_s; i++)); do
    status=$(flwr ls "$conn" --run-id "$run_id" --format json 2>/dev/null | python3 -c '
import json, sys
t = sys.stdin.read()
print(json.loads(t[t.index("{"):])["runs"][0]["status"])' 2>/dev/null)
    [[ "$status" == finished:* ]] && break
    sleep 1
done
echo "fedmf-run.sh: Flower run $run_id: ${status:-status unknown}" >&2
[[ "$status" == finished:completed ]]
