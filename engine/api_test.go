package engine

import (
	"context"
	"sync"
	"testing"
	"time"
)

// TestLimit_ZoneTakesThePlaceOfTheKeysNamespaceAndWindow: a limit with a
// resolved zone counts in that zone, whatever its Key says, as Limit.Zone
// promises.
func TestLimit_ZoneTakesThePlaceOfTheKeysNamespaceAndWindow(t *testing.T) {
	e, _ := newTestEngine(t, Config{})
	z := e.Zone("resolved", time.Minute)
	l := Limit{Key: Key{Namespace: "ignored", Identifier: "k", Window: time.Hour}, Zone: z, Limit: 2, Cost: 1}
	for i := 0; i < 2; i++ {
		if d := e.Decide(bg, l); !d.Allowed || d.Reset != time.Minute {
			t.Fatalf("request %d: %+v, want allowed with the zone's window left (1m)", i, d)
		}
	}
	if e.Decide(bg, l).Allowed {
		t.Fatal("a third request passed a limit of 2")
	}
	if ks, ok := e.Inspect(Key{Namespace: "resolved", Identifier: "k", Window: time.Minute}); !ok || ks.Cells[0].Regional != 2 {
		t.Fatalf("the zone's key holds %+v (found %v), want 2 units", ks, ok)
	}
	if _, ok := e.Inspect(l.Key); ok {
		t.Fatal("the units were counted under the Key's namespace and window")
	}
}

// recordingOrigin is a memOrigin that keeps a copy of every delta flushed.
type recordingOrigin struct {
	*memOrigin
	mu     sync.Mutex
	deltas []Delta
}

func (r *recordingOrigin) Flush(ctx context.Context, batch []Delta) error {
	r.mu.Lock()
	r.deltas = append(r.deltas, batch...)
	r.mu.Unlock()
	return r.memOrigin.Flush(ctx, batch)
}

// TestDelta_OwnIsTheWholeTotalAndEachIncarnationHasItsOwn: each write
// carries this process's absolute total for the cell, Delta included, and
// a key forgotten and made again in the same window writes as a new
// incarnation, from 0, as Delta's fields promise the origin.
func TestDelta_OwnIsTheWholeTotalAndEachIncarnationHasItsOwn(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{}))
	o := &recordingOrigin{memOrigin: newMemOrigin()}
	e.SetOrigin(o)
	l := lim("k", time.Hour, 100, 1)
	seq := clk.UnixMilli() / time.Hour.Milliseconds()
	for _, n := range []int{3, 2} {
		decideN(e, l, n)
		if _, err := replayBoth(e); err != nil {
			t.Fatal(err)
		}
	}
	e.Forget(l.Key)
	e.Decide(bg, l)
	if _, err := replayBoth(e); err != nil {
		t.Fatal(err)
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.deltas) != 3 {
		t.Fatalf("%d deltas flushed, want 3: %+v", len(o.deltas), o.deltas)
	}
	first, second, again := o.deltas[0], o.deltas[1], o.deltas[2]
	for i, d := range o.deltas {
		if d.Key != l.Key || d.Sequence != seq {
			t.Fatalf("delta %d names %v/%d, want %v/%d", i, d.Key, d.Sequence, l.Key, seq)
		}
	}
	if first.Delta != 3 || first.Own != 3 || second.Delta != 2 || second.Own != 5 {
		t.Fatalf("deltas (%d, own %d), (%d, own %d); want (3, own 3), (2, own 5)", first.Delta, first.Own, second.Delta, second.Own)
	}
	if second.Incarnation != first.Incarnation {
		t.Fatal("one cell wrote under two incarnations")
	}
	if again.Incarnation == first.Incarnation || again.Delta != 1 || again.Own != 1 {
		t.Fatalf("after Forget: incarnation %d (before %d), delta %d, own %d; want a new incarnation from 0",
			again.Incarnation, first.Incarnation, again.Delta, again.Own)
	}
	if got := o.total(l.Key, seq); got != 6 {
		t.Fatalf("origin total = %d, want both incarnations' 5 + 1", got)
	}
}
