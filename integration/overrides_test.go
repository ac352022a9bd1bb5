package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// Runtime overrides between real processes (issue 19): a change made on
// one node of one region reaches every node of every region within
// 1.2 × (mysql_flush + global_sync).

func (n *regionNode) adminSend(t *testing.T, method, path, body string) int {
	t.Helper()
	req, err := http.NewRequest(method, fmt.Sprintf("http://localhost:%d%s", n.admin, path), bytes.NewBufferString(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// reachAll waits until every node answers key with want, and returns how
// long the slowest took.
func reachAll(t *testing.T, nodes []*regionNode, key string, want int, what string) time.Duration {
	t.Helper()
	start := time.Now()
	var slowest time.Duration
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			redistest.Eventually(t, 10*time.Second, what, func() bool { return sendKey(loadClient, n.url("/"), key) == want })
			mu.Lock()
			slowest = max(slowest, time.Since(start))
			mu.Unlock()
		}()
	}
	wg.Wait()
	return slowest
}

// TestRegions_RuntimeOverrideReachesEveryNode: two regions × two nodes. A
// PUT on one node of region A raises a denied key's limit, and every node
// of both regions admits it within the bound; a DELETE on a node of B
// restores the denials everywhere; an override that expires lapses
// everywhere; a node started later applies an override from its first
// decision.
func TestRegions_RuntimeOverrideReachesEveryNode(t *testing.T) {
	c := startCluster(t, clusterSpec{regions: 2, nodes: 2, limit: 3, window: pickWindow(2 * time.Minute)})
	nodes := c.all()
	bound := time.Duration(1.2 * float64(testFlush+testGlobalSync))
	key := freshKey("override")
	for _, n := range nodes {
		for i := 0; i < 5; i++ {
			sendKey(loadClient, n.url("/"), key)
		}
	}
	reachAll(t, nodes, key, http.StatusTooManyRequests, "the key denied everywhere")
	path := "/ratelimit/overrides?zone=global&identifier=" + urlQueryEscape(key)
	if s := c.regions[0][0].adminSend(t, http.MethodPut, path, `{"limit": 100000, "reason": "plan upgrade"}`); s != http.StatusOK {
		t.Fatalf("PUT: %d", s)
	}
	up := reachAll(t, nodes, key, http.StatusOK, "the raised limit admits everywhere")
	if s := c.regions[1][1].adminSend(t, http.MethodDelete, path, ""); s != http.StatusOK {
		t.Fatalf("DELETE on a node of region B: %d", s)
	}
	down := reachAll(t, nodes, key, http.StatusTooManyRequests, "the removal denies everywhere")
	t.Logf("override raised everywhere within %s, removed within %s (bound %s)", up, down, bound)
	if up > bound || down > bound {
		t.Fatalf("an override change took %s / %s to reach every node, bound %s", up, down, bound)
	}

	// An override that expires lapses everywhere by itself.
	exp := time.Now().Add(2 * time.Second).UTC().Format(time.RFC3339Nano)
	if s := c.regions[0][1].adminSend(t, http.MethodPut, path, `{"limit": 100000, "expires": "`+exp+`"}`); s != http.StatusOK {
		t.Fatalf("PUT with an expiry: %d", s)
	}
	reachAll(t, nodes, key, http.StatusOK, "the expiring override admits everywhere")
	reachAll(t, nodes, key, http.StatusTooManyRequests, "the expired override lapsed everywhere")

	// A node that starts applies the overrides from its first decision.
	blocked := freshKey("blocked")
	if s := c.regions[1][0].adminSend(t, http.MethodPut, "/ratelimit/overrides?zone=global&identifier="+urlQueryEscape(blocked), `{"limit": 0}`); s != http.StatusOK {
		t.Fatalf("PUT limit 0: %d", s)
	}
	reachAll(t, nodes, blocked, http.StatusTooManyRequests, "limit 0 blocks everywhere")
	// A 429 alone does not show that the override reached a region: the
	// probes spend the key's limit of 3 too. A region's nodes hold it once
	// their Redis does, where a node that starts loads it from.
	for _, n := range nodes {
		redistest.Eventually(t, 10*time.Second, "the override in every node's book", func() bool {
			return n.adminGet("/ratelimit/overrides?zone=global&identifier="+urlQueryEscape(blocked), nil) == nil
		})
	}
	for r := range c.regions {
		fresh := c.startNode(r)
		if s := sendFirst(t, fresh, blocked); s != http.StatusTooManyRequests {
			t.Fatalf("a node of region %d started after the override answered %d to its first request, want 429", r, s)
		}
	}
}

// sendFirst sends the node's first request as soon as it serves.
func sendFirst(t *testing.T, n *regionNode, key string) int {
	t.Helper()
	var status int
	redistest.Eventually(t, 30*time.Second, "the new node serves", func() bool {
		status = sendKey(loadClient, n.url("/"), key)
		return status != 0
	})
	return status
}

// TestRegions_RegionResetStaysReset: one region of two nodes, a key at its
// limit on both; a reset with scope=region on one node makes every node of
// the region admit it again, and it stays reset: after more replays the
// region's count is the units admitted since.
func TestRegions_RegionResetStaysReset(t *testing.T) {
	c := startCluster(t, clusterSpec{regions: 1, nodes: 2, limit: 4, window: pickWindow(2 * time.Minute)})
	nodes := c.all()
	key := freshKey("reset")
	c.dumpOnFailure(key) // it failed once in CI: node 0 counted 5 for 4 admitted
	for _, n := range nodes {
		for i := 0; i < 4; i++ {
			sendKey(loadClient, n.url("/"), key)
		}
	}
	reachAll(t, nodes, key, http.StatusTooManyRequests, "the key denied on both nodes")
	// Units another node admitted before the reset and replays after it
	// count after it (README, "Resets"): the test resets once both nodes
	// have replayed theirs, as CI's load once delayed a replay past the
	// reset (only 3 admitted after it).
	replayed(t, nodes)
	if s := nodes[0].adminSend(t, http.MethodDelete, "/ratelimit/counters?zone=global&scope=region&identifier="+urlQueryEscape(key), ""); s != http.StatusOK {
		t.Fatalf("DELETE scope=region: %d", s)
	}
	start := time.Now()
	// Each node admits one request again (the one that sees the reset).
	reachAll(t, nodes, key, http.StatusOK, "the reset key admitted on every node")
	t.Logf("the reset reached both nodes within %s", time.Since(start))
	// Every unit admitted since the reset counts, and nothing from before
	// comes back: the region's count is what was admitted after it.
	since := int64(len(nodes))
	for i := 0; i < 8; i++ {
		if sendKey(loadClient, nodes[i%2].url("/"), key) == http.StatusOK {
			since++
		}
	}
	if since < 4 {
		t.Fatalf("only %d admitted after the reset, limit 4", since)
	}
	redistest.EventuallyShow(t, 5*time.Second, "the region counts the units since the reset", func() (bool, string) {
		kc, ok := nodes[0].counters(key)
		kc1, ok1 := nodes[1].counters(key)
		return ok && kc.Effective == since, fmt.Sprintf("%d admitted since; node 0 sees %+v (%v), node 1 %+v (%v)", since, kc, ok, kc1, ok1)
	})
}

// TestRegions_GlobalResetStaysReset: two regions × two nodes, a key at
// its limit everywhere; a reset with scope=global on a node of region A
// makes every node of both regions admit it again within 1.2 ×
// (mysql_flush + global_sync), and it stays reset: once the counts have
// travelled, every node's view of the key is the units admitted since.
func TestRegions_GlobalResetStaysReset(t *testing.T) {
	c := startCluster(t, clusterSpec{regions: 2, nodes: 2, limit: 6, window: pickWindow(2 * time.Minute)})
	nodes := c.all()
	key := freshKey("greset")
	c.dumpOnFailure(key)
	admitted := make([]int64, len(c.regions))
	for r, region := range c.regions {
		for _, n := range region {
			for i := 0; i < 6; i++ {
				if sendKey(loadClient, n.url("/"), key) == http.StatusOK {
					admitted[r]++
				}
			}
		}
	}
	reachAll(t, nodes, key, http.StatusTooManyRequests, "the key denied everywhere")
	// Every region holds all of the other's units before the reset (units
	// still travelling between regions when it is made are the next
	// scenario's).
	redistest.EventuallyShow(t, 10*time.Second, "each region imported all of the other's units", func() (bool, string) {
		for r, region := range c.regions {
			other := 1 - r
			for i, n := range region {
				kc, ok := n.counters(key)
				if !ok || len(kc.Cells) == 0 || kc.Cells[0].Global != admitted[other] {
					return false, fmt.Sprintf("%s admitted %d; node %d of %s: %+v (%v)", regionName(other), admitted[other], i, regionName(r), kc, ok)
				}
			}
		}
		return true, ""
	})
	if s := c.regions[0][0].adminSend(t, http.MethodDelete, "/ratelimit/counters?zone=global&scope=global&identifier="+urlQueryEscape(key), ""); s != http.StatusOK {
		t.Fatalf("DELETE scope=global: %d", s)
	}
	lat := reachAll(t, nodes, key, http.StatusOK, "the reset key admitted on every node of both regions")
	bound := time.Duration(1.2 * float64(testFlush+testGlobalSync))
	t.Logf("the global reset reached every node within %s (bound %s)", lat, bound)
	if lat > bound {
		t.Fatalf("the reset took %s to reach every node, bound %s", lat, bound)
	}
	since := int64(len(nodes))
	redistest.EventuallyShow(t, 10*time.Second, "every node sees the units admitted since the reset, and no more", func() (bool, string) {
		for i, n := range nodes {
			if kc, ok := n.counters(key); !ok || kc.Effective != since {
				return false, fmt.Sprintf("%d admitted since; node %d: %+v (%v)", since, i, kc, ok)
			}
		}
		return true, ""
	})
}

// replayed waits until no node has a cell whose units Redis may lack
// (pending_cells: queued, or in a write that has not returned).
func replayed(t *testing.T, nodes []*regionNode) {
	t.Helper()
	for _, n := range nodes {
		redistest.Eventually(t, 5*time.Second, "the node replayed its units", func() bool {
			var st struct {
				Engine struct {
					PendingCells *int64 `json:"pending_cells"`
				} `json:"engine"`
			}
			return n.adminGet("/ratelimit/status", &st) == nil && st.Engine.PendingCells != nil && *st.Engine.PendingCells == 0
		})
	}
}

// dumpOnFailure logs, when the test has failed, what every Redis of the
// cluster holds of the key's cells and every node's status: what a
// count that came out wrong was made of.
func (c *cluster) dumpOnFailure(key string) {
	t := c.t
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		ctx := context.Background()
		for i, srv := range c.redis {
			keys, err := srv.Client().Keys(ctx, "*"+key+"*").Result()
			if err != nil {
				t.Logf("redis %d: %v", i, err)
			}
			for _, k := range keys {
				h, _ := srv.Client().HGetAll(ctx, k).Result()
				t.Logf("redis %d: %q = %v", i, k, h)
			}
		}
		for i, n := range c.all() {
			var st json.RawMessage
			if err := n.adminGet("/ratelimit/status", &st); err != nil {
				t.Logf("node %d status: %v", i, err)
				continue
			}
			t.Logf("node %d status: %s", i, st)
		}
	})
}

