package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// redisConfig is a Caddyfile whose global options are global (a ratelimit
// block pointing the engine at Redis, or nothing) and whose one zone is
// keyed by X-Key, over window.
func redisConfig(admin, port int, global string, window time.Duration) string {
	return caddyConfig(admin, port, global, fmt.Sprintf(`
	handle {
		ratelimit {
			zone e2e_redis {
				key    {http.request.header.X-Key}
				limit  5
				window %ds
			}
		}
		respond "ok"
	}`, int64(window/time.Second)))
}

// TestCaddy_RedisOrigin runs Caddy in-process against a private Redis: the
// counts reach Redis, a key another node filled is denied on its first
// request here, and a reload without Redis leaves the engine local-only.
func TestCaddy_RedisOrigin(t *testing.T) {
	srv := redistest.Start(t, redistest.WithPassword("origin-e2e-pw"))
	t.Setenv("RATELIMIT_TEST_REDIS_URL", srv.URL())
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr(), Password: "origin-e2e-pw"})
	t.Cleanup(func() { rdb.Close() })
	ctx := context.Background()

	// Redis keys expire by wall-clock time, so the engine runs on it: the
	// window is a length whose current window just began, and the test runs
	// inside it (it needs a few seconds at most).
	window, ok := testclock.FreshWindow(time.Now(), time.Minute, 2*time.Minute, 30*time.Second)
	if !ok {
		t.Fatal("no window length in [1m, 2m] leaves 30 s")
	}
	admin, port := e2eAdminPort(t), redistest.MustFreePort(t)
	base := fmt.Sprintf("http://127.0.0.1:%d/", port)
	tester := caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{AdminPort: admin})
	tester.InitServer(redisConfig(admin, port, `	ratelimit {
		redis {env.RATELIMIT_TEST_REDIS_URL}
		prefix e2e
	}`, window), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	st := lookupState()
	if st == nil || st.engine.Origin() == nil {
		t.Fatal("the engine has no origin after loading a config with redis")
	}

	// Another node already used bob's quota in this window.
	windowMs := strconv.FormatInt(window.Milliseconds(), 10)
	seq := strconv.FormatInt(time.Now().UnixMilli()/window.Milliseconds(), 10)
	bobKey := "e2e:{e2e_redis:bob}:" + windowMs + ":" + seq + ":c"
	if err := rdb.HSet(ctx, bobKey, "t", 5).Err(); err != nil {
		t.Fatal(err)
	}
	get(t, tester, base, "X-Key", "bob").expect(t, 429, "")

	for i := 0; i < 5; i++ {
		get(t, tester, base, "X-Key", "alice").expect(t, 200, "ok")
	}
	get(t, tester, base, "X-Key", "alice").expect(t, 429, "")
	// The five units reach Redis on the replay ticks, without more traffic.
	aliceKey := "e2e:{e2e_redis:alice}:" + windowMs + ":" + seq + ":c"
	redistest.Eventually(t, 10*time.Second, "Redis holds alice's 5 units", func() bool {
		n, err := rdb.HGet(ctx, aliceKey, "t").Int64()
		return err == nil && n == 5
	})

	t.Run("config output keeps the placeholder", func(t *testing.T) {
		body := adminDo(t, admin, http.MethodGet, "/config/").body
		if strings.Contains(string(body), "origin-e2e-pw") {
			t.Fatal("the admin API's /config/ shows the Redis password")
		}
		if !strings.Contains(string(body), "{env.RATELIMIT_TEST_REDIS_URL}") {
			t.Fatal("the /config/ output lost the placeholder")
		}
	})

	t.Run("reload without redis is local-only", func(t *testing.T) {
		tester.InitServer(redisConfig(admin, port, "", window), "caddyfile")
		if t.Failed() {
			t.FailNow()
		}
		if lookupState() != st {
			t.Fatal("the reload replaced the engine")
		}
		if o := st.engine.Origin(); o != nil {
			t.Fatalf("the engine still uses origin %v after a reload without redis", o)
		}
		// The counts stay: alice is still denied.
		get(t, tester, base, "X-Key", "alice").expect(t, 429, "")
	})

	t.Run("unload", func(t *testing.T) {
		tester.InitServer(e2eConfig(admin, port, ""), "caddyfile")
		if _, ok := pool.References(poolKey); ok {
			t.Fatal("engine pool still in use after unloading")
		}
		waitNoEngineGoroutines(t)
	})
}

