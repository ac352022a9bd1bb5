#!/usr/bin/env bash
# How busy each process is under load (`make busy`): one variant of the load
# harness (loadtest/Caddyfile.<variant>) pinned to a core as `make compare`
# pins it, wrk on the other, and, for a Redis variant, a private
# redis-server; each round prints wrk's requests a second and p99, and the
# CPU each process used over the middle seconds of the load, as a share of
# one core, then Caddy's CPU, read and write calls and context switches per
# request. A Caddy whose share stays below 100 % while wrk keeps 64
# connections busy was waiting for something other than its core.
#
#   VARIANT=redis_keys100k make busy              # cold keys: every key new
#   VARIANT=redis_keys100k KEYS=warm make busy    # 100,000 keys, each sent once first
#   VARIANT=redis_keys100k REDIS_CPU=0 make busy  # Redis on Caddy's core
#   VARIANT=redis_keys100k REDIS_IDLE=1 make busy # Redis under SCHED_IDLE (chrt)
#   VARIANT=keys100k KEYS=warm NEIGHBOUR=15 make busy
#                            # plus a process busy 15 % of wrk's core doing
#                            # nothing for anyone (loadtest/neighbour)
#   PROFILE=/tmp/busy.pb.gz make busy             # plus Caddy's CPU profile of the last round
#   TRACE=/tmp/busy.trace make busy               # or its execution trace (go tool trace)
#   BASE=c229eff KEYS=warm make busy              # each round on this build, then on that commit's
#
# Environment: VARIANT=redis_keys100k KEYS=cold|warm ROUNDS=3 DURATION=4
# CONNS=64 CADDY_CPU=0 WRK_CPU=1 REDIS_CPU=$WRK_CPU REDIS_IDLE=0 NEIGHBOUR=0
# (percent of wrk's core a neighbour process keeps busy) PROFILE
# (a file: Caddy's CPU profile over the last round's measured seconds,
# from the admin endpoint's /debug/pprof/profile) TRACE (a file: the same
# seconds' execution trace, /debug/pprof/trace; not with PROFILE), BASE
# (a commit: a second Caddy built from it, a git worktree with this tree's
# Caddyfiles, on Redis database 1; every round runs on this build and then
# on that one, each stopped while the other is measured, and the end
# prints this build's CPU per request over that one's, round by round, as
# a median: a change weighed where Redis's work lands beside wrk, which
# make pair, whose sides share Redis and wrk's core, cannot see; the
# profile and trace are this build's).
# Two-node, MySQL and peer variants are not supported. Everything it starts
# is stopped on exit.
set -euo pipefail

VARIANT=${VARIANT:-redis_keys100k}
KEYS=${KEYS:-cold}
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-4}
CONNS=${CONNS:-64}
CADDY_CPU=${CADDY_CPU:-0}
WRK_CPU=${WRK_CPU:-1}
REDIS_CPU=${REDIS_CPU:-$WRK_CPU}
REDIS_IDLE=${REDIS_IDLE:-0}
NEIGHBOUR=${NEIGHBOUR:-0}
PROFILE=${PROFILE:-}
TRACE=${TRACE:-}
BASE=${BASE:-}
GO=${GO:-go}

die() {
	echo "busy: $*" >&2
	exit 1
}

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/harness-lib.sh
. scripts/harness-lib.sh
for v in ROUNDS DURATION CONNS CADDY_CPU WRK_CPU REDIS_CPU REDIS_IDLE NEIGHBOUR; do
	[[ ${!v} =~ ^[0-9]+$ ]] || die "$v must be a non-negative integer, not '${!v}'"
