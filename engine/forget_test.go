package engine

import (
	"context"
	"errors"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// TestForgetMatching_FindsKeysByTheirHeldIdentifier: a key named as the
// engine holds it (a long identifier's hash) is forgotten by a match on
// that name, where Forget, which normalizes what it is given, cannot.
func TestForgetMatching_FindsKeysByTheirHeldIdentifier(t *testing.T) {
	e := New(Config{Manual: true})
	defer e.Close(context.Background())
	e.Zone("z", time.Minute)
	long := strings.Repeat("k", 100)
	for _, id := range []string{long, "short"} {
		e.Decide(context.Background(), Limit{Key: Key{Namespace: "z", Identifier: id, Window: time.Minute}, Limit: 10, Cost: 1})
	}
	held := NormalizeIdentifier(long)
	if e.Forget(Key{Namespace: "z", Identifier: held, Window: time.Minute}) {
		t.Fatal("Forget found a key by its hash: it would hash the hash")
	}
	if n := e.ForgetMatching("z", time.Minute, func(id string) bool { return id == held }); n != 1 {
		t.Fatalf("ForgetMatching forgot %d keys, want the long one", n)
	}
	if _, ok := e.Inspect(Key{Namespace: "z", Identifier: long, Window: time.Minute}); ok {
		t.Fatal("the long key is still held")
	}
	if _, ok := e.Inspect(Key{Namespace: "z", Identifier: "short", Window: time.Minute}); !ok {
		t.Fatal("the short key went too")
	}
}

// TestForget_SendsUnreplayedUnitsFirst: the origin has a forgotten key's
// units before Forget returns, so the key's next request, which reads the
// origin, counts them.
func TestForget_SendsUnreplayedUnitsFirst(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("k", time.Hour, 5, 1)
	seq := clk.UnixMilli() / time.Hour.Milliseconds()
	decideN(e, l, 4)
	if !e.Forget(l.Key) {
		t.Fatal("Forget found nothing to forget")
	}
	if got := o.total(l.Key, seq); got != 4 {
		t.Fatalf("origin total %d after Forget, want the 4 units not replayed yet", got)
	}
	if e.HasEntry(l.Key) || e.Forget(l.Key) {
		t.Fatal("the key is still held")
	}
	if !e.Decide(bg, l).Allowed || e.Decide(bg, l).Allowed {
		t.Fatal("after Forget the key did not count what the origin holds")
	}
}

// TestForget_WaitsForAWriteInFlight forgets a key while the replay's
// write of its units is on its way to the origin: Forget waits for that
// write before it drops the key, so the key's next read finds its units
// there. Before, Forget skipped a cell in flight, and a read that reached
// the origin before the write admitted those units again.
func TestForget_WaitsForAWriteInFlight(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, _, o := withOrigin(t, Config{})
		l := lim("k", time.Hour, 5, 1)
		decideN(e, l, 4)
		gate := make(chan struct{})
		o.flushGate.Store(&gate)
		go replayBoth(e) // its write waits at the gate
		synctest.Wait()
		o.flushGate.Store(nil)
		forgot := make(chan bool)
		go func() { forgot <- e.Forget(l.Key) }()
		synctest.Wait()
		var found, early bool
		select {
		case found = <-forgot:
			early = true
			t.Error("Forget returned while the key's write was in flight")
		default:
		}
		close(gate)
		if !early {
			found = <-forgot
		}
		if !found {
			t.Fatal("Forget found nothing to forget")
		}
		admitted := admittedOf(e, l, 5)
		if admitted != 1 {
			t.Fatalf("admitted %d after Forget with 4 of 5 units used; want 1", admitted)
		}
	})
}

// TestDropMatching_UnitsHeldBeforeAResetNeverReachTheOrigin: a process
// cut off from Redis holds the units it admits; another process resets
// the key meanwhile, and this one hears of it when Redis is back, before
// its replay resumes. The units it held in the reset's window were
// admitted before the reset: dropped, they never reach the origin, where
// they would count after the reset's marks. Units of a later window than
// the reset's, which no mark covers, are written; ForgetMatching, for a
// process's own forget, writes them all. Before the fix a heard reset
// forgot the key as ForgetMatching does: the origin got the 3 held units
// after the reset (the audit's 20 of 20, and 40 counted for a limit of 20).
func TestDropMatching_UnitsHeldBeforeAResetNeverReachTheOrigin(t *testing.T) {
	for _, c := range []struct {
		name string
		drop bool
		at   int64 // the reset's window, relative to the units'
		want int64
	}{
		{"a reset of their window drops them", true, 0, 1},
		{"a reset of the window before writes them", true, -1, 4},
		{"a forget writes them", false, 0, 4},
	} {
		e, _ := newTestEngine(t, manual(Config{}))
		o := newMemOrigin()
		e.SetOrigin(o)
		l := lim("k", time.Minute, 100, 1)
		e.Decide(bg, l)
		replayAll(t, e)
		cut := errors.New("cut off")
		o.flushErr.Store(&cut)
		for range 3 {
			e.Decide(bg, l)
		}
		for _, tier := range []Tier{Fast, Slow} {
			_, _ = e.ReplayOnce(bg, tier) // fails: the units stay held
		}
		ks, _ := e.Inspect(l.Key)
		seq := ks.Cells[0].Sequence
		match := func(id string) bool { return id == "k" }
		var n int
		if c.drop {
			n = e.DropMatching("zone", time.Minute, match, e.nowMs()+c.at*time.Minute.Milliseconds())
		} else {
			n = e.ForgetMatching("zone", time.Minute, match)
		}
		if n != 1 {
			t.Fatalf("%s: forgot %d keys, want 1", c.name, n)
		}
		o.flushErr.Store(nil)
		replayAll(t, e)
		if got := o.total(l.Key, seq); got != c.want {
			t.Fatalf("%s: the origin holds %d units, want %d", c.name, got, c.want)
		}
	}
}