// TestRegions_GlobalResetUnderTraffic: two regions × two nodes, limit
// 12. Region A counts 6 of the key and B imports them; B then admits its
// 6 and the key is reset for every region at once, before B's units can
// have reached A. Traffic goes on at B through the reset, and after it at
// every node, or at A's alone. Units B admitted before its mark must not
// come back at A when B publishes them, nor stay in A's nodes' views once
// B's mark arrives (a node's view of an import only rises): once the
// counts have travelled, every node's view of the key and the published
// rows (each region's count less its base) are the units admitted since
// the reset, exactly.
func TestRegions_GlobalResetUnderTraffic(t *testing.T) {
	t.Run("every node", func(t *testing.T) { globalResetUnderTraffic(t, true) })
	t.Run("region A alone", func(t *testing.T) { globalResetUnderTraffic(t, false) })
}

// globalResetUnderTraffic is the scenario; bAfter: B's nodes take traffic
// after the reset too.
func globalResetUnderTraffic(t *testing.T, bAfter bool) {
	const limit = 12
	c := startCluster(t, clusterSpec{regions: 2, nodes: 2, limit: limit, window: pickWindow(2 * time.Minute)})
	nodes, a, b := c.all(), c.regions[0], c.regions[1]
	key := freshKey("greset-traffic")
	c.dumpOnFailure(key)
	for _, n := range a {
		for range 3 {
			if s := sendKey(loadClient, n.url("/"), key); s != http.StatusOK {
				t.Fatalf("A's units before the reset: %d", s)
			}
		}
	}
	redistest.EventuallyShow(t, 10*time.Second, "B imported A's 6", func() (bool, string) {
		for i, n := range b {
			if kc, ok := n.counters(key); !ok || len(kc.Cells) == 0 || kc.Cells[0].Global != 6 {
				return false, fmt.Sprintf("node %d of B: %+v (%v)", i, kc, ok)
			}
		}
		return true, ""
	})
	for _, n := range b {
		for range 3 {
			if s := sendKey(loadClient, n.url("/"), key); s != http.StatusOK {
				t.Fatalf("B's units before the reset: %d", s)
			}
		}
	}
	// Each node of B denies the key (two nodes can admit a unit more
	// within a tick: README, "Accuracy and round trips"), and B's units
	// are in B's Redis (they are B's count when B marks), not yet at A:
	// B publishes every 100 ms and A pulls every 200 ms.
	reachAll(t, b, key, http.StatusTooManyRequests, "B at its limit")
	replayed(t, b)
	// Traffic at B throughout: B, at its limit, denies until it marks.
	var bAdmitted atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for _, n := range b {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				case <-time.After(10 * time.Millisecond):
				}
				if sendKey(loadClient, n.url("/"), key) == http.StatusOK {
					bAdmitted.Add(1)
				}
			}
		}()
	}
	var once sync.Once
	stopB := func() { once.Do(func() { close(stop); wg.Wait() }) }
	defer stopB()
	time.Sleep(30 * time.Millisecond) // a few of B's requests before the reset
	if n := bAdmitted.Load(); n != 0 {
		t.Fatalf("B admitted %d at its limit before the reset", n)
	}
	if s := a[0].adminSend(t, http.MethodDelete, "/ratelimit/counters?zone=global&scope=global&identifier="+urlQueryEscape(key), ""); s != http.StatusOK {
		t.Fatalf("DELETE scope=global: %d", s)
	}
	offered := nodes
	if !bAfter {
		stopB() // before B can have marked: B admitted nothing
		offered = a
	}
	res := load(t, offered, key, 40, 1500*time.Millisecond, nil)
	stopB()
	since := res.ok + bAdmitted.Load()
	t.Logf("admitted since the reset: %d by the load (%v by node), %d by B's own traffic", res.ok, res.okBy, bAdmitted.Load())
	if since < limit {
		t.Fatalf("only %d admitted in 1.5 s after the reset, limit %d", since, limit)
	}
	redistest.EventuallyShow(t, 10*time.Second, "every node sees the units admitted since the reset, and no more", func() (bool, string) {
		for i, n := range nodes {
			if kc, ok := n.counters(key); !ok || kc.Effective != since {
				return false, fmt.Sprintf("%d admitted since; node %d: %+v (%v)", since, i, kc, ok)
			}
		}
		return true, ""
	})
	// The published rows say the same: each region's count less its base.
	db := mysqltest.Open(t, c.dsn)
	w := c.spec.window.Milliseconds()
	redistest.EventuallyShow(t, 10*time.Second, "the published rows count the units since the reset", func() (bool, string) {
		rows, err := db.Query(`SELECT region, count, reset_version, reset_base FROM ratelimit_global_counts
			WHERE identifier = ? AND window_ms = ? AND sequence = ?`, []byte(key), w, time.Now().UnixMilli()/w)
		if err != nil {
			return false, err.Error()
		}
		defer rows.Close()
		var sum int64
		var got []string
		versions := map[int64]bool{}
		for rows.Next() {
			var region string
			var n, ver, base int64
			if err := rows.Scan(&region, &n, &ver, &base); err != nil {
				return false, err.Error()
			}
			sum += n - base
			versions[ver] = true
			got = append(got, fmt.Sprintf("%s: %d − %d (reset %d)", region, n, base, ver))
		}
		return len(got) == 2 && len(versions) == 1 && !versions[0] && sum == since,
			fmt.Sprintf("%d admitted since; rows %v", since, got)
	})
}

