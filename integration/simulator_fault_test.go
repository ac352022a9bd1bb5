package integration

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/sim"
)

// The failure table's faults held to real processes: the skewed load of
// TestSimulator_SkewedTrafficOverSlidingWindowsAgrees (70 % at one region,
// 30 % at the other, twice the limit's rate) runs for eight windows of
// 4 s on 2 regions × 2 nodes, a fault lasts about two of them, and the
// simulator replays the trace with the same fault over the same span; its
// admitted / limit per window (worst, median and mean) must be the real
// ones'.

// The fault runs' load.
const (
	faultLimit   = 120
	faultWindow  = 4 * time.Second
	faultRate    = 2 * faultLimit / 4 // twice the limit's rate, a second
	faultWindows = 8
)

// skewedPlan is rate requests a second of key for windows windows of
// window, round robin over c's nodes, region r getting shares[r] parts of
// each round, as the scale harness spreads its skewed load.
func skewedPlan(c *cluster, key string, shares []int, rate, windows int, window time.Duration) []planned {
	var order [][2]int
	for turn := range c.spec.nodes {
		for r, share := range shares {
			for range share {
				order = append(order, [2]int{r, turn})
			}
		}
	}
	var plan []planned
	for i := range rate * windows * int(window/time.Second) {
		p := order[i%len(order)]
		plan = append(plan, planned{at: time.Duration(i) * time.Second / time.Duration(rate), key: key, region: p[0], node: p[1]})
	}
	return plan
}

// nextBorder is the start of the window after the next: a load starting
// there has whole windows.
func nextBorder(window time.Duration) time.Time {
	w := window.Milliseconds()
	return time.UnixMilli((time.Now().UnixMilli()/w + 2) * w)
}

// agreeFault is a fault done to real processes: begin starts it and end
// ends it, returning once it is over (the restarted server answers). The
// worst real window must admit at least shows × the limit, or the fault
// did not part the counts it should have.
type agreeFault struct {
	kind       sim.FaultKind
	region     int
	empty      bool // the fault's end restarts Redis empty (sim.Fault.Empty)
	begin, end func() error
	shows      float64
}

// underFault runs the fault load on c (started with the fault runs'
// limit and window), begins f a quarter into the third window and ends
// it two windows later, and replays the trace in the simulator with f's
// kind over the span from begin to the end's return. It returns the real
// figures and the simulated ones.
func underFault(t *testing.T, c *cluster, name string, f agreeFault) (realFigures, *sim.Result) {
	t.Helper()
	readyForLoad(t, c)
	plan := skewedPlan(c, freshKey(name), []int{7, 3}, faultRate, faultWindows, faultWindow)
	start := nextBorder(faultWindow)
	var down, up time.Time
	ended := make(chan error, 1)
	go func() {
		// A helper that fails the test ends this goroutine: the deferred
		// send still tells the load's end.
		err := errors.New("the fault did not end")
		defer func() { ended <- err }()
		time.Sleep(time.Until(start.Add(2*faultWindow + faultWindow/4)))
		down = time.Now()
		if err = f.begin(); err != nil {
			return
		}
		time.Sleep(time.Until(down.Add(2 * faultWindow)))
		err = f.end()
		up = time.Now()
	}()
	answers := offer(t, c, start, plan)
	if err := <-ended; err != nil {
		t.Fatal(err)
	}
	real := figuresOf(answers, faultLimit, faultWindow)
	lead := (sim.HarnessStart + faultWindow - 1) / faultWindow * faultWindow
	origin := start.Add(-lead)
	res := simulate(t, c, trace(answers, origin), 2*time.Second,
		sim.Fault{Kind: f.kind, Region: f.region, At: down.Sub(origin), For: up.Sub(down), Empty: f.empty})
	t.Logf("fault from %s into the load for %s", down.Sub(start).Round(time.Millisecond), up.Sub(down).Round(time.Millisecond))
	t.Logf("admitted / limit per window (%d, in window order): real max %.3f median %.3f mean %.3f %v · simulated max %.3f median %.3f mean %.3f %v",
		len(real.windows), maxOf(real.windows), medianOf(real.windows), meanOf(real.windows), real.inOrder,
		res.WindowMax(), res.WindowMedian(), meanOf(res.Windows), res.InOrder)
	if len(real.windows) != faultWindows || len(res.Windows) != faultWindows {
		t.Fatalf("%d real and %d simulated windows admitted, want the load's %d", len(real.windows), len(res.Windows), faultWindows)
	}
	if maxOf(real.windows) < f.shows {
		t.Fatalf("the worst real window admitted %.3f × the limit, want at least %.1f: the fault did not part the counts", maxOf(real.windows), f.shows)
	}
	return real, res
}

