package origin

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

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
	got, err := srv.Client().HGet(ctxT(t), "ratelimit:{api:alice}:60000:"+fmt.Sprint(seq)+":c", "t").Int64()
	if err != nil || got != 10 {
		t.Fatalf("HGET t of the documented key = %d, %v; want 10", got, err)
	}

	st := o.Stats().Endpoints[0]
	if st.Calls["read"]["ok"] != 2 || st.Calls["flush"]["ok"] != 1 || st.LastRead.IsZero() || st.LastFlush.IsZero() {
		t.Fatalf("stats after 2 reads and 1 flush: %+v", st)
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

// TestClose_LeavesNoGoroutine closes an origin that has read, flushed,
// tripped its breaker and reported it, and checks that every goroutine it
// or its client started ends: a config reload must not leak.
// TestClose_WaitsForTheReservationsAndWritesInFlight: a reload closes
// the old config's origin while the engine may be in a call it began on
// it. Close cut them: a reservation that Redis ran came back as "client
// is closed", the engine decided the request again locally, and near the
// limit denied it while Redis kept its cost (1 to 4 units over in every
// run of TestConcurrency_EveryUnitReachesRedisOrIsCountedAsLost with
// reloads); and every reload counted failed calls that had not failed.
// Close now waits for them as it waits for the read batches, each within
// its own deadline (a second at most).
func TestClose_WaitsForTheReservationsAndWritesInFlight(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "r"})
	k, seq := key("ivy"), nowSeq()
	// Dialled, and the scripts loaded: each call below is one round trip.
	if err := o.Reserve(ctxT(t), reservation(k, seq, 0, 1, 10)); err != nil {
		t.Fatal(err)
	}
	if err := o.Flush(ctxT(t), []engine.Delta{{Key: key("jay"), Sequence: seq, Delta: 1, Own: 1}}); err != nil {
		t.Fatal(err)
	}
	srv.Pause() // the calls below wait in Redis's socket
	paused := true
	defer func() {
		if paused {
			srv.Resume()
		}
	}()
	ep := o.endpoints[0]
	inFlight := func() (writes int, closing bool) {
		ep.mu.Lock()
		defer ep.mu.Unlock()
		return ep.writes, ep.closing
	}
	r := reservation(k, seq, 1, 2, 10)
	d := []engine.Delta{{Key: key("jay"), Sequence: seq, Delta: 2, Own: 3}}
	var resErr, flushErr error
	var calls sync.WaitGroup
	calls.Go(func() { resErr = o.Reserve(context.Background(), r) })
	calls.Go(func() { flushErr = o.Flush(context.Background(), d) })
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		if n, _ := inFlight(); n == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the reservation and the flush never went out")
		}
	}
	closed := make(chan error, 1)
	go func() { closed <- o.Close() }()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		if _, closing := inFlight(); closing {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("Close never began")
		}
	}
	// Close must not end while both wait on the paused Redis: a bounded
	// wait for what must not happen.
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) with a reservation and a flush in flight", err)
	case <-time.After(200 * time.Millisecond):
	}
	srv.Resume()
	paused = false
	calls.Wait()
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	if resErr != nil || !r.Admitted || r.Totals.Cur != 3 {
		t.Fatalf("reservation cut by Close: admitted %v, Redis total %d, %v; want admitted at 3", r.Admitted, r.Totals.Cur, resErr)
	}
	if flushErr != nil || d[0].Totals.Cur != 3 {
		t.Fatalf("flush cut by Close: Redis total %d, %v; want 3", d[0].Totals.Cur, flushErr)
	}
	if err := o.Reserve(ctxT(t), reservation(k, seq, 3, 1, 10)); !errors.Is(err, ErrClosed) {
		t.Fatalf("a reservation after Close: %v, want ErrClosed", err)
	}
}

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

func TestNew_DoesNotDial(t *testing.T) {
	// Nothing listens on port 1; New must succeed anyway (Caddy's validate
	// provisions without a network), and Close must not hang.
	o, err := New(Config{Redis: []string{"redis://127.0.0.1:1"}}, Options{})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if err := o.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
}

func TestString_NamesAddressesNeverCredentials(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{Redis: []string{"redis://u:pw1@a:1/2", "rediss://:pw2@b:3"}}, "redis origin [redis://a:1/2 rediss://b:3/0]"},
		{Config{Cluster: &ClusterConfig{Addrs: []string{"rediss://:pw3@a:1", "b:2"}}}, "redis origin [rediss+cluster://a:1,b:2]"},
		{Config{Sentinel: &SentinelConfig{Master: "m", Addrs: []string{"redis://:pw4@a:1/5"}, SentinelPassword: "pw5"}},
			"redis origin [redis+sentinel://m@a:1/5]"},
	} {
		o, err := New(tc.cfg, Options{})
		if err != nil {
			t.Fatal(err)
		}
		if got := o.String(); got != tc.want || strings.Contains(got, "pw") {
			t.Errorf("String() = %q, want %q", got, tc.want)
		}
		_ = o.Close()
	}
}