// TestDropMatching_ACellMadeAfterTheResetKeepsItsUnits: a process that
// began before a reset, cut off from Redis, meets a key after another
// process reset it, and hears of the reset once Redis is back. The units
// of that key's cell, made after the reset, were all admitted after it:
// they reach the origin, and come back to it after a restart empty
// (Resend), while those of a cell made before the reset in the same
// window are dropped, as before. Before, both were dropped: the region
// never counted the 3 units, and admitted the limit again (the root's
// TestReset_ANodeCutOffMeetsAKeyAfterAResetKeepsItsUnits: 4 for a limit
// of 2).
func TestDropMatching_ACellMadeAfterTheResetKeepsItsUnits(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{}))
	o := newMemOrigin()
	e.SetOrigin(o)
	before, after := lim("before", time.Minute, 100, 1), lim("after", time.Minute, 100, 1)
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	cut := errors.New("cut off")
	o.failReads(cut)
	o.failFlushes(cut)
	decideN(e, before, 3)
	clk.Advance(time.Second)
	at := e.nowMs() // the reset, made by another process
	clk.Advance(time.Millisecond)
	if n := admittedOf(e, after, 3); n != 3 {
		t.Fatalf("cut off, admitted %d of 3", n)
	}
	_, _ = replayBoth(e) // fails: the units stay held
	if n := e.DropMatching("zone", time.Minute, func(string) bool { return true }, at); n != 2 {
		t.Fatalf("the reset forgot %d keys, want 2", n)
	}
	o.failReads(nil)
	o.failFlushes(nil)
	replayAll(t, e)
	check := func(when string) {
		t.Helper()
		if got := o.total(before.Key, seq); got != 0 {
			t.Errorf("%s: the origin holds %d units of the cell made before the reset, want 0", when, got)
		}
		if got := o.total(after.Key, seq); got != 3 {
			t.Errorf("%s: the origin holds %d units of the cell made after the reset, want 3", when, got)
		}
	}
	check("once Redis is back")
	o.restart()
	e.Resend()
	replayAll(t, e)
	check("after a restart empty")
}

// TestDropMatching_AResetsCellsAreNotSentAgain: a reset's marks take off
// the units a reset's cells held, written or not; a Redis restarted empty
// then loses the marks, and every process sends its cells' totals again
// (Resend). The cells a reset dropped must not go: their units would
// count again after the reset (the reference test's seed
// 1795794139796885685: a denial at 16 of a limit of 20). Cells of a later
// window, and those a forget drops, still go; so does what the key counts
// after the reset. Before, the dropped cells stayed among the graves with
// their totals, and Resend sent them.
func TestDropMatching_AResetsCellsAreNotSentAgain(t *testing.T) {
	for _, c := range []struct {
		name  string
		drop  bool
		at    int64 // the reset's window, relative to the units'
		after bool  // a unit admitted after the reset
		want  int64
	}{
		{"a reset of their window", true, 0, false, 0},
		{"a reset of their window, a unit after it", true, 0, true, 1},
		{"a reset of the window before", true, -1, false, 3},
		{"a forget", false, 0, false, 3},
	} {
		e, _ := newTestEngine(t, manual(Config{}))
		o := newMemOrigin()
		e.SetOrigin(o)
		l := lim("k", time.Minute, 100, 1)
		e.Decide(bg, l)
		e.Decide(bg, l)
		// An earlier forget of the key on this process: its cell is among
		// the graves, and the reset takes it off too, as it does the live
		// entry's.
		e.Forget(l.Key)
		e.Decide(bg, l)
		replayAll(t, e)
		seq := e.nowMs() / time.Minute.Milliseconds()
		match := func(id string) bool { return id == "k" }
		if c.drop {
			e.DropMatching("zone", time.Minute, match, e.nowMs()+c.at*time.Minute.Milliseconds())
		} else {
			e.ForgetMatching("zone", time.Minute, match)
		}
		if c.after {
			e.Decide(bg, l)
			replayAll(t, e)
		}
		o.restart()
		e.Resend()
		replayAll(t, e)
		if got := o.total(l.Key, seq); got != c.want {
			t.Errorf("%s: the origin holds %d units after Redis restarted empty, want %d", c.name, got, c.want)
		}
	}
}

