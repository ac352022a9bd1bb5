#!/usr/bin/env bash
# End-to-end load test: real Caddy processes with the ratelimit module, driven
# by wrk over loopback, compared side by side with plain Caddy.
#
#   make loadtest                       # 5 rounds x 5 s
#   ROUNDS=3 DURATION=5 OUT=perf.txt make loadtest
#
# Each scenario is its own Caddy process (loadtest/Caddyfile.<scenario>) on a
# free loopback port with its own admin port (never 2019), serving
# `respond "ok" 200`. Caddy is pinned to CADDY_CPU (default 0, so
# GOMAXPROCS=1) and wrk to WRK_CPU (default 1). After one warm-up per
# scenario, the rounds interleave: every round runs every scenario once, in
# the same order, so slow phases of a noisy machine hit all scenarios alike.
# Ratios are per round (scenario / plain of the same round), then the median,
# both of req/s and of Caddy's CPU time per request (read from /proc, much
# steadier than req/s when other processes share Caddy's core).
#
# Environment:
#   ROUNDS=5 DURATION=5   rounds, and seconds of load per scenario per round
#   WARMUP=2              seconds of warm-up load when a scenario starts
#   CONNS=64              wrk connections (one wrk thread)
#   CADDY_CPU=0 WRK_CPU=1 cores for Caddy and for wrk (and redis-server)
#   SCENARIOS="plain allow deny keys100k redis"   a subset; plain is always run
#   OUT=<file>            also write the result table there
#   PROFILE="<scenario> …" after the rounds, one more run of each with a CPU
#                         profile from Caddy's admin /debug/pprof; prints the
#                         share of Caddy's CPU spent in the ratelimit handler
#                         and the top functions; keeps each profile in
#                         PROFILE_DIR (default ${TMPDIR:-/tmp}) as
#                         loadtest-<scenario>.cpu.pb.gz
#
# The harness fails (exit 1, with Caddy's log tail) when Caddy does not start
# or dies, when wrk sees any socket error, or when a scenario answers other
# statuses than it must (plain, allow, keys100k, redis: only 200; deny: only
# 429). A missed performance bar is reported, not a failure. Traffic only
# ever goes to 127.0.0.1.
set -euo pipefail

ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-5}
WARMUP=${WARMUP:-2}
CONNS=${CONNS:-64}
CADDY_CPU=${CADDY_CPU:-0}
WRK_CPU=${WRK_CPU:-1}
SCENARIOS=${SCENARIOS:-"plain allow deny keys100k redis"}
OUT=${OUT:-}
PROFILE=${PROFILE:-}
GO=${GO:-go}
KEYS=100000 # distinct keys of keys100k

# The guide's bars: the smallest acceptable ratio to plain per scenario.
declare -A BAR=([allow]=0.98 [deny]=0.95 [keys100k]=0.95 [redis]=0.95)
MAX_BYTES_PER_KEY=512 # keys100k: at most 0.5 KiB of heap per key

die() {
	echo "loadtest: $*" >&2
	exit 1
}

for v in ROUNDS DURATION WARMUP CONNS CADDY_CPU WRK_CPU; do
	[[ ${!v} =~ ^[0-9]+$ ]] || die "$v must be a non-negative integer, not '${!v}'"
done
((ROUNDS >= 1 && DURATION >= 1)) || die "ROUNDS and DURATION must be at least 1"
for p in $PROFILE; do
	[[ " plain plainkeys allow deny keys100k redis " == *" $p "* ]] ||
		die "PROFILE must name scenarios, not '$p'"
done

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# --- tools ---------------------------------------------------------------

if ! command -v wrk >/dev/null 2>&1; then
	if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
		echo "loadtest: installing wrk with apt-get" >&2
		export DEBIAN_FRONTEND=noninteractive
		apt-get update -qq
		apt-get install -y -qq --no-install-recommends wrk
	else
		cat >&2 <<'MSG'
loadtest: wrk (the HTTP load generator, 4.x, with LuaJIT) is not on PATH.
Install it, e.g.:
  Debian/Ubuntu:  sudo apt-get install -y wrk
  macOS:          brew install wrk
MSG
		exit 1
	fi
