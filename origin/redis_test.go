package origin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// newOrigin builds an origin from cfg and closes it when the test ends.
func newOrigin(t testing.TB, cfg Config, opts Options) *Redis {
	t.Helper()
	o, err := New(cfg, opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = o.Close() })
	return o
}

// ctxT is a context for one origin call: generous, since the machine is
// shared, but bounded.
func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func key(id string) engine.Key {
	return engine.Key{Namespace: "api", Identifier: id, Window: time.Minute}
}

// readPair reads the totals of a cell and the one before it.
func readPair(o *Redis, ctx context.Context, k engine.Key, seq int64) (cur, prev int64, err error) {
	t, err := o.Read(ctx, k, seq, 0)
	return t.Cur, t.Prev, err
}

// nowSeq is the current sequence of a one-minute window.
func nowSeq() int64 { return time.Now().UnixMilli() / time.Minute.Milliseconds() }

func TestRedis_ReadAndFlushRoundTrip(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "self"})
	k, seq := key("alice"), nowSeq()

	cur, prev, err := readPair(o, ctxT(t), k, seq)
	if err != nil || cur != 0 || prev != 0 {
		t.Fatalf("Read of missing cells = %d, %d, %v; want 0, 0, nil", cur, prev, err)
	}

	batch := []engine.Delta{
		{Key: k, Sequence: seq - 1, Delta: 4, Own: 4},
		{Key: k, Sequence: seq, Delta: 7, Own: 7},
	}
	if err := o.Flush(ctxT(t), batch); err != nil {
		t.Fatalf("Flush: %v", err)
	}
	for i, d := range batch {
		if !d.Done || d.Totals.Cur != d.Delta {
			t.Fatalf("item %d: Done=%v Total=%d, want true, %d", i, d.Done, d.Totals.Cur, d.Delta)
		}
	}

	// Another process's units add up in the same cell.
	other := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "other"})
	b2 := []engine.Delta{{Key: k, Sequence: seq, Delta: 3, Own: 3}}
	if err := other.Flush(ctxT(t), b2); err != nil || !b2[0].Done || b2[0].Totals.Cur != 10 {
		t.Fatalf("second process Flush: Done=%v Total=%d err=%v; want true, 10, nil", b2[0].Done, b2[0].Totals.Cur, err)
	}

	cur, prev, err = readPair(o, ctxT(t), k, seq)
	if err != nil || cur != 10 || prev != 4 {
		t.Fatalf("Read = %d, %d, %v; want 10, 4, nil", cur, prev, err)
	}
	got, err := srv.Client().Get(ctxT(t), "ratelimit:{api:alice}:60000:"+fmt.Sprint(seq)).Int64()
	if err != nil || got != 10 {
		t.Fatalf("GET of the documented key = %d, %v; want 10", got, err)
	}

	st := o.Stats().Endpoints[0]
	if st.Calls["read"]["ok"] != 2 || st.Calls["flush"]["ok"] != 1 || st.LastRead.IsZero() || st.LastFlush.IsZero() {
		t.Fatalf("stats after 2 reads and 1 flush: %+v", st)
	}
}

func TestFlush_ExpiresTwoWindowsAfterTheCellEnds(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}, Prefix: "rl"}, Options{})
	for _, w := range []time.Duration{time.Second, time.Minute, time.Hour} {
		k := engine.Key{Namespace: "z", Identifier: "id", Window: w}
		seq := time.Now().UnixMilli() / w.Milliseconds()
		if err := o.Flush(ctxT(t), []engine.Delta{{Key: k, Sequence: seq, Delta: 1, Own: 1}}); err != nil {
			t.Fatalf("Flush: %v", err)
		}
		name := cellKey("rl", k, seq)
		at, err := srv.Client().Do(ctxT(t), "PEXPIRETIME", name).Int64()
		if err != nil {
			t.Fatalf("PEXPIRETIME %s: %v", name, err)
		}
		if want := (seq + 3) * w.Milliseconds(); at != want {
			t.Fatalf("window %s: key expires at %d, want %d (end of cell + 2 windows)", w, at, want)
		}
	}
}

