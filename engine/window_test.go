package engine

import (
	"math/big"
	"math/rand/v2"
	"testing"
)

// refFits is the sliding-window formula in exact rational arithmetic.
func refFits(cur, prev, cost, limit, w, r int64) bool {
	eff := new(big.Rat).SetInt64(cur + cost)
	weight := big.NewRat(w-r, w)
	eff.Add(eff, new(big.Rat).Mul(new(big.Rat).SetInt64(prev), weight))
	return eff.Cmp(new(big.Rat).SetInt64(limit)) <= 0
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

func TestWindow_RemainingRoundsDown(t *testing.T) {
	// limit 10, cur 3, prev 5 at a third of the window: 10 − 3 − 5×2/3 = 3.67.
	if got := remaining(3, 5, 10, 300, 100); got != 3 {
		t.Fatalf("remaining = %d, want 3", got)
	}
	if got := remaining(12, 0, 10, 300, 100); got != 0 {
		t.Fatalf("remaining over the limit = %d, want 0", got)
	}
}

// bigFits is the sliding-window test in exact arithmetic for any int64s.
func bigFits(cur, prev, cost, limit, w, r int64) bool {
	eff := new(big.Rat).SetInt(new(big.Int).Add(big.NewInt(cur), big.NewInt(cost)))
	eff.Add(eff, new(big.Rat).Mul(new(big.Rat).SetInt64(prev), big.NewRat(w-r, w)))
	return eff.Cmp(new(big.Rat).SetInt64(limit)) <= 0
}

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
