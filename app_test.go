package ratelimit

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"go.uber.org/zap"
)

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

// TestApp_MaxEntriesSizesTheEngine: the first config's max_entries is the
// engine's cap.
func TestApp_MaxEntriesSizesTheEngine(t *testing.T) {
	if _, ok := pool.References(poolKey); ok {
		t.Fatal("the pool is in use by another test")
	}
	st, err := acquireState(&App{MaxEntries: 5})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := releaseState(); err != nil {
			t.Error(err)
		}
	}()
	for i := 0; i < 20; i++ {
		st.engine.Decide(context.Background(), engine.Limit{
			Key:   engine.Key{Namespace: "cap", Identifier: strconv.Itoa(i), Window: time.Minute},
			Limit: 10, Cost: 1,
		})
	}
	st.engine.Evict()
	if n := st.engine.Stats().Entries; n > 5 {
		t.Fatalf("%d live entries with max_entries 5", n)
	}
}
