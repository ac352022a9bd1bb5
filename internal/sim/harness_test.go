package sim

import (
	"fmt"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
)

// What the scale harness measured with real processes (`make regions`,
// integration/scale_test.go: 2 and 3 regions × 1, 2 and 4 nodes, limit
// 300, 80 req/s for 8 s, even and skewed; and the steady region of 400
// live keys), as the README reports it (2026-11-26; the holder pulls the
// overrides table every flush since runtime overrides came, one statement
// more a flush than the 13, 11 and 10 statements/s measured before them).
const (
	realAdmittedLo, realAdmittedHi = 1.01, 1.05 // admitted / limit, every size and scenario
	realPrimaryStatements          = 18.0       // MySQL statements/s on the primary
	realReplicaStatements          = 15.7       // per region that reads from the replica
	realSteadyStatements           = 15.0       // the steady region, whatever its nodes
	realSteadyRows                 = 40.0       // rows read/s, the same
)

// Redis commands/s of each region the scale harness measured with real
// processes (SCALE_REGIONS=2 SCALE_NODES=1,4 make regions, 2026-11-28,
// with the restart watch's mark read once a second; the mean of two runs
// beside other work): total_commands_processed, which counts what every
// node's loops send as well as the requests' calls (the restart watch and
// its mark, the runtime overrides' looks, the heartbeats), by size and
// scenario. Before the mark (2026-11-27 at fa2f381, one run): 264/269,
// 284/258, 425/429 and 471/402.
var realRedis = map[string][]float64{
	"2x1/even": {278, 271}, "2x1/skewed": {295, 267},
	"2x4/even": {453, 450}, "2x4/skewed": {481, 422},
}

// The agreement the simulator keeps with them: admitted within ± 3 % of
// the limit, MySQL within ± 25 %, Redis within ± 15 %.
const (
	admittedSlack = 0.03
	mysqlSlack    = 0.25
	redisSlack    = 0.15
)

func within(got, want, slack float64) bool { return math.Abs(got-want) <= slack*want }

// TestAgreement_ScaleHarnessLoads runs the harness's loads on the same
// sizes and checks the simulator's figures against the real processes'.
func TestAgreement_ScaleHarnessLoads(t *testing.T) {
	for _, regions := range []int{2, 3} {
		for _, nodes := range []int{1, 2, 4} {
			even := make([]int, regions)
			for i := range even {
				even[i] = 1
			}
			skew := map[int][]int{2: {7, 3}, 3: {6, 3, 1}}[regions]
			for _, sc := range []struct {
				name   string
				shares []int
			}{{"even", even}, {"skewed", skew}} {
				name := fmt.Sprintf("%dx%d/%s", regions, nodes, sc.name)
				t.Run(name, func(t *testing.T) {
					res, err := Run(HarnessLoad(regions, nodes, sc.shares))
					if err != nil {
						t.Fatal(err)
					}
					f := res.Figures()
					t.Logf("admitted/limit %.3f, MySQL statements/s %.1f + %.1f per replica region, Redis commands/s %.0f",
						f.Admitted, f.Statements, f.ReplicaStatements, f.Redis)
					if f.Admitted < realAdmittedLo-admittedSlack || f.Admitted > realAdmittedHi+admittedSlack {
						t.Errorf("admitted %.3f × the limit; the real processes admitted %.2f–%.2f (± %.2f)", f.Admitted, realAdmittedLo, realAdmittedHi, admittedSlack)
					}
					if !within(f.Statements, realPrimaryStatements, mysqlSlack) {
						t.Errorf("%.1f statements/s on the primary; real %.0f (± %.0f %%)", f.Statements, realPrimaryStatements, 100*mysqlSlack)
					}
					if !within(f.ReplicaStatements, realReplicaStatements, mysqlSlack) {
						t.Errorf("%.1f statements/s on the replica per region; real %.0f (± %.0f %%)", f.ReplicaStatements, realReplicaStatements, 100*mysqlSlack)
					}
					for i, want := range realRedis[name] {
						if !within(f.Redis[i], want, redisSlack) {
							t.Errorf("region %d: %.0f Redis commands/s; real %.0f (± %.0f %%)", i, f.Redis[i], want, 100*redisSlack)
						}
					}
					if res.Uncounted != 0 {
						t.Errorf("%d admitted units missing from their region's count", res.Uncounted)
					}
				})
			}
		}
	}
}

