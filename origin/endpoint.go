package origin

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// endpoint is one Redis deployment (a standalone partition, a Cluster or a
// Sentinel group) with its client, its two breakers and its counters.
type endpoint struct {
	r       *Redis
	address string
	kind    string
	seed    uint64
	client  redis.UniversalClient
	// sync guards the request path (reads and reservations): a call slower
	// than the slow-call threshold counts as a failure, so a slow Redis
	// stops costing requests latency just as a dead one does. replay guards
	// flushes and counts errors only, so a slow Redis still gets the counts.
	sync, replay *breaker

	calls      [numOps][numOutcomes]atomic.Uint64
	lastOK     [numOps]atomic.Int64 // unix nanoseconds
	roundTrips atomic.Uint64
	slowCalls  atomic.Uint64

	// Read batching (read.go): mu guards queue, drainers and closing; idle
	// is signalled when the last drainer leaves.
	mu       sync.Mutex
	idle     *sync.Cond
	queue    []*readReq
	drainers int
	closing  bool
}

// breaker is one gobreaker circuit breaker with its slow-call threshold
// (zero: errors only).
type breaker struct {
	cb   *gobreaker.CircuitBreaker[struct{}]
	slow time.Duration
	ep   *endpoint
}

// errSlowCall marks, for the breaker only, a call that succeeded too late.
var errSlowCall = errors.New("slow call")

// starvedError marks, for the breaker only, a call that timed out while
// this process was starved of CPU; the breaker excludes it.
type starvedError struct{ err error }

func (e starvedError) Error() string { return "timed out while starved: " + e.err.Error() }

// starvedTimeout is the scheduler latency (99th percentile) from which a
// timeout is taken for this process's own doing: a tenth of the least time
// a read pipeline gets (roundTripFloor).
const starvedTimeout = roundTripFloor / 10

func (ep *endpoint) newBreaker(name string, c BreakerConfig, slow time.Duration) *breaker {
	interval := time.Duration(c.Interval)
	minRequests := uint32(c.MinRequests)
	ratio := c.FailureRatio
	return &breaker{ep: ep, slow: slow, cb: gobreaker.NewCircuitBreaker[struct{}](gobreaker.Settings{
		Name:         name,
		MaxRequests:  halfOpenProbes,
		Interval:     interval,
		BucketPeriod: interval / breakerBuckets,
		Timeout:      time.Duration(c.Timeout),
		// A ratio over a minimum sample, counted per round trip: the herd of
		// cold reads at a window rollover shares a few batched round trips
		// (read.go) that succeed on a healthy Redis, and reads that merely
		// ran out of time waiting for a batch never reach the breaker.
		ReadyToTrip: func(n gobreaker.Counts) bool {
			done := n.TotalSuccesses + n.TotalFailures
			return done >= minRequests && float64(n.TotalFailures) >= ratio*float64(done)
		},
		IsSuccessful: func(err error) bool { return err == nil || !countsAgainst(err) },
		// A caller that gave up says nothing about Redis.
		IsExcluded: func(err error) bool {
			var starved starvedError
			return errors.Is(err, context.Canceled) || errors.As(err, &starved)
		},
		OnStateChange: func(name string, from, to gobreaker.State) {
			ep.r.emit(stateEvent{endpoint: ep.address, breaker: name, from: breakerState(from), to: breakerState(to)})
		},
	})}
}

// countsAgainst reports whether err says something about Redis's health. A
// command Redis refused for its own key (a wrong type, a value that is not
// a number, a script error) does not: one hostile key must not open the
// breaker of the region. Redis refusing work as a whole does.
func countsAgainst(err error) bool {
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		return true
	}
	for _, p := range []string{"LOADING", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "BUSY", "OOM", "NOAUTH", "WRONGPASS", "NOPERM"} {
		if redis.HasErrorPrefix(err, p) {
			return true
		}
	}
	return false
}

// open reports whether the breaker refuses calls right now (a cheap check
// before any work, so an open breaker costs a request nothing).
func (b *breaker) open() bool { return b.cb.State() == gobreaker.StateOpen }

// guard runs fn through the breaker, translating its refusals. A call that
// succeeded past the slow-call threshold counts as a failure for the
// breaker (unless this process was starved of CPU: starve.go), and as the
// success it was for the caller.
func (b *breaker) guard(fn func() error) error {
	_, err := b.cb.Execute(func() (struct{}, error) {
		start := time.Now()
		err := fn()
		switch {
		case err == nil && b.slow > 0 && time.Since(start) > b.slow && !sched.starved(b.slow/2):
			b.ep.slowCalls.Add(1)
			return struct{}{}, errSlowCall
		case err != nil && isTimeout(err) && sched.starved(starvedTimeout):
			// Out of time because this process could not run: says
			// nothing about Redis.
			return struct{}{}, starvedError{err}
		}
		return struct{}{}, err
	})
	var starved starvedError
	switch {
	case errors.As(err, &starved):
		return starved.err
	case errors.Is(err, errSlowCall):
		return nil
	case errors.Is(err, gobreaker.ErrOpenState), errors.Is(err, gobreaker.ErrTooManyRequests):
		return ErrBreakerOpen
	}
	return err
}

// record counts a finished call and reports it to OnCall.
func (ep *endpoint) record(op Op, err error, start time.Time, cells int) {
	o := classify(err)
	ep.calls[op][o].Add(1)
	now := time.Now()
	if o == OutcomeOK {
		ep.lastOK[op].Store(now.UnixNano())
	}
	if f := ep.r.opts.OnCall; f != nil {
		f(CallInfo{Endpoint: ep.address, Op: op, Outcome: o, Duration: now.Sub(start), Cells: cells})
	}
}

func (ep *endpoint) stats() EndpointStats {
	s := EndpointStats{
		Address:       ep.address,
		Kind:          ep.kind,
		Breaker:       breakerState(ep.sync.cb.State()),
		ReplayBreaker: breakerState(ep.replay.cb.State()),
		SlowCalls:     ep.slowCalls.Load(),
		Calls:         make(map[string]map[string]uint64, numOps),
		RoundTrips:    ep.roundTrips.Load(),
	}
	for op := Op(0); op < numOps; op++ {
		m := make(map[string]uint64, numOutcomes)
		for o := Outcome(0); o < numOutcomes; o++ {
			m[o.String()] = ep.calls[op][o].Load()
		}
		s.Calls[op.String()] = m
	}
	if ns := ep.lastOK[OpRead].Load(); ns != 0 {
		s.LastRead = time.Unix(0, ns)
	}
	if ns := ep.lastOK[OpFlush].Load(); ns != 0 {
		s.LastFlush = time.Unix(0, ns)
	}
	return s
}

// shutdown refuses new reads and waits for the read batches in flight.
func (ep *endpoint) shutdown() {
	ep.mu.Lock()
	ep.closing = true
	for ep.drainers > 0 {
		ep.idle.Wait()
	}
	ep.mu.Unlock()
}

// flushRecorded flushes the items idx of batch (all of them when idx is
// nil) to this endpoint, and counts the call.
func (ep *endpoint) flushRecorded(ctx context.Context, batch []engine.Delta, idx []int) error {
	start := time.Now()
	n := len(batch)
	if idx != nil {
		n = len(idx)
	}
	err := ep.flush(ctx, batch, idx)
	ep.record(OpFlush, err, start, n)
	if err != nil {
		return fmt.Errorf("redis flush %s (%d cells): %w", ep.address, n, err)
	}
	return nil
}
