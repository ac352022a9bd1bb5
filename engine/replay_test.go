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