// TestAgreement_SteadyRegion runs the harness's steady region: MySQL's
// load follows regions, not nodes, and matches the real one's.
func TestAgreement_SteadyRegion(t *testing.T) {
	for _, nodes := range []int{1, 2, 4} {
		res, err := Run(HarnessSteady(nodes))
		if err != nil {
			t.Fatal(err)
		}
		f := res.Figures()
		t.Logf("%d nodes: %.1f statements/s, %.1f rows read/s", nodes, f.Statements, f.RowsRead)
		if !within(f.Statements, realSteadyStatements, mysqlSlack) || !within(f.RowsRead, realSteadyRows, mysqlSlack) {
			t.Errorf("%d nodes: %.1f statements/s and %.1f rows read/s; real %.0f and %.0f (± %.0f %%)",
				nodes, f.Statements, f.RowsRead, realSteadyStatements, realSteadyRows, 100*mysqlSlack)
		}
	}
}

// TestHarnessLoad_RoundRobinByShares: the harness's load is 80 requests a
// second for twice the limit's worth and half a second, each region
// getting its share, spread evenly over its nodes, and the costs measured
// over the load.
func TestHarnessLoad_RoundRobinByShares(t *testing.T) {
	c := HarnessLoad(2, 2, []int{7, 3})
	if err := c.Defaults().Validate(); err != nil {
		t.Fatal(err)
	}
	if n := len(c.Requests); n != 640 {
		t.Fatalf("%d requests, want 80 a second for 8 s", n)
	}
	per := map[[2]int]int{}
	for i, r := range c.Requests {
		if want := harnessStart + time.Duration(i)*12500*time.Microsecond; r.At != want || r.Key != "scale" {
			t.Fatalf("request %d: %+v, want key scale at %s", i, r, want)
		}
		per[[2]int{r.Region, r.Node}]++
	}
	// 640 requests in rounds of 20: 32 rounds of 7 + 7 and 3 + 3.
	if want := map[[2]int]int{{0, 0}: 224, {0, 1}: 224, {1, 0}: 96, {1, 1}: 96}; fmt.Sprint(per) != fmt.Sprint(want) {
		t.Fatalf("requests by region and node %v, want %v", per, want)
	}
	last := c.Requests[len(c.Requests)-1].At
	if c.Measure.From != harnessStart.Milliseconds() || c.Measure.To <= last.Milliseconds() || c.Duration <= time.Duration(c.Measure.To)*time.Millisecond {
		t.Fatalf("measured %+v, run %s: want the load measured whole, within the run", c.Measure, c.Duration)
	}
}

// TestFigures_PerSecondAndPerReplicaRegion: the harness's figures are per
// second of the measured span; replica figures per region that reads from
// a replica (every region after the first).
func TestFigures_PerSecondAndPerReplicaRegion(t *testing.T) {
	r := &Result{Config: Config{Limit: 300}, Seconds: 10, Admitted: 312, Windows: []float64{1.04},
		Regions: []RegionResult{
			{MySQL: simmodel.MySQLCost{Statements: 100, RowsRead: 40}, Redis: simmodel.RedisCost{Processed: 500}},
			{MySQL: simmodel.MySQLCost{Statements: 30, ReplicaStatements: 100}, Redis: simmodel.RedisCost{Processed: 300}},
			{MySQL: simmodel.MySQLCost{Statements: 0, ReplicaStatements: 120, ReplicaRowsRead: 10}},
		}}
	f := r.Figures()
	if f.Admitted != 1.04 || f.Statements != 13 || f.RowsRead != 4 || f.ReplicaStatements != 11 || f.ReplicaRowsRead != 0.5 ||
		fmt.Sprint(f.Redis) != "[50 30 0]" {
		t.Fatalf("figures %+v", f)
	}
	if s := itoa(0) + " " + itoa(7) + " " + itoa(1234567); s != "0 7 1234567" {
		t.Fatalf("itoa: %q", s)
	}
}

