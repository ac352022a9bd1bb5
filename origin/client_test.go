package origin

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// TestTLS_RedissVerifiesTheServer reaches a TLS-only Redis over rediss://,
// trusting its certificate through tls_ca_file, and fails without it.
func TestTLS_RedissVerifiesTheServer(t *testing.T) {
	srv := redistest.Start(t, redistest.WithTLS(), redistest.WithPassword("tls-pw"))
	o := newOrigin(t, Config{Redis: []string{srv.URL()}, TLSCAFile: srv.CAFile()}, Options{})
	k, seq := key("tls"), nowSeq()
	b := []engine.Delta{{Key: k, Sequence: seq, Delta: 2, Own: 2}}
	if err := o.Flush(ctxT(t), b); err != nil || !b[0].Done {
		t.Fatalf("Flush over TLS: %v", err)
	}
	if cur, _, err := readPair(o, ctxT(t), k, seq); err != nil || cur != 2 {
		t.Fatalf("Read over TLS: %d, %v", cur, err)
	}
	if a := o.Stats().Endpoints[0].Address; !strings.HasPrefix(a, "rediss://") || strings.Contains(a, "tls-pw") {
		t.Fatalf("address %q", a)
	}

	untrusted := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{})
	if _, _, err := readPair(untrusted, ctxT(t), k, seq); err == nil {
		t.Fatal("a self-signed server was trusted without tls_ca_file")
	}
	if _, err := New(Config{Redis: []string{srv.URL()}, TLSCAFile: "/nonexistent.pem"}, Options{}); err == nil {
		t.Fatal("a missing tls_ca_file was accepted")
	}
}

// TestSentinel_FindsTheMaster reads and flushes through a Sentinel that
// monitors a password-protected master.
func TestSentinel_FindsTheMaster(t *testing.T) {
	master := redistest.Start(t, redistest.WithPassword("master-pw"))
	sentinel := redistest.StartSentinel(t, master)
	o := newOrigin(t, Config{Sentinel: &SentinelConfig{
		Master: redistest.SentinelMaster,
		Addrs:  []string{"redis://:master-pw@" + sentinel.Addr()},
	}}, Options{})
	k, seq := key("sentinel"), nowSeq()
	b := []engine.Delta{{Key: k, Sequence: seq, Delta: 3, Own: 3}}
	if err := o.Flush(ctxT(t), b); err != nil || !b[0].Done || b[0].Totals.Cur != 3 {
		t.Fatalf("Flush through Sentinel: %v (%+v)", err, b[0])
	}
	if cur, _, err := readPair(o, ctxT(t), k, seq); err != nil || cur != 3 {
		t.Fatalf("Read through Sentinel: %d, %v", cur, err)
	}
	if got, err := cellTotal(ctxT(t), master.Client(), DefaultPrefix, k, seq); err != nil || got != 3 {
		t.Fatalf("the master holds %d (%v), want 3", got, err)
	}
	st := o.Stats().Endpoints[0]
	if st.Kind != KindSentinel || strings.Contains(st.Address, "master-pw") || !strings.Contains(st.Address, sentinel.Addr()) {
		t.Fatalf("stats: %+v", st)
	}
}

