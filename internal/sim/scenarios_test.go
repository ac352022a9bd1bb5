package sim

import (
	"testing"
	"time"
)

// TestRun_EveryScenarioLosesNothing runs each scenario on a small fleet:
// every unit each region admitted of a hot key is in its region's count,
// and every count a region registered reached MySQL, by the time its
// window stops weighing, faults included.
func TestRun_EveryScenarioLosesNothing(t *testing.T) {
	for _, sc := range Scenarios {
		t.Run(string(sc), func(t *testing.T) {
			res, err := Run(Config{Regions: 3, Nodes: 1, Keys: 500, Hot: 2, Background: 20,
				Duration: 3*time.Minute + 10*time.Second, Scenario: sc, Seed: 3})
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("admitted/limit max %.3f, %d decisions, propagation %s", res.WindowMax(), res.Decisions, res.BurstText())
			if res.Decisions == 0 || len(res.Windows) == 0 {
				t.Fatalf("%d decisions, %d windows measured", res.Decisions, len(res.Windows))
			}
			if res.Uncounted != 0 || res.Unpublished != 0 {
				t.Errorf("%d units uncounted, %d unpublished", res.Uncounted, res.Unpublished)
			}
			if res.FalseDenies != 0 {
				t.Errorf("%d requests denied while the world's count had room", res.FalseDenies)
			}
			if sc == Burst && len(res.Latencies) == 0 {
				t.Error("no burst reached the other regions")
			}
		})
	}
}

// TestRun_BurstReachesTheOtherRegionsWithinTheBound: a burst at one
// region is counted everywhere within the README's bound, 1.2 ×
// (mysql_flush + blocklist_sync) plus the replica's lag and a round trip.
func TestRun_BurstReachesTheOtherRegionsWithinTheBound(t *testing.T) {
	res, err := Run(Config{Regions: 3, Nodes: 2, Keys: 100, Hot: 3, Background: -1, Duration: 4 * time.Minute,
		Scenario: Burst, Seed: 5, ReplicaLag: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	c := res.Config
	bound := time.Duration(1.2*float64(c.Flush+c.BlocklistSync)) + c.ReplicaLag*3 + c.CrossRTT
	_, p99 := res.Burst()
	t.Logf("%d samples, p99 %s, bound %s", len(res.Latencies), p99, bound)
	if len(res.Latencies) == 0 || res.Unreached != 0 || p99 > bound {
		t.Fatalf("%d samples, %d never reached, p99 %s > %s", len(res.Latencies), res.Unreached, p99, bound)
	}
}
