package simmodel

import (
	"errors"
	"testing"
)

// TestLink_CallsFailAsTheLinkSays: a call during an outage or lost on the
// way fails without running, costing the caller its timeout; one while
// the server is not running is refused at once; one slower than the
// caller's timeout fails for the caller but ran at the server, its round
// trip what the link took (the caller pays its timeout: Tick.add).
func TestLink_CallsFailAsTheLinkSays(t *testing.T) {
	rng := newRand(1, 9)
	five := Dist{Median: 5} // no P99: a constant
	down := Link{Latency: five, Outages: []Span{{From: 100, To: 200}}}
	killed := Link{Latency: five, Refusals: []Span{{From: 100, To: 200}}}
	for _, tc := range []struct {
		name    string
		link    Link
		at      int64
		timeout float64
		lat     float64
		applied bool
		err     error
	}{
		{"before the outage", down, 99, 50, 5, true, nil},
		{"during the outage", down, 100, 50, 50, false, ErrDown},
		{"after the outage", down, 200, 50, 5, true, nil},
		{"before the kill", killed, 99, 50, 5, true, nil},
		{"while killed", killed, 100, 50, 0, false, ErrDown},
		{"restarted", killed, 200, 50, 5, true, nil},
		{"lost", Link{Latency: five, Loss: 1}, 0, 50, 50, false, ErrLost},
		{"late", Link{Latency: Dist{Median: 80}}, 0, 50, 80, true, ErrTimeout},
		{"no timeout", Link{Latency: Dist{Median: 80}}, 0, 0, 80, true, nil},
	} {
		lat, applied, err := tc.link.call(rng, tc.at, tc.timeout)
		if lat != tc.lat || applied != tc.applied || !errors.Is(err, tc.err) {
			t.Errorf("%s: latency %g, applied %v, %v; want %g, %v, %v", tc.name, lat, applied, err, tc.lat, tc.applied, tc.err)
		}
	}
}

// TestDist_SampleHasItsMedianAndP99: half the draws fall below the median
// and one in a hundred above the 99th percentile; a distribution without
// spread is its median, never negative.
func TestDist_SampleHasItsMedianAndP99(t *testing.T) {
	d := Dist{Median: 10, P99: 40}
	rng := newRand(7, 1)
	const n = 100_000
	below, above := 0, 0
	for range n {
		x := d.Sample(rng)
		if x < d.Median {
			below++
		}
		if x > d.P99 {
			above++
		}
	}
	// Six standard deviations of a binomial count either way: a seeded
	// draw, so it either always passes or never.
	if below < n/2-1000 || below > n/2+1000 || above < n/100-200 || above > n/100+200 {
		t.Fatalf("%d of %d below the median, %d above the p99; want about %d and %d", below, n, above, n/2, n/100)
	}
	for _, c := range []struct {
		d    Dist
		want float64
	}{{Dist{Median: 3, P99: 3}, 3}, {Dist{Median: 3, P99: 1}, 3}, {Dist{Median: -1}, 0}} {
		if got := c.d.Sample(rng); got != c.want {
			t.Errorf("%+v: %g, want %g", c.d, got, c.want)
		}
	}
	if s := d.Scaled(0.5); s != (Dist{Median: 5, P99: 20}) {
		t.Errorf("scaled by half: %+v", s)
	}
}

// TestTick_ACallLandsHalfItsRoundTripIn: a call's effect lands at the
// server half its round trip after the iteration's time before it, and the
// iteration's time moves on by the whole round trip.
func TestTick_ACallLandsHalfItsRoundTripIn(t *testing.T) {
	tick := &Tick{}
	tick.Begin(1000)
	if land := tick.add(30, 0); land != 1015 {
		t.Fatalf("first call lands at %d, want 1015", land)
	}
	if land := tick.add(10, 50); land != 1035 {
		t.Fatalf("second call lands at %d, want 1035", land)
	}
	if tick.At() != 1040 {
		t.Fatalf("the iteration reached %d, want 1040", tick.At())
	}
	var none *Tick
	if land := none.add(10, 0); land != 0 {
		t.Fatalf("a call without a tick lands at %d, want 0 (now)", land)
	}
	// A call slower than the caller's timeout lands half its round trip
	// in, however far the server, and the caller waited its timeout: a
	// statement to a MySQL 4 s away with mysql_timeout 1 s reached it 2 s
	// in, not half a second (which made every round trip past the timeout
	// the same to the simulator).
	if land := tick.add(4000, 1000); land != 3040 {
		t.Fatalf("a late call lands at %d, want 3040", land)
	}
	if tick.At() != 2040 {
		t.Fatalf("after a late call the iteration reached %d, want 2040 (its timeout)", tick.At())
	}
	if s := (Span{From: 10, To: 20}); s.Has(9) || !s.Has(10) || !s.Has(19) || s.Has(20) {
		t.Fatal("a span holds [From, To)")
	}
}
