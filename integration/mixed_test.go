//go:build mixed

package integration

import (
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// A rolling deploy: nodes of an earlier build of this repository run
// beside nodes of this one on the same Redis and MySQL. The earlier build
// is an operator's: RATELIMIT_OLD_CADDY names its binary, built from an
// older commit. `make mixed OLD=<commit>` builds it in a git worktree and
// runs these tests (build tag mixed, so `make test` leaves them out
// rather than skipping them).

func oldCaddy(t *testing.T) string {
	t.Helper()
	bin := os.Getenv("RATELIMIT_OLD_CADDY")
	if bin == "" {
		t.Fatal("RATELIMIT_OLD_CADDY names no earlier build of cmd/caddy: run make mixed OLD=<commit>")
	}
	if _, err := os.Stat(bin); err != nil {
		t.Fatal(err)
	}
	return bin
}

// TestMixedBuilds_RollingDeploy: region A starts on the earlier build
// alone (it makes the tables as that build knows them), then a node of
// this build joins it (and upgrades the tables while the old one writes)
// and region B runs this build. The three count one key; every node must
// end on what was admitted. A runtime override set on the old node, and a
// global reset sent to a new one, must reach every node. Then the old
// node is stopped and a new one takes its place: the count carries on.
func TestMixedBuilds_RollingDeploy(t *testing.T) {
	old := oldCaddy(t)
	const limit = 40
	c := startCluster(t, clusterSpec{regions: 2, nodes: 0, limit: limit, window: pickWindow(3 * time.Minute)})
	oldA := c.startNodeOf(0, old)
	oldA.waitReady(t)
	newA := c.startNode(0)
	newB := c.startNode(1)
	newA.waitReady(t)
	newB.waitReady(t)
	c.regions[0] = append(c.regions[0], oldA, newA)
	c.regions[1] = append(c.regions[1], newB)
	nodes := []*regionNode{oldA, newA, newB}

	key := freshKey("mixed")
	c.dumpOnFailure(key)
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		db := mysqltest.Open(t, c.dsn)
		rows, err := db.Query("SELECT region, sequence, count, reset_version, reset_base, updated_ms FROM ratelimit_global_counts WHERE identifier = ?", key)
		if err != nil {
			t.Log(err)
			return
		}
		defer rows.Close()
		for rows.Next() {
			var region string
			var seq, count, ver, base, upd int64
			_ = rows.Scan(&region, &seq, &count, &ver, &base, &upd)
			t.Logf("row %s seq %d count %d reset %d base %d updated %d", region, seq, count, ver, base, upd)
		}
		orows, err := db.Query("SELECT namespace, limit_units, origin_region, version, deleted FROM ratelimit_overrides WHERE identifier = ?", key)
		if err != nil {
			t.Log(err)
			return
		}
		defer orows.Close()
		for orows.Next() {
			var ns, region string
			var lim, ver, del int64
			_ = orows.Scan(&ns, &lim, &region, &ver, &del)
			t.Logf("override row %q limit %d region %s version %d deleted %d", ns, lim, region, ver, del)
		}
	})
	admitted := 0
	for i := 0; i < 24; i++ {
		if sendKey(loadClient, nodes[i%3].url("/"), key) == http.StatusOK {
			admitted++
		}
	}
	if admitted != 24 {
		t.Fatalf("%d of 24 admitted under a limit of %d", admitted, limit)
	}
	for _, n := range nodes {
		redistest.Eventually(t, 10*time.Second, fmt.Sprintf("node of %s on %d", n.region, admitted), func() bool {
			kc, ok := n.counters(key)
			return ok && kc.Effective == int64(admitted)
		})
	}

	path := "/ratelimit/overrides?zone=global&identifier=" + urlQueryEscape(key)
	if s := oldA.adminSend(t, http.MethodPut, path, `{"limit": 2}`); s != http.StatusOK {
		t.Fatalf("PUT on the old node: %d", s)
	}
	for _, n := range nodes {
		redistest.Eventually(t, 10*time.Second, "the old node's override everywhere", func() bool { return n.overrideLimit(key) == 2 })
	}
	if s := newB.adminSend(t, http.MethodDelete, path, ""); s != http.StatusOK {
		t.Fatalf("DELETE on a new node: %d", s)
	}
	for _, n := range nodes {
		redistest.Eventually(t, 10*time.Second, "the removal everywhere", func() bool { return n.overrideLimit(key) == -1 })
	}
	if s := newB.adminSend(t, http.MethodDelete, "/ratelimit/counters?zone=global&scope=global&identifier="+urlQueryEscape(key), ""); s != http.StatusOK {
		t.Fatalf("global reset on a new node: %d", s)
	}
	for _, n := range nodes {
		redistest.Eventually(t, 10*time.Second, "the reset everywhere", func() bool {
			kc, ok := n.counters(key)
			return !ok || kc.Effective == 0
		})
	}

	// The rolling step: the old node goes, a new one takes its place,
	// traffic on every node throughout.
	since := 0
	for i := 0; i < 9; i++ {
		if sendKey(loadClient, nodes[i%3].url("/"), key) == http.StatusOK {
			since++
		}
	}
	oldA.stop()
	newA2 := c.startNode(0)
	newA2.waitReady(t)
	nodes = []*regionNode{newA2, newA, newB}
	for i := 0; i < 9; i++ {
		if sendKey(loadClient, nodes[i%3].url("/"), key) == http.StatusOK {
			since++
		}
	}
	for i, n := range nodes {
		deadline := time.Now().Add(10 * time.Second)
		for {
			kc, ok := n.counters(key)
			if ok && kc.Effective == int64(since) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("node %d of %s holds %+v (found %v) after the restart, want %d", i, n.region, kc, ok, since)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// What each build said of the other: the limiter's warnings and errors.
	for _, n := range []*regionNode{oldA, newA, newB, newA2} {
		for _, line := range strings.Split(n.log.String(), "\n") {
			if strings.Contains(line, `"logger":"ratelimit`) && (strings.Contains(line, `"level":"warn"`) || strings.Contains(line, `"level":"error"`)) {
				t.Logf("%s: %s", n.region, line)
			}
		}
	}
}
