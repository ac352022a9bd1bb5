#!/usr/bin/env bash
# The load harness (`make compare`, alias `make loadtest`): real Caddy
# processes driven by wrk over loopback, this module and the peer module
# github.com/mholt/caddy-ratelimit compared side by side with plain Caddy.
#
#   make compare                                   # every scenario, 7 rounds x 5 s
#   ROUNDS=7 DURATION=4 make compare               # the README's run
#   SCENARIOS="allow deny" PEER=0 make compare     # a subset, this module only
#   PROFILE=redis_keys100k make compare            # plus a CPU profile afterwards
#
# Binaries: this project's Caddy from ./cmd/caddy, and Caddy with the peer
# module at PEER_VERSION, built like `xcaddy build --with` would: a throwaway
# Go module in a temporary directory whose main.go imports Caddy's cmd, the
# standard modules and the peer, requiring the same Caddy version as this
# project's go.mod and the peer from the module proxy. Plain Caddy is this
# project's binary with a Caddyfile that has no rate limit directive.
#
# Rows (SCENARIOS), each measured on this module and, where it has an
# equivalent, on the peer (see loadtest/Caddyfile.<variant>):
#   allow           1 key ({client_ip}), never denied, headers draft
#   allow_off       the same with `headers off` (no peer row: it sends none)
#   deny            1 key, 1 per hour: every request after the first is a 429
#   keys100k        X-Key cycles through 100,000 values; memory per key.
#                   Keyed variants warm up until every key was sent once:
#                   the rounds measure warm keys, and the first pass (entry
#                   creation, with Redis the cell's first write) is
#                   reported on its own
#   redis           allow with a private redis-server (peer: storage sync)
#   keys100k_cold   keys100k's Caddyfile under one-off keys: every request
#                   carries a key this process (and Redis) never saw, the
#                   first pass over the keys measured in every round (a
#                   process as after a deploy, or per-IP keys that come once).
#                   Baseline: plain Caddy under the same script (plainkeys_cold)
#   redis_keys100k  keys100k with Redis (peer: storage sync)
#   redis_keys100k_cold  keys100k_cold with Redis: each key decides without
#                   waiting for Redis (its limit is far above one request),
#                   and its first replay reads and writes its new cell
#   redis_2nodes    2 Caddy processes, 1 key held at its limit (2000/s);
#                   admissions are compared with what one central sliding
#                   window count admits in the same runs: the limit at once,
#                   then the limit per window, limit x (D + p) / window for
#                   a run that starts at phase p of its window (the key
#                   starts each run with an empty previous window), at most
#                   limit x (D/window + 1)
#   redis_mysql     redis plus the cross-region layer (mysql, region), skipped
#                   when this build's `caddy adapt` rejects the mysql line
# The baseline of each row is plain Caddy ("plain"), or for the keyed rows
# plain Caddy under the same keyed wrk script ("plainkeys"). A control
# runs beside the one-key rows and one beside the warm keyed rows
# (CONTROL=1): plain Caddy with one no-op middleware, Caddy's vars handler
# ("plainmw"; "plainkeysmw" under the keyed script), the cost of being any
# middleware at all; each of those rows is also given over its control.
#
# How: every Caddy is pinned to CADDY_CPU (so GOMAXPROCS=1), wrk and
# redis-server to WRK_CPU (REDIS_CPU moves it), scheduled as wrk is
# (REDIS_IDLE=1: redis-server and mariadbd under SCHED_IDLE, taking only
# the CPU wrk leaves; SCHED_VS=1 runs both side by side). All processes start once and warm up; between its
# turns each Caddy is stopped (SIGSTOP), so no idle process's background
# work (a peer's storage sync of 100,000 keys, replay ticks) lands on the
# measured core or reaches Redis. The rounds interleave: each round runs
# every variant once, in the same order. Per round, a variant's ratio is its
# Caddy CPU time per request (all threads, /proc) divided by its baseline's
# in the same round, and its req/s divided by the baseline's; the report
# gives medians and min-max over rounds. Memory per key is (RSS - plainkeys'
# RSS) / distinct keys, each read after a forced GC (the admin endpoint's
# /debug/pprof/heap?gc=1) at the end of the rounds: at once, and once it
# stops falling (settled_rss).
#
# Environment:
#   ROUNDS=7 DURATION=5     rounds (at least 1; the bars want 7), seconds per run
#   WARMUP=2                seconds of warm-up load per variant
#   CONNS=64                wrk connections (one wrk thread; split over 2 nodes)
#   CADDY_CPU=0 WRK_CPU=1   the two cores
#   REDIS_CPU=$WRK_CPU      the core of redis-server (beside wrk by default;
#                           CADDY_CPU puts it on Caddy's, see README)
#   REDIS_IDLE=0            1: redis-server and mariadbd under SCHED_IDLE
#   SCHED_VS=0              1: also run each Redis row with the servers under
#                           the other policy, right after the row in every
#                           round ("sched_<row>", Redis database 2, MySQL
#                           database lt_sched): what the policy moves, side
#                           by side. Leaving SCHED_IDLE needs root
#   SCENARIOS="…"           rows to run (default all)
#   PEER=1                  0: do not build or run the peer
#   PEER_VERSION=v0.1.0     the peer's release (the module proxy serves tags only)
#   CONTROL=1               0: do not run the controls plainmw and plainkeysmw
#   BASE=<commit>           also run each of this module's rows on a build of
#                           that commit (a git worktree; this tree's
#                           Caddyfiles; Redis database 1 and MySQL database
#                           lt_base), right after the row in every round:
#                           a change's effect side by side, interleaved. The
#                           table gives it as "this module at <commit>",
#                           without a bar
#   MAX_SECONDS=1800        no new round starts once the run is this old
#   RESULTS=loadtest/results   where compare.md, compare.tsv and compare.svg go
#   PROFILE="<variant> …"   after the rounds, one more run of each with a CPU
#                           profile (kept in PROFILE_DIR, default $TMPDIR or
#                           /tmp, as loadtest-<variant>.cpu.pb.gz) and pprof's
#                           top functions, all and this module's alone
#
# It fails (exit 1, with Caddy's log tail) when a Caddy does not start or
# dies, on any socket error, or when a variant answers other statuses than it
# must (200; deny: 429; redis_2nodes: 200 or 429). A missed bar is reported,
# not a failure. Traffic only ever goes to 127.0.0.1. Everything it starts
# is stopped on exit (trap), and its temporary directory removed.
set -euo pipefail

