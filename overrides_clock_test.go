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

// skewedNode starts this process's Caddy as a node of region ov-test on
// srv whose own clock is off the region's (Redis's) by offset: Redis's
// clock less this node's, as its heartbeats would measure it. Redis and
// this process share the machine's clock, so no reading could show an
// offset: Redis is reached through a proxy that holds each reply 150 ms,
// which makes every heartbeat's reading too slow to use
// (clockSampleMaxRTT), and the offset is set here, where the heartbeats
// would set it. It returns the node's state, admin port and base URL.
func skewedNode(t *testing.T, srv *redistest.Server, offset time.Duration) (*state, int, string) {
	t.Helper()
	proxy := redistest.StartDelayProxy(t, srv.Addr(), 150*time.Millisecond)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion ov-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t}", proxy.URL())
	_, admin, base := startCaddy(t, overrideConfig(global))
	st := lookupState()
	st.engine.SetClockOffset(offset)
	return st, admin, base
}

// putOnRegionClock stores, as another node of the region whose clock is
// Redis's, an override of zone ov that blocks id (limit 0) and lapses
// after life, both on the region's clock now (regionNow).
func putOnRegionClock(t *testing.T, other *origin.Redis, regionNow time.Time, id string, life time.Duration) overrideRec {
	t.Helper()
	rec := overrideRec{Zone: "ov", Identifier: id, Limit: 0, Region: "ov-test",
		CreatedMs: regionNow.UnixMilli(), Version: regionNow.UnixMicro(), ExpiresMs: regionNow.Add(life).UnixMilli()}
	if _, err := other.PutOverrides(context.Background(), []origin.Override{rec.regionValue()}, false); err != nil {
		t.Fatal(err)
	}
	redistest.Eventually(t, 10*time.Second, "the node holds the other node's override", func() bool {
		r, ok := overrides.get("ov", id)
		return ok && r.Version == rec.Version
	})
	return rec
}

// TestOverrides_ANodeAheadAppliesAnOverrideUntilTheRegionsExpiry: an
// override with an absolute expiry, made by a node on the region's clock,
// 20 s before it lapses. A node whose own clock runs 30 s ahead of the
// region's judged it on that clock: lapsed as it heard of it, so it
// admitted the key the other nodes denied for 20 s, answered 404 to its
// removal, and refused an expiry 10 s ahead on the region's clock as not
// in the future.
func TestOverrides_ANodeAheadAppliesAnOverrideUntilTheRegionsExpiry(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	other, _ := otherNode(t, srv)
	st, admin, base := skewedNode(t, srv, -30*time.Second)

	putOnRegionClock(t, other, st.engine.Now(), "ahead", 20*time.Second)
	if n := admitted(t, base, "ahead", 1); n != 0 {
		t.Errorf("the node ahead admitted %d of 1 for a key its region blocks for 20 s more", n)
	}
	if r := adminSend(t, admin, http.MethodDelete, "/ratelimit/overrides?zone=ov&identifier=ahead", ""); r.status != http.StatusOK {
		t.Errorf("removing the live override answered %d %s, want 200", r.status, r.body)
	}

	expires := st.engine.Now().Add(10 * time.Second).UTC().Format(time.RFC3339Nano)
	r := adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=set-ahead", `{"limit": 0, "expires": "`+expires+`"}`)
	if r.status != http.StatusOK {
		t.Fatalf("an override lapsing 10 s ahead on the region's clock answered %d %s, want 200", r.status, r.body)
	}
	if n := admitted(t, base, "set-ahead", 1); n != 0 {
		t.Errorf("the node ahead admitted %d of 1 for a key it blocked itself for 10 s", n)
	}
}

// TestOverrides_ANodeBehindStopsApplyingAnOverrideAtTheRegionsExpiry: a
// node whose own clock runs 30 s behind the region's kept applying an
// override 30 s past its expiry on the region's clock, where the other
// nodes had stopped.
func TestOverrides_ANodeBehindStopsApplyingAnOverrideAtTheRegionsExpiry(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	other, _ := otherNode(t, srv)
	st, _, base := skewedNode(t, srv, 30*time.Second)

	rec := putOnRegionClock(t, other, st.engine.Now(), "behind", 3*time.Second)
	if n := admitted(t, base, "behind", 1); n != 0 {
		t.Fatalf("admitted %d of 1 while the override blocks the key", n)
	}
	redistest.Eventually(t, 10*time.Second, "the override lapses on the region's clock", func() bool {
		return st.engine.Now().UnixMilli() >= rec.ExpiresMs
	})
	if n := admitted(t, base, "behind", 1); n != 1 {
		t.Fatalf("the node behind admitted %d of 1 after the override lapsed on the region's clock", n)
	}
}