// TestForget_UnitsAdmittedDuringItsWriteAreReadBack: a forget writes the
// key's unreplayed units before it drops the key; the requests that
// arrive while that write is on its way must count too. Before, the key
// stayed in place during the write: those requests were charged to the
// cell being forgotten, their units went to the replay queue after the
// write, and the key's next read, made at once, found the origin without
// them and admitted them again (2 decided before the forget, 3 during its
// write, then 3 more of a limit of 5: 8 admitted).
func TestForget_UnitsAdmittedDuringItsWriteAreReadBack(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, _, o := withOrigin(t, Config{})
		l := lim("k", time.Hour, 5, 1)
		decideN(e, l, 2)
		gate := make(chan struct{})
		o.flushGate.Store(&gate)
		forgot := make(chan bool)
		go func() { forgot <- e.Forget(l.Key) }()
		synctest.Wait() // its write waits at the gate
		o.flushGate.Store(nil)
		during := make(chan int)
		go func() { during <- admittedOf(e, l, 3) }()
		synctest.Wait()
		close(gate)
		if !<-forgot {
			t.Fatal("Forget found nothing to forget")
		}
		admitted := 2 + <-during
		admitted += admittedOf(e, l, 5)
		if admitted != 5 {
			t.Fatalf("admitted %d for a limit of 5 around a forget", admitted)
		}
	})
}

// TestForget_RequestsWaitingForAReadCountInTheKeysNextEntry: requests wait
// for the read of a key's new entry, and the key is forgotten meanwhile.
// Once the read returns they must be decided in the entry that takes its
// place, which reads the origin again: charged to the cell let go, their
// units reached the origin only with the next replay, after that entry's
// read, and were admitted again (102 admitted for a limit of 100).
func TestForget_RequestsWaitingForAReadCountInTheKeysNextEntry(t *testing.T) {
	forgetWhileTwoWaitForARead(t, func(e *Engine, l Limit, n int) int { return admittedOf(e, l, n) })
}

// forgetWhileTwoWaitForARead runs decide (n decisions of l, returning how
// many were admitted) in two requests that wait for the read of l's new
// entry, forgets the key meanwhile, and then 110 more: 100 admitted in
// all for a limit of 100.
func forgetWhileTwoWaitForARead(t *testing.T, decide func(e *Engine, l Limit, n int) int) {
	synctest.Test(t, func(t *testing.T) {
		e, _, o := withOrigin(t, Config{})
		l := lim("k", time.Hour, 100, 1)
		gate := make(chan struct{})
		o.gate.Store(&gate)
		waiting := make(chan int)
		for range 2 {
			go func() { waiting <- decide(e, l, 1) }()
		}
		synctest.Wait() // both wait for the key's read, held at the gate
		if !e.Forget(l.Key) {
			t.Fatal("Forget found nothing to forget")
		}
		o.gate.Store(nil)
		close(gate)
		admitted := <-waiting + <-waiting
		admitted += decide(e, l, 110)
		if admitted != 100 {
			t.Fatalf("admitted %d for a limit of 100", admitted)
		}
	})
}

// TestForget_BatchesWaitingForAReadCountInTheKeysNextEntry is the test
// above for a directive of two zones: batches wait for the reads of a
// key's new entry, and the key is forgotten meanwhile. A batch charged
// the cell let go, and the key's next entry admitted its units again.
func TestForget_BatchesWaitingForAReadCountInTheKeysNextEntry(t *testing.T) {
	other := lim("everyone", time.Hour, 1_000_000, 1)
	other.Namespace = "other"
	forgetWhileTwoWaitForARead(t, func(e *Engine, l Limit, n int) (admitted int) {
		out := make([]Decision, 2)
		for range n {
			if e.DecideMany(bg, []Limit{l, other}, out) {
				admitted++
			}
		}
		return admitted
	})
}

