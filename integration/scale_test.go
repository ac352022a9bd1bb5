//go:build scale

package integration

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/sim"
)

// The scale harness, run by `make regions`: R regions × N nodes of real
// Caddy processes, a Redis per region, a MariaDB primary and a replica
// that the regions after the first read from. Each cluster runs even
// traffic, traffic skewed over the regions and a burst at one region, and
// prints what was admitted, what it cost MySQL and each region's Redis,
// and which node holds each region's role. A second table is the steady
// region of issue 17: live keys, no traffic, MySQL's load with 1, 2 and 4
// nodes. SCALE_REGIONS and SCALE_NODES (comma lists) choose the sizes.

// The intervals of the measurement in issue 17.
const (
	scaleFlush = 200 * time.Millisecond
	scaleSync  = time.Second
)

func scaleSizes(t *testing.T, env string, def []int) []int {
	t.Helper()
	v := os.Getenv(env)
	if v == "" {
		return def
	}
	var out []int
	for _, f := range strings.Split(v, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			t.Fatalf("%s=%q: want a comma list of positive numbers", env, v)
		}
		out = append(out, n)
	}
	return out
}

// costs is a snapshot of what the servers have done: MariaDB's statements
// and rows read on the primary and the replica, and the commands each
// region's Redis processed.
type costs struct {
	at                  time.Time
	stmts, rows         float64
	replStmts, replRows float64
	redis               []float64
}

func (c *cluster) costs(t *testing.T) costs {
	t.Helper()
	s := costs{at: time.Now()}
	s.stmts, s.rows = mysqlCounters(t, c.dsn)
	if c.readDSN != "" {
		s.replStmts, s.replRows = mysqlCounters(t, c.readDSN)
	}
	for _, rs := range c.redis {
		s.redis = append(s.redis, redisCommands(t, rs))
	}
	return s
}

// rates are the cost per second from s0 to s1: MySQL statements and rows
// read on the primary and on the replica.
func rates(s0, s1 costs) (stmts, rows, replStmts, replRows float64) {
	d := s1.at.Sub(s0.at).Seconds()
	return (s1.stmts - s0.stmts) / d, (s1.rows - s0.rows) / d, (s1.replStmts - s0.replStmts) / d, (s1.replRows - s0.replRows) / d
}

// The simulator beside the real processes: the same load on the same
// sizes (internal/sim's HarnessLoad and HarnessSteady), its figures
// printed next to the measured ones. internal/sim's agreement test keeps
// the simulator within ± 3 % of the limit and ± 25 % of MySQL's load of
// what this harness measured.
const compareHeader = "| regions × nodes | scenario | admitted / limit: real · simulated | MySQL statements/s on the primary: real · simulated | on the replica, per region reading it: real · simulated | MySQL rows read/s, primary + replica: real · simulated | Redis commands/s per region: real · simulated |\n| --- | --- | --- | --- | --- | --- | --- |\n"

// compareRow runs the simulator on the harness's load and formats it
// beside the real figures.
func compareRow(t *testing.T, size, scenario string, regions, nodes int, shares []int, admitted float64, s0, s1 costs) string {
	t.Helper()
	res, err := sim.Run(sim.HarnessLoad(regions, nodes, shares))
	if err != nil {
		t.Fatal(err)
	}
	f := res.Figures()
	stmts, rows, replStmts, replRows := rates(s0, s1)
	readers := float64(max(regions-1, 1))
	d := s1.at.Sub(s0.at).Seconds()
	var real, simulated []string
	for i := range s1.redis {
		real = append(real, fmt.Sprintf("%.0f", (s1.redis[i]-s0.redis[i])/d))
		simulated = append(simulated, fmt.Sprintf("%.0f", f.Redis[i]))
	}
	return fmt.Sprintf("| %s | %s | %.2f · %.2f | %.1f · %.1f | %.1f · %.1f | %.0f + %.0f · %.0f + %.0f | %s · %s |\n", size, scenario,
		admitted, f.Admitted, stmts, f.Statements, replStmts/readers, f.ReplicaStatements,
		rows, replRows, f.RowsRead, f.ReplicaRowsRead*readers, strings.Join(real, " / "), strings.Join(simulated, " / "))
}

// since formats the cost per second from s0 to s1: MySQL statements/s
// and rows read/s (primary + replica) and each region's Redis commands/s.
func since(s0, s1 costs) (stmts, rows string, redis string) {
	d := s1.at.Sub(s0.at).Seconds()
	stmts = fmt.Sprintf("%.0f + %.0f", (s1.stmts-s0.stmts)/d, (s1.replStmts-s0.replStmts)/d)
	rows = fmt.Sprintf("%.0f + %.0f", (s1.rows-s0.rows)/d, (s1.replRows-s0.replRows)/d)
	var rs []string
	for i := range s1.redis {
		rs = append(rs, fmt.Sprintf("%.0f", (s1.redis[i]-s0.redis[i])/d))
	}
	return stmts, rows, strings.Join(rs, " / ")
}

// weighted returns the cluster's nodes repeated so that a round robin
// over the result sends region r shares[r] parts of the traffic, spread
// evenly over the region's nodes.
func weighted(c *cluster, shares []int) []*regionNode {
	var out []*regionNode
	nodes := len(c.regions[0])
	for turn := 0; turn < nodes; turn++ {
		for r, share := range shares {
			for range share {
				out = append(out, c.regions[r][turn])
			}
		}
	}
	return out
}

