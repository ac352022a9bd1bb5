package origin

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// TestBreaker_OpensWhenRedisStopsAndRecoversAfterRestart stops Redis under
// a stream of calls: the breaker opens on the failure ratio, open calls are
// refused without I/O, and after Redis comes back (empty, same port) the
// half-open probe closes it again over a fresh connection.
func TestBreaker_OpensWhenRedisStopsAndRecoversAfterRestart(t *testing.T) {
	srv := redistest.Start(t)
	var states stateLog
	cfg := Config{Redis: []string{srv.URL()}, Breaker: BreakerConfig{Timeout: Duration(500 * time.Millisecond)}}
	o := newOrigin(t, cfg, Options{OnStateChange: states.hook})
	k, seq := key("carol"), nowSeq()
	read := func() error { return requestRead(o, k, seq) }
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
		// Probes that failed while Redis was down add open>half-open>open
		// cycles in the middle.
		seen := states.transitions(BreakerName)
		n := len(seen)
		return n >= 3 && seen[0] == "closed>open" &&
			slices.Equal(seen[n-2:], []string{"open>half-open", "half-open>closed"})
	})
	if st := o.Stats().Endpoints[0]; st.Calls["read"]["rejected"] == 0 || st.Calls["flush"]["rejected"] == 0 {
		t.Fatalf("rejected calls not counted: %+v", st.Calls)
	}
}

// TestBreaker_ALightLoadOnARedisThatIsDownOpensIt: under a few requests
// a second the window never holds breaker_min_requests calls, and the
// breaker of a Redis that refused every connection stayed closed for the
// whole outage (an audit: 50 requests over a minute on two nodes); with a
// hung Redis each of a node's first twenty requests waited read_timeout.
// Five calls failed in a row, in a sample smaller than that, now open
// it, and four do not.
func TestBreaker_ALightLoadOnARedisThatIsDownOpensIt(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}, Breaker: BreakerConfig{Timeout: Duration(MaxBreakerTimeout)}}, Options{NodeID: "light"})
	k, seq := key("light"), nowSeq()
	if err := requestRead(o, k, seq); err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	failed := 0
	for failed < 4 {
		if err := requestRead(o, k, seq); err == nil {
			t.Fatal("a read of a stopped Redis succeeded")
		}
		failed++
	}
	if st := o.Stats().Endpoints[0]; st.Breaker != BreakerClosed {
		t.Fatalf("after one success and %d failures the breaker is %s, want closed", failed, st.Breaker)
	}
	if err := requestRead(o, k, seq); err == nil {
		t.Fatal("a read of a stopped Redis succeeded")
	}
	if st := o.Stats().Endpoints[0]; st.Breaker != BreakerOpen {
		t.Fatalf("after five failures in a row the breaker is %s, want open", st.Breaker)
	}
}

func TestBreaker_SlowRedisOpensTheRequestPathOnly(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.StartDelayProxy(t, srv.Addr(), 30*time.Millisecond)
	o := newOrigin(t, Config{Redis: []string{proxy.URL()}, Breaker: BreakerConfig{Timeout: Duration(MaxBreakerTimeout)}}, Options{NodeID: "p"})
	k, seq := key("judy"), nowSeq()
	var took []time.Duration
	for i := 0; i < 60; i++ {
		start := time.Now()
		_ = requestRead(o, k, seq)
		took = append(took, time.Since(start))
		if err := o.Flush(ctxT(t), []engine.Delta{{Key: k, Sequence: seq, Delta: 1, Own: int64(i + 1)}}); err != nil {
			t.Fatalf("flush %d through a slow Redis: %v", i, err)
		}
	}
	st := o.Stats().Endpoints[0]
	if st.Breaker != BreakerOpen || st.ReplayBreaker != BreakerClosed {
		t.Fatalf("after 60 slow calls: request path %s, replay %s; want open and closed", st.Breaker, st.ReplayBreaker)
	}
	if st.SlowCalls < uint64(smallTrip(DefaultBreakerMinRequests)) {
		t.Fatalf("%d slow calls counted", st.SlowCalls)
	}
	// Once open, a read costs nothing.
	last := took[len(took)-10:]
	sort.Slice(last, func(i, j int) bool { return last[i] < last[j] })
	if med := last[len(last)/2]; med > 5*time.Millisecond {
		t.Fatalf("median read with the breaker open took %s", med)
	}
	// Replay still delivered every unit.
	cur, _, err := readPair(newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "q"}), ctxT(t), k, seq)
	if err != nil || cur != 60 {
		t.Fatalf("Redis holds %d (%v), want the 60 replayed units", cur, err)
	}
}

