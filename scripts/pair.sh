#!/usr/bin/env bash
# Paired load test (`make pair`): two variants of the load harness
# (loadtest/Caddyfile.<variant>) served at the same time on the same core,
# each by its own wrk, so that whatever else the machine does in a round
# falls on both alike. A round's ratio is B's Caddy CPU time per request
# divided by A's over the same seconds; the report is the median and the
# min-max over rounds.
#
#   make pair A=plain B=allow                    # 15 rounds x 4 s
#   A=allow_off B=allow ROUNDS=21 make pair
#   A=plainkeys B=keys100k make pair             # keyed: every key sent once first
#   BASE=a8524b2 A=allow B=allow make pair       # side A built from that commit
#
# Why: on a shared virtual machine, the CPU time per request of one Caddy
# moved by ±30 % from one 4-second run to the next (2026-11-26: plain Caddy
# 50 to 70 µs), and `make compare`, which runs the variants one after the
# other, gives each round's ratio that noise. Run side by side, plain
# against plain moved by ±3 % (0.93-1.03 in eight rounds).
#
# What it measures differs from `make compare`: two Caddy processes take
# turns on one core, so each runs with the other's working set in the
# caches, and each gets half the connections (CONNS/2). It is for telling
# two variants apart, a few percent at a time, not for the absolute figures
# of the published table.
#
# Environment: A, B (variants; B is divided by A), ROUNDS=15 DURATION=4
# WARMUP=2 CONNS=64 CADDY_CPU=0 WRK_CPU=1; BASE=<commit> serves side A with
# cmd/caddy built from that commit (a git worktree; this tree's Caddyfiles),
# so that one change is weighed against the build before it. Variants that use Redis get a
# private redis-server (A on database 0, B on database 1); redis_mysql,
# the two-node and the cold variants are not supported. Everything it
# starts is stopped on exit.
set -euo pipefail

A=${A:-plain}
B=${B:-allow}
ROUNDS=${ROUNDS:-15}
DURATION=${DURATION:-4}
WARMUP=${WARMUP:-2}
CONNS=${CONNS:-64}
CADDY_CPU=${CADDY_CPU:-0}
WRK_CPU=${WRK_CPU:-1}
GO=${GO:-go}
BASE=${BASE:-}
KEYS=100000

die() {
	echo "pair: $*" >&2
	exit 1
}

cd "$(dirname "${BASH_SOURCE[0]}")/.."
for v in ROUNDS DURATION WARMUP CONNS CADDY_CPU WRK_CPU; do
	[[ ${!v} =~ ^[0-9]+$ ]] || die "$v must be a non-negative integer, not '${!v}'"
done
((ROUNDS >= 1 && DURATION >= 1 && CONNS >= 4)) || die "ROUNDS and DURATION must be at least 1, CONNS at least 4"
for v in "$A" "$B"; do
	# The unsupported kinds first: the cold rows of make compare have no
	# Caddyfile of their own, so A=keys100k_cold was "no variant".
	[[ $v == *2nodes || $v == *_cold || $v == *mysql* || $v == peer_* ]] &&
		die "$v: two-node, cold, MySQL and peer variants are not supported"
	[[ $v =~ ^[a-z0-9_]+$ && -f loadtest/Caddyfile.$v ]] || die "no variant '$v' (loadtest/Caddyfile.<variant>)"
done

uses_redis() { grep -q 'LT_REDIS_PORT' "loadtest/Caddyfile.$1"; }
is_keyed() { [[ $1 == plainkeys* || $1 == *keys100k ]]; }

need=(wrk)
if uses_redis "$A" || uses_redis "$B"; then need+=(redis-server); fi
scripts/ensure-servers.sh "${need[@]}" || exit 1
for tool in taskset curl awk "$GO"; do
	command -v "$tool" >/dev/null 2>&1 || die "$tool is not on PATH"
done

TMP=$(mktemp -d "${TMPDIR:-/tmp}/pair.XXXXXX")
PIDS=""
# free_port, cpu_ns, stop_all and field.
# shellcheck source=scripts/harness-lib.sh
. scripts/harness-lib.sh

