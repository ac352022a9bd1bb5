package propagation

import (
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

func TestDenialGossip_OneRowPerRegionAndCell(t *testing.T) {
	s := newSetup(t)
	// Two nodes of region a (say, sharing a Redis): each denies the cell
	// once; the table holds one row for (a, cell) with the larger counts.
	a1, a2 := s.region("a"), s.region("a")
	a1.decide("k", 10, 12)
	a2.decide("k", 10, 11)
	a1.p.FlushOnce(bg)
	a2.p.FlushOnce(bg)
	a1.decide("k", 10, 5) // more denials: no new first denial
	a1.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_blocklist", ""); n != 1 {
		t.Fatalf("%d rows for one (region, cell), want 1", n)
	}
	if st := a1.p.Stats(); st.DenialsEmitted != 1 {
		t.Fatalf("node emitted %d rows for one cell, want 1", st.DenialsEmitted)
	}
}

func TestDenialGossip_FilterHalfLimitAndMinWindow(t *testing.T) {
	s := newSetup(t)
	a := s.region("a")
	// One oversized request on a fresh key: denied, not broadcast.
	a.eng.Decide(bg, engine.Limit{Key: key("big"), Limit: 10, Cost: 11})
	// A short window stays regional.
	short := engine.Key{Namespace: "z", Identifier: "short", Window: time.Second}
	for i := 0; i < 12; i++ {
		a.eng.Decide(bg, engine.Limit{Key: short, Limit: 10, Cost: 1})
	}
	a.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_blocklist", ""); n != 0 {
		t.Fatalf("%d rows written; want none", n)
	}
}

func TestOutage_DenialDroppedAtExpiry(t *testing.T) {
	s := newSetup(t)
	eng := engine.New(engine.Config{Now: s.clk.Now, Manual: true})
	defer eng.Close(bg)
	// A port nothing listens on: every write fails fast.
	p, err := New(Config{DSN: "root:@tcp(127.0.0.1:1)/db", Region: "a", Timeout: 100 * time.Millisecond}, eng, Options{Now: s.clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop(bg)
	eng.SetGlobal(p)
	p.ready.Store(true)
	for i := 0; i < 11; i++ {
		eng.Decide(bg, engine.Limit{Key: key("k"), Limit: 10, Cost: 1})
	}
	p.FlushOnce(bg)
	if st := p.Stats(); st.PendingDenials != 1 || st.DroppedBatches < 1 {
		t.Fatalf("after a failed write: %+v", st)
	}
	// Published counts were not marked: they are due again.
	eng.ScanCells(window, func(v *engine.CellView) bool {
		if v.Published != 0 {
			t.Errorf("published mark advanced to %d without a successful write", v.Published)
		}
		return true
	})
	s.clk.Add(2 * window)
	p.FlushOnce(bg)
	if st := p.Stats(); st.PendingDenials != 0 || st.DenialsExpired != 1 {
		t.Fatalf("after expiry: %+v", st)
	}
}

// TestRole_DenialsPastTheBacklogLeaveTheRegionAtTheirExpiry: a flood of
// first denials while MySQL refuses writes leaves more rows in the region
// than the holder keeps pending (maxPendingDenials). The rows past that
// bound were taken at every flush and dropped, and never removed from the
// region (Redis hashes without expiry), nor from the holder's memory of
// what it took, even once they had expired: both grew with every flood
// (10 rows left in each after their expiry, before the fix).
func TestRole_DenialsPastTheBacklogLeaveTheRegionAtTheirExpiry(t *testing.T) {
	const extra = 10
	s, mem, n1 := pastTheBacklog(t, extra)
	n1.p.FlushOnce(bg)
	if st := n1.p.Stats(); st.Role != "holder" || st.PendingDenials != maxPendingDenials {
		t.Fatalf("role %q, %d denials pending; want the holder with %d", st.Role, st.PendingDenials, maxPendingDenials)
	}
	s.clk.Add(3 * window) // every row expired
	n1.p.FlushOnce(bg)
	mem.mu.Lock()
	left := len(mem.denials)
	mem.mu.Unlock()
	n1.p.mu.Lock()
	taken := len(n1.p.taken)
	n1.p.mu.Unlock()
	if left != 0 || taken != 0 {
		t.Fatalf("after every row expired: %d rows left in the region, %d remembered as taken; want none", left, taken)
	}
}

// TestRole_ARowPastTheBacklogIsCountedNotWrittenOnce: a denial row past
// the holder's backlog stays in the region for a later take, and is read
// again at every flush. Each read counted it in
// propagation_denials_not_written_total{reason="queue_full"} again, and
// its expiry there once more (reason "expired"): three flushes of a full
// backlog counted each of 10 rows four times.
func TestRole_ARowPastTheBacklogIsCountedNotWrittenOnce(t *testing.T) {
	const extra = 10
	s, _, n1 := pastTheBacklog(t, extra)
	for range 3 {
		n1.p.FlushOnce(bg)
	}
	s.clk.Add(3 * window) // every row expired
	n1.p.FlushOnce(bg)
	st := n1.p.Stats()
	if got := st.DenialQueueDrops + st.DenialsExpired; got != maxPendingDenials+extra {
		t.Fatalf("%d rows counted not written (%d queue_full, %d expired), want %d, once each",
			got, st.DenialQueueDrops, st.DenialsExpired, maxPendingDenials+extra)
	}
}

// pastTheBacklog is a region whose holder's MySQL refuses writes, holding
// extra first-denial rows more than the holder keeps pending, all of this
// window.
func pastTheBacklog(t *testing.T, extra int) (*setup, *memRegion, *regionNode) {
	t.Helper()
	s := newSetup(t)
	mem := newMemRegion(s.clk)
	n1 := s.regionNode("a", "n1", mem)
	n1.store.failWrites.Store(true)
	w := window.Milliseconds()
	seq := s.clk.ms.Load() / w
	mem.mu.Lock()
	for i := range maxPendingDenials + extra {
		r := BlocklistRow{Namespace: "z", Identifier: "f" + strconv.Itoa(i), WindowMs: w, Sequence: seq,
			Region: "a", Limit: 10, CountCur: 10, ExpiresMs: expiresMs(seq, w)}
		mem.denials[r.cell()] = r
	}
	mem.mu.Unlock()
	return s, mem, n1
}

// TestDenialGossip_AFloodOfFirstDenialsIsWrittenInSeveralBatchesAFlush: a
// flush wrote one batch of denial rows, so with MySQL healthy a region
// wrote about 250 rows a second, and a flood of first denials faster
// than that left most of its rows to expire unwritten (an audit: 58 % of
// 60,255). A backlog is now written at up to maxDenialBatches a flush.
func TestDenialGossip_AFloodOfFirstDenialsIsWrittenInSeveralBatchesAFlush(t *testing.T) {
	s := newSetup(t)
	a := s.region("a", func(c *Config) { c.Batch = 10 })
	const keys = 5 * 10
	for i := range keys {
		a.decide(fmt.Sprintf("k%d", i), 10, 11) // each denied once
	}
	a.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_blocklist", ""); n != keys {
		t.Fatalf("one flush wrote %d rows of %d first denials, in batches of 10", n, keys)
	}
	for i := range maxDenialBatches * 10 * 2 {
		a.decide(fmt.Sprintf("more%d", i), 10, 11)
	}
	a.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_blocklist", ""); n != keys+maxDenialBatches*10 {
		t.Fatalf("a flush wrote %d rows of a backlog of %d, want %d batches of 10", n-keys, maxDenialBatches*10*2, maxDenialBatches)
	}
}
