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
	// lost tells, per node, that the origin lost its data and the node's
	// watch has not been asked about it yet (Noticed); restarts is what
	// its origin had counted before the loss.
	lost     []bool
	restarts []uint64
}

// watchEvery is how often each origin's watch checks the run IDs here (a
// slow tick in a deployment). Its marks are read once a second whatever
// the interval (origin.markEvery).
const watchEvery = 20 * time.Millisecond

// noticeWithin bounds the wait for a watch to notice a loss: the mark's
// second, and room for a loaded machine.
const noticeWithin = 5 * time.Second

func newRedisCluster(t *testing.T, srv *redistest.Server, n int, prefix string) *redisCluster {
	c := &redisCluster{t: t, srv: srv, prefix: prefix}
	for i := range n {
		clk := testclock.New(time.Now())
		c.engines = append(c.engines, engine.New(nodecheck.EngineConfig(clk.Now)))
		c.engines[i].SetProcesses(int64(n)) // as the region's heartbeats count them
		c.clocks = append(c.clocks, clk)
		c.origins = append(c.origins, nil)
		c.gens = append(c.gens, 0)
		c.lost = append(c.lost, false)
		c.restarts = append(c.restarts, 0)
		c.Reload(i)
	}
	return c
}

func (c *redisCluster) Engine(i int) *engine.Engine { return c.engines[i] }
func (c *redisCluster) SetClock(i int, t time.Time) { c.clocks[i].Set(t) }
func (c *redisCluster) Settle()                     {}

// Restart restarts Redis empty.
func (c *redisCluster) Restart() {
	c.losing()
	c.srv.Restart()
}

// Flush empties Redis as an operator's FLUSHALL does (the run ID stays).
func (c *redisCluster) Flush() {
	c.losing()
	if err := c.srv.Client().FlushAll(context.Background()).Err(); err != nil {
		c.t.Fatal(err)
	}
}

// losing notes, before a loss, what each node's origin has counted, unless
// an earlier loss has not been asked about yet: one check may see both.
func (c *redisCluster) losing() {
	for i, o := range c.origins {
		if o != nil && !c.lost[i] {
			c.lost[i], c.restarts[i] = true, o.Restarts()
		}
	}
}

// Noticed waits for node i's origin to count a restart since the loss:
// its watch (origin.WatchRestarts) runs, with the runner sending the
// cells again itself. The runner asks once the watch could have noticed
// on its own clock; here that takes up to the mark's second of real time.
func (c *redisCluster) Noticed(i int) bool {
	if !c.lost[i] {
		return true // its origin came after the loss
	}
	c.lost[i] = false
	o := c.origins[i]
	deadline := time.Now().Add(noticeWithin)
	for o.Restarts() <= c.restarts[i] {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
	return true
}

// Renew restarts node i's process: its engine closes (writing what it
// holds) and a new engine takes its place under a new node ID.
func (c *redisCluster) Renew(i int) {
	_ = c.engines[i].Close(context.Background())
	c.gens[i]++
	c.engines[i] = engine.New(nodecheck.EngineConfig(c.clocks[i].Now))
	c.engines[i].SetProcesses(int64(len(c.engines)))
	if old := c.origins[i]; old != nil {
		_ = old.Close()
	}
	c.origins[i] = nil // a new process: its watch starts afresh
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
	c.origins[i], c.lost[i] = nil, false
}

// Reload gives node i a new origin under its node ID, as a config reload
// does, and closes the one before.
func (c *redisCluster) Reload(i int) {
	o, err := origin.New(origin.Config{Redis: []string{c.srv.URL()}, Prefix: c.prefix},
		origin.Options{NodeID: fmt.Sprintf("node-%d.%d", i, c.gens[i])})
	if err != nil {
		c.t.Fatal(err)
	}
	old := c.origins[i]
	if old != nil {
		// The same Redis, as the root's redisBackend.use hands it on.
		o.TakeWatchFrom(old)
		if c.lost[i] && old.Restarts() > c.restarts[i] {
			c.lost[i] = false // the old origin noticed it
		}
		c.restarts[i] = 0
	} else {
		c.lost[i] = false
	}
	o.WatchRestarts(watchEvery, func() {})
	// Its first check, at once, is its reference: a loss before it is not
	// this origin's to notice.
	for o.RunIDChecks() == 0 {
		time.Sleep(time.Millisecond)
	}
	c.engines[i].SetOrigin(o)
	if old != nil {
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
// restarted empty and emptied by FLUSHALL (no outage: a stopped Redis
// costs every call its timeout), and every origin's own restart watch
// running: each loss must be noticed by it (Noticed), across the reloads
// that hand one origin's watch to the next. The engines' clocks run a few
// seconds ahead of the wall clock, which Redis expires keys by, so no key
// of the run expires early. It runs seeds 1 to 4;
// RATELIMIT_PROPERTY_REDIS_SEEDS=N runs 1 to N.
func TestProperty_NodesOnRedis(t *testing.T) {
	requireBinary(t, "redis-server")
	srv := redistest.Start(t)
	faults := nodecheck.Faults{Restart: true, Step: true, Detach: true, Reset: true, More: true}
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