done
((ROUNDS >= 1 && DURATION >= 3 && CONNS >= 4)) || die "ROUNDS must be at least 1, DURATION at least 3, CONNS at least 4"
((NEIGHBOUR <= 100)) || die "NEIGHBOUR is a percent of a core, at most 100, not $NEIGHBOUR"
[[ $VARIANT =~ ^[a-z0-9_]+$ && -f loadtest/Caddyfile.$VARIANT ]] || die "no variant '$VARIANT' (loadtest/Caddyfile.<variant>)"
[[ $VARIANT == *2nodes || $VARIANT == *mysql* || $VARIANT == peer_* ]] &&
	die "$VARIANT: two-node, MySQL and peer variants are not supported"
[[ -z $PROFILE || -z $TRACE ]] || die "PROFILE and TRACE are one at a time"
[[ $KEYS == cold || $KEYS == warm ]] || die "KEYS must be cold or warm, not '$KEYS'"
need=(wrk curl)
grep -q LT_REDIS_PORT "loadtest/Caddyfile.$VARIANT" && need+=(redis-server)
scripts/ensure-servers.sh "${need[@]}" || exit 1
for t in taskset "$GO"; do command -v "$t" >/dev/null || die "$t is not on PATH"; done

TMP=$(mktemp -d)
PIDS=()
cleanup() {
	stop_all "${PIDS[@]}"
	[ -z "$BASE" ] || git worktree remove --force "$TMP/base" >/dev/null 2>&1 || true
	rm -rf "$TMP"
}
trap cleanup EXIT

"$GO" build -o "$TMP/caddy" ./cmd/caddy || die "cannot build cmd/caddy"
BASE_NAME=""
if [ -n "$BASE" ]; then
	BASE_NAME=$(git rev-parse --short "$BASE^{commit}") || die "BASE=$BASE is not a commit"
	git worktree add --detach "$TMP/base" "$BASE_NAME" >/dev/null 2>&1 || die "git worktree add $BASE_NAME failed"
	(cd "$TMP/base" && "$GO" build -o "$TMP/caddy-base" ./cmd/caddy) || die "cannot build cmd/caddy at $BASE_NAME"
fi
if ((NEIGHBOUR)); then
	"$GO" build -o "$TMP/neighbour" ./loadtest/neighbour || die "cannot build loadtest/neighbour"
fi
REDIS_PID=""
if grep -q LT_REDIS_PORT "loadtest/Caddyfile.$VARIANT"; then
	command -v redis-server >/dev/null || die "redis-server is missing (scripts/ensure-servers.sh installs it)"
	free_port
	export LT_REDIS_PORT=$FREE_PORT
	taskset -c "$REDIS_CPU" redis-server --port "$LT_REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
		>"$TMP/redis.log" 2>&1 &
	REDIS_PID=$!
	PIDS+=("$REDIS_PID")
	wait_port "$LT_REDIS_PORT" "$REDIS_PID" 10 || die "redis-server did not start: $(tail -n 5 "$TMP/redis.log")"
	((REDIS_IDLE)) && { chrt --all-tasks --idle -p 0 "$REDIS_PID" || die "chrt --idle failed"; }
fi
# start_caddy <side> <binary> <Redis suffix>: the variant's Caddy for one
# side (head, or base: BASE's build, on Redis database 1 so that the two
# share no key), pinned as make compare pins it.
declare -A CPID URL ADMIN LABEL=([head]=$VARIANT [base]="$VARIANT at ${BASE_NAME:-}")
start_caddy() {
	local side=$1 bin=$2 port admin redis=${LT_REDIS_PORT:-}
	free_port
	port=$FREE_PORT
	free_port
	admin=$FREE_PORT
	[ -n "$redis" ] && redis+=$3
	LT_PORT=$port LT_ADMIN_PORT=$admin LT_REDIS_PORT=$redis GOMAXPROCS=1 taskset -c "$CADDY_CPU" "$bin" run \
		--config "loadtest/Caddyfile.$VARIANT" --adapter caddyfile >"$TMP/caddy-$side.log" 2>&1 &
	CPID[$side]=$!
	PIDS+=("$!")
	URL[$side]=http://127.0.0.1:$port/
	ADMIN[$side]=$admin
	for _ in $(seq 100); do
		curl -s -o /dev/null "${URL[$side]}" && break
		kill -0 "${CPID[$side]}" 2>/dev/null || die "Caddy ($side) exited: $(tail -n 5 "$TMP/caddy-$side.log")"
		sleep 0.1
	done
	curl -s -o /dev/null "${URL[$side]}" || die "Caddy ($side) does not answer on ${URL[$side]}"
}

