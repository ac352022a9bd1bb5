package engine

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

func TestDecideMany_DenialChargesNoOtherLimit(t *testing.T) {
	e, _ := newTestEngine(t, Config{})
	ls := []Limit{
		{Key: Key{"per_key", "a", time.Minute}, Limit: 100, Cost: 1},
		{Key: Key{"per_ip", "1.2.3.4", time.Minute}, Limit: 2, Cost: 1},
	}
	out := make([]Decision, 2)
	for i := 0; i < 2; i++ {
		if !e.DecideMany(bg, ls, out) {
			t.Fatalf("request %d denied: %+v", i, out)
		}
	}
	for i := 0; i < 5; i++ {
		if e.DecideMany(bg, ls, out) {
			t.Fatal("third request passed a limit of 2")
		}
		if !out[0].Allowed || out[1].Allowed {
			t.Fatalf("verdicts = %+v, want per_key allowing and per_ip denying", out)
		}
		if out[0].Remaining != 98 {
			t.Fatalf("per_key remaining = %d after denials, want 98 (denials charge nothing)", out[0].Remaining)
		}
	}
	ks, _ := e.Inspect(ls[0].Key)
	if ks.Cells[0].Regional != 2 || ks.Cells[0].Speculative != 0 {
		t.Fatalf("per_key cell = %+v, want 2 committed and nothing speculative", ks.Cells[0])
	}
}

func TestDecideMany_ConcurrentBatchesNeverExceedAnyLimit(t *testing.T) {
	e, _ := newTestEngine(t, Config{})
	a := Limit{Key: Key{"a", "x", time.Hour}, Limit: 500, Cost: 1}
	b := Limit{Key: Key{"b", "x", time.Hour}, Limit: 300, Cost: 2}
	var both atomic.Int64
	var wg sync.WaitGroup
	for g := 0; g < 64; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			out := make([]Decision, 2)
			for i := 0; i < 50; i++ {
				if g%2 == 0 {
					if e.DecideMany(bg, []Limit{a, b}, out) {
						both.Add(1)
					}
				} else {
					e.Decide(bg, a)
				}
			}
		}(g)
	}
	wg.Wait()
	ka, _ := e.Inspect(a.Key)
	kb, _ := e.Inspect(b.Key)
	if kb.Cells[0].Regional != 2*both.Load() {
		t.Fatalf("b counted %d, want 2 × %d committed batches", kb.Cells[0].Regional, both.Load())
	}
	if ka.Cells[0].Regional > a.Limit || kb.Cells[0].Regional > b.Limit {
		t.Fatalf("counts a=%d b=%d exceed limits", ka.Cells[0].Regional, kb.Cells[0].Regional)
	}
	if ka.Cells[0].Speculative != 0 || kb.Cells[0].Speculative != 0 {
		t.Fatal("speculative units left after every batch finished")
	}
}

func TestDecideMany_RolledBackUnitsAreNeverReplayed(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	a := Limit{Key: Key{"a", "x", time.Hour}, Limit: 100, Cost: 5}
	b := Limit{Key: Key{"b", "x", time.Hour}, Limit: 1, Cost: 1}
	out := make([]Decision, 2)
	if !e.DecideMany(bg, []Limit{a, b}, out) {
		t.Fatal("first batch denied")
	}
	for i := 0; i < 3; i++ {
		if e.DecideMany(bg, []Limit{a, b}, out) {
			t.Fatal("batch passed a full limit")
		}
	}
	replayBoth(e)
	e.ReplayOnce(bg, Fast)
	seq := clk.UnixMilli() / time.Hour.Milliseconds()
	if got := o.total(a.Key, seq); got != 5 {
		t.Fatalf("origin has %d for a, want only the committed 5", got)
	}
}

func TestDecideMany_HungOriginCostsOneReadTimeoutForAllZones(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const timeout = 30 * time.Millisecond
		e := New(Config{ReadTimeout: timeout, Manual: true})
		o := newMemOrigin()
		gate := make(chan struct{})
		o.gate.Store(&gate)
		e.SetOrigin(o)
		ls := make([]Limit, 4)
		for i := range ls {
			ls[i] = lim(string(rune('a'+i)), time.Minute, 10, 1)
			ls[i].Namespace = ls[i].Identifier
		}
		start := time.Now()
		if !e.DecideMany(bg, ls, make([]Decision, len(ls))) {
			t.Fatal("denied locally below every limit")
		}
		if took := time.Since(start); took != timeout {
			t.Fatalf("a 4-zone decision on a hung origin took %v, want one read timeout (%v)", took, timeout)
		}
		close(gate)
		_ = e.Close(context.Background())
	})
}

