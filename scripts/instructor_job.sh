#!/usr/bin/env bash
# instructor (TOOLS and JSON_SCHEMA modes) against `loom serve` on the bundled model.
# instructor 1.17 pins an older openai than loom's [test] environment, so it gets its own
# venv ($INSTRUCTOR_VENV); the server runs from loom's environment ($LOOM_PYTHON).
#   LOOM_PYTHON=/path/to/venv/bin/python bash scripts/instructor_job.sh
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM_PYTHON=${LOOM_PYTHON:-python}
VENV=${INSTRUCTOR_VENV:-${TMPDIR:-/tmp}/loom-instructor-venv}
PORT=${PORT:-30217}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import instructor" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "instructor==1.17.0"
fi
"$LOOM_PYTHON" -m loom.cli serve --port "$PORT" --served-model-name loom-bundled \
    --max-total-tokens 8192 > "${TMPDIR:-/tmp}/loom-instructor-server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 240); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 $SERVER 2>/dev/null || { cat "${TMPDIR:-/tmp}/loom-instructor-server.log"; exit 1; }
    sleep 0.5
done
"$VENV/bin/python" scripts/instructor_check.py "http://127.0.0.1:$PORT"