// TestFlush_ReaddsOwnContributionsAfterRestartEmpty has two processes
// count in one cell, kills Redis, starts it again empty on the same port,
// and has both flush again: the cell ends up with each process's
// contribution exactly once, nothing lost and nothing doubled.
func TestFlush_ReaddsOwnContributionsAfterRestartEmpty(t *testing.T) {
	srv := redistest.Start(t)
	a := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	b := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "b"})
	k, seq := key("bob"), nowSeq()

	// own tracks what each process's engine has committed to the cell.
	own := map[*Redis]int64{}
	// flush replays delta from p until it is Done, as the engine does with
	// items left not Done; a failed attempt that was applied behind our
	// back would show up as a doubled total below.
	flush := func(p *Redis, delta int64) engine.Delta {
		t.Helper()
		var d engine.Delta
		redistest.Eventually(t, 10*time.Second, "flush succeeds", func() bool {
			batch := []engine.Delta{{Key: k, Sequence: seq, Delta: delta, Own: own[p] + delta}}
			_ = p.Flush(ctxT(t), batch)
			d = batch[0]
			return d.Done
		})
		own[p] += delta
		return d
	}

	flush(a, 5)
	if d := flush(b, 3); d.Totals.Cur != 8 {
		t.Fatalf("before the restart: total %d, want 8", d.Totals.Cur)
	}

	srv.Restart()

	if d := flush(a, 2); d.Totals.Cur != 7 {
		t.Fatalf("a after the restart: total %d, want 7 (its 5 re-added once + 2)", d.Totals.Cur)
	}
	if d := flush(b, 1); d.Totals.Cur != 11 {
		t.Fatalf("b after the restart: total %d, want 11 (a's 7 + b's 3 re-added once + 1)", d.Totals.Cur)
	}
	c := srv.Client()
	if got, err := c.Get(ctxT(t), cellKey(DefaultPrefix, k, seq)).Int64(); err != nil || got != 11 {
		t.Fatalf("Redis holds %d (%v), want 11", got, err)
	}
	if got, err := c.HGetAll(ctxT(t), contributionKey(cellKey(DefaultPrefix, k, seq))).Result(); err != nil ||
		got["a.0"] != "7" || got["b.0"] != "4" || len(got) != 2 {
		t.Fatalf("contributions %v (%v), want a=7 b=4", got, err)
	}

	// Nothing doubles afterwards: the next deltas just add.
	flush(a, 1)
	if d := flush(b, 1); d.Totals.Cur != 13 {
		t.Fatalf("after recovery: total %d, want 13", d.Totals.Cur)
	}
	at, err := c.Do(ctxT(t), "PEXPIRETIME", contributionKey(cellKey(DefaultPrefix, k, seq))).Int64()
	if err != nil || at != (seq+3)*time.Minute.Milliseconds() {
		t.Fatalf("contribution hash expires at %d (%v), want with its cell", at, err)
	}
}

// blockPipelines makes o's next pipeline wait until release is closed,
// after its flush has registered as in flight; entered is closed when it
// waits.
func blockPipelines(o *Redis) (entered, release chan struct{}) {
	entered, release = make(chan struct{}), make(chan struct{})
	var once sync.Once
	o.endpoints[0].client.AddHook(pipelineHook(func(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
		return func(ctx context.Context, cmds []redis.Cmder) error {
			once.Do(func() {
				close(entered)
				<-release
			})
			return next(ctx, cmds)
		}
	}))
	return entered, release
}

type pipelineHook func(redis.ProcessPipelineHook) redis.ProcessPipelineHook

func (pipelineHook) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (pipelineHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (h pipelineHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return h(next)
}

// TestFlush_OverlappingFlushesOfACellCountOnce has one process flush a
// cell twice at once, the later flush landing first. Each write carries the
// absolute total, so the later one brings the earlier one's units along and
// the earlier one, landing last, is a no-op: every unit counts once.
func TestFlush_OverlappingFlushesOfACellCountOnce(t *testing.T) {
	srv := redistest.Start(t)
	// Two origins under one node ID are one process's old and new origin
	// around a config reload, or simply two flushes of one origin.
	early := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "p"})
	late := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "p"})
	k, seq := key("erin"), nowSeq()

	entered, release := blockPipelines(early)
	first := []engine.Delta{{Key: k, Sequence: seq, Delta: 4, Own: 4}}
	done := make(chan error)
	go func() { done <- early.Flush(ctxT(t), first) }()
	<-entered

	second := []engine.Delta{{Key: k, Sequence: seq, Delta: 3, Own: 7}}
	if err := late.Flush(ctxT(t), second); err != nil || !second[0].Done || second[0].Totals.Cur != 7 {
		t.Fatalf("later flush: Done=%v Total=%d err=%v; want true, 7", second[0].Done, second[0].Totals.Cur, err)
	}
	close(release)
	if err := <-done; err != nil || !first[0].Done || first[0].Totals.Cur != 7 {
		t.Fatalf("earlier flush: Done=%v Total=%d err=%v; want true, 7 (a no-op)", first[0].Done, first[0].Totals.Cur, err)
	}
	// The same write again (a lost reply replayed) changes nothing.
	again := []engine.Delta{{Key: k, Sequence: seq, Delta: 3, Own: 7}}
	if err := late.Flush(ctxT(t), again); err != nil || again[0].Totals.Cur != 7 || again[0].Totals.Mine != 7 {
		t.Fatalf("replayed flush: totals %+v err=%v; want 7 and 7", again[0].Totals, err)
	}

	// A real shortfall (Redis lost 2 of this process's units) is repaired.
	if err := srv.Client().HSet(ctxT(t), contributionKey(cellKey(DefaultPrefix, k, seq)), "p.0", 5).Err(); err != nil {
		t.Fatal(err)
	}
	third := []engine.Delta{{Key: k, Sequence: seq, Delta: 1, Own: 8}}
	if err := late.Flush(ctxT(t), third); err != nil || third[0].Totals.Cur != 10 {
		t.Fatalf("flush after a loss of 2: Total=%d err=%v; want 7+1+2 = 10", third[0].Totals.Cur, err)
	}
}