// overrideLimit returns the limit of the runtime override a node holds of
// the key, or -1 when it holds none.
func (n *regionNode) overrideLimit(key string) int64 {
	var d struct {
		Limit int64 `json:"limit"`
	}
	if n.adminGet("/ratelimit/overrides?zone=global&identifier="+urlQueryEscape(key), &d) != nil {
		return -1
	}
	return d.Limit
}

// TestRegions_TwoOperatorsPastAFutureVersionEndOnOneChange: the key's
// override carries a version minutes ahead (made on a node whose clock
// ran ahead, here written as that region's holder would have). Operators
// of regions A and B change the key at once: each change is stamped past
// the held version, so both carry the same one. Every region must end on
// the same change, the one MySQL keeps.
func TestRegions_TwoOperatorsPastAFutureVersionEndOnOneChange(t *testing.T) {
	c := startCluster(t, clusterSpec{regions: 2, nodes: 1, limit: 3, window: pickWindow(2 * time.Minute)})
	a, b := c.regions[0][0], c.regions[1][0]
	key := freshKey("tie")
	db := mysqltest.Open(t, c.dsn)
	future := time.Now().Add(10 * time.Minute).UnixMicro()
	if _, err := db.Exec(`INSERT INTO ratelimit_overrides
		(namespace, identifier, limit_units, expires_ms, reason, origin_region, version, deleted, updated_ms)
		VALUES (?, ?, 1000, 0, '', 'region-z', ?, 0, ROUND(UNIX_TIMESTAMP(NOW(3)) * 1000))`,
		[]byte("global"), []byte(key), future); err != nil {
		t.Fatal(err)
	}
	for _, n := range []*regionNode{a, b} {
		redistest.Eventually(t, 10*time.Second, "the future version in every region", func() bool { return n.overrideLimit(key) == 1000 })
	}
	path := "/ratelimit/overrides?zone=global&identifier=" + urlQueryEscape(key)
	var wg sync.WaitGroup
	for i, n := range []*regionNode{a, b} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if s := n.adminSend(t, http.MethodPut, path, fmt.Sprintf(`{"limit": %d}`, 5+2*i)); s != http.StatusOK {
				t.Errorf("PUT in %s: %d", n.region, s)
			}
		}()
	}
	wg.Wait()
	var kept int64
	redistest.EventuallyShow(t, 10*time.Second, "both regions on MySQL's change", func() (bool, string) {
		if err := db.QueryRow(`SELECT limit_units FROM ratelimit_overrides WHERE identifier = ?`, []byte(key)).Scan(&kept); err != nil {
			return false, err.Error()
		}
		la, lb := a.overrideLimit(key), b.overrideLimit(key)
		return la == kept && lb == kept, fmt.Sprintf("MySQL keeps limit %d; region A applies %d, region B %d", kept, la, lb)
	})
}
