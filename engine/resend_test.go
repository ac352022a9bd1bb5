package engine

import (
	"strconv"
	"testing"
	"time"
)

// TestResend_GivesAnOriginRestartedEmptyEveryUnitBack: the units of a
// live key and of a key forgotten in its window reach an origin that lost
// them, once each.
func TestResend_GivesAnOriginRestartedEmptyEveryUnitBack(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	live, gone := lim("live", time.Hour, 100, 1), lim("gone", time.Hour, 100, 1)
	seq := clk.UnixMilli() / time.Hour.Milliseconds()
	decideN(e, live, 5)
	decideN(e, gone, 3)
	replayAll(t, e)
	e.Forget(gone.Key)
	o.restart()
	if n := e.Resend(); n != 2 {
		t.Fatalf("Resend queued %d cells, want the live key's and the forgotten one's", n)
	}
	replayAll(t, e)
	if got, want := [2]int64{o.total(live.Key, seq), o.total(gone.Key, seq)}, [2]int64{5, 3}; got != want {
		t.Fatalf("origin totals %v after Resend, want %v", got, want)
	}
	// Sent again, the same totals change nothing: writes are idempotent.
	e.Resend()
	replayAll(t, e)
	if got := o.total(live.Key, seq); got != 5 {
		t.Fatalf("origin total %d after a second Resend, want 5", got)
	}
	if s := e.Stats(); s.Resends != 4 {
		t.Fatalf("Stats().Resends = %d, want 4 cells over two resends", s.Resends)
	}
}

// TestResend_WithoutOriginSendsNothing: cells that hold units an origin
// had stay as they are once the engine has no origin to send them to.
func TestResend_WithoutOriginSendsNothing(t *testing.T) {
	e, _, _ := withOrigin(t, Config{})
	l := lim("k", time.Hour, 100, 1)
	e.Decide(bg, l)
	replayAll(t, e)
	e.SetOrigin(nil)
	if n := e.Resend(); n != 0 {
		t.Fatalf("Resend without origin queued %d cells", n)
	}
	if ks, _ := e.Inspect(l.Key); ks.Cells[0].Pending != 0 {
		t.Fatalf("cell %+v: units moved back to pending with no origin to take them", ks.Cells[0])
	}
}

// TestOrigin_UnitsAdmittedWithoutItReachItWhenItComesBack: a key counted
// with an origin, then without one (a reload that took Redis out), then
// with it again: the units admitted in between reach the origin at the
// janitor's next pass. They stayed this process's alone, where a key
// first seen without the origin handed all of its units over.
func TestOrigin_UnitsAdmittedWithoutItReachItWhenItComesBack(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("k", time.Hour, 100, 1)
	seq := clk.UnixMilli() / time.Hour.Milliseconds()
	decideN(e, l, 3)
	replayAll(t, e)
	e.SetOrigin(nil)
	decideN(e, l, 2)
	e.SetOrigin(o)
	e.Sweep()
	replayAll(t, e)
	if got := o.total(l.Key, seq); got != 5 {
		t.Fatalf("the origin holds %d, want the 3 units from before and the 2 admitted without it", got)
	}
	decideN(e, l, 1)
	replayAll(t, e)
	if got := o.total(l.Key, seq); got != 6 {
		t.Fatalf("the origin holds %d after one more, want 6", got)
	}
}

// TestResend_GivesAnOriginRestartedEmptyTheUnitsOfAnEvictedKeyBack: a key
// evicted once the origin had all its units leaves its cell in the graves,
// so that an origin restarted empty in its window gets them back. Evict
// buried the entry's cells after letting them go, reading them from the
// entry, which by then held the tombstone: no evicted key whose units had
// all been written was remembered, and a unit charged to the cell while it
// was being let go, refused by full queues, was neither written nor
// counted as lost (TestEvict_EveryUnitIsSentOrCountedAsLost, a run in
// thirty under load).
func TestResend_GivesAnOriginRestartedEmptyTheUnitsOfAnEvictedKeyBack(t *testing.T) {
	e, clk, o := withOrigin(t, Config{MaxEntries: 10})
	gone := lim("gone", time.Hour, 100, 1)
	seq := clk.UnixMilli() / time.Hour.Milliseconds()
	decideN(e, gone, 3)
	for i := range 10 { // heavier keys: the lightest goes first
		decideN(e, lim("busy-"+strconv.Itoa(i), time.Hour, 100, 1), 20)
	}
	replayAll(t, e)
	if n := e.Evict(); n == 0 {
		t.Fatal("nothing evicted past the cap")
	}
	if _, ok := e.Zone("zone", time.Hour).entries.Load("gone"); ok {
		t.Fatal("the lightest key was not evicted")
	}
	o.restart()
	e.Resend()
	replayAll(t, e)
	if got := o.total(gone.Key, seq); got != 3 {
		t.Fatalf("the origin restarted empty got %d of the evicted key's 3 units back", got)
	}
}

// TestOrigin_UnitsCountedBeforeTheFirstOriginReachIt: a process that
// started without an origin (a local-only config) and is reloaded into a
// region hands the region the units it admitted before, the keys no
// request meets again included: the janitor's next pass upgrades their
// cells. They were handed over only at a key's next request, so an idle
// key's units stayed this process's alone and the region's other nodes
// admitted the key up to its limit again (Redis held 0 of 4 units
// admitted local-only: TestCaddy_AReloadAddingRedisHandsTheRegionItsUnits).
func TestOrigin_UnitsCountedBeforeTheFirstOriginReachIt(t *testing.T) {
	e, _, l, seq := localUnits(t, time.Hour, 1000)
	o := newMemOrigin()
	e.SetOrigin(o)
	e.Sweep()
	replayAll(t, e)
	if got := o.total(l.Key, seq); got != 3 {
		t.Fatalf("the origin holds %d, want the 3 units admitted before it came", got)
	}
	decideN(e, l, 1)
	replayAll(t, e)
	if got := o.total(l.Key, seq); got != 4 {
		t.Fatalf("the origin holds %d after one more, want 4", got)
	}
}
