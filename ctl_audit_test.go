package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
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
