package engine

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"
)

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

func TestClose_FlushesPendingUnits(t *testing.T) {
	e, clk := newTestEngine(t, manual(Config{}))
	o := newMemOrigin()
	e.SetOrigin(o)
	l := lim("k", time.Hour, 1000, 1)
	for i := 0; i < 42; i++ {
		e.Decide(bg, l)
	}
	ctx, cancel := context.WithTimeout(bg, 5*time.Second)
	defer cancel()
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if got := o.total(l.Key, clk.UnixMilli()/time.Hour.Milliseconds()); got != 42 {
		t.Fatalf("origin total after Close = %d, want 42", got)
	}
}
