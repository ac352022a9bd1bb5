package ratelimit

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

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
