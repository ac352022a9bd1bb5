package origin

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

func TestWatchRestarts_SeesARestartedServer(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "w"})
	var seen atomic.Int64
	o.WatchRestarts(20*time.Millisecond, func() { seen.Add(1) })
	// Let it record the first run ID, then restart the server (empty).
	redistest.Eventually(t, 5*time.Second, "the watch checked once", func() bool { return o.runIDChecks.Load() > 0 })
	srv.Restart()
	redistest.Eventually(t, 5*time.Second, "restart noticed", func() bool { return seen.Load() == 1 })
	if got := o.Stats().Restarts; got != 1 {
		t.Fatalf("Stats().Restarts = %d, want 1", got)
	}
}

// TestWatchRestarts_AProcessThatJustStartedSeesARestart: the watch took
// its reference at its first tick, a slow tick after the process began. A
// node that wrote its units and saw Redis restart before that took the
// emptied server for its reference: its 20 units never went back, and
// a node reading the key admitted them again. The first check now comes
// as the watch starts.
func TestWatchRestarts_AProcessThatJustStartedSeesARestart(t *testing.T) {
	srv := redistest.Start(t)
	clk := testclock.New(time.UnixMilli(windowStart(time.Minute) + 1000))
	a := newNode(t, srv.URL(), clk)
	// A tick far longer than the test takes to the restart.
	a.o.WatchRestarts(time.Minute, func() { a.e.Resend() })
	k := engine.Key{Namespace: "api", Identifier: "young", Window: time.Minute}
	for range 20 {
		if !a.e.Decide(context.Background(), engine.Limit{Key: k, Limit: 60, Cost: 1}).Allowed {
			t.Fatal("denied below the limit")
		}
	}
	if err := a.e.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	redistest.Eventually(t, 5*time.Second, "the watch's first check", func() bool { return a.o.RunIDChecks() > 0 })
	srv.Restart()
	if a.o.Restarts() != 0 {
		t.Fatal("the restart was seen before it happened")
	}
	// The second check is a minute away: take it now, as the tick would.
	a.o.watch.check(func() { a.e.Resend() })
	if err := a.e.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	if v, _ := cellTotal(context.Background(), srv.Client(), DefaultPrefix, k, seq); v != 20 {
		t.Fatalf("Redis holds %d after the restart, want the node's 20 back", v)
	}
}

// TestWatchRestarts_TakenOverSeesWhatHappenedBetween: an origin that
// replaces another of the same placement (a reload) starts from the run
// IDs and marks the other saw, so a restart between the other's last check
// and its first is seen; the other, retired, neither reads nor tells. A
// reload that fails hands the watch back the same way, and a FLUSHALL
// then is seen by the origin taken back.
func TestWatchRestarts_TakenOverSeesWhatHappenedBetween(t *testing.T) {
	srv := redistest.Start(t)
	cfg := Config{Redis: []string{srv.URL()}}
	o1, o2 := newOrigin(t, cfg, Options{NodeID: "w"}), newOrigin(t, cfg, Options{NodeID: "w"})
	var told1, told2 int
	check := func(o *Redis, told *int) { o.watch.check(func() { *told++ }) }
	check(o1, &told1) // o1's reference
	srv.Restart()
	o2.TakeWatchFrom(o1)
	check(o2, &told2)
	if told2 != 1 {
		t.Fatalf("the origin that took over was told of %d restarts, want the 1 since the other's last check", told2)
	}
	before := o1.RunIDChecks()
	check(o1, &told1)
	if told1 != 0 || o1.RunIDChecks() != before {
		t.Fatalf("the retired origin checked (%d checks, was %d) and told %d restarts, want neither", o1.RunIDChecks(), before, told1)
	}
	o1.TakeWatchFrom(o2) // the reload failed: o1 is the one in use again
	if err := srv.Client().FlushAll(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	check(o2, &told2)
	check(o1, &told1)
	if told1 != 1 || told2 != 1 {
		t.Fatalf("after the watch went back and a FLUSHALL: told %d (want 1) and the retired one %d (want still 1)", told1, told2)
	}
	if o1.Stats().Restarts != 1 || o2.Stats().Restarts != 1 {
		t.Fatalf("restarts counted: %d and %d, want one each", o1.Stats().Restarts, o2.Stats().Restarts)
	}
}

// TestWatchRestarts_ARestartCountsOnce: the mark is read once a second,
// and the check that saw a restart's new run ID did not read it when it
// was not due: the next read found the mark gone with the restart and
// counted the same restart again, and every node sent its cells twice.
// A new run ID now has its mark read at the same check.
func TestWatchRestarts_ARestartCountsOnce(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "w"})
	var seen atomic.Int64
	o.WatchRestarts(20*time.Millisecond, func() { seen.Add(1) })
	redistest.Eventually(t, 5*time.Second, "the watch read the mark", func() bool { return markReadAfter(o, time.Time{}) })
	srv.Restart()
	restarted := time.Now()
	redistest.Eventually(t, 5*time.Second, "restart noticed", func() bool { return seen.Load() >= 1 })
	redistest.Eventually(t, 5*time.Second, "the mark read since the restart", func() bool { return markReadAfter(o, restarted) })
	checks := o.RunIDChecks()
	redistest.Eventually(t, 5*time.Second, "one more check", func() bool { return o.RunIDChecks() > checks })
	if n := seen.Load(); n != 1 || o.Stats().Restarts != 1 {
		t.Fatalf("one restart told %d times and counted %d", n, o.Stats().Restarts)
	}
}