// meanOf is the mean of xs.
func meanOf(xs []float64) float64 {
	var s float64
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}

// holdWindows fails t where the simulated worst, median or mean window
// lies further from the real one than its slack.
func holdWindows(t *testing.T, real realFigures, res *sim.Result, maxSlack, medianSlack, meanSlack float64) {
	t.Helper()
	for _, f := range []struct {
		what      string
		sim, real float64
		slack     float64
	}{
		{"the worst window", res.WindowMax(), maxOf(real.windows), maxSlack},
		{"the median window", res.WindowMedian(), medianOf(real.windows), medianSlack},
		{"the mean window", meanOf(res.Windows), meanOf(real.windows), meanSlack},
	} {
		if math.Abs(f.sim-f.real) > f.slack {
			t.Errorf("%s: simulated %.3f × the limit, real %.3f (± %.2f)", f.what, f.sim, f.real, f.slack)
		}
	}
}

// faultCluster is the fault runs' cluster: 2 regions × 2 nodes at the
// agreement runs' intervals, changed by spec's other fields.
func faultCluster(t *testing.T, spec clusterSpec) *cluster {
	spec.regions, spec.nodes, spec.limit, spec.window = 2, 2, faultLimit, faultWindow
	spec.flush, spec.globalSync, spec.blocklistSync = agreeFlush, agreeSync, agreeSync
	return startCluster(t, spec)
}

// TestSimulator_MariaDBDownUnderSkewedTrafficAgrees: MariaDB is killed for
// about two windows and started again: each region counts alone
// meanwhile, and the windows of the outage admit more than the limit. The
// simulator's primary is down over the same span (sim.PrimaryDown: every
// statement refused at once, as a killed server on loopback refuses its
// connections).
func TestSimulator_MariaDBDownUnderSkewedTrafficAgrees(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy, Redis and MariaDB")
	}
	c := faultCluster(t, clusterSpec{ownMySQL: true})
	real, res := underFault(t, c, "agree-mysql-down", agreeFault{kind: sim.PrimaryDown, shows: 1.2,
		begin: func() error { c.mysql.Stop(); return nil }, end: c.mysql.Restart})
	// The slack, from four runs on a 2-core machine beside other work
	// (2026-11-28, one under -race): the worst window, the outage's
	// whole one, was 1.592 in every run, real and simulated; the next
	// highest 1.450–1.467 real against 1.458; the medians within 0.009;
	// the mean window within 0.007–0.024 (0.024 under -race). The
	// window of the restart varied most (1.208 and 1.300 real against
	// 1.125 in two runs read window by window), as the write breaker's
	// probe fell (the simulator draws one phase of it). Seven more runs
	// the same day, each beside the other fault tests (one under -race),
	// put the medians 0.008–0.050 apart (real 1.025–1.083 against
	// 1.025–1.033) and the means 0.016–0.038, which failed the median's
	// first ± 0.04 twice.
	// So: the worst window ± 0.10, the median ± 0.08, the mean ± 0.08.
	holdWindows(t, real, res, 0.10, 0.08, 0.08)
}

