package propagation

import (
	"context"
	"errors"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
)

// overridesSeen collects what a process's pulls hand to OnOverrides.
type overridesSeen struct {
	mu   sync.Mutex
	rows map[string]OverrideRow
}

func watchOverrides(r *region) *overridesSeen {
	s := &overridesSeen{rows: map[string]OverrideRow{}}
	r.p.onOverrides = func(rows []OverrideRow) {
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, o := range rows {
			if old, ok := s.rows[o.Identifier]; !ok || o.Version > old.Version {
				s.rows[o.Identifier] = o
			}
		}
	}
	return s
}

func (s *overridesSeen) get(id string) (OverrideRow, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	o, ok := s.rows[id]
	return o, ok
}

// TestOverrides_TravelBetweenRegionsNewestFirst: a change made at region
// a reaches region b at b's next flush; an older change written later (a
// slow region) does not replace it; a removal travels as a tombstone; the
// whole read at start hands b every override.
func TestOverrides_TravelBetweenRegionsNewestFirst(t *testing.T) {
	s := newSetup(t)
	a, b := s.region("a"), s.region("b")
	seen := watchOverrides(b)
	b.p.FlushOnce(bg) // b's whole read at start: nothing yet
	a.p.PutOverride(OverrideRow{Namespace: "z", Identifier: "cust", Limit: 500, Reason: "plan upgrade", Region: "a", Version: 2000})
	a.p.FlushOnce(bg)
	b.p.FlushOnce(bg)
	if o, ok := seen.get("cust"); !ok || o.Limit != 500 || o.Reason != "plan upgrade" || o.Deleted || o.Region != "a" {
		t.Fatalf("b saw %+v (%v), want a's limit of 500", o, ok)
	}
	// A change older than the one held is not written over it.
	b.p.PutOverride(OverrideRow{Namespace: "z", Identifier: "cust", Limit: 1, Region: "b", Version: 1000})
	b.p.FlushOnce(bg)
	b.p.readWholeNext()
	b.p.FlushOnce(bg)
	if o, _ := seen.get("cust"); o.Limit != 500 {
		t.Fatalf("an older change replaced the newer one: %+v", o)
	}
	// A removal is a newer row that every region reads.
	a.p.PutOverride(OverrideRow{Namespace: "z", Identifier: "cust", Region: "a", Version: 3000, Deleted: true, ExpiresMs: s.clk.Now().UnixMilli() + 86_400_000})
	a.p.FlushOnce(bg)
	b.p.FlushOnce(bg)
	if o, _ := seen.get("cust"); !o.Deleted || o.Live(s.clk.Now().UnixMilli()) {
		t.Fatalf("b did not see the removal: %+v", o)
	}
	// A process that starts loads every override before it decides.
	c := s.region("c")
	all, err := c.p.LoadOverrides(bg)
	if err != nil || len(all) != 1 || all[0].Version != 3000 {
		t.Fatalf("LoadOverrides = %+v, %v; want the removal", all, err)
	}
	if st := a.p.Stats(); st.OverridesWritten != 2 || st.PendingOverrides != 0 {
		t.Fatalf("a's stats: %d written, %d pending; want 2 and 0", st.OverridesWritten, st.PendingOverrides)
	}
}