// markReadAfter reports whether the watch of o read a server's mark
// after t.
func markReadAfter(o *Redis, t time.Time) bool {
	w := o.watch
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, at := range w.markedAt {
		if at.After(t) {
			return true
		}
	}
	return false
}

// TestWatchRestarts_NamesAServerThatMayEvict: a Redis with a memory limit
// and an eviction policy may evict the limiter's counts, which no node
// sees as a restart: the watch names it once per server it reads (and
// again after a restart, and in the origin of each reload), and says
// nothing of one that may not evict. A reload's origin took the old
// one's servers for seen (TakeWatchFrom) and said nothing, though the
// README promised it would.
func TestWatchRestarts_NamesAServerThatMayEvict(t *testing.T) {
	evicting, safe := redistest.Start(t), redistest.Start(t)
	for _, set := range []struct {
		srv    *redistest.Server
		policy string
	}{{evicting, "allkeys-lru"}, {safe, "noeviction"}} {
		c := set.srv.Client()
		if err := c.ConfigSet(context.Background(), "maxmemory", "100mb").Err(); err != nil {
			t.Fatal(err)
		}
		if err := c.ConfigSet(context.Background(), "maxmemory-policy", set.policy).Err(); err != nil {
			t.Fatal(err)
		}
	}
	type warning struct {
		addr, policy string
		max          int64
	}
	warned := make(chan warning, 4)
	o := newOrigin(t, Config{Redis: []string{evicting.URL(), safe.URL()}}, Options{NodeID: "w",
		OnEvicting: func(addr, policy string, max int64) { warned <- warning{addr, policy, max} }})
	o.WatchRestarts(20*time.Millisecond, func() {})
	redistest.Eventually(t, 5*time.Second, "the watch checked three times", func() bool { return o.runIDChecks.Load() >= 3 })
	if len(warned) != 1 {
		t.Fatalf("%d warnings after three checks, want one (the evicting server's, once)", len(warned))
	}
	w := <-warned
	if w.policy != "allkeys-lru" || w.max != 100<<20 || !strings.Contains(w.addr, evicting.Addr()) {
		t.Fatalf("warning %+v, want the evicting server %s with allkeys-lru and 100 MiB", w, evicting.Addr())
	}
	// A reload: the next config's origin of the same servers takes the
	// watch, and says it again, once.
	next := newOrigin(t, Config{Redis: []string{evicting.URL(), safe.URL()}}, Options{NodeID: "w",
		OnEvicting: func(addr, policy string, max int64) { warned <- warning{addr, policy, max} }})
	next.TakeWatchFrom(o)
	next.WatchRestarts(20*time.Millisecond, func() {})
	redistest.Eventually(t, 5*time.Second, "the reload's watch checked three times", func() bool { return next.runIDChecks.Load() >= 3 })
	if len(warned) != 1 {
		t.Fatalf("%d warnings after the reload's three checks, want one", len(warned))
	}
	if w := <-warned; !strings.Contains(w.addr, evicting.Addr()) {
		t.Fatalf("the reload's warning %+v, want the evicting server %s", w, evicting.Addr())
	}
}

