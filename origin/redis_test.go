package origin

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
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
