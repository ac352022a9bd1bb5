package engine

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestDecide_WindowBorders(t *testing.T) {
	const w = time.Minute
	cases := []struct {
		name     string
		at       int64 // ms into the second window
		limit    int64
		prev     int64 // requests admitted in the first window
		cost     int64
		wantPass int64 // requests of cost admitted in the second window
	}{
		{"start: previous weighs fully", 0, 10, 10, 1, 0},
		{"middle: previous weighs half", 30_000, 10, 10, 1, 5},
		{"last millisecond: previous weighs ⌊10/60000⌋ = 0", 59_999, 10, 10, 1, 10},
		{"previous weighs ⌊10 × 6001/60000⌋ = 1", 53_999, 10, 10, 1, 9},
		{"cost 2 in the middle", 30_000, 10, 4, 2, 4},
		{"empty previous window", 30_000, 10, 0, 3, 3},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e, clk := newTestEngine(t, Config{})
			for i := int64(0); i < tc.prev; i++ {
				if d := e.Decide(bg, lim("k", w, tc.limit, 1)); !d.Allowed {
					t.Fatalf("first window request %d denied", i)
				}
			}
			clk.Set(time.UnixMilli(epoch + w.Milliseconds() + tc.at))
			var passed int64
			for i := 0; i < 100; i++ {
				if e.Decide(bg, lim("k", w, tc.limit, tc.cost)).Allowed {
					passed++
				}
			}
			if passed != tc.wantPass {
				t.Fatalf("admitted %d, want %d", passed, tc.wantPass)
			}
		})
	}
}

func TestDecide_HeadersValues(t *testing.T) {
	e, clk := newTestEngine(t, Config{})
	clk.Set(time.UnixMilli(epoch + 15_000))
	d := e.Decide(bg, lim("k", time.Minute, 5, 2))
	if !d.Allowed || d.Limit != 5 || d.Remaining != 3 || d.Reset != 45*time.Second || d.RetryAfter != 0 {
		t.Fatalf("first decision = %+v", d)
	}
	e.Decide(bg, lim("k", time.Minute, 5, 2))
	d = e.Decide(bg, lim("k", time.Minute, 5, 2))
	if d.Allowed || d.Remaining != 1 || d.RetryAfter != 45*time.Second+time.Millisecond {
		t.Fatalf("denial = %+v, want remaining 1 and retry 1 ms into the next window (⌊4 × 59999/60000⌋ + 2 = 5)", d)
	}
}

func TestDecide_CostAboveLimitCanNeverPass(t *testing.T) {
	e, _ := newTestEngine(t, Config{})
	d := e.Decide(bg, lim("k", time.Minute, 5, 6))
	if d.Allowed || d.RetryAfter != Never || d.Remaining != 5 {
		t.Fatalf("decision = %+v, want denied with RetryAfter Never and nothing charged", d)
	}
	if d := e.Decide(bg, lim("k", time.Minute, 5, 5)); !d.Allowed {
		t.Fatalf("the oversized request charged the key: %+v", d)
	}
}

