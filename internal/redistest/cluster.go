package redistest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
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
	// Replicas are the servers AddReplica joined.
	Replicas []*Server
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

// AddReplica starts a cluster-enabled server, joins it to the cluster as a
// replica of master and waits until it has synced with it.
func (c *Cluster) AddReplica(t testing.TB, master *Server) *Server {
	t.Helper()
	bus, err := FreePort()
	if err != nil {
		t.Fatalf("redistest: %v", err)
	}
	r := Start(t, WithArgs(
		"--cluster-enabled", "yes",
		"--cluster-config-file", "nodes.conf",
		"--cluster-port", strconv.Itoa(bus),
		"--cluster-node-timeout", "5000",
	))
	// The master sends its first sync at once rather than 5 s later.
	if err := master.newClient().ConfigSet(context.Background(), "repl-diskless-sync-delay", "0").Err(); err != nil {
		t.Fatalf("redistest: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), clusterTimeout)
	defer cancel()
	mc, rc := master.newClient(), r.newClient()
	defer mc.Close()
	defer rc.Close()
	id, err := mc.ClusterMyID(ctx).Result()
	if err != nil {
		t.Fatalf("redistest: CLUSTER MYID: %v", err)
	}
	// The master meets the replica: MEET names the bus port, which only
	// the new node's is known here.
	if err := mc.Do(ctx, "CLUSTER", "MEET", "127.0.0.1", r.port, bus).Err(); err != nil {
		t.Fatalf("redistest: CLUSTER MEET: %v", err)
	}
	// REPLICATE fails until the replica has heard of the master; called
	// again once it took, it would start the sync over.
	err = waitFor(ctx, func() error { return rc.Do(ctx, "CLUSTER", "REPLICATE", id).Err() })
	if err != nil {
		t.Fatalf("redistest: CLUSTER REPLICATE: %v", err)
	}
	err = waitFor(ctx, func() error {
		info, err := rc.Info(ctx, "replication").Result()
		if err != nil {
			return err
		}
		if !strings.Contains(info, "master_link_status:up") {
			return errors.New("replica not synced yet")
		}
		// Every node must know it, and it every node, before a failover
		// can take: a replica that has not heard of a master yet sees the
		// cluster down.
		known := "cluster_known_nodes:" + strconv.Itoa(len(c.Nodes)+len(c.Replicas)+1)
		for _, n := range append(append([]*Server{r}, c.Nodes...), c.Replicas...) {
			if n.cmd == nil {
				continue
			}
			nc := n.newClient()
			ci, err := nc.ClusterInfo(ctx).Result()
			nc.Close()
			if err != nil {
				return err
			}
			if !strings.Contains(ci, known) || !strings.Contains(ci, "cluster_state:ok") {
				return fmt.Errorf("node %s does not know every node yet", n.Addr())
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("redistest: replica of %s: %v", master.Addr(), err)
	}
	c.Replicas = append(c.Replicas, r)
	return r
}