// TestOrigin_FollowsTheNewestStartedConfig walks the origin through the
// lifecycles of two configs: a reload hands the engine to the new config's
// origin, a new config that fails to start hands it back, and the last
// config to stop leaves the engine local-only.
func TestOrigin_FollowsTheNewestStartedConfig(t *testing.T) {
	if _, ok := pool.References(poolKey); ok {
		t.Fatal("the pool is in use by another test")
	}
	newApp := func(port int) *App {
		// Nothing dials: no decision is made, so nothing is read or flushed.
		cfg := origin.Config{Redis: []string{fmt.Sprintf("redis://127.0.0.1:%d", port)}}
		o, err := origin.New(cfg, origin.Options{})
		if err != nil {
			t.Fatal(err)
		}
		st, err := acquireState(nil)
		if err != nil {
			t.Fatal(err)
		}
		a := &App{Origin: &cfg, state: st, logger: zap.NewNop()}
		a.backends = []backend{&redisBackend{a: a, origin: o, engineOrigin: o}, nil}
		t.Cleanup(func() { o.Close() })
		return a
	}
	a, b := newApp(1), newApp(2)
	defer func() {
		for range 2 {
			if err := releaseState(); err != nil {
				t.Error(err)
			}
		}
	}()
	eng := a.state.engine
	using := func(want *App, when string) {
		t.Helper()
		got := eng.Origin()
		switch {
		case want == nil && got != nil:
			t.Fatalf("%s: engine uses %v, want local-only", when, got)
		case want != nil && got != engine.Origin(want.backends[0].(*redisBackend).origin):
			t.Fatalf("%s: engine uses %v, want %v", when, got, want.backends[0])
		}
	}

	a.state.start(a)
	using(a, "A started")
	b.state.start(b)
	using(b, "reload: B started")
	b.state.stop(b, false) // B failed to start: Caddy stops what it started
	using(a, "B stopped while A runs")
	b.state.start(b)
	a.state.stop(a, false) // the reload completes: the old config stops
	using(b, "A stopped after B started")
	b.state.stop(b, false) // the last config's Stop: its HTTP server may still serve
	using(b, "last config's Stop")
	b.state.stop(b, true) // its Cleanup, once every app has stopped
	using(nil, "last config cleaned up")
	b.state.stop(b, true)
	using(nil, "cleaned up twice")
}

// TestCaddy_ReloadWithoutRedisWritesPendingUnits is the review's case: a
// reload that removes redis from the config detached the origin at once,
// and units admitted but not yet replayed never reached Redis. Now the old
// config's origin writes them as it stops; and when Redis cannot take
// them, they are counted as lost (replay_lost_units_total) and logged.
func TestCaddy_ReloadWithoutRedisWritesPendingUnits(t *testing.T) {
	window, ok := testclock.FreshWindow(time.Now(), time.Minute, 2*time.Minute, 30*time.Second)
	if !ok {
		t.Fatal("no window length in [1m, 2m] leaves 30 s")
	}
	for _, redisDown := range []bool{false, true} {
		t.Run(fmt.Sprintf("redis down %v", redisDown), func(t *testing.T) {
			srv := redistest.Start(t)
			t.Setenv("RATELIMIT_TEST_REDIS_URL", srv.URL())
			rdb := srv.Client()
			admin, port := e2eAdminPort(t), redistest.MustFreePort(t)
			base := fmt.Sprintf("http://127.0.0.1:%d/", port)
			tester := caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{AdminPort: admin})
			// Ticks of a minute: nothing replays on its own during the test.
			tester.InitServer(redisConfig(admin, port, `	ratelimit {
		redis {env.RATELIMIT_TEST_REDIS_URL}
		prefix pend
		slow_tick 1m
		fast_tick 1m
	}`, window), "caddyfile")
			if t.Failed() {
				t.FailNow()
			}
			defer tester.InitServer(e2eConfig(admin, port, ""), "caddyfile") // unload: the next test starts without an engine
			st := lookupState()
			lost := st.engine.Stats().LostUnits
			id := fmt.Sprintf("carol-%v", redisDown)
			for i := 0; i < 4; i++ {
				get(t, tester, base, "X-Key", id).expect(t, 200, "ok")
			}
			key := "pend:{e2e_redis:" + id + "}:" + strconv.FormatInt(window.Milliseconds(), 10) + ":" +
				strconv.FormatInt(time.Now().UnixMilli()/window.Milliseconds(), 10) + ":c"
			if n, _ := rdb.HGet(context.Background(), key, "t").Int64(); n != 0 {
				t.Fatalf("Redis holds %d before the reload: the units were replayed already", n)
			}
			if redisDown {
				srv.Stop()
			}
			tester.InitServer(redisConfig(admin, port, "", window), "caddyfile")
			if t.Failed() {
				t.FailNow()
			}
			if redisDown {
				if got := st.engine.Stats().LostUnits - lost; got != 4 {
					t.Fatalf("lost units counted: %d, want the 4 Redis could not take", got)
				}
				return
			}
			if n, err := rdb.HGet(context.Background(), key, "t").Int64(); err != nil || n != 4 {
				t.Fatalf("Redis holds %d (%v) after the reload without redis, want the 4 admitted units", n, err)
			}
			if got := st.engine.Stats().LostUnits - lost; got != 0 {
				t.Fatalf("lost units counted: %d, want 0", got)
			}
		})
	}
}

