package ratelimit

import (
	"database/sql"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

func mysqlConfig(global string) func(admin, port int) string {
	return func(admin, port int) string {
		return caddyConfig(admin, port, global, `
	handle {
		ratelimit {
			zone e2e_mysql {
				key    {http.request.header.X-Key}
				limit  5
				window 1m
			}
		}
		respond "ok"
	}`)
	}
}

// TestCaddy_MySQLLayer runs Caddy in-process against a private MariaDB:
// Start creates the schema, a burst writes one denial row, the status,
// the blocklist route and the metrics show the layer, and a reload that
// changes the region fails and keeps the running config.
func TestCaddy_MySQLLayer(t *testing.T) {
	srv := mysqltest.Start(t)
	dsn := srv.NewDatabase(t)
	t.Setenv("RATELIMIT_TEST_MYSQL_DSN", dsn)
	global := `	ratelimit {
		region  test-a
		mysql   {env.RATELIMIT_TEST_MYSQL_DSN}
		mysql_flush 20ms
		global_sync 50ms
		blocklist_sync 50ms
		min_window 1s
	}`
	tester, admin, base := startCaddy(t, mysqlConfig(global))
	db := mysqltest.Open(t, dsn)
	redistest.Eventually(t, 20*time.Second, "schema migrated", func() bool {
		var n int
		err := db.QueryRow(`SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name LIKE 'ratelimit_%'`).Scan(&n)
		return err == nil && n == 3
	})
	// Metrics add up across configs (and test runs): compare with before.
	written0 := metricValue(t, admin, `caddy_ratelimit_propagation_rows_written_total{table="ratelimit_blocklist"}`)
	for i := 0; i < 8; i++ {
		req, _ := http.NewRequest(http.MethodGet, base+"/", nil)
		req.Header.Set("X-Key", "burst-key")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	redistest.Eventually(t, 10*time.Second, "one denial row written", func() bool {
		return rowCount(t, db, "ratelimit_blocklist") == 1
	})
	var region []byte
	var cur int64
	if err := db.QueryRow(`SELECT origin_region, count_cur FROM ratelimit_blocklist`).Scan(&region, &cur); err != nil {
		t.Fatal(err)
	}
	// Without Redis the node is its own region: test-a/<node>.
	if !strings.HasPrefix(string(region), "test-a/") || cur != 5 {
		t.Fatalf("row: region %q count_cur %d", region, cur)
	}

	var status struct {
		Propagation *struct {
			Region      string `json:"region"`
			Database    string `json:"database"`
			Ready       bool   `json:"ready"`
			Breaker     string `json:"breaker"`
			RowsEmitted struct {
				Blocklist int64 `json:"blocklist"`
			} `json:"rows_emitted"`
		} `json:"propagation"`
	}
	adminDo(t, admin, http.MethodGet, "/ratelimit/status").decode(t, http.StatusOK, &status)
	p := status.Propagation
	if p == nil || !p.Ready || p.Breaker != "closed" || p.RowsEmitted.Blocklist != 1 || p.Region != string(region) {
		t.Fatalf("propagation status: %+v", p)
	}
	if strings.Contains(p.Database, "root") || !strings.HasSuffix(p.Database, "/"+dsn[strings.LastIndex(dsn, "/")+1:]) {
		t.Fatalf("database shown as %q", p.Database)
	}
	var bl struct {
		Emitted []struct {
			Identifier string `json:"identifier"`
			CountCur   int64  `json:"count_cur"`
		} `json:"emitted"`
		Applied []any `json:"applied"`
	}
	adminDo(t, admin, http.MethodGet, "/ratelimit/blocklist").decode(t, http.StatusOK, &bl)
	if len(bl.Emitted) != 1 || bl.Emitted[0].Identifier != "burst-key" || bl.Applied == nil {
		t.Fatalf("blocklist: %+v", bl)
	}
	if r := adminDo(t, admin, http.MethodPost, "/ratelimit/blocklist"); r.status != http.StatusMethodNotAllowed {
		t.Fatalf("POST /ratelimit/blocklist: %d", r.status)
	}
	// The dashboard's cross-region panels select series this scrape has.
	_, crossRegion := splitQueries(loadDashboardQueries(t), propagationMetricPrefix)
	scraped := map[string]bool{}
	for series := range scrape(t, admin) {
		name, _, _ := strings.Cut(series, "{")
		scraped[name] = true
	}
	if missing, err := missingMetrics(crossRegion, scraped); err != nil || len(missing) > 0 {
		t.Errorf("the dashboard's cross-region panels query metrics the scrape does not have: %q (%v)", missing, err)
	}
	if got := metricValue(t, admin, `caddy_ratelimit_propagation_rows_written_total{table="ratelimit_blocklist"}`); got != written0+1 {
		t.Errorf("rows_written_total{ratelimit_blocklist} went from %g to %g, want one more", written0, got)
	}
	metrics := string(adminDo(t, admin, http.MethodGet, "/metrics").body)
	for _, want := range []string{
		`caddy_ratelimit_propagation_ready 1`,
		`caddy_ratelimit_propagation_breaker_state{state="closed"} 1`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %q", want)
		}
	}

	// A reload that changes the region fails; the running config stays.
	err := loadCaddyfile(t, admin, mysqlConfig(strings.Replace(global, "test-a", "test-b", 1)))
	if err == nil || !strings.Contains(err.Error(), "restart Caddy to change it") {
		t.Fatalf("reload changing the region: %v", err)
	}
	if currentProp.Load() == nil || currentProp.Load().Region() != string(region) {
		t.Fatal("the running config lost its propagation after a failed reload")
	}
	_ = tester
}

// loadCaddyfile posts a Caddyfile to the admin endpoint and returns the
// error it answered, if any.
func loadCaddyfile(t *testing.T, admin int, cfg func(admin, port int) string) error {
	t.Helper()
	return loadCaddyfileOn(t, admin, redistest.MustFreePort(t), cfg)
}

// loadCaddyfileOn is loadCaddyfile with the site on port.
func loadCaddyfileOn(t *testing.T, admin, port int, cfg func(admin, port int) string) error {
	t.Helper()
	body := cfg(admin, port)
	req, _ := http.NewRequest(http.MethodPost, fmt.Sprintf("http://localhost:%d/load", admin), strings.NewReader(body))
	req.Header.Set("Content-Type", "text/caddyfile")
	req.Close = true // as adminSend's
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("load: %d %s", resp.StatusCode, b)
	}
	return nil
}