fi
for tool in taskset curl awk "$GO"; do
	command -v "$tool" >/dev/null 2>&1 ||
		die "$tool is not on PATH (taskset: util-linux; curl; awk; go)"
done
ncpu=$(getconf _NPROCESSORS_ONLN)
((CADDY_CPU < ncpu && WRK_CPU < ncpu && CADDY_CPU != WRK_CPU)) ||
	die "needs two distinct cores CADDY_CPU=$CADDY_CPU and WRK_CPU=$WRK_CPU; this machine has $ncpu"

# --- scratch space and cleanup -------------------------------------------

TMP=$(mktemp -d "${TMPDIR:-/tmp}/loadtest.XXXXXX")
declare -A PID PORT ADMIN
REDIS_PID=""
cleanup() {
	local p
	for p in "${PID[@]}" $REDIS_PID; do
		kill -TERM "$p" 2>/dev/null || true
	done
	for p in "${PID[@]}" $REDIS_PID; do
		for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
		kill -KILL "$p" 2>/dev/null || true
	done
	rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# log_tail prints the end of a scenario's Caddy log, for failures.
log_tail() {
	if [ -f "$TMP/$1.log" ]; then
		echo "--- last lines of Caddy's log ($1) ---" >&2
		tail -n 25 "$TMP/$1.log" >&2
		echo "---" >&2
	fi
}

fail() { # fail <scenario> <message>
	echo "loadtest: FAIL: $1: $2" >&2
	log_tail "$1"
	exit 1
}

# free_port sets FREE_PORT to a loopback TCP port nobody listens on, below
# the ephemeral range (so no outgoing connection holds it), not handed out
# before. (A variable, not output: a subshell would forget USED_PORTS.)
USED_PORTS=" "
FREE_PORT=""
free_port() {
	local p
	for _ in $(seq 500); do
		p=$((20000 + RANDOM % 12000))
		[[ $USED_PORTS == *" $p "* ]] && continue
		if ! timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$p" 2>/dev/null; then
			USED_PORTS+="$p "
			FREE_PORT=$p
			return 0
		fi
	done
	die "no free loopback port found"
}

# metric <admin port> <name> prints a metric's value from Caddy's admin
# /metrics as an integer (Prometheus text uses exponents).
metric() {
	curl -s --max-time 5 "http://127.0.0.1:$1/metrics" |
		awk -v n="$2" '$1 == n { printf "%.0f\n", $2; found = 1 } END { if (!found) print "" }'
}

# cpu_ns <pid> prints the CPU time the process has used, in nanoseconds: the
# sum over its threads of /proc/<pid>/task/*/schedstat, or /proc/<pid>/stat's
# clock ticks where schedstat is missing.
cpu_ns() {
	local t
	t=$(cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{ s += $1 } END { if (NR) printf "%.0f", s }')
	if [ -z "$t" ]; then
		t=$(awk -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); printf "%.0f", ($12 + $13) * 1e9 / hz }' /proc/"$1"/stat)
	fi
	echo "$t"
}

median() { # median of the arguments
	printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END {
		if (NR == 0) { print ""; exit }
		if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# --- scenarios -----------------------------------------------------------

read -r -a scen <<<"$SCENARIOS"
order=(plain) # plain first in every round: the baseline of the ratios
for s in "${scen[@]}"; do
	case $s in
	plain) ;;
	keys100k)
		# Its baseline is plain Caddy under the same keyed client load
		# (wrk's Lua request builder and the X-Key header), not plain.
		[[ " ${order[*]} " == *" plainkeys "* ]] || order+=(plainkeys)
		[[ " ${order[*]} " == *" $s "* ]] || order+=("$s")
		;;
	allow | deny | redis) [[ " ${order[*]} " == *" $s "* ]] || order+=("$s") ;;
	*) die "unknown scenario '$s' (plain allow deny keys100k redis)" ;;
	esac
done

echo "loadtest: building cmd/caddy (non-race)"
BIN=$TMP/caddy
"$GO" build -o "$BIN" ./cmd/caddy || die "go build ./cmd/caddy failed"

NOTES=()

