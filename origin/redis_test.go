package origin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// newOrigin builds an origin from cfg and closes it when the test ends.
func newOrigin(t *testing.T, cfg Config, hooks Hooks) *Redis {
	t.Helper()
	o, err := New(cfg, hooks)
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

// nowSeq is the current sequence of a one-minute window.
func nowSeq() int64 { return time.Now().UnixMilli() / time.Minute.Milliseconds() }

func TestRedis_ReadAndFlushRoundTrip(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Hooks{})
	k, seq := key("alice"), nowSeq()

	cur, prev, err := o.Read(ctxT(t), k, seq)
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
		if !d.Done || d.Total != d.Delta {
			t.Fatalf("item %d: Done=%v Total=%d, want true, %d", i, d.Done, d.Total, d.Delta)
		}
	}

	// Another process's units add up in the same cell.
	other := newOrigin(t, Config{Redis: []string{srv.URL()}}, Hooks{})
	b2 := []engine.Delta{{Key: k, Sequence: seq, Delta: 3, Own: 3}}
	if err := other.Flush(ctxT(t), b2); err != nil || !b2[0].Done || b2[0].Total != 10 {
		t.Fatalf("second process Flush: Done=%v Total=%d err=%v; want true, 10, nil", b2[0].Done, b2[0].Total, err)
	}

	cur, prev, err = o.Read(ctxT(t), k, seq)
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
	o := newOrigin(t, Config{Redis: []string{srv.URL()}, Prefix: "rl"}, Hooks{})
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

// TestFlush_ReaddsOwnContributionAfterRestartEmpty kills Redis, starts it
// again empty on the same port, and flushes again: the cell ends up with
// this process's contribution exactly once.
func TestFlush_ReaddsOwnContributionAfterRestartEmpty(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Hooks{})
	k, seq := key("bob"), nowSeq()

	first := []engine.Delta{{Key: k, Sequence: seq, Delta: 5, Own: 5}}
	if err := o.Flush(ctxT(t), first); err != nil || first[0].Total != 5 {
		t.Fatalf("first Flush: total %d, %v", first[0].Total, err)
	}

	srv.Restart()

	// The engine replays items until they are Done; do the same, and prove
	// that no failed attempt was applied behind our back.
	own := int64(5)
	var d engine.Delta
	redistest.Eventually(t, 10*time.Second, "flush after restart succeeds", func() bool {
		d = engine.Delta{Key: k, Sequence: seq, Delta: 2, Own: own + 2}
		b := []engine.Delta{d}
		_ = o.Flush(ctxT(t), b)
		d = b[0]
		return d.Done
	})
	if d.Total != 7 {
		t.Fatalf("Total after restart = %d, want 7 (own 5 re-added once + delta 2)", d.Total)
	}
	got, err := srv.Client().Get(ctxT(t), cellKey(DefaultPrefix, k, seq)).Int64()
	if err != nil || got != 7 {
		t.Fatalf("Redis holds %d (%v), want 7", got, err)
	}
	if r := o.Stats().Endpoints[0].Readded; r != 5 {
		t.Fatalf("Readded = %d, want 5", r)
	}

	// Nothing doubles afterwards: the next delta just adds.
	next := []engine.Delta{{Key: k, Sequence: seq, Delta: 1, Own: 8}}
	if err := o.Flush(ctxT(t), next); err != nil || next[0].Total != 8 {
		t.Fatalf("next Flush: total %d (%v), want 8", next[0].Total, err)
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
	hooks := Hooks{OnStateChange: func(ep string, from, to BreakerState) {
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
		_, _, err := o.Read(ctx, k, seq)
		return err
	}
	// Healthy traffic first: successes in the window must not mask the
	// outage that follows (the ratio decides, not a count).
	for i := 0; i < 30; i++ {
		if err := read(); err != nil {
			t.Fatalf("healthy read %d: %v", i, err)
		}
	}

	srv.Stop()
	redistest.Eventually(t, 10*time.Second, "breaker opens", func() bool {
		_ = read()
		return o.Stats().Endpoints[0].Breaker == BreakerOpen
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
		return slices.Equal(transitions, []string{"closed>open", "open>half-open", "half-open>closed"})
	})
	if st := o.Stats().Endpoints[0]; st.Calls["read"]["rejected"] == 0 || st.Calls["flush"]["rejected"] != 1 {
		t.Fatalf("rejected calls not counted: %+v", st.Calls)
	}
}

// TestRead_HungRedisNeverBlocksPastTheDeadline pauses Redis (SIGSTOP): the
// socket stays open and nothing answers. Reads and flushes return at their
// deadline.
func TestRead_HungRedisNeverBlocksPastTheDeadline(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Hooks{})
	k, seq := key("dave"), nowSeq()
	if _, _, err := o.Read(ctxT(t), k, seq); err != nil {
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
		_, _, err := o.Read(ctx, k, seq)
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
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Hooks{})
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
			if _, _, err := o.Read(ctx, key(fmt.Sprintf("user-%d", i)), seq); err == nil {
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
	o := newOrigin(t, Config{Redis: urls}, Hooks{})
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

	reordered := newOrigin(t, Config{Redis: []string{urls[2], urls[0], urls[1]}}, Hooks{})
	for i := 0; i < keys; i++ {
		cur, prev, err := reordered.Read(ctxT(t), key(fmt.Sprintf("tenant-%d", i)), seq)
		if err != nil || cur != int64(i+1000) || prev != int64(i+1) {
			t.Fatalf("tenant-%d through reordered partitions: %d, %d, %v", i, cur, prev, err)
		}
	}

	// Without partition 1, keys homed on 0 and 2 stay where they are.
	fewer := newOrigin(t, Config{Redis: []string{urls[0], urls[2]}}, Hooks{})
	for i := 0; i < keys; i++ {
		id := fmt.Sprintf("tenant-%d", i)
		if home[id] == 1 {
			continue
		}
		cur, _, err := fewer.Read(ctxT(t), key(id), seq)
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
	o := newOrigin(t, Config{Redis: []string{live.URL(), dead.URL()}}, Hooks{})
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
	o := newOrigin(t, Config{Cluster: &ClusterConfig{Addrs: cl.Addrs()}}, Hooks{})
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
		cur, prev, err := o.Read(ctxT(t), k, seq)
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
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Hooks{})
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
		if !d.Done || d.Total != d.Delta {
			t.Fatalf("%q: Total %d, want %d: another identifier shares its key", trunc(d.Key.Identifier), d.Total, d.Delta)
		}
		cur, _, err := o.Read(ctxT(t), d.Key, seq)
		if err != nil || cur != d.Delta {
			t.Fatalf("%q: Read %d, %v; want %d", trunc(d.Key.Identifier), cur, err, d.Delta)
		}
	}
	if n, err := srv.Client().DBSize(ctxT(t)).Result(); err != nil || n != int64(len(batch)) {
		t.Fatalf("DBSIZE = %d (%v), want %d distinct keys", n, err, len(batch))
	}
}

