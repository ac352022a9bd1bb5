#!/usr/bin/env bash
# Compares the engine's decision benchmarks of this checkout with those of
# another commit, alternating the two builds in one sitting (A B A B …) so
# that the machine's noise falls on both alike, and prints each benchmark's
# median ns/op and allocations for both, with the ratio.
#
#   REF=228773b scripts/bench-engine-vs.sh          # make bench-engine-vs REF=228773b
#
# REF      the commit to compare with (required)
# ROUNDS   alternations (default 7)
# BENCH    benchmark regexp (default the single decisions: allow, deny, and
#          both with the real clock)
# BENCHTIME  per run (default 1s)
# PKG      the package whose benchmarks run (default ./engine; . for the
#          handler's)
set -euo pipefail
cd "$(dirname "$0")/.."
: "${REF:?set REF to the commit to compare with, e.g. REF=228773b}"
ROUNDS=${ROUNDS:-7}
[[ $ROUNDS =~ ^[0-9]+$ ]] && ((ROUNDS >= 1)) || { echo "bench-engine-vs: ROUNDS must be at least 1, not '$ROUNDS'" >&2; exit 1; }
git rev-parse --quiet --verify "$REF^{commit}" >/dev/null || { echo "bench-engine-vs: REF=$REF is not a commit of this repository" >&2; exit 1; }
BENCH=${BENCH:-'^BenchmarkDecide(Allow|Deny)(RealClock)?$'}
BENCHTIME=${BENCHTIME:-1s}
GO=${GO:-go}
PKG=${PKG:-./engine}

tmp=$(mktemp -d)
cleanup() {
	git worktree remove --force "$tmp/ref" >/dev/null 2>&1 || true
	rm -rf "$tmp"
}
trap cleanup EXIT

git worktree add --detach "$tmp/ref" "$REF" >/dev/null 2>"$tmp/worktree.err" ||
	{ echo "bench-engine-vs: git worktree add $REF failed: $(cat "$tmp/worktree.err")" >&2; exit 1; }
(cd "$tmp/ref" && "$GO" test -c -o "$tmp/ref.test" "$PKG")
"$GO" test -c -o "$tmp/head.test" "$PKG"
ref_name=$(git rev-parse --short "$REF")
head_name=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- "$PKG" || echo "+changes")

for i in $(seq "$ROUNDS"); do
	for side in ref head; do
		# A benchmark that fails, or a BENCH that matches none of PKG's
		# benchmarks on one side, ended the script with no word (grep found
		# no line under pipefail); say which.
		name=$head_name
		[ "$side" = ref ] && name=$ref_name
		"$tmp/$side.test" -test.run '^$' -test.bench "$BENCH" -test.benchmem \
			-test.benchtime "$BENCHTIME" -test.count 1 >"$tmp/out.txt" 2>&1 ||
			{ cat "$tmp/out.txt" >&2; echo "bench-engine-vs: the benchmarks of $PKG failed on $name" >&2; exit 1; }
		grep '^Benchmark' "$tmp/out.txt" | sed "s/^/$side /" >>"$tmp/all.txt" ||
			{ echo "bench-engine-vs: no benchmark of $PKG matches BENCH='$BENCH' on $name" >&2; exit 1; }
	done
	echo "round $i of $ROUNDS done" >&2
done

# Per side and benchmark: the median ns/op and allocs/op over the rounds.
awk -v ref="$ref_name" -v head="$head_name" '
function median(list,   n, a, i, j, t) {
	n = split(list, a, " ")
	for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] + 0 > t + 0; j--) a[j + 1] = a[j]; a[j + 1] = t }
	return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
{
	side = $1; name = $2; sub(/-[0-9]+$/, "", name)
	for (i = 3; i <= NF; i++) {
		if ($(i) == "ns/op") ns[side, name] = ns[side, name] " " $(i - 1)
		if ($(i) == "allocs/op") al[side, name] = al[side, name] " " $(i - 1)
	}
	names[name] = 1
}
END {
	for (n in names) {
		r = median(ns["ref", n]); h = median(ns["head", n])
		printf "%-32s %14.1f %14.1f %7.2fx %10s %10s\n", n, r, h, (r > 0 ? h / r : 0), median(al["ref", n]), median(al["head", n])
	}
}' "$tmp/all.txt" | sort >"$tmp/table.txt"
printf "%-32s %14s %14s %8s %10s %10s\n" benchmark "$ref_name ns/op" "$head_name ns/op" ratio "allocs $ref_name" "allocs $head_name"
cat "$tmp/table.txt"
echo "medians of $ROUNDS alternated rounds of $BENCHTIME each"
