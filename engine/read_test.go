package engine

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

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
	clk.Advance(time.Duration(e.coldReadRetry()) * time.Millisecond)
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
	// A limit a million times the cost: the first decision does not even
	// wait for the cold read; the replay right after it reads the key.
	s := e.Stats()
	if s.SyncReads != 0 || s.UnreadDecisions != 1 {
		t.Fatalf("synchronous reads = %d, unread decisions = %d, want 0 and the first decision", s.SyncReads, s.UnreadDecisions)
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

// TestTiers_StaleKeyBelowHalfIsRefreshedByItsOwnReplay: a stale key far
// below its limit, under a limit far above one request, passes on its own
// count, and its replay refreshes it; under a smaller limit it reads first
// (TestStale_ANodeThatHasNotMetTheOthersReadsFirstUnderASmallLimit).
func TestTiers_StaleKeyBelowHalfIsRefreshedByItsOwnReplay(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("k", time.Minute, 1<<20, 1)
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

// TestRead_AFailedColdReadRetriesOnceTheOriginAnswers is what the
// reference test found on seed 1795597556737899827: a key first touched
// while the origin was down decided locally for the 250 ms a failed read
// waits before it retries, though the origin answered again meanwhile and
// another process had used the key's limit: admitted 2 of 1 (the bound
// holds again within one flush period of a fault, 210 ms there). A failed
// read now waits a slow tick at most (100 ms), and none once a call of the
// process succeeds. Before the fix: admitted.
func TestRead_AFailedColdReadRetriesOnceTheOriginAnswers(t *testing.T) {
	a, b, clk, o := twoNodes(t)
	l := lim("k", time.Minute, 1, 1)
	o.down.Store(true)
	a.Decide(bg, Limit{Key: l.Key, Limit: 1, Cost: 2}) // denied: its read goes on in the background
	waitFor(t, "a's read to fail", func() bool { return entryOf(t, a, l.Key).cur.Load().freshUntil() != 0 })
	o.down.Store(false)
	clk.Advance(60 * time.Millisecond)
	if !b.Decide(bg, l).Allowed {
		t.Fatal("b denied the key's first unit")
	}
	replayAll(t, a, b)
	clk.Advance(60 * time.Millisecond)
	if a.Decide(bg, l).Allowed {
		t.Fatal("a admitted a unit of a key b used whole, 120 ms after the origin came back")
	}
}

// TestRead_AViewFromAClockAheadIsNotFresh is what the reference test found
// on seed 1795598186842465738: a replay answered while this process's
// clock was an hour ahead made its view of the key fresh until an hour
// later; stepped back, it trusted that view for the hour, and admitted on
// counts another process had long since passed. Before the fix: admitted
// at 18 + 3 of 20.
func TestRead_AViewFromAClockAheadIsNotFresh(t *testing.T) {
	a, b, clk, _ := twoNodes(t)
	l := lim("k", time.Hour, 20, 3)
	start := clk.Now()
	for range 3 {
		a.Decide(bg, l) // a's cold read, then 9 units
	}
	clk.Set(start.Add(time.Hour))
	replayAll(t, a) // answered an hour ahead: fresh until then
	clk.Set(start.Add(10 * time.Millisecond))
	for range 3 {
		b.Decide(bg, l)
	}
	replayAll(t, b) // the origin holds 18
	// At half its limit in its own view, a reads before it decides, unless
	// it takes its view for fresh.
	if a.Decide(bg, l).Allowed {
		t.Fatal("a admitted 3 at a count of 18 of 20: it trusted a view from a clock an hour ahead")
	}
}

// TestUnread_AFarLimitAdmitsItsShareBeforeReading: a key another process
// has taken to its limit of 10,240, new to this one. Its limit is far above
// the cost, so this process decides without reading first, but only up to
// 1/1024 of the limit (10 units): the request after those reads the key
// and is denied. Without the share's bound it would admit on and on.
func TestUnread_AFarLimitAdmitsItsShareBeforeReading(t *testing.T) {
	a, b, _, _ := twoNodes(t)
	const limit = 10240
	if d := a.Decide(bg, lim("k", time.Hour, limit, limit)); !d.Allowed {
		t.Fatalf("a could not take the key to its limit: %+v", d)
	}
	replayAll(t, a)
	admitted := admittedOf(b, lim("k", time.Hour, limit, 1), 50)
	if admitted != limit/unreadShare {
		t.Fatalf("b admitted %d at a key the region holds at its limit, want its unread share %d", admitted, limit/unreadShare)
	}
	if s := b.Stats(); s.UnreadDecisions != limit/unreadShare || s.SyncReads != 1 || s.Reads != 1 {
		t.Fatalf("unread decisions %d, synchronous reads %d, reads %d: want %d, then one read past the share", s.UnreadDecisions, s.SyncReads, s.Reads, limit/unreadShare)
	}
}

// TestUnread_TheFirstReplayReadsTheKey: the unread decisions' units go on
// the fast tick, whose answer brings the region's count as a read would:
// after it, b denies without a read of its own.
func TestUnread_TheFirstReplayReadsTheKey(t *testing.T) {
	a, b, _, _ := twoNodes(t)
	const limit = 10240
	a.Decide(bg, lim("k", time.Hour, limit, limit-5))
	replayAll(t, a)
	for range 3 {
		if d := b.Decide(bg, lim("k", time.Hour, limit, 1)); !d.Allowed {
			t.Fatalf("b denied an unread request 5 units under the limit: %+v", d)
		}
	}
	if n, err := b.ReplayOnce(bg, Fast); err != nil || n != 1 {
		t.Fatalf("fast replay: %d cells, %v; want the key's first units", n, err)
	}
	got := 0
	for range 5 {
		if b.Decide(bg, lim("k", time.Hour, limit, 1)).Allowed {
			got++
		}
	}
	if s := b.Stats(); got != 2 || s.Reads != 0 {
		t.Fatalf("after the replay b admitted %d with %d reads, want the 2 left and no read", got, s.Reads)
	}
}

// TestUnread_WhatStillReadsFirst: a cold key reads before its first
// decision when one request matters: a limit under 1024 times the cost, a
// cost of 0 (nothing to replay), and a key in strict mode.
func TestUnread_WhatStillReadsFirst(t *testing.T) {
	cases := []struct {
		name string
		l    Limit
		prep func(e *Engine, l Limit)
	}{
		{"limit 1023 × the cost", lim("k", time.Hour, 1023, 1), nil},
		{"limit 10,240, cost 11", lim("k", time.Hour, 10240, 11), nil},
		{"cost 0", lim("k", time.Hour, 1<<40, 0), nil},
		{"strict mode", lim("k", time.Hour, 1<<40, 1), func(e *Engine, l Limit) {
			e.markStrict(e.Zone(l.Namespace, l.Window), l.Identifier, epoch+time.Hour.Milliseconds(), epoch)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e, _, o := withOrigin(t, Config{})
			if tc.prep != nil {
				tc.prep(e, tc.l)
			}
			e.Decide(bg, tc.l)
			if s := e.Stats(); s.SyncReads != 1 || s.UnreadDecisions != 0 || o.reads.Load() != 1 {
				t.Fatalf("synchronous reads %d, unread decisions %d, origin reads %d: want the cold read first", s.SyncReads, s.UnreadDecisions, o.reads.Load())
			}
		})
	}
}

// TestRead_APreviousCellTheOriginReplacesIsRemembered: a key that rotated
// over a gap while the engine had no origin keeps its old cell as the
// previous one, holding the units admitted then. Once an origin is back,
// a read that brings the previous window's total replaces that cell with
// one of the window just before: the old cell was let go unburied, and
// what no queue had taken of it (the queues full) was neither written nor
// counted as lost.
func TestRead_APreviousCellTheOriginReplacesIsRemembered(t *testing.T) {
	e, clk, o := oneCellQueuesEngine(t)
	k := lim("k", time.Second, 10, 1)
	first := clk.UnixMilli() / 1000
	e.SetOrigin(nil) // a reload without Redis: units wait for the next
	e.Decide(bg, k)
	clk.Advance(3 * time.Second) // over a gap: the old cell stays as the previous one
	e.Decide(bg, k)
	if p := entryOf(t, e, k.Key).prev.Load(); p == nil || p.seq() != first {
		t.Fatalf("the entry's previous cell is %v, want the one of window %d", p, first)
	}
	now := clk.UnixMilli() / 1000
	o.add(k.Key, now-1, 4) // other nodes counted the window just before
	e.SetOrigin(o)         // both unsent cells for one slot of the slow queue
	e.Decide(bg, k)        // reads the origin: the previous window's 4
	if p := entryOf(t, e, k.Key).prev.Load(); p == nil || p.seq() != now-1 {
		t.Fatalf("the read left the previous cell at %v, want one of window %d", p, now-1)
	}
	if err := e.Close(bg); err != nil {
		t.Fatal(err)
	}
	if sent, lost := o.total(k.Key, first), e.Stats().LostUnits; sent+lost != 1 {
		t.Fatalf("of the old cell's unit, %d reached the origin and %d were counted as lost", sent, lost)
	}
}

// TestRead_ADenialOfAColdCellDoesNotWaitForItsRead: a key this process
// held at its limit while the origin failed (its cell never read) starts
// a new window, whose cell is cold. Its previous cell's weight alone
// denies the first request there, which counts only grow from: the read
// could not have turned it into an allow. The request is denied at once,
// while the read hangs, and the read still goes on, so the cell is fresh
// once it returns. Before the fix the denial waited the read timeout.
func TestRead_ADenialOfAColdCellDoesNotWaitForItsRead(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, clk, o := withOrigin(t, Config{ReadTimeout: time.Second})
		l := lim("k", time.Minute, 10, 1)
		o.failReads(errOriginDown)
		if n := admittedOf(e, l, 11); n != 10 {
			t.Fatalf("admitted %d with the origin failing, want the limit of 10", n)
		}
		o.failReads(nil)
		clk.Advance(time.Minute) // the next window: its cell is cold
		gate := make(chan struct{})
		o.gate.Store(&gate)
		release := sync.OnceFunc(func() { close(gate) })
		defer release()
		reads := o.reads.Load()
		start := time.Now()
		d := e.Decide(bg, l)
		if waited := time.Since(start); waited != 0 {
			t.Fatalf("the denial waited %v for the read", waited)
		}
		if d.Allowed {
			t.Fatalf("allowed at a previous window of 10 of 10: %+v", d)
		}
		synctest.Wait()
		if o.reads.Load() != reads+1 || o.entered.Load() != reads+1 {
			t.Fatalf("origin reads %d, want the cold cell's read under way", o.reads.Load()-reads)
		}
		release()
		synctest.Wait()
		if ks, _ := e.Inspect(l.Key); ks.FreshUntil.IsZero() {
			t.Fatalf("the read did not make the cell fresh: %+v", ks)
		}
	})
}

