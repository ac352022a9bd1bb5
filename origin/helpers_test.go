package origin

import (
	"context"
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

// reservation is a reservation of cost at limit, carrying own.
func reservation(k engine.Key, seq, own, cost, limit int64) *engine.Reservation {
	return &engine.Reservation{Key: k, Sequence: seq, Own: own, Cost: cost, Limit: limit}
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
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = n.e.Close(ctx)
	})
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

// windowStart returns the start of the next window after the real clock:
// the simulation runs in the near future so PEXPIREAT keeps its keys.
func windowStart(w time.Duration) int64 {
	wms := w.Milliseconds()
	return (time.Now().UnixMilli()/wms + 1) * wms
}

// windowClock is a simulated clock at windowStart(w), and that start in
// Unix milliseconds.
func windowClock(w time.Duration) (*testclock.Clock, int64) {
	start := windowStart(w)
	return testclock.New(time.UnixMilli(start)), start
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

// pipelineHook is a go-redis hook of pipelines only.
type pipelineHook func(redis.ProcessPipelineHook) redis.ProcessPipelineHook

func (pipelineHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (pipelineHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (h pipelineHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return h(next)
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

// logSink captures go-redis's own log lines.
type logSink struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (l *logSink) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func (l *logSink) printf(format string, v ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	fmt.Fprintf(&l.buf, format+"\n", v...)
}

// cpuTime is the CPU time this process has used, user and system.
func cpuTime(tb testing.TB) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// trunc shortens s for a failure message.
func trunc(s string) string {
	if len(s) > 40 {
		return s[:40] + "…"
	}
	return s
}