# wrk_run <side> <seconds> <prefix> <keys>: wrk in the background on
# WRK_CPU against that side's Caddy.
wrk_run() {
	LT_KEYS=$4 LT_KEY_PREFIX=$3 taskset -c "$WRK_CPU" wrk -t1 -c"$CONNS" -d"$2"s -s loadtest/wrk.lua "${URL[$1]}" >"$TMP/wrk.out" 2>&1 &
	WRK_PID=$!
}
keys=1000000000
[ "$KEYS" = warm ] && keys=100000
SIDES=(head)
[ -n "$BASE" ] && SIDES+=(base)
for side in "${SIDES[@]}"; do
	if [ "$side" = head ]; then start_caddy head "$TMP/caddy" ""; else start_caddy base "$TMP/caddy-base" /1; fi
	# Warm-up: the warm keys all once (at 20,000 a second or more), or
	# cold keys of their own.
	wrk_run "$side" "$([ "$KEYS" = warm ] && echo 6 || echo 2)" w "$keys"
	wait "$WRK_PID" || die "wrk failed in the warm-up: $(tail -n 3 "$TMP/wrk.out")"
	# The side not measured waits stopped, so its replay and collections
	# never land on the measured core or reach Redis meanwhile.
	((${#SIDES[@]} > 1)) && kill -STOP "${CPID[$side]}"
done
NEIGHBOUR_PID=""
if ((NEIGHBOUR)); then
	taskset -c "$WRK_CPU" "$TMP/neighbour" -share "$NEIGHBOUR" -period "${NEIGHBOUR_PERIOD:-3ms}" &
	NEIGHBOUR_PID=$!
	PIDS+=("$NEIGHBOUR_PID")
fi

echo "busy: $VARIANT, $KEYS keys; Caddy on core $CADDY_CPU, wrk on core $WRK_CPU$([ -n "$REDIS_PID" ] && echo ", Redis on core $REDIS_CPU$( ((REDIS_IDLE)) && echo ' (SCHED_IDLE)')")$( ((NEIGHBOUR)) && echo ", a neighbour busy $NEIGHBOUR % of core $WRK_CPU")$([ -n "$BASE" ] && echo "; each round on this build, then on $BASE_NAME")"
# sample: the CPU time (ns) of Caddy (CADDY_PID), wrk, Redis and the
# neighbour (0 for those not running), Caddy's read and write calls and
# context switches, and the clock (ns), on one line.
sample() {
	local r=0 n=0
	[ -n "$REDIS_PID" ] && r=$(cpu_ns "$REDIS_PID")
	[ -n "$NEIGHBOUR_PID" ] && n=$(cpu_ns "$NEIGHBOUR_PID")
	echo "$(cpu_ns "$CADDY_PID") $(cpu_ns "$WRK_PID") $r $n $(io_switches "$CADDY_PID") $(date +%s%N)"
}
declare -A US # <side>,<round>: Caddy's µs of CPU per request
for r in $(seq "$ROUNDS"); do
	for side in "${SIDES[@]}"; do
		CADDY_PID=${CPID[$side]}
		((${#SIDES[@]} > 1)) && kill -CONT "$CADDY_PID"
		prefix=c$r$side
		[ "$KEYS" = warm ] && prefix=w
		wrk_run "$side" "$DURATION" "$prefix" "$keys"
		sleep 1
		window=$((DURATION - 2))
		read -r c0 w0 r0 n0 io0 sw0 t0 <<<"$(sample)"
		if [ -n "$PROFILE" ] && ((r == ROUNDS)) && [ "$side" = head ]; then
			curl -s --max-time $((window + 10)) -o "$PROFILE" "http://127.0.0.1:${ADMIN[$side]}/debug/pprof/profile?seconds=$window" ||
				die "no CPU profile from the admin endpoint"
		elif [ -n "$TRACE" ] && ((r == ROUNDS)) && [ "$side" = head ]; then
			curl -s --max-time $((window + 10)) -o "$TRACE" "http://127.0.0.1:${ADMIN[$side]}/debug/pprof/trace?seconds=$window" ||
				die "no execution trace from the admin endpoint"
		else
			sleep "$window"
		fi
		read -r c1 w1 r1 n1 io1 sw1 t1 <<<"$(sample)"
		wait "$WRK_PID" || die "wrk failed: $(tail -n 3 "$TMP/wrk.out")"
		((${#SIDES[@]} > 1)) && kill -STOP "$CADDY_PID"
		line=$(grep '^LT ' "$TMP/wrk.out") || die "wrk printed no summary: $(tail -n 3 "$TMP/wrk.out")"
		[ "$(field sock_errors)" = 0 ] || die "socket errors: $line"
		label=""
		((${#SIDES[@]} > 1)) && label=" (${LABEL[$side]})"
		awk -v r="$r" -v lb="$label" -v n="$(field requests)" -v d="$(field duration_us)" -v p99="$(field p99_us)" \
			-v c=$((c1 - c0)) -v w=$((w1 - w0)) -v rd=$((r1 - r0)) -v t=$((t1 - t0)) -v redis="$REDIS_PID" \
			-v io=$((io1 - io0)) -v sw=$((sw1 - sw0)) -v nb=$((n1 - n0)) -v neighbour="$NEIGHBOUR_PID" \
			'BEGIN { rate = n / d * 1e6; q = rate * t / 1e9
				printf "busy: round %d%s: %.0f req/s, p99 %.2f ms; CPU over %.1f s, %% of a core: Caddy %.0f, wrk %.0f%s%s\n",
				r, lb, rate, p99 / 1000, t / 1e9, 100 * c / t, 100 * w / t, redis == "" ? "" : sprintf(", Redis %.0f", 100 * rd / t),
				neighbour == "" ? "" : sprintf(", neighbour %.0f", 100 * nb / t)
				printf "busy: round %d%s: per request (at wrk'"'"'s average rate): Caddy %.1f µs of CPU, %.2f read and write calls, %.3f context switches\n",
				r, lb, c / q / 1000, io / q, sw / q }' | tee "$TMP/round.out"
		US[$side,$r]=$(sed -n 's/.*per request.*Caddy \([0-9.]*\) µs.*/\1/p' "$TMP/round.out")
	done
done
if [ -n "$BASE" ]; then
	ratios=()
	for r in $(seq "$ROUNDS"); do
		ratios+=("$(awk -v a="${US[head,$r]}" -v b="${US[base,$r]}" 'BEGIN { printf "%.4f", a / b }')")
	done
	printf '%s\n' "${ratios[@]}" | sort -g | awk -v v="$VARIANT" -v b="$BASE_NAME" -v n="$ROUNDS" '
		{ x[NR] = $1 }
		END { m = (NR % 2) ? x[(NR + 1) / 2] : (x[NR / 2] + x[NR / 2 + 1]) / 2
			printf "busy: %s, this build / %s: Caddy CPU per request, round by round: median %.3f (%.3f-%.3f) over %d rounds\n", v, b, m, x[1], x[NR], n }'
fi
[ -z "$PROFILE" ] || echo "busy: Caddy's CPU profile of the last round in $PROFILE (go tool pprof -top $PROFILE)"
[ -z "$TRACE" ] || echo "busy: Caddy's execution trace of the last round in $TRACE (go tool trace $TRACE)"