// TestOverrides_CleanupKeepsOverridesWithoutExpiry: cleanup deletes the
// removals and resets that lapsed, an override that lapsed a day later
// (LapsedOverrideLife), and never one without an expiry.
func TestOverrides_CleanupKeepsOverridesWithoutExpiry(t *testing.T) {
	s := newSetup(t)
	a := s.region("a")
	now := s.clk.Now().UnixMilli()
	a.p.PutOverride(OverrideRow{Namespace: "z", Identifier: "forever", Limit: 5, Region: "a", Version: 1})
	a.p.PutOverride(OverrideRow{Namespace: "z", Identifier: "lapsed", Limit: 5, Region: "a", Version: 1, ExpiresMs: now - 1})
	a.p.PutOverride(OverrideRow{Namespace: "z", Identifier: "removed", Region: "a", Version: 1, Deleted: true, ExpiresMs: now - 1})
	a.p.PutOverride(OverrideRow{Namespace: ResetMark + "z", Identifier: "reset", Region: "a", Version: 1, ExpiresMs: now - 1})
	a.p.PutOverride(OverrideRow{Namespace: "z", Identifier: "later", Limit: 5, Region: "a", Version: 1, ExpiresMs: now + 60_000})
	a.p.FlushOnce(bg)
	left := func() map[string]bool {
		t.Helper()
		all, err := a.p.LoadOverrides(bg)
		if err != nil {
			t.Fatal(err)
		}
		ids := map[string]bool{}
		for _, o := range all {
			ids[o.Identifier] = true
		}
		return ids
	}
	if n := a.p.CleanupOnce(bg); n != 2 {
		t.Fatalf("cleanup deleted %d rows, want the lapsed removal and reset", n)
	}
	if ids := left(); len(ids) != 3 || !ids["forever"] || !ids["lapsed"] || !ids["later"] {
		t.Fatalf("left %v, want forever, lapsed and later", ids)
	}
	s.clk.Add(LapsedOverrideLife)
	if n := a.p.CleanupOnce(bg); n != 1 {
		t.Fatalf("a day on, cleanup deleted %d rows, want the override lapsed a day ago", n)
	}
	if ids := left(); len(ids) != 2 || !ids["forever"] || !ids["later"] {
		t.Fatalf("left %v, want forever and later (lapsed less than a day ago)", ids)
	}
}

// resetRegion is a memRegion that carries overrides; afterTake runs once,
// after the holder took the region's changes: an operator's reset that
// lands in the middle of a flush.
type resetRegion struct {
	memNode
	pending   []OverrideRow
	afterTake func()
}

func (r *resetRegion) TakeOverrides(_ context.Context, all bool) ([]OverrideRow, error) {
	r.mu.Lock()
	out := r.pending
	r.pending = nil
	r.mu.Unlock()
	if f := r.afterTake; f != nil {
		r.afterTake = nil
		f()
	}
	return out, nil
}

func (r *resetRegion) ApplyOverrides(context.Context, []OverrideRow) error { return nil }

// TestOverrides_AResetReachesMySQLBeforeTheCountsAfterIt: a global reset
// lands in the region while the holder flushes, and the region counts
// units after it. Another region marks its view of the key when it reads
// the reset, taking off what it imported by then: a count holding units
// from after the reset must not reach MySQL before the reset does, or
// those units are taken off with the old ones and never count there.
func TestOverrides_AResetReachesMySQLBeforeTheCountsAfterIt(t *testing.T) {
	s := newSetup(t)
	mem := newMemRegion(s.clk)
	reg := &resetRegion{}
	n1 := s.regionNodeOn("a", mem, reg)
	n1.decide("k", 100, 60)
	mem.setTotal("k", 60)
	n1.p.FlushOnce(bg)
	n1.p.GlobalSyncOnce(bg)
	n1.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_global_counts", "WHERE identifier = 'k' AND count = 60"); n != 1 {
		t.Fatal("the region's count before the reset was not published")
	}
	reg.afterTake = func() {
		reg.mu.Lock()
		reg.pending = append(reg.pending, OverrideRow{Namespace: "\x01z", Identifier: "k", Region: "a", Version: 5000,
			ExpiresMs: s.clk.Now().UnixMilli() + 120_000})
		reg.mu.Unlock()
		mem.setTotal("k", 62) // two units admitted after the reset
	}
	n1.p.GlobalSyncOnce(bg)
	n1.p.FlushOnce(bg)
	counted := countRows(t, s.dsn, "ratelimit_global_counts", "WHERE identifier = 'k' AND count = 62")
	resets := countRows(t, s.dsn, "ratelimit_overrides", "WHERE identifier = 'k'")
	if counted == 1 && resets == 0 {
		t.Fatal("the count with the units after the reset reached MySQL before the reset")
	}
	n1.p.GlobalSyncOnce(bg)
	n1.p.FlushOnce(bg)
	counted = countRows(t, s.dsn, "ratelimit_global_counts", "WHERE identifier = 'k' AND count = 62")
	resets = countRows(t, s.dsn, "ratelimit_overrides", "WHERE identifier = 'k'")
	if counted != 1 || resets != 1 {
		t.Fatalf("after the next flush: %d rows of the new count, %d of the reset; want both", counted, resets)
	}
}

