package sim

import (
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
)

// TestFits_IsTheSlidingWindowWithThePreviousWeightRoundedDown: the central
// counter's verdict is cur + ⌊prev × (w − r) / w⌋ + cost ≤ limit, checked
// against the formula itself over small counts and every part of a window.
func TestFits_IsTheSlidingWindowWithThePreviousWeightRoundedDown(t *testing.T) {
	const w = 1000
	for cur := int64(0); cur <= 5; cur++ {
		for prev := int64(0); prev <= 6; prev++ {
			for cost := int64(0); cost <= 3; cost++ {
				for limit := int64(0); limit <= 6; limit++ {
					for _, r := range []int64{0, 1, 250, 333, 999, 1000, 1500} {
						var weight int64
						if r < w {
							weight = prev * (w - r) / w
						}
						if want := cur+weight+cost <= limit; fits(cur, prev, cost, limit, w, r) != want {
							t.Fatalf("fits(cur %d, prev %d, cost %d, limit %d, r %d) = %v, want %v", cur, prev, cost, limit, r, !want, want)
						}
					}
				}
			}
		}
	}
}

// TestFits_LargeLimitsAndWindowsDoNotOverflow: the engine weighs the
// previous window in 128 bits (engine/window.go), so a limit times a
// window past 2⁶³ (a limit of 10¹² over 3 h: 1.08 × 10²²) decides as any
// other; the central counter must too, or it calls every admission in a
// window after the first a false allow (a run of -limit 1000000000000
// -window 3h with five requests a second reported 55 % false allows).
func TestFits_LargeLimitsAndWindowsDoNotOverflow(t *testing.T) {
	w := (3 * time.Hour).Milliseconds()
	for _, tc := range []struct {
		cur, prev, cost, limit, r int64
		want                      bool
	}{
		{0, 1, 1, 1e12, 0, true},
		{0, 5, 1, 1e12, w / 2, true},
		{1e12 - 1, 1, 1, 1e12, w - 1, true}, // ⌊1 × 1 / w⌋ = 0
		{1e12 - 2, 3, 1, 1e12, 0, false},
		{0, 1 << 62, 1, 1 << 62, 0, false},
		{0, 1 << 62, 1, 1 << 62, 1, true}, // the weight drops by ⌈2⁶² / w⌉
	} {
		if got := fits(tc.cur, tc.prev, tc.cost, tc.limit, w, tc.r); got != tc.want {
			t.Errorf("fits(cur %d, prev %d, cost %d, limit %d, w %d, r %d) = %v, want %v", tc.cur, tc.prev, tc.cost, tc.limit, w, tc.r, got, tc.want)
		}
	}
}

// TestMeasure_JudgesEachDecisionAgainstTheWorldsCount: a denial with room
// is a false denial, an admission past the limit (in this window or
// weighed with the last) a false allow; a hot key's first denial in a
// window arms one wait per other region, which ends when that region's
// view holds what the world had admitted then.
func TestMeasure_JudgesEachDecisionAgainstTheWorldsCount(t *testing.T) {
	ks := newKeyspace(1, 2)
	m := newMeasure(ks, 3, time.Second, 2)
	var armed []winKey
	arm := func(k winKey, _ int) { armed = append(armed, k) }
	req := func(at int64) request { return request{at: at, key: 0, region: 0} }
	// Window 1: the third request is denied with room, the sixth admitted
	// past the limit; the denials at the limit are right.
	for i, allowed := range []bool{true, true, false, true, false, true} {
		m.record(req(1000+int64(i)), allowed, arm)
	}
	// Window 2, 100 ms in: the previous window's 4 weigh ⌊4 × 0.9⌋ = 3.
	m.record(req(2100), true, arm)
	if m.decisions != 7 || m.allowed != 5 || m.falseDenies != 1 || m.falseAllows != 2 {
		t.Fatalf("%d decisions, %d allowed, %d false denies, %d false allows; want 7, 5, 1, 2",
			m.decisions, m.allowed, m.falseDenies, m.falseAllows)
	}
	if len(armed) != 1 || armed[0] != (winKey{0, 1}) {
		t.Fatalf("armed %v, want window 1 of key 0 once", armed)
	}
	if got := m.windows(0, 2, false); len(got) != 1 || got[0] != 4.0/3 {
		t.Fatalf("windows %v, want one at 4/3 of the limit", got)
	}
	// The world had admitted 2 units at the first denial: region 1 sees 1
	// of its own, then 1 more imported.
	id := simmodel.CellID{Key: engine.Key{Namespace: Namespace, Identifier: ks.name(0), Window: time.Second}, Seq: 1}
	m.view(1, id, simmodel.Hash{T: 1}, 1500)
	if m.unreached() != 1 || len(m.latencies) != 0 {
		t.Fatalf("%d regions unreached, latencies %v: want region 1 still waiting", m.unreached(), m.latencies)
	}
	m.view(1, id, simmodel.Hash{T: 1, G: 1}, 1600)
	if m.unreached() != 0 || len(m.latencies) != 1 || m.latencies[0] != 1600-1002 {
		t.Fatalf("%d regions unreached, latencies %v: want one of 598 ms", m.unreached(), m.latencies)
	}
}

// TestPercentile_RoundsToTheNearestRank: the percentile of sorted samples,
// -1 of none.
func TestPercentile_RoundsToTheNearestRank(t *testing.T) {
	xs := make([]int64, 100)
	for i := range xs {
		xs[i] = int64(i + 1)
	}
	for _, tc := range []struct {
		xs   []int64
		p    float64
		want int64
	}{{nil, 0.5, -1}, {xs, 0, 1}, {xs, 0.5, 51}, {xs, 0.99, 99}, {xs, 1, 100}, {[]int64{7}, 0.99, 7}} {
		if got := percentile(tc.xs, tc.p); got != tc.want {
			t.Errorf("p%g of %d samples: %d, want %d", 100*tc.p, len(tc.xs), got, tc.want)
		}
	}
}

// TestReference_JudgesOutsideDecisionsAsTheRunsCounter: decisions made
// elsewhere are judged by the central counter a run uses: a window's
// units past the limit are false allows (and still counted), the
// previous window's weight rounds down, and a denial with room is a
// false deny.
func TestReference_JudgesOutsideDecisionsAsTheRunsCounter(t *testing.T) {
	r := NewReference(2, time.Second)
	const w = 1_800_000_000_000 // on a border
	for _, d := range []struct {
		at      int64
		allowed bool
	}{
		{w, true}, {w + 1, true}, {w + 2, true}, // the third is past the limit
		{w + 3, false},    // right
		{w + 1000, true},  // the previous window's 3 weigh 3: false allow
		{w + 1999, false}, // ⌊3 × 1 / 1000⌋ = 0, 1 counted: room, a false deny
		{w + 5000, true},  // windows later, nothing weighs
	} {
		r.Judge("k", d.at, d.allowed)
	}
	r.Judge("other", w+3, true) // keys apart
	if r.Decisions != 8 || r.FalseAllows != 2 || r.FalseDenies != 1 {
		t.Fatalf("%d decisions, %d false allows, %d false denies; want 8, 2, 1", r.Decisions, r.FalseAllows, r.FalseDenies)
	}
}