// TestDecide_RetryAfterIsExact replays a denied request one millisecond
// before its Retry-After (denied) and at it (allowed), and does the same at
// the second granularity a client sees in the header.
func TestDecide_RetryAfterIsExact(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	e, clk := newTestEngine(t, Config{})
	denials := 0
	for i := 0; i < 300; i++ {
		w := time.Duration(1+rng.IntN(120)) * time.Second
		limit := int64(1 + rng.IntN(20))
		clk.Set(time.UnixMilli(epoch + rng.Int64N(w.Milliseconds())))
		id := fmt.Sprint("k", i)
		// Load the key over two windows with random traffic.
		for j := 0; j < 40; j++ {
			e.Decide(bg, lim(id, w, limit, int64(rng.IntN(3))))
			clk.Advance(time.Duration(rng.Int64N(w.Milliseconds()/10+1)) * time.Millisecond)
		}
		cost := int64(1 + rng.IntN(int(limit)))
		d := e.Decide(bg, lim(id, w, limit, cost))
		if d.Allowed {
			continue
		}
		denials++
		if d.RetryAfter <= 0 {
			t.Fatalf("denied with RetryAfter %v", d.RetryAfter)
		}
		// Probe on copies of the key's state: a decision that allows charges.
		probes := 0
		probe := func(after time.Duration) bool {
			probes++
			pid := fmt.Sprint(id, "-probe-", probes)
			copyKey(t, e, Key{Namespace: "zone", Identifier: id, Window: w}, pid)
			now := clk.UnixMilli()
			defer clk.Set(time.UnixMilli(now))
			clk.Advance(after)
			return e.Decide(bg, lim(pid, w, limit, cost)).Allowed
		}
		if probe(d.RetryAfter - time.Millisecond) {
			t.Fatalf("case %d: allowed 1ms before RetryAfter %v", i, d.RetryAfter)
		}
		if !probe(d.RetryAfter) {
			t.Fatalf("case %d: denied at RetryAfter %v", i, d.RetryAfter)
		}
		secs := (d.RetryAfter + time.Second - 1) / time.Second * time.Second
		if probe(secs - time.Second) {
			t.Fatalf("case %d: header Retry-After %v is not the first passing second", i, secs)
		}
		if !probe(secs) {
			t.Fatalf("case %d: denied at header Retry-After %v", i, secs)
		}
	}
	if denials < 50 {
		t.Fatalf("only %d denials replayed", denials)
	}
}

// copyKey copies one key's cells to another identifier in the same engine.
func copyKey(t *testing.T, e *Engine, key Key, id string) {
	t.Helper()
	z := e.Zone(key.Namespace, key.Window)
	en, ok := z.entries.Load(key.Identifier)
	if !ok {
		t.Fatal("key not in engine")
	}
	src := en.cur.Load()
	n, loaded := z.entries.LoadOrCreate(id, src.seq(), 0, false, true)
	if loaded {
		t.Fatalf("key %q already in engine", id)
	}
	n.cur.Load().count.Store(src.count.Load())
	if p := en.previous(src); p != nil {
		pc := newCell(p.seq(), false)
		pc.count.Store(p.count.Load())
		n.prev.Store(pc)
	}
	e.live.Add(1)
}

