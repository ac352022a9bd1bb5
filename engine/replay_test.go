package engine

import (
	"testing"
	"time"
)

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

func TestQueue_HoldsWhatItsCapacityAllowsInOrder(t *testing.T) {
	q := newQueue(2)
	z := &Zone{}
	a, b := newCell(1, true), newCell(2, true)
	if !q.push(z, newEntry("a", 0, true), a) || !q.push(z, newEntry("b", 0, true), b) {
		t.Fatal("a queue of 2 refused a cell")
	}
	if q.push(z, newEntry("c", 0, true), newCell(3, true)) {
		t.Fatal("a full queue took a third cell")
	}
	if q.len() != 2 {
		t.Fatalf("len %d, want 2", q.len())
	}
	for _, want := range []*cell{a, b} {
		if d, ok := q.pop(); !ok || d.cell != want {
			t.Fatalf("pop = %v, %v; want the cells in the order pushed", d, ok)
		}
	}
	if _, ok := q.pop(); ok || q.len() != 0 {
		t.Fatal("an empty queue popped a cell")
	}
}