// TestBreaker_OpensWhenRedisStopsAndRecoversAfterRestart stops Redis under
// a stream of calls: the breaker opens on the failure ratio, open calls are
// refused without I/O, and after Redis comes back (empty, same port) the
// half-open probe closes it again over a fresh connection.
func TestBreaker_OpensWhenRedisStopsAndRecoversAfterRestart(t *testing.T) {
	srv := redistest.Start(t)
	var mu sync.Mutex
	var transitions []string
	hooks := Options{OnStateChange: func(ep, name string, from, to BreakerState) {
		if name != BreakerName {
			return
		}
		mu.Lock()
		transitions = append(transitions, string(from)+">"+string(to))
		mu.Unlock()
	}}
	cfg := Config{Redis: []string{srv.URL()}, Breaker: BreakerConfig{Timeout: Duration(500 * time.Millisecond)}}
	o := newOrigin(t, cfg, hooks)
	k, seq := key("carol"), nowSeq()
	read := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), engine.DefaultReadTimeout)
		defer cancel()
		_, _, err := readPair(o, ctx, k, seq)
		return err
	}
	// Healthy traffic first: successes in the window must not mask the
	// outage that follows (the ratio decides, not a count).
	for i := 0; i < 30; i++ {
		if err := read(); err != nil {
			t.Fatalf("healthy read %d: %v", i, err)
		}
	}

	flush := func() error {
		return o.Flush(ctxT(t), []engine.Delta{{Key: k, Sequence: seq, Delta: 1, Own: 1}})
	}
	srv.Stop()
	redistest.Eventually(t, 10*time.Second, "both breakers open", func() bool {
		_ = read()
		_ = flush()
		st := o.Stats().Endpoints[0]
		return st.Breaker == BreakerOpen && st.ReplayBreaker == BreakerOpen
	})
	st := o.Stats().Endpoints[0]
	if failed := st.Calls["read"]["error"] + st.Calls["read"]["timeout"]; failed < 20 {
		t.Fatalf("breaker opened after %d failed reads; the minimum sample is 20", failed)
	}

	start := time.Now()
	err := read()
	if !errors.Is(err, ErrBreakerOpen) {
		t.Fatalf("read with the breaker open: %v, want ErrBreakerOpen", err)
	}
	if took := time.Since(start); took > 20*time.Millisecond {
		t.Fatalf("an open breaker took %s to refuse; it must not wait on Redis", took)
	}
	b := []engine.Delta{{Key: k, Sequence: seq, Delta: 1, Own: 1}}
	if err := o.Flush(ctxT(t), b); !errors.Is(err, ErrBreakerOpen) || b[0].Done {
		t.Fatalf("flush with the breaker open: Done=%v err=%v", b[0].Done, err)
	}

	srv.Restart()
	redistest.Eventually(t, 10*time.Second, "breaker closes after Redis is back", func() bool {
		return read() == nil && o.Stats().Endpoints[0].Breaker == BreakerClosed
	})
	redistest.Eventually(t, time.Second, "state changes reported", func() bool {
		mu.Lock()
		defer mu.Unlock()
		// Probes that failed while Redis was down add open>half-open>open
		// cycles in the middle.
		n := len(transitions)
		return n >= 3 && transitions[0] == "closed>open" &&
			slices.Equal(transitions[n-2:], []string{"open>half-open", "half-open>closed"})
	})
	if st := o.Stats().Endpoints[0]; st.Calls["read"]["rejected"] == 0 || st.Calls["flush"]["rejected"] == 0 {
		t.Fatalf("rejected calls not counted: %+v", st.Calls)
	}
}

// TestRead_HungRedisNeverBlocksPastTheDeadline pauses Redis (SIGSTOP): the
// socket stays open and nothing answers. Reads and flushes return at their
// deadline.
func TestRead_HungRedisNeverBlocksPastTheDeadline(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{})
	k, seq := key("dave"), nowSeq()
	if _, _, err := readPair(o, ctxT(t), k, seq); err != nil {
		t.Fatalf("warm-up read: %v", err)
	}
	srv.Pause()
	defer srv.Resume()

	const budget = 50 * time.Millisecond
	// Slack for a loaded machine; a go-redis default timeout would be 5 s.
	const slack = 250 * time.Millisecond
	for i := 0; i < 3; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), budget)
		start := time.Now()
		_, _, err := readPair(o, ctx, k, seq)
		took := time.Since(start)
		cancel()
		if err == nil || !isTimeout(err) {
			t.Fatalf("read from a hung Redis: %v, want a timeout", err)
		}
		if took > budget+slack {
			t.Fatalf("read took %s with a %s deadline", took, budget)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), budget)
	defer cancel()
	start := time.Now()
	b := []engine.Delta{{Key: k, Sequence: seq, Delta: 1, Own: 1}}
	err := o.Flush(ctx, b)
	if took := time.Since(start); err == nil || b[0].Done || took > budget+slack {
		t.Fatalf("flush to a hung Redis: err=%v Done=%v after %s", err, b[0].Done, took)
	}
	if st := o.Stats().Endpoints[0]; st.Calls["read"]["timeout"] != 3 || st.Calls["flush"]["timeout"] != 1 {
		t.Fatalf("timeouts not counted as such: %+v", st.Calls)
	}
}

