package integration

import (
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// The region's role: one node of a region talks to MySQL for all of them
// (issue 17). These scenarios kill holders, stop a replica and count
// MariaDB's own statements.

// holderOf waits until exactly one of nodes holds its region's role and
// every one of them names it, and returns it.
func holderOf(t *testing.T, nodes []*regionNode, within time.Duration) *regionNode {
	t.Helper()
	var holder *regionNode
	redistest.Eventually(t, within, "one holder that every node names", func() bool {
		holder = nil
		id := ""
		for _, n := range nodes {
			var st propStatus
			if err := n.adminGet("/ratelimit/status", &st); err != nil || st.Propagation == nil {
				return false
			}
			p := st.Propagation
			if p.Role == "holder" {
				if holder != nil {
					return false
				}
				holder, id = n, p.NodeID
			}
			if id != "" && p.Holder != id {
				return false
			}
		}
		return holder != nil
	})
	return holder
}

// kill ends the node with SIGKILL: no flush, no lease released.
func kill(t *testing.T, n *regionNode) {
	t.Helper()
	if err := n.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = n.cmd.Wait()
}

func without(nodes []*regionNode, gone ...*regionNode) []*regionNode {
	var out []*regionNode
	for _, n := range nodes {
		keep := true
		for _, g := range gone {
			keep = keep && n != g
		}
		if keep {
			out = append(out, n)
		}
	}
	return out
}

// TestRegions_HolderKilledHandsTheRoleOn: region A's role holder dies
// (kill -9); another of its nodes holds the role within 3 × mysql_flush
// plus the lease. Then a second node dies, the last one takes the role,
// and a burst at it is denied at region B within the bound of
// TestRegions_BurstAtADeniedAtB.
func TestRegions_HolderKilledHandsTheRoleOn(t *testing.T) {
	c := startCluster(t, clusterSpec{regions: 2, nodes: 3, limit: 50, window: pickWindow(time.Minute)})
	a := c.regions[0]
	lease := 3*testFlush + time.Second // 3 × mysql_flush + mysql_timeout
	first := holderOf(t, a, 10*time.Second)
	kill(t, first)
	killed := time.Now()
	second := holderOf(t, without(a, first), 10*time.Second)
	handover := time.Since(killed)
	bound := 3*testFlush + lease
	t.Logf("role handed over %s after the holder was killed (bound %s)", handover, bound)
	if handover > bound {
		t.Fatalf("the role passed after %s > %s", handover, bound)
	}
	kill(t, second)
	last := holderOf(t, without(a, first, second), 10*time.Second)
	lat := denyLatencyAt(t, last, c.regions[1][0], c.spec.limit, freshKey("after-kills"))
	burstBound := time.Duration(1.2*float64(testFlush+testBlocklistSync)) + 250*time.Millisecond
	t.Logf("with two of three nodes killed, region B saw A's burst %s after A's first denial (bound %s)", lat, burstBound)
	if lat > burstBound {
		t.Fatalf("B learned of the burst after %s > %s", lat, burstBound)
	}
}

// TestRegions_MariaDBStalledKeepsOneHolder: MariaDB stops answering
// (SIGSTOP: it accepts connections and answers nothing) for three lease
// lengths. Each of the holder's queries waits mysql_timeout, and a flush
// has several: it once outlasted its lease, the other node took the role,
// and both talked to MySQL for the region (both showed holder). Now the
// holder renews its lease as its flush waits: at no moment do two nodes
// hold the role, and once MariaDB answers the same node still holds it.
func TestRegions_MariaDBStalledKeepsOneHolder(t *testing.T) {
	c := startCluster(t, clusterSpec{regions: 1, nodes: 2, limit: 50, window: pickWindow(time.Minute), ownMySQL: true})
	nodes := c.regions[0]
	first := holderOf(t, nodes, 10*time.Second)
	lease := 3*testFlush + time.Second // 3 × mysql_flush + mysql_timeout
	c.mysql.Pause()
	t.Cleanup(c.mysql.Resume)
	paused := time.Now()
	samples := 0
	for time.Since(paused) < 3*lease { // the stall lasts this long: the scenario, not a wait
		var roles []string
		for _, n := range nodes {
			roles = append(roles, n.status(t).Propagation.Role)
		}
		if roles[0] == "holder" && roles[1] == "holder" {
			t.Fatalf("%s into MariaDB's stall both nodes hold the region's role", time.Since(paused).Round(time.Millisecond))
		}
		samples++
		time.Sleep(testFlush / 4)
	}
	c.mysql.Resume()
	if again := holderOf(t, nodes, 10*time.Second); again != first {
		t.Fatal("the role passed to the other node during MariaDB's stall")
	}
	st := first.status(t).Propagation
	t.Logf("MariaDB stalled %s: %d samples of both nodes' roles, one holder in each; the holder renewed its lease %d times within flushes",
		3*lease, samples, st.LeaseRenewals)
	if st.LeaseRenewals == 0 || st.RoleTaken != 1 {
		t.Fatalf("the holder renewed its lease within flushes %d times and took the role %d times: want renewals, and the role taken once",
			st.LeaseRenewals, st.RoleTaken)
	}
}

// TestRegions_ReplicaStoppedReaderCatchesUp: region B pulls from a replica
// whose SQL thread stops for 3 s while region A bursts; B learns of the
// burst within 1.2 × (mysql_flush + global_sync) of the replica resuming.
func TestRegions_ReplicaStoppedReaderCatchesUp(t *testing.T) {
	c := startCluster(t, clusterSpec{regions: 2, nodes: 1, limit: 50, window: pickWindow(time.Minute), replica: true})
	a, b := c.regions[0][0], c.regions[1][0]
	key := freshKey("replica")
	c.pair.StopApplying(t)
	denied := false
	for i := int64(0); i < 2*c.spec.limit && !denied; i++ {
		denied = sendKey(loadClient, a.url("/"), key) == http.StatusTooManyRequests
	}
	if !denied {
		t.Fatal("region A never denied")
	}
	time.Sleep(3 * time.Second) // the replica stays stopped for 3 s: the scenario, not a wait
	if kc, ok := b.counters(key); ok && kc.Effective >= c.spec.limit {
		t.Fatalf("B learned of the burst through a stopped replica: %+v", kc)
	}
	c.pair.StartApplying(t)
	resumed := time.Now()
	redistest.Eventually(t, 10*time.Second, "B learns of A's burst", func() bool {
		kc, ok := b.counters(key)
		return ok && kc.Effective >= c.spec.limit
	})
	lat, bound := time.Since(resumed), time.Duration(1.2*float64(testFlush+testGlobalSync))
	t.Logf("B learned of A's burst %s after the replica resumed (bound %s)", lat, bound)
	if lat > bound {
		t.Fatalf("B learned of the burst %s after the replica resumed > %s", lat, bound)
	}
}

// mysqlCounters reads MariaDB's own counters: statements (Questions) and
// rows read (Rows_read in MariaDB, Innodb_rows_read in MySQL). A server
// that shows neither fails the test: a rows figure of 0 must mean none.
func mysqlCounters(t *testing.T, dsn string) (statements, rows float64) {
	t.Helper()
	db := mysqltest.Open(t, dsn)
	rs, err := db.Query(`SHOW GLOBAL STATUS WHERE Variable_name IN ('Questions', 'Rows_read', 'Innodb_rows_read')`)
	if err != nil {
		t.Fatal(err)
	}
	defer rs.Close()
	seen := map[string]float64{}
	for rs.Next() {
		var name string
		var v float64
		if err := rs.Scan(&name, &v); err != nil {
			t.Fatal(err)
		}
		seen[name] = v
	}
	if err := rs.Err(); err != nil {
		t.Fatal(err)
	}
	statements, ok := seen["Questions"]
	if !ok {
		t.Fatal("the server shows no Questions in SHOW GLOBAL STATUS")
	}
	if rows, ok = seen["Rows_read"]; !ok {
		if rows, ok = seen["Innodb_rows_read"]; !ok {
			t.Fatal("the server shows neither Rows_read nor Innodb_rows_read in SHOW GLOBAL STATUS")
		}
	}
	return statements, rows
}

// loadFlush is mysql_flush in the MySQL load tests.
const loadFlush = 200 * time.Millisecond

// mysqlLoad runs one region of n nodes with live keys at 60 % of their
// limit and no traffic during the measurement, and returns MariaDB's
// statements and rows read per second over d.
func mysqlLoad(t *testing.T, n, keys int, d time.Duration) (statements, rows float64) {
	c := startCluster(t, clusterSpec{regions: 1, nodes: n, limit: 10, window: pickWindow(d + time.Minute), ownMySQL: true,
		flush: loadFlush, globalSync: time.Second, blocklistSync: time.Second})
	nodes := c.all()
	tag := freshKey("load")
	var wg sync.WaitGroup
	for k := range keys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 6 {
				if code := sendKey(loadClient, nodes[(k+i)%len(nodes)].url("/"), fmt.Sprintf("%s-%d", tag, k)); code != http.StatusOK {
					t.Errorf("key %d request %d: %d", k, i, code)
				}
			}
		}()
	}
	wg.Wait()
	holderOf(t, nodes, 10*time.Second)
	waitSteady(t, nodes, 3*time.Second)
	s0, r0 := mysqlCounters(t, c.dsn)
	time.Sleep(d) // the measurement
	s1, r1 := mysqlCounters(t, c.dsn)
	return (s1 - s0) / d.Seconds(), (r1 - r0) / d.Seconds()
}

