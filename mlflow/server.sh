#!/usr/bin/env bash
# Run an MLflow tracking server for darts-dist: a database backend and a served artifact store.
# Settings: mlflow/server.env (or the file DARTS_MLFLOW_SETTINGS names). Point runs at it with
#   export MLFLOW_TRACKING_URI=http://127.0.0.1:5000
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=server.env
source "${DARTS_MLFLOW_SETTINGS:-$here/server.env}"
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION
mkdir -p "$DARTS_MLFLOW_DATA"
[[ "$DARTS_MLFLOW_ARTIFACTS" == *://* ]] || mkdir -p "$DARTS_MLFLOW_ARTIFACTS"  # a local folder, not s3:// etc.
echo "mlflow server on http://$DARTS_MLFLOW_HOST:$DARTS_MLFLOW_PORT (data: $DARTS_MLFLOW_DATA)" >&2
# exec: the server takes this script's process id, so stopping that id stops the server.
exec mlflow server \
    --backend-store-uri "$DARTS_MLFLOW_BACKEND" \
    --artifacts-destination "$DARTS_MLFLOW_ARTIFACTS" \
    --serve-artifacts \
    --host "$DARTS_MLFLOW_HOST" \
    --port "$DARTS_MLFLOW_PORT" \
    --workers "$DARTS_MLFLOW_WORKERS"