# The redis scenario needs redis-server and the `redis` subdirective of the
# global ratelimit option; without either it is skipped, saying why.
if [[ " ${order[*]} " == *" redis "* ]]; then
	skip=""
	if ! command -v redis-server >/dev/null 2>&1; then
		skip="redis-server is not on PATH (Debian/Ubuntu: apt-get install redis-server)"
	elif ! adapt_err=$(LT_ADMIN_PORT=1 LT_PORT=2 LT_REDIS_PORT=3 \
		"$BIN" adapt --adapter caddyfile --config loadtest/Caddyfile.redis 2>&1 >/dev/null); then
		skip="this build does not accept \`ratelimit { redis redis://… }\` yet: $(
			echo "$adapt_err" | sed -n 's/.*"msg":"\(.*\)"}.*/\1/p' | sed 's/\\"/"/g' | head -n 1)"
	fi
	if [ -n "$skip" ]; then
		echo "loadtest: NOTE: skipping the redis scenario: $skip" >&2
		NOTES+=("redis: skipped: $skip")
		new=()
		for s in "${order[@]}"; do [ "$s" = redis ] || new+=("$s"); done
		order=("${new[@]}")
	fi
fi

REDIS_PORT=""
start_redis() {
	free_port
	REDIS_PORT=$FREE_PORT
	taskset -c "$WRK_CPU" redis-server --port "$REDIS_PORT" --bind 127.0.0.1 \
		--save "" --appendonly no --dir "$TMP" --logfile "$TMP/redis.log" \
		--daemonize no >/dev/null 2>&1 &
	REDIS_PID=$!
	for _ in $(seq 100); do
		if reply=$(timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$REDIS_PORT; printf 'PING\r\n' >&3; head -c 5 <&3" 2>/dev/null) &&
			[ "$reply" = "+PONG" ]; then
			return 0
		fi
		kill -0 "$REDIS_PID" 2>/dev/null || break
		sleep 0.1
	done
	tail -n 20 "$TMP/redis.log" >&2 || true
	die "redis-server did not start on 127.0.0.1:$REDIS_PORT"
}

redis_commands() { # total commands the private redis-server processed
	command -v redis-cli >/dev/null 2>&1 || { echo ""; return; }
	redis-cli -h 127.0.0.1 -p "$REDIS_PORT" info stats 2>/dev/null |
		tr -d '\r' | sed -n 's/^total_commands_processed://p'
}

# start_caddy <scenario> starts its Caddy on fresh ports and waits until it
# answers; a port taken in between is retried with new ones.
start_caddy() {
	local s=$1 attempt
	for attempt in 1 2 3; do
		free_port
		ADMIN[$s]=$FREE_PORT
		free_port
		PORT[$s]=$FREE_PORT
		# Caddy's data and config directories are private to the run.
		XDG_DATA_HOME=$TMP/data XDG_CONFIG_HOME=$TMP/config \
			LT_ADMIN_PORT=${ADMIN[$s]} LT_PORT=${PORT[$s]} LT_REDIS_PORT=$REDIS_PORT \
			taskset -c "$CADDY_CPU" "$BIN" run --adapter caddyfile \
			--config "loadtest/Caddyfile.$s" >"$TMP/$s.log" 2>&1 &
		PID[$s]=$!
		for _ in $(seq 150); do
			if curl -s -o /dev/null --max-time 1 "http://127.0.0.1:${PORT[$s]}/"; then
				return 0
			fi
			kill -0 "${PID[$s]}" 2>/dev/null || break
			sleep 0.1
		done
		if kill -0 "${PID[$s]}" 2>/dev/null; then
			fail "$s" "Caddy did not answer on 127.0.0.1:${PORT[$s]} within 15 s"
		fi
		grep -q "address already in use" "$TMP/$s.log" || break
	done
	fail "$s" "Caddy failed to start"
}

# check_headers <scenario>: one request, to prove the scenario's Caddy does
# what its Caddyfile says (the limiter is on the path, or absent in plain).
check_headers() {
	local s=$1 h code
	h=$(curl -s -D - -o /dev/null --max-time 5 -H "X-Key: header-check" "http://127.0.0.1:${PORT[$s]}/") ||
		fail "$s" "request failed"
	code=$(echo "$h" | awk 'NR == 1 { print $2 }')
	case $s in
	plain | plainkeys)
		[ "$code" = 200 ] || fail "$s" "status $code, want 200"
		! echo "$h" | grep -qi '^ratelimit:' || fail "$s" "plain Caddy sent RateLimit headers"
		;;
	deny)
		[ "$code" = 429 ] || fail "$s" "status $code after the warm-up, want 429"
		echo "$h" | grep -qi '^retry-after:' || fail "$s" "429 without Retry-After"
		;;
	*)
		[ "$code" = 200 ] || fail "$s" "status $code, want 200"
		echo "$h" | grep -qi '^ratelimit:' || fail "$s" "no RateLimit header: is the limiter on the path?"
		;;
	esac
}