// waitSteady waits until the region has published what its traffic
// counted: no node registered a cell or wrote a row for quiet (the
// replays, registrations and publications of the last requests are done),
// so the measurement sees a region whose counts do not change.
func waitSteady(t *testing.T, nodes []*regionNode, quiet time.Duration) {
	t.Helper()
	sig := func() int64 {
		var sum int64
		for _, n := range nodes {
			p := n.status(t).Propagation
			sum += p.RowsEmitted.GlobalCounts + p.RowsEmitted.Blocklist + p.CellsRegistered
		}
		return sum
	}
	last, since := sig(), time.Now()
	redistest.Eventually(t, 60*time.Second, "a region whose counts stopped changing", func() bool {
		if s := sig(); s != last {
			last, since = s, time.Now()
		}
		return time.Since(since) >= quiet
	})
}

// TestRegions_MySQLLoadFollowsRegionsNotNodes: one region's MySQL load,
// 400 live keys at 60 % of their limit and no traffic, with one and with
// four nodes: statements and rows read per second within 1.5 × of each
// other, and rows read per second at most a quarter of the live cells.
// The region's counts stop changing before the measurement.
func TestRegions_MySQLLoadFollowsRegionsNotNodes(t *testing.T) {
	const keys, d = 400, 10 * time.Second
	s1, r1 := mysqlLoad(t, 1, keys, d)
	s4, r4 := mysqlLoad(t, 4, keys, d)
	t.Logf("MySQL load of one region, %d live keys: 1 node %.1f statements/s %.1f rows read/s; 4 nodes %.1f statements/s %.1f rows read/s",
		keys, s1, r1, s4, r4)
	// With no count changing, the rows read are the whole reads, one
	// every tenth global_sync (10 s here, jittered): a measurement of 10 s
	// holds one or two, so the ratio's floor is one whole read.
	whole := float64(keys) / d.Seconds()
	// Likewise the holder's floor of statements is its pulls: three a
	// flush (counts, denial rows, overrides) at loadFlush. A busy
	// machine slows the one node's ticks (7.4 a second once, under load),
	// which four nodes talking to MySQL each would pass four times over.
	pulls := 3 / loadFlush.Seconds()
	if s4 > 1.5*max(s1, pulls) || r4 > 1.5*max(r1, whole) {
		t.Fatalf("4 nodes cost MySQL %.1f statements/s and %.1f rows/s, 1 node %.1f and %.1f: more than 1.5 ×", s4, r4, s1, r1)
	}
	if r1 > keys/4 || r4 > keys/4 {
		t.Fatalf("rows read/s %.1f (1 node), %.1f (4 nodes) with no count changing, want at most a quarter of %d live cells", r1, r4, keys)
	}
}
