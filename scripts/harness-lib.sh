# Shell functions the load harness (loadtest.sh) and the paired runs
# (pair.sh, busy.sh) share; sourced, not run. The sourcing script defines die.

# free_port sets FREE_PORT to a loopback TCP port nobody listens on, below
# the ephemeral range, not handed out before. (A variable, not output: a
# subshell would forget USED_PORTS.)
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

# wait_port <port> <pid> <seconds>: waits until something listens on the
# loopback port; fails when the process pid exits or the seconds pass.
wait_port() {
	for _ in $(seq $(($3 * 10))); do
		timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null && return 0
		kill -0 "$2" 2>/dev/null || return 1
		sleep 0.1
	done
	return 1
}

# cpu_ns <pid> prints the CPU time the process has used, in nanoseconds:
# the sum over its threads of /proc/<pid>/task/*/schedstat, or
# /proc/<pid>/stat's clock ticks where schedstat is missing.
cpu_ns() {
	local t
	t=$(cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{ s += $1 } END { if (NR) printf "%.0f", s }')
	if [ -z "$t" ]; then
		t=$(awk -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); printf "%.0f", ($12 + $13) * 1e9 / hz }' /proc/"$1"/stat)
	fi
	echo "$t"
}

# io_switches <pid>: the process's read and write system calls so far
# (/proc/<pid>/io: syscr + syscw) and its threads' context switches,
# voluntary and not, as "<syscalls> <switches>".
io_switches() {
	local io sw
	io=$(awk '/^sysc[rw]:/ { s += $2 } END { printf "%.0f", s }' /proc/"$1"/io 2>/dev/null)
	sw=$(cat /proc/"$1"/task/*/status 2>/dev/null | awk '/ctxt_switches:/ { s += $2 } END { printf "%.0f", s }')
	echo "${io:-0} ${sw:-0}"
}

# stop_all <pid>...: stops the processes, stopped ones too (SIGCONT, then
# SIGTERM), and kills any still running 5 s later.
stop_all() {
	local p
	for p in "$@"; do
		kill -CONT "$p" 2>/dev/null || true # a stopped process cannot exit
		kill -TERM "$p" 2>/dev/null || true
	done
	for p in "$@"; do
		for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
		kill -KILL "$p" 2>/dev/null || true
	done
}

# field <name>: the value of name=… in $line, the "LT …" summary line that
# loadtest/wrk.lua prints (set by the caller).
field() { echo "$line" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
