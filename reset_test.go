package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// TestReset_RegionScopeStaysReset: a key at its limit, counted by this
// node and by another node of the region, is reset for the region: it is
// admitted again at once, the other node's replay of what it had counted
// before brings nothing back, the units after the reset count, and the
// other nodes hear of the reset through the region.
func TestReset_RegionScopeStaysReset(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion rs-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t}", srv.URL())
	_, admin, base := startCaddy(t, overrideConfig(global))
	other, err := origin.New(origin.Config{Redis: []string{srv.URL()}}, origin.Options{NodeID: "other"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Close() })
	ctx := context.Background()
	k := engine.Key{Namespace: "ov", Identifier: "cust", Window: time.Minute}
	seq := time.Now().UnixMilli() / time.Minute.Milliseconds()
	otherWrites := func(own int64) {
		t.Helper()
		if err := other.Flush(ctx, []engine.Delta{{Key: k, Sequence: seq, Own: own, Incarnation: 1}}); err != nil {
			t.Fatal(err)
		}
	}
	otherWrites(1) // the other node admitted one unit
	if n := admitted(t, base, "cust", 3); n != 1 {
		t.Fatalf("with the other node's unit, admitted %d of 3 at limit 2, want 1", n)
	}
	var doc resetDoc
	adminSend(t, admin, http.MethodDelete, "/ratelimit/counters?zone=ov&identifier=cust&scope=region", "").decode(t, http.StatusOK, &doc)
	if !doc.Reset || doc.Scope != scopeRegion {
		t.Fatalf("answer %+v", doc)
	}
	otherWrites(1) // its replay of the unit from before the reset
	if n := admitted(t, base, "cust", 1); n != 1 {
		t.Fatalf("after the reset, admitted %d, want the key to start over", n)
	}
	otherWrites(2) // one unit after the reset at the other node
	if n := admitted(t, base, "cust", 2); n != 0 {
		t.Fatalf("after the reset, 1 here and 1 there, admitted %d more at limit 2, want 0", n)
	}
	if p, err := other.Peek(ctx, k, seq); err != nil || p.Cur != 2 {
		t.Fatalf("the region counts %+v (%v) after the reset, want 2", p, err)
	}
	_, recs, err := other.Overrides(ctx)
	if err != nil || len(recs) != 1 {
		t.Fatalf("the region holds %+v (%v), want the reset's record", recs, err)
	}
	if rec, ok := recOfRegion(recs[0]); !ok || !rec.Reset || rec.Zone != "ov" || rec.Identifier != "cust" {
		t.Fatalf("the region's record %+v (%v)", rec, ok)
	}
}

// TestReset_RefusedRegionResetChangesNothingHere: a region reset that
// Redis cannot take (it is down) answers 503, and this node keeps the
// key's count: it went on denying the key, where it once forgot the key
// before the write failed and admitted a whole limit again.
func TestReset_RefusedRegionResetChangesNothingHere(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion rs-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t}", srv.URL())
	_, admin, base := startCaddy(t, overrideConfig(global))
	if n := admitted(t, base, "cust", 3); n != 2 {
		t.Fatalf("admitted %d of 3 at limit 2, want 2", n)
	}
	srv.Stop()
	r := adminSend(t, admin, http.MethodDelete, "/ratelimit/counters?zone=ov&identifier=cust&scope=region", "")
	if r.status != http.StatusServiceUnavailable {
		t.Fatalf("a region reset with Redis down answered %d %s, want 503", r.status, r.body)
	}
	if n := admitted(t, base, "cust", 2); n != 0 {
		t.Fatalf("after a refused reset, admitted %d more at limit 2, want 0: the node forgot the key", n)
	}
	var doc keyDoc
	adminSend(t, admin, http.MethodGet, "/ratelimit/counters?zone=ov&identifier=cust", "").decode(t, http.StatusOK, &doc)
	if doc.Remaining != 0 {
		t.Fatalf("after a refused reset the key shows %+v, want nothing remaining", doc)
	}
}

// TestReset_ScopesNeedTheirBackends: a reset beyond this node needs the
// region's Redis (and global the cross-region layer); an unknown scope is
// a 400; scope on a GET is a 400; nothing is forgotten then.
func TestReset_ScopesNeedTheirBackends(t *testing.T) {
	resetOverrides(t)
	_, admin, base := startCaddy(t, overrideConfig(""))
	admitted(t, base, "cust", 3)
	for _, c := range []struct{ method, query string }{
		{http.MethodDelete, "zone=ov&identifier=cust&scope=region"},
		{http.MethodDelete, "zone=ov&identifier=cust&scope=global"}, // no Redis, no MySQL
		{http.MethodDelete, "zone=ov&identifier=cust&scope=everywhere"},
		{http.MethodGet, "zone=ov&identifier=cust&scope=node"},
	} {
		if r := adminSend(t, admin, c.method, "/ratelimit/counters?"+c.query, ""); r.status != http.StatusBadRequest {
			t.Errorf("%s %s: %d %s, want 400", c.method, c.query, r.status, r.body)
		}
	}
	if n := admitted(t, base, "cust", 1); n != 0 {
		t.Fatal("a refused reset forgot the key")
	}
	var doc forgetDoc
	adminSend(t, admin, http.MethodDelete, "/ratelimit/counters?zone=ov&identifier=cust&scope=node", "").decode(t, http.StatusOK, &doc)
	if !doc.Forgotten {
		t.Fatalf("scope=node answered %+v", doc)
	}
}