// TestForget_BatchesWaitingForAReservationCountInTheKeysNextEntry: a
// batch decides one zone at the origin (a young key two processes share)
// and another here, which it charges once the reservation is back. The
// second zone's key is forgotten while the reservation is in flight. The
// batch charged the cell let go, and the key's next entry admitted its
// units again (102 for a limit of 100).
func TestForget_BatchesWaitingForAReservationCountInTheKeysNextEntry(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		clk := testclock.New(time.UnixMilli(epoch))
		shared := newMemOrigin()
		var es []*Engine
		var origins []*memOrigin
		for _, node := range []string{"a", "b"} {
			e, _ := newTestEngine(t, manual(Config{Now: clk.Now}))
			o := shared.peer(node)
			e.SetOrigin(o)
			e.SetProcesses(2)
			es, origins = append(es, e), append(origins, o)
		}
		a := es[0]
		hot := lim("hot", time.Minute, 20, 1)
		for _, e := range es {
			e.Decide(bg, hot) // both processes meet hot: young and shared
		}
		k := lim("k", time.Hour, 100, 1)
		k.Namespace = "other"
		admitted := 0
		if a.Decide(bg, k).Allowed { // k read and held here, far from its limit
			admitted++
		}
		reserves := origins[0].reserves.Load()
		gate := make(chan struct{})
		origins[0].gate.Store(&gate)
		waiting := make(chan int)
		for range 2 {
			go func() {
				out := make([]Decision, 2)
				if a.DecideMany(bg, []Limit{hot, k}, out) {
					waiting <- 1
					return
				}
				waiting <- 0
			}()
		}
		synctest.Wait() // both batches wait for hot's reservation, held at the gate
		if !a.Forget(k.Key) {
			t.Fatal("Forget found nothing to forget")
		}
		origins[0].gate.Store(nil)
		close(gate)
		admitted += <-waiting + <-waiting
		if origins[0].reserves.Load() == reserves {
			t.Fatal("no batch reserved hot at the origin: the test no longer waits where it means to")
		}
		for range 110 {
			if a.Decide(bg, k).Allowed {
				admitted++
			}
		}
		if admitted != 100 {
			t.Fatalf("admitted %d for a limit of 100", admitted)
		}
	})
}

// TestDropMatching_AKeyMetOnlyAfterTheResetKeepsItsCount: a process cut
// off from the origin met a key after a reset and admitted its limit;
// it hears of the reset when the origin is back, while its request path
// still decides locally (its breaker not closed yet, here a read that
// fails). The reset takes nothing off the key's cell, made after it, and
// the key stays at its limit. Before, the reset forgot the entry: the
// next request decided the key from nothing and admitted the limit again
// (the root's TestReset_ANodeCutOffMeetsAKeyAfterAResetKeepsItsUnits, 2
// runs in 6: 2 more at a limit of 2).
func TestDropMatching_AKeyMetOnlyAfterTheResetKeepsItsCount(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	k := lim("met-late", time.Minute, 2, 1)
	cut := errors.New("cut off")
	o.failReads(cut)
	o.failFlushes(cut)
	at := e.nowMs() // the reset, made by another process
	clk.Advance(time.Millisecond)
	if n := admittedOf(e, k, 3); n != 2 {
		t.Fatalf("cut off, admitted %d of 3 at a limit of 2", n)
	}
	e.DropMatching("zone", time.Minute, func(string) bool { return true }, at)
	if n := admittedOf(e, k, 2); n != 0 {
		t.Fatalf("after the reset, which took nothing off, admitted %d more at a limit of 2", n)
	}
	o.failFlushes(nil)
	replayAll(t, e)
	if got := o.total(k.Key, clk.UnixMilli()/time.Minute.Milliseconds()); got != 2 {
		t.Fatalf("the origin holds %d of the 2 units admitted after the reset", got)
	}
}

// TestDropMatching_AResetKeepsTheUnitsOfOlderWindows: a process whose
// clock stepped back an hour admitted units in a window of then, and its
// clock stepped forward again before a region's reset of the key, made on
// the true clock. The reset marks the key's two current windows at the
// origin, and the process dropped the older window's units too, unwritten:
// once its clock stepped back again it admitted them anew (9 for a limit
// of 8 in property seed 1795908793839211404). They are written now, and
// the window of then holds them.
func TestDropMatching_AResetKeepsTheUnitsOfOlderWindows(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("k", 2*time.Second, 8, 1)
	clk.Advance(-time.Hour)
	then := clk.UnixMilli() / l.Window.Milliseconds()
	decideN(e, l, 3)
	clk.Advance(time.Hour)
	e.DropMatching(l.Namespace, l.Window, func(id string) bool { return id == l.Identifier }, clk.UnixMilli())
	if _, err := replayBoth(e); err != nil {
		t.Fatal(err)
	}
	if got := o.total(l.Key, then); got != 3 {
		t.Errorf("the origin holds %d units of the window an hour back, 3 admitted there and no reset of it", got)
	}
	clk.Advance(-time.Hour)
	if n := admittedOf(e, l, 10); n != 5 {
		t.Errorf("back in the window an hour back, %d admitted, want the 5 its limit of 8 has left", n)
	}
}