// TestCluster_ThreeNodes runs against a three-master Redis Cluster: both
// cells of a key share a slot, keys spread over the nodes, and reads and
// flushes work through the cluster client.
func TestCluster_ThreeNodes(t *testing.T) {
	cl := redistest.StartCluster(t, 3)
	o := newOrigin(t, Config{Cluster: &ClusterConfig{Addrs: cl.Addrs()}}, Options{})
	seq := nowSeq()
	admin := redis.NewClient(&redis.Options{Addr: cl.Nodes[0].Addr()})
	defer admin.Close()

	nodes := make(map[string]bool)
	for i := 0; i < 60; i++ {
		k := key(fmt.Sprintf("c:%d{}", i)) // hostile on purpose
		b := []engine.Delta{
			{Key: k, Sequence: seq - 1, Delta: 2, Own: 2},
			{Key: k, Sequence: seq, Delta: int64(i + 1), Own: int64(i + 1)},
		}
		if err := o.Flush(ctxT(t), b); err != nil || !b[0].Done || !b[1].Done {
			t.Fatalf("Flush %d through the cluster: %v (%+v)", i, err, b)
		}
		cur, prev, err := readPair(o, ctxT(t), k, seq)
		if err != nil || cur != int64(i+1) || prev != 2 {
			t.Fatalf("Read %d through the cluster: %d, %d, %v", i, cur, prev, err)
		}
		s1, err1 := admin.ClusterKeySlot(ctxT(t), cellKey(DefaultPrefix, k, seq)).Result()
		s2, err2 := admin.ClusterKeySlot(ctxT(t), cellKey(DefaultPrefix, k, seq-1)).Result()
		if err1 != nil || err2 != nil || s1 != s2 {
			t.Fatalf("cells of %q in slots %d and %d (%v, %v)", k.Identifier, s1, s2, err1, err2)
		}
		nodes[nodeOfSlot(t, admin, s1)] = true
	}
	if len(nodes) < 2 {
		t.Fatalf("60 keys all on node(s) %v: the test does not exercise routing", nodes)
	}
	if st := o.Stats().Endpoints[0]; st.Kind != KindCluster || st.Breaker != BreakerClosed {
		t.Fatalf("stats: %+v", st)
	}
}

// nodeOfSlot returns the address of the Cluster node that serves slot.
func nodeOfSlot(t *testing.T, c *redis.Client, slot int64) string {
	t.Helper()
	slots, err := c.ClusterSlots(ctxT(t)).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range slots {
		if int64(s.Start) <= slot && slot <= int64(s.End) {
			return s.Nodes[0].Addr
		}
	}
	t.Fatalf("slot %d is not served", slot)
	return ""
}

// replyLost runs call while the Cluster node that serves key is stopped,
// and starts the node again once the call gave up on its connection: it
// ended, or took another to send the command again (what go-redis's
// Cluster client does, whatever MaxRetries says). The stopped node then
// runs what the call sent on the connection it gave up, whose reply
// nobody reads. replyLost returns when the call has ended and the node
// answers again.
func replyLost(t *testing.T, cl *redistest.Cluster, o *Redis, key string, call func(context.Context)) {
	t.Helper()
	admin := redis.NewClient(&redis.Options{Addr: cl.Nodes[0].Addr()})
	defer admin.Close()
	slot, err := admin.ClusterKeySlot(ctxT(t), key).Result()
	if err != nil {
		t.Fatal(err)
	}
	addr := nodeOfSlot(t, admin, slot)
	var srv *redistest.Server
	for _, n := range cl.Nodes {
		if n.Addr() == addr {
			srv = n
		}
	}
	cc := o.endpoints[0].client.(*redis.ClusterClient)
	node, err := cc.MasterForKey(ctxT(t), key)
	if err != nil || srv == nil {
		t.Fatalf("the node of %q's slot (%s): %v", key, addr, err)
	}
	gets := func() uint32 { s := node.PoolStats(); return s.Hits + s.Misses }
	before := gets()

	srv.Pause()
	ctx, cancel := context.WithTimeout(context.Background(), 3*maxCallTimeout)
	defer cancel()
	done := make(chan struct{})
	go func() { defer close(done); call(ctx) }()
	redistest.Eventually(t, 5*time.Second, "the call timed out on its connection", func() bool {
		select {
		case <-done:
			return true
		default:
			return gets() >= before+2
		}
	})
	srv.Resume()
	<-done
	redistest.Eventually(t, 5*time.Second, "the node answers again", func() bool {
		return cc.Ping(ctxT(t)).Err() == nil
	})
}