func TestDecide_ConcurrentNeverExceedsLimit(t *testing.T) {
	e, _ := newTestEngine(t, Config{})
	const limit = 1000
	var admitted atomic.Int64
	var wg sync.WaitGroup
	for g := 0; g < 64; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 100; i++ {
				if e.Decide(bg, lim("hot", time.Hour, limit, 1)).Allowed {
					admitted.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	if admitted.Load() != limit {
		t.Fatalf("admitted %d of 6400 requests, want exactly %d", admitted.Load(), limit)
	}
}

func TestDecide_DryRunChargesAndReportsTheVerdictWithoutSideEffects(t *testing.T) {
	var notified atomic.Int64
	e, _, o := withOrigin(t, Config{OnFirstDenial: func(Denial) { notified.Add(1) }})
	l := lim("k", time.Hour, 3, 1)
	l.DryRun = true
	for i := 0; i < 5; i++ {
		d := e.Decide(bg, l)
		if want := i < 3; d.Allowed != want {
			t.Fatalf("request %d: Allowed = %v, want %v", i, d.Allowed, want)
		}
		if i >= 3 && d.RetryAfter <= 0 {
			t.Fatalf("would-be denial without Retry-After: %+v", d)
		}
	}
	ks, _ := e.Inspect(l.Key)
	if ks.Cells[0].Regional != 5 {
		t.Fatalf("dry run counted %d, want every served request (5)", ks.Cells[0].Regional)
	}
	if notified.Load() != 0 || len(e.StrictKeys()) != 0 || ks.Cells[0].Blocked {
		t.Fatal("a dry-run denial recorded a denial")
	}
	_ = o

	// In a batch a dry-run limit never fails the batch.
	ls := []Limit{l, lim("other", time.Hour, 100, 1)}
	out := make([]Decision, 2)
	if !e.DecideMany(bg, ls, out) {
		t.Fatal("a dry-run limit failed the batch")
	}
	if out[0].Allowed || !out[1].Allowed {
		t.Fatalf("verdicts = %+v, want the dry-run limit to report its would-be denial", out)
	}
	if ks, _ := e.Inspect(l.Key); ks.Cells[0].Regional != 6 {
		t.Fatalf("count = %d after the batch, want 6", ks.Cells[0].Regional)
	}
}

// TestDecide_WarmDecisionsDoNotAllocate pins the hot path at zero
// allocations: allow, deny and a two-limit batch on warm keys. `make test`
// runs it without the race detector, which changes what allocates.
func TestDecide_WarmDecisionsDoNotAllocate(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector changes allocations; make test runs this without it")
	}
	e, _ := newTestEngine(t, Config{})
	allow := lim("allow", time.Hour, 1<<50, 1)
	allow.Zone = e.Zone(allow.Namespace, allow.Window)
	deny := lim("deny", time.Hour, 1, 1)
	deny.Zone = allow.Zone
	batch := []Limit{allow, {Key: Key{"other", "x", time.Minute}, Limit: 1 << 50, Cost: 1}}
	batch[1].Zone = e.Zone("other", time.Minute)
	out := make([]Decision, 2)
	e.Decide(bg, allow)
	e.Decide(bg, deny)
	e.DecideMany(bg, batch, out)
	for name, f := range map[string]func(){
		"allow": func() { e.Decide(bg, allow) },
		"deny":  func() { e.Decide(bg, deny) },
		"batch": func() { e.DecideMany(bg, batch, out) },
	} {
		if n := testing.AllocsPerRun(1000, f); n != 0 {
			t.Errorf("%s: %.1f allocations per decision, want 0", name, n)
		}
	}
}

func TestDecide_HugeCostOverALoweredLimitIsNoFreePass(t *testing.T) {
	e, _ := newTestEngine(t, manual(Config{}))
	l := lim("k", time.Minute, 10, 1)
	for i := 0; i < 10; i++ {
		if !e.Decide(bg, l).Allowed {
			t.Fatal("denied below the limit")
		}
	}
	// A reload lowers the limit below the count; a hostile cost must not
	// wrap the arithmetic into an admission.
	l.Limit = 5
	for _, cost := range []int64{math.MaxInt64, math.MaxInt64 - 4, MaxCount + 1, MaxCount, -1 << 62} {
		l.Cost = cost
		if d := e.Decide(bg, l); d.Allowed {
			t.Fatalf("cost %d admitted over a lowered limit: %+v", cost, d)
		}
	}
	l.Cost = 1
	if d := e.Decide(bg, l); d.Allowed {
		t.Fatalf("a later request passed: %+v", d)
	}
	ks, _ := e.Inspect(l.Key)
	if got := ks.Cells[0].Regional; got != 10 {
		t.Fatalf("count = %d, want 10", got)
	}
}

func TestDecide_CountsSaturateAtMaxCount(t *testing.T) {
	e, _ := newTestEngine(t, manual(Config{}))
	l := lim("k", time.Minute, math.MaxInt64, math.MaxInt64)
	l.DryRun = true
	for i := 0; i < 3; i++ {
		e.Decide(bg, l)
	}
	ks, _ := e.Inspect(l.Key)
	if got := ks.Cells[0].Regional; got != MaxCount {
		t.Fatalf("count = %d, want saturated at %d", got, MaxCount)
	}
	l.DryRun = false
	l.Cost = 1
	if d := e.Decide(bg, l); d.Allowed || d.Limit != MaxCount {
		t.Fatalf("a saturated cell admitted, or the limit was not clamped: %+v", d)
	}
}

// TestDecide_ANamedZoneDecidesAsALookedUpOne: a limit that names its zone
// (as the handler's do) takes Decide's warm path; one that does not goes
// through locate. Two engines on one clock, one of each, must agree on
// every decision through what the warm path must leave to locate: new
// keys, windows that roll over, a clock stepped back and forward, forgotten
// keys and identifiers too long to be kept as they are.
func TestDecide_ANamedZoneDecidesAsALookedUpOne(t *testing.T) {
	named, clk := newTestEngine(t, manual(Config{}))
	looked := New(manual(Config{Now: clk.Now}))
	t.Cleanup(func() { _ = looked.Close(bg) })
	const w = time.Second
	ids := []string{"a", "b", strings.Repeat("x", MaxIdentifierLen+1), strings.Repeat("x", MaxIdentifierLen+2)}
	rng := rand.New(rand.NewPCG(1, 2))
	warm := 0
	for i := range 20000 {
		id := ids[rng.IntN(len(ids))]
		l := lim(id, w, 7, rng.Int64N(3))
		switch rng.IntN(40) {
		case 0:
			clk.Advance(time.Duration(rng.IntN(1500)) * time.Millisecond)
		case 1:
			clk.Advance(-3 * w) // a step back, then time runs on
		case 2:
			k := Key{Namespace: l.Namespace, Identifier: id, Window: w}
			if named.Forget(k) != looked.Forget(k) {
				t.Fatalf("decision %d: the engines disagree on forgetting %q", i, id)
			}
		}
		clk.Advance(time.Duration(rng.IntN(20)) * time.Millisecond)
		nl := l
		nl.Zone = named.Zone(l.Namespace, l.Window)
		if en, ok := nl.Zone.entries.Load(id); ok && en.cur.Load().seq() == clk.UnixMilli()/w.Milliseconds() {
			warm++
		}
		got, want := named.Decide(bg, nl), looked.Decide(bg, l)
		if got != want {
			t.Fatalf("decision %d (%q, cost %d): named zone %+v, looked up %+v", i, id, l.Cost, got, want)
		}
	}
	if warm < 5000 {
		t.Fatalf("only %d of 20000 decisions found their key's cell of now: the warm path was hardly tried", warm)
	}
}

// TestDecide_AnOversizedRequestLeavesTheKeyAsItWas: a request denied for
// its own size (a cost above the limit, or a key under half its limit)
// neither puts the key in strict mode nor uses up its first denial, so
// the key's denial at its limit is still counted, notified and shown.
func TestDecide_AnOversizedRequestLeavesTheKeyAsItWas(t *testing.T) {
	var notified atomic.Int64
	e, _, _ := withOrigin(t, Config{OnFirstDenial: func(Denial) { notified.Add(1) }})
	small := lim("k", time.Hour, 100, 1)
	decideN(e, small, 10)
	for _, cost := range []int64{101, 1 << 40, 95} {
		big := small
		big.Cost = cost
		if e.Decide(bg, big).Allowed {
			t.Fatalf("a cost of %d passed at 10 of 100", cost)
		}
	}
	ks, _ := e.Inspect(small.Key)
	if s := e.Stats(); notified.Load() != 0 || s.FirstDenials != 0 || s.StrictKeys != 0 || ks.Cells[0].Blocked {
		t.Fatalf("oversized requests at 10 of 100: %d notified, %+v, blocked %v; want the key untouched", notified.Load(), s, ks.Cells[0].Blocked)
	}
	if n := admittedOf(e, small, 95); n != 90 {
		t.Fatalf("admitted %d of 95 after the oversized requests, want the 90 left", n)
	}
	ks, _ = e.Inspect(small.Key)
	if s := e.Stats(); notified.Load() != 1 || s.FirstDenials != 1 || s.StrictKeys != 1 || !ks.Cells[0].Blocked {
		t.Fatalf("at the limit: %d notified, %+v, blocked %v; want one first denial and the key in strict mode", notified.Load(), s, ks.Cells[0].Blocked)
	}
}
