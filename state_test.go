package ratelimit

import (
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
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