// TestRead_ColdHerdAtRolloverDoesNotTripTheBreaker fires thousands of
// concurrent first reads, as every active key's new cell does at a window
// rollover. They share a few round trips and the breaker stays closed.
func TestRead_ColdHerdAtRolloverDoesNotTripTheBreaker(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{})
	seq := nowSeq()
	const herd = 5000
	var wg sync.WaitGroup
	var ok atomic.Int64
	for i := 0; i < herd; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), engine.DefaultReadTimeout)
			defer cancel()
			if _, _, err := readPair(o, ctx, key(fmt.Sprintf("user-%d", i)), seq); err == nil {
				ok.Add(1)
			}
		}()
	}
	wg.Wait()
	st := o.Stats().Endpoints[0]
	if st.Breaker != BreakerClosed {
		t.Fatalf("breaker %s after a cold herd of %d reads (%+v)", st.Breaker, herd, st.Calls)
	}
	if st.Calls["read"]["rejected"] != 0 {
		t.Fatalf("%d reads rejected by the breaker", st.Calls["read"]["rejected"])
	}
	if st.RoundTrips > herd/10 {
		t.Fatalf("%d reads took %d round trips; concurrent reads must share them", herd, st.RoundTrips)
	}
	t.Logf("%d of %d reads answered within %s in %d round trips", ok.Load(), herd, engine.DefaultReadTimeout, st.RoundTrips)
	if ok.Load() == 0 {
		t.Fatal("no read of the herd succeeded")
	}
}

// TestPartitions_RouteBothCellsOfAKeyToOneServer spreads keys over three
// partitions: both cells of a key sit on one server, every server gets a
// share, another process listing the partitions in another order agrees,
// and dropping a partition moves only that partition's keys.
func TestPartitions_RouteBothCellsOfAKeyToOneServer(t *testing.T) {
	srvs := []*redistest.Server{redistest.Start(t), redistest.Start(t), redistest.Start(t)}
	urls := []string{srvs[0].URL(), srvs[1].URL(), srvs[2].URL()}
	o := newOrigin(t, Config{Redis: urls}, Options{})
	seq := nowSeq()
	const keys = 300
	var batch []engine.Delta
	for i := 0; i < keys; i++ {
		k := key(fmt.Sprintf("tenant-%d", i))
		batch = append(batch,
			engine.Delta{Key: k, Sequence: seq - 1, Delta: int64(i + 1), Own: int64(i + 1)},
			engine.Delta{Key: k, Sequence: seq, Delta: int64(i + 1000), Own: int64(i + 1000)})
	}
	if err := o.Flush(ctxT(t), batch); err != nil {
		t.Fatalf("Flush: %v", err)
	}
	home := make(map[string]int) // identifier → server index
	for i := 0; i < keys; i++ {
		k := key(fmt.Sprintf("tenant-%d", i))
		holders := 0
		for s, srv := range srvs {
			n, err := srv.Client().Exists(ctxT(t), cellKey(DefaultPrefix, k, seq), cellKey(DefaultPrefix, k, seq-1)).Result()
			if err != nil {
				t.Fatal(err)
			}
			switch n {
			case 0:
			case 2:
				holders++
				home[k.Identifier] = s
			default:
				t.Fatalf("%s: server %d holds %d of its 2 cells", k.Identifier, s, n)
			}
		}
		if holders != 1 {
			t.Fatalf("%s: held by %d servers, want 1", k.Identifier, holders)
		}
	}
	share := make([]int, len(srvs))
	for _, s := range home {
		share[s]++
	}
	for s, n := range share {
		if n < keys/6 {
			t.Fatalf("server %d holds %d of %d keys: the hash does not spread (%v)", s, n, keys, share)
		}
	}

	reordered := newOrigin(t, Config{Redis: []string{urls[2], urls[0], urls[1]}}, Options{})
	for i := 0; i < keys; i++ {
		cur, prev, err := readPair(reordered, ctxT(t), key(fmt.Sprintf("tenant-%d", i)), seq)
		if err != nil || cur != int64(i+1000) || prev != int64(i+1) {
			t.Fatalf("tenant-%d through reordered partitions: %d, %d, %v", i, cur, prev, err)
		}
	}

	// Without partition 1, keys homed on 0 and 2 stay where they are.
	fewer := newOrigin(t, Config{Redis: []string{urls[0], urls[2]}}, Options{})
	for i := 0; i < keys; i++ {
		id := fmt.Sprintf("tenant-%d", i)
		if home[id] == 1 {
			continue
		}
		cur, _, err := readPair(fewer, ctxT(t), key(id), seq)
		if err != nil || cur != int64(i+1000) {
			t.Fatalf("%s (on server %d) moved when partition 1 left: %d, %v", id, home[id], cur, err)
		}
	}
}