func rowCount(t *testing.T, db *sql.DB, table string) int {
	t.Helper()
	var n int
	if err := db.QueryRow("SELECT COUNT(*) FROM " + table).Scan(&n); err != nil {
		return -1
	}
	return n
}

func TestMySQLOption_ErrorsNeverQuoteThePassword(t *testing.T) {
	st, err := acquireState(nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = releaseState() })
	for _, dsn := range []string{
		"root:pw-s3cret@tcp(127.0.0.1:1)/",
		"root:pw-s3cret@tcp(127.0.0.1:1)/db?tls=pw-s3cret",
		"root:pw-s3cret@tcp(127.0.0.1:1/db",
		"{env.RATELIMIT_TEST_UNSET_DSN_VAR}",
	} {
		a := &App{Region: "r", MySQL: &MySQLConfig{DSN: dsn}, state: st, logger: st.apps.view().logger}
		b, err := provisionMySQL(a)
		if err == nil {
			b.close()
			t.Fatalf("DSN %q accepted", dsn)
		}
		if strings.Contains(err.Error(), "pw-s3cret") {
			t.Fatalf("error quotes the password: %v", err)
		}
	}
}

func TestMySQLOption_ValidateNeedsRegion(t *testing.T) {
	a := &App{MySQL: &MySQLConfig{DSN: "{env.X}"}}
	if err := a.Validate(); err == nil || !strings.Contains(err.Error(), "region is required with mysql") {
		t.Fatalf("Validate: %v", err)
	}
	a.Region = "r"
	a.MySQL.Flush = 1
	if err := a.Validate(); err == nil || !strings.Contains(err.Error(), "mysql_flush") {
		t.Fatalf("Validate with a 1ns flush: %v", err)
	}
}

// metricValue returns the value of one series from the admin endpoint's
// /metrics, or 0 when it is absent.
func metricValue(t *testing.T, admin int, series string) float64 {
	t.Helper()
	for _, line := range strings.Split(string(adminDo(t, admin, http.MethodGet, "/metrics").body), "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				t.Fatalf("metric %s: %v", series, err)
			}
			return f
		}
	}
	return 0
}

