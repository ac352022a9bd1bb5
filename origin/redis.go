package origin

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// Redis is the regional origin backed by Redis: one or several standalone
// partitions, a Cluster, or a Sentinel-monitored master. It implements
// engine.Origin and is safe for concurrent use. Its three calls are in
// read.go (Read), reserve.go (Reserve) and flush.go (Flush).
type Redis struct {
	prefix    string
	nodeID    string
	endpoints []*endpoint
	opts      Options

	events   chan stateEvent // breaker transitions for OnStateChange (breaker.go)
	dropped  atomic.Uint64
	restarts atomic.Uint64 // run ID changes seen (restart.go)
	watch    *restartWatch
	// builds is the region's processes by build, as Builds last read
	// them; nil before.
	builds atomic.Pointer[map[string]int64]
	// processes is the region's live processes, as the last Heartbeat
	// counted them (processes.go).
	processes atomic.Int64
	// clockOffset is Redis's clock less this process's (Options.Now), in
	// ns, as a heartbeat measured it (processes.go); clockKnown is set
	// once one did.
	clockOffset atomic.Int64
	clockKnown  atomic.Bool
	// beat is held across a renewal of this process's record and by
	// Leave, so that no renewal under way records it again after Leave;
	// left (under beat) stops them.
	beat sync.Mutex
	left bool
	// notices is whether WatchOverrides is subscribed (overrides.go).
	notices atomic.Bool
	// runIDChecks counts the watch's checks, for tests to await one.
	runIDChecks atomic.Uint64
	closed      atomic.Bool
	once        sync.Once
	done        chan struct{}
}

var (
	_ engine.Origin      = (*Redis)(nil)
	_ engine.Partitioned = (*Redis)(nil)
)

// Options are the origin's settings that are not configuration: hooks to
// observe it and the process's identity. All are optional.
type Options struct {
	// NodeID names this process in the cells' contribution hashes (see
	// Flush). It must be unique among the processes sharing a Redis and
	// stable for the life of the engine, across config reloads; the
	// default, a random ID made once per process, is both.
	NodeID string
	// OnCall runs on the calling goroutine after every Read and after every
	// endpoint's part of a Flush: keep it cheap (update a histogram).
	OnCall func(CallInfo)
	// OnStateChange runs when one of an endpoint's breakers (BreakerName
	// or ReplayBreakerName) changes state, in order, on a goroutine of its
	// own, so it may log, update metrics or call Stats. A slow hook delays
	// later notifications only.
	OnStateChange func(endpoint, breaker string, from, to BreakerState)
	// OnEvicting runs on the restart watch's goroutine (WatchRestarts)
	// when it first reads a server, or reads it restarted, that may evict
	// keys: a memory limit (maxmemory) with a policy other than
	// noeviction. A count Redis evicts is lost to every node, with no
	// restart for anyone to see.
	OnEvicting func(address, policy string, maxmemory int64)
	// OnScriptsRefused runs on the restart watch's goroutine when it
	// first reads a server, or reads it restarted, that refuses Lua
	// scripts (EVAL "return 1" refused: EVAL/EVALSHA disabled or renamed,
	// or not permitted; scriptless.go). Every call of the module is a
	// script: such a server serves none, and decisions stay local. err
	// wraps ErrScriptsRefused with the server's reply.
	OnScriptsRefused func(address string, err error)
	// Build names this process's build in its record among the region's
	// processes (Builds); "" names none. A space or a control character
	// in it is replaced with "_", and it is cut to maxBuild bytes.
	Build string
	// Now is this process's clock, which the heartbeats measure Redis's
	// clock against (ClockOffset): the engine's Config.Now. Default
	// time.Now.
	Now func() time.Time
	// HeardRegion, if set, is when this process last knew every change
	// of the region's that weighs on what it writes (the root's runtime
	// overrides and resets); zero: never. An open breaker that the
	// restart watch hears Redis through closes only once that is after
	// it opened (breaker.answeredOutside): the units a node held through
	// an outage are written once it heard the resets made meanwhile, which
	// take them off. Nil: no such condition.
	HeardRegion func() time.Time
}

// maxBuild bounds Options.Build: it goes into a record every node reads.
const maxBuild = 100

// Errors returned by Read and Flush, wrapped with the endpoint's address.
var (
	// ErrBreakerOpen: the endpoint's breaker is open (or half-open with its
	// probe in flight); nothing was sent, which it tells the engine with
	// its method Refused (engine.Origin's Read).
	ErrBreakerOpen error = breakerOpen{}
	// ErrClosed: Close was called.
	ErrClosed = errors.New("origin closed")
)

// breakerOpen is ErrBreakerOpen's type.
type breakerOpen struct{}

func (breakerOpen) Error() string { return "circuit breaker open" }

// Refused tells the engine that the call was never sent: a decision that
// waited for it waited for nothing, and no read is counted.
func (breakerOpen) Refused() bool { return true }

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
	roots, err := certPool(cfg.TLSCAFile)
	if err != nil {
		return nil, fmt.Errorf("origin config: %w", err)
	}
	if opts.NodeID == "" {
		opts.NodeID = processNodeID()
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	opts.Build = strings.Map(func(c rune) rune {
		if c <= ' ' || c == 0x7f {
			return '_'
		}
		return c
	}, opts.Build[:min(len(opts.Build), maxBuild)])
	r := &Redis{
		prefix: cfg.Prefix,
		nodeID: opts.NodeID,
		opts:   opts,
		done:   make(chan struct{}),
	}
	r.watch = newRestartWatch(r)
	if opts.OnStateChange != nil {
		r.events = make(chan stateEvent, stateEventBuffer)
		go r.notify()
	}
	for _, s := range specs {
		r.endpoints = append(r.endpoints, r.newEndpoint(s, roots, cfg.Breaker, time.Duration(cfg.ReadTimeout)))
	}
	return r, nil
}

// processNodeID identifies this process to Redis. The engine, and with it
// every cell's own total, lives as long as the process (config reloads
// keep it), so one random ID per process is exactly as long-lived; 64
// random bits make two processes sharing an ID practically impossible.
var processNodeID = sync.OnceValue(func() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // never fails on supported platforms
	return hex.EncodeToString(b[:])
})

// NodeID returns the ID under which this process's own totals are
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

// Placement names where the origin keeps its keys: the prefix and every
// endpoint's address (never credentials), sorted. Two origins of one
// placement hold the same keys in the same places; a reload to another
// one must hand it every count (see the root's redisBackend.use).
func (r *Redis) Placement() string {
	addrs := make([]string, len(r.endpoints))
	for i, ep := range r.endpoints {
		addrs[i] = ep.address
	}
	slices.Sort(addrs)
	return r.prefix + " " + strings.Join(addrs, " ")
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