func TestFlush_AFailingCommandDoesNotCountAgainstTheBreaker(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "p"})
	seq := nowSeq()
	bad, good := key("mallory"), key("trent")
	// A cell that holds something other than a count: its script fails.
	if err := srv.Client().Set(ctxT(t), cellKey(DefaultPrefix, bad, seq), "not a number", 0).Err(); err != nil {
		t.Fatal(err)
	}
	for i := int64(1); i <= 50; i++ {
		b := []engine.Delta{{Key: bad, Sequence: seq, Delta: 1, Own: i}, {Key: good, Sequence: seq, Delta: 1, Own: i}}
		_ = o.Flush(ctxT(t), b)
		if b[0].Done || !b[1].Done || b[1].Totals.Cur != i {
			t.Fatalf("flush %d: bad Done=%v, good Done=%v total %d", i, b[0].Done, b[1].Done, b[1].Totals.Cur)
		}
		if _, err := o.Read(ctxT(t), bad, seq, 0); err == nil {
			t.Fatal("read of a non-integer cell succeeded")
		}
	}
	if st := o.Stats().Endpoints[0]; st.Breaker != BreakerClosed || st.ReplayBreaker != BreakerClosed {
		t.Fatalf("one hostile key opened a breaker: %+v", st)
	}
}

// TestBreaker_AReplicaAnsweringREADONLYOpensItAndRecovers: the configured
// server is made a replica of another mid-run (REPLICAOF, an operator's
// mistake or a failover the address did not follow). Every write is
// refused with READONLY for as long as it stays one: that is Redis
// refusing work as a whole, not one hostile key, so both breakers open
// (decisions local at no cost, counts held) and the errors say READONLY.
// It once failed inside the script, cell by cell, as "Redis refused N
// cells (a key holds another type, or … out of memory)": the breakers
// stayed closed, every cold read paid a round trip that always failed,
// and no line named the cause. When the server is a master again, the
// breakers close by themselves and the held units arrive.
func TestBreaker_AReplicaAnsweringREADONLYOpensItAndRecovers(t *testing.T) {
	srv, other := redistest.Start(t), redistest.Start(t)
	var states stateLog
	cfg := Config{Redis: []string{srv.URL()}, Breaker: BreakerConfig{Timeout: Duration(200 * time.Millisecond)}}
	o := newOrigin(t, cfg, Options{NodeID: "ro", OnStateChange: states.hook})
	k, seq := key("victor"), nowSeq()
	flush := oneCellFlush(t, o, k, seq)
	if b, err := flush(5); err != nil || !b[0].Done {
		t.Fatalf("healthy flush: %v", err)
	}
	var restarts atomic.Int64
	o.WatchRestarts(20*time.Millisecond, func() { restarts.Add(1) })
	redistest.Eventually(t, 5*time.Second, "the watch read the server", func() bool { return o.RunIDChecks() > 0 })
	ctx := context.Background()
	if err := srv.Client().Do(ctx, "REPLICAOF", "127.0.0.1", other.Port()).Err(); err != nil {
		t.Fatal(err)
	}
	var lastErr error
	cold := 0
	redistest.EventuallyShow(t, 10*time.Second, "both breakers open on READONLY", func() (bool, string) {
		cold++
		if err := requestRead(o, key(fmt.Sprint("cold", cold)), seq); err != nil && !errors.Is(err, ErrBreakerOpen) {
			lastErr = err
		}
		if _, err := flush(9); err != nil && !errors.Is(err, ErrBreakerOpen) {
			lastErr = err
		}
		st := o.Stats().Endpoints[0]
		return st.Breaker == BreakerOpen && st.ReplayBreaker == BreakerOpen,
			fmt.Sprintf("breakers %s/%s, last error %v", st.Breaker, st.ReplayBreaker, lastErr)
	})
	if lastErr == nil || !strings.Contains(lastErr.Error(), "READONLY") {
		t.Fatalf("the errors do not name READONLY: %v", lastErr)
	}
	redistest.Eventually(t, 10*time.Second, "the replica synced", func() bool {
		info, err := srv.Client().Info(ctx, "replication").Result()
		return err == nil && strings.Contains(info, "master_link_status:up")
	})
	if err := srv.Client().Do(ctx, "REPLICAOF", "NO", "ONE").Err(); err != nil {
		t.Fatal(err)
	}
	awaitRecovery(t, o, k, seq, flush, 9)
	if got, err := cellTotal(ctx, srv.Client(), DefaultPrefix, k, seq); err != nil || got != 9 {
		t.Fatalf("Redis holds %d (%v), want the 9 units", got, err)
	}
	// Its sync with the other server replaced what it held (the 5 units
	// above are gone, and the 9 came back whole): the counts of
	// keys no node writes again are gone, as after a restart, and the
	// watch, which saw its mark gone, has the nodes send them again.
	redistest.Eventually(t, 5*time.Second, "the lost counts seen as a restart", func() bool { return restarts.Load() > 0 })
}