ROUNDS=${ROUNDS:-7}
DURATION=${DURATION:-5}
WARMUP=${WARMUP:-2}
CONNS=${CONNS:-64}
CADDY_CPU=${CADDY_CPU:-0}
WRK_CPU=${WRK_CPU:-1}
REDIS_CPU=${REDIS_CPU:-$WRK_CPU}
REDIS_IDLE=${REDIS_IDLE:-0}
SCHED_VS=${SCHED_VS:-0}
ALL_ROWS="allow allow_off deny keys100k keys100k_cold redis redis_keys100k redis_keys100k_cold redis_2nodes redis_mysql"
SCENARIOS=${SCENARIOS:-$ALL_ROWS}
PEER=${PEER:-1}
CONTROL=${CONTROL:-1}
PEER_MODULE=github.com/mholt/caddy-ratelimit
PEER_VERSION=${PEER_VERSION:-v0.1.0}
MAX_SECONDS=${MAX_SECONDS:-1800}
RESULTS=${RESULTS:-loadtest/results}
PROFILE=${PROFILE:-}
BASE=${BASE:-}
GO=${GO:-go}
KEYS=100000 # distinct keys of the keyed rows

# The bars of issues 11 and 20, the stricter where both set one: the
# largest acceptable median ratio of Caddy's CPU time per request to the
# baseline's ("-": measured, no bar).
declare -A BAR=([allow]=1.04 [allow_off]=1.02 [deny]=1.05 [keys100k]=1.03
	[keys100k_cold]=- [redis]=1.03 [redis_keys100k]=1.08 [redis_keys100k_cold]=1.40
	[redis_2nodes]=- [redis_mysql]=1.05)
MAX_BYTES_PER_KEY=200     # keys100k: at most 200 B of RSS per key (issue 20)
MAX_CMDS_X=3              # redis_keys100k: at most 3 Redis commands per request (issue 20)
MAX_P99_X=1.5             # redis_keys100k and its cold row: p99 at most 1.5 x the baseline's
TWO_NODE_LIMIT=2000 # redis_2nodes: its limit per window (loadtest/Caddyfile.redis_2nodes)
TWO_NODE_WINDOW=1   # and its window, in seconds

die() {
	echo "loadtest: $*" >&2
	exit 1
}

for v in ROUNDS DURATION WARMUP CONNS CADDY_CPU WRK_CPU REDIS_CPU REDIS_IDLE SCHED_VS MAX_SECONDS PEER CONTROL; do
	[[ ${!v} =~ ^[0-9]+$ ]] || die "$v must be a non-negative integer, not '${!v}'"
done
((ROUNDS >= 1 && DURATION >= 1 && CONNS >= 2)) || die "ROUNDS and DURATION must be at least 1, CONNS at least 2"
for s in $SCENARIOS; do
	[[ " $ALL_ROWS " == *" $s "* ]] || die "unknown scenario '$s' ($ALL_ROWS)"
done

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# --- tools ---------------------------------------------------------------

need=(wrk)
[[ " $SCENARIOS " == *" redis"* ]] && need+=(redis-server) # with redis-cli
[[ " $SCENARIOS " == *" redis_mysql "* ]] && need+=(mariadbd)
scripts/ensure-servers.sh "${need[@]}" || exit 1
PATH="$PATH:/usr/sbin:/usr/local/sbin" # mariadbd
for tool in taskset chrt curl awk "$GO"; do
	command -v "$tool" >/dev/null 2>&1 ||
		die "$tool is not on PATH (taskset, chrt: util-linux; curl; awk; go)"
done
ncpu=$(getconf _NPROCESSORS_ONLN)
((CADDY_CPU < ncpu && WRK_CPU < ncpu && CADDY_CPU != WRK_CPU)) ||
	die "needs two distinct cores CADDY_CPU=$CADDY_CPU and WRK_CPU=$WRK_CPU; this machine has $ncpu"
((REDIS_CPU < ncpu)) || die "REDIS_CPU=$REDIS_CPU: this machine has $ncpu cores"

# --- scratch space and cleanup -------------------------------------------

TMP=$(mktemp -d "${TMPDIR:-/tmp}/loadtest.XXXXXX")
declare -A PIDS PORTS ADMINS
SERVER_PIDS="" # redis-server, mariadbd
# free_port, cpu_ns, stop_all and field.
# shellcheck source=scripts/harness-lib.sh
. scripts/harness-lib.sh

