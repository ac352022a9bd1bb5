package integration

import (
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// The multi-region harness: R regions × N Caddy processes built from
// cmd/caddy, a private redis-server per region and one private mariadbd
// (shared by the test binary; every scenario has a database of its own).
// Everything is torn down by t.Cleanup, also when a scenario fails.

var sharedMySQL mysqltest.Shared

func TestMain(m *testing.M) { os.Exit(mysqltest.Main(m, &sharedMySQL)) }

// Test intervals of the cross-region layer (issue 10's short form).
const (
	testFlush         = 100 * time.Millisecond
	testGlobalSync    = 200 * time.Millisecond
	testBlocklistSync = 200 * time.Millisecond
)

// clusterSpec describes a multi-region cluster.
type clusterSpec struct {
	regions, nodes int
	limit          int64
	window         time.Duration
	// noRedis runs the nodes without a regional origin (each node is its
	// own region for the cross-region layer).
	noRedis bool
	// secret sets identifier_secret on every node.
	secret string
	// key is the zone's key placeholder (default the X-Key header).
	key string
	// extra global lines.
	extra string
	// zoneExtra are extra lines of the zone block (an override line).
	zoneExtra string
	// ownMySQL gives the cluster a mariadbd of its own (a scenario that
	// stops it).
	ownMySQL bool
	// beforeNodes, if set, runs on the fresh database before any node
	// starts.
	beforeNodes func(dsn string)
	// flush, globalSync and blocklistSync replace the test intervals.
	flush, globalSync, blocklistSync time.Duration
	// windows, if set, gives region r's zone windows[r] in place of window
	// (a fleet whose regions disagree).
	windows []time.Duration
	// replica gives the cluster a MariaDB primary and a replica of it
	// (its own pair); the regions after the first pull from the replica
	// (mysql_read), as regions far from the primary do.
	replica bool
	// regionDSN, if set, gives region r's nodes the DSN it returns for
	// the cluster's (one through a proxy that cuts the region off).
	regionDSN func(r int, dsn string) string
}

type cluster struct {
	t       *testing.T
	spec    clusterSpec
	mysql   *mysqltest.Server
	dsn     string
	pair    *mysqltest.Pair
	readDSN string
	redis   []*redistest.Server
	regions [][]*regionNode
}

// regionNode is one Caddy process of a region.
type regionNode struct {
	*node
	region string
	file   string
}

// pickWindow returns a window (whole minutes) whose current fixed window
// has at least need left, so a scenario runs inside one cell without
// sleeping to a border: the sliding window's previous cell then weighs
// nothing, and the count admitted is the count of one cell.
func pickWindow(need time.Duration) time.Duration {
	now := time.Now().UnixMilli()
	for m := 60; ; m++ {
		w := time.Duration(m) * time.Minute
		if left := w.Milliseconds() - now%w.Milliseconds(); time.Duration(left)*time.Millisecond > need {
			return w
		}
	}
}

// startCluster starts the servers and the nodes and waits until every
// node serves and its propagation layer has migrated.
func startCluster(t *testing.T, spec clusterSpec) *cluster {
	t.Helper()
	requireBinary(t, "redis-server")
	spec.flush = cmp.Or(spec.flush, testFlush)
	spec.globalSync = cmp.Or(spec.globalSync, testGlobalSync)
	spec.blocklistSync = cmp.Or(spec.blocklistSync, testBlocklistSync)
	c := &cluster{t: t, spec: spec}
	switch {
	case spec.replica:
		c.pair = mysqltest.StartPair(t)
		c.mysql = c.pair.Primary
		c.dsn, c.readDSN = c.pair.NewDatabase(t)
	case spec.ownMySQL:
		c.mysql = mysqltest.Start(t)
		c.dsn = c.mysql.NewDatabase(t)
	default:
		c.mysql = sharedMySQL.Get(t)
		c.dsn = c.mysql.NewDatabase(t)
	}
	if spec.beforeNodes != nil {
		spec.beforeNodes(c.dsn)
	}
	if spec.key == "" {
		spec.key = "{http.request.header.X-Key}"
		c.spec.key = spec.key
	}
	for r := 0; r < spec.regions; r++ {
		var rs *redistest.Server
		if !spec.noRedis {
			rs = redistest.Start(t)
		}
		c.redis = append(c.redis, rs)
		var nodes []*regionNode
		for n := 0; n < spec.nodes; n++ {
			nodes = append(nodes, c.startNode(r))
		}
		c.regions = append(c.regions, nodes)
	}
	for _, n := range c.all() {
		n.waitReady(t)
	}
	return c
}

func regionName(r int) string { return fmt.Sprintf("region-%c", 'a'+r) }

// globalLines is the ratelimit global option of region r's nodes.
func (c *cluster) globalLines(r int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "\t\tregion %s\n", regionName(r))
	if rs := c.redis[r]; rs != nil {
		fmt.Fprintf(&b, "\t\tredis %s\n\t\tfast_tick 10ms\n", rs.URL())
	}
	fmt.Fprintf(&b, "\t\tmysql {env.RATELIMIT_MYSQL_DSN}\n")
	if c.readDSN != "" && r > 0 {
		fmt.Fprintf(&b, "\t\tmysql_read {env.RATELIMIT_MYSQL_READ_DSN}\n")
	}
	fmt.Fprintf(&b, "\t\tmysql_flush %s\n\t\tglobal_sync %s\n\t\tblocklist_sync %s\n\t\tmin_window 1s\n",
		c.spec.flush, c.spec.globalSync, c.spec.blocklistSync)
	if c.spec.secret != "" {
		fmt.Fprintf(&b, "\t\tidentifier_secret %s\n", c.spec.secret)
	}
	b.WriteString(c.spec.extra)
	return b.String()
}

