package sim

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// TestRTT_ByDistanceOnTheRing: the primary's own region reaches it over
// the local round trip; the others by their distance on the ring of
// regions, from 0.28 × the farthest's next to it to the whole across it.
func TestRTT_ByDistanceOnTheRing(t *testing.T) {
	local, far := time.Millisecond, 250*time.Millisecond
	for _, tc := range []struct {
		i    int
		want float64
	}{{0, 1}, {1, 250 * (0.28 + 0.72*0.2)}, {9, 250 * (0.28 + 0.72*0.2)}, {3, 250 * (0.28 + 0.72*0.6)}, {5, 250}} {
		if got := rtt(tc.i, 10, local, far); math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("region %d of 10: %g ms, want %g", tc.i, got, tc.want)
		}
	}
}

// TestBuild_MakesTheFleetOnItsModels: build makes regions × nodes, each
// node on its region's Redis, named by region and node, and places the
// scenario's outage on the links it cuts.
func TestBuild_MakesTheFleetOnItsModels(t *testing.T) {
	cfg := Config{Regions: 3, Nodes: 2, Keys: 10, Duration: 3 * time.Minute, Scenario: RedisDown}.Defaults()
	s := &sim{cfg: cfg, base: epoch, loops: rand.New(rand.NewPCG(1, 1))}
	s.clk = testclock.New(time.UnixMilli(s.base))
	s.ks = newKeyspace(cfg.Hot, cfg.Keys)
	s.m = newMeasure(s.ks, cfg.Limit, cfg.Window, cfg.Regions)
	if err := s.build(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		for _, n := range s.nodes {
			_ = n.eng.Close(bg)
		}
	}()
	if len(s.regions) != 3 || len(s.nodes) != 6 {
		t.Fatalf("%d regions, %d nodes; want 3 and 6", len(s.regions), len(s.nodes))
	}
	for i, n := range s.nodes {
		r := s.regions[i/2]
		if want := fmt.Sprintf("r%03d-n%02d", i/2, i%2); n.id != want || n.index != i || n.region != r || r.nodes[i%2] != n {
			t.Errorf("node %d: %q in %s, want %q in %s", i, n.id, n.region.name, want, r.name)
		}
	}
	// The scenario's Redis outage: region 1 (of 3), a minute in, 30 s.
	s.clk.Set(time.UnixMilli(s.base + 61_000))
	for i, r := range s.regions {
		_, err := r.redis.Info()
		if down := i == 1; down != errors.Is(err, simmodel.ErrDown) {
			t.Errorf("region %d during the outage: %v", i, err)
		}
	}
	s.clk.Set(time.UnixMilli(s.base + 90_000))
	if _, err := s.regions[1].redis.Info(); err != nil {
		t.Errorf("region 1 after the outage: %v", err)
	}
}

// TestJitter_WithinAFifthEitherWay: the loops' intervals vary by ±20 %.
func TestJitter_WithinAFifthEitherWay(t *testing.T) {
	s := &sim{loops: rand.New(rand.NewPCG(3, 3))}
	lo, hi := int64(math.MaxInt64), int64(0)
	for range 1000 {
		j := s.jitter(time.Second)
		lo, hi = min(lo, j), max(hi, j)
	}
	if lo < 800 || hi > 1200 || hi-lo < 300 {
		t.Fatalf("a second jittered to %d–%d ms, want spread over 800–1200", lo, hi)
	}
}
