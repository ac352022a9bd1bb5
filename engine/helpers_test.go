package engine

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// epoch is a window-aligned start time for tests (aligned to every window
// the tests use: 1 s, 1 min, 1 h, 1 day).
const epoch = int64(1_700_000_000) / 86400 * 86400 * 1000

// newTestEngine returns an engine on a fake clock, closed at test end.
func newTestEngine(t testing.TB, cfg Config) (*Engine, *testclock.Clock) {
	t.Helper()
	clk := testclock.New(time.UnixMilli(epoch))
	if cfg.Now == nil {
		cfg.Now = clk.Now
	}
	e := New(cfg)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = e.Close(ctx)
	})
	return e, clk
}

func lim(id string, window time.Duration, limit, cost int64) Limit {
	return Limit{Key: Key{Namespace: "zone", Identifier: id, Window: window}, Limit: limit, Cost: cost}
}

var bg = context.Background()

// manual is a config whose background loops never tick on their own: the
// tests drive replay with ReplayOnce and the janitor with Sweep.
func manual(c Config) Config {
	c.Manual = true
	if c.ReadTimeout == 0 {
		c.ReadTimeout = 5 * time.Second
	}
	return c
}

func withOrigin(t *testing.T, cfg Config) (*Engine, *testclock.Clock, *memOrigin) {
	t.Helper()
	e, clk := newTestEngine(t, manual(cfg))
	o := newMemOrigin()
	e.SetOrigin(o)
	return e, clk, o
}

// oneCellQueuesEngine is withOrigin with replay queues of one cell each,
// which a test fills to make them refuse a cell.
func oneCellQueuesEngine(t *testing.T) (*Engine, *testclock.Clock, *memOrigin) {
	t.Helper()
	e, clk := newTestEngine(t, manual(Config{}))
	e.queueLen = 1
	o := newMemOrigin()
	e.SetOrigin(o)
	return e, clk, o
}

// replayBoth runs one iteration of both replay ticks, fast first.
func replayBoth(e *Engine) (int, error) {
	n, err := e.ReplayOnce(bg, Fast)
	m, err2 := e.ReplayOnce(bg, Slow)
	if err == nil {
		err = err2
	}
	return n + m, err
}

// waitFor polls cond until it holds or a generous deadline passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// entryOf returns the entry of key, failing the test if there is none.
func entryOf(t *testing.T, e *Engine, key Key) *entry {
	t.Helper()
	en, ok := e.Zone(key.Namespace, key.Window).entries.Load(key.Identifier)
	if !ok {
		t.Fatalf("no entry for %v", key)
	}
	return en
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

// localUnits returns a local-only engine whose key k, with the given
// window and limit, holds 3 units in plain cells, and the key's sequence.
func localUnits(t *testing.T, window time.Duration, limit int64) (*Engine, *testclock.Clock, Limit, int64) {
	t.Helper()
	e, clk := newTestEngine(t, manual(Config{}))
	l := lim("k", window, limit, 1)
	seq := clk.UnixMilli() / window.Milliseconds()
	for i := 0; i < 3; i++ {
		e.Decide(bg, l)
	}
	return e, clk, l, seq
}

// decideN decides l n times, whatever the verdicts.
func decideN(e *Engine, l Limit, n int) {
	for range n {
		e.Decide(bg, l)
	}
}

// admittedOf decides l n times and returns how many were allowed.
func admittedOf(e *Engine, l Limit, n int) int {
	admitted := 0
	for range n {
		if e.Decide(bg, l).Allowed {
			admitted++
		}
	}
	return admitted
}

// stalledWrite runs replay, whose write o holds until release is called
// (at the latest when the test ends), and waits until the write is in
// flight; replayed is closed once replay returns.
func stalledWrite(t *testing.T, e *Engine, o *memOrigin, replay func()) (release func(), replayed <-chan struct{}) {
	t.Helper()
	gate := make(chan struct{})
	o.flushGate.Store(&gate)
	var once sync.Once
	release = func() { once.Do(func() { close(gate) }) }
	t.Cleanup(release)
	done := make(chan struct{})
	go func() {
		defer close(done)
		replay()
	}()
	waitFor(t, "a write in flight", func() bool { return e.stats.flushing.Load() == 1 })
	return release, done
}