# --- wrk -----------------------------------------------------------------

KEY_SENT=0 # keyed requests sent to keys100k so far (the next key index)

# load <scenario> <seconds> <keyed 0|1>: one wrk run; sets R_* from its
# summary line and checks the statuses.
load() {
	local s=$1 d=$2 keyed=$3 out line cpu0 cpu1
	local -a env=()
	((keyed)) && env=(LT_KEYS=$KEYS LT_KEY_START=$KEY_SENT)
	cpu0=$(cpu_ns "${PID[$s]}")
	out=$(env "${env[@]}" timeout $((d + 30)) taskset -c "$WRK_CPU" \
		wrk -t1 -c"$CONNS" --latency -d"${d}s" -s loadtest/wrk.lua \
		"http://127.0.0.1:${PORT[$s]}/" 2>&1) ||
		{ echo "$out" >&2; fail "$s" "wrk failed"; }
	cpu1=$(cpu_ns "${PID[$s]}")
	line=$(echo "$out" | grep '^LT ' | tail -n 1)
	[ -n "$line" ] || { echo "$out" >&2; fail "$s" "no summary from wrk"; }
	kill -0 "${PID[$s]}" 2>/dev/null || fail "$s" "Caddy died under load"
	field() { echo "$line" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
	R_REQ=$(field requests)
	R_RPS=$(awk -v n="$R_REQ" -v us="$(field duration_us)" 'BEGIN { printf "%.0f", n / (us / 1e6) }')
	R_P99=$(field p99_us)
	# Caddy's CPU time per request: unlike req/s, it barely moves when
	# other processes take turns on Caddy's core.
	R_CPU=$(awk -v a="$cpu0" -v b="$cpu1" -v n="$R_REQ" 'BEGIN { printf "%.0f", (b - a) / n }')
	R_SOCK=$(field sock_errors)
	local codes
	codes=$(field codes)
	read -r R_2XX R_429 R_200 < <(echo "$codes" | tr ',' '\n' | awk -F: '
		$1 >= 200 && $1 < 300 { ok += $2 } $1 == 429 { d += $2 } $1 == 200 { o += $2 }
		END { print ok + 0, d + 0, o + 0 }')
	R_OTHER=$((R_REQ - R_2XX - R_429))
	[ "$s" = keys100k ] && KEY_SENT=$((KEY_SENT + $(field keyed_sent)))

	((R_REQ > 0)) || fail "$s" "no request completed"
	((R_SOCK == 0)) || fail "$s" "$R_SOCK socket errors ($line)"
	((R_OTHER == 0)) || fail "$s" "$R_OTHER responses neither 2xx nor 429 (status counts: $codes)"
	if [ "$s" = deny ]; then
		# Only the first request of the hour-long window may pass, and the
		# warm-up already sent it.
		((R_2XX <= 1)) || fail "$s" "$R_2XX of $R_REQ requests passed a limit of 1 per hour"
	else
		((R_429 == 0 && R_200 == R_REQ)) || fail "$s" "not all 200 (status counts: $codes)"
	fi
}

# --- run -----------------------------------------------------------------

n=${#order[@]}
est=$((n * (WARMUP + 2) + ROUNDS * n * (DURATION + 1)))
for p in $PROFILE; do est=$((est + DURATION + 5)); done
started=$(date -u '+%Y-%m-%d %H:%M UTC')
load_before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
echo "loadtest: ${order[*]}; $ROUNDS rounds x ${DURATION}s, about ${est}s in all"

if [[ " ${order[*]} " == *" redis "* ]]; then
	start_redis
	echo "loadtest: redis-server on 127.0.0.1:$REDIS_PORT (core $WRK_CPU)"
fi

HEAP0="" ALLOC0=""
for s in "${order[@]}"; do
	start_caddy "$s"
	load "$s" "$WARMUP" 0 # keys100k: no X-Key yet, one shared bucket
	check_headers "$s"
	if [ "$s" = keys100k ]; then
		HEAP0=$(metric "${ADMIN[$s]}" go_memstats_heap_inuse_bytes)
		ALLOC0=$(metric "${ADMIN[$s]}" go_memstats_heap_alloc_bytes)
		[ -n "$HEAP0" ] || fail "$s" "no go_memstats_heap_inuse_bytes on the admin /metrics"
	fi
	echo "loadtest: $s: Caddy pid ${PID[$s]} on 127.0.0.1:${PORT[$s]} (admin ${ADMIN[$s]}), warmed up"
done
REDIS_CMDS0=""
[ -n "$REDIS_PORT" ] && REDIS_CMDS0=$(redis_commands)

declare -A RPS P99 CPU N2XX N429 NOTHER NSOCK
declare -a MEM_PER_KEY=() ALLOC_PER_KEY=()
HEAP1="" ALLOC1="" DISTINCT=0
for r in $(seq "$ROUNDS"); do
	line="round $r/$ROUNDS:"
	for s in "${order[@]}"; do
		keyed=0
		[ "$s" = keys100k ] || [ "$s" = plainkeys ] && keyed=1
		load "$s" "$DURATION" "$keyed"
		RPS[$s]+="$R_RPS "
		P99[$s]+="$R_P99 "
		CPU[$s]+="$R_CPU "
		N2XX[$s]=$((${N2XX[$s]:-0} + R_2XX))
		N429[$s]=$((${N429[$s]:-0} + R_429))
		NOTHER[$s]=$((${NOTHER[$s]:-0} + R_OTHER))
		NSOCK[$s]=$((${NSOCK[$s]:-0} + R_SOCK))
		if [ "$s" = keys100k ]; then
			HEAP1=$(metric "${ADMIN[$s]}" go_memstats_heap_inuse_bytes)
			ALLOC1=$(metric "${ADMIN[$s]}" go_memstats_heap_alloc_bytes)
			DISTINCT=$((KEY_SENT < KEYS ? KEY_SENT : KEYS))
			MEM_PER_KEY+=("$(((HEAP1 - HEAP0) / DISTINCT))")
			ALLOC_PER_KEY+=("$(((ALLOC1 - ALLOC0) / DISTINCT))")
		fi
		line+=" $s $R_RPS/s ($(awk -v c="$R_CPU" 'BEGIN { printf "%.1f", c / 1000 }') us CPU/req)"
	done
	echo "loadtest: $line"
done

ENTRIES=""
if [[ " ${order[*]} " == *" keys100k "* ]]; then
	# The engine's live-entry gauge, if this build exports one.
	ENTRIES=$(curl -s --max-time 5 "http://127.0.0.1:${ADMIN[keys100k]}/metrics" |
		grep -E '^caddy_ratelimit_[a-z_]*entr(y|ies)[a-z_]*(\{[^}]*\})? ' |
		awk '{ printf "%s%s %.0f", sep, $1, $2; sep = "; " }' || true)
fi
REDIS_CMDS=""
if [ -n "$REDIS_PORT" ] && [ -n "$REDIS_CMDS0" ]; then
	REDIS_CMDS=$(($(redis_commands) - REDIS_CMDS0))
fi

# --- report --------------------------------------------------------------

read -r -a plain_rps <<<"${RPS[plain]}"
read -r -a plain_p99 <<<"${P99[plain]}"
read -r -a plain_cpu <<<"${CPU[plain]}"
plain_p99_max=$(printf '%s\n' "${plain_p99[@]}" | sort -g | tail -n 1)
MISSES=()

table() {
	printf '%-9s %8s %7s %11s %8s %7s %11s %7s %9s %8s %5s %4s  %-7s %s\n' \
		scenario "req/s" "x plain" "x range" "us/req" "x cpu" "x range" "p99 ms" 2xx 429 other sock bar verdict
	local s i rps p99 cpu ratios cratios med_ratio med_cratio med_p99 bar miss
	for s in "${order[@]}"; do
		read -r -a rps <<<"${RPS[$s]}"
		read -r -a p99 <<<"${P99[$s]}"
		read -r -a cpu <<<"${CPU[$s]}"
		# The baseline of the ratios: plain, or plainkeys for keys100k.
		local base=plain
		[ "$s" = keys100k ] && base=plainkeys
		read -r -a base_rps <<<"${RPS[$base]}"
		read -r -a base_cpu <<<"${CPU[$base]}"
		ratios=() cratios=()
		for i in "${!rps[@]}"; do
			ratios+=("$(awk -v a="${rps[$i]}" -v b="${base_rps[$i]}" 'BEGIN { printf "%.4f", a / b }')")
			cratios+=("$(awk -v a="${cpu[$i]}" -v b="${base_cpu[$i]}" 'BEGIN { printf "%.4f", b / a }')")
		done
		med_ratio=$(median "${ratios[@]}")
		med_cratio=$(median "${cratios[@]}")
		med_p99=$(median "${p99[@]}")
		bar="-" verdict="baseline"
		[ "$s" = plainkeys ] && verdict="baseline of keys100k"
		if [ "$s" != plain ] && [ "$s" != plainkeys ]; then
			bar=">=${BAR[$s]}"
			miss=()
			if awk -v r="$med_ratio" -v b="${BAR[$s]}" 'BEGIN { exit !(r < b) }'; then
				miss+=("req/s")
				MISSES+=("$s: median req/s ratio $(printf '%.3f' "$med_ratio") < ${BAR[$s]}")
			fi
			if awk -v r="$med_cratio" -v b="${BAR[$s]}" 'BEGIN { exit !(r < b) }'; then
				miss+=("cpu")
				MISSES+=("$s: median CPU ratio $(printf '%.3f' "$med_cratio") < ${BAR[$s]} (Caddy CPU per request $(awk -v a="$(median "${cpu[@]}")" -v b="$(median "${base_cpu[@]}")" 'BEGIN { printf "%.2f us vs %.2f us baseline", a / 1000, b / 1000 }'))")
			fi
			if awk -v p="$med_p99" -v m="$plain_p99_max" 'BEGIN { exit !(p > m) }'; then
				miss+=("p99")
				MISSES+=("$s: median p99 $(awk -v p="$med_p99" 'BEGIN { printf "%.2f", p / 1000 }') ms above plain's worst round ($(awk -v p="$plain_p99_max" 'BEGIN { printf "%.2f", p / 1000 }') ms)")
			fi
			verdict="ok"
			[ ${#miss[@]} -eq 0 ] || verdict="MISS($(IFS=,; echo "${miss[*]}"))"
		fi
		printf '%-9s %8.0f %7.3f %11s %8.2f %7.3f %11s %7.2f %9d %8d %5d %4d  %-7s %s\n' \
			"$s" "$(median "${rps[@]}")" "$med_ratio" "$(span "${ratios[@]}")" \
			"$(awk -v c="$(median "${cpu[@]}")" 'BEGIN { print c / 1000 }')" \
			"$med_cratio" "$(span "${cratios[@]}")" \
			"$(awk -v p="$med_p99" 'BEGIN { print p / 1000 }')" \
			"${N2XX[$s]}" "${N429[$s]}" "${NOTHER[$s]}" "${NSOCK[$s]}" "$bar" "$verdict"
	done
}

span() { # "min-max" of the arguments
	printf '%s\n' "$@" | sort -g | awk 'NR == 1 { lo = $1 } { hi = $1 } END { printf "%.2f-%.2f", lo, hi }'
}

report() {
	echo
	echo "caddy-ratelimit load test, $started, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(
		git diff --quiet HEAD -- . 2>/dev/null || echo ' (with uncommitted changes)')"
	echo "machine: $ncpu cores, $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -n 1); load average before $load_before, after $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo '?')"
	echo "setup: Caddy on core $CADDY_CPU (GOMAXPROCS=1), wrk -t1 -c$CONNS on core $WRK_CPU, loopback; $ROUNDS rounds x ${DURATION}s, interleaved; medians over rounds"
	echo
	table
	echo
	if [[ " ${order[*]} " == *" keys100k "* ]]; then
		local mpk apk
		mpk=$(printf '%.0f' "$(median "${MEM_PER_KEY[@]}")")
		apk=$(printf '%.0f' "$(median "${ALLOC_PER_KEY[@]}")")
		echo "keys100k memory: $DISTINCT distinct keys; heap in use $((HEAP0 / 1024)) KiB before the keyed traffic, $((HEAP1 / 1024)) KiB after the last round"
		echo "  per key (median over rounds, no GC forced, so it includes garbage not yet collected): heap_inuse $mpk B, heap_alloc $apk B (bar <= $MAX_BYTES_PER_KEY B)"
		if ((mpk > MAX_BYTES_PER_KEY)); then
			MISSES+=("keys100k: $mpk B of heap in use per key > $MAX_BYTES_PER_KEY B")
		fi
		if [ -n "$ENTRIES" ]; then
			echo "  live entries reported by the module: $ENTRIES"
		else
			echo "  live entries: no caddy_ratelimit_*entries* metric in this build"
		fi
	fi
	if [ -n "$REDIS_CMDS" ]; then
		echo "redis: $REDIS_CMDS commands processed by the private redis-server during the rounds"
		[ "$REDIS_CMDS" -gt 0 ] || echo "  WARNING: Caddy sent Redis nothing: the redis scenario measured a local-only limiter"
	fi
	local note
	for note in "${NOTES[@]}"; do echo "note: $note"; done
	echo "deny answers with Caddy's default error handling (429, empty body, Retry-After and RateLimit headers)."
	echo "x plain: median over rounds of req/s divided by plain's req/s in the same round (x range: min-max)."
	echo "us/req: Caddy's CPU time per request (all threads, from /proc), median over rounds; x cpu: plain's"
	echo "us/req divided by the scenario's, per round, median: the throughput ratio on a core of its own,"
	echo "much less disturbed than req/s when other processes share Caddy's core. A p99 misses when its"
	echo "median is above the worst p99 plain had in the same rounds."
	if [ ${#MISSES[@]} -gt 0 ]; then
		echo "bars missed:"
		for note in "${MISSES[@]}"; do echo "  - $note"; done
	else
		echo "every bar met"
	fi
}

report_text=$(report)
echo "$report_text"
if [ -n "$OUT" ]; then
	echo "$report_text" >"$OUT"
	echo "loadtest: table written to $OUT" >&2
fi

# --- optional profile ----------------------------------------------------

for p in $PROFILE; do
	if [[ " ${order[*]} " != *" $p "* ]]; then
		echo "loadtest: NOTE: no profile of $p: the scenario did not run" >&2
		continue
	fi
	prof=${PROFILE_DIR:-${TMPDIR:-/tmp}}/loadtest-$p.cpu.pb.gz
	secs=$((DURATION > 2 ? DURATION - 1 : 1))
	echo
	echo "loadtest: profiling $p for ${secs}s under load (not part of the table)"
	curl -s --max-time $((secs + 30)) -o "$prof" \
		"http://127.0.0.1:${ADMIN[$p]}/debug/pprof/profile?seconds=$secs" &
	curl_pid=$!
	keyed=0
	[ "$p" = keys100k ] && keyed=1
	load "$p" "$DURATION" "$keyed"
	wait "$curl_pid" || die "could not fetch the CPU profile of $p"
	echo "loadtest: CPU profile of $p in $prof ($R_RPS req/s while profiling)"
	if [ "$p" != plain ]; then
		# The handler's own share: everything under its ServeHTTP except the
		# next handler (respond). Caddy's error flow after a denial and the
		# GC its allocations cause come on top.
		"$GO" tool pprof -top -cum -focus='caddy-ratelimit\.\(\*Handler\)\.ServeHTTP$' \
			-ignore='StaticResponse' "$BIN" "$prof" 2>/dev/null |
			awk '$NF == "github.com/edgelimit/caddy-ratelimit.(*Handler).ServeHTTP" {
				print "loadtest: " $5 " of Caddy'"'"'s CPU samples in the ratelimit handler itself (next handler excluded)" }'
	fi
	"$GO" tool pprof -top -nodecount=25 "$BIN" "$prof" 2>/dev/null | sed -n '5,35p'
	echo "loadtest: cumulative:"
	"$GO" tool pprof -top -cum -nodecount=45 "$BIN" "$prof" 2>/dev/null | sed -n '6,55p'
done
