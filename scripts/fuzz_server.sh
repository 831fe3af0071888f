#!/usr/bin/env bash
# The reliability suite, long: schemathesis over every endpoint of /openapi.json and hypothesis over
# the parsers and SSE framing, with many more examples than CI's short run (tests/server/test_fuzz_*.py),
# then the hostile-request and auth tests. Usage: scripts/fuzz_server.sh [EXAMPLES_PER_ENDPOINT] [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
export FUZZ_EXAMPLES="${1:-500}"
shift || true
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
echo "fuzzing with FUZZ_EXAMPLES=$FUZZ_EXAMPLES" >&2
python -m pytest -p no:cacheprovider -q tests/server/test_fuzz_api.py tests/server/test_fuzz_parsers.py \
    tests/server/test_hostile_requests.py tests/server/test_auth.py "$@"