// TestMinWindow_ShorterWindowsStayInTheirRegion: a window shorter than
// min_window is never published, so two regions sharing a key each admit
// up to the limit (the default, 1m, for a 4 s window: 70/30 traffic at
// twice the limit's rate admits 1.6 × a window, the second region's 0.6
// beside the first's 1); with min_window at 1 s, as the integration
// cluster sets it, the regions count each other and the windows stay
// near the limit. Before min_window was a setting of the simulator, a
// trace of that cluster's 4 s windows ran with the default, and
// disagreed with the real processes by 0.6 × the limit.
func TestMinWindow_ShorterWindowsStayInTheirRegion(t *testing.T) {
	const limit, w = 120, 4 * time.Second
	var reqs []Request
	for i := range 60 * 24 { // 60 a second for six windows, 7 of 10 at the first region
		region := 0
		if i%10 >= 7 {
			region = 1
		}
		reqs = append(reqs, Request{At: 3*w + time.Duration(i)*time.Second/60, Key: "k", Region: region, Node: i / 10 % 2})
	}
	c := HarnessTrace(2, 2, limit, w, harnessFlush, harnessSync, 2*time.Second, reqs, 1)
	for _, tc := range []struct {
		minWindow time.Duration
		lo, hi    float64
	}{{0, 1.55, 1.61}, {time.Second, 1.0, 1.05}} {
		c.MinWindow = tc.minWindow
		res, err := Run(c)
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Windows) != 6 || res.Windows[0] < tc.lo || res.WindowMax() > tc.hi {
			t.Errorf("min_window %s: admitted / limit per window %.3f, want six in [%.2f, %.2f]", res.Config.MinWindow, res.Windows, tc.lo, tc.hi)
		}
	}
}

// TestHarnessTrace_ByKeyAndRegion: a trace's keys have their units by
// region (summing to what was admitted) and their travel times, and a
// replica held 2 s behind (its 99th percentile the median: MASTER_DELAY)
// makes the burst's count reach the region reading it about 2 s later
// than the primary does.
func TestHarnessTrace_ByKeyAndRegion(t *testing.T) {
	var reqs []Request
	for i := range 200 { // a burst at region 0: twice the limit in a second
		reqs = append(reqs, Request{At: HarnessStart + time.Duration(i)*5*time.Millisecond, Key: "burst", Region: 0})
	}
	for i := range 80 { // the same key at region 1, 20 a second
		reqs = append(reqs, Request{At: HarnessStart + time.Duration(i)*50*time.Millisecond, Key: "burst", Region: 1})
	}
	slices.SortStableFunc(reqs, func(a, b Request) int { return int(a.At - b.At) })
	travel := map[bool]int64{}
	for _, replica := range []bool{false, true} {
		c := HarnessTrace(2, 1, 100, time.Hour, harnessFlush, harnessSync, 5*time.Second, reqs, 1)
		if replica {
			c.NoReplicas, c.ReplicaLag, c.ReplicaLagP99 = false, 2*time.Second, 2*time.Second
		}
		res, err := Run(c)
		if err != nil {
			t.Fatal(err)
		}
		by := res.KeyAdmitted["burst"]
		if len(by) != 2 || by[0]+by[1] != res.Admitted || by[0] != res.Regions[0].Admitted {
			t.Fatalf("units by region %v, admitted %d (region 0: %d)", by, res.Admitted, res.Regions[0].Admitted)
		}
		ls := res.KeyLatencies["burst"]
		if len(ls) != 1 || !slices.Equal(ls, res.Latencies) {
			t.Fatalf("the key's travel times %v, the run's %v", ls, res.Latencies)
		}
		travel[replica] = ls[0]
	}
	if d := travel[true] - travel[false]; d < 1500 || d > 2500 {
		t.Errorf("a count's travel: %d ms through a replica 2 s behind, %d ms from the primary", travel[true], travel[false])
	}
}
