package engine

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"
)

func TestEngine_LocalOnlyRunsNoReplayLoop(t *testing.T) {
	buf := make([]byte, 1<<20)
	// An earlier test's engine, closed, may still be returning from its
	// loop: Close returns once the loop's deferred Done ran, inside the
	// loop's frame (this test once failed in CI on such a goroutine).
	waitFor(t, "the replay loops of earlier tests to end", func() bool {
		buf = buf[:cap(buf)]
		return !strings.Contains(string(buf[:runtime.Stack(buf, true)]), "replayLoop")
	})
	e := New(Config{})
	defer func() { _ = e.Close(context.Background()) }()
	e.Decide(bg, lim("k", time.Minute, 10, 1))
	buf = buf[:cap(buf)]
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

// TestEngine_SetTimingChangesOnlyWhatItIsGiven: New fills every zero
// setting with its default, and a reload's SetTiming changes the values it
// is given and keeps the others.
func TestEngine_SetTimingChangesOnlyWhatItIsGiven(t *testing.T) {
	e, _ := newTestEngine(t, Config{ReadTimeout: -1, Manual: true})
	want := Timing{ReadTimeout: DefaultReadTimeout, Freshness: DefaultFreshness, SlowTick: DefaultSlowTick, FastTick: DefaultFastTick}
	if got := e.Timing(); got != want {
		t.Fatalf("a new engine's timing = %+v, want the defaults %+v", got, want)
	}
	e.SetTiming(Timing{Freshness: 3 * time.Second, FastTick: 5 * time.Millisecond, SlowTick: -time.Second})
	want.Freshness, want.FastTick = 3*time.Second, 5*time.Millisecond
	if got := e.Timing(); got != want {
		t.Fatalf("timing after SetTiming = %+v, want %+v", got, want)
	}
	if e.freshnessMs() != 3000 || e.fastTickMs() != 5 {
		t.Fatalf("the decisions see freshness %d ms and fast tick %d ms, want 3000 and 5", e.freshnessMs(), e.fastTickMs())
	}
}