// TestBreaker_ABusyRedisOpensItAndRecoversAfterSCRIPTKILL: another
// client's script runs past busy-reply-threshold, and Redis answers
// every other command with BUSY until it ends or is killed. Each call
// fails at once (no added latency), both breakers open, the units wait,
// and after SCRIPT KILL the breakers close by themselves and the units
// arrive.
func TestBreaker_ABusyRedisOpensItAndRecoversAfterSCRIPTKILL(t *testing.T) {
	srv := redistest.Start(t, redistest.WithArgs("--lua-time-limit", "20"))
	cfg := Config{Redis: []string{srv.URL()}, Breaker: BreakerConfig{Timeout: Duration(200 * time.Millisecond)}}
	o := newOrigin(t, cfg, Options{NodeID: "busy"})
	k, seq := key("xavier"), nowSeq()
	flush := oneCellFlush(t, o, k, seq)
	if b, err := flush(2); err != nil || !b[0].Done {
		t.Fatalf("healthy flush: %v", err)
	}
	looping := srv.Client()
	ended := make(chan error, 1)
	go func() { ended <- looping.Eval(context.Background(), "while true do end", nil).Err() }()
	admin := srv.Client()
	redistest.Eventually(t, 10*time.Second, "Redis answers BUSY", func() bool {
		return redis.HasErrorPrefix(admin.Ping(context.Background()).Err(), "BUSY")
	})
	var lastErr error
	redistest.EventuallyShow(t, 10*time.Second, "both breakers open on BUSY", func() (bool, string) {
		start := time.Now()
		if err := requestRead(o, k, seq); err != nil && !errors.Is(err, ErrBreakerOpen) {
			lastErr = err
		}
		if took := time.Since(start); took > engine.DefaultReadTimeout {
			t.Fatalf("a read of a busy Redis took %s", took)
		}
		if b, err := flush(7); b[0].Done {
			t.Fatalf("a flush to a busy Redis was done: %v", err)
		}
		st := o.Stats().Endpoints[0]
		return st.Breaker == BreakerOpen && st.ReplayBreaker == BreakerOpen,
			fmt.Sprintf("breakers %s/%s, last error %v", st.Breaker, st.ReplayBreaker, lastErr)
	})
	if !strings.Contains(fmt.Sprint(lastErr), "BUSY") {
		t.Fatalf("the errors do not name BUSY: %v", lastErr)
	}
	if err := admin.ScriptKill(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	<-ended
	awaitRecovery(t, o, k, seq, flush, 7)
}

// TestBreaker_APasswordSetMidRunOpensItAndSaysWhy: an operator sets
// requirepass on the running Redis. The connections already
// authenticated keep working; once they are gone (CLIENT KILL, a
// restart of the pool), every new one is refused with NOAUTH: both
// breakers open, the status says NOAUTH, and when the password is lifted
// (or the node reloaded with it) the breakers close by themselves and
// the units held arrive.
func TestBreaker_APasswordSetMidRunOpensItAndSaysWhy(t *testing.T) {
	srv := redistest.Start(t)
	cfg := Config{Redis: []string{srv.URL()}, Breaker: BreakerConfig{Timeout: Duration(200 * time.Millisecond)}}
	o := newOrigin(t, cfg, Options{NodeID: "pw"})
	k, seq := key("yvonne"), nowSeq()
	flush := oneCellFlush(t, o, k, seq)
	if b, err := flush(2); err != nil || !b[0].Done {
		t.Fatalf("healthy flush: %v", err)
	}
	ctx := context.Background()
	admin := srv.Client()
	if err := admin.ConfigSet(ctx, "requirepass", "s3cret-set-mid-run").Err(); err != nil {
		t.Fatal(err)
	}
	if b, err := flush(3); err != nil || !b[0].Done {
		t.Fatalf("a connection authenticated before the password was set: %v", err)
	}
	if err := admin.Do(ctx, "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes").Err(); err != nil {
		t.Fatal(err)
	}
	redistest.EventuallyShow(t, 10*time.Second, "both breakers open on NOAUTH", func() (bool, string) {
		_ = requestRead(o, k, seq)
		_, _ = flush(7)
		st := o.Stats().Endpoints[0]
		return st.Breaker == BreakerOpen && st.ReplayBreaker == BreakerOpen && strings.Contains(st.LastError, "NOAUTH"),
			fmt.Sprintf("breakers %s/%s, last error %q", st.Breaker, st.ReplayBreaker, st.LastError)
	})
	if st := o.Stats().Endpoints[0]; strings.Contains(st.LastError, "s3cret") {
		t.Fatalf("the status shows the password: %q", st.LastError)
	}
	if err := admin.ConfigSet(ctx, "requirepass", "").Err(); err != nil {
		t.Fatal(err)
	}
	awaitRecovery(t, o, k, seq, flush, 7)
}

// TestBreaker_APasswordKeepsItOpenThroughItsProbes: to a client that has
// not authenticated, Redis answers a command of more than ten arguments
// "ERR Protocol error: unauthenticated multibulk length" (and closes the
// connection), not NOAUTH. A replay batch is such a command: the
// breaker took that reply for one key's error, so its probe passed, it
// closed, and it stayed closed while every flush failed, each on a new
// connection (an audit: about 235 connections a second from three idle
// nodes). That reply says the server refused the client, whatever the
// key: the breaker stays open through its probes.
func TestBreaker_APasswordKeepsItOpenThroughItsProbes(t *testing.T) {
	srv := redistest.Start(t)
	var states stateLog
	cfg := Config{Redis: []string{srv.URL()}, Breaker: BreakerConfig{Timeout: Duration(100 * time.Millisecond)}}
	o := newOrigin(t, cfg, Options{NodeID: "pw-probe", OnStateChange: states.hook})
	seq := nowSeq()
	batch := make([]engine.Delta, 12)
	for i := range batch {
		batch[i] = engine.Delta{Key: key(fmt.Sprint("probe", i)), Sequence: seq, Delta: 1, Own: 1}
	}
	if err := o.Flush(ctxT(t), batch); err != nil {
		t.Fatalf("healthy flush: %v", err)
	}
	ctx := context.Background()
	admin := srv.Client()
	if err := admin.ConfigSet(ctx, "requirepass", "s3cret-probed").Err(); err != nil {
		t.Fatal(err)
	}
	if err := admin.Do(ctx, "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes").Err(); err != nil {
		t.Fatal(err)
	}
	redistest.Eventually(t, 10*time.Second, "the replay breaker open", func() bool {
		_ = o.Flush(ctxT(t), batch)
		return o.Stats().Endpoints[0].ReplayBreaker == BreakerOpen
	})
	// Ten probes' worth of flushes, as replay's ticks send them.
	for end := time.Now().Add(time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		_ = o.Flush(ctxT(t), batch)
	}
	if seen := states.transitions(ReplayBreakerName); slices.Contains(seen, "half-open>closed") {
		t.Fatalf("the replay breaker closed on a probe refused for want of a password: %v", seen)
	}
}

// TestBreaker_KilledConnectionsCostNoCall: CLIENT KILL of every
// connection of the module, again and again between calls (an operator
// cleaning up, a proxy recycling): the pool notices a closed connection
// before it uses it, so no call fails and no breaker moves.
func TestBreaker_KilledConnectionsCostNoCall(t *testing.T) {
	srv := redistest.Start(t)
	var states stateLog
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "kill", OnStateChange: states.hook})
	admin := srv.Client()
	seq := nowSeq()
	for i := range 200 {
		if i%5 == 0 {
			if err := admin.Do(context.Background(), "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes").Err(); err != nil {
				t.Fatal(err)
			}
		}
		if err := requestRead(o, key(fmt.Sprint("k", i%7)), seq); err != nil {
			t.Fatalf("read %d after CLIENT KILL: %v", i, err)
		}
		b := []engine.Delta{{Key: key("w"), Sequence: seq, Delta: 1, Own: int64(i + 1)}}
		if err := o.Flush(ctxT(t), b); err != nil || !b[0].Done {
			t.Fatalf("flush %d after CLIENT KILL: %v", i, err)
		}
	}
	if st := o.Stats().Endpoints[0]; st.Breaker != BreakerClosed || st.ReplayBreaker != BreakerClosed || len(states.transitions(BreakerName)) > 0 {
		t.Fatalf("breakers %s/%s, transitions %v", st.Breaker, st.ReplayBreaker, states.transitions(BreakerName))
	}
}

