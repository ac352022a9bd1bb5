package ratelimit

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// TestCaddy_RedisSlowForAMoment walks the README's row "Redis slow or
// failing for a moment" (What failures look like) through Caddy, Redis
// behind a proxy that holds its replies 300 ms for a while: each request
// for a new key waits at most about read_timeout (50 ms), the waits that
// ran out are counted (read_wait_timeouts_total, origin_calls_total's
// timeouts), the streak is logged from its fifth failure, and its end once
// a call succeeds again.
func TestCaddy_RedisSlowForAMoment(t *testing.T) {
	window, ok := testclock.FreshWindow(time.Now(), time.Minute, 2*time.Minute, 40*time.Second)
	if !ok {
		t.Fatal("no window length in [1m, 2m] leaves 40 s")
	}
	srv := redistest.Start(t)
	proxy := redistest.StartDelayProxy(t, srv.Addr(), 0)
	t.Setenv("RATELIMIT_TEST_REDIS_URL", proxy.URL())
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	admin, port := e2eAdminPort(t), redistest.MustFreePort(t)
	base := fmt.Sprintf("http://127.0.0.1:%d/", port)
	tester := caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{AdminPort: admin})
	tester.InitServer(redisConfig(admin, port, fmt.Sprintf(`	log {
		output file %s
		format json
		level INFO
	}
	ratelimit {
		redis {env.RATELIMIT_TEST_REDIS_URL}
		prefix slowmoment
		read_timeout 50ms
	}`, logFile), window), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	defer tester.InitServer(e2eConfig(admin, port, ""), "caddyfile") // unload: the next test starts without an engine
	logged := func(msg string) bool {
		for _, l := range readLog(t, logFile) {
			if l["msg"] == msg {
				return true
			}
		}
		return false
	}
	get(t, tester, base, "X-Key", "warm-up").expect(t, 200, "ok")
	m0 := scrape(t, admin)

	proxy.SetDelay(300 * time.Millisecond)
	var slowest time.Duration
	for i := range 8 {
		start := time.Now()
		get(t, tester, base, "X-Key", fmt.Sprintf("slow-%d", i)).expect(t, 200, "ok")
		slowest = max(slowest, time.Since(start))
	}
	if slowest > 250*time.Millisecond {
		t.Errorf("a request waited %s for a Redis 300 ms slow, read_timeout 50ms", slowest)
	}
	m := scrape(t, admin)
	if d := m["caddy_ratelimit_read_wait_timeouts_total"] - m0["caddy_ratelimit_read_wait_timeouts_total"]; d < 1 {
		t.Errorf("read_wait_timeouts_total rose by %v over 8 reads that ran out of time", d)
	}
	if d := m[`caddy_ratelimit_cell_reads_total{outcome="error"}`] - m0[`caddy_ratelimit_cell_reads_total{outcome="error"}`]; d < 1 {
		t.Errorf("cell_reads_total{outcome=error} rose by %v over 8 reads that ran out of time", d)
	}
	if d := failedCalls(m) - failedCalls(m0); d < 1 {
		t.Errorf("origin_calls_total{outcome=timeout or error} rose by %v over 8 reads that ran out of time", d)
	}
	redistest.Eventually(t, 5*time.Second, "the streak's line", func() bool {
		return logged("redis calls failing: decisions use local counts until they recover")
	})

	proxy.SetDelay(0)
	n := 0
	redistest.Eventually(t, 15*time.Second, "the streak's end", func() bool {
		n++
		get(t, tester, base, "X-Key", fmt.Sprintf("back-%d", n)).expect(t, 200, "ok")
		return logged("redis calls succeed again")
	})
}

// failedCalls sums the origin calls that timed out or failed, over every
// endpoint and operation.
func failedCalls(m map[string]float64) float64 {
	var n float64
	for series, v := range m {
		if strings.HasPrefix(series, "caddy_ratelimit_origin_calls_total{") &&
			(strings.Contains(series, `outcome="timeout"`) || strings.Contains(series, `outcome="error"`)) {
			n += v
		}
	}
	return n
}
