package integration

import (
	"bufio"
	"context"
	"database/sql"
	"fmt"
	"net/http"
	"net/url"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// Scenario 7: hostile identifiers (case variants, trailing spaces, invalid
// UTF-8, separators, quotes, NUL, 10 KB) round-trip through MySQL exactly
// and never merge.
func TestRegions_HostileIdentifiersRoundTrip(t *testing.T) {
	c := startCluster(t, clusterSpec{regions: 2, nodes: 1, limit: 40, window: pickWindow(time.Minute),
		key: "{http.request.uri.query.k}"})
	tag := strconv.FormatInt(time.Now().UnixNano(), 36)
	ids := []string{
		"Key" + tag, "key" + tag, "KEY" + tag, "key" + tag + " ", "key" + tag + "  ", " key" + tag,
		"k\xff\xfe" + tag, "k\xc3\x28" + tag, "a:b" + tag, "a}b{" + tag, "a'b" + tag, `a"b` + tag,
		"a\\b" + tag, "a\x00b" + tag, "a%b" + tag, "';DROP TABLE ratelimit_blocklist;--" + tag,
		strings.Repeat("x", 10_000) + tag, strings.Repeat("x", 10_001) + tag,
	}
	a, b := c.regions[0][0], c.regions[1][0]
	for i, id := range ids {
		u := a.url("/?k=" + url.QueryEscape(id))
		for j := 0; j < 10+i; j++ { // 25 % of the limit or more: published
			if code := sendKey(loadClient, u, ""); code != http.StatusOK {
				t.Fatalf("identifier #%d request %d: %d", i, j, code)
			}
		}
	}
	db := mysqltest.Open(t, c.dsn)
	// Every identifier's row reaches exactly its own count (rows grow as
	// pushes land, so wait for the values, not for the rows).
	rowCount := func(id string) (int64, error) {
		var got int64
		err := db.QueryRow(`SELECT count FROM ratelimit_global_counts WHERE identifier = ? AND region = ?`,
			[]byte(engine.NormalizeIdentifier(id)), []byte(regionName(0))).Scan(&got)
		return got, err
	}
	deadline := time.Now().Add(10 * time.Second)
	for i, id := range ids {
		want := int64(10 + i)
		for {
			got, err := rowCount(id)
			if err == nil && got == want {
				break
			}
			if got > want || time.Now().After(deadline) {
				t.Fatalf("identifier #%d: row count %d (%v), want %d", i, got, err, want)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	var rows int
	if err := db.QueryRow(`SELECT COUNT(*) FROM ratelimit_global_counts WHERE region = ?`, []byte(regionName(0))).Scan(&rows); err != nil || rows != len(ids) {
		t.Fatalf("%d rows for %d distinct identifiers (%v): some merged or split", rows, len(ids), err)
	}
	// Region B imported each under its own identifier.
	redistest.Eventually(t, 10*time.Second, "B imported every identifier", func() bool {
		for i, id := range ids {
			kc, ok := b.counters(id)
			if !ok || len(kc.Cells) == 0 || kc.Cells[0].Global != int64(10+i) {
				return false
			}
		}
		return true
	})
	for i, id := range ids {
		kc, _ := b.counters(id)
		if got := kc.Cells[0].GlobalByRegion[regionName(0)]; got != int64(10+i) {
			t.Errorf("identifier #%d: B shows %d from %s, want %d", i, got, regionName(0), 10+i)
		}
	}
}

// goroutines reads the node's goroutine count from the admin endpoint's
// pprof profile.
func (n *regionNode) goroutines(t *testing.T) int {
	t.Helper()
	resp, err := http.Get(fmt.Sprintf("http://localhost:%d/debug/pprof/goroutine?debug=1", n.admin))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	// "goroutine profile: total 123"
	f := strings.Fields(line)
	v, err := strconv.Atoi(f[len(f)-1])
	if err != nil {
		t.Fatalf("goroutine profile header %q: %v", line, err)
	}
	return v
}

// waitConverged waits until every node shows, for key's current cell,
// regional + global == total and global == what the other regions admitted.
func waitConverged(t *testing.T, c *cluster, key string, byRegion []int64, timeout time.Duration) {
	t.Helper()
	var total int64
	for _, v := range byRegion {
		total += v
	}
	var last string
	deadline := time.Now().Add(timeout)
	for {
		ok := true
		for r, nodes := range c.regions {
			for _, n := range nodes {
				kc, found := n.counters(key)
				if !found || len(kc.Cells) == 0 {
					ok, last = false, fmt.Sprintf("%s: no counters", n.region)
					continue
				}
				cell := kc.Cells[0]
				if cell.Regional != byRegion[r] || cell.Global != total-byRegion[r] {
					ok = false
					last = fmt.Sprintf("%s: regional %d global %d, want %d and %d", n.region, cell.Regional, cell.Global, byRegion[r], total-byRegion[r])
				}
			}
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("counts did not converge within %s: %s", timeout, last)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Scenario 6: `caddy reload` of every node under load loses no count,
// answers only 200 or 429, and leaks no goroutine.
func TestRegions_ReloadUnderLoad(t *testing.T) {
	const limit, rate = 1000, 100
	dur := 6 * time.Second
	c := startCluster(t, clusterSpec{regions: 2, nodes: 1, limit: limit, window: pickWindow(dur + time.Minute)})
	nodes := c.all()
	// Warm up on another key, then count goroutines at rest.
	load(t, nodes, freshKey("warm"), 50, time.Second, nil)
	time.Sleep(500 * time.Millisecond)
	before := make([]int, len(nodes))
	for i, n := range nodes {
		before[i] = n.goroutines(t)
	}
	key := freshKey("reload")
	reload := func() {
		for _, n := range nodes {
			bin, _ := caddyBinary()
			out, err := exec.Command(bin, "reload", "--config", n.file, "--address", fmt.Sprintf("localhost:%d", n.admin), "--force").CombinedOutput()
			if err != nil {
				t.Errorf("caddy reload: %v\n%s", err, out)
			}
		}
	}
	res := load(t, nodes, key, rate, dur, reload)
	t.Logf("reload under load: admitted %d, denied %d, other %d, p99 %s", res.ok, res.denied, res.other, res.p99())
	if res.other != 0 {
		t.Fatalf("%d responses neither 200 nor 429 across the reload (by status, 0 for a transport error: %v)", res.other, res.otherCodes)
	}
	if res.denied != 0 {
		t.Fatalf("%d denials under the limit", res.denied)
	}
	waitConverged(t, c, key, []int64{res.okBy[0], res.okBy[1]}, 15*time.Second)
	time.Sleep(time.Second) // the old configs' goroutines finish their grace
	for i, n := range nodes {
		if after := n.goroutines(t); after > before[i]+5 {
			t.Errorf("node %d: %d goroutines after the reload, %d before", i, after, before[i])
		}
	}
}

// Scenario 5: one region's Redis restarted (empty) under load: no request
// fails, the counts reconverge in both regions.
func TestRegions_RedisRestartUnderLoad(t *testing.T) {
	const limit, rate = 1000, 100
	dur := 6 * time.Second
	c := startCluster(t, clusterSpec{regions: 2, nodes: 1, limit: limit, window: pickWindow(dur + time.Minute)})
	key := freshKey("redis-restart")
	res := load(t, c.all(), key, rate, dur, func() { c.redis[0].Restart() })
	t.Logf("redis restart under load: admitted %d, denied %d, other %d, p99 %s", res.ok, res.denied, res.other, res.p99())
	if res.other != 0 {
		t.Fatalf("%d responses neither 200 nor 429 while Redis restarted", res.other)
	}
	waitConverged(t, c, key, []int64{res.okBy[0], res.okBy[1]}, 20*time.Second)
}

// Scenario 4: MariaDB stopped under load: only 200 and 429, the p99
// latency stays within max(3 × before, before + 20 ms), dropped batches
// are counted, and once MariaDB is back a burst at A is denied at B again.
func TestRegions_MariaDBStoppedUnderLoad(t *testing.T) {
	const limit, rate = 300, 100
	c := startCluster(t, clusterSpec{regions: 2, nodes: 1, limit: limit, window: pickWindow(2 * time.Minute), ownMySQL: true})
	nodes := c.all()
	before := load(t, nodes, freshKey("before"), rate, 3*time.Second, nil)
	c.mysql.Stop()
	during := load(t, nodes, freshKey("during"), rate, 3*time.Second, nil)
	pBefore, pDuring := before.p99(), during.p99()
	t.Logf("MariaDB down: p99 %s before, %s during; during: %d admitted, %d denied, %d other",
		pBefore, pDuring, during.ok, during.denied, during.other)
	if before.other+during.other != 0 {
		t.Fatalf("%d responses neither 200 nor 429", before.other+during.other)
	}
	if bound := max(3*pBefore, pBefore+20*time.Millisecond); pDuring > bound {
		t.Fatalf("p99 %s with MariaDB down > %s", pDuring, bound)
	}
	var dropped int64
	for _, n := range nodes {
		dropped += n.status(t).Propagation.DroppedBatches
	}
	if dropped == 0 {
		t.Fatal("no dropped batch counted while MariaDB was down")
	}
	if err := c.mysql.Restart(); err != nil {
		t.Fatal(err)
	}
	// The write breaker may be open: a burst at A reaches B once it probes
	// again (breaker_timeout, 5 s by default).
	key := freshKey("after")
	a, b := c.regions[0][0], c.regions[1][0]
	for i := 0; i < 2*limit && sendKey(loadClient, a.url("/"), key) != http.StatusTooManyRequests; i++ {
	}
	start := time.Now()
	redistest.Eventually(t, 30*time.Second, "B learns of A's burst after MariaDB restarted", func() bool {
		kc, ok := b.counters(key)
		return ok && kc.Effective >= limit
	})
	t.Logf("after the restart B learned of A's burst in %s; %d batches dropped while down", time.Since(start), dropped)
	if code := sendKey(loadClient, b.url("/"), key); code != http.StatusTooManyRequests {
		t.Fatalf("B answered %d, want 429", code)
	}
}

// Scenario 8: cleanup deletes expired rows and nothing else. The rows are
// there before the nodes start; every node cleans soon after it starts
// (and every minute after), all at once, safely.
func TestRegions_CleanupDeletesExpiredRowsOnly(t *testing.T) {
	now := time.Now().UnixMilli()
	expired := []int64{1, now - 60_000, now - 1}
	live := []int64{now + 60_000, now + 3_600_000}
	var db *sql.DB
	seed := func(dsn string) {
		db = mysqltest.Open(t, dsn)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := propagation.Migrate(ctx, db); err != nil {
			t.Fatal(err)
		}
		for i, exp := range append(append([]int64{}, expired...), live...) {
			id := []byte(fmt.Sprintf("cleanup-%d", i))
			if _, err := db.Exec(`INSERT INTO ratelimit_global_counts (namespace, identifier, window_ms, sequence, region, count, expires_ms)
				VALUES (?, ?, 60000, 1, ?, 5, ?)`,
				[]byte("global"), id, []byte("region-z"), exp); err != nil {
				t.Fatal(err)
			}
			if _, err := db.Exec(`INSERT INTO ratelimit_blocklist (namespace, identifier, window_ms, sequence, origin_region, limit_units, count_cur, count_prev, expires_ms)
				VALUES (?, ?, 60000, 1, ?, 10, 5, 0, ?)`,
				[]byte("global"), id, []byte("region-z"), exp); err != nil {
				t.Fatal(err)
			}
		}
	}
	startCluster(t, clusterSpec{regions: 2, nodes: 1, limit: 10, window: pickWindow(time.Minute), beforeNodes: seed})
	count := func(table, cond string) int {
		var n int
		if err := db.QueryRow(`SELECT COUNT(*) FROM `+table+` WHERE `+cond, now).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	redistest.Eventually(t, 30*time.Second, "expired rows deleted", func() bool {
		return count("ratelimit_global_counts", "expires_ms <= ?") == 0 && count("ratelimit_blocklist", "expires_ms <= ?") == 0
	})
	for _, table := range []string{"ratelimit_global_counts", "ratelimit_blocklist"} {
		if n := count(table, "expires_ms > ?"); n != len(live) {
			t.Fatalf("%s: %d live rows left, want %d", table, n, len(live))
		}
	}
}