// TestBreaker_NOREPLICASOpensItAndRecovers: min-replicas-to-write with
// too few replicas in sync makes Redis refuse every write with
// NOREPLICAS, from inside the script as READONLY does: both breakers
// open and the status names it (it was once "refused cells", breakers
// closed), and they close by themselves when Redis takes writes again.
func TestBreaker_NOREPLICASOpensItAndRecovers(t *testing.T) {
	srv := redistest.Start(t)
	cfg := Config{Redis: []string{srv.URL()}, Breaker: BreakerConfig{Timeout: Duration(200 * time.Millisecond)}}
	o := newOrigin(t, cfg, Options{NodeID: "norep"})
	k, seq := key("zelda"), nowSeq()
	flush := oneCellFlush(t, o, k, seq)
	ctx := context.Background()
	admin := srv.Client()
	if err := admin.ConfigSet(ctx, "min-replicas-to-write", "1").Err(); err != nil {
		t.Fatal(err)
	}
	redistest.EventuallyShow(t, 10*time.Second, "both breakers open on NOREPLICAS", func() (bool, string) {
		_ = requestRead(o, key(fmt.Sprint("cold", time.Now().UnixNano())), seq)
		_, _ = flush(4)
		st := o.Stats().Endpoints[0]
		return st.Breaker == BreakerOpen && st.ReplayBreaker == BreakerOpen && strings.Contains(st.LastError, "NOREPLICAS"),
			fmt.Sprintf("breakers %s/%s, last error %q", st.Breaker, st.ReplayBreaker, st.LastError)
	})
	if err := admin.ConfigSet(ctx, "min-replicas-to-write", "0").Err(); err != nil {
		t.Fatal(err)
	}
	awaitRecovery(t, o, k, seq, flush, 4)
}