// TestPartitions_OneDeadPartitionFailsOnlyItsItems flushes across two
// partitions, one stopped: the live one's items are Done, the dead one's
// are not, and the error names the dead endpoint.
func TestPartitions_OneDeadPartitionFailsOnlyItsItems(t *testing.T) {
	live, dead := redistest.Start(t), redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{live.URL(), dead.URL()}}, Options{})
	dead.Stop()
	seq := nowSeq()
	var batch []engine.Delta
	for i := 0; i < 40; i++ {
		batch = append(batch, engine.Delta{Key: key(fmt.Sprintf("k%d", i)), Sequence: seq, Delta: 1, Own: 1})
	}
	err := o.Flush(ctxT(t), batch)
	if err == nil || !strings.Contains(err.Error(), dead.Addr()) || strings.Contains(err.Error(), live.Addr()) {
		t.Fatalf("Flush error %v: want one naming %s only", err, dead.Addr())
	}
	done, notDone := 0, 0
	for _, d := range batch {
		onLive := o.route(d.Key).address == o.endpoints[0].address
		if d.Done != onLive {
			t.Fatalf("%s: Done=%v but on live partition=%v", d.Key.Identifier, d.Done, onLive)
		}
		if d.Done {
			done++
		} else {
			notDone++
		}
	}
	if done == 0 || notDone == 0 {
		t.Fatalf("all %d keys on one partition; the test proves nothing", len(batch))
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

// TestRedis_HostileIdentifiersNeverCollide writes a distinct count for each
// hostile identifier into a real Redis and reads every one back.
func TestRedis_HostileIdentifiersNeverCollide(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{})
	big := strings.Repeat("A", 64<<10)
	ids := []string{
		"", ":", "{", "}", "{}", "a:b", "a%3Ab", "%", "%25", "\n", "a\nb", "a\r\nb", "\x00",
		"\xff\xfe", "\xc3\x28", "é", "x}:60000:1", "api:x", big, big + "\n", big + "{",
	}
	seq := nowSeq()
	var batch []engine.Delta
	for i, id := range ids {
		batch = append(batch, engine.Delta{Key: key(id), Sequence: seq, Delta: int64(i + 1), Own: int64(i + 1)})
	}
	// One that would collide with "x" under a naive "ns:id" join.
	batch = append(batch, engine.Delta{
		Key: engine.Key{Namespace: "api:x", Identifier: "", Window: time.Minute}, Sequence: seq, Delta: 100, Own: 100,
	})
	if err := o.Flush(ctxT(t), batch); err != nil {
		t.Fatalf("Flush: %v", err)
	}
	for _, d := range batch {
		if !d.Done || d.Totals.Cur != d.Delta {
			t.Fatalf("%q: Total %d, want %d: another identifier shares its key", trunc(d.Key.Identifier), d.Totals.Cur, d.Delta)
		}
		cur, _, err := readPair(o, ctxT(t), d.Key, seq)
		if err != nil || cur != d.Delta {
			t.Fatalf("%q: Read %d, %v; want %d", trunc(d.Key.Identifier), cur, err, d.Delta)
		}
	}
	// A cell and its contribution hash per identifier, none shared.
	if n, err := srv.Client().DBSize(ctxT(t)).Result(); err != nil || n != 2*int64(len(batch)) {
		t.Fatalf("DBSIZE = %d (%v), want %d distinct keys", n, err, 2*len(batch))
	}
}

// logSink captures go-redis's own log lines.
type logSink struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (l *logSink) printf(format string, v ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	fmt.Fprintf(&l.buf, format+"\n", v...)
}

