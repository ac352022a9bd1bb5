package origin

import (
	"context"
	"crypto/rand"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// Names of every endpoint's two circuit breakers: the request path's
// (reads and reservations, where slow counts as failed) and replay's
// (errors only).
const (
	BreakerName       = "ratelimit_origin"
	ReplayBreakerName = "ratelimit_origin_replay"
)

// Tunables of the breaker and the state-change notifications.
const (
	// breakerBuckets splits the breaker's counting interval into a rolling
	// window, so counts age out one bucket at a time instead of all at
	// once at the end of each interval (which would forget a building
	// outage every 10 s).
	breakerBuckets = 10
	// halfOpenProbes is the number of calls a half-open breaker lets
	// through; one successful round trip is enough evidence that Redis
	// answers again, and more would keep decisions local for longer.
	halfOpenProbes = 1
	// stateEventBuffer holds breaker transitions until OnStateChange takes
	// them; transitions are rare (seconds apart), so a full buffer means a
	// stuck hook, and dropping is better than blocking a Redis call.
	stateEventBuffer = 64
)

// Redis is the regional origin backed by Redis: one or several standalone
// partitions, a Cluster, or a Sentinel-monitored master. It implements
// engine.Origin and is safe for concurrent use.
type Redis struct {
	prefix    string
	nodeID    string
	endpoints []*endpoint
	opts      Options

	events   chan stateEvent
	dropped  atomic.Uint64
	restarts atomic.Uint64 // run ID changes seen (restart.go)
	// runIDChecks counts the watch's checks, for tests to await one.
	runIDChecks atomic.Uint64
	closed      atomic.Bool
	once        sync.Once
	done        chan struct{}
}

type stateEvent struct {
	endpoint, breaker string
	from, to          BreakerState
}

var _ engine.Origin = (*Redis)(nil)

// New validates cfg and returns the origin. It does not dial: connections
// are made by the first Read or Flush, so it is safe in Caddy's Provision.
// Close releases the clients.
func New(cfg Config, opts Options) (*Redis, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("origin config: %w", err)
	}
	cfg = cfg.WithDefaults()
	specs, err := cfg.endpoints()
	if err != nil {
		return nil, fmt.Errorf("origin config: %w", err)
	}
	var roots *x509.CertPool
	if cfg.TLSCAFile != "" {
		pem, err := os.ReadFile(cfg.TLSCAFile)
		if err != nil {
			return nil, fmt.Errorf("origin config: tls_ca_file: %w", err)
		}
		roots = x509.NewCertPool()
		if !roots.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("origin config: tls_ca_file %s: no PEM certificate in it", cfg.TLSCAFile)
		}
	}
	if opts.NodeID == "" {
		opts.NodeID = processNodeID()
	}
	r := &Redis{
		prefix: cfg.Prefix,
		nodeID: opts.NodeID,
		opts:   opts,
		done:   make(chan struct{}),
	}
	if opts.OnStateChange != nil {
		r.events = make(chan stateEvent, stateEventBuffer)
		go r.notify()
	}
	for _, s := range specs {
		ep := &endpoint{
			r:       r,
			address: s.address,
			kind:    s.kind,
			seed:    labelHash(s.kind, s.placementLabel()),
			client:  newClient(s, roots),
		}
		ep.idle = sync.NewCond(&ep.mu)
		ep.sync = ep.newBreaker(BreakerName, cfg.Breaker, time.Duration(cfg.Breaker.SlowCall))
		ep.replay = ep.newBreaker(ReplayBreakerName, cfg.Breaker, 0)
		r.endpoints = append(r.endpoints, ep)
	}
	return r, nil
}

// processNodeID identifies this process to Redis. The engine, and with it
// every cell's own contribution, lives as long as the process (config
// reloads keep it), so one random ID per process is exactly as long-lived;
// 64 random bits make two processes sharing an ID practically impossible.
var processNodeID = sync.OnceValue(func() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // never fails on supported platforms
	return hex.EncodeToString(b[:])
})

// NodeID returns the ID under which this process's contributions are
// recorded.
func (r *Redis) NodeID() string { return r.nodeID }

// String lists the endpoints' addresses, never credentials.
func (r *Redis) String() string {
	s := "redis origin ["
	for i, ep := range r.endpoints {
		if i > 0 {
			s += " "
		}
		s += ep.address
	}
	return s + "]"
}

