package engine

import "math/bits"

// The sliding window, in integer arithmetic so that every node computes the
// same verdict and the same Retry-After from the same counts:
//
//	effective = cur + ⌊prev × (w − r) / w⌋ + cost,   allow iff effective ≤ limit
//
// where w is the window in milliseconds and r the milliseconds elapsed in the
// current window. The previous cell's weight is rounded down, as Unkey's
// limiter does: evaluated exactly, a full previous window would let the
// current window's last unit pass only at r = w, which never comes, and a
// zone under steady load would admit limit − 1 a window (limit 3 behaving
// as 2). Rounding down costs less than one unit a decision. With m = room + 1
// the test ⌊prev × (w − r) / w⌋ ≤ room is prev × (w − r) < m × w, evaluated
// with 128-bit products so large counts and long windows cannot overflow.

// fits reports whether cost more units fit: cur + ⌊prev×(w−r)/w⌋ + cost ≤ limit.
func fits(cur, prev, cost, limit, w, r int64) bool {
	room := limit - cur - cost
	if room < 0 {
		return false
	}
	if prev == 0 || r >= w {
		return true
	}
	return mulLess(uint64(prev), uint64(w-r), uint64(room)+1, uint64(w))
}

// mulLess reports whether a×b < c×d.
func mulLess(a, b, c, d uint64) bool {
	h1, l1 := bits.Mul64(a, b)
	h2, l2 := bits.Mul64(c, d)
	return h1 < h2 || (h1 == h2 && l1 < l2)
}

// mulDiv returns floor(a×b/c) for a×b/c < 2⁶⁴ (callers guarantee b ≤ c or
// a ≤ c, so the quotient fits).
func mulDiv(a, b, c uint64) uint64 {
	h, l := bits.Mul64(a, b)
	q, _ := bits.Div64(h, l, c)
	return q
}

// weighted returns ⌊prev × (w−r) / w⌋: the previous cell's contribution,
// rounded down as the verdict rounds it, so Remaining is exactly the cost
// that still fits.
func weighted(prev, w, r int64) int64 {
	if prev == 0 || r >= w {
		return 0
	}
	return int64(mulDiv(uint64(prev), uint64(w-r), uint64(w)))
}

// remaining returns max(0, limit − cur − ⌊prev×(w−r)/w⌋).
func remaining(cur, prev, limit, w, r int64) int64 {
	rem := limit - cur - weighted(prev, w, r)
	if rem < 0 {
		return 0
	}
	return rem
}

// retryAfterMs returns the milliseconds from now until the same request
// would first pass with no other traffic, or -1 when cost > limit. It is
// called for a denied request, so the answer is always at least 1.
//
// Within the current window only the previous cell's weight decays: the
// request passes at the first r' with ⌊prev×(w−r')/w⌋ ≤ room, that is once
// w − r' is at most span(prev, room+1, w). If that cannot happen before the
// window ends, the current cell becomes the previous one of the next window
// and decays in turn.
func retryAfterMs(cur, prev, cost, limit, w, r int64) int64 {
	if cost > limit {
		return -1
	}
	if room := limit - cur - cost; room >= 0 && prev > 0 {
		// Denied now, so prev×(w−r) ≥ (room+1)×w: the span is below w − r.
		if q := span(prev, room+1, w); q > 0 {
			return w - q - r
		}
	}
	room := limit - cost
	if cur <= room {
		return w - r
	}
	// cur ≥ room+1, so the span is below w.
	return w - r + w - span(cur, room+1, w)
}

// span returns the longest remaining part of a window, in milliseconds, at
// which n units weigh less than m: the largest s with n × s < m × w, that
// is ⌊(m×w − 1) / n⌋. Callers guarantee the answer is below w.
func span(n, m, w int64) int64 {
	h, l := bits.Mul64(uint64(m), uint64(w))
	l, borrow := bits.Sub64(l, 1, 0)
	h -= borrow
	q, _ := bits.Div64(h, l, uint64(n))
	return int64(q)
}

// pressureAtLeast reports whether effective ≥ limit × num/den: the test of
// the pressure tiers (num/den is 1/2 or 9/10).
func pressureAtLeast(effective, limit, num, den int64) bool {
	return effective*den >= limit*num
}

// MaxCount is the largest count, limit or cost the engine holds: 2^53 − 1,
// the largest integer a double represents exactly, so that the origin's
// scripts (Lua numbers are doubles) compute what the engine computes. Every
// count and sum saturates at it; larger limits and costs are taken as it.
const MaxCount = 1<<53 - 1

// ClampCount returns n within [0, MaxCount]: a negative cost or limit is
// zero (never a refund), a huge one the ceiling (never an overflow).
func ClampCount(n int64) int64 {
	switch {
	case n < 0:
		return 0
	case n > MaxCount:
		return MaxCount
	}
	return n
}

// SatAdd returns a + b within [0, MaxCount], whatever a and b: each is
// clamped first, so the sum cannot overflow.
func SatAdd(a, b int64) int64 {
	// Counts are nearly always within [0, MaxCount] already: then no bit
	// at or above bit 53 is set in either, and the sum cannot overflow.
	if uint64(a|b) <= MaxCount {
		return min(a+b, MaxCount)
	}
	return min(ClampCount(a)+ClampCount(b), MaxCount)
}