func (l *logSink) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// TestPassword_NeverInErrorsLogsOrStatus checks every place a URL could
// leak: config errors for malformed URLs, call errors (wrong password, dead
// server), String, Stats (as JSON), breaker notifications and go-redis's
// own log lines.
func TestPassword_NeverInErrorsLogsOrStatus(t *testing.T) {
	const secret = "Sup3rS3cret-pw"
	sink := &logSink{}
	SetLogger(sink.printf)
	t.Cleanup(func() { SetLogger(func(string, ...any) {}) })

	var seen []string
	check := func(where, s string) {
		t.Helper()
		seen = append(seen, s)
		if strings.Contains(s, secret) || strings.Contains(s, "Sup3r") || strings.Contains(s, "S3cret") {
			t.Fatalf("%s leaks the password: %s", where, s)
		}
	}

	for _, bad := range []string{
		"redis://:" + secret + "@127.0.0.1:notaport",
		"redis://user:" + secret + "/x@127.0.0.1:6379",
		"redis://user:" + secret + "@127.0.0.1:6379/x/y",
		"redis://:" + secret + "@127.0.0.1:6379/" + secret,
		"redis://:" + secret + "@127.0.0.1:6379/?password=" + secret,
		"http://:" + secret + "@127.0.0.1:6379",
		"redis://:" + secret + "@127.0.0.1:6379\x7f",
		"user:" + secret + "@127.0.0.1:6379",
	} {
		err := Config{Redis: []string{bad}}.Validate()
		if err == nil {
			t.Fatalf("Validate accepted a malformed URL")
		}
		check("Validate error", err.Error())
		err = Config{Cluster: &ClusterConfig{Addrs: []string{bad}}}.Validate()
		if err == nil {
			t.Fatalf("Validate accepted a malformed cluster address")
		}
		check("Validate error (cluster)", err.Error())
	}

	srv := redistest.Start(t, redistest.WithPassword(secret))
	var mu sync.Mutex
	var notes []string
	hooks := Options{OnStateChange: func(ep, _ string, from, to BreakerState) {
		mu.Lock()
		notes = append(notes, ep)
		mu.Unlock()
	}}
	good := newOrigin(t, Config{Redis: []string{srv.URL()}}, hooks)
	if _, _, err := readPair(good, ctxT(t), key("x"), 1); err != nil {
		t.Fatalf("read with the right password: %v", err)
	}
	check("String", good.String())
	js, _ := json.Marshal(good.Stats())
	check("Stats", string(js))
	if !strings.Contains(string(js), srv.Addr()) {
		t.Fatalf("Stats should name the address %s: %s", srv.Addr(), js)
	}

	wrong := newOrigin(t, Config{Redis: []string{"redis://:wrong-" + secret + "@" + srv.Addr()}}, Options{})
	_, _, err := readPair(wrong, ctxT(t), key("x"), 1)
	if err == nil {
		t.Fatal("read with a wrong password succeeded")
	}
	check("wrong-password error", err.Error())

	srv.Stop()
	for i := 0; i < 30; i++ {
		if _, _, err := readPair(good, ctxT(t), key("x"), 1); err != nil {
			check("dead-server error", err.Error())
		}
		b := []engine.Delta{{Key: key("x"), Sequence: 1, Delta: 1, Own: 1}}
		if err := good.Flush(ctxT(t), b); err != nil {
			check("dead-server flush error", err.Error())
		}
	}
	redistest.Eventually(t, 5*time.Second, "breaker notification", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(notes) > 0
	})
	mu.Lock()
	for _, n := range notes {
		check("OnStateChange endpoint", n)
	}
	mu.Unlock()
	if !strings.Contains(sink.String(), srv.Addr()) {
		t.Fatalf("go-redis logged nothing about the dead server; the log check proves nothing: %q", sink.String())
	}
	check("go-redis log", sink.String())
	if len(seen) < 20 {
		t.Fatalf("only %d strings checked", len(seen))
	}
}

func TestRedis_CloseRefusesCallsAndIsIdempotent(t *testing.T) {
	srv := redistest.Start(t)
	o, err := New(Config{Redis: []string{srv.URL()}}, Options{OnStateChange: func(string, string, BreakerState, BreakerState) {}})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := readPair(o, ctxT(t), key("x"), 1); err != nil {
		t.Fatalf("Read: %v", err)
	}
	if err := o.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := o.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, _, err := readPair(o, ctxT(t), key("x"), 1); !errors.Is(err, ErrClosed) {
		t.Fatalf("Read after Close: %v", err)
	}
	b := []engine.Delta{{Key: key("x"), Sequence: 1, Delta: 1, Own: 1}}
	if err := o.Flush(ctxT(t), b); !errors.Is(err, ErrClosed) || b[0].Done {
		t.Fatalf("Flush after Close: %v, Done=%v", err, b[0].Done)
	}
}