// Read returns the totals of the cell (key, seq) and of the cell before it,
// with the recorded share of this process's incarnation inc of the cell,
// which it registers in the cell; a missing cell is 0. It
// returns by ctx's deadline whatever Redis does, and at once when the
// endpoint's request-path breaker is open. Concurrent reads of one
// endpoint share round trips.
func (r *Redis) Read(ctx context.Context, key engine.Key, seq int64, inc uint32) (engine.Totals, error) {
	start := time.Now()
	ep := r.route(key)
	t, err := ep.read(ctx, key, seq, inc)
	ep.record(OpRead, err, start, 2)
	if err != nil {
		return engine.Totals{}, fmt.Errorf("redis read %s (zone %q): %w", ep.address, key.Namespace, err)
	}
	return t, nil
}

// Reserve decides one request at Redis in one script (scripts.go): it raises
// this process's contribution to res.Own, then admits res.Cost only if the
// region's count allows, charging it in the same step. It returns by ctx's
// deadline whatever Redis does, and at once when the request-path breaker
// is open.
func (r *Redis) Reserve(ctx context.Context, res *engine.Reservation) error {
	start := time.Now()
	ep := r.route(res.Key)
	err := ep.reserve(ctx, res)
	ep.record(OpReserve, err, start, 1)
	if err != nil {
		return fmt.Errorf("redis reserve %s (zone %q): %w", ep.address, res.Key.Namespace, err)
	}
	return nil
}

// Flush raises this process's contribution to each item's cell to its Own
// in one pipeline per endpoint, and stores the cell's totals and Done for
// each item Redis applied. See flush.go and scripts.go: the write is
// idempotent, so a Redis restarted empty gets every unit back exactly once.
//
// Endpoints are written concurrently; an endpoint whose breaker is open or
// whose round trip fails leaves its items not Done. The error joins every
// endpoint's error.
func (r *Redis) Flush(ctx context.Context, batch []engine.Delta) error {
	if len(batch) == 0 {
		return nil
	}
	ctx, cancel := boundContext(ctx)
	defer cancel()
	if len(r.endpoints) == 1 {
		return r.endpoints[0].flushRecorded(ctx, batch, nil)
	}
	groups := make(map[*endpoint][]int, len(r.endpoints))
	for i := range batch {
		ep := r.route(batch[i].Key)
		groups[ep] = append(groups[ep], i)
	}
	if len(groups) == 1 {
		for ep := range groups {
			return ep.flushRecorded(ctx, batch, nil)
		}
	}
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	for ep, idx := range groups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Each goroutine writes only its own items of batch.
			if err := ep.flushRecorded(ctx, batch, idx); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Stats returns a snapshot for operators.
func (r *Redis) Stats() Stats {
	st := Stats{Endpoints: make([]EndpointStats, len(r.endpoints)), Restarts: r.restarts.Load()}
	for i, ep := range r.endpoints {
		st.Endpoints[i] = ep.stats()
	}
	return st
}

// Close stops accepting calls, waits for the read batches in flight (each
// bounded by its deadline) and closes every client. It is idempotent.
func (r *Redis) Close() error {
	var errs []error
	r.once.Do(func() {
		r.closed.Store(true)
		for _, ep := range r.endpoints {
			ep.shutdown()
			if err := ep.client.Close(); err != nil && !errors.Is(err, redis.ErrClosed) {
				errs = append(errs, fmt.Errorf("close %s: %w", ep.address, err))
			}
		}
		close(r.done)
	})
	return errors.Join(errs...)
}

// emit queues a breaker transition for OnStateChange. gobreaker calls its
// hook with its lock held, so the user's hook runs elsewhere and may call
// Stats.
func (r *Redis) emit(ev stateEvent) {
	if r.events == nil {
		return
	}
	select {
	case r.events <- ev:
	default:
		r.dropped.Add(1)
	}
}

func (r *Redis) notify() {
	for {
		select {
		case ev := <-r.events:
			r.opts.OnStateChange(ev.endpoint, ev.breaker, ev.from, ev.to)
		case <-r.done:
			return
		}
	}
}

// boundContext gives ctx a deadline no later than maxCallTimeout from now.
func boundContext(ctx context.Context) (context.Context, context.CancelFunc) {
	limit := time.Now().Add(maxCallTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(limit) {
		return ctx, func() {}
	}
	return context.WithDeadline(ctx, limit)
}
