package engine

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// manual is a config whose background loops never tick on their own: the
// tests drive replay with ReplayOnce and the janitor with Sweep.
func manual(c Config) Config {
	c.Manual = true
	if c.ReadTimeout == 0 {
		c.ReadTimeout = 5 * time.Second
	}
	return c
}

func withOrigin(t *testing.T, cfg Config) (*Engine, *testclock.Clock, *memOrigin) {
	t.Helper()
	e, clk := newTestEngine(t, manual(cfg))
	o := newMemOrigin()
	e.SetOrigin(o)
	return e, clk, o
}

// replayBoth runs one iteration of both replay ticks, fast first.
func replayBoth(e *Engine) (int, error) {
	n, err := e.ReplayOnce(bg, Fast)
	m, err2 := e.ReplayOnce(bg, Slow)
	if err == nil {
		err = err2
	}
	return n + m, err
}

// waitFor polls cond until it holds or a generous deadline passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestHydration_ColdKeyReadsOnceUnderConcurrentFirstRequests(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("cold", time.Minute, 20, 1)
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	o.add(l.Key, seq, 13) // other nodes used 13 of 20
	gate := make(chan struct{})
	o.gate.Store(&gate)

	var admitted atomic.Int64
	var wg sync.WaitGroup
	for g := 0; g < 64; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if e.Decide(bg, l).Allowed {
				admitted.Add(1)
			}
		}()
	}
	waitFor(t, "63 requests to join the first one's read", func() bool {
		return e.Stats().SharedReads == 63
	})
	close(gate)
	wg.Wait()
	if n := o.reads.Load(); n != 1 {
		t.Fatalf("origin reads = %d, want 1 for 64 concurrent first requests", n)
	}
	if admitted.Load() != 7 {
		t.Fatalf("admitted %d, want the 7 the origin's count leaves", admitted.Load())
	}
}

func TestHydration_FailedHydrationIsRetried(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("k", time.Minute, 10, 1)
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	o.add(l.Key, seq, 9)
	o.failReads(errOriginDown)
	if d := e.Decide(bg, l); !d.Allowed {
		t.Fatalf("an origin failure denied the request: %+v", d)
	}
	if d := e.Decide(bg, l); !d.Allowed || o.reads.Load() != 1 {
		t.Fatalf("a read was retried before the back-off (reads=%d)", o.reads.Load())
	}
	o.failReads(nil)
	clk.Advance(coldReadRetry)
	if d := e.Decide(bg, l); d.Allowed {
		t.Fatalf("after the retry the origin's 9 + local 2 should deny: %+v", d)
	}
	if o.reads.Load() != 2 {
		t.Fatalf("origin reads = %d, want the retry to be the second", o.reads.Load())
	}
	ks, _ := e.Inspect(l.Key)
	if ks.Cells[0].Regional != 11 {
		t.Fatalf("regional count = %d, want 9 from the origin + 2 local", ks.Cells[0].Regional)
	}
}

func TestTiers_HotKeyBelowHalfMakesNoSynchronousRead(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("hot", time.Hour, 1_000_000, 1)
	for i := 0; i < 5000; i++ {
		e.Decide(bg, l)
		clk.Advance(time.Duration(1) * time.Millisecond) // 5 s in all: freshness lapses several times
		if i%100 == 0 {
			if _, err := replayBoth(e); err != nil {
				t.Fatal(err)
			}
		}
	}
	s := e.Stats()
	if s.SyncReads != 1 {
		t.Fatalf("synchronous reads = %d, want only the cold read", s.SyncReads)
	}
	if got := o.total(l.Key, clk.UnixMilli()/time.Hour.Milliseconds()); got < 4900 {
		t.Fatalf("origin total = %d, replay is not reaching the origin", got)
	}
	if calls := o.reads.Load() + o.flushes.Load(); calls > 5000/100+1 {
		t.Fatalf("%d origin calls for 5000 requests, want at most one per 100", calls)
	}
}

