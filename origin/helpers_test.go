package origin

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
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

// key is the key of id in the zone "api", one-minute window.
func key(id string) engine.Key {
	return engine.Key{Namespace: "api", Identifier: id, Window: time.Minute}
}

// nowSeq is the current sequence of a one-minute window.
func nowSeq() int64 { return time.Now().UnixMilli() / time.Minute.Milliseconds() }

// readPair reads the totals of a cell and the one before it.
func readPair(o *Redis, ctx context.Context, k engine.Key, seq int64) (cur, prev int64, err error) {
	t, err := o.Read(ctx, k, seq, 0)
	return t.Cur, t.Prev, err
}

// requestRead reads the cell (k, seq) within the engine's default read
// timeout, as a request's read would.
func requestRead(o *Redis, k engine.Key, seq int64) error {
	ctx, cancel := context.WithTimeout(context.Background(), engine.DefaultReadTimeout)
	defer cancel()
	_, err := o.Read(ctx, k, seq, 0)
	return err
}

// reservation is a reservation of cost at limit, carrying own.
func reservation(k engine.Key, seq, own, cost, limit int64) *engine.Reservation {
	return &engine.Reservation{Key: k, Sequence: seq, Own: own, Cost: cost, Limit: limit}
}

// stateLog records the breakers' state changes as OnStateChange reports
// them.
type stateLog struct {
	mu     sync.Mutex
	events []stateEvent
}

// hook is the OnStateChange that records.
func (l *stateLog) hook(endpoint, breaker string, from, to BreakerState) {
	l.mu.Lock()
	l.events = append(l.events, stateEvent{endpoint: endpoint, breaker: breaker, from: from, to: to})
	l.mu.Unlock()
}

// transitions returns the state changes of the breaker name so far, as
// "closed>open".
func (l *stateLog) transitions(name string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, ev := range l.events {
		if ev.breaker == name {
			out = append(out, string(ev.from)+">"+string(ev.to))
		}
	}
	return out
}

// endpoints returns the endpoint that each state change so far names.
func (l *stateLog) endpoints() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]string, len(l.events))
	for i, ev := range l.events {
		out[i] = ev.endpoint
	}
	return out
}

// validateCase is a configuration and the error Validate must give it.
type validateCase struct {
	name    string
	cfg     Config
	wantErr string // empty: valid
}

// checkValidate runs Validate on each case, as a subtest of its name.
func checkValidate(t *testing.T, cases []validateCase) {
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate()
			switch {
			case tc.wantErr == "" && err != nil:
				t.Fatalf("Validate: %v", err)
			case tc.wantErr != "" && err == nil:
				t.Fatalf("Validate accepted it; want an error containing %q", tc.wantErr)
			case tc.wantErr != "" && !strings.Contains(err.Error(), tc.wantErr):
				t.Fatalf("Validate: %v; want it to contain %q", err, tc.wantErr)
			}
		})
	}
}

// nodesMade numbers the simulated nodes, for their IDs.
var nodesMade atomic.Int64

// node is one simulated Caddy process: an engine with its own origin.
type node struct {
	e *engine.Engine
	o *Redis
	// flushedCells counts cells the origin flushed successfully.
	flushedCells atomic.Int64
}

// newNode makes a simulated process on the Redis at url, on clock.
func newNode(t *testing.T, url string, clock *testclock.Clock) *node {
	t.Helper()
	n := &node{}
	n.o = newOrigin(t, Config{Redis: []string{url}}, Options{NodeID: t.Name() + fmt.Sprint(nodesMade.Add(1)), OnCall: func(c CallInfo) {
		if c.Op == OpFlush && c.Outcome == OutcomeOK {
			n.flushedCells.Add(int64(c.Cells))
		}
	}})
	n.e = engine.New(engine.Config{Now: clock.Now})
	n.e.SetOrigin(n.o)
	closeAtCleanup(t, n.e, 5*time.Second)
	return n
}

// tick runs the replay ticks due at simulated millisecond ms, as the
// engine's loop would: fast every 10 ms, slow every 100 ms.
func (n *node) tick(t *testing.T, ms int64) {
	ctx := context.Background()
	if ms%engine.DefaultFastTick.Milliseconds() == 0 {
		if _, err := n.e.ReplayOnce(ctx, engine.Fast); err != nil {
			t.Fatalf("fast replay: %v", err)
		}
	}
	if ms%engine.DefaultSlowTick.Milliseconds() == 0 {
		if _, err := n.e.ReplayOnce(ctx, engine.Slow); err != nil {
			t.Fatalf("slow replay: %v", err)
		}
	}
}

// closeAtCleanup closes e when the test ends, waiting at most within for
// its last replay.
func closeAtCleanup(t *testing.T, e *engine.Engine, within time.Duration) {
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), within)
		defer cancel()
		_ = e.Close(ctx)
	})
}

// windowStart returns the start of the next window after the real clock:
// the simulation runs in the near future so PEXPIREAT keeps its keys.
func windowStart(w time.Duration) int64 {
	wms := w.Milliseconds()
	return (time.Now().UnixMilli()/wms + 1) * wms
}

// cpuTime is the CPU time this process has used, user and system.
func cpuTime(tb testing.TB) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// cellTotal reads the region's total of the cell (key, seq): field t of
// its hash, 0 when there is none.
func cellTotal(ctx context.Context, c redis.Cmdable, prefix string, k engine.Key, seq int64) (int64, error) {
	v, err := c.HGet(ctx, cellKey(prefix, k, seq), "t").Int64()
	if errors.Is(err, redis.Nil) {
		return 0, nil
	}
	return v, err
}

// setCellTotal sets the region's total of the cell (key, seq), as another
// process's units there would.
func setCellTotal(ctx context.Context, c redis.Cmdable, prefix string, k engine.Key, seq int64, v any) error {
	return c.HSet(ctx, cellKey(prefix, k, seq), "t", v).Err()
}
