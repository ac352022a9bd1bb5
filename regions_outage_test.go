package ratelimit

import (
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// TestCaddy_TheRegionsRedisDownPausesPublicationAndLosesNothing walks the
// README's "the region's Redis down" row of the cross-region layer with
// real servers: while Redis is down the node decides locally, loses the
// role and writes nothing to MySQL; once Redis is back (restarted empty)
// it takes the role again and publishes the region's total with the units
// admitted meanwhile, once, and the denial row that waited: MySQL holds
// 10 (not 3, not 17), and the node counts its own units once.
func TestCaddy_TheRegionsRedisDownPausesPublicationAndLosesNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy, MariaDB and Redis")
	}
	window, ok := testclock.FreshWindow(time.Now(), time.Minute, 2*time.Minute, 50*time.Second)
	if !ok {
		t.Fatal("no window length in [1m, 2m] leaves 50 s")
	}
	my := mysqltest.Start(t)
	dsn := my.NewDatabase(t)
	rds := redistest.Start(t)
	t.Setenv("RATELIMIT_TEST_MYSQL_DSN", dsn)
	t.Setenv("RATELIMIT_TEST_OUTAGE_REDIS", rds.URL())
	_, admin, base := startCaddy(t, func(admin, port int) string {
		return caddyConfig(admin, port, `	ratelimit {
		region test-a
		redis {env.RATELIMIT_TEST_OUTAGE_REDIS}
		mysql {env.RATELIMIT_TEST_MYSQL_DSN}
		mysql_flush 20ms
		global_sync 50ms
		blocklist_sync 50ms
		min_window 1s
		slow_tick 200ms
		breaker_timeout 500ms
	}`, fmt.Sprintf(`
	handle {
		ratelimit {
			zone region_outage {
				key    {http.request.header.X-Key}
				limit  10
				window %s
			}
		}
		respond "ok"
	}`, window))
	})
	db := mysqltest.Open(t, dsn)
	send := func(n int) (admitted int) {
		t.Helper()
		for range n {
			req, _ := http.NewRequest(http.MethodGet, base+"/", nil)
			req.Header.Set("X-Key", "hugo")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			switch resp.StatusCode {
			case http.StatusOK:
				admitted++
			case http.StatusTooManyRequests:
			default:
				t.Fatalf("status %d", resp.StatusCode)
			}
		}
		return admitted
	}
	// published is what MySQL holds of hugo's cell, -1 before the layer
	// made its table (it migrates in the background).
	published := func() int64 {
		t.Helper()
		var n int64
		if err := db.QueryRow(`SELECT COALESCE(SUM(count), 0) FROM ratelimit_global_counts WHERE identifier = 'hugo'`).Scan(&n); err != nil {
			return -1
		}
		return n
	}
	const held = `caddy_ratelimit_propagation_role_held`
	leaseErrors := `caddy_ratelimit_propagation_errors_total{op="lease"}`

	if got := send(3); got != 3 {
		t.Fatalf("admitted %d of the first 3", got)
	}
	redistest.EventuallyShow(t, 20*time.Second, "the 3 units published", func() (bool, string) {
		n := published()
		return n == 3 && metricValue(t, admin, held) == 1, fmt.Sprintf("MySQL holds %d", n)
	})
	lease0 := metricValue(t, admin, leaseErrors)

	rds.Stop()
	if got := send(8); got != 7 {
		t.Fatalf("admitted %d of 8 with Redis down, want 7 (local decisions, limit 10)", got)
	}
	redistest.Eventually(t, 20*time.Second, "the role lost and lease errors counted", func() bool {
		return metricValue(t, admin, held) == 0 && metricValue(t, admin, leaseErrors) > lease0
	})
	// Publication pauses: nothing more reaches MySQL while Redis is down.
	time.Sleep(500 * time.Millisecond) // 25 flush periods: a write would have come
	if n, rows := published(), rowCount(t, db, "ratelimit_blocklist"); n != 3 || rows != 0 {
		t.Fatalf("MySQL holds %d and %d denial rows with the region's Redis down, want 3 and none (publication pauses)", n, rows)
	}

	rds.Restart()
	redistest.EventuallyShow(t, 30*time.Second, "the role taken again, the 10 units and the denial published", func() (bool, string) {
		n, rows := published(), rowCount(t, db, "ratelimit_blocklist")
		return n == 10 && rows == 1 && metricValue(t, admin, held) == 1,
			fmt.Sprintf("MySQL holds %d and %d denial rows, role held %v", n, rows, metricValue(t, admin, held))
	})
	time.Sleep(time.Second) // pulls every 50 ms: an own row read back as another region's would show by now
	if n := published(); n != 10 {
		t.Fatalf("MySQL holds %d after the recovery, want 10", n)
	}
	if got := send(3); got != 0 {
		t.Fatalf("after the outage %d of 3 more admitted at the limit", got)
	}
	var c struct {
		Effective int64 `json:"effective"`
	}
	adminDo(t, admin, http.MethodGet, "/ratelimit/counters?zone=region_outage&identifier=hugo").decode(t, 200, &c)
	if c.Effective != 10 {
		t.Fatalf("the node counts %d of hugo after the outage, want 10 (its own units once)", c.Effective)
	}
}