// TestOverrides_AGlobalMarkIsPublishedWithItsBase: a region that marks a
// global reset publishes its count with the reset's version and its base
// (its total then), although the count did not move, and another region's
// holder hands both to its region's Redis with the part of the region
// that sent them. A stale write without the reset never takes it back.
func TestOverrides_AGlobalMarkIsPublishedWithItsBase(t *testing.T) {
	s := newSetup(t)
	memA, memB := newMemRegion(s.clk), newMemRegion(s.clk)
	a, b := s.regionNode("a", "n1", memA), s.regionNode("b", "m1", memB)
	a.decide("k", 100, 60)
	memA.setTotal("k", 60)
	a.p.FlushOnce(bg)
	a.p.GlobalSyncOnce(bg)
	a.p.FlushOnce(bg)
	cell := Cell{"z", "k", window.Milliseconds(), seq0}
	row := func() (count, ver, base int64) {
		t.Helper()
		db := mysqltest.Open(t, s.dsn)
		if err := db.QueryRow(`SELECT count, reset_version, reset_base FROM ratelimit_global_counts WHERE region = 'a' AND identifier = 'k'`).
			Scan(&count, &ver, &base); err != nil {
			t.Fatal(err)
		}
		return count, ver, base
	}
	if c, v, _ := row(); c != 60 || v != MarksResets {
		t.Fatalf("before the reset: count %d, reset %d; want 60 and none (%d: a region that marks resets)", c, v, MarksResets)
	}
	memA.mu.Lock()
	memA.totals[cell] = RegionTotal{Count: 60, ResetVersion: 5000, ResetBase: 60}
	memA.mu.Unlock()
	a.p.FlushOnce(bg)
	if c, v, base := row(); c != 60 || v != 5000 || base != 60 {
		t.Fatalf("after the mark: count %d, reset %d, base %d; want 60, 5000, 60", c, v, base)
	}
	stale := &CountRow{Namespace: "z", Identifier: "k", WindowMs: window.Milliseconds(), Sequence: seq0, Region: "a",
		Count: 61, ExpiresMs: expiresMs(seq0, window.Milliseconds())}
	if err := a.store.UpsertCounts(bg, []*CountRow{stale}); err != nil {
		t.Fatal(err)
	}
	if c, v, base := row(); c != 61 || v != 5000 || base != 60 {
		t.Fatalf("after a write without the reset: count %d, reset %d, base %d; want 61 and the reset kept", c, v, base)
	}
	for range 2 {
		b.p.GlobalSyncOnce(bg)
		b.p.FlushOnce(bg)
	}
	memB.mu.Lock()
	got := memB.parts[cell]["a"]
	memB.mu.Unlock()
	if got != (ImportPart{Region: "a", Count: 61, ResetVersion: 5000, ResetBase: 60}) {
		t.Fatalf("region b's Redis got a's part %+v, want count 61 with the reset 5000 at 60", got)
	}
}

// TestOverrides_ACellResetHereGetsItsImportsPartByPart: a cell no region
// published a reset of is imported as one sum; once the region reset it,
// an import without parts is refused, and the holder sends every region's
// part from then on.
func TestOverrides_ACellResetHereGetsItsImportsPartByPart(t *testing.T) {
	s := newSetup(t)
	memB := newMemRegion(s.clk)
	a, b := s.region("a"), s.regionNode("b", "m1", memB)
	cell := Cell{"z", "k", window.Milliseconds(), seq0}
	a.decide("k", 100, 60)
	a.p.FlushOnce(bg)
	b.p.FlushOnce(bg)
	memB.mu.Lock()
	sum, parts := memB.imported[cell], memB.parts[cell]
	memB.resetHere[cell] = true
	memB.mu.Unlock()
	if sum != 60 || len(parts) != 0 {
		t.Fatalf("b's region got %d and parts %v, want the sum 60 alone", sum, parts)
	}
	a.decide("k", 100, 5)
	a.p.FlushOnce(bg)
	b.p.FlushOnce(bg) // without parts: refused
	b.p.FlushOnce(bg) // part by part
	memB.mu.Lock()
	got := memB.parts[cell]["a"]
	memB.mu.Unlock()
	if got.Count != 65 {
		t.Fatalf("after the region reset the cell, a's part is %+v, want its count 65", got)
	}
}

