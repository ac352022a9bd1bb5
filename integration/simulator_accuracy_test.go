package integration

import (
	"cmp"
	"fmt"
	"maps"
	"math"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/sim"
)

// The simulator's accuracy columns held to real processes: each test runs
// a load on real Caddy nodes (a Redis per region, one MariaDB), records
// every request as it was sent (when, which node, the answer), then
// replays that trace request for request in the simulator
// (sim.HarnessTrace: the same regions × nodes, limit, window and
// intervals, on loopback) and compares the figures the simulator's tables
// print: admitted / limit per window (max and median), the share of false
// allows against the central counter (sim.Reference for the real
// answers), and the time from a burst's first denial to its count in the
// other region. The slack of each comparison is derived from repeated
// runs on a noisy 2-core machine and stated where it is checked.

// The intervals of the agreement runs: the scale harness's (the
// simulator's harnessNet), long enough that a scheduling delay of a few
// tens of milliseconds on a loaded machine is a small part of a flush.
const (
	agreeFlush = 200 * time.Millisecond
	agreeSync  = time.Second
)

// planned is one request of a load: when (from the load's start), which
// key, at which node of which region.
type planned struct {
	at           time.Duration
	key          string
	region, node int
}

// answered is a planned request as it went: when it was sent and the
// status it got.
type answered struct {
	planned
	sent time.Time
	code int
}

// offer sends plan (in order of at) from start on, each request when its
// time comes and on its own connection's goroutine, and returns the
// answers in the plan's order. An answer neither 200 nor 429 fails the
// test.
func offer(t *testing.T, c *cluster, start time.Time, plan []planned) []answered {
	t.Helper()
	out := make([]answered, len(plan))
	var wg sync.WaitGroup
	for i, p := range plan {
		time.Sleep(time.Until(start.Add(p.at)))
		n := c.regions[p.region][p.node]
		wg.Go(func() {
			out[i].planned = p
			out[i].sent = time.Now()
			out[i].code = sendKey(loadClient, n.url("/"), p.key)
		})
	}
	wg.Wait()
	for _, a := range out {
		if a.code != http.StatusOK && a.code != http.StatusTooManyRequests {
			t.Fatalf("a request to region %d node %d answered %d", a.region, a.node, a.code)
		}
	}
	return out
}

// trace is the answers as the simulator's requests: each at its time
// from origin, which must lie a whole number of the windows before every
// border the answers cross, so that the simulator's windows fall where
// the real ones did.
func trace(answers []answered, origin time.Time) []sim.Request {
	out := make([]sim.Request, len(answers))
	for i, a := range answers {
		out[i] = sim.Request{At: a.sent.Sub(origin), Key: a.key, Region: a.region, Node: a.node}
	}
	return out
}

// realFigures are the simulator's accuracy figures computed for the real
// answers: admitted / limit of each key's window (every window the load
// touched, in increasing order), and the false allows and denies of the
// central counter fed the answers in the order they were sent.
type realFigures struct {
	// windows is admitted / limit of every window, in increasing order;
	// inOrder the same in window order (by window, then key).
	windows, inOrder                    []float64
	decisions, falseAllows, falseDenies int64
}

func figuresOf(answers []answered, limit int64, window time.Duration) realFigures {
	byTime := slices.Clone(answers)
	slices.SortStableFunc(byTime, func(a, b answered) int { return a.sent.Compare(b.sent) })
	ref := sim.NewReference(limit, window)
	type win struct {
		key string
		seq int64
	}
	admitted := map[win]int64{}
	for _, a := range byTime {
		ok := a.code == http.StatusOK
		ref.Judge(a.key, a.sent.UnixMilli(), ok)
		if w := (win{a.key, a.sent.UnixMilli() / window.Milliseconds()}); ok {
			admitted[w]++
		} else if _, seen := admitted[w]; !seen {
			admitted[w] = 0
		}
	}
	ws := slices.Collect(maps.Keys(admitted))
	slices.SortFunc(ws, func(a, b win) int {
		if a.seq != b.seq {
			return cmp.Compare(a.seq, b.seq)
		}
		return strings.Compare(a.key, b.key)
	})
	var f realFigures
	for _, w := range ws {
		if n := admitted[w]; n > 0 { // as the simulator: a window counts once it admitted
			f.inOrder = append(f.inOrder, float64(n)/float64(limit))
		}
	}
	f.windows = slices.Sorted(slices.Values(f.inOrder))
	f.decisions, f.falseAllows, f.falseDenies = ref.Decisions, ref.FalseAllows, ref.FalseDenies
	return f
}