func (c *cluster) site(r int) string {
	window := c.spec.window
	if r < len(c.spec.windows) {
		window = c.spec.windows[r]
	}
	return fmt.Sprintf(`	ratelimit {
		zone global {
			key    %s
			limit  %d
			window %s
%s		}
		headers off
	}
	respond "ok"`, c.spec.key, c.spec.limit, window, c.spec.zoneExtra)
}

// startNode starts one node of region r (it serves once startNode
// returns; waitReady waits for its cross-region layer).
func (c *cluster) startNode(r int) *regionNode {
	c.t.Helper()
	bin, err := caddyBinary()
	if err != nil {
		c.t.Fatal(err)
	}
	return c.startNodeOf(r, bin)
}

// startNodeOf starts one node of region r from the Caddy binary bin (a
// build of another commit, in a rolling deploy's tests).
func (c *cluster) startNodeOf(r int, bin string) *regionNode {
	t := c.t
	t.Helper()
	n := &regionNode{node: &node{t: t, log: new(logBuffer), admin: redistest.MustFreePort(t), port: redistest.MustFreePort(t)}, region: regionName(r)}
	dir := t.TempDir()
	n.file = filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(n.file, []byte(c.caddyfile(r, n.node)), 0o600); err != nil {
		t.Fatal(err)
	}
	dsn := c.dsn
	if c.spec.regionDSN != nil {
		dsn = c.spec.regionDSN(r, dsn)
	}
	n.cmd = exec.Command(bin, "run", "--config", n.file)
	n.cmd.Env = append(os.Environ(), "HOME="+dir, "XDG_DATA_HOME="+dir, "XDG_CONFIG_HOME="+dir,
		"RATELIMIT_MYSQL_DSN="+dsn, "RATELIMIT_MYSQL_READ_DSN="+c.readDSN)
	n.cmd.Stdout, n.cmd.Stderr = n.log, n.log
	if err := n.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.stop)
	return n
}

func (c *cluster) caddyfile(r int, n *node) string {
	return fmt.Sprintf(`{
	admin localhost:%d
	http_port %d
	auto_https off
	persist_config off
	skip_install_trust
	grace_period 1s
	ratelimit {
%s	}
}

http://127.0.0.1:%d {
	bind 127.0.0.1
%s
}
`, n.admin, n.port, c.globalLines(r), n.port, c.site(r))
}

func (c *cluster) all() []*regionNode {
	var out []*regionNode
	for _, ns := range c.regions {
		out = append(out, ns...)
	}
	return out
}

// propStatus is the part of the admin status the scenarios read.
type propStatus struct {
	Propagation *struct {
		Region      string `json:"region"`
		Ready       bool   `json:"ready"`
		Breaker     string `json:"breaker"`
		RowsEmitted struct {
			Blocklist    int64 `json:"blocklist"`
			GlobalCounts int64 `json:"global_counts"`
		} `json:"rows_emitted"`
		RowsApplied struct {
			Blocklist    int64 `json:"blocklist"`
			GlobalCounts int64 `json:"global_counts"`
		} `json:"rows_applied"`
		DroppedBatches  int64  `json:"dropped_batches"`
		Imports         int64  `json:"imports"`
		Role            string `json:"role"`
		RoleTaken       int64  `json:"role_taken"`
		LeaseRenewals   int64  `json:"lease_renewals"`
		Holder          string `json:"holder"`
		NodeID          string `json:"node_id"`
		CellsRegistered int64  `json:"cells_registered"`
	} `json:"propagation"`
}

