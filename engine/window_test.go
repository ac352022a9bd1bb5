package engine

import (
	"math/big"
	"math/rand/v2"
	"testing"
)

// refWeighted is the previous cell's weight in exact arithmetic, rounded
// down: ⌊prev × (w − r) / w⌋.
func refWeighted(prev, w, r int64) *big.Int {
	p := new(big.Int).Mul(big.NewInt(prev), big.NewInt(w-r))
	return p.Quo(p, big.NewInt(w))
}

// refFits is the sliding-window formula in exact arithmetic:
// cur + ⌊prev × (w − r) / w⌋ + cost ≤ limit.
func refFits(cur, prev, cost, limit, w, r int64) bool {
	eff := new(big.Int).Add(big.NewInt(cur), big.NewInt(cost))
	eff.Add(eff, refWeighted(prev, w, r))
	return eff.Cmp(big.NewInt(limit)) <= 0
}

// refRetryAfter finds the wait by trying every millisecond, moving the
// counts across window borders as the engine's cells move.
func refRetryAfter(cur, prev, cost, limit, w, r int64) int64 {
	if cost > limit {
		return -1
	}
	for wait := int64(1); wait <= 3*w; wait++ {
		t := r + wait
		c, p := cur, prev
		switch {
		case t >= 2*w:
			c, p, t = 0, 0, t-2*w
		case t >= w:
			c, p, t = 0, cur, t-w
		}
		if refFits(c, p, cost, limit, w, t) {
			return wait
		}
	}
	panic("no wait found")
}

func TestWindow_FitsMatchesExactArithmetic(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 50000; i++ {
		w := 1 + rng.Int64N(5000)
		r := rng.Int64N(w)
		limit := rng.Int64N(200)
		cur := rng.Int64N(limit + 5)
		prev := rng.Int64N(2*limit + 5)
		cost := rng.Int64N(limit/4 + 3)
		if got, want := fits(cur, prev, cost, limit, w, r), refFits(cur, prev, cost, limit, w, r); got != want {
			t.Fatalf("fits(cur=%d prev=%d cost=%d limit=%d w=%d r=%d) = %v, want %v", cur, prev, cost, limit, w, r, got, want)
		}
	}
}

func TestWindow_FitsHugeValuesDoNotOverflow(t *testing.T) {
	const big = int64(1) << 60
	// prev × (w − r) overflows int64; the 128-bit product must not.
	if fits(0, big, 0, big-1, 1<<40, 0) {
		t.Fatal("a full previous window at r=0 must not fit below its own count")
	}
	if !fits(0, big, 0, big, 1<<40, 0) {
		t.Fatal("a previous window exactly at the limit fits with cost 0")
	}
}

func TestWindow_RetryAfterIsTheFirstPassingMillisecond(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	checked := 0
	for i := 0; i < 4000; i++ {
		w := 1 + rng.Int64N(300)
		r := rng.Int64N(w)
		limit := 1 + rng.Int64N(40)
		cur := rng.Int64N(limit + 3)
		prev := rng.Int64N(2*limit + 3)
		cost := rng.Int64N(limit + 3)
		if fits(cur, prev, cost, limit, w, r) {
			continue
		}
		checked++
		if got, want := retryAfterMs(cur, prev, cost, limit, w, r), refRetryAfter(cur, prev, cost, limit, w, r); got != want {
			t.Fatalf("retryAfterMs(cur=%d prev=%d cost=%d limit=%d w=%d r=%d) = %d, want %d", cur, prev, cost, limit, w, r, got, want)
		}
	}
	if checked < 300 {
		t.Fatalf("only %d denied cases checked", checked)
	}
}

// TestWindow_SteadyLoadAdmitsTheWholeLimit is the defect a review measured:
// limit 3 over 2 s at 15 requests a second admitted 2 a window after the
// first, because a full previous window weighed exactly let the last unit
// pass only at the very end of the window. Rounded down, every window
// admits its limit.
func TestWindow_SteadyLoadAdmitsTheWholeLimit(t *testing.T) {
	for _, tc := range []struct{ limit, w, every int64 }{
		{3, 2000, 66}, {5, 1000, 100}, {5, 1000, 20}, {100, 60000, 100},
	} {
		counts := map[int64]int64{}
		admitted := int64(0)
		windows := int64(10)
		for now := int64(0); now < windows*tc.w; now += tc.every {
			seq, r := now/tc.w, now%tc.w
			if fits(counts[seq], counts[seq-1], 1, tc.limit, tc.w, r) {
				counts[seq]++
				admitted++
			}
		}
		// Before the fix: 21 of 30 for limit 3, 41 of 50 for limit 5.
		if min := windows * tc.limit * 95 / 100; admitted < min {
			t.Errorf("limit %d, window %d ms, a request every %d ms: %d admitted in %d windows, want at least %d (95 %%)",
				tc.limit, tc.w, tc.every, admitted, windows, min)
		}
		if admitted > windows*tc.limit {
			t.Errorf("limit %d: %d admitted in %d windows, more than the limit a window", tc.limit, admitted, windows)
		}
	}
}

func TestWindow_RemainingRoundsDown(t *testing.T) {
	// limit 10, cur 3, prev 5 at a third of the window: 10 − 3 − ⌊5×2/3⌋ = 10 − 3 − 3.
	if got := remaining(3, 5, 10, 300, 100); got != 4 {
		t.Fatalf("remaining = %d, want 4", got)
	}
	if got := remaining(12, 0, 10, 300, 100); got != 0 {
		t.Fatalf("remaining over the limit = %d, want 0", got)
	}
}

// bigFits is the sliding-window test in exact arithmetic for any int64s.
func bigFits(cur, prev, cost, limit, w, r int64) bool { return refFits(cur, prev, cost, limit, w, r) }

// TestWindow_FitsOverTheWholeRange draws counts, costs and limits from the
// whole range the engine holds (up to 2^53 − 1, and sums of two such
// counts) with windows up to 2^40 ms, and checks fits against exact
// arithmetic: no overflow anywhere.
func TestWindow_FitsOverTheWholeRange(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	draw := func() int64 {
		switch rng.IntN(4) {
		case 0:
			return rng.Int64N(100)
		case 1:
			return MaxCount - rng.Int64N(100)
		}
		return rng.Int64N(MaxCount + 1)
	}
	for i := 0; i < 200000; i++ {
		w := 1 + rng.Int64N(1<<40)
		r := rng.Int64N(w)
		cur, prev := draw()+draw(), draw()+draw() // current and previous may each hold regional + global
		cost, limit := draw(), draw()
		if got, want := fits(cur, prev, cost, limit, w, r), bigFits(cur, prev, cost, limit, w, r); got != want {
			t.Fatalf("fits(cur=%d prev=%d cost=%d limit=%d w=%d r=%d) = %v, want %v", cur, prev, cost, limit, w, r, got, want)
		}
		if !bigFits(cur, prev, cost, limit, w, r) {
			if ra := retryAfterMs(cur, prev, cost, limit, w, r); (cost > limit) != (ra < 0) || (ra >= 0 && ra < 1) {
				t.Fatalf("retryAfterMs(cur=%d prev=%d cost=%d limit=%d w=%d r=%d) = %d", cur, prev, cost, limit, w, r, ra)
			}
		}
	}
}