cleanup() {
	# shellcheck disable=SC2086 # PIDS is a list of pids on purpose
	stop_all $PIDS
	[ -z "$BASE" ] || git worktree remove --force "$TMP/base" >/dev/null 2>&1 || true
	rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "pair: building cmd/caddy" >&2
"$GO" build -o "$TMP/caddy" ./cmd/caddy
declare -A BIN=([a]=$TMP/caddy [b]=$TMP/caddy) LABEL=([a]=$A [b]=$B)
if [ -n "$BASE" ]; then
	name=$(git rev-parse --short "$BASE^{commit}") || die "BASE=$BASE is not a commit"
	echo "pair: building cmd/caddy at $name (BASE, side A)" >&2
	git worktree add --detach "$TMP/base" "$name" >/dev/null 2>&1 || die "git worktree add $name failed"
	(cd "$TMP/base" && "$GO" build -o "$TMP/caddy-base" ./cmd/caddy) || die "go build ./cmd/caddy at $name failed"
	BIN[a]=$TMP/caddy-base LABEL[a]="$A at $name"
fi

REDIS_PORT=""
if uses_redis "$A" || uses_redis "$B"; then
	free_port
	REDIS_PORT=$FREE_PORT
	taskset -c "$WRK_CPU" redis-server --port "$REDIS_PORT" --bind 127.0.0.1 \
		--save "" --appendonly no --dir "$TMP" --logfile "$TMP/redis.log" >/dev/null 2>&1 &
	PIDS+=" $!"
fi

# The two sides are "a" and "b"; each has its Caddy's pid, port and the
# keys its wrk has sent so far.
declare -A VAR=([a]=$A [b]=$B) PID PORT SENT=([a]=0 [b]=0)
start() { # start <side>
	local s=$1 admin db=0
	[ "$s" = b ] && db=1
	free_port
	admin=$FREE_PORT
	free_port
	PORT[$s]=$FREE_PORT
	XDG_DATA_HOME=$TMP/data-$s XDG_CONFIG_HOME=$TMP/config \
		LT_ADMIN_PORT=$admin LT_PORT=${PORT[$s]} LT_REDIS_PORT=${REDIS_PORT:-0}/$db \
		LT_STORAGE=$TMP/storage-$s LT_MYSQL_DSN=unused \
		taskset -c "$CADDY_CPU" "${BIN[$s]}" run --adapter caddyfile \
		--config "loadtest/Caddyfile.${VAR[$s]}" >"$TMP/caddy-$s.log" 2>&1 &
	PID[$s]=$!
	PIDS+=" ${PID[$s]}"
	for _ in $(seq 150); do
		curl -s -o /dev/null --max-time 1 "http://127.0.0.1:${PORT[$s]}/" && return 0
		kill -0 "${PID[$s]}" 2>/dev/null || { tail -n 20 "$TMP/caddy-$s.log" >&2; die "${VAR[$s]}: Caddy failed to start"; }
		sleep 0.1
	done
	die "${VAR[$s]}: Caddy did not answer"
}

# run <seconds>: both wrks at once; sets REQ_<side> and CPU_<side> (ns of
# Caddy CPU per request), and fails on socket errors or an unexpected status.
run() {
	local d=$1 s c0a c0b line
	local -A wp c0
	for s in a b; do c0[$s]=$(cpu_ns "${PID[$s]}"); done
	for s in a b; do
		local -a env=()
		is_keyed "${VAR[$s]}" && env=(LT_KEYS=$KEYS LT_KEY_START=${SENT[$s]})
		env "${env[@]}" timeout $((d + 30)) taskset -c "$WRK_CPU" \
			wrk -t1 -c$((CONNS / 2)) -d"${d}s" -s loadtest/wrk.lua \
			"http://127.0.0.1:${PORT[$s]}/" >"$TMP/wrk-$s.out" 2>&1 &
		wp[$s]=$!
	done
	# A wrk that failed stops the other too: the cleanup stops Caddy, not
	# wrk, which otherwise ran on for up to its duration and 30 s more.
	for s in a b; do wait "${wp[$s]}" || {
		kill "${wp[a]}" "${wp[b]}" 2>/dev/null
		cat "$TMP/wrk-$s.out" >&2
		die "${VAR[$s]}: wrk failed"
	}; done
	for s in a b; do
		kill -0 "${PID[$s]}" 2>/dev/null || die "${VAR[$s]}: Caddy died under load"
		line=$(grep '^LT ' "$TMP/wrk-$s.out" | tail -n 1)
		[ -n "$line" ] || { cat "$TMP/wrk-$s.out" >&2; die "${VAR[$s]}: no summary from wrk"; }
		(($(field sock_errors) == 0)) || die "${VAR[$s]}: $(field sock_errors) socket errors"
		local want=200
		[[ ${VAR[$s]} == deny ]] && want=429
		echo "$(field codes)," | tr ',' '\n' | awk -F: -v w="$want" -v v="${VAR[$s]}" \
			'NF == 2 && $1 != w && !(v == "deny" && $1 == 200 && $2 == 1) { bad = 1 } END { exit bad }' ||
			die "${VAR[$s]}: statuses $(field codes), want $want"
		printf -v "REQ_$s" '%s' "$(field requests)"
		printf -v "CPU_$s" '%s' "$((($(cpu_ns "${PID[$s]}") - c0[$s]) / $(field requests)))"
		SENT[$s]=$((SENT[$s] + $(field keyed_sent)))
	done
}

start a
start b
echo "pair: ${LABEL[a]} (pid ${PID[a]}) and ${LABEL[b]} (pid ${PID[b]}) on core $CADDY_CPU, wrk -c$((CONNS / 2)) each on core $WRK_CPU" >&2
run "$WARMUP"
while (is_keyed "$A" && ((SENT[a] < KEYS))) || (is_keyed "$B" && ((SENT[b] < KEYS))); do
	run "$WARMUP" # every key once before the rounds: warm keys only
done

ratios=()
for r in $(seq "$ROUNDS"); do
	run "$DURATION"
	x=$(awk -v a="$CPU_a" -v b="$CPU_b" 'BEGIN { printf "%.4f", b / a }')
	ratios+=("$x")
	printf 'pair: round %d/%d: %s %.1f µs, %s %.1f µs per request: %s\n' "$r" "$ROUNDS" \
		"${LABEL[a]}" "$(awk -v c="$CPU_a" 'BEGIN { print c / 1000 }')" "$B" "$(awk -v c="$CPU_b" 'BEGIN { print c / 1000 }')" "$x"
done
printf '%s\n' "${ratios[@]}" | sort -g | awk -v a="${LABEL[a]}" -v b="$B" -v n="$ROUNDS" -v d="$DURATION" '
	{ v[NR] = $1 }
	END {
		m = NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
		printf "pair: %s / %s, CPU per request, side by side: median %.3f (%.3f-%.3f) over %d rounds of %d s\n", b, a, m, v[1], v[NR], n, d
	}'
