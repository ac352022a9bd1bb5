package origin

import (
	"context"
	"errors"
	"maps"
	"net"
	"os"
	"time"

	"github.com/sony/gobreaker/v2"
)

// Op is the kind of an origin call.
type Op uint8

// Ops.
const (
	// OpRead is a Read: one cell pair, possibly batched with others into
	// one round trip.
	OpRead Op = iota
	// OpFlush is the part of one Flush that went to one endpoint: one
	// round trip (two when Redis had lost its scripts).
	OpFlush
	// OpReserve is one Reserve: a request decided at Redis.
	OpReserve
	numOps
)

// String returns "read", "flush" or "reserve".
func (o Op) String() string {
	switch o {
	case OpRead:
		return "read"
	case OpFlush:
		return "flush"
	case OpReserve:
		return "reserve"
	}
	return "unknown"
}

// Outcome is how an origin call ended.
type Outcome uint8

// Outcomes.
const (
	// OutcomeOK: Redis answered.
	OutcomeOK Outcome = iota
	// OutcomeError: Redis or the connection failed.
	OutcomeError
	// OutcomeTimeout: the deadline passed first (a slow or hung Redis, or
	// a read that waited its whole budget for a batch).
	OutcomeTimeout
	// OutcomeRejected: the breaker refused the call, or the origin is
	// closed; no I/O happened.
	OutcomeRejected
	numOutcomes
)

// String returns "ok", "error", "timeout" or "rejected".
func (o Outcome) String() string {
	switch o {
	case OutcomeOK:
		return "ok"
	case OutcomeError:
		return "error"
	case OutcomeTimeout:
		return "timeout"
	case OutcomeRejected:
		return "rejected"
	}
	return "unknown"
}

// BreakerState is the state of an endpoint's circuit breaker.
type BreakerState string

// Breaker states.
const (
	// BreakerClosed: calls go to Redis.
	BreakerClosed BreakerState = "closed"
	// BreakerOpen: calls fail at once and decisions stay local.
	BreakerOpen BreakerState = "open"
	// BreakerHalfOpen: one probe call may go to Redis; the rest are
	// rejected until it answers.
	BreakerHalfOpen BreakerState = "half-open"
)

func breakerState(s gobreaker.State) BreakerState {
	switch s {
	case gobreaker.StateOpen:
		return BreakerOpen
	case gobreaker.StateHalfOpen:
		return BreakerHalfOpen
	}
	return BreakerClosed
}

// CallInfo describes one finished origin call, for latency metrics.
type CallInfo struct {
	// Endpoint is the endpoint's address (never credentials).
	Endpoint string
	Op       Op
	Outcome  Outcome
	// Duration is the time the caller waited, batching included.
	Duration time.Duration
	// Cells is the number of cells read or flushed.
	Cells int
	// Err is why the call failed (nil when it did not): Redis's reply
	// (READONLY, OOM, WRONGPASS…) or the connection's error. It names
	// addresses and zones, never credentials or identifiers.
	Err error
}

// Stats is a snapshot of the origin for operators.
type Stats struct {
	Endpoints []EndpointStats `json:"endpoints"`
	// Restarts counts the servers seen restarted (their run ID changed)
	// or emptied (FLUSHALL: their mark is gone; see WatchRestarts), after
	// each of which every live cell's total was sent again.
	Restarts uint64 `json:"restarts"`
	// OverrideNotices tells whether this process is subscribed to the
	// region's notices of override changes (see WatchOverrides).
	OverrideNotices bool `json:"override_notices"`
	// Processes is how many processes the region's record counted live
	// at the last heartbeat, this one included (see WatchProcesses); 0
	// before one answered.
	Processes int64 `json:"processes"`
	// ClockOffsetMs is Redis's clock less this process's in milliseconds,
	// as the heartbeats measured it (ClockOffset): what the engine adds
	// to its clock. 0 before one did, and while within clockDeadband.
	ClockOffsetMs int64 `json:"clock_offset_ms"`
	// Builds is the region's processes by the build each names, as the
	// last read counted them (Builds); nil before one did.
	Builds map[string]int64 `json:"builds"`
}

// EndpointStats is a snapshot of one endpoint.
type EndpointStats struct {
	// Address names the endpoint: scheme, hosts, port and database, never
	// credentials.
	Address string `json:"address"`
	// Kind is "standalone", "cluster" or "sentinel".
	Kind string `json:"kind"`
	// Breaker is the state of the request path's breaker (reads and
	// reservations), ReplayBreaker that of replay's.
	Breaker       BreakerState `json:"breaker"`
	ReplayBreaker BreakerState `json:"replay_breaker"`
	// Calls counts calls by op ("read", "flush", "reserve") and outcome
	// ("ok", "error", "timeout", "rejected").
	Calls map[string]map[string]uint64 `json:"calls"`
	// RoundTrips counts pipelines and scripts sent to Redis: concurrent
	// reads share one.
	RoundTrips uint64 `json:"round_trips"`
	// SlowCalls counts request-path round trips that succeeded slower than
	// the slow-call threshold (each a failure for the breaker).
	SlowCalls uint64 `json:"slow_calls"`
	// LastRead and LastFlush are the times of the last successful read and
	// flush (zero if none yet).
	LastRead  time.Time `json:"last_read,omitzero"`
	LastFlush time.Time `json:"last_flush,omitzero"`
	// LastError is the error of the last call that failed or timed out
	// (not one the breaker refused), and LastErrorAt when it came: what
	// Redis answered (READONLY, OOM, WRONGPASS…) or what the connection
	// did. Empty when none has.
	LastError   string    `json:"last_error,omitempty"`
	LastErrorAt time.Time `json:"last_error_at,omitzero"`
}

// Stats returns a snapshot for operators.
func (r *Redis) Stats() Stats {
	st := Stats{Endpoints: make([]EndpointStats, len(r.endpoints)), Restarts: r.restarts.Load(), OverrideNotices: r.OverrideNotices(), Processes: r.Processes()}
	if b := r.builds.Load(); b != nil {
		st.Builds = maps.Clone(*b)
	}
	if d, ok := r.ClockOffset(); ok {
		st.ClockOffsetMs = d.Milliseconds()
	}
	for i, ep := range r.endpoints {
		st.Endpoints[i] = ep.stats()
	}
	return st
}

// classify maps an error to the outcome it counts as.
func classify(err error) Outcome {
	if err == nil {
		return OutcomeOK
	}
	if errors.Is(err, ErrBreakerOpen) || errors.Is(err, ErrClosed) {
		return OutcomeRejected
	}
	if isTimeout(err) {
		return OutcomeTimeout
	}
	return OutcomeError
}

func isTimeout(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded) {
		return true
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
