package integration

import (
	"fmt"
	"math"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/sim"
	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
)

// The simulator's MySQL held to real processes where it is slow: a region
// reading a replica held behind (MASTER_DELAY), and a region far from the
// primary (every byte to and from MariaDB carried by a wire of 75 ms each
// way). Each test runs bursts at one region beside a steady trickle of
// the same key at the other, which admits until the burst's count
// reaches it: how much it admits is how long the count took, through
// the replica or over the long wire. The simulator replays the trace on
// the same fleet with the same lag or round trip.

// besideBurst is a load of keys in turn, one every period: a burst at
// region burstAt(k) (200 requests a second for a second: twice the
// limit of 100) while the other region sends the key besideRate a
// second for besideFor, less than the limit on its own. watch is the
// other region's view of each key, polled every 5 ms over its period.
type besideBurst struct {
	keys              int
	period, besideFor time.Duration
	besideRate        int
	burstAt           func(k int) int
	names             []string
	answers           []answered
	views             [][]viewSample
	start             time.Time
	realLat           [][]time.Duration // by the region the count travels to
	admitted          [2]int
	real              realFigures
	window            time.Duration
	limit             int64
}

// run offers the load on c (2 regions × 1 node) and measures it.
func (b *besideBurst) run(t *testing.T, c *cluster) {
	t.Helper()
	b.window, b.limit = c.spec.window, c.spec.limit
	var plan []planned
	b.names = make([]string, b.keys)
	for k := range b.keys {
		b.names[k] = freshKey(fmt.Sprintf("agree-mysql-%d", k))
		from, at := time.Duration(k)*b.period, b.burstAt(k)
		for i := range 200 {
			plan = append(plan, planned{at: from + time.Duration(i)*time.Second/200, key: b.names[k], region: at})
		}
		for i := range int(b.besideFor.Seconds() * float64(b.besideRate)) {
			plan = append(plan, planned{at: from + time.Duration(i)*time.Second/time.Duration(b.besideRate), key: b.names[k], region: 1 - at})
		}
	}
	slices.SortStableFunc(plan, func(a, b planned) int { return int(a.at - b.at) })
	b.start = time.Now().Add(100 * time.Millisecond)
	b.views = make([][]viewSample, b.keys)
	var watch sync.WaitGroup
	watch.Go(func() {
		for k := range b.keys {
			other := c.regions[1-b.burstAt(k)][0]
			b.views[k] = watchView(other, b.names[k], b.window, b.start.Add(time.Duration(k)*b.period), b.start.Add(time.Duration(k+1)*b.period))
		}
	})
	b.answers = offer(t, c, b.start, plan)
	watch.Wait()
	b.real = figuresOf(b.answers, b.limit, b.window)
	b.realLat = make([][]time.Duration, 2)
	for k := range b.keys {
		lat, ok := travel(b.answers, b.names[k], b.views[k], b.window)
		if !ok {
			t.Fatalf("key %d: the other region's view never held the burst's count", k)
		}
		to := 1 - b.burstAt(k)
		b.realLat[to] = append(b.realLat[to], lat)
	}
	for _, a := range b.answers {
		if a.code == http.StatusOK {
			b.admitted[a.region]++
		}
	}
}

// simulated are the simulator's figures of the load over replaySeeds
// seeds: the seeds' mean of the worst and median key (admitted / limit)
// and of what each region admitted beside the bursts, a key; every
// seed's travel times, by the region the count travels to; and the
// first seed's result.
type simulated struct {
	res                  *sim.Result
	windowMax, windowMid float64
	beside               [2]float64
	lat                  [][]time.Duration
	admitted             [2]float64
}

// replaySeeds is how many seeds replay a trace. One seed places every
// loop's phase once, and a load of ten bursts meets each phase once: the
// trickling region's count came 0.3 s or 0.9 s after a burst by the
// phase alone, where the real loops' phases fall anew each run.
const replaySeeds = 8

