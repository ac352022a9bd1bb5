package origin

import (
	"testing"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// TestReset_UnitsFromBeforeNeverComeBack: after a reset the cell and the
// one before it say 0; a replay of a total written before the reset adds
// nothing, the units written after it count, in reads, peeks and
// reservations alike.
func TestReset_UnitsFromBeforeNeverComeBack(t *testing.T) {
	srv := redistest.Start(t)
	a := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	b := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "b"})
	ctx, k, seq := ctxT(t), key("reset-me"), nowSeq()
	write := func(o *Redis, s, own int64, inc uint32) {
		t.Helper()
		d := []engine.Delta{{Key: k, Sequence: s, Own: own, Incarnation: inc}}
		if err := o.Flush(ctx, d); err != nil {
			t.Fatal(err)
		}
	}
	write(a, seq-1, 30, 1)
	write(a, seq, 50, 1)
	if cur, prev, _ := readPair(b, ctx, k, seq); cur != 50 || prev != 30 {
		t.Fatalf("before the reset: %d / %d", cur, prev)
	}
	if err := b.ResetCells(ctx, k, seq, 0); err != nil {
		t.Fatal(err)
	}
	if cur, prev, _ := readPair(b, ctx, k, seq); cur != 0 || prev != 0 {
		t.Fatalf("after the reset: %d / %d, want 0 / 0", cur, prev)
	}
	write(a, seq, 50, 1) // a replays what it wrote before: nothing comes back
	write(a, seq, 53, 1) // three units after the reset
	write(b, seq, 4, 1)  // four of another node
	if cur, _, _ := readPair(b, ctx, k, seq); cur != 7 {
		t.Fatalf("after the reset and 7 new units: %d", cur)
	}
	if p, err := a.Peek(ctx, k, seq); err != nil || p.Cur != 7 || p.Prev != 0 {
		t.Fatalf("peek %+v (%v), want 7 / 0", p, err)
	}
	res := reservation(k, seq, 0, 3, 10)
	res.Incarnation = 2
	if err := a.Reserve(ctx, res); err != nil || !res.Admitted {
		t.Fatalf("a reservation of 3 at 7 of 10: %+v (%v)", res, err)
	}
	res = reservation(k, seq, 3, 1, 10)
	res.Incarnation = 2
	if err := a.Reserve(ctx, res); err != nil || res.Admitted || res.Totals.Cur != 10 {
		t.Fatalf("a reservation of 1 at 10 of 10: %+v (%v)", res, err)
	}
}