cleanup() {
	# Word-split on purpose: a two-node variant holds two pids in one value.
	# shellcheck disable=SC2086
	stop_all ${PIDS[*]+${PIDS[*]}} $SERVER_PIDS
	[ -z "$BASE" ] || git worktree remove --force "$TMP/base" >/dev/null 2>&1 || true
	rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log_tail() {
	local f
	for f in "$TMP/$1".*log; do
		[ -f "$f" ] || continue
		echo "--- last lines of $(basename "$f") ---" >&2
		tail -n 25 "$f" >&2
	done
}

fail() { # fail <variant> <message>
	echo "loadtest: FAIL: $1: $2" >&2
	log_tail "$1"
	exit 1
}

# metric_sum <admin port> <regex> sums the values of the series whose name
# and labels match the regex (anchored at the start of the line).
metric_sum() {
	curl -s --max-time 5 "http://127.0.0.1:$1/metrics" |
		awk -v re="^$2" '$0 !~ /^#/ && $0 ~ re { s += $NF; n++ } END { if (n) printf "%.0f\n", s; else print "" }'
}

rss_bytes() { awk '$1 == "VmRSS:" { print $2 * 1024 }' /proc/"$1"/status; }

# settled_rss <pid>: the RSS once it stops falling after a collection: read
# every 0.25 s until a second passes without it dropping by 0.5 % more, at
# most 10 s. Go returns freed pages to the system in the background, after
# the collection: read at once, RSS holds whatever the heap's last peak
# left (one build measured 173 to 245 B per key that way).
settled_rss() {
	local low now quiet=0 i
	low=$(rss_bytes "$1")
	for ((i = 0; i < 40 && quiet < 4; i++)); do
		sleep 0.25
		now=$(rss_bytes "$1")
		if ((now < low - low / 200)); then
			quiet=0
		else
			quiet=$((quiet + 1))
		fi
		((now < low)) && low=$now
	done
	echo "$low"
}

median() {
	printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END {
		if (NR == 0) { print ""; exit }
		if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
span() { printf '%s\n' "$@" | sort -g | awk 'NR == 1 { lo = $1 } { hi = $1 } END { printf "%.2f–%.2f", lo, hi }'; }

# --- variants ------------------------------------------------------------

is_peer() { [[ $1 == peer_* ]]; }
is_base() { [[ $1 == base_* ]]; }
is_sched() { [[ $1 == sched_* ]]; }
row_of() { local r=${1#peer_}; r=${r#sched_}; echo "${r#base_}"; }
is_cold() { [[ $1 == *_cold ]]; }
is_keyed() { [[ $1 == plainkeys* || $1 == *keys100k || $1 == *keys100k_cold ]]; }
nodes_of() { if [[ $1 == *2nodes ]]; then echo 2; else echo 1; fi; }
# control_of <variant>: the no-op middleware it is also divided by (none
# for a cold or two-node row).
control_of() {
	if is_cold "$1" || [[ $1 == *2nodes || $1 == plain* ]]; then echo ""
	elif is_keyed "$1"; then echo plainkeysmw
	else echo plainmw; fi
}
base_of() {
	if is_cold "$1"; then echo plainkeys_cold
	elif is_keyed "$1"; then echo plainkeys
	else echo plain; fi
}
# conf_of <variant>: its Caddyfile (a BASE build runs this tree's; a cold
# row runs its warm row's).
conf_of() { local r=${1#base_}; r=${r#sched_}; echo "loadtest/Caddyfile.${r%_cold}"; }
uses_redis() { [[ $(row_of "$1") == redis* ]] && ! is_peer "$1"; }
has_peer() { [[ " allow deny keys100k redis redis_keys100k redis_2nodes " == *" $1 "* ]]; }

NOTES=()
read -r -a rows <<<"$SCENARIOS"

# The tree the binary is built from, recorded now: commits may land while
# the rounds run.
commit=$(git rev-parse --short HEAD 2>/dev/null || echo '?')
git diff --quiet HEAD -- . 2>/dev/null || commit+=" (with uncommitted changes)"
echo "loadtest: building cmd/caddy"
BIN=$TMP/caddy
"$GO" build -o "$BIN" ./cmd/caddy || die "go build ./cmd/caddy failed"
BBIN="" BASE_NAME=""
if [ -n "$BASE" ]; then
	BASE_NAME=$(git rev-parse --short "$BASE^{commit}") || die "BASE=$BASE is not a commit"
	echo "loadtest: building cmd/caddy at $BASE_NAME (BASE)"
	git worktree add --detach "$TMP/base" "$BASE_NAME" >/dev/null 2>&1 || die "git worktree add $BASE_NAME failed"
	BBIN=$TMP/caddy-base
	(cd "$TMP/base" && "$GO" build -o "$BBIN" ./cmd/caddy) || die "go build ./cmd/caddy at $BASE_NAME failed"
fi
CADDY_VERSION=$(awk '$1 == "github.com/caddyserver/caddy/v2" { print $2; exit }' go.mod)
GO_VERSION=$(awk '$1 == "go" { print $2; exit }' go.mod)

# adapt_error <caddyfile> prints why this build's `caddy adapt` rejects the
# file (nothing if it accepts it).
adapt_error() {
	local err
	if ! err=$(LT_ADMIN_PORT=1 LT_PORT=2 LT_REDIS_PORT=3 LT_STORAGE=$TMP/x \
		LT_MYSQL_DSN='root:@tcp(127.0.0.1:4)/lt' \
		"$BIN" adapt --adapter caddyfile --config "$1" 2>&1 >/dev/null); then
		local msg
		msg=$(echo "$err" | sed -n 's/.*"msg":"\(.*\)"}.*/\1/p;s/.*"error":"\(.*\)"}.*/\1/p' | sed 's/\\"/"/g' | tail -n 1)
		[ -n "$msg" ] || msg=$(echo "$err" | tail -n 1)
		echo "${msg:-rejected}"
	fi
}

if [[ " ${rows[*]} " == *" redis_mysql "* ]]; then
	why=$(adapt_error loadtest/Caddyfile.redis_mysql)
	if [ -n "$why" ]; then
		echo "loadtest: redis_mysql: not available in this build (caddy adapt rejects the mysql line: $why)" >&2
		NOTES+=("redis_mysql: not available in this build: \`caddy adapt\` rejects \`mysql <dsn>\` ($why)")
		new=()
		for s in "${rows[@]}"; do [ "$s" = redis_mysql ] || new+=("$s"); done
		rows=("${new[@]}")
	fi
fi

PBIN=""
if ((PEER)); then
	echo "loadtest: building Caddy $CADDY_VERSION with $PEER_MODULE $PEER_VERSION in a throwaway module"
	mkdir -p "$TMP/peer"
	cat >"$TMP/peer/main.go" <<'EOF'
// Caddy with the standard modules and the peer rate limit module, as
// xcaddy generates it.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/mholt/caddy-ratelimit"
)

func main() {
	caddycmd.Main()
}
EOF
	cat >"$TMP/peer/go.mod" <<EOF
module caddy

go $GO_VERSION

require (
	github.com/caddyserver/caddy/v2 $CADDY_VERSION
	$PEER_MODULE $PEER_VERSION
)
EOF
	PBIN=$TMP/caddy-peer
	(cd "$TMP/peer" && GOWORK=off GOFLAGS=-mod=mod "$GO" mod tidy >"$TMP/peer-build.log" 2>&1 &&
		GOWORK=off "$GO" build -o "$PBIN" . >>"$TMP/peer-build.log" 2>&1) ||
		{ tail -n 20 "$TMP/peer-build.log" >&2; die "building Caddy with $PEER_MODULE $PEER_VERSION failed"; }
	# Its list in a file, not a pipe: under pipefail, grep -q leaving at the
	# first match can fail the pipeline with the writer's SIGPIPE.
	"$PBIN" list-modules >"$TMP/peer-modules.txt" 2>&1 ||
		{ tail -n 20 "$TMP/peer-modules.txt" >&2; die "the peer build's list-modules failed"; }
	grep -qx http.handlers.rate_limit "$TMP/peer-modules.txt" ||
		{ tail -n 20 "$TMP/peer-modules.txt" >&2; die "the peer build has no http.handlers.rate_limit module"; }
fi

order=(plain)
for s in "${rows[@]}"; do
	# The control, once, after plain, when a one-key row of one node runs.
	((CONTROL)) && [ "$(control_of "$s")" = plainmw ] &&
		[[ " ${order[*]} " != *" plainmw "* ]] && order=(plain plainmw "${order[@]:1}")
	if is_keyed "$s" && ! is_cold "$s" && [[ " ${order[*]} " != *" plainkeys "* ]]; then
		order+=(plainkeys)
		((CONTROL)) && order+=(plainkeysmw)
	fi
	is_cold "$s" && [[ " ${order[*]} " != *" plainkeys_cold "* ]] && order+=(plainkeys_cold)
	order+=("$s")
	[ -n "$BASE" ] && order+=("base_$s")
	((SCHED_VS)) && [[ $s == redis* ]] && order+=("sched_$s")
	((PEER)) && has_peer "$s" && order+=("peer_$s")
done

# --- servers -------------------------------------------------------------

REDIS_PORT="" REDIS_PID=""
start_redis() {
	free_port
	REDIS_PORT=$FREE_PORT
	taskset -c "$REDIS_CPU" redis-server --port "$REDIS_PORT" --bind 127.0.0.1 \
		--save "" --appendonly no --dir "$TMP" --logfile "$TMP/redis.log" \
		--daemonize no >/dev/null 2>&1 &
	local pid=$!
	SERVER_PIDS+=" $pid"
	REDIS_PID=$pid
	wait_port "$REDIS_PORT" "$pid" 10 || { tail -n 20 "$TMP/redis.log" >&2; die "redis-server did not start"; }
	((!REDIS_IDLE)) || schedule "$pid" idle
}

# schedule <pid> idle|other: the scheduling policy of every thread of a
# server.
schedule() {
	chrt --all-tasks "--$2" -p 0 "$1" >/dev/null 2>&1 ||
		die "chrt --all-tasks --$2 -p 0 $1 failed$([ "$2" = other ] && echo ' (leaving SCHED_IDLE needs root)')"
}

# place_servers <variant>: with SCHED_VS=1, the servers' policy for the
# variant's turn: REDIS_IDLE's, or the other one for a sched_ variant.
place_servers() {
	uses_redis "$1" && ((SCHED_VS)) || return 0
	local p idle=$REDIS_IDLE
	is_sched "$1" && idle=$((1 - REDIS_IDLE))
	for p in $SERVER_PIDS; do schedule "$p" "$( ((idle)) && echo idle || echo other)"; done
}

# redis_commands: the commands the private redis-server has processed
# (INFO stats), empty if it cannot be read.
redis_commands() {
	{ redis-cli -h 127.0.0.1 -p "$REDIS_PORT" info stats 2>/dev/null || true; } |
		tr -d '\r' | sed -n 's/^total_commands_processed://p'
}

MYSQL_DSN=""
start_mariadb() {
	local d=$TMP/mariadb port pid
	free_port
	port=$FREE_PORT
	mariadb-install-db --no-defaults --user=root --datadir="$d" \
		--auth-root-authentication-method=normal --skip-test-db >"$TMP/mariadb-install.log" 2>&1 ||
		{ tail -n 20 "$TMP/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
	taskset -c "$WRK_CPU" mariadbd --no-defaults --user=root --datadir="$d" --socket="$d/sock" \
		--port="$port" --bind-address=127.0.0.1 --skip-grant-tables >"$TMP/mariadb.log" 2>&1 &
	pid=$!
	SERVER_PIDS+=" $pid"
	wait_port "$port" "$pid" 60 || { tail -n 20 "$TMP/mariadb.log" >&2; die "mariadbd did not start"; }
	((!REDIS_IDLE)) || schedule "$pid" idle
	mariadb --no-defaults --socket="$d/sock" -uroot -e 'CREATE DATABASE lt; CREATE DATABASE lt_base; CREATE DATABASE lt_sched' ||
		die "CREATE DATABASE failed"
	MYSQL_DSN="root:@tcp(127.0.0.1:$port)/lt"
}

# start_caddy <variant>: its node(s) on fresh ports, each answering.
start_caddy() {
	local v=$1 bin=$BIN n i port admin pid cf
	cf=$(conf_of "$v")
	is_peer "$v" && bin=$PBIN
	local redis_port=$REDIS_PORT mysql_dsn=$MYSQL_DSN
	# A BASE build keeps its counts apart (Redis database 1, its own MySQL
	# database): sharing keys with this build's variant would make every
	# key a shared one for both.
	is_base "$v" && bin=$BBIN redis_port=$REDIS_PORT/1 mysql_dsn=${MYSQL_DSN%/lt}/lt_base
	is_sched "$v" && redis_port=$REDIS_PORT/2 mysql_dsn=${MYSQL_DSN%/lt}/lt_sched
	n=$(nodes_of "$v")
	PIDS[$v]="" PORTS[$v]="" ADMINS[$v]=""
	for i in $(seq "$n"); do
		free_port
		admin=$FREE_PORT
		free_port
		port=$FREE_PORT
		# Data and config directories private to the run; the peer's
		# storage directory is shared by the nodes of one variant only.
		XDG_DATA_HOME=$TMP/data-$v-$i XDG_CONFIG_HOME=$TMP/config \
			LT_ADMIN_PORT=$admin LT_PORT=$port LT_REDIS_PORT=$redis_port \
			LT_STORAGE=$TMP/storage-$v LT_MYSQL_DSN=$mysql_dsn \
			taskset -c "$CADDY_CPU" "$bin" run --adapter caddyfile \
			--config "$cf" >"$TMP/$v.$i.log" 2>&1 &
		pid=$!
		PIDS[$v]+="$pid " PORTS[$v]+="$port " ADMINS[$v]+="$admin "
		for _ in $(seq 150); do
			curl -s -o /dev/null --max-time 1 "http://127.0.0.1:$port/" && continue 2
			kill -0 "$pid" 2>/dev/null || fail "$v" "Caddy failed to start"
			sleep 0.1
		done
		fail "$v" "Caddy did not answer on 127.0.0.1:$port within 15 s"
	done
}

pause() { local p; for p in ${PIDS[$1]}; do kill -STOP "$p"; done; }
resume() { local p; for p in ${PIDS[$1]}; do kill -CONT "$p"; done; }
first() { echo "${1%% *}"; }

# check_headers <variant>: one request proves the variant's Caddy does what
# its Caddyfile says.
check_headers() {
	local v=$1 h code c=$1
	is_base "$v" || is_sched "$v" && c=$(row_of "$v")
	h=$(curl -s -D - -o /dev/null --max-time 5 -H "X-Key: header-check" "http://127.0.0.1:$(first "${PORTS[$v]}")/") ||
		fail "$v" "request failed"
	code=$(echo "$h" | awk 'NR == 1 { print $2 }')
	case $c in
	plain | plainkeys | plainkeys_cold | plainmw | plainkeysmw | allow_off | peer_allow | peer_keys100k | peer_redis | peer_redis_keys100k)
		[ "$code" = 200 ] || fail "$v" "status $code, want 200"
		! echo "$h" | grep -qi '^ratelimit:' || fail "$v" "RateLimit header where none is expected"
		;;
	deny | peer_deny)
		[ "$code" = 429 ] || fail "$v" "status $code after the warm-up, want 429"
		echo "$h" | grep -qi '^retry-after:' || fail "$v" "429 without Retry-After"
		;;
	*2nodes) [[ $code == 200 || $code == 429 ]] || fail "$v" "status $code, want 200 or 429" ;;
	*)
		[ "$code" = 200 ] || fail "$v" "status $code, want 200"
		echo "$h" | grep -qi '^ratelimit:' || fail "$v" "no RateLimit header: is the limiter on the path?"
		;;
	esac
}

# --- wrk -----------------------------------------------------------------

declare -A KEY_SENT # per variant: keyed requests sent so far (the next key)

# load <variant> <seconds>: one wrk per node, concurrently, all on WRK_CPU;
# sets R_REQ R_RPS R_CPU R_P50 R_P99 R_2XX R_429 and checks the statuses.
load() {
	local v=$1 d=$2 n i cpu0=0 cpu1=0 p port line out codes
	local -a env=() ports wpids
	is_keyed "$v" && env=(LT_KEYS=$KEYS LT_KEY_START=${KEY_SENT[$v]:-0})
	# A cold variant's keys never repeat (and never meet a warm variant's in
	# Redis): every request is a key's first.
	is_cold "$v" && env=(LT_KEYS=1000000000 LT_KEY_START=${KEY_SENT[$v]:-0} LT_KEY_PREFIX=c)
	read -r -a ports <<<"${PORTS[$v]}"
	n=${#ports[@]}
	for p in ${PIDS[$v]}; do cpu0=$((cpu0 + $(cpu_ns "$p"))); done
	R_START=$(date +%s.%N)
	wpids=()
	for i in "${!ports[@]}"; do
		env "${env[@]}" timeout $((d + 30)) taskset -c "$WRK_CPU" \
			wrk -t1 -c$((CONNS / n)) --latency -d"${d}s" -s loadtest/wrk.lua \
			"http://127.0.0.1:${ports[$i]}/" >"$TMP/wrk.$i.out" 2>&1 &
		wpids+=($!)
	done
	for i in "${!wpids[@]}"; do
		wait "${wpids[$i]}" || { cat "$TMP/wrk.$i.out" >&2; fail "$v" "wrk failed"; }
	done
	for p in ${PIDS[$v]}; do
		kill -0 "$p" 2>/dev/null || fail "$v" "Caddy died under load"
		cpu1=$((cpu1 + $(cpu_ns "$p")))
	done
	R_REQ=0 R_RPS=0 R_P50=0 R_P99=0 R_SOCK=0 codes="" R_SENT=0
	for i in "${!ports[@]}"; do
		line=$(grep '^LT ' "$TMP/wrk.$i.out" | tail -n 1)
		[ -n "$line" ] || { cat "$TMP/wrk.$i.out" >&2; fail "$v" "no summary from wrk"; }
		R_REQ=$((R_REQ + $(field requests)))
		R_RPS=$(awk -v a="$R_RPS" -v n="$(field requests)" -v us="$(field duration_us)" 'BEGIN { printf "%.0f", a + n / (us / 1e6) }')
		# Several nodes: the larger of their percentiles.
		R_P50=$(($(field p50_us) > R_P50 ? $(field p50_us) : R_P50))
		R_P99=$(($(field p99_us) > R_P99 ? $(field p99_us) : R_P99))
		R_SOCK=$((R_SOCK + $(field sock_errors)))
		R_SENT=$((R_SENT + $(field keyed_sent)))
		codes+="$(field codes),"
	done
	R_CPU=$(awk -v a="$cpu0" -v b="$cpu1" -v n="$R_REQ" 'BEGIN { printf "%.0f", (b - a) / n }')
	read -r R_2XX R_429 < <(echo "$codes" | tr ',' '\n' | awk -F: '
		$1 >= 200 && $1 < 300 { ok += $2 } $1 == 429 { d += $2 } END { print ok + 0, d + 0 }')
	local other=$((R_REQ - R_2XX - R_429))
	is_keyed "$v" && KEY_SENT[$v]=$((${KEY_SENT[$v]:-0} + R_SENT))

	((R_REQ > 0)) || fail "$v" "no request completed"
	((R_SOCK == 0)) || fail "$v" "$R_SOCK socket errors"
	((other == 0)) || fail "$v" "$other responses neither 2xx nor 429 (status counts: $codes)"
	case $(row_of "$v") in
	deny) ((R_2XX <= 1)) || fail "$v" "$R_2XX of $R_REQ requests passed a limit of 1 per hour" ;;
	*2nodes) ;;
	*) ((R_429 == 0)) || fail "$v" "$R_429 requests denied (status counts: $codes)" ;;
	esac
}

# --- run -----------------------------------------------------------------

T0=$(date +%s)
started=$(date -u '+%Y-%m-%d %H:%M UTC')
load_before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
nruns=0
for v in "${order[@]}"; do nruns=$((nruns + 1)); done
echo "loadtest: ${order[*]}"
echo "loadtest: $ROUNDS rounds x ${DURATION}s x $nruns variants, about $((nruns * (WARMUP + 3) + ROUNDS * nruns * (DURATION + 2)))s"

for v in "${order[@]}"; do uses_redis "$v" && { [ -n "$REDIS_PORT" ] || start_redis; }; done
[ -n "$REDIS_PORT" ] && echo "loadtest: redis-server on 127.0.0.1:$REDIS_PORT (core $REDIS_CPU$( ((REDIS_IDLE)) && echo ', SCHED_IDLE'))"
if [[ " ${order[*]} " == *" redis_mysql "* ]]; then
	start_mariadb
	echo "loadtest: mariadbd on ${MYSQL_DSN#*@} (core $WRK_CPU)"
fi

declare -A FIRST_CPU # keyed variants: CPU per request of the warm-up's first pass over the keys
for v in "${order[@]}"; do
	place_servers "$v"
	start_caddy "$v"
	load "$v" "$WARMUP"
	if is_keyed "$v" && ! is_cold "$v"; then
		# Warm up until every key has been sent once (at most 8 turns), so
		# the rounds measure warm keys; the first pass, where each key is
		# created (and, with Redis, its cell first written), is reported
		# on its own.
		first_ns=$((R_CPU * R_REQ)) first_req=$R_REQ turns=1
		while ((KEY_SENT[$v] < KEYS && turns < 8)); do
			load "$v" "$WARMUP"
			first_ns=$((first_ns + R_CPU * R_REQ)) first_req=$((first_req + R_REQ)) turns=$((turns + 1))
		done
		FIRST_CPU[$v]=$((first_ns / first_req))
	fi
	check_headers "$v"
	pause "$v"
	echo "loadtest: $v: Caddy pid ${PIDS[$v]}on 127.0.0.1 port ${PORTS[$v]}(admin ${ADMINS[$v]}), warmed up"
done

declare -A RPS CPU P50 P99 N2XX N429 ORIGIN_CALLS REDIS_CMDS REDIS_NS CENTRAL
rounds_done=0
for r in $(seq "$ROUNDS"); do
	if (($(date +%s) - T0 > MAX_SECONDS)); then
		NOTES+=("stopped after $rounds_done of $ROUNDS rounds: MAX_SECONDS=$MAX_SECONDS reached")
		echo "loadtest: MAX_SECONDS reached, stopping after $rounds_done rounds" >&2
		break
	fi
	line="round $r/$ROUNDS:"
	for v in "${order[@]}"; do
		place_servers "$v"
		resume "$v"
		oc0=0 rc0=0
		if uses_redis "$v"; then
			for a in ${ADMINS[$v]}; do oc0=$((oc0 + $(metric_sum "$a" 'caddy_ratelimit_origin_calls_total' || echo 0))); done
			rc0=$(redis_commands)
			[ -n "$rc0" ] || fail "$v" "cannot read INFO stats from redis-server"
			rn0=$(cpu_ns "$REDIS_PID")
		fi
		load "$v" "$DURATION"
		if uses_redis "$v"; then
			oc1=0
			for a in ${ADMINS[$v]}; do oc1=$((oc1 + $(metric_sum "$a" 'caddy_ratelimit_origin_calls_total' || echo 0))); done
			ORIGIN_CALLS[$v]=$((${ORIGIN_CALLS[$v]:-0} + oc1 - oc0))
			REDIS_CMDS[$v]=$((${REDIS_CMDS[$v]:-0} + $(redis_commands) - rc0))
			REDIS_NS[$v]=$((${REDIS_NS[$v]:-0} + $(cpu_ns "$REDIS_PID") - rn0))
		fi
		pause "$v"
		RPS[$v]+="$R_RPS " CPU[$v]+="$R_CPU " P50[$v]+="$R_P50 " P99[$v]+="$R_P99 "
		N2XX[$v]=$((${N2XX[$v]:-0} + R_2XX)) N429[$v]=$((${N429[$v]:-0} + R_429))
		if [[ $v == *2nodes ]]; then
			# What one central sliding-window count admits in this run under
			# a demand above its limit throughout: the limit at once, then
			# the limit per window, from the run's phase p in its first
			# window: limit x (D + p) / window.
			CENTRAL[$v]=$(awk -v c="${CENTRAL[$v]:-0}" -v s="$R_START" -v l="$TWO_NODE_LIMIT" -v d="$DURATION" -v w="$TWO_NODE_WINDOW" \
				'BEGIN { p = s / w - int(s / w); printf "%.0f", c + l * (d / w + p) }')
		fi
		line+=" $v $(awk -v c="$R_CPU" 'BEGIN { printf "%.1f", c / 1000 }')us"
	done
	rounds_done=$r
	echo "loadtest: $line"
done
((rounds_done > 0)) || die "no round ran"

# Memory: RSS after a forced GC, of each keyed variant and its baseline,
# at once (RSS: the figure the bars were set on) and once settled (RSS1,
# see settled_rss).
declare -A RSS RSS1 HEAP
for v in "${order[@]}"; do
	is_keyed "$v" && ! is_cold "$v" || continue
	resume "$v"
	a=$(first "${ADMINS[$v]}")
	curl -s --max-time 30 -o /dev/null "http://127.0.0.1:$a/debug/pprof/heap?gc=1" ||
		fail "$v" "forced GC through /debug/pprof/heap?gc=1 failed"
	RSS[$v]=$(rss_bytes "$(first "${PIDS[$v]}")")
	RSS1[$v]=$(settled_rss "$(first "${PIDS[$v]}")")
	HEAP[$v]=$(metric_sum "$a" 'go_memstats_heap_inuse_bytes ')
	pause "$v"
done

# --- report --------------------------------------------------------------

mkdir -p "$RESULTS"
TSV=$RESULTS/compare.tsv
MD=$RESULTS/compare.md
MISSES=() MET=()

ratio_list() { # ratio_list <variant> <metric array name> <base>: per-round ratios
	local -n m=$2
	local -a a b
	read -r -a a <<<"${m[$1]}"
	read -r -a b <<<"${m[$3]}"
	local i
	for i in "${!a[@]}"; do awk -v x="${a[$i]}" -v y="${b[$i]}" 'BEGIN { printf "%.4f\n", x / y }'; done
}
fmt() { awk -v x="$1" -v f="$2" 'BEGIN { printf f, x }'; }

{
	echo "# caddy-ratelimit: side-by-side load test"
	echo
	echo "- date: $started; commit $commit; $rounds_done interleaved rounds x ${DURATION} s"
	echo "- command: \`ROUNDS=$ROUNDS DURATION=$DURATION make compare\`$([ "$SCENARIOS" = "$ALL_ROWS" ] || echo " with SCENARIOS=\"$SCENARIOS\"")$([ -z "$BASE" ] || echo " and BASE=$BASE_NAME")$( ((REDIS_IDLE)) && echo " and REDIS_IDLE=1")$( ((SCHED_VS)) && echo " and SCHED_VS=1")"
	echo "- machine: $ncpu cores, $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -n 1), $(awk '$1 == "MemTotal:" { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo); load average before $load_before, after $(cut -d' ' -f1-3 /proc/loadavg)"
	echo "- Caddy $CADDY_VERSION on core $CADDY_CPU (GOMAXPROCS 1), \`wrk -t1 -c$CONNS\` on core $WRK_CPU, loopback$( ((REDIS_CPU == WRK_CPU)) || echo ", redis-server on core $REDIS_CPU")$( ((REDIS_IDLE)) && echo ", redis-server and mariadbd under SCHED_IDLE"), \`respond \"ok\" 200\`; peer: $PEER_MODULE $PEER_VERSION$( ((PEER)) || echo ' (not run: PEER=0)')"
	echo
	echo "| scenario | module | CPU/request × baseline (min–max) | req/s × baseline (min–max) | p50 / p99 ms | p99 × baseline | memory per key | bar (CPU ×) | verdict |"
	echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
} >"$MD"
printf 'row\tmodule\tcpu_x\tcpu_min\tcpu_max\trps_x\trps_min\trps_max\tbar\n' >"$TSV"

for v in "${order[@]}"; do
	base=$(base_of "$v")
	row=$(row_of "$v")
	mapfile -t cx < <(ratio_list "$v" CPU "$base")
	mapfile -t tx < <(ratio_list "$v" RPS "$base")
	mapfile -t px < <(ratio_list "$v" P99 "$base")
	read -r -a p50 <<<"${P50[$v]}"
	read -r -a p99 <<<"${P99[$v]}"
	cmed=$(median "${cx[@]}") tmed=$(median "${tx[@]}") pmed=$(median "${px[@]}")
	mod="this module"
	is_peer "$v" && mod="peer"
	is_base "$v" && mod="this module at $BASE_NAME (BASE)"
	is_sched "$v" && mod="this module, servers $( ((REDIS_IDLE)) && echo 'scheduled as wrk is' || echo 'under SCHED_IDLE') (SCHED_VS)"
	[[ $v == plain* ]] && mod="plain Caddy"
	label=$row
	case $v in
	plain) label="plain (baseline)" ;;
	plainkeys) label="plainkeys (baseline of the keyed rows)" ;;
	plainkeys_cold) label="plainkeys_cold (baseline of the cold rows)" ;;
	plainmw) label="plainmw (control: one no-op middleware)" mod="plain Caddy with Caddy's vars handler" ;;
	plainkeysmw) label="plainkeysmw (control of the keyed rows)" mod="plain Caddy with Caddy's vars handler" ;;
	peer_redis | peer_redis_keys100k | peer_redis_2nodes) mod="peer, storage sync (file system; no Redis)" ;;
	esac
	mem="–"
	if is_keyed "$v" && [[ $v != plainkeys* ]] && [ -n "${RSS[$v]:-}" ]; then
		distinct=$((KEY_SENT[$v] < KEYS ? KEY_SENT[$v] : KEYS))
		bpk=$(((RSS[$v] - RSS[plainkeys]) / distinct))
		mem="$bpk B (RSS $((RSS[$v] >> 20)) MiB vs $((RSS[plainkeys] >> 20)) MiB, $distinct keys); settled $(((RSS1[$v] - RSS1[plainkeys]) / distinct)) B"
		[ -n "${HEAP[$v]}" ] && [ -n "${HEAP[plainkeys]}" ] &&
			mem+="; heap $(((HEAP[$v] - HEAP[plainkeys]) / distinct)) B"
	fi
	extra=""
	if [[ $v == *2nodes ]]; then
		adm=$(awk -v n="${N2XX[$v]}" -v r="$rounds_done" 'BEGIN { printf "%.0f", n / r }')
		central=$(awk -v n="${CENTRAL[$v]}" -v r="$rounds_done" 'BEGIN { printf "%.0f", n / r }')
		allowed=$((TWO_NODE_LIMIT * (DURATION / TWO_NODE_WINDOW + 1)))
		extra="; admitted $adm per run, $(fmt "$(awk -v a="$adm" -v l="$central" 'BEGIN { print a / l }')" '%.2f') × the $central one central count admits in the same runs (at most $allowed)"
		if [ -n "${ORIGIN_CALLS[$v]:-}" ]; then
			extra+=", $(awk -v c="${ORIGIN_CALLS[$v]}" -v n="${N2XX[$v]}" 'BEGIN { printf "%.3f", c / n }') Redis round trips and $(awk -v c="${REDIS_CMDS[$v]}" -v n="${N2XX[$v]}" 'BEGIN { printf "%.3f", c / n }') commands per admission"
		fi
	elif [ -n "${REDIS_CMDS[$v]:-}" ]; then
		extra="; $(awk -v c="${REDIS_CMDS[$v]}" -v n="${N2XX[$v]}" 'BEGIN { printf "%.4f", c / n }') Redis commands per request"
		extra+=" and $(awk -v c="${REDIS_NS[$v]:-0}" -v n="${N2XX[$v]}" 'BEGIN { printf "%.2f", c / n / 1000 }') µs of Redis's CPU"
	fi
	ctl=$(control_of "$(row_of "$v")")
	if [ -n "$ctl" ] && [ -n "${CPU[$ctl]:-}" ]; then
		mapfile -t ox < <(ratio_list "$v" CPU "$ctl")
		extra+="; CPU/request $(fmt "$(median "${ox[@]}")" '%.3f') × the control's"
	fi
	if is_keyed "$v" && [[ $v != plainkeys* ]] && [ -n "${FIRST_CPU[$v]:-}" ] && [ -n "${FIRST_CPU[plainkeys]:-}" ]; then
		extra+="; first pass over the keys (warm-up): CPU/request $(awk -v a="${FIRST_CPU[$v]}" -v b="${FIRST_CPU[plainkeys]}" 'BEGIN { printf "%.2f", a / b }') ×"
	fi
	bar="–" verdict="baseline"
	[[ $v == plain*mw ]] && verdict="control"
	if [[ $v != plain* ]]; then
		verdict="–"
		if ! is_peer "$v" && ! is_base "$v" && ! is_sched "$v"; then
			bar=${BAR[$row]}
			miss=()
			if [ "$bar" != - ]; then
				awk -v r="$cmed" -v b="$bar" 'BEGIN { exit !(r > b) }' && miss+=("CPU $(fmt "$cmed" '%.3f') > $bar")
				bar="≤ $bar ×"
			else
				bar="measure"
			fi
			if [ "$row" = keys100k ] && [ -n "${bpk:-}" ] && ((bpk > MAX_BYTES_PER_KEY)); then
				miss+=("$bpk B per key > $MAX_BYTES_PER_KEY B")
			fi
			if [[ $row == redis_keys100k* ]] && awk -v r="$pmed" -v b="$MAX_P99_X" 'BEGIN { exit !(r > b) }'; then
				miss+=("p99 $(fmt "$pmed" '%.2f') × > $MAX_P99_X ×")
			fi
			if [ "$row" = redis_keys100k ] && [ -n "${REDIS_CMDS[$v]:-}" ] &&
				awk -v c="${REDIS_CMDS[$v]}" -v n="${N2XX[$v]}" -v b="$MAX_CMDS_X" 'BEGIN { exit !(c / n > b) }'; then
				miss+=("$(awk -v c="${REDIS_CMDS[$v]}" -v n="${N2XX[$v]}" 'BEGIN { printf "%.2f", c / n }') Redis commands per request > $MAX_CMDS_X")
			fi
			[ "$row" = keys100k ] && bar+=", ≤ $MAX_BYTES_PER_KEY B/key"
			[ "$row" = redis_keys100k ] && bar+=", ≤ $MAX_CMDS_X commands a request"
			[[ $row == redis_keys100k* ]] && bar+=", p99 ≤ $MAX_P99_X ×"
			if [ "$bar" = measure ]; then
				verdict="measured"
			elif [ ${#miss[@]} -eq 0 ]; then
				verdict="met"
				MET+=("$row")
			else
				why=$(printf '%s; ' "${miss[@]}")
				verdict="**missed** (${why%; })"
				MISSES+=("$row: ${why%; }")
			fi
		fi
		is_base "$v" || is_sched "$v" || printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$row" "$(is_peer "$v" && echo peer || echo ours)" \
			"$cmed" "$(printf '%s\n' "${cx[@]}" | sort -g | head -n 1)" "$(printf '%s\n' "${cx[@]}" | sort -g | tail -n 1)" \
			"$tmed" "$(printf '%s\n' "${tx[@]}" | sort -g | head -n 1)" "$(printf '%s\n' "${tx[@]}" | sort -g | tail -n 1)" \
			"$(is_peer "$v" || [ "${BAR[$row]}" = - ] && echo - || echo "${BAR[$row]}")" >>"$TSV"
	fi
	printf '| %s | %s | %s (%s) | %s (%s) | %s / %s | %s | %s | %s | %s |\n' "$label" "$mod" \
		"$(fmt "$cmed" '%.3f')" "$(span "${cx[@]}")" "$(fmt "$tmed" '%.3f')" "$(span "${tx[@]}")" \
		"$(fmt "$(median "${p50[@]}")" '%.0f' | awk '{ printf "%.2f", $1 / 1000 }')" \
		"$(fmt "$(median "${p99[@]}")" '%.0f' | awk '{ printf "%.2f", $1 / 1000 }')" \
		"$(fmt "$pmed" '%.2f')" "$mem" "$bar" "$verdict$extra" >>"$MD"
done
{
	echo
	echo "CPU/request × baseline: per round, Caddy's CPU time per request (all threads, from /proc) divided by"
	echo "the baseline's in the same round; median over rounds, min–max in brackets. req/s × baseline: the"
	echo "same for throughput. p50 / p99: wrk's, medians over rounds (two nodes: the larger of the two)."
	echo "The baseline is plain Caddy; for keys100k and redis_keys100k plain Caddy under the same keyed wrk"
	echo "script (plainkeys). Memory per key: (RSS − plainkeys' RSS) / distinct keys, read at once after a forced"
	echo "GC at the end of the rounds; settled: the same once each RSS stops falling (Go returns freed pages in"
	echo "the background; at most 10 s); heap: the same with go_memstats_heap_inuse_bytes. The keyed variants"
	echo "warm up until every key has been sent once, so the rounds measure warm keys; the first pass, where"
	echo "each key is created (with Redis: its cell first written), is given on its own against"
	echo "plainkeys' first pass. The cold rows (keys100k_cold, redis_keys100k_cold) send every request with"
	echo "a key their process, and Redis, never saw (keys that come once, or a process after a deploy),"
	echo "against plain Caddy under the same script (plainkeys_cold): the first pass in every round."
	if [ -n "${CPU[plainmw]:-}${CPU[plainkeysmw]:-}" ]; then
		echo "The controls (plainmw; plainkeysmw under the keyed script) are plain Caddy with one no-op middleware"
		echo "in front of respond (Caddy's vars handler): what any middleware costs, this module's or another's."
		echo "\"× the control's\" divides a row's CPU per request by its control's in the same round: the rate"
		echo "limiter's own cost beyond being a middleware."
	fi
	echo "The peer keeps a ring of 24 bytes × limit per key, so its limits differ: 10⁶ per 10 s for one key,"
	echo "100 per hour for each of 100,000 keys (this module: 10⁹ per hour), never reached in either case."
	echo "Its distributed mode syncs through Caddy storage (a private file-system directory, every 5 s), not Redis."
	for n in ${NOTES[@]+"${NOTES[@]}"}; do echo; echo "Note: $n"; done
	echo
	if [ ${#MISSES[@]} -eq 0 ]; then echo "Every bar met."; else
		echo "Bars met: ${MET[*]:-none}. Bars missed:"
		for n in "${MISSES[@]}"; do echo "- $n"; done
	fi
} >>"$MD"

if "$GO" run ./loadtest/chart -in "$TSV" -out "$RESULTS/compare.svg" -title "CPU per request and throughput vs plain Caddy ($started, $rounds_done rounds)"; then
	echo "loadtest: chart in $RESULTS/compare.svg" >&2
else
	echo "loadtest: WARNING: the chart could not be drawn" >&2
fi
echo
cat "$MD"
echo
echo "loadtest: table in $MD, data in $TSV" >&2

# --- optional profile ----------------------------------------------------

for p in $PROFILE; do
	if [[ " ${order[*]} " != *" $p "* ]]; then
		echo "loadtest: NOTE: no profile of $p: it did not run" >&2
		continue
	fi
	prof=${PROFILE_DIR:-${TMPDIR:-/tmp}}/loadtest-$p.cpu.pb.gz
	mkdir -p "$(dirname "$prof")"
	secs=$((DURATION > 2 ? DURATION - 1 : 1))
	bin=$BIN
	is_peer "$p" && bin=$PBIN
	is_base "$p" && bin=$BBIN
	echo
	echo "loadtest: profiling $p for ${secs}s under load (not part of the table)"
	place_servers "$p"
	resume "$p"
	curl -s --max-time $((secs + 30)) -o "$prof" \
		"http://127.0.0.1:$(first "${ADMINS[$p]}")/debug/pprof/profile?seconds=$secs" &
	curl_pid=$!
	load "$p" "$DURATION"
	wait "$curl_pid" || die "could not fetch the CPU profile of $p"
	pause "$p"
	echo "loadtest: CPU profile of $p in $prof ($R_RPS req/s while profiling)"
	"$GO" tool pprof -top -nodecount=30 "$bin" "$prof" 2>/dev/null | sed -n '4,40p'
	echo "loadtest: cumulative, this module's code only:"
	"$GO" tool pprof -top -cum -nodecount=40 -focus='edgelimit/caddy-ratelimit' "$bin" "$prof" 2>/dev/null | sed -n '4,50p'
done