// oneCellFlush returns a flush of k's cell seq carrying own as this
// process's total, and the batch it sent.
func oneCellFlush(t *testing.T, o *Redis, k engine.Key, seq int64) func(own int64) ([]engine.Delta, error) {
	return func(own int64) ([]engine.Delta, error) {
		b := []engine.Delta{{Key: k, Sequence: seq, Delta: 1, Own: own}}
		return b, o.Flush(ctxT(t), b)
	}
}

// awaitRecovery waits until both of o's breakers have closed by
// themselves: a flush of own lands (Redis then holds own for k) and a
// read of k passes.
func awaitRecovery(t *testing.T, o *Redis, k engine.Key, seq int64, flush func(int64) ([]engine.Delta, error), own int64) {
	t.Helper()
	redistest.EventuallyShow(t, 10*time.Second, "the units arrive and the breakers close", func() (bool, string) {
		b, err := flush(own)
		rerr := requestRead(o, k, seq)
		st := o.Stats().Endpoints[0]
		return b[0].Done && b[0].Totals.Cur == own && rerr == nil && st.Breaker == BreakerClosed && st.ReplayBreaker == BreakerClosed,
			fmt.Sprintf("flush %v, read %v, breakers %s/%s", err, rerr, st.Breaker, st.ReplayBreaker)
	})
}