// holders names the node (its place in the region, from 1) holding each
// region's role.
func holders(t *testing.T, c *cluster) string {
	var out []string
	for _, nodes := range c.regions {
		h := holderOf(t, nodes, 10*time.Second)
		for i, n := range nodes {
			if n == h {
				out = append(out, strconv.Itoa(i+1))
			}
		}
	}
	return strings.Join(out, " / ")
}

func skewShares(regions int) ([]int, string) {
	switch regions {
	case 1:
		return []int{1}, "100"
	case 2:
		return []int{7, 3}, "70/30"
	case 3:
		return []int{6, 3, 1}, "60/30/10"
	}
	shares := make([]int, regions)
	shares[0] = regions
	for i := 1; i < regions; i++ {
		shares[i] = 1
	}
	return shares, "first region half"
}

const scaleHeader = "| regions × nodes | scenario | admitted / limit | burst at A seen at B | MySQL statements/s (primary + replica) | MySQL rows read/s (primary + replica) | Redis commands/s per region | role held by node |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n"

// TestScale_Regions runs the traffic scenarios on each size.
func TestScale_Regions(t *testing.T) {
	const limit, rate = 300, 80
	dur := time.Duration(float64(2*limit)/rate*float64(time.Second)) + 500*time.Millisecond
	var b, cmp strings.Builder
	b.WriteString(scaleHeader)
	cmp.WriteString(compareHeader)
	for _, regions := range scaleSizes(t, "SCALE_REGIONS", []int{2, 3}) {
		for _, nodes := range scaleSizes(t, "SCALE_NODES", []int{1, 2, 4}) {
			t.Run(fmt.Sprintf("%dx%d", regions, nodes), func(t *testing.T) {
				c := startCluster(t, clusterSpec{regions: regions, nodes: nodes, limit: limit, window: pickWindow(3 * time.Minute),
					replica: true, flush: scaleFlush, globalSync: scaleSync, blocklistSync: scaleSync})
				size := fmt.Sprintf("%d × %d", regions, nodes)
				even := make([]int, regions)
				for i := range even {
					even[i] = 1
				}
				skew, skewName := skewShares(regions)
				for _, sc := range []struct {
					name   string
					shares []int
				}{{"even", even}, {"skewed " + skewName, skew}} {
					s0 := c.costs(t)
					res := load(t, weighted(c, sc.shares), freshKey("scale"), rate, dur, nil)
					s1 := c.costs(t)
					stmts, rows, redis := since(s0, s1)
					ratio := float64(res.ok) / limit
					fmt.Fprintf(&b, "| %s | %s, %d req/s for %s | %.2f | | %s | %s | %s | %s |\n",
						size, sc.name, rate, dur, ratio, stmts, rows, redis, holders(t, c))
					cmp.WriteString(compareRow(t, size, sc.name, regions, nodes, sc.shares, ratio, s0, s1))
					if res.other != 0 || ratio > 1.10 || ratio < 0.95 {
						t.Errorf("%s %s: admitted %d of %d (%.2f ×), %d other answers", size, sc.name, res.ok, limit, ratio, res.other)
					}
				}
				s0 := c.costs(t)
				lat := denyLatencyAt(t, c.regions[0][0], c.regions[1][0], limit, freshKey("scale-burst"))
				s1 := c.costs(t)
				stmts, rows, redis := since(s0, s1)
				fmt.Fprintf(&b, "| %s | burst at A | | %s | %s | %s | %s | %s |\n",
					size, lat.Round(time.Millisecond), stmts, rows, redis, holders(t, c))
				if bound := time.Duration(1.2*float64(scaleFlush+scaleSync)) + 250*time.Millisecond; lat > bound {
					t.Errorf("%s: B learned of the burst after %s > %s", size, lat, bound)
				}
			})
		}
	}
	fmt.Printf("\nscale: limit %d per window, mysql_flush %s, global_sync and blocklist_sync %s; the regions after the first read from the replica\n%s",
		limit, scaleFlush, scaleSync, b.String())
	fmt.Printf("\nscale: the real processes beside the simulator on the same loads (go run ./cmd/ratelimit-sim models them; internal/sim's agreement test)\n%s", cmp.String())
}

// TestScale_SteadyRegion is issue 17's measurement: one region, 400 live
// keys at 60 % of their limit, no traffic during the measurement, MySQL's
// own counters over 10 s, with 1, 2 and 4 nodes.
func TestScale_SteadyRegion(t *testing.T) {
	const keys, d = 400, 10 * time.Second
	var b strings.Builder
	b.WriteString("| nodes | statements/s: real · simulated | rows read/s: real · simulated |\n| --- | --- | --- |\n")
	var first float64
	for _, n := range scaleSizes(t, "SCALE_NODES", []int{1, 2, 4}) {
		s, r := mysqlLoad(t, n, keys, d)
		res, err := sim.Run(sim.HarnessSteady(n))
		if err != nil {
			t.Fatal(err)
		}
		f := res.Figures()
		fmt.Fprintf(&b, "| %d | %.1f · %.1f | %.1f · %.1f |\n", n, s, f.Statements, r, f.RowsRead)
		if first == 0 {
			first = s
		}
		if s > 1.5*first || r > keys/4 {
			t.Errorf("%d nodes: %.1f statements/s (1 node %.1f), %.1f rows read/s (bound %d)", n, s, first, r, keys/4)
		}
	}
	fmt.Printf("\nscale: one region, %d live keys at 60 %% of their limit, no traffic, MariaDB's counters over %s (mysql_flush %s, global_sync and blocklist_sync %s)\n%s",
		keys, d, scaleFlush, scaleSync, b.String())
}
