package ratelimit

import (
	"maps"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

func TestLiveApps_NewestProvisionedSpeaksAfterFailedReload(t *testing.T) {
	var o liveApps
	if v := o.view(); v.app != nil || v.logger == nil {
		t.Fatalf("no app: %+v, want the default logger", v)
	}
	running, _ := observedApp(zapcore.InfoLevel, identities{})
	failed, _ := observedApp(zapcore.InfoLevel, identities{secret: []byte("0123456789abcdef")})
	next, _ := observedApp(zapcore.InfoLevel, identities{})
	o.provision(running)
	o.provision(failed) // a reload provisions its app first...
	if o.view().app != failed || !o.view().ids.hashed() {
		t.Fatal("the newest app must speak for the process")
	}
	o.cleanup(failed) // ...and cleans it up when it fails
	if o.view().app != running {
		t.Fatal("after a failed reload the running config's app must speak again")
	}
	o.provision(next)
	o.cleanup(running) // a successful reload cleans up the old app last
	if o.view().app != next {
		t.Fatal("after a reload the new app must speak")
	}
	o.cleanup(next)
	if o.view().app != nil {
		t.Fatal("no app left")
	}
}

func TestPool_EngineClosesWithItsLastUser(t *testing.T) {
	useClock(t, 0)
	base := engineGoroutines()
	a := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("p", 5, time.Minute)}})
	b := &Handler{Zones: []*Zone{zoneOf("p", 5, time.Minute)}, logger: zap.NewNop()}
	if err := b.provision(new(App)); err != nil {
		t.Fatal(err)
	}
	if a.engine != b.engine {
		t.Fatal("two handlers got different engines")
	}
	if n, _ := pool.References(poolKey); n != 2 {
		t.Fatalf("pool has %d references, want 2", n)
	}
	if engineGoroutines() <= base {
		t.Fatal("engine started no background goroutine")
	}
	if err := b.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if err := b.Cleanup(); err != nil { // idempotent
		t.Fatal(err)
	}
	if n, _ := pool.References(poolKey); n != 1 {
		t.Fatalf("pool has %d references, want 1", n)
	}
	if err := a.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if _, ok := pool.References(poolKey); ok {
		t.Fatal("pool still holds the state after its last user left")
	}
	waitNoEngineGoroutines(t)
}

// TestState_SizeChangesAreNamed: a reload that changes max_entries or
// replay_workers cannot resize the running engine; it was ignored without
// a word, and now the app logs both values of each.
func TestState_SizeChangesAreNamed(t *testing.T) {
	cfg := newEngineConfig()
	(&App{MaxEntries: 50}).configureEngine(&cfg)
	st := &state{sized: cfg}
	if f := st.sizeChanges(&App{MaxEntries: 50}); len(f) != 0 {
		t.Fatalf("the same sizes reported as changed: %v", f)
	}
	f := st.sizeChanges(&App{MaxEntries: 3, Origin: &origin.Config{Redis: []string{"redis://127.0.0.1:6379"}, ReplayWorkers: 2}})
	got := map[string]int64{}
	for _, x := range f {
		got[x.Key] = x.Integer
	}
	want := map[string]int64{"max_entries": 50, "config_max_entries": 3, "replay_workers": engine.DefaultReplayWorkers, "config_replay_workers": 2}
	if !maps.Equal(got, want) {
		t.Fatalf("changes %v, want %v", got, want)
	}
}

// TestState_DefaultSizesAreNoChange: a size left out is the engine's
// default, the same engine as one written out. A local-only engine (no
// replay_workers) reloaded into a config with Redis and the default
// replay_workers, or max_entries 1000000 written in one config and left
// out in the next, changed nothing, yet the warning fired with
// replay_workers 0 against 8 (the engine ran with 8 all along).
func TestState_DefaultSizesAreNoChange(t *testing.T) {
	local := newEngineConfig()
	(&App{}).configureEngine(&local)
	st := &state{sized: local}
	withRedis := &App{Origin: &origin.Config{Redis: []string{"redis://127.0.0.1:6379"}}}
	if f := st.sizeChanges(withRedis); len(f) != 0 {
		t.Fatalf("a local-only engine reloaded into Redis with the default replay_workers: changes reported %v", f)
	}
	if f := st.sizeChanges(&App{MaxEntries: engine.DefaultMaxEntries}); len(f) != 0 {
		t.Fatalf("max_entries written as its default: changes reported %v", f)
	}
	redis := newEngineConfig()
	withRedis.configureEngine(&redis)
	st = &state{sized: redis}
	if f := st.sizeChanges(&App{}); len(f) != 0 {
		t.Fatalf("an engine made with Redis reloaded into a local-only config: changes reported %v", f)
	}
}
