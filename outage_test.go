package ratelimit

import (
	"context"
	"fmt"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// TestCaddy_RedisDownAcrossAReloadAndBack walks the README's rows "Redis
// down" and "Redis back" (What failures look like) through Caddy, with a
// reload that keeps the Redis in the middle of the outage: the metrics and
// the log lines the rows name appear, the units admitted while Redis was
// away reach the Redis that comes back (restarted empty) exactly once,
// both breakers close again, nothing stays pending, and the goroutines
// the outage started end. The breakers that opened were the old config's:
// the new one's start closed, so no "closed" line follows the "open" ones,
// and "redis calls succeed again" says that Redis answers.
func TestCaddy_RedisDownAcrossAReloadAndBack(t *testing.T) {
	window, ok := testclock.FreshWindow(time.Now(), time.Minute, 2*time.Minute, 50*time.Second)
	if !ok {
		t.Fatal("no window length in [1m, 2m] leaves 50 s")
	}
	srv := redistest.Start(t)
	t.Setenv("RATELIMIT_TEST_REDIS_URL", srv.URL())
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	endpoint := fmt.Sprintf("redis://127.0.0.1:%d/0", srv.Port())
	admin, port := e2eAdminPort(t), redistest.MustFreePort(t)
	base := fmt.Sprintf("http://127.0.0.1:%d/", port)
	tester := caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{AdminPort: admin})
	config := func(readTimeout string) string {
		return redisConfig(admin, port, fmt.Sprintf(`	log {
		output file %s
		format json
		level DEBUG
	}
	ratelimit {
		redis {env.RATELIMIT_TEST_REDIS_URL}
		prefix outage
		fast_tick 20ms
		slow_tick 500ms
		read_timeout %s
		breaker_timeout 1s
	}`, logFile, readTimeout), window)
	}
	tester.InitServer(config("50ms"), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	defer tester.InitServer(e2eConfig(admin, port, ""), "caddyfile") // unload: the next test starts without an engine

	key := "outage:{e2e_redis:gina}:" + strconv.FormatInt(window.Milliseconds(), 10) + ":" +
		strconv.FormatInt(time.Now().UnixMilli()/window.Milliseconds(), 10) + ":c"
	holds := func(want int64, what string) {
		t.Helper()
		redistest.EventuallyShow(t, 15*time.Second, what, func() (bool, string) {
			n, err := srv.Client().HGet(context.Background(), key, "t").Int64()
			return err == nil && n == want, fmt.Sprintf("Redis holds %d (%v)", n, err)
		})
	}
	gauge := func(m map[string]float64, breaker, state string) float64 {
		return m[fmt.Sprintf(`caddy_ratelimit_origin_breaker_state{breaker=%q,endpoint=%q,state=%q}`, breaker, endpoint, state)]
	}
	logged := func(msg, breaker string) bool {
		for _, l := range readLog(t, logFile) {
			if l["msg"] == msg && l["endpoint"] == endpoint && (breaker == "" || l["breaker"] == breaker) {
				return true
			}
		}
		return false
	}

	defer func() { // the limiter's own lines, to read a failure by
		if !t.Failed() {
			return
		}
		for _, l := range readLog(t, logFile) {
			if msg, _ := l["msg"].(string); l["logger"] == "ratelimit" && !strings.HasPrefix(msg, "redis client: ") {
				t.Logf("%v %v %v breaker=%v to=%v error=%v", l["ts"], l["level"], msg, l["breaker"], l["to"], l["error"])
			}
		}
	}()

	for range 2 {
		get(t, tester, base, "X-Key", "gina").expect(t, 200, "ok")
	}
	holds(2, "Redis holds gina's 2 units")
	goroutines := runtime.NumGoroutine()

	// Redis down: both breakers open, the request path's on the requests'
	// failed reads, replay's on its failed flushes.
	srv.Stop()
	for range 2 {
		get(t, tester, base, "X-Key", "gina").expect(t, 200, "ok")
	}
	n := 0
	redistest.EventuallyShow(t, 20*time.Second, "both breakers open", func() (bool, string) {
		n++
		get(t, tester, base, "X-Key", fmt.Sprintf("other-%d", n)).expect(t, 200, "ok")
		m := scrape(t, admin)
		return gauge(m, "ratelimit_origin", "open") == 1 && gauge(m, "ratelimit_origin_replay", "open") == 1,
			fmt.Sprintf("request path open %v, replay open %v", gauge(m, "ratelimit_origin", "open"), gauge(m, "ratelimit_origin_replay", "open"))
	})
	m := scrape(t, admin)
	if p := m["caddy_ratelimit_replay_pending_cells"]; p < 1 {
		t.Errorf("replay_pending_cells %v with gina's units waiting", p)
	}
	// The request path's breaker refuses the next request's call at no
	// cost.
	rejected := func() float64 {
		m := scrape(t, admin)
		return m[fmt.Sprintf(`caddy_ratelimit_origin_calls_total{endpoint=%q,op="read",outcome="rejected"}`, endpoint)]
	}
	before := rejected()
	get(t, tester, base, "X-Key", "a-new-key-while-open").expect(t, 200, "ok")
	if after := rejected(); after <= before {
		t.Errorf("origin_calls_total{op=read,outcome=rejected} stayed at %v with the breaker open", after)
	}
	for _, msg := range []string{"redis calls failing: decisions use local counts until they recover"} {
		redistest.Eventually(t, 5*time.Second, msg, func() bool { return logged(msg, "") })
	}
	redistest.Eventually(t, 5*time.Second, "the open lines", func() bool {
		return logged("redis circuit breaker open: decisions use local counts", "ratelimit_origin") &&
			logged("redis circuit breaker open: replay holds counts until redis answers", "ratelimit_origin_replay")
	})
	// Replay's breaker probes with its ticks while Redis stays down; no
	// flush succeeds.
	lastFlush := scrape(t, admin)["caddy_ratelimit_last_flush_timestamp_seconds"]
	redistest.Eventually(t, 10*time.Second, "replay's breaker probes", func() bool {
		return logged("redis circuit breaker half-open: probing", "ratelimit_origin_replay")
	})
	if lf := scrape(t, admin)["caddy_ratelimit_last_flush_timestamp_seconds"]; lf != lastFlush {
		t.Errorf("last_flush_timestamp_seconds moved from %v to %v with Redis down", lastFlush, lf)
	}

	// A reload that keeps the Redis, mid-outage: the new origin takes over
	// the units waiting.
	tester.InitServer(config("60ms"), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	get(t, tester, base, "X-Key", "a-new-key-after-the-reload").expect(t, 200, "ok")

	// Redis back, empty: gina's 4 units reach it, once.
	srv.Restart()
	holds(4, "Redis holds gina's 4 units once it is back")
	get(t, tester, base, "X-Key", "gina").expect(t, 200, "ok")
	holds(5, "Redis holds gina's 5 units")
	redistest.EventuallyShow(t, 15*time.Second, "both breakers closed", func() (bool, string) {
		n++
		get(t, tester, base, "X-Key", fmt.Sprintf("back-%d", n)).expect(t, 200, "ok")
		m := scrape(t, admin)
		return gauge(m, "ratelimit_origin", "closed") == 1 && gauge(m, "ratelimit_origin_replay", "closed") == 1,
			fmt.Sprintf("request path closed %v, replay closed %v", gauge(m, "ratelimit_origin", "closed"), gauge(m, "ratelimit_origin_replay", "closed"))
	})
	redistest.EventuallyShow(t, 5*time.Second, "nothing pending", func() (bool, string) {
		p := scrape(t, admin)["caddy_ratelimit_replay_pending_cells"]
		return p == 0, fmt.Sprintf("replay_pending_cells %v", p)
	})
	redistest.Eventually(t, 5*time.Second, "the recovery's line", func() bool {
		return logged("redis calls succeed again", "")
	})
	if lf := scrape(t, admin)["caddy_ratelimit_last_flush_timestamp_seconds"]; lf <= lastFlush {
		t.Errorf("last_flush_timestamp_seconds still %v after Redis came back", lf)
	}
	holds(5, "Redis still holds gina's 5 units, none twice")

	// What the outage started ends with it (the test's own HTTP client
	// keeps a few connections: some slack).
	redistest.EventuallyShow(t, 10*time.Second, "the goroutines end", func() (bool, string) {
		n := runtime.NumGoroutine()
		return n <= goroutines+10, fmt.Sprintf("%d goroutines, %d before the outage", n, goroutines)
	})
}
