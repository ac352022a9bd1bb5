package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// TestOverrides_RegionScopeReachesTheOtherNodesThroughRedis: with Redis,
// a PUT is stored in the region (scope region); a change another node
// left in the region reaches this one within a few fast ticks, and a
// process that starts applies the region's overrides from its first
// decision.
func TestOverrides_RegionScopeReachesTheOtherNodesThroughRedis(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion ov-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t}", srv.URL())
	// Another node's change, in the region before this process starts.
	other, err := origin.New(origin.Config{Redis: []string{srv.URL()}}, origin.Options{NodeID: "other"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Close() })
	put := func(id string, limit int64) {
		t.Helper()
		rec := overrideRec{Zone: "ov", Identifier: id, Limit: limit, Region: "ov-test", CreatedMs: time.Now().UnixMilli(), Version: time.Now().UnixMicro()}
		if _, err := other.PutOverrides(context.Background(), []origin.Override{rec.regionValue()}, false); err != nil {
			t.Fatal(err)
		}
	}
	put("early", 0)
	_, admin, base := startCaddy(t, overrideConfig(global))
	if n := admitted(t, base, "early", 1); n != 0 {
		t.Fatalf("the region's limit-0 override set before start admitted %d on the first request", n)
	}
	var doc overrideDoc
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=mine", `{"limit": 7}`).decode(t, http.StatusOK, &doc)
	if doc.Scope != scopeRegion {
		t.Fatalf("scope %q, want region", doc.Scope)
	}
	_, all, err := other.Overrides(context.Background())
	if err != nil || len(all) != 2 {
		t.Fatalf("the region holds %+v (%v), want early and mine", all, err)
	}
	put("late", 0)
	start := time.Now()
	redistest.Eventually(t, 5*time.Second, "another node's change applied here", func() bool { return admitted(t, base, "late", 1) == 0 })
	t.Logf("another node's change applied here within %s", time.Since(start))
}