func maxOf(xs []float64) float64    { return xs[len(xs)-1] }
func medianOf(xs []float64) float64 { return xs[len(xs)/2] }

// readyForLoad waits until every region's role is held and every node
// counts its region's processes, as the simulated fleet has before its
// trace begins.
func readyForLoad(t *testing.T, c *cluster) {
	t.Helper()
	for _, nodes := range c.regions {
		holderOf(t, nodes, 20*time.Second)
		var ns []*node
		for _, n := range nodes {
			ns = append(ns, n.node)
		}
		countEachOther(t, ns)
	}
}

// simulate runs the trace in the simulator on c's configuration, with
// faults.
func simulate(t *testing.T, c *cluster, reqs []sim.Request, settle time.Duration, faults ...sim.Fault) *sim.Result {
	t.Helper()
	s := c.spec
	cfg := sim.HarnessTrace(s.regions, s.nodes, s.limit, s.window, s.flush, s.globalSync, settle, reqs, 1)
	cfg.Faults = faults
	res, err := sim.Run(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if res.Decisions != int64(len(reqs)) {
		t.Fatalf("the simulator decided %d requests of a trace of %d", res.Decisions, len(reqs))
	}
	return res
}

// TestSimulator_SkewedTrafficOverSlidingWindowsAgrees: two regions of two
// nodes share one key, 70 % of the traffic at the first region and 30 %
// at the second, at twice the limit's rate for six windows of 4 s, so
// that every window after the first weighs the one before it. The
// simulator replays the trace; its admitted / limit per window (max and
// median) and its share of false allows must be the real ones'.
func TestSimulator_SkewedTrafficOverSlidingWindowsAgrees(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy, Redis and MariaDB")
	}
	const (
		limit   = 120
		window  = 4 * time.Second
		rate    = 2 * limit / 4 // twice the limit's rate, a second
		windows = 6
	)
	c := startCluster(t, clusterSpec{regions: 2, nodes: 2, limit: limit, window: window,
		flush: agreeFlush, globalSync: agreeSync, blocklistSync: agreeSync})
	readyForLoad(t, c)
	plan := skewedPlan(c, freshKey("agree-skewed"), []int{7, 3}, rate, windows, window)
	start := nextBorder(window)
	answers := offer(t, c, start, plan)
	real := figuresOf(answers, limit, window)
	// The simulated fleet runs HarnessStart, rounded up to windows,
	// before the load.
	lead := (sim.HarnessStart + window - 1) / window * window
	res := simulate(t, c, trace(answers, start.Add(-lead)), 2*time.Second)

	realFA := float64(real.falseAllows) / float64(real.decisions)
	simFA := float64(res.FalseAllows) / float64(res.Decisions)
	t.Logf("admitted / limit per window (%d): real max %.3f median %.3f %v · simulated max %.3f median %.3f %v",
		len(real.windows), maxOf(real.windows), medianOf(real.windows), real.windows, res.WindowMax(), res.WindowMedian(), res.Windows)
	t.Logf("false allows: real %.2f %% · simulated %.2f %%; false denies: real %.2f %% · simulated %.2f %%",
		100*realFA, 100*simFA, 100*float64(real.falseDenies)/float64(real.decisions), 100*float64(res.FalseDenies)/float64(res.Decisions))
	if len(real.windows) != windows || len(res.Windows) != windows {
		t.Fatalf("%d real and %d simulated windows admitted, want the load's %d", len(real.windows), len(res.Windows), windows)
	}
	// The slack, from seven runs on a 2-core machine beside other work
	// (2026-11-27, one under -race beside other packages' tests): the
	// simulated worst window was 0.008–0.042 below the real one (real
	// 1.042–1.075: one sample, a noisy machine's), the median within
	// ± 0.017 (real 1.017–1.042), false allows within 2.2 points (real
	// 39.8–41.5 %; a unit admitted a moment early counts one at twice
	// the limit's rate). So: the worst window ± 0.08 of the limit (10
	// units of 120), the median ± 0.04, false allows ± 4 points. With the
	// default min_window (1m) the simulator's regions counted apart
	// here: 1.60 × and 71 %.
	const maxSlack, medianSlack, faSlack = 0.08, 0.04, 0.04
	if d := math.Abs(res.WindowMax() - maxOf(real.windows)); d > maxSlack {
		t.Errorf("the worst window: simulated %.3f × the limit, real %.3f (± %.2f)", res.WindowMax(), maxOf(real.windows), maxSlack)
	}
	if d := math.Abs(res.WindowMedian() - medianOf(real.windows)); d > medianSlack {
		t.Errorf("the median window: simulated %.3f × the limit, real %.3f (± %.2f)", res.WindowMedian(), medianOf(real.windows), medianSlack)
	}
	if d := math.Abs(simFA - realFA); d > faSlack {
		t.Errorf("false allows: simulated %.2f %%, real %.2f %% (± %.0f points)", 100*simFA, 100*realFA, 100*faSlack)
	}
}