// replay runs the load's trace in the simulator on c's fleet, tune
// setting what the test's fleet has that HarnessTrace's has not.
func (b *besideBurst) replay(t *testing.T, c *cluster, tune func(*sim.Config)) simulated {
	t.Helper()
	s := c.spec
	reqs := trace(b.answers, b.start.Add(-sim.HarnessStart))
	out := simulated{lat: make([][]time.Duration, 2)}
	for seed := uint64(1); seed <= replaySeeds; seed++ {
		cfg := sim.HarnessTrace(s.regions, s.nodes, s.limit, s.window, s.flush, s.globalSync, 8*time.Second, reqs, seed)
		tune(&cfg)
		res, err := sim.Run(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if res.Decisions != int64(len(reqs)) {
			t.Fatalf("the simulator decided %d requests of a trace of %d", res.Decisions, len(reqs))
		}
		if len(res.Windows) != b.keys {
			t.Fatalf("seed %d: %d simulated windows admitted, want one per key (%d)", seed, len(res.Windows), b.keys)
		}
		if out.res == nil {
			out.res = res
		}
		out.windowMax += res.WindowMax() / replaySeeds
		out.windowMid += res.WindowMedian() / replaySeeds
		for k, name := range b.names {
			ls := res.KeyLatencies[name]
			if len(ls) != 1 {
				t.Fatalf("seed %d key %d: %d simulated travel times, want one", seed, k, len(ls))
			}
			to := 1 - b.burstAt(k)
			out.lat[to] = append(out.lat[to], time.Duration(ls[0])*time.Millisecond)
			out.beside[to] += float64(res.KeyAdmitted[name][to]) / float64(b.bursts(1-to)) / replaySeeds
		}
		for r := range 2 {
			out.admitted[r] += float64(res.Regions[r].Admitted) / replaySeeds
		}
	}
	return out
}

// bursts is how many of the load's bursts come at region r.
func (b *besideBurst) bursts(r int) int {
	n := 0
	for k := range b.keys {
		if b.burstAt(k) == r {
			n++
		}
	}
	return n
}

// medianDur is the median of ds (the upper one of an even count).
func medianDur(ds []time.Duration) time.Duration {
	s := slices.Sorted(slices.Values(ds))
	return s[len(s)/2]
}

// compare logs the real and simulated figures and fails those apart by
// more than their slack: the median and worst key (admitted / limit),
// what the trickling region admitted a key, and the median travel to
// each region that received bursts' counts.
func (b *besideBurst) compare(t *testing.T, s simulated, medianSlack, maxSlack float64, besideSlack [2]float64, travelSlack [2]time.Duration) {
	t.Helper()
	t.Logf("admitted / limit per key: real max %.3f median %.3f %v · simulated (mean of %d seeds) max %.3f median %.3f, seed 1 %v",
		maxOf(b.real.windows), medianOf(b.real.windows), b.real.windows, replaySeeds, s.windowMax, s.windowMid, s.res.Windows)
	t.Logf("admitted by region: real %d / %d · simulated %.1f / %.1f", b.admitted[0], b.admitted[1], s.admitted[0], s.admitted[1])
	if len(b.real.windows) != b.keys {
		t.Fatalf("%d real windows admitted, want one per key (%d)", len(b.real.windows), b.keys)
	}
	if d := math.Abs(s.windowMax - maxOf(b.real.windows)); d > maxSlack {
		t.Errorf("the worst key: simulated %.3f × the limit, real %.3f (± %.2f)", s.windowMax, maxOf(b.real.windows), maxSlack)
	}
	if d := math.Abs(s.windowMid - medianOf(b.real.windows)); d > medianSlack {
		t.Errorf("the median key: simulated %.3f × the limit, real %.3f (± %.2f)", s.windowMid, medianOf(b.real.windows), medianSlack)
	}
	// What the trickling region admitted of each key, until the burst's
	// count reached it.
	for to := range 2 {
		n := b.bursts(1 - to)
		if n == 0 {
			continue
		}
		var realN int
		for _, a := range b.answers {
			if a.region == to && a.code == http.StatusOK && b.burstAt(slices.Index(b.names, a.key)) != to {
				realN++
			}
		}
		rb, sb := float64(realN)/float64(n), s.beside[to]
		realP50, simP50 := medianDur(b.realLat[to]), medianDur(s.lat[to])
		t.Logf("region %d beside %d bursts: admitted a key real %.1f · simulated %.1f; travel to it: real p50 %s %v · simulated p50 %s (seed 1 %v)",
			to, n, rb, sb, realP50.Round(time.Millisecond), roundAll(b.realLat[to]), simP50, s.lat[to][:n])
		if d := math.Abs(sb-rb) / float64(b.limit); d > besideSlack[to] {
			t.Errorf("region %d admitted beside the bursts %.1f a key simulated, %.1f real (± %.2f of the limit)", to, sb, rb, besideSlack[to])
		}
		if d := (simP50 - realP50).Abs(); d > travelSlack[to] {
			t.Errorf("a burst's travel to region %d: simulated p50 %s, real %s (± %s)", to, simP50, realP50, travelSlack[to])
		}
	}
}

func roundAll(ds []time.Duration) []time.Duration {
	out := make([]time.Duration, len(ds))
	for i, d := range ds {
		out[i] = d.Round(time.Millisecond)
	}
	return out
}

// TestSimulator_ReplicaHeldBehindAgrees: the second region pulls from a
// replica held 2 s behind the primary (MASTER_DELAY=2); six bursts at
// the first region, each beside 20 requests a second of the key at the
// second for 4.5 s (90, less than the limit). The second region admits
// until the burst's count reaches it through the replica; the simulator
// replays the trace with every replica 2 s behind (ReplicaLag and its
// 99th percentile), and what each key and the second region admit, and
// the count's travel, must be the real ones'.
func TestSimulator_ReplicaHeldBehindAgrees(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy, Redis and a MariaDB primary and replica")
	}
	const lag = 2 * time.Second
	b := &besideBurst{keys: 6, period: 5 * time.Second, besideFor: 4500 * time.Millisecond, besideRate: 20,
		burstAt: func(int) int { return 0 }}
	window := pickWindow(time.Duration(b.keys)*b.period + 30*time.Second)
	c := startCluster(t, clusterSpec{regions: 2, nodes: 1, limit: 100, window: window, replica: true,
		flush: agreeFlush, globalSync: agreeSync, blocklistSync: agreeSync})
	c.pair.SetDelay(t, lag)
	readyForLoad(t, c)
	b.run(t, c)
	s := b.replay(t, c, func(cfg *sim.Config) {
		cfg.NoReplicas = false
		cfg.ReplicaLag, cfg.ReplicaLagP99 = lag, lag
	})
	// For the record, not held: the lag the tables draw (a median of 2 s,
	// its 99th percentile 6 s), which a MASTER_DELAY replica has not.
	drawn := b.replay(t, c, func(cfg *sim.Config) {
		cfg.NoReplicas = false
		cfg.ReplicaLag = lag
	})
	t.Logf("with the lag drawn (p99 %s): region 1 admitted %.1f a key, travel p50 %s", 3*lag, drawn.beside[1], medianDur(drawn.lat[1]))
	// The slack, from fourteen runs on a 2-core machine beside other work
	// (2026-11-29; five replayed on seed 1 alone, nine on eight seeds):
	// the second region admitted 48.7–52.3 units a key real against
	// 50.8–51.2 simulated (at most 2.3 apart; with the lag drawn as the
	// tables draw it, 54.8), the median key 1.49–1.53 against
	// 1.508–1.510, the worst 1.51–1.59 against 1.529–1.536. The travel
	// is to the count of the first denial, which comes with a flush after
	// the one that stopped the second region: real 1.87–2.09 s at p50
	// against 2.00–2.10 s, but in one run 2.73 s, three of six keys 2.9
	// s (MariaDB holds an event until its binary log's timestamp, whole
	// seconds, plus the delay: a count a second later now and then, which
	// stopped nothing). So: the second region ± 0.05 of the limit (a lag
	// 0.25 s off moves it by 5 units), the median key ± 0.05, the worst
	// ± 0.10, the travel ± 1 s.
	b.compare(t, s, 0.05, 0.10, [2]float64{0, 0.05}, [2]time.Duration{0, time.Second})
}