// TestCaddy_ReloadToAnotherRedisCarriesTheCounts: a reload points the
// node at another Redis. What it had replayed to the first one was not in
// the second, so a node reading the key there (one started since, or one
// whose view lapsed) admitted it all again: before the fix Redis B held 0
// of dave's 4 units. Then a reload without Redis, a request, and one with
// Redis B again: B gets that unit too.
func TestCaddy_ReloadToAnotherRedisCarriesTheCounts(t *testing.T) {
	window, ok := testclock.FreshWindow(time.Now(), time.Minute, 2*time.Minute, 30*time.Second)
	if !ok {
		t.Fatal("no window length in [1m, 2m] leaves 30 s")
	}
	a, b := redistest.Start(t), redistest.Start(t)
	t.Setenv("RATELIMIT_TEST_REDIS_A", a.URL())
	t.Setenv("RATELIMIT_TEST_REDIS_B", b.URL())
	admin, port := e2eAdminPort(t), redistest.MustFreePort(t)
	base := fmt.Sprintf("http://127.0.0.1:%d/", port)
	tester := caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{AdminPort: admin})
	withRedis := func(env string) string {
		return redisConfig(admin, port, `	ratelimit {
		redis {env.`+env+`}
		prefix moved
	}`, window)
	}
	tester.InitServer(withRedis("RATELIMIT_TEST_REDIS_A"), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	defer tester.InitServer(e2eConfig(admin, port, ""), "caddyfile") // unload: the next test starts without an engine
	key := "moved:{e2e_redis:dave}:" + strconv.FormatInt(window.Milliseconds(), 10) + ":" +
		strconv.FormatInt(time.Now().UnixMilli()/window.Milliseconds(), 10) + ":c"
	holds := func(srv *redistest.Server, want int64, what string) {
		t.Helper()
		redistest.Eventually(t, 10*time.Second, what, func() bool {
			n, err := srv.Client().HGet(context.Background(), key, "t").Int64()
			return err == nil && n == want
		})
	}
	for range 4 {
		get(t, tester, base, "X-Key", "dave").expect(t, 200, "ok")
	}
	holds(a, 4, "Redis A holds dave's 4 units")
	tester.InitServer(withRedis("RATELIMIT_TEST_REDIS_B"), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	holds(b, 4, "Redis B holds dave's 4 units after the reload to it")

	tester.InitServer(redisConfig(admin, port, "", window), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	get(t, tester, base, "X-Key", "dave").expect(t, 200, "ok") // counted without Redis
	tester.InitServer(withRedis("RATELIMIT_TEST_REDIS_B"), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	holds(b, 5, "Redis B holds dave's 5 units once the node has Redis again")
}

// TestCaddy_ReloadToAnotherSecretCarriesTheCounts: a reload that changes
// identifier_secret renames every key in Redis (its name holds the
// identifier's HMAC). The node's units were under the old names, so a
// node reading the key under its new name (one started since, or one
// whose view lapsed) admitted it all again: before the fix Redis held
// none of erin's 4 units under the new name.
func TestCaddy_ReloadToAnotherSecretCarriesTheCounts(t *testing.T) {
	window, ok := testclock.FreshWindow(time.Now(), time.Minute, 2*time.Minute, 30*time.Second)
	if !ok {
		t.Fatal("no window length in [1m, 2m] leaves 30 s")
	}
	srv := redistest.Start(t)
	t.Setenv("RATELIMIT_TEST_REDIS_URL", srv.URL())
	admin, port := e2eAdminPort(t), redistest.MustFreePort(t)
	base := fmt.Sprintf("http://127.0.0.1:%d/", port)
	tester := caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{AdminPort: admin})
	withSecret := func(secret string) string {
		return redisConfig(admin, port, `	ratelimit {
		redis {env.RATELIMIT_TEST_REDIS_URL}
		prefix renamed
		identifier_secret `+secret+`
	}`, window)
	}
	const first, second = "first-secret-of-32-bytes-or-more!", "second-secret-of-32-bytes-or-more"
	keyUnder := func(secret string) string {
		return "renamed:{e2e_redis:" + identifierHMAC([]byte(secret), "erin") + "}:" + strconv.FormatInt(window.Milliseconds(), 10) + ":" +
			strconv.FormatInt(time.Now().UnixMilli()/window.Milliseconds(), 10) + ":c"
	}
	holds := func(key string, want int64, what string) {
		t.Helper()
		redistest.Eventually(t, 10*time.Second, what, func() bool {
			n, err := srv.Client().HGet(context.Background(), key, "t").Int64()
			return err == nil && n == want
		})
	}
	tester.InitServer(withSecret(first), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	defer tester.InitServer(e2eConfig(admin, port, ""), "caddyfile") // unload: the next test starts without an engine
	for range 4 {
		get(t, tester, base, "X-Key", "erin").expect(t, 200, "ok")
	}
	holds(keyUnder(first), 4, "Redis holds erin's 4 units under the first secret's name")
	tester.InitServer(withSecret(second), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	holds(keyUnder(second), 4, "Redis holds erin's 4 units under the second secret's name after the reload")
}

// TestCaddy_RedisRestartedAroundAReloadGetsTheCountsBack: a reload that
// keeps the Redis makes a new origin, whose restart watch took the first
// run ID (and mark) it read for its reference. A Redis that restarted
// empty (or was flushed) after the old origin's last check and before the
// new one's first went unseen by both: frank's 4 units were lost from
// Redis for good, and a node reading the key there admitted them again.
// The new origin starts from what the old one saw (TakeWatchFrom).
func TestCaddy_RedisRestartedAroundAReloadGetsTheCountsBack(t *testing.T) {
	window, ok := testclock.FreshWindow(time.Now(), time.Minute, 2*time.Minute, 40*time.Second)
	if !ok {
		t.Fatal("no window length in [1m, 2m] leaves 40 s")
	}
	for _, loss := range []string{"restart", "FLUSHALL"} {
		t.Run(loss, func(t *testing.T) {
			srv := redistest.Start(t)
			t.Setenv("RATELIMIT_TEST_REDIS_URL", srv.URL())
			admin, port := e2eAdminPort(t), redistest.MustFreePort(t)
			base := fmt.Sprintf("http://127.0.0.1:%d/", port)
			tester := caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{AdminPort: admin})
			// The watch checks every slow tick: 2 s, far longer than a
			// restart and a reload take.
			withRedis := func(readTimeout string) string {
				return redisConfig(admin, port, `	ratelimit {
		redis {env.RATELIMIT_TEST_REDIS_URL}
		prefix around
		fast_tick 20ms
		slow_tick 2s
		read_timeout `+readTimeout+`
	}`, window)
			}
			tester.InitServer(withRedis("50ms"), "caddyfile")
			if t.Failed() {
				t.FailNow()
			}
			defer tester.InitServer(e2eConfig(admin, port, ""), "caddyfile") // unload: the next test starts without an engine
			key := "around:{e2e_redis:frank}:" + strconv.FormatInt(window.Milliseconds(), 10) + ":" +
				strconv.FormatInt(time.Now().UnixMilli()/window.Milliseconds(), 10) + ":c"
			holds := func(want int64, what string) {
				t.Helper()
				redistest.EventuallyShow(t, 10*time.Second, what, func() (bool, string) {
					n, err := srv.Client().HGet(context.Background(), key, "t").Int64()
					return err == nil && n == want, fmt.Sprintf("Redis holds %d (%v)", n, err)
				})
			}
			for range 4 {
				get(t, tester, base, "X-Key", "frank").expect(t, 200, "ok")
			}
			holds(4, "Redis holds frank's 4 units")
			o, ok := lookupState().currentOrigin().(*origin.Redis)
			if !ok {
				t.Fatal("the engine has no Redis origin")
			}
			// Just after a check: the next is 2 s away.
			checks := o.RunIDChecks()
			redistest.Eventually(t, 5*time.Second, "the watch checked", func() bool { return o.RunIDChecks() > checks })
			if loss == "restart" {
				srv.Restart()
			} else if err := srv.Client().FlushAll(context.Background()).Err(); err != nil {
				t.Fatal(err)
			}
			tester.InitServer(withRedis("60ms"), "caddyfile") // a new origin on the same Redis
			if t.Failed() {
				t.FailNow()
			}
			if o.RunIDChecks() != checks+1 {
				t.Fatal("the old origin checked again before the reload: it tests nothing")
			}
			if o2, _ := lookupState().currentOrigin().(*origin.Redis); o2 == o || o2 == nil {
				t.Fatal("the reload kept the origin: it tests nothing")
			}
			holds(4, "Redis holds frank's 4 units again after the "+loss+" around the reload")
		})
	}
}

// TestCaddy_AReloadAddingRedisHandsTheRegionItsUnits: a process that ran
// local-only is reloaded with Redis. A key it counted before and meets
// again hands its units over at that request; one it does not meet again
// kept them the process's alone, and the region's other nodes admitted
// it up to its limit anew: Redis held none of quiet's 4 units. The
// janitor's next pass hands them over.
func TestCaddy_AReloadAddingRedisHandsTheRegionItsUnits(t *testing.T) {
	window, ok := testclock.FreshWindow(time.Now(), time.Minute, 2*time.Minute, 30*time.Second)
	if !ok {
		t.Fatal("no window length in [1m, 2m] leaves 30 s")
	}
	if n, ok := pool.References(poolKey); ok {
		t.Fatalf("engine pool still has %d users from an earlier test", n)
	}
	old := newEngineConfig
	newEngineConfig = func() engine.Config { return engine.Config{JanitorInterval: 100 * time.Millisecond} }
	t.Cleanup(func() { newEngineConfig = old })
	srv := redistest.Start(t)
	t.Setenv("RATELIMIT_TEST_REDIS_URL", srv.URL())
	admin, port := e2eAdminPort(t), redistest.MustFreePort(t)
	base := fmt.Sprintf("http://127.0.0.1:%d/", port)
	tester := caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{AdminPort: admin})
	tester.InitServer(redisConfig(admin, port, "", window), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	defer tester.InitServer(e2eConfig(admin, port, ""), "caddyfile") // unload: the next test starts without an engine
	for range 4 {
		get(t, tester, base, "X-Key", "quiet").expect(t, 200, "ok")
		get(t, tester, base, "X-Key", "busy").expect(t, 200, "ok")
	}
	tester.InitServer(redisConfig(admin, port, `	ratelimit {
		redis {env.RATELIMIT_TEST_REDIS_URL}
		prefix added
	}`, window), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	get(t, tester, base, "X-Key", "busy").expect(t, 200, "ok")
	get(t, tester, base, "X-Key", "busy").expect(t, 429, "")
	for id, want := range map[string]int64{"busy": 5, "quiet": 4} {
		key := "added:{e2e_redis:" + id + "}:" + strconv.FormatInt(window.Milliseconds(), 10) + ":" +
			strconv.FormatInt(time.Now().UnixMilli()/window.Milliseconds(), 10) + ":c"
		redistest.EventuallyShow(t, 5*time.Second, fmt.Sprintf("Redis holds %s's %d units", id, want), func() (bool, string) {
			n, err := srv.Client().HGet(context.Background(), key, "t").Int64()
			return err == nil && n == want, fmt.Sprintf("%d (%v)", n, err)
		})
	}
}

// TestCaddy_AReloadThatFailsToStartWritesNoCountToItsRedis: a reload to
// another Redis whose config fails to start (its HTTP server's address
// is taken) leaves the node on its Redis. Its limiter, started before
// the HTTP server failed, had written every live key's count to the new
// servers, as a completed reload to them does: the failed config's
// Redis, another region's or one the node never joined, held k's 2
// units, counted there on top of its own nodes' counts. That write
// now waits until the new config runs alone.
func TestCaddy_AReloadThatFailsToStartWritesNoCountToItsRedis(t *testing.T) {
	resetOverrides(t)
	a, b := redistest.Start(t), redistest.Start(t)
	_, admin, base := startCaddy(t, overrideConfig(fmt.Sprintf("\tratelimit {\n\t\tredis %s\n\t}", a.URL())))
	if n := admitted(t, base, "k", 2); n != 2 {
		t.Fatalf("admitted %d of 2", n)
	}
	// Replayed: units still pending while the failed config's Redis is
	// the engine's, for the moment the new config runs beside the old,
	// would replay there.
	redistest.Eventually(t, 5*time.Second, "Redis A holds k's 2 units", func() bool {
		keys, err := a.Client().Keys(context.Background(), "*{ov:k}*:c").Result()
		if err != nil || len(keys) != 1 {
			return false
		}
		n, err := a.Client().HGet(context.Background(), keys[0], "t").Int64()
		return err == nil && n == 2
	})
	// A reload that failed after the limiter started hands the engine back
	// to Redis A, which gets every count again (the units replayed to the
	// failed config's servers meanwhile would be missing there): the next
	// reload waits until they are written, or they would replay to its
	// servers in the moment it runs beside the old config.
	eng, seen, resends := lookupState().engine, 0, int64(0)
	failToStart(t, admin, b, 40, func(_, started int) {
		if started == seen {
			return
		}
		seen = started
		redistest.Eventually(t, 5*time.Second, "Redis A got every count again", func() bool {
			s := eng.Stats()
			if s.Resends > resends && s.PendingCells == 0 {
				resends = s.Resends
				return true
			}
			return false
		})
	})
	if n := admitted(t, base, "k", 1); n != 0 {
		t.Fatalf("after the failed reloads k admitted %d more at its limit", n)
	}
	// A reload that completes writes the counts; wait as long for a
	// failed one's.
	time.Sleep(200 * time.Millisecond)
	keys, err := b.Client().Keys(context.Background(), "*:c").Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) > 0 {
		t.Fatalf("the failed config's Redis holds counts: %v", keys)
	}
}

// TestCaddy_NoStrictKeysWithoutRedis: strict mode makes a decision refresh
// from Redis first, so without Redis no key is in it. A key denied at its
// limit with Redis kept its deadline through a reload without Redis, and
// the status (strict_keys beside "origin": null), the strict_keys gauge,
// /ratelimit/strict and the key's strict_until showed it until the
// deadline, up to a window. The deadline is kept, hidden: a reload back to
// Redis within it puts the key in strict mode again, since Redis still
// holds the count it was denied at.
func TestCaddy_NoStrictKeysWithoutRedis(t *testing.T) {
	d := deniedWithRedis(t, "strictless", "erin")
	tester, admin, port, window := d.tester, d.admin, d.port, d.window
	withRedis := redisConfig(admin, port, d.global, window)
	strict := func(want int, when string) {
		t.Helper()
		n := strictCounts(t, admin)
		var key struct {
			StrictUntil *time.Time `json:"strict_until"`
		}
		adminDo(t, admin, "GET", "/ratelimit/counters?zone=e2e_redis&identifier=erin").decode(t, 200, &key)
		if !n.are(want) || (key.StrictUntil != nil) != (want == 1) {
			t.Fatalf("%s: %s, strict_until %v; want %d", when, n, key.StrictUntil, want)
		}
	}
	strict(1, "denied with Redis")
	tester.InitServer(redisConfig(admin, port, "", window), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	strict(0, "after a reload without Redis")
	tester.InitServer(withRedis, "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	strict(1, "after a reload back to Redis within the deadline")
}

// TestStrictKeys_CountsWhatTheListingLists: a reload that changes a
// zone's window leaves the old window's strict deadlines until they pass,
// which /ratelimit/strict does not list (no loaded config defines the
// zone with that window); the status's strict_keys and the gauge, which
// the README says count the keys as the listing lists them, counted them
// (an audit of 2026-11-29: 50 against a listing of 1).
func TestStrictKeys_CountsWhatTheListingLists(t *testing.T) {
	d := deniedWithRedis(t, "strictwindows", "frank")
	tester, admin, port, window, global := d.tester, d.admin, d.port, d.window, d.global
	strict := func(want int, when string) {
		t.Helper()
		if n := strictCounts(t, admin); !n.are(want) {
			t.Fatalf("%s: %s; want %d", when, n, want)
		}
	}
	strict(1, "denied")
	tester.InitServer(redisConfig(admin, port, global, 2*window), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	strict(0, "after a reload that doubled the zone's window")
	tester.InitServer(redisConfig(admin, port, global, window), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	strict(1, "after a reload back to the window, within the deadline")
}

// strictKeyCounts is what a node says of its keys in strict mode: the
// status's strict_keys, /ratelimit/strict's total and the gauge (with the
// status's origin section, for a failure's message).
type strictKeyCounts struct {
	status, listed int
	gauge          float64
	origin         json.RawMessage
}

func strictCounts(t *testing.T, admin int) strictKeyCounts {
	t.Helper()
	var doc struct {
		Origin json.RawMessage `json:"origin"`
		Engine struct {
			StrictKeys int `json:"strict_keys"`
		} `json:"engine"`
	}
	adminDo(t, admin, "GET", "/ratelimit/status").decode(t, 200, &doc)
	var listed struct {
		Total int `json:"total"`
	}
	adminDo(t, admin, "GET", "/ratelimit/strict").decode(t, 200, &listed)
	return strictKeyCounts{doc.Engine.StrictKeys, listed.Total, metricValue(t, admin, "caddy_ratelimit_strict_keys"), doc.Origin}
}

// are reports whether every count is n.
func (c strictKeyCounts) are(n int) bool {
	return c.status == n && c.listed == n && c.gauge == float64(n)
}

func (c strictKeyCounts) String() string {
	return fmt.Sprintf("status strict_keys %d, /ratelimit/strict total %d, gauge %v (origin %s)", c.status, c.listed, c.gauge, c.origin)
}

// deniedNode is a Caddy of redisConfig on a private Redis whose key was
// just denied at its limit of 5 (strict mode); the test's end loads a
// config without the limiter.
type deniedNode struct {
	tester      *caddytest.Tester
	admin, port int
	window      time.Duration
	global      string // the global option: the Redis under prefix
}

func deniedWithRedis(t *testing.T, prefix, key string) deniedNode {
	t.Helper()
	window, ok := testclock.FreshWindow(time.Now(), time.Minute, 2*time.Minute, 30*time.Second)
	if !ok {
		t.Fatal("no window length in [1m, 2m] leaves 30 s")
	}
	srv := redistest.Start(t)
	t.Setenv("RATELIMIT_TEST_REDIS_URL", srv.URL())
	d := deniedNode{admin: e2eAdminPort(t), port: redistest.MustFreePort(t), window: window,
		global: "\tratelimit {\n\t\tredis {env.RATELIMIT_TEST_REDIS_URL}\n\t\tprefix " + prefix + "\n\t}"}
	d.tester = caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{AdminPort: d.admin})
	d.tester.InitServer(redisConfig(d.admin, d.port, d.global, window), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	t.Cleanup(func() { d.tester.InitServer(e2eConfig(d.admin, d.port, ""), "caddyfile") }) // unload: the next test starts without an engine
	base := fmt.Sprintf("http://127.0.0.1:%d/", d.port)
	for range 5 {
		get(t, d.tester, base, "X-Key", key).expect(t, 200, "ok")
	}
	get(t, d.tester, base, "X-Key", key).expect(t, 429, "")
	return d
}