// TestSimulator_BurstAtOneRegionBesideAnotherAgrees: eight keys in turn,
// each a burst at the first region (200 requests a second for a second:
// twice a limit of 100) while the second region sends the same key 30
// requests a second for two seconds. What the second region admits after
// the burst used the limit, until the burst's count reaches it, is the
// over-admission of a burst; the simulator replays the trace, and its
// admitted / limit per key (max and median) and its time from each
// burst's first denial to the count in the second region (median) must
// be the real ones'. The real time is read from the second region's view
// of the key (its counters, polled every 5 ms), as the simulator reads
// its model of the region's Redis.
func TestSimulator_BurstAtOneRegionBesideAnotherAgrees(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy, Redis and MariaDB")
	}
	const (
		limit   = 100
		keys    = 8
		period  = 2500 * time.Millisecond
		burstN  = 200 // at 200 a second
		besideN = 60  // at 30 a second
	)
	window := pickWindow(time.Duration(keys)*period + 30*time.Second)
	c := startCluster(t, clusterSpec{regions: 2, nodes: 1, limit: limit, window: window,
		flush: agreeFlush, globalSync: agreeSync, blocklistSync: agreeSync})
	readyForLoad(t, c)
	var plan []planned
	names := make([]string, keys)
	for k := range keys {
		names[k] = freshKey(fmt.Sprintf("agree-burst-%d", k))
		from := time.Duration(k) * period
		for i := range burstN {
			plan = append(plan, planned{at: from + time.Duration(i)*time.Second/200, key: names[k], region: 0})
		}
		for i := range besideN {
			plan = append(plan, planned{at: from + time.Duration(i)*time.Second/30, key: names[k], region: 1})
		}
	}
	slices.SortStableFunc(plan, func(a, b planned) int { return int(a.at - b.at) })
	start := time.Now().Add(100 * time.Millisecond)
	b := c.regions[1][0]
	views := make([][]viewSample, keys)
	var watch sync.WaitGroup
	watch.Go(func() {
		for k := range keys {
			views[k] = watchView(b, names[k], window, start.Add(time.Duration(k)*period), start.Add(time.Duration(k+1)*period))
		}
	})
	answers := offer(t, c, start, plan)
	watch.Wait()
	real := figuresOf(answers, limit, window)
	var realLat []time.Duration
	for k := range keys {
		lat, ok := travel(answers, names[k], views[k], window)
		if !ok {
			t.Fatalf("key %d: the second region's view never held the burst's count", k)
		}
		realLat = append(realLat, lat)
	}
	slices.Sort(realLat)
	// One window holds the whole trace in both; the simulated fleet runs
	// HarnessStart before it.
	res := simulate(t, c, trace(answers, start.Add(-sim.HarnessStart)), 5*time.Second)
	simP50, _ := res.Burst()
	realP50 := realLat[len(realLat)/2]
	t.Logf("admitted / limit per key: real max %.3f median %.3f %v · simulated max %.3f median %.3f %v",
		maxOf(real.windows), medianOf(real.windows), real.windows, res.WindowMax(), res.WindowMedian(), res.Windows)
	byRegion := [2]int{}
	for _, a := range answers {
		if a.code == http.StatusOK {
			byRegion[a.region]++
		}
	}
	t.Logf("admitted by region: real %d / %d · simulated %d / %d", byRegion[0], byRegion[1], res.Regions[0].Admitted, res.Regions[1].Admitted)
	t.Logf("first denial → its count in the other region: real p50 %s %v · simulated p50 %s %v (%d never)",
		realP50, realLat, simP50, res.Latencies, res.Unreached)
	if len(real.windows) != keys || len(res.Windows) != keys || len(res.Latencies) != keys {
		t.Fatalf("%d real and %d simulated windows admitted, %d simulated travel times, want one per key (%d)", len(real.windows), len(res.Windows), len(res.Latencies), keys)
	}
	// The slack, from eleven runs on a 2-core machine beside other work
	// (2026-11-27, one under -race beside other packages' tests): the
	// simulated median key was 0–0.05 below the real one (real
	// 1.21–1.23), the worst key 0.05 below to 0.02 above (real
	// 1.22–1.28, the 1.28 a run whose slowest burst took 0.8 s to
	// travel), the median travel 67 ms below to 58 ms above (real
	// 165–301 ms, simulated 202–267 ms). So: the median key ± 0.06, the
	// worst, one sample of a noisy machine, ± 0.10, the median travel
	// ± 125 ms. The first region admits the limit exactly in both; the
	// second admitted about 1.6 units a key more in those real runs. Its
	// count arrived later: each holder's flush made 32 Redis round trips
	// one after another to take the registry's and the denials' shards
	// (about 5 ms of an 11 ms flush here), and each flush loop waits for
	// its last flush before its next interval, while the model took one
	// round trip each and its loopback had neither client nor server
	// time. The takes are pipelined now and HarnessTrace's round trips
	// are those measured here; four runs after: the median key 1.19–1.20
	// real and simulated alike, the second region 151–161 units real
	// against 149–159. The simulated travel times keep two short ones
	// (about 45 and 60 ms) whatever the run: the simulator draws its
	// loops' phases from the seed, not from the trace, and each run's
	// bursts come at the same simulated times, so the first two always
	// find the first region's flush and the second's pull just after
	// their first denial (seed 2 puts its short ones elsewhere).
	const medianSlack, maxSlack, travelSlack = 0.06, 0.10, 125 * time.Millisecond
	if d := math.Abs(res.WindowMax() - maxOf(real.windows)); d > maxSlack {
		t.Errorf("the worst key: simulated %.3f × the limit, real %.3f (± %.2f)", res.WindowMax(), maxOf(real.windows), maxSlack)
	}
	if d := math.Abs(res.WindowMedian() - medianOf(real.windows)); d > medianSlack {
		t.Errorf("the median key: simulated %.3f × the limit, real %.3f (± %.2f)", res.WindowMedian(), medianOf(real.windows), medianSlack)
	}
	if d := (simP50 - realP50).Abs(); d > travelSlack {
		t.Errorf("a burst's travel to the other region: simulated p50 %s, real %s (± %s)", simP50, realP50, travelSlack)
	}
}

