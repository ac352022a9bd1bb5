#!/usr/bin/env bash
# Runs every test with the race detector (make test's last step) and, when
# any fails, ends with what failed: the FAIL lines, the failing tests'
# messages and any panic or data race, gathered from the whole output.
# A CI log is often read from its end, where a package's last thousands
# of lines (Caddy's own log lines among them) would otherwise hide which
# test failed and why.
#
#   scripts/test.sh [go test flags and packages]   # default: ./...
set -uo pipefail

GO=${GO:-go}
TIMEOUT=${TIMEOUT:-20m}
PATH="$PATH:/usr/sbin:/usr/local/sbin"
[ $# -gt 0 ] || set -- ./...

log=$(mktemp "${TMPDIR:-/tmp}/ratelimit-test.XXXXXX")
trap 'rm -f "$log"' EXIT

"$GO" test -race -count=1 -timeout "$TIMEOUT" "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
if [ "$status" -ne 0 ]; then
	echo
	echo "=== what failed (gathered from the output above) ==="
	grep -E -- '^[[:space:]]*--- FAIL|^[[:space:]]+[^[:space:]]+_test\.go:[0-9]+: |^panic: |^fatal error: |WARNING: DATA RACE|^FAIL|^ok ' "$log" |
		grep -v -E '^ok ' | head -n 200
fi
exit "$status"
