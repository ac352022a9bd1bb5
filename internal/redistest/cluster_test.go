package redistest

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"
)

// TestCluster_ServesEverySlot: a cluster of three private masters takes
// keys of any slot through a cluster client.
func TestCluster_ServesEverySlot(t *testing.T) {
	c := StartCluster(t, 3)
	if len(c.Addrs()) != 3 {
		t.Fatalf("addresses %v", c.Addrs())
	}
	cl := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	defer cl.Close()
	ctx := context.Background()
	for _, k := range []string{"a", "b", "c", "{x}1", "zz"} {
		if err := cl.Set(ctx, k, "v", 0).Err(); err != nil {
			t.Fatalf("set %s: %v", k, err)
		}
	}
}
