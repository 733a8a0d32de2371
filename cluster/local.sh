#!/usr/bin/env bash
# A local multi-node Ray cluster on one machine: a head node and a worker node, each with its own
# resources, so that placement by resources can be checked without a second machine.
#
#   cluster/local.sh start     # head on 127.0.0.1:$PORT, dashboard (job submission) on :$DASHBOARD_PORT
#   cluster/local.sh stop      # stops this cluster's processes only (not other Ray clusters here)
#   cluster/local.sh status
#
# Settings (environment): DARTS_LOCAL_CLUSTER_DIR (Ray's temp folder, keep it short: socket paths
# are limited to 107 bytes), PORT, DASHBOARD_PORT, HEAD_CPUS, WORKER_CPUS, HEAD_RESOURCES,
# WORKER_RESOURCES (JSON), JOB_SERVER_WAIT_S (how long `start` waits for the job server; default 180,
# more on a loaded machine, where every Ray process starts slowly). Defaults: the head has {"train_node": 1} (the calibration worker runs
# there) and the worker node {"expert_node": 3} (the three expert actors), as
# jobs/configs/local-two-node.yaml asks.
set -euo pipefail

DIR="${DARTS_LOCAL_CLUSTER_DIR:-/tmp/darts-local}"
PORT="${PORT:-6390}"
DASHBOARD_PORT="${DASHBOARD_PORT:-8266}"
HEAD_CPUS="${HEAD_CPUS:-2}"
WORKER_CPUS="${WORKER_CPUS:-6}"
default_head_resources='{"train_node": 1}'
default_worker_resources='{"expert_node": 3}'
HEAD_RESOURCES="${HEAD_RESOURCES:-$default_head_resources}"
WORKER_RESOURCES="${WORKER_RESOURCES:-$default_worker_resources}"
JOB_SERVER_WAIT_S="${JOB_SERVER_WAIT_S:-180}"
# Ray's token auth is for clusters other machines reach; this one listens on loopback only, so auth stays off
# unless RAY_AUTH_MODE=token (with RAY_AUTH_TOKEN, or ~/.ray/auth_token) is set when it starts, as
# tests/test_multinode.py does: then every node, and every `ray job submit`, needs the token.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"

# What this script runs: Ray's command line (pip install -e . brings it) and pgrep (procps, which slim images
# such as python:3.11-slim leave out).
for tool in ray pgrep; do
    if ! command -v "$tool" >/dev/null; then
        case "$tool" in
            ray) fix="activate the project's environment (. .venv/bin/activate), or pip install -e ." ;;
            pgrep) fix="install procps (apt-get install procps; dnf install procps-ng; apk add procps)" ;;
        esac
        echo "error: cluster/local.sh needs $tool, which is not on PATH" >&2
        echo "fix: $fix" >&2
        exit 2
    fi
done

ours() { pgrep -f -- "$DIR/" || true; }

start() {
    if [[ -n "$(ours)" ]]; then
        echo "a local cluster is already running in $DIR (cluster/local.sh stop first)" >&2
        exit 1
    fi
    mkdir -p "$DIR"
    ray start --head --node-ip-address=127.0.0.1 --port="$PORT" \
        --include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" \
        --num-cpus="$HEAD_CPUS" --num-gpus=0 --resources="$HEAD_RESOURCES" \
        --dashboard-agent-listen-port=0 --metrics-export-port=0 \
        --temp-dir="$DIR/head" --disable-usage-stats
    # Every agent takes a free port (port 0), not Ray's fixed defaults: another Ray instance on this
    # machine (a test's, the second node's) would hold those, and a head whose agent cannot bind
    # takes no jobs.
    ray start --address="127.0.0.1:$PORT" --node-ip-address=127.0.0.1 \
        --num-cpus="$WORKER_CPUS" --num-gpus=0 --resources="$WORKER_RESOURCES" \
        --dashboard-agent-listen-port=0 --metrics-export-port=0 \
        --temp-dir="$DIR/worker" --disable-usage-stats
    # The dashboard takes jobs only once its agent on the head is up ("No available agent to submit
    # job" before that): wait until a no-op job is accepted (bounded).
    local deadline=$((SECONDS + JOB_SERVER_WAIT_S)) answer
    while ((SECONDS < deadline)); do
        if answer="$(ray job submit --address "http://127.0.0.1:$DASHBOARD_PORT" --no-wait -- true 2>&1)"; then
            echo "local cluster: 127.0.0.1:$PORT, jobs at http://127.0.0.1:$DASHBOARD_PORT"
            return 0
        fi
        sleep 2
    done
    echo "the local cluster's job server did not take a job within $JOB_SERVER_WAIT_S s: ${answer##*$'\n'}" >&2
    echo "see $DIR/head/session_latest/logs; stop the cluster with: $0 stop" >&2
    exit 1
}

stop() {
    # `ray stop` would stop every Ray process on the machine; only this cluster's are named by $DIR.
    local pids
    pids="$(ours)"
    [[ -z "$pids" ]] && { echo "no local cluster running in $DIR"; return 0; }
    kill -TERM $pids 2>/dev/null || true
    # The Python processes end within a second of SIGTERM; the GCS server and the autoscaler's monitor were still
    # up 20 s after it (measured): a longer grace only delays their SIGKILL.
    for _ in $(seq 6); do
        [[ -z "$(ours)" ]] && { echo "local cluster stopped"; return 0; }
        sleep 0.5
    done
    kill -KILL $(ours) 2>/dev/null || true
    echo "local cluster stopped (killed)"
}

status() {
    RAY_ADDRESS="127.0.0.1:$PORT" ray status
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 {start|stop|status}" >&2; exit 2 ;;
esac