func TestDecideMany_RollbackRacingAMergeLeavesNoUnits(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	a, b := lim("a", time.Minute, 10, 3), lim("b", time.Minute, 1, 2)
	e.Decide(bg, lim("a", time.Minute, 10, 0)) // read both
	e.Decide(bg, lim("b", time.Minute, 10, 0))
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	// A merge lands between the two steps of a's rollback (b denies).
	testHookRollback = func(c *cell) { c.mergeOrigin(o.total(a.Key, seq)) }
	defer func() { testHookRollback = nil }()
	if e.DecideMany(bg, []Limit{a, b}, make([]Decision, 2)) {
		t.Fatal("b should deny")
	}
	ks, _ := e.Inspect(a.Key)
	if got := ks.Cells[0].Regional; got != 0 {
		t.Fatalf("a counts %d after a rolled-back batch, want 0", got)
	}
}

// TestDecideMany_BurstOverProcesses is TestBurst_ProcessesMeetAKeyOneAfterAnother
// with a second limit in the directive (a per-key zone beside a zone far
// from its limit): the batch read the origin's count as its check and
// never reserved, so what the processes admitted and had not replayed was
// never weighed. Four Caddy processes on one Redis admitted 123 to 227 of
// a limit of 100 in a burst with two zones, 87 to 101 with one; here,
// with no replay before the burst ends, each process took the limit.
func TestDecideMany_BurstOverProcesses(t *testing.T) {
	for _, c := range []struct {
		n      int
		region int64
		gap    time.Duration
	}{
		{4, 4, time.Microsecond},
		{4, 4, 20 * time.Microsecond},
		{4, 4, 100 * time.Microsecond},
		{2, 2, 20 * time.Microsecond},
	} {
		es, clk, l, admitted := meet(t, c.n, c.region)
		other := lim("everyone", time.Minute, 1_000_000, 1)
		other.Namespace = "other"
		var since time.Duration
		out := make([]Decision, 2)
		for i := range 400 {
			clk.Advance(c.gap)
			if since += c.gap; since >= 10*time.Millisecond {
				since = 0
				for _, e := range es {
					if _, err := e.ReplayOnce(bg, Fast); err != nil {
						t.Fatal(err)
					}
				}
			}
			if es[i%c.n].DecideMany(bg, []Limit{l, other}, out) {
				admitted++
			}
		}
		t.Logf("%d processes (region %d), a request every %v: %d admitted of a limit of 100", c.n, c.region, c.gap, admitted)
		if admitted != 100 {
			t.Errorf("%d processes (region %d), a request every %v: %d admitted at a limit of 100 with a second limit beside it", c.n, c.region, c.gap, admitted)
		}
	}
}

// TestDecideMany_TheLimitNearestItsLimitGoesToTheOriginFirst: two limits
// of a batch both decided at the origin (young keys shared by two
// processes), one of which the origin denies. The one nearest its limit
// goes first, so its denial leaves the other uncharged; when the other
// went first, its units stayed counted at the origin for a request that
// was denied.
func TestDecideMany_TheLimitNearestItsLimitGoesToTheOriginFirst(t *testing.T) {
	es, _, _, _ := meet(t, 2, 2)
	a, b := es[0], es[1]
	tight := lim("tight", time.Minute, 5, 2)
	wide := lim("wide", time.Minute, 20, 3)
	for _, e := range es {
		e.Decide(bg, wide) // both processes meet wide: young and shared
	}
	a.Decide(bg, tight)
	tight.Cost = 3
	b.Decide(bg, tight) // the region holds 5 of tight's 5; a saw 2
	out := make([]Decision, 2)
	if a.DecideMany(bg, []Limit{wide, tight}, out) {
		t.Fatal("the batch passed at 5 + 3 of tight's 5")
	}
	if out[0].ChargedAnyway || out[1].ChargedAnyway {
		t.Fatalf("a limit stayed charged: %+v", out)
	}
	ks, _ := a.Inspect(wide.Key)
	if got := ks.Cells[0].Regional; got != 3 {
		t.Fatalf("wide's count here = %d after the denied batch, want its lone decision's 3", got)
	}
}