func TestRedis_OnCallReportsEveryCall(t *testing.T) {
	srv := redistest.Start(t)
	var mu sync.Mutex
	var calls []CallInfo
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{OnCall: func(c CallInfo) {
		mu.Lock()
		calls = append(calls, c)
		mu.Unlock()
	}})
	if _, _, err := readPair(o, ctxT(t), key("x"), 1); err != nil {
		t.Fatal(err)
	}
	b := []engine.Delta{{Key: key("x"), Sequence: 1, Delta: 1, Own: 1}, {Key: key("y"), Sequence: 1, Delta: 1, Own: 1}}
	if err := o.Flush(ctxT(t), b); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(calls) != 2 || calls[0].Op != OpRead || calls[1].Op != OpFlush || calls[1].Cells != 2 ||
		calls[0].Outcome != OutcomeOK || calls[0].Duration <= 0 || calls[0].Endpoint != srv.URL() {
		t.Fatalf("calls = %+v", calls)
	}
}

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
	if got, err := master.Client().Get(ctxT(t), cellKey(DefaultPrefix, k, seq)).Int64(); err != nil || got != 3 {
		t.Fatalf("the master holds %d (%v), want 3", got, err)
	}
	st := o.Stats().Endpoints[0]
	if st.Kind != KindSentinel || strings.Contains(st.Address, "master-pw") || !strings.Contains(st.Address, sentinel.Addr()) {
		t.Fatalf("stats: %+v", st)
	}
}

// TestClose_LeavesNoGoroutine closes an origin that has read, flushed,
// tripped its breaker and reported it, and checks that every goroutine it
// or its client started ends: a config reload must not leak.
func TestClose_LeavesNoGoroutine(t *testing.T) {
	srv := redistest.Start(t)
	base := runtime.NumGoroutine()
	o, err := New(Config{Redis: []string{srv.URL()}}, Options{OnStateChange: func(string, string, BreakerState, BreakerState) {}})
	if err != nil {
		t.Fatal(err)
	}
	k := key("leak")
	for i := 0; i < 5; i++ {
		if _, _, err := readPair(o, ctxT(t), k, int64(i)); err != nil {
			t.Fatal(err)
		}
	}
	srv.Stop()
	for i := 0; i < 40; i++ {
		_, _, _ = readPair(o, ctxT(t), k, 1)
		_ = o.Flush(ctxT(t), []engine.Delta{{Key: k, Sequence: 1, Delta: 1, Own: 1}})
	}
	if st := o.Stats().Endpoints[0].Breaker; st != BreakerOpen {
		t.Fatalf("breaker %s; the test wants the failure paths exercised", st)
	}
	if err := o.Close(); err != nil {
		t.Fatal(err)
	}
	// go-redis's dial prober notices a closed pool within a second.
	redistest.Eventually(t, 5*time.Second, "goroutines back to the baseline", func() bool {
		return runtime.NumGoroutine() <= base
	})
}

// BenchmarkFlush is one replay batch of 256 distinct cells against a real
// Redis, the shape of a slow tick with many keys each touched once: the
// Caddy-side cost of replay per cell (ns/cell, allocs/op over 256).
func BenchmarkFlush(b *testing.B) {
	srv := redistest.Start(b)
	o := newOrigin(b, Config{Redis: []string{srv.URL()}}, Options{NodeID: "bench"})
	const cells = 256
	seq := nowSeq()
	batch := make([]engine.Delta, cells)
	ks := make([]engine.Key, cells)
	for i := range ks {
		ks[i] = key("user-" + strconv.Itoa(1_000_000+i))
	}
	ctx := context.Background()
	own := int64(0)
	b.ReportAllocs()
	cpu0 := cpuTime(b)
	for b.Loop() {
		own++
		for i := range batch {
			batch[i] = engine.Delta{Key: ks[i], Sequence: seq, Delta: 1, Own: own}
		}
		if err := o.Flush(ctx, batch); err != nil {
			b.Fatal(err)
		}
		if !batch[cells-1].Done || batch[cells-1].Totals.Mine != own {
			b.Fatalf("last item: done=%v totals=%+v, want mine=%d", batch[cells-1].Done, batch[cells-1].Totals, own)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*cells), "ns/cell")
	// This process's CPU time alone: Redis runs the scripts in its own.
	b.ReportMetric(float64((cpuTime(b)-cpu0).Nanoseconds())/float64(b.N*cells), "cpu-ns/cell")
}