func TestTiers_StaleKeyAtHalfRefreshesSynchronously(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("k", time.Hour, 100, 1)
	for i := 0; i < 60; i++ {
		e.Decide(bg, l)
	}
	before := e.Stats().SyncReads
	e.Decide(bg, l) // fresh: no read
	if e.Stats().SyncReads != before {
		t.Fatal("a fresh key at 60 % read synchronously")
	}
	clk.Advance(DefaultFreshness)
	o.add(l.Key, clk.UnixMilli()/time.Hour.Milliseconds(), 30)
	e.Decide(bg, l)
	if e.Stats().SyncReads != before+1 {
		t.Fatal("a stale key at 60 % did not refresh before deciding")
	}
	ks, _ := e.Inspect(l.Key)
	if ks.Cells[0].Regional < 92 {
		t.Fatalf("regional = %d, the refresh did not merge the other node's 30", ks.Cells[0].Regional)
	}
}

// sharedAt87 brings a key with a limit of 100 an hour to 87 units: one of
// another node, which the cold read shows (so the cell is shared), and 86
// of this engine. The next request, with the other node's expected growth
// (one unit a replay interval, over two), makes 90 %.
func sharedAt87(t *testing.T, e *Engine, clk *testclock.Clock, o *memOrigin) (Limit, int64) {
	t.Helper()
	l := lim("k", time.Hour, 100, 1)
	seq := clk.UnixMilli() / time.Hour.Milliseconds()
	o.add(l.Key, seq, 1)
	for i := 0; i < 86; i++ {
		if !e.Decide(bg, l).Allowed {
			t.Fatal("denied below the limit")
		}
	}
	return l, seq
}

func TestReserve_SharedCellNearItsLimitIsDecidedAtTheOrigin(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l, seq := sharedAt87(t, e, clk, o)
	if n := o.reserves.Load(); n != 0 {
		t.Fatalf("%d reservations below 90 %%", n)
	}
	// Another node took the rest; this node's view is fresh and does not
	// show it.
	o.add(l.Key, seq, 13)
	d := e.Decide(bg, l)
	if d.Allowed {
		t.Fatalf("allowed at the limit without asking the origin: %+v", d)
	}
	if o.reserves.Load() != 1 {
		t.Fatalf("reservations = %d, want 1", o.reserves.Load())
	}
	if d.RetryAfter <= 0 {
		t.Fatalf("an origin denial has no Retry-After: %+v", d)
	}
	// The origin has every unit this process admitted: they rode with the
	// reservation.
	if got := o.total(l.Key, seq); got != 100 {
		t.Fatalf("origin total = %d, want 100", got)
	}
}