// TestRestart_IdleKeysGetTheirTotalsBack is the review's case: Redis
// restarted empty in the middle of a window, and a key that no node
// touches afterwards kept none of its units, so whichever node next saw
// it admitted them again. With the watch, each node sends its live cells'
// totals again within a check interval and a flush tick.
func TestRestart_IdleKeysGetTheirTotalsBack(t *testing.T) {
	srv := redistest.Start(t)
	clk := testclock.New(time.UnixMilli(windowStart(time.Minute) + 1000))
	a, b := newNode(t, srv.URL(), clk), newNode(t, srv.URL(), clk)
	for _, n := range []*node{a, b} {
		n.o.WatchRestarts(20*time.Millisecond, func() { n.e.Resend() })
	}
	k := engine.Key{Namespace: "api", Identifier: "idle", Window: time.Minute}
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	for i, n := range []*node{a, a, a, b, b} {
		for range 10 {
			if !n.e.Decide(context.Background(), engine.Limit{Key: k, Limit: 60, Cost: 1}).Allowed {
				t.Fatalf("request of round %d denied below the limit", i)
			}
		}
	}
	for _, n := range []*node{a, b} {
		if err := n.e.Flush(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	total := func() int64 {
		v, _ := cellTotal(context.Background(), srv.Client(), DefaultPrefix, k, seq)
		return v
	}
	// Flush leaves a cell whose write the engine's own replay has in
	// flight to that write (under load, CI once read 31 here): the units
	// are all at Redis once it lands.
	redistest.Eventually(t, 5*time.Second, "Redis holds the 50 units before the restart", func() bool {
		return total() == 50
	})
	// Both watches have their reference before the restart.
	redistest.Eventually(t, 5*time.Second, "watches ready", func() bool {
		return a.o.runIDChecks.Load() > 0 && b.o.runIDChecks.Load() > 0
	})
	srv.Restart()
	redistest.Eventually(t, 5*time.Second, "totals sent again", func() bool { return total() == 50 })
	if a.e.Stats().Resends == 0 || b.e.Stats().Resends == 0 {
		t.Fatalf("resends: a %d, b %d", a.e.Stats().Resends, b.e.Stats().Resends)
	}
	// A third node sees the key's whole count: 10 left of 60.
	c := newNode(t, srv.URL(), clk)
	admitted := 0
	for range 30 {
		if c.e.Decide(context.Background(), engine.Limit{Key: k, Limit: 60, Cost: 1}).Allowed {
			admitted++
		}
	}
	if admitted != 10 {
		t.Fatalf("a new node admitted %d after the restart, want the 10 left", admitted)
	}
}

// TestWatchRestarts_ClusterFailoverToAReplicaThatMissedWrites: a Cluster
// master dies and its replica, which missed its last writes (replication
// is asynchronous), takes its slots at another address. The watch read
// run IDs by address, and the replica's address had never been a master's,
// so nothing was seen: a key no request touched kept 10 of its 60 units
// for the rest of its window, and a new node admitted 90 more of a limit
// of 100 where 40 were left. The promoted replica now counts as a
// restart: the node sends its totals again and the new node admits 40.
func TestWatchRestarts_ClusterFailoverToAReplicaThatMissedWrites(t *testing.T) {
	cl := redistest.StartCluster(t, 3)
	master := cl.Nodes[0]
	replica := cl.AddReplica(t, master)
	ctx := context.Background()
	clk := testclock.New(time.UnixMilli(windowStart(time.Minute) + 1000))
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	// A key whose slot the master that fails serves.
	var k engine.Key
	for i := 0; ; i++ {
		k = engine.Key{Namespace: "api", Identifier: "idle-" + strconv.Itoa(i), Window: time.Minute}
		slot, err := master.Client().ClusterKeySlot(ctx, cellKey(DefaultPrefix, k, seq)).Result()
		if err != nil {
			t.Fatal(err)
		}
		if servedBy(t, master, slot) {
			break
		}
	}
	newNode, admit := failoverNodes(t, Config{Cluster: &ClusterConfig{Addrs: cl.Addrs()}}, clk, engine.Limit{Key: k, Limit: 100, Cost: 1})
	restarts := missWrites(t, master, replica, newNode, admit, k, seq)
	if err := replica.Client().Do(ctx, "CLUSTER", "FAILOVER", "TAKEOVER").Err(); err != nil {
		t.Fatal(err)
	}
	redistest.Eventually(t, 10*time.Second, "every master knows the replica took the slots", func() bool {
		return servedBy(t, cl.Nodes[1], -1, replica) && servedBy(t, cl.Nodes[2], -1, replica)
	})
	promotedHoldsAll(t, replica, restarts, newNode, admit, k, seq, 5*time.Second)
}

// servedBy reports whether node's slot map gives slot to node itself, or
// with slot -1, whether it gives slot 0 to owner[0].
func servedBy(t *testing.T, node *redistest.Server, slot int64, owner ...*redistest.Server) bool {
	t.Helper()
	want := node.Addr()
	if slot < 0 {
		slot, want = 0, owner[0].Addr()
	}
	slots, err := node.Client().ClusterSlots(context.Background()).Result()
	if err != nil {
		return false
	}
	for _, s := range slots {
		if int64(s.Start) <= slot && slot <= int64(s.End) && len(s.Nodes) > 0 {
			return s.Nodes[0].Addr == want
		}
	}
	return false
}

// TestWatchRestarts_SentinelFailoverToAReplicaThatMissedWrites: as the
// Cluster case above, through Sentinel. The replica stopped taking the
// master's stream after 10 of a key's 60 units, and the master died;
// Sentinel promoted the replica. The watch sees another server answer
// behind the same Sentinel endpoint (its run ID differs), and the node
// sends its totals again: the promoted replica holds 60, and a new node
// admits the 40 left of 100.
func TestWatchRestarts_SentinelFailoverToAReplicaThatMissedWrites(t *testing.T) {
	master, replica := redistest.Start(t), redistest.Start(t)
	ctx := context.Background()
	if err := replica.Client().Do(ctx, "REPLICAOF", "127.0.0.1", master.Port()).Err(); err != nil {
		t.Fatal(err)
	}
	redistest.Eventually(t, 10*time.Second, "the replica in sync", func() bool {
		info, err := replica.Client().Info(ctx, "replication").Result()
		return err == nil && strings.Contains(info, "master_link_status:up")
	})
	sentinel := redistest.StartFastSentinel(t, master, time.Second)
	redistest.Eventually(t, 15*time.Second, "Sentinel knows the replica", func() bool {
		rs, err := sentinel.Client().Do(ctx, "SENTINEL", "REPLICAS", redistest.SentinelMaster).Slice()
		return err == nil && len(rs) == 1
	})
	clk := testclock.New(time.UnixMilli(windowStart(time.Minute) + 1000))
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	k := engine.Key{Namespace: "api", Identifier: "idle", Window: time.Minute}
	cfg := Config{Sentinel: &SentinelConfig{Master: redistest.SentinelMaster, Addrs: []string{"redis://" + sentinel.Addr()}}}
	newNode, admit := failoverNodes(t, cfg, clk, engine.Limit{Key: k, Limit: 100, Cost: 1})
	restarts := missWrites(t, master, replica, newNode, admit, k, seq)
	redistest.Eventually(t, 30*time.Second, "Sentinel promoted the replica", func() bool {
		addr, err := sentinel.Client().Do(ctx, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", redistest.SentinelMaster).StringSlice()
		return err == nil && len(addr) == 2 && addr[1] == strconv.Itoa(replica.Port())
	})
	promotedHoldsAll(t, replica, restarts, newNode, admit, k, seq, 15*time.Second)
}

// failoverNodes returns, for the failover tests, a maker of nodes (an
// origin on cfg and an engine on clk) and a function that decides lim
// count times on a node, flushes it and returns how many it admitted.
func failoverNodes(t *testing.T, cfg Config, clk *testclock.Clock, lim engine.Limit) (newNode func() *node, admit func(n *node, count int) int) {
	newNode = func() *node {
		n := &node{o: newOrigin(t, cfg, Options{NodeID: t.Name() + strconv.FormatInt(nodesMade.Add(1), 10)})}
		// A new node's first read finds the master through Sentinel or
		// the Cluster's slots, connects and loads the script: on a loaded
		// host that took more than the default 50 ms, and the key was
		// decided here alone, all 100 admitted. What these tests judge is
		// what the promoted replica holds, not how fast it answers.
		n.e = engine.New(engine.Config{Now: clk.Now, ReadTimeout: 5 * time.Second})
		n.e.SetOrigin(n.o)
		closeAtCleanup(t, n.e, 5*time.Second)
		return n
	}
	admit = func(n *node, count int) int {
		t.Helper()
		admitted := 0
		for range count {
			if n.e.Decide(context.Background(), lim).Allowed {
				admitted++
			}
		}
		if err := n.e.Flush(context.Background()); err != nil {
			t.Fatal(err)
		}
		return admitted
	}
	return newNode, admit
}

// missWrites is the failover tests' fault: a node that watches for
// restarts (resending its totals on one) admits 10 of k's units, which
// reach the replica; the replica stops taking the master's stream, the
// node admits 50 more, which only the master holds, and the master dies.
// It returns the restarts the node has seen.
func missWrites(t *testing.T, master, replica *redistest.Server, newNode func() *node, admit func(*node, int) int, k engine.Key, seq int64) *atomic.Int64 {
	t.Helper()
	ctx := context.Background()
	a := newNode()
	restarts := new(atomic.Int64)
	a.o.WatchRestarts(20*time.Millisecond, func() { restarts.Add(1); a.e.Resend() })
	admit(a, 10)
	if err := master.Client().Do(ctx, "WAIT", 1, 5000).Err(); err != nil {
		t.Fatal(err)
	}
	// The replica stops taking the stream; what the master writes now,
	// only the master holds.
	replica.Pause()
	if err := master.Client().Do(ctx, "CLIENT", "KILL", "TYPE", "replica").Err(); err != nil {
		t.Fatal(err)
	}
	admit(a, 50)
	if got, err := cellTotal(ctx, master.Client(), DefaultPrefix, k, seq); err != nil || got != 60 {
		t.Fatalf("the master holds %d (%v), want 60", got, err)
	}
	redistest.Eventually(t, 5*time.Second, "the watch read the master", func() bool { return a.o.RunIDChecks() > 1 })
	master.Stop()
	replica.Resume()
	return restarts
}

// promotedHoldsAll waits (up to wait) until the promoted replica holds the
// 60 units missWrites admitted, and checks that a new node then admits
// the 40 left of 100.
func promotedHoldsAll(t *testing.T, replica *redistest.Server, restarts *atomic.Int64, newNode func() *node, admit func(*node, int) int, k engine.Key, seq int64, wait time.Duration) {
	t.Helper()
	total := func() int64 {
		v, _ := cellTotal(context.Background(), replica.Client(), DefaultPrefix, k, seq)
		return v
	}
	redistest.EventuallyShow(t, wait, "the node sends its totals to the promoted replica", func() (bool, string) {
		return total() == 60, fmt.Sprintf("the replica holds %d, restarts seen %d", total(), restarts.Load())
	})
	if got := admit(newNode(), 100); got != 40 {
		t.Fatalf("a new node admitted %d after the failover, want the 40 left of 100", got)
	}
}

// TestRestart_FlushAllMidWindowGivesIdleKeysTheirTotalsBack: an operator's
// FLUSHALL (or FLUSHDB) empties Redis as a restart does, but the run ID
// stays: a key no node touches afterwards kept none of its units, and a
// new node admitted them again. The watch sees the flush by its mark,
// a key it keeps in each server, and the nodes send their totals again.
func TestRestart_FlushAllMidWindowGivesIdleKeysTheirTotalsBack(t *testing.T) {
	srv := redistest.Start(t)
	clk := testclock.New(time.UnixMilli(windowStart(time.Minute) + 1000))
	a, b := newNode(t, srv.URL(), clk), newNode(t, srv.URL(), clk)
	for _, n := range []*node{a, b} {
		n.o.WatchRestarts(20*time.Millisecond, func() { n.e.Resend() })
	}
	k := engine.Key{Namespace: "api", Identifier: "idle", Window: time.Minute}
	lim := engine.Limit{Key: k, Limit: 60, Cost: 1}
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	for _, n := range []*node{a, a, a, b, b} {
		for range 10 {
			if !n.e.Decide(context.Background(), lim).Allowed {
				t.Fatal("a request denied below the limit")
			}
		}
	}
	for _, n := range []*node{a, b} {
		if err := n.e.Flush(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	total := func() int64 {
		v, _ := cellTotal(context.Background(), srv.Client(), DefaultPrefix, k, seq)
		return v
	}
	redistest.Eventually(t, 5*time.Second, "watches ready", func() bool {
		return a.o.runIDChecks.Load() > 0 && b.o.runIDChecks.Load() > 0
	})
	for _, flush := range []string{"FLUSHALL", "FLUSHDB"} {
		if err := srv.Client().Do(context.Background(), flush).Err(); err != nil {
			t.Fatal(err)
		}
		redistest.EventuallyShow(t, 5*time.Second, "totals sent again after "+flush, func() (bool, string) {
			return total() == 50, fmt.Sprintf("Redis holds %d of 50; restarts seen: a %d, b %d", total(), a.o.Restarts(), b.o.Restarts())
		})
	}
	c := newNode(t, srv.URL(), clk)
	admitted := 0
	for range 30 {
		if c.e.Decide(context.Background(), lim).Allowed {
			admitted++
		}
	}
	if admitted != 10 {
		t.Fatalf("a new node admitted %d after the flushes, want the 10 left", admitted)
	}
}

// TestRestart_FlushAllOfAClusterGivesIdleKeysTheirTotalsBack: as
// FlushAllMidWindow above, in a Cluster, where one mark cannot stand for
// every master (a key lies in one slot, on one master): the watch keeps
// a mark on each master, in a slot it serves.
func TestRestart_FlushAllOfAClusterGivesIdleKeysTheirTotalsBack(t *testing.T) {
	cl := redistest.StartCluster(t, 3)
	ctx := context.Background()
	clk := testclock.New(time.UnixMilli(windowStart(time.Minute) + 1000))
	seq := clk.UnixMilli() / time.Minute.Milliseconds()
	lim := func(i int) engine.Limit {
		return engine.Limit{Key: engine.Key{Namespace: "api", Identifier: "idle-" + strconv.Itoa(i), Window: time.Minute}, Limit: 60, Cost: 1}
	}
	cfg := Config{Cluster: &ClusterConfig{Addrs: cl.Addrs()}}
	newNode, _ := failoverNodes(t, cfg, clk, lim(0))
	a := newNode()
	a.o.WatchRestarts(20*time.Millisecond, func() { a.e.Resend() })
	// Keys on every master.
	const keys = 12
	for i := range keys {
		for range 50 {
			if !a.e.Decide(ctx, lim(i)).Allowed {
				t.Fatal("a request denied below the limit")
			}
		}
	}
	if err := a.e.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	held := func() (n int) {
		for i := range keys {
			for _, node := range cl.Nodes {
				if v, err := cellTotal(ctx, node.Client(), DefaultPrefix, lim(i).Key, seq); err == nil && v == 50 {
					n++
				}
			}
		}
		return n
	}
	if got := held(); got != keys {
		t.Fatalf("%d of %d keys hold 50 before the flush", got, keys)
	}
	redistest.Eventually(t, 5*time.Second, "the watch read the masters", func() bool { return a.o.RunIDChecks() > 1 })
	for _, node := range cl.Nodes {
		if err := node.Client().FlushAll(ctx).Err(); err != nil {
			t.Fatal(err)
		}
	}
	redistest.EventuallyShow(t, 5*time.Second, "totals sent again after FLUSHALL", func() (bool, string) {
		return held() == keys, fmt.Sprintf("%d of %d keys hold their 50; restarts seen %d", held(), keys, a.o.Restarts())
	})
	c := newNode()
	admitted := 0
	for range 30 {
		if c.e.Decide(ctx, lim(0)).Allowed {
			admitted++
		}
	}
	if admitted != 10 {
		t.Fatalf("a new node admitted %d after the flush, want the 10 left", admitted)
	}
}