func (n *regionNode) adminGet(path string, v any) error {
	resp, err := http.Get(fmt.Sprintf("http://localhost:%d%s", n.admin, path))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %d %s", path, resp.StatusCode, b)
	}
	if v == nil {
		return nil
	}
	return json.Unmarshal(b, v)
}

func (n *regionNode) status(t *testing.T) propStatus {
	t.Helper()
	var st propStatus
	if err := n.adminGet("/ratelimit/status", &st); err != nil {
		t.Fatal(err)
	}
	if st.Propagation == nil {
		t.Fatalf("node of %s has no propagation section", n.region)
	}
	return st
}

// waitReady waits until the node serves and its schema is migrated.
func (n *regionNode) waitReady(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		var st propStatus
		if err := n.adminGet("/ratelimit/status", &st); err == nil && st.Propagation != nil && st.Propagation.Ready {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("node of %s not ready within 60 s\n%s", n.region, tail(n.log.String(), 3000))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// counters returns the key's counters on the node, or false when it holds
// none.
type keyCounters struct {
	Limit     int64 `json:"limit"`
	Effective int64 `json:"effective"`
	Cells     []struct {
		Sequence       int64            `json:"sequence"`
		Regional       int64            `json:"regional"`
		Global         int64            `json:"global"`
		GlobalByRegion map[string]int64 `json:"global_by_region"`
	} `json:"cells"`
}

func (n *regionNode) counters(id string) (keyCounters, bool) {
	var kc keyCounters
	err := n.adminGet("/ratelimit/counters?zone=global&identifier="+urlQueryEscape(id), &kc)
	return kc, err == nil
}

func urlQueryEscape(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.' {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}

// loadResult is what a load run saw.
type loadResult struct {
	ok, denied, other int64
	// okBy is the admitted count per node, in the order load was given.
	okBy      []int64
	latencies []time.Duration
	// otherCodes counts the other answers by status, 0 for a transport
	// error (see sendKey).
	otherCodes map[int]int64
}

func (r *loadResult) p99() time.Duration {
	if len(r.latencies) == 0 {
		return 0
	}
	l := append([]time.Duration(nil), r.latencies...)
	sort.Slice(l, func(i, j int) bool { return l[i] < l[j] })
	return l[len(l)*99/100]
}

var loadClient = &http.Client{
	Transport: &http.Transport{MaxIdleConnsPerHost: 64, MaxConnsPerHost: 64},
	Timeout:   5 * time.Second,
}

// load offers rate requests a second for d, spread evenly (round robin)
// over nodes, all on key, and counts the answers. during, if set, runs
// once half of d has passed (an outage, a reload).
func load(t *testing.T, nodes []*regionNode, key string, rate int, d time.Duration, during func()) *loadResult {
	t.Helper()
	res := new(loadResult)
	var ok, denied, other atomic.Int64
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := time.Now()
	total := int(float64(rate) * d.Seconds())
	interval := time.Second / time.Duration(rate)
	fired := false
	okBy := make([]atomic.Int64, len(nodes))
	for i := 0; i < total; i++ {
		at := start.Add(time.Duration(i) * interval)
		time.Sleep(time.Until(at))
		if during != nil && !fired && time.Since(start) >= d/2 {
			fired = true
			wg.Add(1)
			go func() { defer wg.Done(); during() }()
		}
		ni := i % len(nodes)
		n := nodes[ni]
		wg.Add(1)
		go func() {
			defer wg.Done()
			t0 := time.Now()
			code := sendKey(loadClient, n.url("/"), key)
			el := time.Since(t0)
			switch code {
			case http.StatusOK:
				ok.Add(1)
				okBy[ni].Add(1)
			case http.StatusTooManyRequests:
				denied.Add(1)
			default:
				other.Add(1)
			}
			mu.Lock()
			res.latencies = append(res.latencies, el)
			if code != http.StatusOK && code != http.StatusTooManyRequests {
				if res.otherCodes == nil {
					res.otherCodes = map[int]int64{}
				}
				res.otherCodes[code]++
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	res.ok, res.denied, res.other = ok.Load(), denied.Load(), other.Load()
	for i := range okBy {
		res.okBy = append(res.okBy, okBy[i].Load())
	}
	return res
}

// sendKey makes one GET with the X-Key header and returns the status (0
// on a transport error).
func sendKey(c *http.Client, url, key string) int {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return 0
	}
	req.Header.Set("X-Key", key)
	resp, err := c.Do(req)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// freshKey is a key no earlier scenario used.
func freshKey(name string) string {
	return fmt.Sprintf("%s-%d", name, time.Now().UnixNano())
}

// evenTrafficBound is issue 10's accuracy bound: limit + rate × 1.2 ×
// (mysql_flush + global_sync).
func evenTrafficBound(limit int64, rate int) int64 {
	return limit + int64(float64(rate)*1.2*(testFlush+testGlobalSync).Seconds())
}

func runEvenTraffic(t *testing.T, regions, nodes int, noRedis bool) {
	const limit, rate = 300, 80
	dur := time.Duration(float64(2*limit)/rate*float64(time.Second)) + 500*time.Millisecond
	c := startCluster(t, clusterSpec{regions: regions, nodes: nodes, limit: limit, window: pickWindow(dur + 30*time.Second), noRedis: noRedis})
	key := freshKey("even")
	res := load(t, c.all(), key, rate, dur, nil)
	bound := evenTrafficBound(limit, rate)
	t.Logf("%d regions × %d nodes (redis %v), limit %d, %d req/s for %s: admitted %d (bound %d), denied %d, other %d",
		regions, nodes, !noRedis, limit, rate, dur, res.ok, bound, res.denied, res.other)
	if res.other != 0 {
		t.Fatalf("%d responses neither 200 nor 429", res.other)
	}
	if res.ok > bound {
		t.Fatalf("admitted %d > bound %d: the regions did not converge through MySQL", res.ok, bound)
	}
	if res.ok < limit*95/100 {
		t.Fatalf("admitted %d of a limit of %d with twice the limit offered: under-admission", res.ok, limit)
	}
}

// Scenario 1: traffic spread evenly over two regions at about twice the
// limit is admitted within limit + rate × 1.2 × (flush + global sync).
func TestRegions_EvenTrafficTwoRegions(t *testing.T) { runEvenTraffic(t, 2, 1, false) }

// Scenario 1 with two nodes per region.
func TestRegions_EvenTrafficTwoRegionsTwoNodes(t *testing.T) { runEvenTraffic(t, 2, 2, false) }

// Without Redis a node is its own region for the cross-region layer: two
// Redis-less nodes of one region converge through MySQL.
func TestRegions_EvenTrafficNodesWithoutRedis(t *testing.T) { runEvenTraffic(t, 1, 2, true) }

// denyLatency bursts key at region A's first node until it denies, then
// polls region B (which sees no traffic) until its counters show the key
// at the limit, and returns the time from A's first denial to then. (B's
// rows applied are no such sign: a count row A published in the middle of
// its burst may be the first to arrive, below the limit.)
func denyLatency(t *testing.T, c *cluster, key string) time.Duration {
	t.Helper()
	return denyLatencyAt(t, c.regions[0][0], c.regions[1][0], c.spec.limit, key)
}

// denyLatencyAt is denyLatency from node a of one region to node b of
// another.
func denyLatencyAt(t *testing.T, a, b *regionNode, limit int64, key string) time.Duration {
	t.Helper()
	var firstDeny time.Time
	for i := int64(0); i < limit*2; i++ {
		if sendKey(loadClient, a.url("/"), key) == http.StatusTooManyRequests {
			firstDeny = time.Now()
			break
		}
	}
	if firstDeny.IsZero() {
		t.Fatalf("region A never denied %d requests of a limit of %d", limit*2, limit)
	}
	deadline := firstDeny.Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if kc, ok := b.counters(key); ok && kc.Effective >= limit {
			return time.Since(firstDeny)
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("region B did not learn of A's burst within 10 s")
	return 0
}

// Scenarios 2 and 3: a burst at region A is denied at region B, which saw
// no traffic, within 1.2 × (flush + blocklist sync) + 250 ms; each
// (region, cell) wrote at most one denial row, and B echoed none.
func TestRegions_BurstAtADeniedAtB(t *testing.T) {
	c := startCluster(t, clusterSpec{regions: 2, nodes: 1, limit: 50, window: pickWindow(time.Minute)})
	key := freshKey("burst")
	lat := denyLatency(t, c, key)
	bound := time.Duration(1.2*float64(testFlush+testBlocklistSync)) + 250*time.Millisecond
	t.Logf("region B saw A's burst %s after A's first denial (bound %s)", lat, bound)
	if lat > bound {
		t.Fatalf("B learned of the burst after %s > %s", lat, bound)
	}
	b := c.regions[1][0]
	if code := sendKey(loadClient, b.url("/"), key); code != http.StatusTooManyRequests {
		t.Fatalf("B answered %d to the key A denied, want 429", code)
	}
	for i := 0; i < 5; i++ {
		sendKey(loadClient, b.url("/"), key)
	}
	// Scenario 3: one row per (region, cell); B's own denials (on
	// imported counts) wrote none.
	db := mysqltest.Open(t, c.dsn)
	redistest.Eventually(t, 5*time.Second, "A's denial row", func() bool {
		var n int
		_ = db.QueryRow(`SELECT COUNT(*) FROM ratelimit_blocklist WHERE identifier = ?`, []byte(key)).Scan(&n)
		return n >= 1
	})
	time.Sleep(3 * testFlush) // B's flushes have run: an echo would be written by now
	rows, err := db.Query(`SELECT origin_region, sequence FROM ratelimit_blocklist WHERE identifier = ?`, []byte(key))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for rows.Next() {
		var region []byte
		var seq int64
		_ = rows.Scan(&region, &seq)
		got = append(got, fmt.Sprintf("%s/%d", region, seq))
	}
	rows.Close()
	if len(got) != 1 || !strings.HasPrefix(got[0], regionName(0)+"/") {
		t.Fatalf("denial rows for the key: %v, want exactly one of %s", got, regionName(0))
	}
	if st := b.status(t); st.Propagation.RowsEmitted.Blocklist != 0 {
		t.Fatalf("B emitted %d denial rows: an echo", st.Propagation.RowsEmitted.Blocklist)
	}
}

// Scenario 9: with identifier_secret, rows hold HMACs and a burst at A is
// still denied at B, on B's first request for the key.
func TestRegions_IdentifierSecretBurstDeniedAtB(t *testing.T) {
	c := startCluster(t, clusterSpec{regions: 2, nodes: 1, limit: 50, window: pickWindow(time.Minute),
		secret: "integration-secret-0123456789"})
	key := freshKey("secret")
	lat := denyLatency(t, c, key)
	t.Logf("region B counted A's burst %s after A's first denial", lat)
	b := c.regions[1][0]
	if code := sendKey(loadClient, b.url("/"), key); code != http.StatusTooManyRequests {
		t.Fatalf("B's first request for the key A denied answered %d, want 429", code)
	}
	db := mysqltest.Open(t, c.dsn)
	var n int
	if err := db.QueryRow(`SELECT COUNT(*) FROM ratelimit_blocklist WHERE identifier = ?`, []byte(key)).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d rows hold the raw identifier (%v)", n, err)
	}
}

// TestRegions_AZoneOverAnotherWindowElsewhereIsLogged: region B defines
// the zone over another window than A. A's counts name cells no request
// of B weighs, so B admits its whole limit beside A's; the fleet's
// operator must hear of it from B's holder, naming the zone and both
// windows (before, nothing said so: the regions admitted twice the
// limit in silence).
func TestRegions_AZoneOverAnotherWindowElsewhereIsLogged(t *testing.T) {
	const limit = 4
	w := pickWindow(time.Minute)
	c := startCluster(t, clusterSpec{regions: 2, nodes: 1, limit: limit, window: w, windows: []time.Duration{w, w + time.Minute}})
	a, b := c.regions[0][0], c.regions[1][0]
	key := freshKey("window")
	for range limit {
		if s := sendKey(loadClient, a.url("/"), key); s != http.StatusOK {
			t.Fatalf("A's units: %d", s)
		}
	}
	want := "another region counts a zone over a window this region does not"
	redistest.EventuallyShow(t, 5*time.Second, "B's holder says the zone's windows differ", func() (bool, string) {
		return strings.Contains(b.log.String(), want), tail(b.log.String(), 1500)
	})
	admitted := 0
	for range limit {
		if sendKey(loadClient, b.url("/"), key) == http.StatusOK {
			admitted++
		}
	}
	t.Logf("B admitted %d of the key A holds at its limit of %d (the regions count the zone apart)", admitted, limit)
}