// TestReset_GlobalTakesOffEachRegionsOwnPast: a cell of region A imports
// regions B and C, which mark resets (version 1 until they mark one), and
// D, which cannot (version 0: a process without Redis). A global reset
// marked here starts the import over. B's units from before its mark,
// published after A marked, count nothing, and B's mark's base takes off
// exactly what B counted before it, so the import never falls; D counts
// what it published since A's mark (its part then is its snapshot). The
// mark is idempotent, a region reset after it still takes the imports
// off, and the region's total is published with the mark.
func TestReset_GlobalTakesOffEachRegionsOwnPast(t *testing.T) {
	srv := redistest.Start(t)
	a := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	ctx, k, seq := ctxT(t), key("global-reset"), nowSeq()
	const v = 1_790_000_000_000_000 // a version: Unix microseconds
	imported := func(what string, want int64, parts ...ImportPart) {
		t.Helper()
		if len(parts) > 0 {
			if err := a.Import(ctx, []RoleImport{{Key: k, Sequence: seq, Parts: parts}}); err != nil {
				t.Fatal(err)
			}
		}
		if tot, err := a.Read(ctx, k, seq, 0); err != nil || tot.Global != want {
			t.Fatalf("%s: the cell imports %d (%v), want %d", what, tot.Global, err, want)
		}
	}
	if err := a.Flush(ctx, []engine.Delta{{Key: k, Sequence: seq, Own: 20, Incarnation: 1}}); err != nil {
		t.Fatal(err)
	}
	imported("before the reset", 10+6+5, ImportPart{Region: "b", Count: 10, ResetVersion: 1},
		ImportPart{Region: "c", Count: 4, Denied: 6, ResetVersion: 1}, ImportPart{Region: "d", Count: 5})
	if err := a.ResetCells(ctx, k, seq, v); err != nil {
		t.Fatal(err)
	}
	imported("at the reset", 0)
	if tot, err := a.CellTotals(ctx, []RoleCell{{Key: k, Sequence: seq}}); err != nil || tot[0] != (CellTotal{Count: 20, ResetVersion: v, ResetBase: 20}) {
		t.Fatalf("the region's total %+v (%v), want 20 with the reset's version and base 20", tot, err)
	}
	// B published 2 units it had admitted before its mark: they count
	// nothing, and B's mark says where its reset was.
	imported("B's late units", 0, ImportPart{Region: "b", Count: 12, ResetVersion: 1})
	imported("B's mark at 12 and one unit since", 1, ImportPart{Region: "b", Count: 13, ResetVersion: v, ResetBase: 12})
	imported("C's mark at 7 and one unit since", 2, ImportPart{Region: "c", Count: 8, Denied: 9, ResetVersion: v, ResetBase: 7})
	imported("an older row of B", 2, ImportPart{Region: "b", Count: 12, ResetVersion: 1})
	imported("D's 3 units since A's mark", 5, ImportPart{Region: "d", Count: 8})
	if err := a.ResetCells(ctx, k, seq, v); err != nil { // heard again
		t.Fatal(err)
	}
	imported("the same reset again", 5)
	if err := a.ResetCells(ctx, k, seq, 0); err != nil { // the region alone
		t.Fatal(err)
	}
	imported("a region reset", 0)
	imported("three more units of B", 3, ImportPart{Region: "b", Count: 16, ResetVersion: v, ResetBase: 12})
	// The cell imports 4 + 1 + 3 = 8 by now (B, C, D), 5 of them from
	// before the region reset.
	// A cell never reset here raises its import as before, whatever the
	// other regions reset: this region takes its old part off when it
	// hears of the reset, not before.
	k2 := key("not-reset-here")
	if err := a.Import(ctx, []RoleImport{{Key: k2, Sequence: seq, Parts: []ImportPart{{Region: "b", Count: 10, ResetVersion: 1}}}}); err != nil {
		t.Fatal(err)
	}
	if err := a.Import(ctx, []RoleImport{{Key: k2, Sequence: seq, Parts: []ImportPart{{Region: "b", Count: 11, ResetVersion: v, ResetBase: 10}}}}); err != nil {
		t.Fatal(err)
	}
	if tot, _ := a.Read(ctx, k2, seq, 0); tot.Global != 10 {
		t.Fatalf("a cell not reset here imports %d after B's reset, want 10 until this region marks", tot.Global)
	}
	if err := a.ResetCells(ctx, k2, seq, v); err != nil {
		t.Fatal(err)
	}
	if tot, _ := a.Read(ctx, k2, seq, 0); tot.Global != 1 {
		t.Fatalf("after this region marks B's reset: %d, want B's one unit since its mark", tot.Global)
	}
	// Without the parts, a cell reset here is left alone and wants them.
	bare := []RoleImport{{Key: k2, Sequence: seq, Count: 50}}
	if err := a.Import(ctx, bare); err != nil || !bare[0].WantsParts {
		t.Fatalf("an import without parts into a cell reset here: wants parts %v (%v)", bare[0].WantsParts, err)
	}
	if tot, _ := a.Read(ctx, k2, seq, 0); tot.Global != 1 {
		t.Fatalf("after an import without parts: %d, want the cell left at 1", tot.Global)
	}
	// A key this region never held is marked all the same, so B's units
	// from before its mark that arrive later count nothing here either.
	k3 := key("never-here")
	if err := a.ResetCells(ctx, k3, seq, v); err != nil {
		t.Fatal(err)
	}
	at, err := srv.Client().Do(ctx, "PEXPIRETIME", cellKey(DefaultPrefix, k3, seq)).Int64()
	if err != nil || at != expireAt(k3, seq).UnixMilli() {
		t.Fatalf("a cell the reset made expires at %d (%v), want %d", at, err, expireAt(k3, seq).UnixMilli())
	}
	if err := a.Import(ctx, []RoleImport{{Key: k3, Sequence: seq, Count: 7 + 4,
		Parts: []ImportPart{{Region: "b", Count: 7, ResetVersion: 1}, {Region: "d", Count: 4}}}}); err != nil {
		t.Fatal(err)
	}
	if tot, _ := a.Read(ctx, k3, seq, 0); tot.Global != 0 || tot.Cur != 0 {
		t.Fatalf("B's and D's units first seen after the reset, in a cell it made: %+v, want nothing", tot)
	}
	if err := a.Import(ctx, []RoleImport{{Key: k3, Sequence: seq, Count: 7 + 6,
		Parts: []ImportPart{{Region: "b", Count: 7, ResetVersion: 1}, {Region: "d", Count: 6}}}}); err != nil {
		t.Fatal(err)
	}
	if tot, _ := a.Read(ctx, k3, seq, 0); tot.Global != 2 {
		t.Fatalf("D's 2 units since: %+v, want 2", tot)
	}
	if err := a.ResetCells(ctx, key("never-here-either"), seq, 0); err != nil {
		t.Fatal(err)
	}
	if n, _ := srv.Client().Exists(ctx, cellKey(DefaultPrefix, key("never-here-either"), seq)).Result(); n != 0 {
		t.Fatal("a region reset made a cell the region did not hold")
	}
}