// TestSimulator_RedisDownUnderSkewedTrafficAgrees: the busier region's
// Redis is killed for about two windows and started again, empty: its
// nodes count alone meanwhile and its holder can neither take the
// region's counts to MySQL nor bring the other region's. The simulator's
// Redis of that region is unreachable over the same span and comes back
// empty (sim.RedisOutage, Empty).
func TestSimulator_RedisDownUnderSkewedTrafficAgrees(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy, Redis and MariaDB")
	}
	c := faultCluster(t, clusterSpec{})
	real, res := underFault(t, c, "agree-redis-down", agreeFault{kind: sim.RedisOutage, region: 0, empty: true, shows: 1.5,
		begin: func() error { c.redis[0].Stop(); return nil },
		end:   func() error { c.redis[0].Restart(); return nil }})
	// The slack, from six runs on a 2-core machine beside other work
	// (2026-11-28, each beside the other fault tests, one under -race):
	// the window of the whole outage admitted 2.000 × the limit in every
	// run, real and simulated (every request: each node alone under the
	// limit); the window of the restart 1.675–1.717 real against
	// 1.667–1.717; the
	// medians within 0.009, the means within 0.006. So: the worst window
	// ± 0.05, the median ± 0.04, the mean ± 0.015 at first. Then a CI run
	// (the whole suite under -race, 2026-11-28) put the mean 0.016 apart:
	// its windows of the kill and of the restart were 1.758 and 1.775
	// real against 1.742 and 1.667 (sorted lists; which was which is
	// not known). Read window by window in three more runs under -race,
	// the window of the kill moved up to 0.058 between real and
	// simulated (1.725 against 1.783), that of the restart up to 0.025:
	// each node's breaker trips and probes at moments of its own, which
	// the simulator draws. Two windows of eight 0.09 apart move the mean
	// 0.0225: the mean ± 0.025 now. Before the simulator modelled the
	// origin's breakers its nodes used Redis again the moment it was
	// back, and the window of the restart admitted 1.242 × against the
	// real 1.667: the mean window 0.05–0.075 below. With three of the
	// eight windows raised by the fault, the median is the highest of the
	// others, a window without fault whose real count moves by several
	// units from run to run: a CI run (2026-11-29, the whole suite under
	// -race) put it 0.042 apart, its first window admitting 1.067 × the
	// limit against the simulated 1.025, the fault's windows within 0.033,
	// the others within 0.017, and the mean within 0.016. The MariaDB test's median moved as much
	// (real 1.025–1.083 against 1.025–1.033): the median ± 0.08 here too.
	// Since 2026-11-29 a node's breakers close at its restart watch's
	// next answer (a slow tick) instead of their probe, real and
	// simulated: the window of the restart admitted 0.992 × the limit in
	// both (one run; 1.675–1.717 before), the kill's 1.758 against 1.717.
	// Two CI runs the same day put the simulated window of the restart at
	// 1.242 against the real 0.992, and the mean 0.028 apart: the
	// simulator did not model the restart watch's answer to a new run ID
	// (every cell sent again, the layer's registrations and imports
	// again), and its Redis came back with what it held; and its killed
	// Redis swallowed each call until its timeout, where a killed one's
	// host refuses it at once, so a holder's loop, a second a call, took
	// the role back up to two seconds late and the other region read
	// nothing of this one's counts meanwhile. Since it models all three
	// (sim.Fault's Empty), three runs (2026-11-29, beside nothing) put the
	// window of the restart at 0.992–1.000 real and 1.000 simulated, the
	// means 0.001–0.011 apart: the mean ± 0.025 again.
	holdWindows(t, real, res, 0.05, 0.08, 0.025)
}

// TestSimulator_RegionCutOffUnderSkewedTrafficAgrees: the quieter region's
// nodes reach MariaDB through a proxy that is cut (every byte swallowed,
// every statement ending in mysql_timeout, as behind a partition) for
// about two windows and restored: each region counts alone meanwhile.
// The simulator cuts the region off over the same span (sim.Cutoff).
func TestSimulator_RegionCutOffUnderSkewedTrafficAgrees(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy, Redis and MariaDB")
	}
	var proxy *redistest.Proxy
	c := faultCluster(t, clusterSpec{regionDSN: func(r int, dsn string) string {
		if r != 1 {
			return dsn
		}
		at, end := strings.Index(dsn, "tcp("), strings.Index(dsn, ")/")
		if proxy == nil {
			proxy = redistest.StartDelayProxy(t, dsn[at+len("tcp("):end], 0)
		}
		return fmt.Sprintf("%stcp(%s%s", dsn[:at], proxy.Addr(), dsn[end:])
	}})
	real, res := underFault(t, c, "agree-cutoff", agreeFault{kind: sim.Cutoff, region: 1, shows: 1.2,
		begin: func() error { proxy.Cut(); return nil },
		end:   func() error { proxy.Restore(); return nil }})
	// The slack, from six runs on a 2-core machine beside other work
	// (2026-11-28, each beside the other fault tests, one under -race):
	// the window of the whole cut admitted 1.592 × the limit in every
	// run, real and simulated, the window it began in 1.442–1.467
	// against 1.433–1.458;
	// the medians within 0.017, the means within 0.005. So: the worst
	// window ± 0.05, the median ± 0.04, the mean ± 0.015. Before the
	// simulator judged each statement when its holder's flush sent it,
	// a flush begun during the cut failed its statements for seconds
	// after the restore, and the window of the restore admitted 1.367 ×
	// the limit against the real 1.025 ×: the mean window 0.035–0.040
	// above. The median is the highest window without fault, as in the
	// Redis-down test, where a CI run put it 0.042 apart from the
	// simulated one: ± 0.08, as there.
	holdWindows(t, real, res, 0.05, 0.08, 0.015)
}
