package engine

import (
	"context"
	"math"
	"runtime"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// Defects a review found, each pinned by a test that failed before its fix.

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

func TestReplay_FullFastQueueFallsBackToTheSlowOne(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{}))
	e.queueLen = 2
	o := newMemOrigin()
	e.SetOrigin(o)
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	// Three keys at half their limit want the fast queue, which holds two.
	for _, id := range []string{"a", "b", "c"} {
		l := lim(id, time.Minute, 2, 1)
		if !e.Decide(bg, l).Allowed {
			t.Fatal("denied below the limit")
		}
	}
	for _, tier := range []Tier{Fast, Slow} {
		if _, err := e.ReplayOnce(bg, tier); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{"a", "b", "c"} {
		if got := o.total(Key{"zone", id, time.Minute}, seq); got != 1 {
			t.Fatalf("origin total of %s = %d, want 1: its unit was stranded", id, got)
		}
	}
}

func TestSweep_KeepsAnEntryWhoseUnitsNoQueueTook(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{}))
	e.queueLen = 1
	o := newMemOrigin()
	e.SetOrigin(o)
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	for _, id := range []string{"a", "b", "c", "d"} {
		e.Decide(bg, lim(id, time.Minute, 100, 1))
	}
	// Two windows later every entry is idle, and both queues (one slot
	// each) are full: the sweep must not forget the units of the rest.
	clk.Advance(2 * time.Minute)
	e.Sweep()
	for i := 0; i < 4; i++ {
		for _, tier := range []Tier{Fast, Slow} {
			if _, err := e.ReplayOnce(bg, tier); err != nil {
				t.Fatal(err)
			}
		}
		e.Sweep()
	}
	for _, id := range []string{"a", "b", "c", "d"} {
		if got := o.total(Key{"zone", id, time.Minute}, seq); got != 1 {
			t.Fatalf("origin total of %s = %d, want 1", id, got)
		}
	}
	if n := e.Stats().Entries; n != 0 {
		t.Fatalf("%d entries left after their units reached the origin", n)
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

func TestStrict_DeadlinesAreBoundedByMaxEntries(t *testing.T) {
	e, _, _ := withOrigin(t, Config{MaxEntries: 10})
	for i := 0; i < 100; i++ {
		l := lim(strings.Repeat("x", i+1), time.Minute, 0, 1)
		if e.Decide(bg, l).Allowed {
			t.Fatal("a zero limit admitted")
		}
	}
	if n := len(e.StrictKeys()); n > 10 {
		t.Fatalf("%d strict deadlines, want at most MaxEntries = 10", n)
	}
}

func TestEngine_LocalOnlyRunsNoReplayLoop(t *testing.T) {
	e := New(Config{})
	defer func() { _ = e.Close(context.Background()) }()
	e.Decide(bg, lim("k", time.Minute, 10, 1))
	buf := make([]byte, 1<<20)
	if stacks := string(buf[:runtime.Stack(buf, true)]); strings.Contains(stacks, "replayLoop") {
		t.Fatal("a local-only engine runs the replay loop")
	}
	e.SetOrigin(newMemOrigin())
	waitFor(t, "the first origin to start the replay loop", func() bool {
		buf = buf[:cap(buf)]
		return strings.Contains(string(buf[:runtime.Stack(buf, true)]), "replayLoop")
	})
}

func TestScan_KeepsTheFirstKeysInOrder(t *testing.T) {
	e, _ := newTestEngine(t, manual(Config{}))
	ids := []string{"m", "c", "x", "a", "q", "b", "z", "d"}
	for _, id := range ids {
		e.Decide(bg, lim(id, time.Minute, 10, 1))
		e.Decide(bg, lim(id, time.Hour, 10, 1))
	}
	got := e.Scan("zone", "", 5)
	want := []Key{{"zone", "a", time.Minute}, {"zone", "a", time.Hour}, {"zone", "b", time.Minute}, {"zone", "b", time.Hour}, {"zone", "c", time.Minute}}
	if len(got) != len(want) {
		t.Fatalf("Scan returned %d keys, want %d", len(got), len(want))
	}
	for i := range want {
		if got[i].Key != want[i] {
			t.Fatalf("Scan[%d] = %v, want %v", i, got[i].Key, want[i])
		}
	}
	if all := e.Scan("zone", "", -1); len(all) != 2*len(ids) {
		t.Fatalf("Scan(-1) returned %d keys, want %d", len(all), 2*len(ids))
	}
}

// twoNodes returns two engines on one clock and one origin, each its own
// process to the origin.
func twoNodes(t *testing.T) (a, b *Engine, clk *testclock.Clock, o *memOrigin) {
	t.Helper()
	clk = testclock.New(time.UnixMilli(epoch))
	a, _ = newTestEngine(t, manual(Config{Now: clk.Now}))
	b, _ = newTestEngine(t, manual(Config{Now: clk.Now}))
	o = newMemOrigin()
	a.SetOrigin(o)
	b.SetOrigin(o.peer("b"))
	return a, b, clk, o
}

// replayAll runs one replay of both tiers on every engine.
func replayAll(t *testing.T, es ...*Engine) {
	t.Helper()
	for _, e := range es {
		for _, tier := range []Tier{Fast, Slow} {
			if _, err := e.ReplayOnce(bg, tier); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestForget_RecreatedKeyStillReachesTheOrigin is the over-admission a
// review measured with two Caddy nodes on one Redis: 50 requests to A, a
// DELETE of the key on A, then 300 alternating A and B (another DELETE on
// A half-way) admitted 139 for a limit of 100. A forgotten key's new cell
// started this process's total at 0 again, below what the origin held for
// it, so its units never reached the other node. Before the fix: 139.
func TestForget_RecreatedKeyStillReachesTheOrigin(t *testing.T) {
	a, b, clk, _ := twoNodes(t)
	l := lim("k", 20*time.Second, 100, 1)
	admitted := 0
	decide := func(e *Engine) {
		if e.Decide(bg, l).Allowed {
			admitted++
		}
		clk.Advance(10 * time.Millisecond)
		replayAll(t, a, b)
	}
	for i := 0; i < 50; i++ {
		decide(a)
	}
	a.Forget(l.Key)
	for i := 0; i < 300; i++ {
		if i == 150 {
			a.Forget(l.Key)
		}
		decide([]*Engine{a, b}[i%2])
	}
	if admitted > 100 {
		t.Fatalf("admitted %d for a limit of 100 around two forgets", admitted)
	}
	if admitted < 100 {
		t.Fatalf("admitted %d, want the whole limit of 100", admitted)
	}
}

// TestForget_ReadmitAtFullSpeedStaysExact is the same run at the pace of
// two Caddy nodes on loopback: a request every 250 µs, replays on the
// fast tick (10 ms). It admitted 106–120 of 100 through the built Caddy:
// after the forget both nodes decide at the origin, and each answer's
// step (the others' growth since the answer before) was taken as growth
// per tick, though the answers came 500 µs apart. The others' pace
// looked like a unit a tick, both nodes went back to deciding locally
// short of 90 %, and each admitted what the other had admitted within a
// tick. A step is now measured over half a tick at least and scaled to
// a tick.
func TestForget_ReadmitAtFullSpeedStaysExact(t *testing.T) {
	for _, forget := range []bool{true, false} {
		a, b, clk, _ := twoNodes(t)
		l := lim("k", 20*time.Second, 100, 1)
		admitted := 0
		nextTick := clk.Now().Add(DefaultFastTick)
		decide := func(e *Engine) {
			if e.Decide(bg, l).Allowed {
				admitted++
			}
			clk.Advance(250 * time.Microsecond)
			if !clk.Now().Before(nextTick) {
				nextTick = nextTick.Add(DefaultFastTick)
				replayAll(t, a, b)
			}
		}
		for i := 0; i < 50; i++ {
			decide(a)
		}
		if forget {
			a.Forget(l.Key)
		}
		for i := 0; i < 300; i++ {
			if i == 150 && forget {
				a.Forget(l.Key)
			}
			decide([]*Engine{a, b}[i%2])
		}
		if admitted != 100 {
			t.Errorf("forget %v: admitted %d, want the limit of 100", forget, admitted)
		}
	}
}

// TestResend_UnitsTheOriginKeptCountOnce is what the reference test found
// on seed 1795593710044218115 (a denial one unit under the limit): units
// the origin already holds go back to pending (Resend after a restart
// the origin recovered from, or a write whose answer was lost), and an
// answer about the next window carries the previous cell's total with
// them in it. Merged with pending on top, they counted twice in the
// previous cell, for good. Before the fix: 2 for 1.
func TestResend_UnitsTheOriginKeptCountOnce(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{}))
	o := newMemOrigin()
	e.SetOrigin(o)
	l := lim("k", time.Second, 5, 1)
	e.Decide(bg, l)
	replayAll(t, e) // the origin holds the unit
	if n := e.Resend(); n != 1 {
		t.Fatalf("Resend queued %d cells, want 1", n)
	}
	clk.Advance(time.Second) // the next window: the cell is the previous one
	e.Decide(bg, l)          // its read answers the previous total too
	ks, _ := e.Inspect(l.Key)
	if len(ks.Cells) != 2 || ks.Cells[1].Regional != 1 {
		t.Fatalf("cells %+v: want the previous cell's one unit counted once", ks.Cells)
	}
	replayAll(t, e)
	if ks, _ = e.Inspect(l.Key); ks.Cells[1].Regional != 1 || o.total(l.Key, ks.Cells[1].Sequence) != 1 {
		t.Fatalf("after the replay: cells %+v, origin %d; want 1 and 1", ks.Cells, o.total(l.Key, ks.Cells[1].Sequence))
	}
	// The same in the cell's own window: after Resend the next decision
	// reads first (the others' totals are suspect), and the answer's
	// record says what the origin holds of this process.
	replayAll(t, e)
	e.Resend()
	e.Decide(bg, l)
	if ks, _ = e.Inspect(l.Key); ks.Cells[0].Regional != 2 {
		t.Fatalf("cells %+v: want the current cell's two units counted once", ks.Cells)
	}
}

// TestClock_StepBackKeepsThePreviousCellForResend is what the reference
// test found on seed 1795593053020452457 (an over-admission after compound
// faults): a clock an hour ahead counts a key in two windows; stepped back,
// the key's cell from the future is replaced, and the one before it was
// dropped without being remembered. The origin restarted empty then, and
// Resend sent the stale cell's units but not its predecessor's: 35 units
// never came back. Before the fix: the origin held 0 of the 5.
func TestClock_StepBackKeepsThePreviousCellForResend(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{}))
	o := newMemOrigin()
	e.SetOrigin(o)
	l := lim("k", time.Second, 100, 1)
	start := clk.Now()
	clk.Set(start.Add(time.Hour))
	for range 5 {
		e.Decide(bg, l)
	}
	ahead := clk.Now().UnixMilli() / 1000
	clk.Advance(time.Second)
	for range 3 {
		e.Decide(bg, l)
	}
	replayAll(t, e)
	clk.Set(start) // back: both cells lie an hour ahead
	e.Decide(bg, l)
	o.restart()
	e.Resend()
	replayAll(t, e)
	if got := o.total(l.Key, ahead); got != 5 {
		t.Fatalf("the origin holds %d of the 5 units counted in the earlier window ahead", got)
	}
	if got := o.total(l.Key, ahead+1); got != 3 {
		t.Fatalf("the origin holds %d of the 3 units counted in the later window ahead", got)
	}
}

