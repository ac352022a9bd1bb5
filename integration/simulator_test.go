package integration

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/sim"
)

// TestSimulator_IdleRegionCostsWhatTheModelSays holds the simulator to
// real processes on what a region costs with no traffic at all: one
// region of real Caddy nodes on their Redis and a MariaDB of their own
// (the scale harness's intervals), Redis's commands and MariaDB's
// statements a second over 10 s, beside the simulator's run of the same
// region (sim.HarnessIdle). These are the loops every node and holder runs
// whatever the traffic: the restart watch, the runtime overrides' looks,
// the region's processes, the role and its pulls, the database's clock.
// At 200 regions × 10 nodes they are most of the Redis calls the
// simulator's tables report, so a loop the model leaves out shows here.
func TestSimulator_IdleRegionCostsWhatTheModelSays(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy, Redis and MariaDB")
	}
	const d = 10 * time.Second
	for _, nodes := range []int{1, 4} {
		c := startCluster(t, clusterSpec{regions: 1, nodes: nodes, limit: 10, window: pickWindow(time.Minute), ownMySQL: true,
			flush: 200 * time.Millisecond, globalSync: time.Second, blocklistSync: time.Second})
		holderOf(t, c.all(), 10*time.Second)
		steady(t, c)
		r0, s0 := redisCommands(t, c.redis[0]), time.Now()
		q0, _ := mysqlCounters(t, c.dsn)
		time.Sleep(d)
		r1, s1 := redisCommands(t, c.redis[0]), time.Now()
		q1, _ := mysqlCounters(t, c.dsn)
		secs := s1.Sub(s0).Seconds()
		redis, stmts := (r1-r0)/secs, (q1-q0)/secs
		res, err := sim.Run(sim.HarnessIdle(nodes))
		if err != nil {
			t.Fatal(err)
		}
		f := res.Figures()
		t.Logf("%d nodes, idle: Redis commands/s real %.0f · simulated %.0f; MySQL statements/s real %.1f · simulated %.1f",
			nodes, redis, f.Redis[0], stmts, f.Statements)
		if !within(f.Redis[0], redis, 0.15) {
			t.Errorf("%d idle nodes: the simulator's Redis runs %.0f commands/s, the real one %.0f (± 15 %%)", nodes, f.Redis[0], redis)
		}
		if !within(f.Statements, stmts, 0.10) {
			t.Errorf("%d idle nodes: the simulator's MySQL runs %.1f statements/s, the real one %.1f (± 10 %%)", nodes, f.Statements, stmts)
		}
	}
}

// steady waits until every node of c's one region runs its loops as it
// will for the rest of the test, which is what the simulator models:
// Redis counts one subscriber per node on the channel of the region's
// runtime override changes (until a node is subscribed it looks at the
// change counter every fast tick, not every slow one), and every node
// has beaten: each has its record among the region's processes, and
// each counts them all.
func steady(t *testing.T, c *cluster) {
	t.Helper()
	nodes := c.all()
	want := int64(len(nodes))
	rc := c.redis[0].Client()
	const notices, processes = "ratelimit:{overrides}:v", "ratelimit:{processes}"
	redistest.Eventually(t, 20*time.Second, "every node subscribed to the override notices", func() bool {
		subs, err := rc.PubSubNumSub(context.Background(), notices).Result()
		return err == nil && subs[notices] == want
	})
	redistest.Eventually(t, 20*time.Second, "every node's record among the region's processes", func() bool {
		n, err := rc.ZCard(context.Background(), processes).Result()
		return err == nil && n == want
	})
	var ns []*node
	for _, n := range nodes {
		ns = append(ns, n.node)
	}
	countEachOther(t, ns)
}

func within(got, want, slack float64) bool { return got >= want*(1-slack) && got <= want*(1+slack) }

// redisCommands is INFO's total_commands_processed (the INFO included).
func redisCommands(t *testing.T, rs *redistest.Server) float64 {
	t.Helper()
	info, err := rs.Client().Info(context.Background(), "stats").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "total_commands_processed:"); ok {
			n, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no total_commands_processed in INFO of %s", rs.Addr())
	return 0
}