// viewSample is a region's view of a key's cell (its count and what it
// imported) at a time.
type viewSample struct {
	at   time.Time
	seq  int64
	view int64
}

// watchView polls n's view of key from from until until, every 5 ms.
func watchView(n *regionNode, key string, window time.Duration, from, until time.Time) []viewSample {
	time.Sleep(time.Until(from))
	var out []viewSample
	for now := time.Now(); now.Before(until); now = time.Now() {
		if kc, ok := n.counters(key); ok {
			for _, cell := range kc.Cells {
				out = append(out, viewSample{at: now, seq: cell.Sequence, view: cell.Regional + cell.Global})
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	return out
}

// travel is the time from key's first denial anywhere to the first of
// views (the other region's) holding what the fleet had admitted of the
// key before that denial, as the simulator measures it.
func travel(answers []answered, key string, views []viewSample, window time.Duration) (time.Duration, bool) {
	var first time.Time
	for _, a := range answers {
		if a.key == key && a.code == http.StatusTooManyRequests && (first.IsZero() || a.sent.Before(first)) {
			first = a.sent
		}
	}
	if first.IsZero() {
		return 0, false
	}
	var target int64
	for _, a := range answers {
		if a.key == key && a.code == http.StatusOK && a.sent.Before(first) {
			target++
		}
	}
	seq := first.UnixMilli() / window.Milliseconds()
	for _, v := range views {
		if v.seq == seq && v.view >= target && !v.at.Before(first) {
			return v.at.Sub(first), true
		}
	}
	return 0, false
}