// TestOverrides_ARegionCutOffWhileAChangeLapsedDropsWhatItReplaced: region
// b holds an override (a block) when region a replaces it with one that
// expires soon (a reprieve), and b's holder does not reach MySQL until
// the reprieve lapsed and a cleanup ran. Back, b must hear that the block
// was replaced, and no region must get the block back: b's whole read
// found its block missing from the table (its row, the reprieve's, was
// deleted as it lapsed) and wrote it back, and every region pulled it.
func TestOverrides_ARegionCutOffWhileAChangeLapsedDropsWhatItReplaced(t *testing.T) {
	s := newSetup(t)
	a, b := s.region("a"), s.region("b")
	seen := watchOverrides(b)
	a.p.PutOverride(OverrideRow{Namespace: "z", Identifier: "cust", Limit: 0, Reason: "abuse", Region: "a", Version: 1000})
	a.p.FlushOnce(bg)
	b.p.FlushOnce(bg) // b holds the block
	if o, ok := seen.get("cust"); !ok || o.Version != 1000 {
		t.Fatalf("b saw %+v (%v), want the block", o, ok)
	}

	reprieve := OverrideRow{Namespace: "z", Identifier: "cust", Limit: 100, Region: "a", Version: 2000,
		ExpiresMs: s.clk.Now().UnixMilli() + 30_000}
	a.p.PutOverride(reprieve)
	a.p.FlushOnce(bg)
	s.clk.Add(31 * time.Second) // b makes no statement meanwhile
	a.p.CleanupOnce(bg)

	b.p.readWholeNext()
	b.p.FlushOnce(bg)
	b.p.FlushOnce(bg)
	if o, _ := seen.get("cust"); o.Version != reprieve.Version {
		t.Errorf("b last saw %+v, not the reprieve that replaced its block: it applies the block for good", o)
	}
	all, err := s.region("c").p.LoadOverrides(bg)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range all {
		if o.Live(s.clk.Now().UnixMilli()) {
			t.Errorf("a region that starts now loads %+v: the replaced block is back", o)
		}
	}
	if n := b.p.Stats().OverrideRowsMissing; n != 0 {
		t.Errorf("b wrote back %d override rows", n)
	}

	// A day past its lapse, the cleanup deletes the reprieve.
	s.clk.Add(24 * time.Hour)
	if n := a.p.CleanupOnce(bg); n != 1 {
		t.Errorf("a day past the reprieve's lapse, cleanup deleted %d rows, want it", n)
	}
}

// overrideQueue is the overrides of a region as its Redis holds them:
// every change held, and a queue of those the holder has not taken.
type overrideQueue struct {
	mu    sync.Mutex
	held  map[Cell]OverrideRow
	queue []OverrideRow
}

func newOverrideQueue() *overrideQueue { return &overrideQueue{held: map[Cell]OverrideRow{}} }

func (q *overrideQueue) put(o OverrideRow) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.held[Cell{Namespace: o.Namespace, Identifier: o.Identifier}] = o
	q.queue = append(q.queue, o)
}

// queuedOverrides is a node's handle on a memRegion that carries
// overrides in q. Its next take of the queue, once fail is set, empties
// the queue and then fails, as a take whose reply never came back (the
// script ran); its next take of denial rows runs duringDenials first.
type queuedOverrides struct {
	memNode
	q             *overrideQueue
	fail          atomic.Bool
	duringDenials func()
}

func (r *queuedOverrides) TakeOverrides(_ context.Context, all bool) ([]OverrideRow, error) {
	q := r.q
	q.mu.Lock()
	defer q.mu.Unlock()
	if all {
		q.queue = nil
		return slices.Collect(maps.Values(q.held)), nil
	}
	out := q.queue
	q.queue = nil
	if r.fail.CompareAndSwap(true, false) {
		return nil, errors.New("the take's reply never came back")
	}
	return out, nil
}

