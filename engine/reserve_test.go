package engine

import (
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// sharedAt86 brings a key with a limit of 100 an hour to 86 units: one of
// another node, which the cold read shows (so the cell is shared), and 85
// of this engine, each replayed before the next. The next request, with
// the other node's expected growth (one unit a replay interval, over two)
// and itself counted once more (not yet replayed), makes 90 %.
func sharedAt86(t *testing.T, e *Engine, clk *testclock.Clock, o *memOrigin) (Limit, int64) {
	t.Helper()
	l := lim("k", time.Hour, 100, 1)
	seq := clk.UnixMilli() / time.Hour.Milliseconds()
	o.add(l.Key, seq, 1)
	for i := 0; i < 85; i++ {
		if !e.Decide(bg, l).Allowed {
			t.Fatal("denied below the limit")
		}
		if _, err := replayBoth(e); err != nil {
			t.Fatal(err)
		}
	}
	return l, seq
}

func TestReserve_SharedCellNearItsLimitIsDecidedAtTheOrigin(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l, seq := sharedAt86(t, e, clk, o)
	if n := o.reserves.Load(); n != 0 {
		t.Fatalf("%d reservations below 90 %%", n)
	}
	// Another node took the rest; this node's view is fresh and does not
	// show it.
	o.add(l.Key, seq, 14)
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

// TestReserve_RequestsThatArriveMeanwhileShareTheNextRoundTrip: while one
// reservation of a cell is in flight, the requests that arrive form the
// next one, and a single round trip decides them all, admitting exactly
// what the region's count leaves.
func TestReserve_RequestsThatArriveMeanwhileShareTheNextRoundTrip(t *testing.T) {
	// The other node takes 6 more: the region holds 92, and 8 are left.
	joinedReservation(t, 6, 8, 2)
}

// TestReserve_NoRoomLeftDeniesTheNextGroupWithoutARoundTrip: when the
// reservation in flight brings back a full count, the requests that joined
// behind it are denied without another round trip.
func TestReserve_NoRoomLeftDeniesTheNextGroupWithoutARoundTrip(t *testing.T) {
	// The other node takes 13 more: the region holds 99, and 1 is left,
	// which the leader takes.
	joinedReservation(t, 13, 1, 1)
}

// joinedReservation runs a leader's reservation, hung until 20 requests
// have joined behind it, on a cell where another node adds foreign units
// near the limit of 100; it checks what was admitted and how many round
// trips it took.
func joinedReservation(t *testing.T, foreign, wantAdmitted, wantTrips int64) {
	synctest.Test(t, func(t *testing.T) {
		e, clk, o := withOrigin(t, Config{ReadTimeout: time.Second})
		l, seq := sharedAt86(t, e, clk, o)
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

// TestReserve_AnAnswerDuringAReservationCountsItsCostsOnce: an answer
// about a cell (a read flight's, a background refresh's) that arrives
// while a reservation of the cell is in flight is merged as the count of
// the other processes plus this process's own total. The reservation
// raised that total by its costs before it was sent, and the answer,
// from before the reservation landed, did not hold them: the merge put
// the costs in the count, and the reservation's verdict added them again.
// The node then counted the key 5 units above the region for the rest of
// the window (96 against 91 here), and denied early.
func TestReserve_AnAnswerDuringAReservationCountsItsCostsOnce(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l, seq := sharedAt86(t, e, clk, o)
	before := o.reserves.Load()
	o.reserveDelay.Store(int64(300 * time.Millisecond))
	done := make(chan bool)
	go func() { done <- e.Decide(bg, lim("k", time.Hour, 100, 5)).Allowed }() // past 90 %: at the origin
	waitFor(t, "a reservation in flight", func() bool { return o.reserves.Load() > before })
	en := entryOf(t, e, l.Key)
	c := en.cur.Load()
	sent := e.nowMs()
	tot, err := o.Read(bg, l.Key, seq, c.incarnation())
	if err != nil {
		t.Fatal(err)
	}
	e.merge(e.Zone(l.Key.Namespace, l.Key.Window), en, c, tot, sent, l.Key, false)
	if !<-done {
		t.Fatal("the reservation was denied at 86 of 100")
	}
	o.reserveDelay.Store(0)
	if _, err := replayBoth(e); err != nil {
		t.Fatal(err)
	}
	if got := o.total(l.Key, seq); got != 91 {
		t.Fatalf("the origin holds %d, want 91", got)
	}
	if got := c.committed(); got != 91 {
		t.Fatalf("the node counts %d units in the cell, the region 91", got)
	}
}

// TestReserve_AFailedReservationsUnitsCountOnceInThePreviousCell: a
// reservation carries the units this process has not replayed yet, and
// when its answer is lost (a timeout after the origin ran it) they go back
// to pending, though the origin may hold them. An answer about the next
// window then carries the previous cell's total with them in it; merged
// with pending on top, they counted twice in the previous cell for the
// rest of that window, as units a lost write's answer left did before
// TestResend_UnitsTheOriginKeptCountOnce.
func TestReserve_AFailedReservationsUnitsCountOnceInThePreviousCell(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("k", 10*time.Second, 100, 1)
	seq := clk.UnixMilli() / l.Window.Milliseconds()
	o.add(l.Key, seq, 1) // another process's unit: the cold read shows it
	e.Decide(bg, l)
	replayAll(t, e)
	for range 3 { // decided locally, not replayed yet
		e.Decide(bg, l)
	}
	// Strict mode sends the next request to the origin, with the 3 units.
	e.markStrict(e.Zone(l.Namespace, l.Window), l.Identifier, clk.UnixMilli()+time.Second.Milliseconds(), clk.UnixMilli())
	o.lostReplies.Store(1)
	if d := e.Decide(bg, l); !d.Allowed {
		t.Fatalf("decided locally after the failed reservation: %+v, want allowed", d)
	}
	if n := o.reserves.Load(); n != 1 {
		t.Fatalf("%d reservations, want 1", n)
	}
	// The origin ran it: it holds the 3 units and the request's unit.
	if got := o.total(l.Key, seq); got != 6 {
		t.Fatalf("the origin holds %d, want 6", got)
	}
	clk.Advance(l.Window) // the next window, before any replay
	e.Decide(bg, l)       // its read answers the previous total too
	ks, _ := e.Inspect(l.Key)
	if len(ks.Cells) != 2 || ks.Cells[1].Regional != 6 {
		t.Fatalf("cells %+v: want the previous cell's 6 units counted once", ks.Cells)
	}
	replayAll(t, e)
	if ks, _ = e.Inspect(l.Key); ks.Cells[1].Regional != 6 || o.total(l.Key, seq) != 6 {
		t.Fatalf("after the replay: cells %+v, origin %d; want 6 and 6", ks.Cells, o.total(l.Key, seq))
	}
}

// TestReserve_AWaitForAWriteInFlightThatRunsOutIsCounted: a reservation
// waits for its cell's write in flight (holdWrites); on a hung Redis that
// write outlasts the request's read_timeout, and the request decides
// locally, as one whose read ran out does. Every request near the limit
// waited so, each counted nowhere: an audit with a hung Redis found 16
// requests a node waiting read_timeout before the breaker opened, 7 of
// them in read_wait_timeouts_total. One waits now, and is counted.
func TestReserve_AWaitForAWriteInFlightThatRunsOutIsCounted(t *testing.T) {
	const timeout = 20 * time.Millisecond
	e, clk, o := withOrigin(t, Config{ReadTimeout: timeout})
	l := lim("k", time.Hour, 100, 1)
	o.add(l.Key, clk.UnixMilli()/time.Hour.Milliseconds(), 1) // shared
	for i := 0; i < 80; i++ {
		if !e.Decide(bg, l).Allowed {
			t.Fatal("denied below the limit")
		}
		if _, err := replayBoth(e); err != nil {
			t.Fatal(err)
		}
	}
	if !e.Decide(bg, l).Allowed { // a unit to write
		t.Fatal("denied below the limit")
	}
	release, replayed := stalledWrite(t, e, o, func() { _, _ = replayBoth(e) })
	// Up to the limit's 90 %, decided locally; then each request waits
	// for the write to reserve, and runs out.
	before, waited := e.Stats().ReadWaitTimeouts, int64(0)
	for i := 0; i < 15; i++ {
		start := time.Now()
		if !e.Decide(bg, l).Allowed {
			t.Fatal("denied below the limit, decided locally")
		}
		if time.Since(start) >= timeout {
			waited++
		}
	}
	if waited == 0 {
		t.Fatal("no request waited for the write in flight: the test tests nothing")
	}
	if waited != 1 {
		t.Errorf("%d requests waited for the write in flight until their deadline, want 1: once a wait ran out, the next decide at once", waited)
	}
	if got := e.Stats().ReadWaitTimeouts - before; got != waited {
		t.Errorf("read_wait_timeouts rose by %d, with %d requests that waited for the write in flight until their deadline", got, waited)
	}
	if n := o.reserves.Load(); n != 0 {
		t.Errorf("%d reservations sent past a write in flight", n)
	}
	release()
	<-replayed
}
