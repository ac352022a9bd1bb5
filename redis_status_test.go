package ratelimit

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/origin"
)

// TestRedisStatus_SectionIsNullLocalOnlyAndListsEndpoints: the status's
// origin section, from the origin in use.
func TestRedisStatus_SectionIsNullLocalOnlyAndListsEndpoints(t *testing.T) {
	st := new(state)
	if s := redisStatus(st); s != nil {
		t.Fatalf("local-only section %v, want nil (JSON null)", s)
	}
	at := time.UnixMilli(1_700_000_000_000)
	st.setOrigin(fakeView{origin.Stats{Restarts: 2, Endpoints: []origin.EndpointStats{{
		Address: "redis://127.0.0.1:6379/0", Kind: "standalone", Breaker: origin.BreakerClosed, ReplayBreaker: origin.BreakerOpen,
		Calls: map[string]map[string]uint64{"flush": {"ok": 3}}, RoundTrips: 4, SlowCalls: 1, LastFlush: at,
	}}}})
	b, err := json.Marshal(redisStatus(st))
	if err != nil {
		t.Fatal(err)
	}
	want := `{"endpoints":[{"address":"redis://127.0.0.1:6379/0","kind":"standalone","breaker":"closed","replay_breaker":"open",` +
		`"calls":{"flush":{"ok":3}},"round_trips":4,"slow_calls":1,"last_read":null,"last_flush":"2023-11-14T22:13:20Z"}],"restarts":2,"override_notices":false}`
	if string(b) != want {
		t.Fatalf("section\n%s\nwant\n%s", b, want)
	}
}

// TestRedisCollector_SeriesPerEndpoint: slow calls per endpoint, the
// breakers' states (two breakers × three states) and the restarts.
func TestRedisCollector_SeriesPerEndpoint(t *testing.T) {
	useClock(t, 0)
	provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("redis_collector", 1, time.Minute)}})
	st := lookupState()
	st.setOrigin(fakeView{stats: fakeEndpoints("redis://a:6379/0", "redis://b:6379/0", "redis://c:6379/0")})
	t.Cleanup(func() { st.setOrigin(nil) })
	for name, want := range map[string]int{
		"caddy_ratelimit_origin_breaker_state":    3 * 2 * 3,
		"caddy_ratelimit_origin_slow_calls_total": 3,
		"caddy_ratelimit_origin_restarts_total":   1,
	} {
		if got := collectCount(redisCollector{}, name); got != want {
			t.Errorf("%s: %d series, want %d", name, got, want)
		}
	}
	st.setOrigin(nil)
	if got := collectCount(redisCollector{}, "caddy_ratelimit_origin_restarts_total"); got != 0 {
		t.Fatalf("local-only: %d restart series, want none", got)
	}
}
