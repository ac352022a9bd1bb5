package redistest

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
)

// Cluster is a Redis Cluster of private servers, every node a master.
type Cluster struct {
	Nodes []*Server
}

// Addrs returns the nodes' host:port addresses.
func (c *Cluster) Addrs() []string {
	out := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		out[i] = n.Addr()
	}
	return out
}

// StartCluster starts n cluster-enabled servers with explicit cluster bus
// ports, joins them with `redis-cli --cluster create` (all masters, slots
// split evenly) and waits until every node reports cluster_state:ok.
func StartCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("redis-cli not found on PATH (required when CI=true): %v", err)
		}
		t.Skipf("redis-cli not found on PATH: %v", err)
	}
	c := &Cluster{}
	for i := 0; i < n; i++ {
		// The bus port must be free too: by default it is port + 10000,
		// which nothing reserves for us.
		bus, err := FreePort()
		if err != nil {
			t.Fatalf("redistest: %v", err)
		}
		c.Nodes = append(c.Nodes, Start(t, WithArgs(
			"--cluster-enabled", "yes",
			"--cluster-config-file", "nodes.conf",
			"--cluster-port", strconv.Itoa(bus),
			"--cluster-node-timeout", "5000",
		)))
	}
	args := append([]string{"--cluster", "create"}, c.Addrs()...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	ctx, cancel := context.WithTimeout(context.Background(), clusterTimeout)
	defer cancel()
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, cli, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Fatalf("redistest: redis-cli --cluster create: %v\n%s", err, out.String())
	}
	for _, node := range c.Nodes {
		cl := redis.NewClient(&redis.Options{Addr: node.Addr(), MaxRetries: -1})
		err := waitFor(ctx, func() error {
			info, err := cl.ClusterInfo(ctx).Result()
			if err != nil {
				return err
			}
			if !strings.Contains(info, "cluster_state:ok") {
				return errors.New("cluster_state is not ok yet")
			}
			return nil
		})
		cl.Close()
		if err != nil {
			t.Fatalf("redistest: cluster node %s: %v", node.Addr(), err)
		}
	}
	return c
}
