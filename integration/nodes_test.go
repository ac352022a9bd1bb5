package integration

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/nodecheck"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// redisCluster is a nodecheck.Cluster on a real Redis: each engine has its
// own origin.Redis under a node ID of its own, as separate processes do.
type redisCluster struct {
	t       *testing.T
	srv     *redistest.Server
	prefix  string
	engines []*engine.Engine
	clocks  []*testclock.Clock
	origins []*origin.Redis
	gens    []int // each node's processes (Renew)
}

func newRedisCluster(t *testing.T, srv *redistest.Server, n int, prefix string) *redisCluster {
	c := &redisCluster{t: t, srv: srv, prefix: prefix}
	for i := range n {
		clk := testclock.New(time.Now())
		c.engines = append(c.engines, engine.New(nodecheck.EngineConfig(clk.Now)))
		c.engines[i].SetProcesses(int64(n)) // as the region's heartbeats count them
		c.clocks = append(c.clocks, clk)
		c.origins = append(c.origins, nil)
		c.gens = append(c.gens, 0)
		c.Reload(i)
	}
	return c
}

func (c *redisCluster) Engine(i int) *engine.Engine { return c.engines[i] }
func (c *redisCluster) SetClock(i int, t time.Time) { c.clocks[i].Set(t) }
func (c *redisCluster) Restart()                    { c.srv.Restart() }
func (c *redisCluster) Settle()                     {}

// Flush empties Redis as an operator's FLUSHALL does (the run ID stays).
func (c *redisCluster) Flush() {
	if err := c.srv.Client().FlushAll(context.Background()).Err(); err != nil {
		c.t.Fatal(err)
	}
}

// Noticed reports the loss noticed, as the runner assumes: the origins'
// watch (origin.WatchRestarts) does not run here.
func (c *redisCluster) Noticed(int) bool { return true }

// Renew restarts node i's process: its engine closes (writing what it
// holds) and a new engine takes its place under a new node ID.
func (c *redisCluster) Renew(i int) {
	_ = c.engines[i].Close(context.Background())
	c.gens[i]++
	c.engines[i] = engine.New(nodecheck.EngineConfig(c.clocks[i].Now))
	c.engines[i].SetProcesses(int64(len(c.engines)))
	c.Reload(i)
}

// SetDown is not drawn for real Redis (Gen leaves outages out here).
func (c *redisCluster) SetDown(bool) { c.t.Error("no outage on real Redis in this test") }

// Detach takes node i's origin out, as a reload to a config without
// Redis does, and closes it.
func (c *redisCluster) Detach(i int) {
	c.engines[i].SetOrigin(nil)
	if old := c.origins[i]; old != nil {
		_ = old.Close()
	}
	c.origins[i] = nil
}

// Reload gives node i a new origin under its node ID, as a config reload
// does, and closes the one before.
func (c *redisCluster) Reload(i int) {
	o, err := origin.New(origin.Config{Redis: []string{c.srv.URL()}, Prefix: c.prefix},
		origin.Options{NodeID: fmt.Sprintf("node-%d.%d", i, c.gens[i])})
	if err != nil {
		c.t.Fatal(err)
	}
	c.engines[i].SetOrigin(o)
	if old := c.origins[i]; old != nil {
		_ = old.Close()
	}
	c.origins[i] = o
}

// ResetCells marks the cells through a client of its own, as the
// operator's node does: the node that resets may run without Redis.
func (c *redisCluster) ResetCells(key engine.Key, seq int64) error {
	o, err := origin.New(origin.Config{Redis: []string{c.srv.URL()}, Prefix: c.prefix}, origin.Options{NodeID: "operator"})
	if err != nil {
		return err
	}
	defer o.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return o.ResetCells(ctx, key, seq, 0)
}

func (c *redisCluster) close() {
	for i, e := range c.engines {
		_ = e.Close(context.Background())
		if o := c.origins[i]; o != nil {
			_ = o.Close()
		}
	}
}

// TestProperty_NodesOnRedis runs nodecheck's lists on a real Redis: the
// same invariant as TestProperty_NodesAgreeWithOneCounter, with Redis
// restarted empty (no outage: a stopped Redis costs every call its
// timeout). The engines' clocks run a few seconds ahead of the wall
// clock, which Redis expires keys by, so no key of the run expires early.
// It runs seeds 1 to 4; RATELIMIT_PROPERTY_REDIS_SEEDS=N runs 1 to N.
func TestProperty_NodesOnRedis(t *testing.T) {
	requireBinary(t, "redis-server")
	srv := redistest.Start(t)
	// The operations added in November 2026 (FLUSHALL, a node's process
	// restarted, a clock an hour back, h0 on a second window, costs of
	// 2^53−1) run with RATELIMIT_PROPERTY_REDIS_MORE=1, not by default.
	faults := nodecheck.Faults{Restart: true, Step: true, Detach: true, Reset: true,
		More: os.Getenv("RATELIMIT_PROPERTY_REDIS_MORE") == "1"}
	run := func(ops []nodecheck.Op, prefix string) nodecheck.Result {
		c := newRedisCluster(t, srv, nodecheck.Nodes(ops), prefix)
		defer c.close()
		return nodecheck.Run(c, ops, time.Now().Add(10*time.Second), nil)
	}
	decisions, runs := 0, 0
	seeds := uint64(4)
	if v := os.Getenv("RATELIMIT_PROPERTY_REDIS_SEEDS"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil || n == 0 {
			t.Fatalf("RATELIMIT_PROPERTY_REDIS_SEEDS=%q: want a number of seeds", v)
		}
		seeds = n
	}
	for seed := uint64(1); seed <= seeds; seed++ {
		ops := nodecheck.Gen(seed, 3000, faults)
		runs++
		res := run(ops, fmt.Sprintf("nc%d", runs))
		decisions += res.Decisions
		if res.Err == nil {
			continue
		}
		short, serr := nodecheck.Shrink(ops, func(o []nodecheck.Op) error {
			runs++
			return run(o, fmt.Sprintf("nc%d", runs)).Err
		})
		t.Fatalf("seed %d: %v\n%s", seed, res.Err, nodecheck.Describe(short, serr))
	}
	if decisions < 1000 {
		t.Fatalf("only %d decisions checked", decisions)
	}
	t.Logf("%d decisions checked on Redis against the central counter", decisions)
}