// TestSimulator_DistantMySQLAgrees: the second region reaches MariaDB
// over a wire of 75 ms each way (a proxy: every statement a round trip
// of 150 ms, and the connection's handshake its own); ten bursts, in
// turn at each region, each beside 30 requests a second of the key at
// the other for 2.5 s (75, less than the limit). The simulator replays
// the trace with the second region's statements 151 ms away (CrossRTT:
// the wire and a statement's millisecond on loopback).
func TestSimulator_DistantMySQLAgrees(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy, Redis and MariaDB")
	}
	const oneWay = 75 * time.Millisecond
	b := &besideBurst{keys: 10, period: 3 * time.Second, besideFor: 2500 * time.Millisecond, besideRate: 30,
		burstAt: func(k int) int { return k % 2 }}
	window := pickWindow(time.Duration(b.keys)*b.period + 30*time.Second)
	var proxy *redistest.Proxy
	c := startCluster(t, clusterSpec{regions: 2, nodes: 1, limit: 100, window: window,
		flush: agreeFlush, globalSync: agreeSync, blocklistSync: agreeSync,
		regionDSN: func(r int, dsn string) string {
			if r != 1 {
				return dsn
			}
			at, end := strings.Index(dsn, "tcp("), strings.Index(dsn, ")/")
			if proxy == nil {
				proxy = redistest.StartDelayProxy(t, dsn[at+len("tcp("):end], 0)
				proxy.SetLatency(oneWay)
			}
			return fmt.Sprintf("%stcp(%s%s", dsn[:at], proxy.Addr(), dsn[end:])
		}})
	readyForLoad(t, c)
	sent := proxy.Sent()
	b.run(t, c)
	sent = proxy.Sent() - sent
	loadFor := time.Duration(b.keys) * b.period
	s := b.replay(t, c, func(cfg *sim.Config) {
		cfg.CrossRTT = 2*oneWay + time.Millisecond
		cfg.Measure = simmodel.Span{From: sim.HarnessStart.Milliseconds(), To: (sim.HarnessStart + loadFor).Milliseconds()}
	})
	realStmts := float64(sent) / loadFor.Seconds()
	simStmts := s.res.PerSecond(s.res.Regions[1].MySQL.Statements)
	t.Logf("the distant region's statements a second over the load: real %.1f (the wire's requests) · simulated %.1f", realStmts, simStmts)
	// The slack, from seventeen runs on a 2-core machine beside other
	// work (2026-11-29; seven replayed on seed 1 alone, the figures below
	// from the ten on eight seeds): 5.6–5.8 statements a second real against
	// 5.6–5.7; the median key 1.32–1.38 against 1.350–1.363, the worst
	// 1.43–1.50 against 1.459–1.481; the near region beside the distant
	// one's bursts admitted 27.6–35.6 units a key against 29.9–31.2 (at
	// most 5.1 apart), the distant one 34.0–41.8 against 37.7–39.0
	// (3.7). The travel to the near region: real 453–857 ms at p50,
	// simulated 763–801 (−94 to +347 ms apart). To the distant one the
	// simulator is late: real 418–1,050 ms, simulated 909–1,068, up to
	// 525 ms later, 250 ms or more in seven runs of ten. The likely cause,
	// not proven: the model runs a tick's statements at the tick's start
	// and reads the primary as of then, where a distant holder's pull
	// reaches the primary after the tick's round trips before it (a
	// denial row's write, the counts' publish: 150–300 ms here) and sees
	// what was written meanwhile. The real distant region's view took
	// each burst's count in one step (one dumped run: five of five); a
	// simulated holder reading earlier would more often take it part-way,
	// which stops the trickle as early (the units admitted agree) but
	// leaves the rest for its next tick. Not fixed: a tick would have to
	// pause at each read while the other nodes' ticks run. A first try
	// (each read waits for its time, a node's other loops wait for the
	// paused one) gave 802–906 ms in five runs against real 522–1,050,
	// the trickles as before, but moved a 10 × 10 burst table's p99 from
	// 4.16 s to 4.65 s, which the waiting loops may have made. So:
	// statements ± 15 %, the median key ± 0.06, the worst ± 0.10, the
	// trickles ± 0.10 and ± 0.08 of the limit, the travel (a median of
	// five bursts, each at its own phase of the loops) ± 700 ms to the
	// near region and ± 800 ms to the distant one.
	if d := math.Abs(simStmts-realStmts) / realStmts; d > 0.15 {
		t.Errorf("the distant region's statements a second: simulated %.1f, real %.1f (± 15 %%)", simStmts, realStmts)
	}
	b.compare(t, s, 0.06, 0.10, [2]float64{0.10, 0.08}, [2]time.Duration{700 * time.Millisecond, 800 * time.Millisecond})
}