// TestBreaker_ReadingTheStateMovesNoBreaker: with no calls, an open
// breaker stays open for the status and the metrics however long they
// read it, Redis down or back, until a call comes to probe. The status
// once asked gobreaker for the state, which moves an open breaker whose
// timeout passed to half-open: every scrape of an idle node then turned
// both breakers half-open (and the log said "half-open: probing") with
// Redis still down and nothing probing, and they stayed so until a call.
func TestBreaker_ReadingTheStateMovesNoBreaker(t *testing.T) {
	srv := redistest.Start(t)
	var states stateLog
	timeout := 200 * time.Millisecond
	cfg := Config{Redis: []string{srv.URL()}, Breaker: BreakerConfig{Timeout: Duration(timeout)}}
	o := newOrigin(t, cfg, Options{OnStateChange: states.hook})
	k, seq := key("dora"), nowSeq()
	read := func() error { return requestRead(o, k, seq) }
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
	idle := func(what string) {
		t.Helper()
		// The state must hold for longer than the breaker's timeout with
		// nothing but reads of it: there is no event to await.
		for end := time.Now().Add(3 * timeout); time.Now().Before(end); time.Sleep(timeout / 4) {
			if st := o.Stats().Endpoints[0]; st.Breaker != BreakerOpen || st.ReplayBreaker != BreakerOpen {
				t.Fatalf("%s, with no call: request path %s, replay %s; want both open", what, st.Breaker, st.ReplayBreaker)
			}
		}
	}
	idle("Redis down")
	srv.Restart()
	idle("Redis back")
	for _, name := range []string{BreakerName, ReplayBreakerName} {
		if seen := states.transitions(name); slices.Contains(seen, "open>half-open") {
			t.Fatalf("%s went half-open with no call: %v", name, seen)
		}
	}
	// The first calls probe and close them.
	redistest.Eventually(t, 10*time.Second, "both breakers close", func() bool {
		_ = read()
		_ = flush()
		st := o.Stats().Endpoints[0]
		return st.Breaker == BreakerClosed && st.ReplayBreaker == BreakerClosed
	})
}

// TestBreaker_ClosesOnceTheRestartWatchHearsRedisAgain: an open breaker
// waited out its timeout (breaker_timeout, 5 s by default) before a call
// probed Redis, whatever else had heard it answer since: a Redis killed
// and started again half a second later left each node deciding alone
// for 5 s (an audit: 184 admitted in a window of 100, three nodes at 30
// requests a second), though the restart watch had read the new server
// at the next slow tick. An answer to the watch that began after the
// breaker opened, and came within its slow-call threshold, closes it.
func TestBreaker_ClosesOnceTheRestartWatchHearsRedisAgain(t *testing.T) {
	srv := redistest.Start(t)
	var states stateLog
	cfg := Config{Redis: []string{srv.URL()}, Breaker: BreakerConfig{Timeout: Duration(MaxBreakerTimeout)}}
	o := newOrigin(t, cfg, Options{NodeID: "heard", OnStateChange: states.hook})
	k, seq := key("heard"), nowSeq()
	if err := requestRead(o, k, seq); err != nil {
		t.Fatal(err)
	}
	o.WatchRestarts(20*time.Millisecond, func() {})
	srv.Stop()
	openBoth(t, o, k, seq)
	srv.Restart()
	// No call goes through either breaker meanwhile: only the watch hears
	// Redis. Their timeout is ten minutes.
	redistest.Eventually(t, 5*time.Second, "both breakers closed", func() bool {
		st := o.Stats().Endpoints[0]
		return st.Breaker == BreakerClosed && st.ReplayBreaker == BreakerClosed
	})
	if err := requestRead(o, k, seq); err != nil {
		t.Fatalf("a read once the breakers closed: %v", err)
	}
	redistest.Eventually(t, time.Second, "the closing reported", func() bool {
		seen := states.transitions(BreakerName)
		return len(seen) >= 2 && seen[0] == "closed>open" && seen[len(seen)-1] == "open>closed"
	})
}

