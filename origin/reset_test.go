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
	if err := b.ResetCells(ctx, k, seq); err != nil {
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