func TestReserve_LoneProcessNearItsLimitMakesNoRoundTrip(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("k", time.Hour, 100, 1)
	for i := 0; i < 100; i++ {
		if !e.Decide(bg, l).Allowed {
			t.Fatalf("request %d denied below the limit", i)
		}
		clk.Advance(time.Duration(20) * time.Millisecond) // slower than a fast tick: every view is "old"
		if i%10 == 0 {
			for _, tier := range []Tier{Slow, Fast} {
				if _, err := e.ReplayOnce(bg, tier); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	if e.Decide(bg, l).Allowed {
		t.Fatal("allowed past the limit")
	}
	if n := o.reserves.Load(); n != 0 {
		t.Fatalf("a lone process made %d reservations", n)
	}
	if n := o.reads.Load(); n != 1 {
		t.Fatalf("a lone process made %d reads, want the cold one", n)
	}
}

func TestStrict_DenialMakesNoOriginCallAndRolloverReserves(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("k", time.Minute, 10, 1)
	o.add(l.Key, clk.UnixMilli()/60_000, 1) // shared from the first read
	for i := 0; i < 9; i++ {
		if !e.Decide(bg, l).Allowed {
			t.Fatal("denied below the limit")
		}
	}
	clk.Set(time.UnixMilli(epoch + 50_000))
	reads, reserves := o.reads.Load(), o.reserves.Load()
	for i := 0; i < 100; i++ {
		if e.Decide(bg, l).Allowed {
			t.Fatal("allowed over the limit")
		}
	}
	if o.reads.Load() != reads || o.reserves.Load() != reserves || o.flushes.Load() != 0 {
		t.Fatalf("denials called the origin: reads %d→%d, reserves %d→%d, flushes %d",
			reads, o.reads.Load(), reserves, o.reserves.Load(), o.flushes.Load())
	}
	ks, _ := e.Inspect(l.Key)
	wantUntil := time.UnixMilli(epoch + 110_000)
	if !ks.StrictUntil.Equal(wantUntil) {
		t.Fatalf("strict until %v, want one window after the last denial, %v", ks.StrictUntil, wantUntil)
	}
	// Next window, three quarters in: the previous cell weighs ⌊2.5⌋, so a
	// request would pass locally; strict mode sends it to the origin.
	clk.Set(time.UnixMilli(epoch + 60_000 + 45_000))
	if _, err := e.ReplayOnce(bg, Fast); err != nil {
		t.Fatal(err)
	}
	if _, err := replayBoth(e); err != nil {
		t.Fatal(err)
	}
	// A look at the key (cost 0) reads the stale shared cell; another
	// node's traffic reaches the origin after that read.
	peek := l
	peek.Cost = 0
	e.Decide(bg, peek)
	o.add(l.Key, clk.UnixMilli()/60_000, 8)
	reserves = o.reserves.Load()
	if d := e.Decide(bg, l); d.Allowed {
		t.Fatalf("strict mode did not ask the origin: %+v", d)
	}
	if o.reserves.Load() != reserves+1 {
		t.Fatalf("reservations = %d, want one", o.reserves.Load()-reserves)
	}
}

func TestOrigin_HungReadCostsAtMostTheReadTimeout(t *testing.T) {
	const timeout = 30 * time.Millisecond
	e, _ := newTestEngine(t, Config{ReadTimeout: timeout, SlowTick: time.Hour, FastTick: time.Hour})
	o := newMemOrigin()
	gate := make(chan struct{})
	o.gate.Store(&gate)
	defer close(gate)
	e.SetOrigin(o)
	start := time.Now()
	d := e.Decide(bg, lim("k", time.Minute, 10, 1))
	elapsed := time.Since(start)
	if !d.Allowed {
		t.Fatal("a hung origin denied the request")
	}
	if elapsed < timeout || elapsed > timeout+500*time.Millisecond {
		t.Fatalf("decision took %v with a hung origin, want about the read timeout %v", elapsed, timeout)
	}
	if e.Stats().ReadWaitTimeouts != 1 {
		t.Fatal("the timeout was not counted")
	}
}

func TestReplay_MergesOtherNodesAndNeverDoubles(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("k", time.Hour, 1000, 1)
	seq := clk.UnixMilli() / time.Hour.Milliseconds()
	for i := 0; i < 5; i++ {
		e.Decide(bg, l)
	}
	o.add(l.Key, seq, 100)
	if n, err := replayBoth(e); err != nil || n != 1 {
		t.Fatalf("ReplayOnce = %d, %v", n, err)
	}
	if got := o.total(l.Key, seq); got != 105 {
		t.Fatalf("origin total = %d, want 105", got)
	}
	ks, _ := e.Inspect(l.Key)
	if ks.Cells[0].Regional != 105 || ks.Cells[0].Pending != 0 {
		t.Fatalf("cell = %+v, want regional 105 and nothing pending", ks.Cells[0])
	}
	// A second replay with nothing new sends nothing.
	if n, _ := replayBoth(e); n != 0 {
		t.Fatalf("replayed %d cells with nothing pending", n)
	}
}

func TestReplay_FailedFlushKeepsUnitsForLater(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("k", time.Hour, 1000, 1)
	seq := clk.UnixMilli() / time.Hour.Milliseconds()
	for i := 0; i < 7; i++ {
		e.Decide(bg, l)
	}
	o.failFlushes(errOriginDown)
	if _, err := replayBoth(e); err == nil {
		t.Fatal("a failed flush reported no error")
	}
	o.failFlushes(nil)
	e.Decide(bg, l)
	if _, err := replayBoth(e); err != nil {
		t.Fatal(err)
	}
	if got := o.total(l.Key, seq); got != 8 {
		t.Fatalf("origin total = %d, want all 8 units exactly once", got)
	}
	en, _ := e.Zone("zone", time.Hour).entries.Load("k")
	if own := en.cur.Load().links().own.Load(); own != 8 {
		t.Fatalf("own contribution = %d, want 8", own)
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

func TestClose_FlushesPendingUnits(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{}))
	o := newMemOrigin()
	e.SetOrigin(o)
	l := lim("k", time.Hour, 1000, 1)
	for i := 0; i < 42; i++ {
		e.Decide(bg, l)
	}
	ctx, cancel := context.WithTimeout(bg, 5*time.Second)
	defer cancel()
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if got := o.total(l.Key, clk.UnixMilli()/time.Hour.Milliseconds()); got != 42 {
		t.Fatalf("origin total after Close = %d, want 42", got)
	}
}

func TestTiers_StaleKeyBelowHalfIsRefreshedByItsOwnReplay(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("k", time.Minute, 1000, 1)
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	e.Decide(bg, l) // cold: one read
	clk.Advance(2 * time.Second)
	o.add(l.Key, seq, 100)   // other nodes, this window
	o.add(l.Key, seq-1, 300) // and the last
	reads := o.reads.Load()
	if !e.Decide(bg, l).Allowed {
		t.Fatal("denied far below the limit")
	}
	if o.reads.Load() != reads {
		t.Fatal("a stale key below half its limit read the origin although its request charges units")
	}
	if _, err := replayBoth(e); err != nil {
		t.Fatal(err)
	}
	ks, _ := e.Inspect(l.Key)
	if ks.Cells[0].Regional != 102 || len(ks.Cells) != 2 || ks.Cells[1].Regional != 300 || ks.FreshUntil.IsZero() {
		t.Fatalf("after the replay: %+v; want both cells refreshed (102 and 300) and fresh", ks)
	}
	// A request that charges nothing replays nothing: it refreshes in the
	// background instead.
	clk.Advance(2 * time.Second)
	l.Cost = 0
	e.Decide(bg, l)
	waitFor(t, "a background read", func() bool { return o.reads.Load() == reads+1 })
}

// TestReserve_RequestsThatArriveMeanwhileShareTheNextRoundTrip: while one
// reservation of a cell is in flight, the requests that arrive form the
// next one, and a single round trip decides them all, admitting exactly
// what the region's count leaves.
func TestReserve_RequestsThatArriveMeanwhileShareTheNextRoundTrip(t *testing.T) {
	// The other node takes 5 more: the region holds 92, and 8 are left.
	joinedReservation(t, 5, 8, 2)
}

// TestReserve_NoRoomLeftDeniesTheNextGroupWithoutARoundTrip: when the
// reservation in flight brings back a full count, the requests that joined
// behind it are denied without another round trip.
func TestReserve_NoRoomLeftDeniesTheNextGroupWithoutARoundTrip(t *testing.T) {
	// The other node takes 12 more: the region holds 99, and 1 is left,
	// which the leader takes.
	joinedReservation(t, 12, 1, 1)
}

// joinedReservation runs a leader's reservation, hung until 20 requests
// have joined behind it, on a cell where another node adds foreign units
// near the limit of 100; it checks what was admitted and how many round
// trips it took.
func joinedReservation(t *testing.T, foreign, wantAdmitted, wantTrips int64) {
	synctest.Test(t, func(t *testing.T) {
		e, clk, o := withOrigin(t, Config{ReadTimeout: time.Second})
		l, seq := sharedAt87(t, e, clk, o)
		o.add(l.Key, seq, foreign)
		gate := make(chan struct{})
		o.gate.Store(&gate)
		const joiners = 20
		var admitted atomic.Int64
		var wg sync.WaitGroup
		decide := func() {
			defer wg.Done()
			if e.Decide(bg, l).Allowed {
				admitted.Add(1)
			}
		}
		wg.Add(1)
		go decide() // the leader: its reservation hangs at the gate
		synctest.Wait()
		if n := o.reserves.Load(); n != 1 {
			t.Fatalf("%d reservations in flight, want the leader's", n)
		}
		wg.Add(joiners)
		for range joiners {
			go decide()
		}
		synctest.Wait()
		if n := e.Stats().ReservationWaits; n != joiners {
			t.Fatalf("%d requests joined, want %d", n, joiners)
		}
		close(gate)
		wg.Wait()
		st := e.Stats()
		if n := o.reserves.Load(); n != wantTrips {
			t.Fatalf("%d reservations for 1 + %d requests, want %d round trips", n, joiners, wantTrips)
		}
		if got := admitted.Load(); got != wantAdmitted || st.ReservationsAdmitted != wantAdmitted {
			t.Fatalf("admitted %d (stats %+v), want the %d the region had left", got, st, wantAdmitted)
		}
		if got := o.total(l.Key, seq); got != 100 {
			t.Fatalf("origin total = %d, want 100", got)
		}
		if e.Decide(bg, l).Allowed {
			t.Fatal("allowed past the limit")
		}
	})
}

// TestReserve_ConcurrentRequestsAtTheLimitAdmitExactlyWhatIsLeft: many
// goroutines deciding a shared key in its last tenth, with reservations
// that take a while, admit exactly what the region has left, in fewer
// round trips than requests (the race detector checks the groups).
func TestReserve_ConcurrentRequestsAtTheLimitAdmitExactlyWhatIsLeft(t *testing.T) {
	e, clk, o := withOrigin(t, Config{ReadTimeout: 5 * time.Second})
	l := lim("k", time.Hour, 100, 1)
	seq := clk.UnixMilli() / time.Hour.Milliseconds()
	o.add(l.Key, seq, 80) // other nodes hold 80: the cold read makes the key shared
	for i := 0; i < 10; i++ {
		if !e.Decide(bg, l).Allowed {
			t.Fatal("denied below the limit")
		}
	}
	o.reserveDelay.Store(int64(200 * time.Microsecond))
	var admitted atomic.Int64
	var wg sync.WaitGroup
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 20 {
				if e.Decide(bg, l).Allowed {
					admitted.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	st := e.Stats()
	if got := admitted.Load(); got != 10 {
		t.Fatalf("admitted %d of 320 with 10 left (stats %+v)", got, st)
	}
	if got := o.total(l.Key, seq); got != 100 {
		t.Fatalf("origin total = %d, want 100", got)
	}
	if st.ReservationErrors != 0 || st.Reservations >= st.ReservationsAdmitted+st.ReservationsDenied {
		t.Fatalf("%d round trips decided %d requests (errors %d): no request shared one", st.Reservations,
			st.ReservationsAdmitted+st.ReservationsDenied, st.ReservationErrors)
	}
}

// TestOrigin_ImportedCountsArriveWithTheOriginsAnswers: what other regions
// counted, left at the origin by the region's cross-region role, reaches a
// cell with a read and with a replay's answer, and only ever rises.
func TestOrigin_ImportedCountsArriveWithTheOriginsAnswers(t *testing.T) {
	e, _, o := withOrigin(t, Config{})
	o.setGlobal(func(id cellID) (int64, bool) { return map[int64]int64{0: 30, -1: 8}[id.seq-epoch/60_000], true })
	l := lim("k", time.Minute, 100, 1)
	// At the window's start the previous cell's 8 weigh in full.
	if d := e.Decide(bg, l); !d.Allowed || d.Remaining != 100-30-8-1 {
		t.Fatalf("first decision %+v: the cold read must bring the 30 and 8 imported", d)
	}
	ks, _ := e.Inspect(l.Key)
	if ks.Cells[0].Global != 30 {
		t.Fatalf("cells %+v, want 30 imported", ks.Cells)
	}
	o.setGlobal(func(cellID) (int64, bool) { return 45, true })
	if _, err := replayBoth(e); err != nil {
		t.Fatal(err)
	}
	if ks, _ = e.Inspect(l.Key); ks.Cells[0].Global != 45 {
		t.Fatalf("after a replay %+v, want 45 imported", ks.Cells)
	}
	o.setGlobal(func(cellID) (int64, bool) { return 10, true })
	e.Decide(bg, lim("k", time.Minute, 100, 1))
	replayBoth(e)
	if ks, _ = e.Inspect(l.Key); ks.Cells[0].Global != 45 {
		t.Fatalf("an import fell: %+v", ks.Cells)
	}
}