// cpuTime is the CPU time this process has used, user and system.
func cpuTime(tb testing.TB) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestFlush_ManyCellsGoInChunksAndFailAlone flushes more cells than one
// script call carries, with hostile identifiers and one cell Redis refuses:
// every other cell is applied once with its own totals, in order.
func TestFlush_ManyCellsGoInChunksAndFailAlone(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "p"})
	seq := nowSeq()
	const n = 2*manyChunk + 22
	const bad = manyChunk + 5
	batch := make([]engine.Delta, n)
	for i := range batch {
		id := fmt.Sprintf("u %d:{x}%%\n\x00\xff", i)
		batch[i] = engine.Delta{Key: key(id), Sequence: seq, Delta: int64(i + 1), Own: int64(i + 1)}
		// Each previous cell holds its own count, and each cell 1000 units
		// of another process.
		if err := srv.Client().Set(ctxT(t), cellKey(DefaultPrefix, batch[i].Key, seq-1), 7*i, 0).Err(); err != nil {
			t.Fatal(err)
		}
		if err := srv.Client().Set(ctxT(t), cellKey(DefaultPrefix, batch[i].Key, seq), 1000, 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if err := srv.Client().Set(ctxT(t), cellKey(DefaultPrefix, batch[bad].Key, seq), "not a number", 0).Err(); err != nil {
		t.Fatal(err)
	}
	for round := 0; round < 2; round++ { // the second flush is a replay: a no-op
		err := o.Flush(ctxT(t), batch)
		if err == nil || !strings.Contains(err.Error(), "refused 1 cells") {
			t.Fatalf("flush: %v, want the one refused cell reported", err)
		}
		for i, d := range batch {
			if i == bad {
				if d.Done {
					t.Fatalf("the refused cell is marked done: %+v", d.Totals)
				}
				continue
			}
			want := engine.Totals{Cur: 1000 + int64(i+1), Prev: int64(7 * i), Mine: int64(i + 1), Shared: false}
			if !d.Done || d.Totals != want {
				t.Fatalf("round %d, cell %d: done=%v totals %+v, want %+v", round, i, d.Done, d.Totals, want)
			}
		}
	}
	if st := o.Stats().Endpoints[0]; st.ReplayBreaker != BreakerClosed {
		t.Fatalf("a refused cell opened the replay breaker: %+v", st)
	}
}

// BenchmarkColdDecide is the first decision of keys this process has never
// seen, through an engine on a real Redis, from 64 concurrent callers (the
// load harness's connections): each reads Redis before it decides. cpu-ns/op
// is this process's CPU per decision, the engine and the origin together.
func BenchmarkColdDecide(b *testing.B) {
	srv := redistest.Start(b)
	o := newOrigin(b, Config{Redis: []string{srv.URL()}}, Options{NodeID: "bench"})
	e := engine.New(engine.Config{})
	b.Cleanup(func() { _ = e.Close(context.Background()) })
	e.SetOrigin(o)
	var next atomic.Int64
	b.SetParallelism(32) // 64 callers on 2 cores
	b.ReportAllocs()
	cpu0 := cpuTime(b)
	b.RunParallel(func(pb *testing.PB) {
		ctx := context.Background()
		for pb.Next() {
			id := "k" + strconv.FormatInt(next.Add(1), 10)
			d := e.Decide(ctx, engine.Limit{Key: engine.Key{Namespace: "api", Identifier: id, Window: time.Hour}, Limit: 1 << 40, Cost: 1})
			if !d.Allowed {
				b.Fatal("denied")
			}
		}
	})
	b.ReportMetric(float64((cpuTime(b)-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
	b.ReportMetric(float64(o.Stats().Endpoints[0].RoundTrips)/float64(b.N), "roundtrips/op")
	if st := e.Stats(); st.SyncReads < int64(b.N)/2 {
		b.Fatalf("%d synchronous reads for %d cold keys", st.SyncReads, b.N)
	}
}

// TestScripts_ReloadedAfterScriptFlush: a Redis that lost its scripts (a
// restart, a failover, SCRIPT FLUSH) gets them loaded again by the next
// read, flush or reservation, which then succeeds once: nothing is lost
// and nothing counts twice.
func TestScripts_ReloadedAfterScriptFlush(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "p"})
	seq := nowSeq()
	ks := []engine.Key{key("ivan"), key("judy")}
	flushScripts := func() {
		t.Helper()
		if err := srv.Client().ScriptFlush(ctxT(t)).Err(); err != nil {
			t.Fatal(err)
		}
	}
	for round := int64(1); round <= 3; round++ {
		flushScripts()
		for _, k := range ks {
			if _, err := o.Read(ctxT(t), k, seq, 0); err != nil {
				t.Fatalf("round %d: read after SCRIPT FLUSH: %v", round, err)
			}
		}
		flushScripts()
		batch := []engine.Delta{{Key: ks[0], Sequence: seq, Delta: 1, Own: round}, {Key: ks[1], Sequence: seq, Delta: 1, Own: round}}
		if err := o.Flush(ctxT(t), batch); err != nil || !batch[0].Done || !batch[1].Done {
			t.Fatalf("round %d: flush after SCRIPT FLUSH: %v (%+v)", round, err, batch)
		}
		flushScripts()
		r := reservation(ks[0], seq, round, 1, 1000)
		if err := o.Reserve(ctxT(t), r); err != nil || !r.Admitted {
			t.Fatalf("round %d: reservation after SCRIPT FLUSH: %v admitted=%v", round, err, r.Admitted)
		}
		if err := o.Flush(ctxT(t), []engine.Delta{{Key: ks[0], Sequence: seq, Own: round + 1}}); err != nil {
			t.Fatal(err)
		}
		for i, want := range []int64{round + 1, round} {
			cur, _, err := readPair(o, ctxT(t), ks[i], seq)
			if err != nil || cur != want {
				t.Fatalf("round %d: %s holds %d (%v), want %d", round, ks[i].Identifier, cur, err, want)
			}
		}
	}
}