// TestRotation_AKeyIdleForAWindowReadsFirst is what the reference test
// found on seed 1795597378052014898: a key this process last touched
// windows ago (or before its clock jumped) rotated into a cell that
// counted as read, so its first request decided on local counts alone,
// far from the limit in its own view, while another process had counted
// the new window to 4 of 5. Before the fix: cost 2 admitted, 6 of 5.
func TestRotation_AKeyIdleForAWindowReadsFirst(t *testing.T) {
	a, b, clk, _ := twoNodes(t)
	l := lim("k", time.Second, 5, 1)
	a.Decide(bg, Limit{Key: l.Key, Limit: 5}) // a reads the key (cost 0)
	clk.Advance(2 * time.Second)
	for range 4 {
		b.Decide(bg, l)
	}
	replayAll(t, a, b)
	l.Cost = 2
	if a.Decide(bg, l).Allowed {
		t.Fatal("a admitted cost 2 of a key the other process counted to 4 of 5 in this window")
	}
}

// TestClock_StepForwardAndBackFreezesNoKey is the review's unit repro: the
// wall clock steps an hour forward (an NTP step, a resumed VM) and back,
// and a key touched meanwhile kept counting in its cell from the future,
// admitting 9 of 300 afterwards for a limit of 100. A cell more than one
// window ahead of now is stale and replaced. Before the fix: 9.
func TestClock_StepForwardAndBackFreezesNoKey(t *testing.T) {
	for _, withOrigin := range []bool{false, true} {
		e, clk := newTestEngine(t, manual(Config{}))
		var o *memOrigin
		if withOrigin {
			o = newMemOrigin()
			e.SetOrigin(o)
		}
		l := lim("k", time.Minute, 100, 1)
		start := clk.Now().Add(10 * time.Second)
		clk.Set(start)
		before := 0
		if withOrigin {
			// 20 units counted before the step reach the origin.
			for range 20 {
				e.Decide(bg, l)
			}
			replayAll(t, e)
			before = 20
		}
		clk.Set(start.Add(time.Hour))
		for range 5 {
			if !e.Decide(bg, l).Allowed {
				t.Fatal("denied in the hour ahead")
			}
		}
		clk.Set(start.Add(time.Second))
		admitted := 0
		for range 300 {
			if e.Decide(bg, l).Allowed {
				admitted++
			}
		}
		if admitted != 100-before {
			t.Fatalf("origin %v: admitted %d of 300 after the clock came back, want %d", withOrigin, admitted, 100-before)
		}
		if withOrigin {
			replayAll(t, e)
			seq := start.UnixMilli() / time.Minute.Milliseconds()
			if got := o.total(l.Key, seq); got != 100 {
				t.Fatalf("origin holds %d for the window, want 100", got)
			}
			if got := o.total(l.Key, seq+60); got != 5 {
				t.Fatalf("origin holds %d for the window an hour ahead, want its 5", got)
			}
		}
	}
}

// TestClock_CellOneWindowAheadIsKept: a clock that steps back by less than
// a window (or a node a little behind the others) keeps counting in the
// newer cell, never moving a key back to an older one.
func TestClock_CellOneWindowAheadIsKept(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{}))
	l := lim("k", time.Minute, 10, 1)
	clk.Set(clk.Now().Add(time.Minute + time.Second))
	for range 4 {
		e.Decide(bg, l)
	}
	clk.Set(clk.Now().Add(-2 * time.Second)) // back into the window before
	ks, _ := e.Inspect(l.Key)
	if len(ks.Cells) == 0 || ks.Cells[0].Regional != 4 {
		t.Fatalf("cells %+v, want the newer cell with 4", ks.Cells)
	}
	admitted := 0
	for range 20 {
		if e.Decide(bg, l).Allowed {
			admitted++
		}
	}
	if admitted != 6 {
		t.Fatalf("admitted %d after a step back within the window, want the 6 left in the newer cell", admitted)
	}
}

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
