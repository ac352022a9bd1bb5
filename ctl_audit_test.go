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

// TestOverrides_A503IsAChangeStoredNowhere: the admin API answers 503 to
// a change "the region's Redis did not take ... stored nowhere" (README).
// A change whose answer from Redis is slow (a saturated Redis, a slow
// link: the reply comes after the call's second) was taken all the same:
// the region holds it and its other nodes apply it. The answer must then
// not be a 503 that says it is stored nowhere.
func TestOverrides_A503IsAChangeStoredNowhere(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	proxy := redistest.StartDelayProxy(t, srv.Addr(), 0)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion ov-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t}", proxy.URL())
	other, _ := otherNode(t, srv)
	_, admin, base := startCaddy(t, overrideConfig(global))
	// A first change loads the script into Redis: the slow one below is
	// one round trip (EVALSHA), which Redis runs at once.
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=warm", `{"limit": 5}`).decode(t, http.StatusOK, &overrideDoc{})

	proxy.SetDelay(1500 * time.Millisecond)
	go func() {
		// Redis's reply to the change is on its way back, held by the
		// proxy; later replies come at once.
		time.Sleep(300 * time.Millisecond)
		proxy.SetDelay(0)
	}()
	r := adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=blocked", `{"limit": 0, "reason": "abuse"}`)
	_, all, err := other.Overrides(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	held := false
	for _, o := range all {
		if rec, ok := recOfRegion(o); ok && rec.Identifier == "blocked" {
			held = true
		}
	}
	t.Logf("answer %d %s; the region holds the change: %v", r.status, r.body, held)
	if r.status == http.StatusServiceUnavailable && held {
		t.Fatalf("the change answered 503 (%s), yet the region holds it and every other node applies it", r.body)
	}
	if r.status == http.StatusOK && !held {
		t.Fatalf("the change answered 200, yet the region does not hold it")
	}
	if held {
		redistest.Eventually(t, 5*time.Second, "the change applied here too", func() bool { return admitted(t, base, "blocked", 1) == 0 })
	}
}

// TestReset_ANodeStartedAfterAResetKeepsItsUnits: another node reset a
// key for the region; this node starts afterwards while Redis does not
// answer it (a slow or cut-off Redis: its first load of the region's
// records times out) and admits the key's limit on its own. When Redis
// answers again it reads the reset's record, made before it started.
// Every unit it holds was admitted after that reset: they must reach the
// region, and the node must not admit the limit a second time.
func TestReset_ANodeStartedAfterAResetKeepsItsUnits(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	proxy := redistest.StartDelayProxy(t, srv.Addr(), 0)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion rs-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t\tread_timeout 50ms\n"+
		"\t\tbreaker_min_requests 2\n\t\tbreaker_timeout 2s\n\t}", proxy.URL())
	other, err := origin.New(origin.Config{Redis: []string{srv.URL()}}, origin.Options{NodeID: "other"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Close() })
	ctx := context.Background()
	k := engine.Key{Namespace: "ov", Identifier: "late", Window: time.Minute}
	seq := time.Now().UnixMilli() / time.Minute.Milliseconds()
	// The other node's region reset, as resetKey makes it, before this
	// node starts.
	now := time.Now()
	if err := other.ResetCells(ctx, k, seq, 0); err != nil {
		t.Fatal(err)
	}
	rec := overrideRec{Zone: "ov", Identifier: "late", Reset: true, Region: "rs-test",
		CreatedMs: now.UnixMilli(), Version: now.UnixMicro(), ExpiresMs: now.Add(2 * time.Minute).UnixMilli()}
	if _, err := other.PutOverrides(ctx, []origin.Override{rec.regionValue()}, false); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	proxy.SetDelay(2 * time.Second) // every call of this node times out
	_, _, base := startCaddy(t, overrideConfig(global))
	if n := admitted(t, base, "late", 2); n != 2 {
		t.Fatalf("cut off, admitted %d of 2 at limit 2", n)
	}
	st := lookupState()
	redistest.Eventually(t, 15*time.Second, "the replay's breaker opens", func() bool {
		o, _ := st.currentOrigin().(*origin.Redis)
		return o != nil && o.Stats().Endpoints[0].ReplayBreaker == origin.BreakerOpen
	})
	proxy.SetDelay(0)
	redistest.Eventually(t, 15*time.Second, "the node read the region's records", func() bool {
		overrides.mu.Lock()
		_, ok := overrides.recs[overrideKey{rec.bookZone(), "late"}]
		overrides.mu.Unlock()
		return ok
	})
	redistest.Eventually(t, 15*time.Second, "nothing left to replay", func() bool { return st.engine.Stats().PendingCells == 0 })
	p, err := other.Peek(ctx, k, seq)
	n := admitted(t, base, "late", 2)
	t.Logf("the region counts %+v (%v); admitted %d more", p, err, n)
	if err != nil || p.Cur != 2 {
		t.Errorf("the region counts %+v (%v), want the 2 units admitted after the reset", p, err)
	}
	if n != 0 {
		t.Errorf("admitted %d more at limit 2 after 2 admitted since the reset", n)
	}
}
