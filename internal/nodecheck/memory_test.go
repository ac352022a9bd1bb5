package nodecheck

import (
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
)

// TestMemoryCluster_NodesShareOneOrigin: what one node replayed, another
// reads; a restart empties the origin, an outage fails its calls, and each
// node keeps its own clock.
func TestMemoryCluster_NodesShareOneOrigin(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := NewMemoryCluster(2)
		defer c.Close()
		for i := range 2 {
			c.SetClock(i, memoryBase)
		}
		h0 := Keys[0] // limit 5
		if d := c.Engine(0).Decide(bg, limitOf(h0, 3)); !d.Allowed {
			t.Fatal("node 0 denied 3 of 5")
		}
		synctest.Wait()
		for _, tier := range []engine.Tier{engine.Fast, engine.Slow} {
			_, _ = c.Engine(0).ReplayOnce(bg, tier)
		}
		if d := c.Engine(1).Decide(bg, limitOf(h0, 3)); d.Allowed {
			t.Fatal("node 1 admitted 3 more of 5: it did not read node 0's units")
		}
		synctest.Wait()
		if c.store.Cells() == 0 {
			t.Fatal("the origin holds no cell")
		}
		c.Restart()
		if c.store.Cells() != 0 {
			t.Fatal("a restart left cells")
		}
		c.SetDown(true)
		if _, err := c.store.Info(); !errors.Is(err, simmodel.ErrDown) {
			t.Fatalf("a call while down: %v", err)
		}
		c.SetDown(false)
		c.SetClock(1, memoryBase.Add(time.Hour))
		if !c.Engine(0).Now().Equal(memoryBase) || !c.Engine(1).Now().Equal(memoryBase.Add(time.Hour)) {
			t.Fatalf("clocks %s and %s: want each node's own", c.Engine(0).Now(), c.Engine(1).Now())
		}
	})
}