// TestDecideMany_UnitsOfACellLetGoBeforeTheCommitReachTheNextOrigin: a
// batch reserves in a cell, a rotation lets the cell go before the batch
// commits, while the engine has no origin (a reload without Redis). The
// rotation remembered only cells with units (the reservation was not one
// yet), and the commit, with no origin to queue for, left its units in
// the cell no entry held: the origin that came back never got them, and
// nothing counted them as lost. Two processes on one origin found it in
// the concurrent accounting property (1 to 4 units of about 300).
func TestDecideMany_UnitsOfACellLetGoBeforeTheCommitReachTheNextOrigin(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	e.SetOrigin(nil) // a reload without Redis: the units wait for the next origin
	a, b := lim("a", time.Second, 10, 2), lim("b", time.Second, 10, 3)
	seq := clk.UnixMilli() / time.Second.Milliseconds()
	testHookCommit = func() {
		testHookCommit = nil
		// Requests of a, three and six windows on: their rotations let
		// the cell the batch reserved in go (without an origin the first
		// keeps it as the previous cell; the second lets it go).
		for range 2 {
			clk.Advance(3 * time.Second)
			if !e.Decide(bg, lim("a", time.Second, 10, 1)).Allowed {
				t.Error("a's request in a new window was denied")
			}
		}
	}
	defer func() { testHookCommit = nil }()
	if !e.DecideMany(bg, []Limit{a, b}, make([]Decision, 2)) {
		t.Fatal("the batch was denied")
	}
	e.SetOrigin(o)
	if err := e.Flush(bg); err != nil {
		t.Fatal(err)
	}
	if got := o.total(a.Key, seq); got != 2 {
		t.Fatalf("the origin holds %d of a's units in the batch's window, want the batch's 2 (lost units: %d)", got, e.Stats().LostUnits)
	}
	if got := o.total(a.Key, seq+6); got != 1 {
		t.Fatalf("the origin holds %d of a's units six windows on, want 1", got)
	}
}

// TestDecideMany_ADenialDoesNotWaitForAnotherLimitsRead: a batch of a key
// held at its limit (read, fresh) and a key this process never met (its
// cell cold, under a limit that reads first) is denied by the first on
// its own counts, which a read only raises. The batch was denied after
// the second key's read, up to the read timeout; now at once, the read
// going on in the background, so the second key's cell is fresh once it
// returns.
func TestDecideMany_ADenialDoesNotWaitForAnotherLimitsRead(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, _, o := withOrigin(t, Config{ReadTimeout: time.Second})
		held := lim("held", time.Minute, 10, 1)
		if n := admittedOf(e, held, 11); n != 10 {
			t.Fatalf("admitted %d, want the limit of 10", n)
		}
		fresh := lim("fresh", time.Minute, 10, 1)
		fresh.Namespace = "other"
		gate := make(chan struct{})
		o.gate.Store(&gate)
		release := sync.OnceFunc(func() { close(gate) })
		defer release()
		reads := o.reads.Load()
		out := make([]Decision, 2)
		start := time.Now()
		ok := e.DecideMany(bg, []Limit{held, fresh}, out)
		if waited := time.Since(start); waited != 0 {
			t.Fatalf("the denial waited %v for the other key's read", waited)
		}
		if ok || out[0].Allowed {
			t.Fatalf("a batch with a key at 10 of 10 passed: %+v", out)
		}
		synctest.Wait()
		if o.reads.Load() != reads+1 {
			t.Fatalf("origin reads %d, want the cold key's read under way", o.reads.Load()-reads)
		}
		release()
		synctest.Wait()
		if ks, _ := e.Inspect(fresh.Key); ks.FreshUntil.IsZero() {
			t.Fatalf("the read did not make the cold key's cell fresh: %+v", ks)
		}
		if ks, _ := e.Inspect(fresh.Key); ks.Cells[0].Regional != 0 || ks.Cells[0].Pending != 0 {
			t.Fatalf("the refused batch charged the other key: %+v", ks)
		}
	})
}