// TestCaddy_AReloadIsNoRoleChange reloads Caddy with Redis and MySQL: the
// node holds the region's cross-region role throughout, so no reload is a
// role change. Each reload's new layer counted taking the role again
// (propagation_role_changes_total{change="taken"} 21 after 20 reloads of
// one node, with "took the region's cross-region role" logged at each),
// which an alert on role changes reads as a flapping role.
func TestCaddy_AReloadIsNoRoleChange(t *testing.T) {
	srv := mysqltest.Start(t)
	t.Setenv("RATELIMIT_TEST_MYSQL_DSN", srv.NewDatabase(t))
	t.Setenv("RATELIMIT_TEST_ROLE_REDIS", redistest.Start(t).URL())
	global := func(flush string) string {
		return `	ratelimit {
		region  test-a
		redis   {env.RATELIMIT_TEST_ROLE_REDIS}
		mysql   {env.RATELIMIT_TEST_MYSQL_DSN}
		mysql_flush ` + flush + `
		global_sync 50ms
		blocklist_sync 50ms
		min_window 1s
	}`
	}
	_, admin, _ := startCaddy(t, mysqlConfig(global("20ms")))
	const held = `caddy_ratelimit_propagation_role_held`
	taken := `caddy_ratelimit_propagation_role_changes_total{change="taken"}`
	lost := `caddy_ratelimit_propagation_role_changes_total{change="lost"}`
	redistest.Eventually(t, 30*time.Second, "the node holds the role", func() bool {
		return metricValue(t, admin, held) == 1
	})
	// Metrics add up across configs (and tests): compare with before.
	taken0, lost0 := metricValue(t, admin, taken), metricValue(t, admin, lost)
	const reloads = 6
	for i := range reloads {
		flush := []string{"20ms", "25ms"}[i%2] // changed, and (but the port) unchanged
		if err := loadCaddyfile(t, admin, mysqlConfig(global(flush))); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	redistest.Eventually(t, 30*time.Second, "the node holds the role after the reloads", func() bool {
		return metricValue(t, admin, held) == 1
	})
	time.Sleep(200 * time.Millisecond) // flushes of the last config
	if dt, dl := metricValue(t, admin, taken)-taken0, metricValue(t, admin, lost)-lost0; dt != 0 || dl != 0 {
		t.Errorf("%d reloads of a node that held the role counted it taken %g and lost %g times, want 0", reloads, dt, dl)
	}
}

// TestCaddy_AReloadAddingOrRemovingRedisCountsNoUnitTwice: with MySQL, a
// node without Redis writes its rows as its own region (region/node), a
// node with Redis as the region. A reload that added or removed Redis
// changed the name the running engine's rows go under, so the rows it had
// written came back as another region's, and the units they carry, still
// in the engine's cells (or the region's Redis), were counted twice: 3
// admitted of a limit of 5, then none more (want 2) in both directions.
// Such a reload is refused now, as one changing the region is: a restart
// starts the engine, and its counts, over.
func TestCaddy_AReloadAddingOrRemovingRedisCountsNoUnitTwice(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy, MariaDB and Redis")
	}
	window, ok := testclock.FreshWindow(time.Now(), time.Minute, 2*time.Minute, 45*time.Second)
	if !ok {
		t.Fatal("no window length in [1m, 2m] leaves 45 s")
	}
	srv := mysqltest.Start(t)
	for _, redisFirst := range []bool{true, false} {
		t.Run(fmt.Sprintf("redis first %v", redisFirst), func(t *testing.T) {
			dsn := srv.NewDatabase(t)
			t.Setenv("RATELIMIT_TEST_MYSQL_DSN", dsn)
			t.Setenv("RATELIMIT_TEST_ROWS_REDIS", redistest.Start(t).URL())
			port := 0
			cfg := func(withRedis bool) func(admin, p int) string {
				redis := ""
				if withRedis {
					redis = "\t\tredis {env.RATELIMIT_TEST_ROWS_REDIS}\n"
				}
				return func(admin, p int) string {
					if port == 0 {
						port = p
					}
					return caddyConfig(admin, port, "\tratelimit {\n\t\tregion test-a\n"+redis+`		mysql {env.RATELIMIT_TEST_MYSQL_DSN}
		mysql_flush 20ms
		global_sync 50ms
		blocklist_sync 50ms
		min_window 1s
	}`, fmt.Sprintf(`
	handle {
		ratelimit {
			zone rows_reload {
				key    {http.request.header.X-Key}
				limit  5
				window %s
			}
		}
		respond "ok"
	}`, window))
				}
			}
			_, admin, base := startCaddy(t, cfg(redisFirst))
			db := mysqltest.Open(t, dsn)
			send := func(n int) (admitted int) {
				for range n {
					req, _ := http.NewRequest(http.MethodGet, base+"/", nil)
					req.Header.Set("X-Key", "flip")
					resp, err := http.DefaultClient.Do(req)
					if err != nil {
						t.Fatal(err)
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode == http.StatusOK {
						admitted++
					}
				}
				return admitted
			}
			if got := send(3); got != 3 {
				t.Fatalf("admitted %d of the first 3, want 3", got)
			}
			redistest.Eventually(t, 20*time.Second, "the 3 units published", func() bool {
				var n int64
				err := db.QueryRow(`SELECT COALESCE(SUM(count), 0) FROM ratelimit_global_counts WHERE identifier = 'flip'`).Scan(&n)
				return err == nil && n == 3
			})
			// Refused: the running config, and the name its rows go under,
			// stay.
			if err := loadCaddyfile(t, admin, cfg(!redisFirst)); err == nil || !strings.Contains(err.Error(), "restart Caddy to add or remove Redis") {
				t.Errorf("the reload adding or removing Redis: %v, want it refused", err)
			}
			time.Sleep(time.Second) // pulls every 50 ms
			if got := send(3); got != 2 {
				t.Fatalf("after the reload %d of 3 more admitted, want 2 (limit 5, 3 admitted before it)", got)
			}
		})
	}
}

// TestCaddy_TheLastNodeOfARegionPublishesAsItStops: a process's flushes
// publish the cells at half their limit or more, and the cells between
// publish_floor and half wait for a global sync. A region's last node
// that stopped (a single-node region restarted in a deploy, a region
// drained) took those counts with it: an audit stopped such a node after
// 120 requests of a limit of 300, and the other region admitted 300 more
// (420 to 436 in all, 6 runs of 6). Its last flush now publishes every
// count that grew.
func TestCaddy_TheLastNodeOfARegionPublishesAsItStops(t *testing.T) {
	srv := mysqltest.Start(t)
	dsn := srv.NewDatabase(t)
	t.Setenv("RATELIMIT_TEST_MYSQL_DSN", dsn)
	t.Setenv("RATELIMIT_TEST_LAST_REDIS", redistest.Start(t).URL())
	tester, admin, base := startCaddy(t, func(admin, port int) string {
		return caddyConfig(admin, port, `	ratelimit {
		region test-a
		redis  {env.RATELIMIT_TEST_LAST_REDIS}
		mysql  {env.RATELIMIT_TEST_MYSQL_DSN}
		mysql_flush 20ms
		global_sync 1h
		min_window 1s
	}`, `
	handle {
		ratelimit {
			zone last_node {
				key    {http.request.header.X-Key}
				limit  100
				window 1h
			}
		}
		respond "ok"
	}`)
	})
	redistest.Eventually(t, 20*time.Second, "the layer ready", func() bool {
		return metricValue(t, admin, "caddy_ratelimit_propagation_ready") == 1 &&
			metricValue(t, admin, "caddy_ratelimit_propagation_role_held") == 1
	})
	// The role's first flush publishes every registered cell (takeRole):
	// from a flush that ended after the role was seen held, only hot
	// cells are published.
	held := float64(time.Now().Add(50*time.Millisecond).UnixMilli()) / 1000
	redistest.Eventually(t, 10*time.Second, "a flush of the role after it was taken", func() bool {
		return metricValue(t, admin, "caddy_ratelimit_propagation_last_pull_timestamp_seconds") >= held
	})
	const sent = 30 // above publish_floor (20), below half the limit
	for range sent {
		req, _ := http.NewRequest(http.MethodGet, base+"/", nil)
		req.Header.Set("X-Key", "last")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d below the limit", resp.StatusCode)
		}
	}
	// The units in the region's Redis first. In one clean-clone run of
	// three the node published nothing at its stop, before this wait and
	// the one for the role's first flush; the cause is not pinned down
	// (the closing note of 2026-11-29): 0 failures in 24 runs since.
	redistest.Eventually(t, 10*time.Second, "the units replayed to Redis", func() bool {
		return metricValue(t, admin, "caddy_ratelimit_replay_pending_cells") == 0
	})
	db := mysqltest.Open(t, dsn)
	published := func() int64 {
		var n int64
		if err := db.QueryRow(`SELECT COALESCE(SUM(count), 0) FROM ratelimit_global_counts WHERE identifier = 'last'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := published(); n != 0 {
		t.Fatalf("%d units published below half the limit before a global sync; the test needs none", n)
	}
	// The node stops: a config without the rate limiter, as the last
	// config's stop at shutdown.
	tester.InitServer(e2eConfig(admin, redistest.MustFreePort(t), ""), "caddyfile")
	if n := published(); n != sent {
		t.Fatalf("%d units published once the region's last node stopped, want %d", n, sent)
	}
}