// TestBreaker_TheWatchClosesItAfterItsTimeoutPassed: on an idle node an
// outage longer than breaker_timeout leaves the breakers open with their
// timeout passed and no call to probe. The watch asked gobreaker for the
// state before closing one, which moved it to half-open instead (and
// logged "half-open: probing" with nothing probing): the request path's
// breaker then showed half-open until the next request. The watch's
// answer closes it, with no half-open between.
func TestBreaker_TheWatchClosesItAfterItsTimeoutPassed(t *testing.T) {
	srv := redistest.Start(t)
	var states stateLog
	timeout := 100 * time.Millisecond
	cfg := Config{Redis: []string{srv.URL()}, Breaker: BreakerConfig{Timeout: Duration(timeout)}}
	o := newOrigin(t, cfg, Options{NodeID: "idle", OnStateChange: states.hook})
	k, seq := key("idle"), nowSeq()
	o.WatchRestarts(20*time.Millisecond, func() {})
	srv.Stop()
	openBoth(t, o, k, seq)
	ep := o.endpoints[0]
	redistest.Eventually(t, 5*time.Second, "both breakers' timeout passed", func() bool {
		last := max(ep.requests.openedAt.Load(), ep.replay.openedAt.Load())
		return time.Since(time.Unix(0, last)) > 2*timeout
	})
	// Opening them took calls, which may have probed: only what comes
	// after counts.
	before := map[string]int{}
	for _, name := range []string{BreakerName, ReplayBreakerName} {
		before[name] = len(states.transitions(name))
	}
	srv.Restart()
	// No call goes through either breaker: only the watch hears Redis.
	redistest.Eventually(t, 5*time.Second, "both breakers closed", func() bool {
		st := o.Stats().Endpoints[0]
		return st.Breaker == BreakerClosed && st.ReplayBreaker == BreakerClosed
	})
	for _, name := range []string{BreakerName, ReplayBreakerName} {
		redistest.Eventually(t, time.Second, name+"'s closing reported", func() bool {
			return slices.Contains(states.transitions(name)[before[name]:], "open>closed")
		})
		if seen := states.transitions(name)[before[name]:]; !slices.Equal(seen, []string{"open>closed"}) {
			t.Fatalf("%s once Redis was back, with no call: %v, want open>closed", name, seen)
		}
	}
}

// TestBreaker_ASlowAnswerOutsideItLeavesItOpen: the watch's answer closes
// the request path's breaker only within its slow-call threshold (a
// Redis answering slowly opened it, and would again at once), and only an
// answer that began after it opened (one in flight through the outage
// says nothing of Redis since).
func TestBreaker_ASlowAnswerOutsideItLeavesItOpen(t *testing.T) {
	srv := redistest.Start(t)
	cfg := Config{Redis: []string{srv.URL()}, Breaker: BreakerConfig{Timeout: Duration(MaxBreakerTimeout), SlowCall: Duration(10 * time.Millisecond)}}
	o := newOrigin(t, cfg, Options{NodeID: "slowly"})
	k, seq := key("slowly"), nowSeq()
	before := time.Now()
	srv.Stop()
	redistest.Eventually(t, 10*time.Second, "the request path's breaker open", func() bool {
		_ = requestRead(o, k, seq)
		return o.Stats().Endpoints[0].Breaker == BreakerOpen
	})
	b := o.endpoints[0].requests
	b.answeredOutside(time.Now(), 50*time.Millisecond)
	b.answeredOutside(before, time.Millisecond)
	if st := b.reported(); st != BreakerOpen {
		t.Fatalf("after a slow answer and one that began before it opened, the breaker is %s, want open", st)
	}
	b.answeredOutside(time.Now(), time.Millisecond)
	if st := b.reported(); st != BreakerClosed {
		t.Fatalf("after a quick answer that began after it opened, the breaker is %s, want closed", st)
	}
}