// logSink captures go-redis's own log lines.
type logSink struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (l *logSink) Printf(_ context.Context, format string, v ...any) {
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
	redis.SetLogger(sink)
	t.Cleanup(func() { redis.SetLogger(&discard{}) })

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
	hooks := Hooks{OnStateChange: func(ep string, from, to BreakerState) {
		mu.Lock()
		notes = append(notes, ep)
		mu.Unlock()
	}}
	good := newOrigin(t, Config{Redis: []string{srv.URL()}}, hooks)
	if _, _, err := good.Read(ctxT(t), key("x"), 1); err != nil {
		t.Fatalf("read with the right password: %v", err)
	}
	check("String", good.String())
	js, _ := json.Marshal(good.Stats())
	check("Stats", string(js))
	if !strings.Contains(string(js), srv.Addr()) {
		t.Fatalf("Stats should name the address %s: %s", srv.Addr(), js)
	}

	wrong := newOrigin(t, Config{Redis: []string{"redis://:wrong-" + secret + "@" + srv.Addr()}}, Hooks{})
	_, _, err := wrong.Read(ctxT(t), key("x"), 1)
	if err == nil {
		t.Fatal("read with a wrong password succeeded")
	}
	check("wrong-password error", err.Error())

	srv.Stop()
	for i := 0; i < 30; i++ {
		if _, _, err := good.Read(ctxT(t), key("x"), 1); err != nil {
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
	check("go-redis log", sink.String())
	if len(seen) < 20 {
		t.Fatalf("only %d strings checked", len(seen))
	}
}

type discard struct{}

func (discard) Printf(context.Context, string, ...any) {}

func TestRedis_CloseRefusesCallsAndIsIdempotent(t *testing.T) {
	srv := redistest.Start(t)
	o, err := New(Config{Redis: []string{srv.URL()}}, Hooks{OnStateChange: func(string, BreakerState, BreakerState) {}})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := o.Read(ctxT(t), key("x"), 1); err != nil {
		t.Fatalf("Read: %v", err)
	}
	if err := o.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := o.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, _, err := o.Read(ctxT(t), key("x"), 1); !errors.Is(err, ErrClosed) {
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
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Hooks{OnCall: func(c CallInfo) {
		mu.Lock()
		calls = append(calls, c)
		mu.Unlock()
	}})
	if _, _, err := o.Read(ctxT(t), key("x"), 1); err != nil {
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
