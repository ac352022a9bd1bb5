package ratelimit

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
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
	st.setOrigin(fakeView{origin.Stats{Restarts: 2, ClockOffsetMs: -2500, Builds: map[string]int64{"v1": 2, "": 1}, Endpoints: []origin.EndpointStats{{
		Address: "redis://127.0.0.1:6379/0", Kind: "standalone", Breaker: origin.BreakerClosed, ReplayBreaker: origin.BreakerOpen,
		Calls: map[string]map[string]uint64{"flush": {"ok": 3}}, RoundTrips: 4, SlowCalls: 1, LastFlush: at,
	}}}})
	// Restarts add those that the process's other origins saw (earlier
	// tests' too): the counter stays monotonic across reloads.
	base, _ := otherOrigins(st.currentOrigin())
	b, err := json.Marshal(redisStatus(st))
	if err != nil {
		t.Fatal(err)
	}
	want := `{"endpoints":[{"address":"redis://127.0.0.1:6379/0","kind":"standalone","breaker":"closed","replay_breaker":"open",` +
		`"calls":{"flush":{"ok":3}},"round_trips":4,"slow_calls":1,"last_read":null,"last_flush":"2023-11-14T22:13:20Z","last_error":"","last_error_at":null}],"restarts":` +
		fmt.Sprint(2+base[restartsStat]) + `,"override_notices":false,"processes":0,"builds":[{"build":"","processes":1},{"build":"v1","processes":2}],"clock_offset_ms":-2500}`
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

// TestRedisStatus_ARestartSeenStaysCountedAcrossAReload: a reload makes a
// new origin, whose own count of Redis restarts starts at 0; the status
// and origin_restarts_total went back to 0 with it, as a counter must not.
func TestRedisStatus_ARestartSeenStaysCountedAcrossAReload(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	global := fmt.Sprintf("\tratelimit {\n\t\tredis %s\n\t}", srv.URL())
	tester, admin, base := startCaddy(t, overrideConfig(global))
	restarts := func() float64 {
		var doc struct {
			Origin struct {
				Restarts float64 `json:"restarts"`
			} `json:"origin"`
		}
		adminDo(t, admin, http.MethodGet, "/ratelimit/status").decode(t, http.StatusOK, &doc)
		return doc.Origin.Restarts
	}
	admitted(t, base, "k", 1)
	o, ok := lookupState().currentOrigin().(*origin.Redis)
	if !ok {
		t.Fatal("the engine has no Redis origin")
	}
	redistest.Eventually(t, 5*time.Second, "the watch read the run ID", func() bool { return o.RunIDChecks() > 0 })
	before := restarts() // what the process's earlier origins saw (other tests')
	srv.Restart()
	redistest.Eventually(t, 10*time.Second, "the restart is seen", func() bool { return restarts() == before+1 })
	changed := fmt.Sprintf("\tratelimit {\n\t\tredis %s\n\t\tread_timeout 60ms\n\t}", srv.URL()) // a new origin
	tester.InitServer(overrideConfig(changed)(admin, portOf(t, base)), "caddyfile")
	if o2, _ := lookupState().currentOrigin().(*origin.Redis); o2 == o {
		t.Fatal("the reload kept the origin: it tests nothing")
	}
	if n := restarts(); n != before+1 {
		t.Fatalf("after a reload the status counts %v restarts, want the %v seen before it", n, before+1)
	}
	var metric float64
	for _, line := range strings.Split(string(adminDo(t, admin, http.MethodGet, "/metrics").body), "\n") {
		if v, ok := strings.CutPrefix(line, "caddy_ratelimit_origin_restarts_total "); ok {
			if _, err := fmt.Sscanf(v, "%g", &metric); err != nil {
				t.Fatal(err)
			}
		}
	}
	if metric != before+1 {
		t.Fatalf("after a reload caddy_ratelimit_origin_restarts_total is %v, want %v", metric, before+1)
	}
}
