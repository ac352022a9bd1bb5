package origin

import (
	"context"
	"crypto/x509"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// endpoint is one Redis deployment (a standalone partition, a Cluster or a
// Sentinel group) with its client, its two breakers and its counters.
type endpoint struct {
	r       *Redis
	address string
	kind    string
	seed    uint64 // placement (route.go)
	client  redis.UniversalClient
	// requests guards the request path (reads and reservations): a call
	// slower than the slow-call threshold counts as a failure, so a slow
	// Redis stops costing requests latency just as a dead one does. replay
	// guards flushes and counts errors only, so a slow Redis still gets
	// the counts.
	requests, replay *breaker
	// callTimeout bounds a request-path call (see callTimeout).
	callTimeout time.Duration

	calls      [numOps][numOutcomes]atomic.Uint64
	lastOK     [numOps]atomic.Int64 // unix nanoseconds
	roundTrips atomic.Uint64
	slowCalls  atomic.Uint64
	// lastErr is the last failed call's error, for Stats.
	lastErr atomic.Pointer[callError]

	// Read batching (read.go): mu guards queue, batchers, writes and
	// closing; idle is signalled when the last batcher or write leaves.
	mu       sync.Mutex
	idle     *sync.Cond
	queue    []*readReq
	batchers int
	// writes counts the reservations and flushes in flight (begin), which
	// Close waits for as it waits for the read batches.
	writes  int
	closing bool
}

// newEndpoint makes the endpoint of s, with its client (not dialled yet)
// and its two breakers.
func (r *Redis) newEndpoint(s endpointSpec, roots *x509.CertPool, b BreakerConfig, readTimeout time.Duration) *endpoint {
	ep := &endpoint{
		r:           r,
		address:     s.address,
		kind:        s.kind,
		seed:        labelHash(s.kind, s.placementLabel()),
		client:      newClient(s, roots, callTimeout(readTimeout)),
		callTimeout: callTimeout(readTimeout),
	}
	ep.idle = sync.NewCond(&ep.mu)
	ep.requests = ep.newBreaker(BreakerName, b, time.Duration(b.SlowCall))
	ep.replay = ep.newBreaker(ReplayBreakerName, b, 0)
	return ep
}

// ready reports why a request-path call (a read or a reservation) of a
// cell of window w may not go to Redis now: its caller left, the origin is
// closed, the breaker is open, or the window is shorter than the keys
// can name. It costs no I/O, so a refusal costs a request nothing.
func (ep *endpoint) ready(ctx context.Context, w time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if ep.r.closed.Load() {
		return ErrClosed
	}
	if ep.requests.open() {
		return ErrBreakerOpen
	}
	if w < time.Millisecond {
		return fmt.Errorf("window %s is below one millisecond", w)
	}
	return nil
}

// record counts a finished call and reports it to OnCall.
func (ep *endpoint) record(op Op, err error, start time.Time, cells int) {
	o := classify(err)
	ep.calls[op][o].Add(1)
	now := time.Now()
	switch o {
	case OutcomeOK:
		ep.lastOK[op].Store(now.UnixNano())
	case OutcomeError, OutcomeTimeout:
		ep.lastErr.Store(&callError{msg: err.Error(), at: now})
	}
	if f := ep.r.opts.OnCall; f != nil {
		f(CallInfo{Endpoint: ep.address, Op: op, Outcome: o, Duration: now.Sub(start), Cells: cells, Err: err})
	}
}

// callError is a failed call's error as Stats shows it.
type callError struct {
	msg string
	at  time.Time
}

// stats is the endpoint's snapshot: its breakers and its counters.
func (ep *endpoint) stats() EndpointStats {
	s := EndpointStats{
		Address:       ep.address,
		Kind:          ep.kind,
		Breaker:       ep.requests.reported(),
		ReplayBreaker: ep.replay.reported(),
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
	if e := ep.lastErr.Load(); e != nil {
		s.LastError, s.LastErrorAt = e.msg, e.at
	}
	return s
}

// shutdown refuses new reads, reservations and flushes, and waits for
// those in flight, each bounded by its deadline (callTimeout at most).
func (ep *endpoint) shutdown() {
	ep.mu.Lock()
	ep.closing = true
	for ep.batchers > 0 || ep.writes > 0 {
		ep.idle.Wait()
	}
	ep.mu.Unlock()
}

// begin registers a reservation or a flush about to go to Redis, unless
// the origin is closing (ErrClosed: nothing was sent); end must follow.
// A reload closes the old config's origin while the engine may still be
// in a call it began on it: cut by the closed client, a reservation that
// Redis ran came back as an error, the request was decided again locally
// (denied, near its limit) and its cost stayed charged in Redis, and every
// reload counted errors for calls that had not failed.
func (ep *endpoint) begin() error {
	ep.mu.Lock()
	defer ep.mu.Unlock()
	if ep.closing {
		return ErrClosed
	}
	ep.writes++
	return nil
}

// end is a call begun by begin leaving.
func (ep *endpoint) end() {
	ep.mu.Lock()
	ep.writes--
	if ep.writes == 0 && ep.batchers == 0 {
		ep.idle.Broadcast()
	}
	ep.mu.Unlock()
}
