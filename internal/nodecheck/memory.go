package nodecheck

import (
	"context"
	"strconv"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// MemoryCluster is a Cluster whose origin is in memory: simmodel's model
// of Redis (the scripts' semantics: one record per process and cell
// incarnation, raised to an absolute total; the region's totals; a read
// registers the process), which fails every call while down and empties
// on Restart.
type MemoryCluster struct {
	store   *simmodel.Redis
	engines []*engine.Engine
	clocks  []*testclock.Clock
	ids     []string // each node's process ID
	gen     int      // processes renewed
}

// NewMemoryCluster returns n engines on one in-memory origin. Close them
// with Close.
func NewMemoryCluster(n int) *MemoryCluster {
	// The model's own clock only places outages and imports, which these
	// runs have none of: each engine keeps its own clock.
	c := &MemoryCluster{store: simmodel.NewRedis(func() int64 { return 0 }, 1, simmodel.Link{}, simmodel.DefaultTimeouts)}
	for i := range n {
		clk := testclock.New(time.Unix(0, 0))
		e := engine.New(EngineConfig(clk.Now))
		c.ids = append(c.ids, strconv.Itoa(i))
		e.SetOrigin(c.store.Origin(c.ids[i]))
		e.SetProcesses(int64(n)) // as the region's heartbeats count them
		c.engines = append(c.engines, e)
		c.clocks = append(c.clocks, clk)
	}
	return c
}

// EngineConfig is the configuration of a Cluster's engines.
func EngineConfig(now func() time.Time) engine.Config {
	return engine.Config{Now: now, Manual: true, MaxEntries: 24, ReadTimeout: 50 * time.Millisecond,
		FastTick: FastTick, SlowTick: SlowTick}
}

// Engine implements Cluster.
func (c *MemoryCluster) Engine(i int) *engine.Engine { return c.engines[i] }

// SetClock implements Cluster.
func (c *MemoryCluster) SetClock(i int, t time.Time) { c.clocks[i].Set(t) }

// Reload implements Cluster.
func (c *MemoryCluster) Reload(i int) {
	c.engines[i].SetTiming(engine.Timing{FastTick: FastTick, SlowTick: SlowTick})
	c.engines[i].SetOrigin(c.store.Origin(c.ids[i]))
}

// Detach implements Cluster.
func (c *MemoryCluster) Detach(i int) { c.engines[i].SetOrigin(nil) }

// Restart implements Cluster.
func (c *MemoryCluster) Restart() { c.store.Restart() }

// Flush implements Cluster: the model has no run ID, so a flush is a
// restart.
func (c *MemoryCluster) Flush() { c.store.Restart() }

// Noticed implements Cluster: the model's loss is noticed in time.
func (c *MemoryCluster) Noticed(int) bool { return true }

// Renew implements Cluster.
func (c *MemoryCluster) Renew(i int) {
	_ = c.engines[i].Close(context.Background())
	c.gen++
	e := engine.New(EngineConfig(c.clocks[i].Now))
	c.ids[i] = strconv.Itoa(i) + "." + strconv.Itoa(c.gen)
	e.SetOrigin(c.store.Origin(c.ids[i]))
	e.SetProcesses(int64(len(c.engines)))
	c.engines[i] = e
}

// ResetCells implements Cluster.
func (c *MemoryCluster) ResetCells(key engine.Key, seq int64) error {
	return c.store.ResetCells(key, seq)
}

// SetDown implements Cluster.
func (c *MemoryCluster) SetDown(down bool) { c.store.SetDown(down) }

// Settle implements Cluster; a test running the cluster in a synctest
// bubble waits there instead.
func (c *MemoryCluster) Settle() {}

// Close closes the engines.
func (c *MemoryCluster) Close() {
	for _, e := range c.engines {
		_ = e.Close(context.Background())
	}
}