// refusedErr is an origin's refusal of a call it never sent (an open
// breaker).
type refusedErr struct{}

func (refusedErr) Error() string { return "circuit breaker open" }
func (refusedErr) Refused() bool { return true }

// TestRead_ARefusedReadIsNoRead: an audit saw sync_reads_total rise by 200
// over 100 requests of two zones while the breaker was open, and
// cell_reads_total{outcome="error"} by 301 against 17 failed calls: a read
// the origin refused without sending it counted as a decision that waited
// for Redis and as a failed read, exactly when nothing waited. A refused
// read now counts as neither; a read sent that failed counts as both, as
// before.
func TestRead_ARefusedReadIsNoRead(t *testing.T) {
	e, _, o := withOrigin(t, Config{})
	o.failReads(fmt.Errorf("redis://r:6379: %w", refusedErr{}))
	for i := range 100 {
		if !e.Decide(bg, lim(fmt.Sprintf("refused-%d", i), time.Minute, 10, 1)).Allowed {
			t.Fatal("denied while reads are refused")
		}
	}
	if st := e.Stats(); st.SyncReads != 0 || st.ReadErrors != 0 {
		t.Fatalf("100 cold keys with every read refused unsent: %d sync reads, %d read errors; want 0 and 0", st.SyncReads, st.ReadErrors)
	}
	o.failReads(errors.New("connection reset by peer"))
	for i := range 10 {
		e.Decide(bg, lim(fmt.Sprintf("failed-%d", i), time.Minute, 10, 1))
	}
	if st := e.Stats(); st.SyncReads != 10 || st.ReadErrors != 10 {
		t.Fatalf("10 cold keys whose reads were sent and failed: %d sync reads, %d read errors; want 10 and 10", st.SyncReads, st.ReadErrors)
	}
}