func (r *queuedOverrides) ApplyOverrides(context.Context, []OverrideRow) error { return nil }

func (r *queuedOverrides) TakeDenials(ctx context.Context) ([]BlocklistRow, error) {
	if f := r.duringDenials; f != nil {
		r.duringDenials = nil
		f()
	}
	return r.memNode.TakeDenials(ctx)
}

// TestOverrides_ATakeThatFailedIsFollowedByAWholeOne: a change of the
// region popped from its queue by a take that then failed reaches MySQL
// at the next flush, which takes every override the region holds. It
// was lost before: nothing took the region's overrides whole again but a
// new holder or another database server, so the other regions never
// applied the change (an override, or a global reset).
func TestOverrides_ATakeThatFailedIsFollowedByAWholeOne(t *testing.T) {
	s := newSetup(t)
	reg := &queuedOverrides{memNode: memNode{newMemRegion(s.clk), "n1"}, q: newOverrideQueue()}
	n := s.regionNodeWith("a", reg)
	n.p.FlushOnce(bg) // takes the role, and every override: none yet
	reg.q.put(OverrideRow{Namespace: "z", Identifier: "cust", Limit: 500, Region: "a", Version: 2000})
	reg.fail.Store(true)
	n.p.FlushOnce(bg)
	if reg.fail.Load() {
		t.Fatal("the flush took no queued override")
	}
	n.p.FlushOnce(bg)
	if got := countRows(t, s.dsn, "ratelimit_overrides", "WHERE identifier = 'cust' AND limit_units = 500"); got != 1 {
		t.Fatalf("%d rows of the override after the next flush, want 1", got)
	}
}

// TestOverrides_AHolderWhoseRoleIsGoneTakesNoChange: the holder's lease
// lapses during a flush (the region's Redis answers late) and another
// node takes the role, taking every override the region holds. A change
// made after that was popped from the queue by the old holder's flush,
// which then found its role gone and wrote nothing: the change never
// reached MySQL. A flush that lost its role now takes no change: the
// new holder does.
func TestOverrides_AHolderWhoseRoleIsGoneTakesNoChange(t *testing.T) {
	s := newSetup(t)
	mem, q := newMemRegion(s.clk), newOverrideQueue()
	fast := func(c *Config) { c.Flush, c.Timeout = 20*time.Millisecond, 300*time.Millisecond }
	r1 := &queuedOverrides{memNode: memNode{mem, "n1"}, q: q}
	r2 := &queuedOverrides{memNode: memNode{mem, "n2"}, q: q}
	n1, n2 := s.regionNodeWith("a", r1, fast), s.regionNodeWith("a", r2, fast)
	n1.p.FlushOnce(bg)
	if st := n1.p.Stats(); st.Role != "holder" {
		t.Fatalf("n1 is %q, want the holder", st.Role)
	}
	lease := n1.p.leaseTTL()
	r1.duringDenials = func() {
		s.clk.Add(lease + time.Millisecond) // n1's lease lapses: n2 takes the role
		n2.p.FlushOnce(bg)
		if st := n2.p.Stats(); st.Role != "holder" {
			t.Errorf("n2 is %q, want the holder", st.Role)
		}
		q.put(OverrideRow{Namespace: "z", Identifier: "cust", Limit: 500, Region: "a", Version: 2000})
		// The region's Redis answers n1 late: past what n1 reckons of
		// its lease, less a query's timeout.
		time.Sleep(lease - n1.p.cfg.Timeout + 40*time.Millisecond)
	}
	n1.p.FlushOnce(bg)
	if st := n1.p.Stats(); st.Role != "member" {
		t.Fatalf("n1 is %q after its role passed, want a member", st.Role)
	}
	n2.p.FlushOnce(bg)
	if got := countRows(t, s.dsn, "ratelimit_overrides", "WHERE identifier = 'cust' AND limit_units = 500"); got != 1 {
		t.Fatalf("%d rows of the change made after n2 took the role, want 1", got)
	}
}