// TestBreaker_ARefusingRedisAnsweringTheWatchStaysOpen: a server that
// refuses the limiter's calls with a reply (a replica's READONLY here;
// NOPERM, MISCONF, scripts refused alike) answers the restart watch all
// the same. That answer says nothing of the refusal: the breakers stay
// open for the probe at breaker_timeout, rather than closing at every
// slow tick to fail five calls and open again, with a warning each time.
func TestBreaker_ARefusingRedisAnsweringTheWatchStaysOpen(t *testing.T) {
	srv, other := redistest.Start(t), redistest.Start(t)
	cfg := Config{Redis: []string{srv.URL()}, Breaker: BreakerConfig{Timeout: Duration(MaxBreakerTimeout)}}
	o := newOrigin(t, cfg, Options{NodeID: "refused"})
	k, seq := key("refused"), nowSeq()
	flush := oneCellFlush(t, o, k, seq)
	o.WatchRestarts(20*time.Millisecond, func() {})
	ctx := context.Background()
	if err := srv.Client().Do(ctx, "REPLICAOF", "127.0.0.1", other.Port()).Err(); err != nil {
		t.Fatal(err)
	}
	cold := 0
	redistest.Eventually(t, 10*time.Second, "both breakers open on READONLY", func() bool {
		cold++
		_ = requestRead(o, key(fmt.Sprint("cold", cold)), seq)
		_, _ = flush(9)
		st := o.Stats().Endpoints[0]
		return st.Breaker == BreakerOpen && st.ReplayBreaker == BreakerOpen
	})
	checks := o.RunIDChecks()
	redistest.Eventually(t, 5*time.Second, "the watch read the server three times more", func() bool { return o.RunIDChecks() >= checks+3 })
	if st := o.Stats().Endpoints[0]; st.Breaker != BreakerOpen || st.ReplayBreaker != BreakerOpen {
		t.Fatalf("breakers %s/%s after the watch heard a server that refuses writes, want both open", st.Breaker, st.ReplayBreaker)
	}
}

// TestBreaker_TheWatchClosesItOnceTheProcessHeardTheRegion: a node that
// held units through an outage writes them once it heard the resets made
// meanwhile, which take them off (Options.HeardRegion): until it heard
// the region after the breakers opened, the watch's answer leaves them
// open.
func TestBreaker_TheWatchClosesItOnceTheProcessHeardTheRegion(t *testing.T) {
	srv := redistest.Start(t)
	var heard atomic.Int64
	cfg := Config{Redis: []string{srv.URL()}, Breaker: BreakerConfig{Timeout: Duration(MaxBreakerTimeout)}}
	o := newOrigin(t, cfg, Options{NodeID: "hears", HeardRegion: func() time.Time { return time.Unix(0, heard.Load()) }})
	k, seq := key("hears"), nowSeq()
	heard.Store(time.Now().UnixNano()) // before the outage
	srv.Stop()
	openBoth(t, o, k, seq)
	srv.Restart()
	o.WatchRestarts(20*time.Millisecond, func() {})
	checks := o.RunIDChecks()
	redistest.Eventually(t, 5*time.Second, "the watch read the server three times", func() bool { return o.RunIDChecks() >= checks+3 })
	if st := o.Stats().Endpoints[0]; st.Breaker != BreakerOpen || st.ReplayBreaker != BreakerOpen {
		t.Fatalf("breakers %s/%s before the process heard the region since they opened, want both open", st.Breaker, st.ReplayBreaker)
	}
	heard.Store(time.Now().UnixNano())
	redistest.Eventually(t, 5*time.Second, "both breakers closed once it heard the region", func() bool {
		st := o.Stats().Endpoints[0]
		return st.Breaker == BreakerClosed && st.ReplayBreaker == BreakerClosed
	})
}

// openBoth reads and writes k through o, whose Redis is down, until both
// breakers are open.
func openBoth(t *testing.T, o *Redis, k engine.Key, seq int64) {
	t.Helper()
	redistest.Eventually(t, 10*time.Second, "both breakers open", func() bool {
		_ = requestRead(o, k, seq)
		_ = o.Flush(ctxT(t), []engine.Delta{{Key: k, Sequence: seq, Delta: 1, Own: 1}})
		st := o.Stats().Endpoints[0]
		return st.Breaker == BreakerOpen && st.ReplayBreaker == BreakerOpen
	})
}