// TestOverrides_AChangeOnALaggingNodeComesAfterTheLeadingNodes: another
// node of the region, on the region's clock, blocks a key; an operator
// then raises its limit on a node whose own clock runs 30 s behind. The
// later change must win (its version is after, whatever this node's
// clock says) and be stamped as made after the first: on this node's
// clock it was shown as made 30 s before the change it replaced.
func TestOverrides_AChangeOnALaggingNodeComesAfterTheLeadingNodes(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	other, _ := otherNode(t, srv)
	st, admin, base := skewedNode(t, srv, 30*time.Second)

	first := putOnRegionClock(t, other, st.engine.Now(), "lagging", time.Hour)
	var doc overrideDoc
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=lagging", `{"limit": 6}`).decode(t, http.StatusOK, &doc)
	got, _ := overrides.get("ov", "lagging")
	if got.Limit != 6 || got.Version <= first.Version {
		t.Fatalf("the book holds %+v after %+v", got, first)
	}
	if held := regionRecs(t, other)["lagging"]; held.Version != got.Version || held.Limit != 6 {
		t.Fatalf("the region holds %+v, want the lagging node's change %+v", held, got)
	}
	if got.CreatedMs < first.CreatedMs {
		t.Errorf("the later change is stamped created at %s, %s before the change it replaced",
			time.UnixMilli(got.CreatedMs).UTC().Format(time.RFC3339Nano), time.Duration(first.CreatedMs-got.CreatedMs)*time.Millisecond)
	}
	if !doc.Created.Equal(time.UnixMilli(got.CreatedMs).UTC()) {
		t.Errorf("the PUT answered created %s, the book holds %d", doc.Created, got.CreatedMs)
	}
	if n := admitted(t, base, "lagging", 3); n != 3 {
		t.Errorf("admitted %d of 3 under the raised limit 6", n)
	}
}

// TestOverrides_ExpiryOnTheEnginesClockAllocatesNothing: the request path
// judges a runtime override's expiry on the engine's clock (here a fake
// one, in 2023, where the override has an hour to run; on the process's
// clock it lapsed long ago), and the request costs no allocation more
// than one without an override.
func TestOverrides_ExpiryOnTheEnginesClockAllocatesNothing(t *testing.T) {
	resetOverrides(t)
	clk := useClock(t, 0)
	serveOne := warmRequest(t, "off", 1)
	overrides.merge([]overrideRec{{Zone: "a", Identifier: "203.0.113.7", Limit: 1 << 50, Version: 1,
		ExpiresMs: windowStart.Add(time.Hour).UnixMilli()}})
	if l, ok := runtimeLimit(context.Background(), "a", "203.0.113.7"); !ok || l != 1<<50 {
		t.Fatalf("the override live for an hour on the engine's clock: limit %d, applies %v", l, ok)
	}
	clk.Advance(time.Hour)
	if _, ok := runtimeLimit(context.Background(), "a", "203.0.113.7"); ok {
		t.Fatal("the override applies after its expiry on the engine's clock")
	}
	clk.Advance(-time.Hour)
	if raceEnabled {
		return // the race detector changes allocations
	}
	if got := testing.AllocsPerRun(200, serveOne); got > placeholderAllocs {
		t.Errorf("%.1f allocations per request under an expiring override, want at most %d", got, placeholderAllocs)
	}
}

// TestOverrides_AnOverrideHeardBeforeTheFirstHeartbeatAppliesOnceTheClockIsKnown:
// a node whose clock runs 30 s ahead of its Redis loads the region's
// overrides before a heartbeat has measured Redis's clock (its Redis was
// slow: every reading too slow to use), so on its own clock, where an
// override with 25 s to run on the region's clock has lapsed. When a
// heartbeat then measures the offset, the node must apply the override:
// the set the request path reads was built once, on the clock of then,
// and left it out until the next change.
func TestOverrides_AnOverrideHeardBeforeTheFirstHeartbeatAppliesOnceTheClockIsKnown(t *testing.T) {
	resetOverrides(t)
	const ahead = 30 * time.Second
	if n, ok := pool.References(poolKey); ok {
		t.Fatalf("engine pool still has %d users from an earlier test", n)
	}
	useEngineClock(t, func() time.Time { return time.Now().Add(ahead) })
	srv := redistest.Start(t)
	other, _ := otherNode(t, srv)
	proxy := redistest.StartDelayProxy(t, srv.Addr(), 150*time.Millisecond)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion ov-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t}", proxy.URL())
	_, _, base := startCaddy(t, overrideConfig(global))
	st := lookupState()
	putOnRegionClock(t, other, time.Now(), "first-beat", 25*time.Second) // Redis's clock is this machine's
	if d := st.engine.ClockOffset(); d != 0 {
		t.Fatalf("the engine took offset %s through a slow Redis: the test races nothing", d)
	}
	proxy.SetDelay(0)
	redistest.EventuallyShow(t, 10*time.Second, "a heartbeat measures Redis's clock", func() (bool, string) {
		d := st.engine.ClockOffset()
		return (d + ahead).Abs() < 200*time.Millisecond, d.String()
	})
	if n := admitted(t, base, "first-beat", 1); n != 0 {
		t.Fatalf("admitted %d of 1 for a key the region blocks for 20 s more, once the node decides on the region's clock", n)
	}
}
