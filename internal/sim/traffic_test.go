package sim

import (
	"math"
	"math/rand/v2"
	"testing"
)

// TestKeyspace_NamesEveryKindOfKey: hot keys, background keys, the keys of
// a trace and cold keys each have their names, and the hot and trace keys
// are the ones measured per window.
func TestKeyspace_NamesEveryKindOfKey(t *testing.T) {
	ks := newKeyspace(2, 5)
	ks.extra = []string{"trace-a"}
	for _, tc := range []struct {
		i    int32
		name string
		hot  bool
	}{{0, "h0", true}, {1, "h1", true}, {2, "b0", false}, {4, "b2", false}, {5, "trace-a", true}, {6, "c1", false}} {
		if got := ks.name(tc.i); got != tc.name || ks.isHot(tc.i) != tc.hot {
			t.Errorf("key %d: %q hot %v, want %q hot %v", tc.i, got, ks.isHot(tc.i), tc.name, tc.hot)
		}
	}
}

// TestSpread_SharesAddUpToTheWholeKey: at any time a key's traffic is
// spread over the regions in shares that add up to one (the moving peak's
// are scaled to add up to one with the peak on a region, so between two
// they are within a thousandth of it); skewed traffic favours the key's
// own first region by Zipf's law.
func TestSpread_SharesAddUpToTheWholeKey(t *testing.T) {
	const regions = 7
	for sc, slack := range map[Scenario]float64{Even: 1e-9, Skewed: 1e-9, Moving: 1e-3} {
		sp := newSpread(sc, regions, 600_000, 3, rand.New(rand.NewPCG(1, 1)))
		for k := range 3 {
			for _, at := range []float64{0, 150_000, 599_999} {
				sum := 0.0
				for r := range regions {
					sum += sp.weight(k, r, at)
				}
				if math.Abs(sum-1) > slack {
					t.Errorf("%s, key %d at %g ms: shares add up to %g", sc, k, at, sum)
				}
			}
		}
	}
	sp := newSpread(Skewed, regions, 600_000, 3, nil)
	if first, second := sp.weight(2, 2, 0), sp.weight(2, 3, 0); math.Abs(first-2*second) > 1e-9 {
		t.Errorf("key 2's first region gets %g, its second %g: want twice", first, second)
	}
}

// TestFluid_OffersExactlyItsRate: a hot key's source in a region offers a
// window its rate's worth of requests, spaced evenly, to the region's
// nodes.
func TestFluid_OffersExactlyItsRate(t *testing.T) {
	f := &fluid{key: 3, region: 1, nodes: 4, base: 1_000_000, end: 120_000,
		rate: func(float64) float64 { return 1000.0 / 60_000 }, rng: rand.New(rand.NewPCG(1, 2))}
	n, last := 0, int64(0)
	for {
		r, ok := f.next()
		if !ok {
			break
		}
		if r.at < last || r.key != 3 || r.region != 1 || r.node < 0 || r.node >= 4 {
			t.Fatalf("request %+v after one at %d", r, last)
		}
		last = r.at
		n++
	}
	if n < 1999 || n > 2000 {
		t.Fatalf("%d requests in two minutes at 1000 a minute", n)
	}
}

// TestBurst_OneRegionAWindowFromItsFirstHalfToItsEnd: a hot key bursts
// once a window, at one region, starting in the window's first half and
// lasting to its end at the burst's rate.
func TestBurst_OneRegionAWindowFromItsFirstHalfToItsEnd(t *testing.T) {
	b := &burst{key: 0, regions: 5, nodes: 2, window: 60_000, end: 180_000, rate: 0.01, rng: rand.New(rand.NewPCG(4, 4))}
	type span struct {
		region      int32
		first, last int64
		n           int
	}
	var windows [3]*span
	for {
		r, ok := b.next()
		if !ok {
			break
		}
		w := r.at / 60_000
		if windows[w] == nil {
			windows[w] = &span{region: r.region, first: r.at}
		}
		s := windows[w]
		if r.region != s.region {
			t.Fatalf("window %d bursts at regions %d and %d", w, s.region, r.region)
		}
		s.last, s.n = r.at, s.n+1
	}
	for w, s := range windows {
		if s == nil {
			t.Fatalf("no burst in window %d", w)
		}
		start := int64(w) * 60_000
		if s.first >= start+30_000 || s.last < start+59_900 {
			t.Errorf("window %d: burst from %d to %d ms", w, s.first-start, s.last-start)
		}
		if want := float64(s.last-s.first) * 0.01; math.Abs(float64(s.n)-want) > 2 {
			t.Errorf("window %d: %d requests over %d ms at 0.01 a ms", w, s.n, s.last-s.first)
		}
	}
}

// TestPopularity_TheBusiestKeyStaysUnderItsCap: the background's busiest
// key gets at most the cap of the total rate, and the draws follow the
// popularity (the first key is drawn most).
func TestPopularity_TheBusiestKeyStaysUnderItsCap(t *testing.T) {
	const keys, rate, capRate = 1000, 1000.0, 8.0
	p := newPopularity(keys, rate, capRate)
	if first := p.cdf[0]; first*rate > capRate*1.0001 || first*rate < capRate*0.99 {
		t.Fatalf("the busiest key gets %g requests a second, want just under %g", first*rate, capRate)
	}
	if last := p.cdf[keys-1]; math.Abs(last-1) > 1e-9 {
		t.Fatalf("the shares add up to %g", last)
	}
	counts := make([]int, keys)
	rng := rand.New(rand.NewPCG(5, 5))
	for range 100_000 {
		counts[p.draw(rng)]++
	}
	if counts[0] <= counts[keys/2] || counts[keys/2] <= 0 {
		t.Fatalf("draws: first key %d, middle key %d", counts[0], counts[keys/2])
	}
}
