package origin

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"
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
	// starvedTimeout is the scheduler latency (99th percentile) from which
	// a timeout is taken for this process's own doing: a tenth of the
	// least time a read pipeline gets (roundTripFloor).
	starvedTimeout = roundTripFloor / 10
)

// breaker is one gobreaker circuit breaker with its slow-call threshold
// (zero: errors only).
type breaker struct {
	// cb is the breaker in use: answeredOutside replaces an open one with
	// a closed one (made by fresh), and gen numbers them, so that a
	// replaced one's late transitions are not taken for the new one's.
	cb    atomic.Pointer[gobreaker.CircuitBreaker[struct{}]]
	gen   atomic.Uint64
	fresh func(gen uint64) *gobreaker.CircuitBreaker[struct{}]
	mu    sync.Mutex // replacements
	// openedAt is when it last opened (Unix ns).
	openedAt atomic.Int64
	// refused: the last failure it counted was Redis refusing the call
	// with a reply (READONLY, NOPERM, scripts refused, …), which an answer
	// to the restart watch does not say is over (answeredOutside).
	refused atomic.Bool
	slow    time.Duration
	ep      *endpoint
	// state is the state the breaker last entered, for Stats: gobreaker's
	// State() moves an open breaker whose timeout passed to half-open, so
	// a status or a metrics scrape read that way turned an idle node's
	// breakers half-open ("probing") with nothing probing, Redis down or
	// not. A call moves them (open, guard); a read of the state does not.
	state atomic.Int32
}

// slowPerCell is what each cell of a call adds to the slow-call
// threshold: a few times what Redis spends on a cell's script (about 5 µs
// for a read with its previous cell).
const slowPerCell = 20 * time.Microsecond

// errSlowCall marks, for the breaker only, a call that succeeded too late.
var errSlowCall = errors.New("slow call")

// starvedError marks, for the breaker only, a call that timed out while
// this process was starved of CPU; the breaker excludes it.
type starvedError struct{ err error }

func (e starvedError) Error() string { return "timed out while starved: " + e.err.Error() }

func (ep *endpoint) newBreaker(name string, c BreakerConfig, slow time.Duration) *breaker {
	interval := time.Duration(c.Interval)
	minRequests := uint32(c.MinRequests)
	ratio := c.FailureRatio
	b := &breaker{ep: ep, slow: slow}
	b.fresh = func(gen uint64) *gobreaker.CircuitBreaker[struct{}] {
		return b.settings(name, gen, interval, minRequests, ratio, time.Duration(c.Timeout))
	}
	b.cb.Store(b.fresh(0))
	return b
}

// settings makes the breaker's gobreaker, number gen.
func (b *breaker) settings(name string, gen uint64, interval time.Duration, minRequests uint32, ratio float64, timeout time.Duration) *gobreaker.CircuitBreaker[struct{}] {
	ep := b.ep
	return gobreaker.NewCircuitBreaker[struct{}](gobreaker.Settings{
		Name:         name,
		MaxRequests:  halfOpenProbes,
		Interval:     interval,
		BucketPeriod: interval / breakerBuckets,
		Timeout:      timeout,
		// A ratio over a minimum sample, counted per round trip: the herd of
		// cold reads at a window rollover shares a few batched round trips
		// (read.go) that succeed on a healthy Redis, and reads that merely
		// ran out of time waiting for a batch never reach the breaker.
		ReadyToTrip: func(n gobreaker.Counts) bool {
			done := n.TotalSuccesses + n.TotalFailures
			if done < minRequests {
				// A light load fills no sample: enough calls in a row
				// failed (smallTrip). A Redis down or hung under a few
				// requests a second kept the breaker closed for good, or
				// made the first twenty requests of a node each wait
				// read_timeout, seconds apart.
				return n.ConsecutiveFailures >= smallTrip(minRequests)
			}
			return float64(n.TotalFailures) >= ratio*float64(done)
		},
		IsSuccessful: func(err error) bool { return err == nil || !countsAgainst(err) },
		// A caller that gave up says nothing about Redis.
		IsExcluded: func(err error) bool {
			var starved starvedError
			return errors.Is(err, context.Canceled) || errors.As(err, &starved)
		},
		OnStateChange: func(name string, from, to gobreaker.State) {
			if b.gen.Load() != gen {
				return // replaced (answeredOutside)
			}
			if to == gobreaker.StateOpen {
				b.openedAt.Store(time.Now().UnixNano())
			}
			b.state.Store(int32(to))
			ep.r.emit(stateEvent{endpoint: ep.address, breaker: name, from: breakerState(from), to: breakerState(to)})
		},
	})
}

// answeredOutside is told of a round trip to the endpoint made outside
// the breakers (the restart watch's, every slow tick), which began at
// start and took rtt. An open breaker waited out its timeout
// (breaker_timeout) before a call probed Redis, whatever had heard it
// answer since: a Redis killed and started again half a second later left
// each node deciding alone for the timeout's 5 s (an audit: 184 admitted
// in a window of 100 over three nodes). Such an answer is the evidence
// the half-open probe would give (one round trip: halfOpenProbes), and
// closes an open breaker at once, made anew, when the round trip began
// after it opened and came within its slow-call threshold (a Redis that
// answers slowly opened the request path's breaker, and would at once
// again). So does one whose timeout passed with no call to probe it (an
// idle node): the breaker's recorded state says whether it is still open,
// not gobreaker's State(), which moves such a breaker to half-open
// ("probing", with nothing probing). Until 2026-11-29 the watch asked
// State(), and after an outage longer than breaker_timeout left the
// breaker half-open until the next request came
// (TestBreaker_TheWatchClosesItAfterItsTimeoutPassed). One a call moved
// to half-open is left to that call's probe.
//
// Nor one that Redis opened by refusing calls with a reply (READONLY from
// a replica, NOPERM, MISCONF, scripts refused): the server answers the
// watch all the same, and closed at every slow tick the breaker would
// fail a few calls and open again, a warning each time. Nor, until the
// process heard the region's changes since it opened (Options.HeardRegion),
// one whose units held through the outage a reset made meanwhile takes
// off: written first, they counted after the reset (the root's
// TestReset_ANodeCutOffDropsTheUnitsItHeld, whose breaker's timeout had
// left the node time to hear it).
func (b *breaker) answeredOutside(start time.Time, rtt time.Duration) {
	opened := b.openedAt.Load()
	if gobreaker.State(b.state.Load()) != gobreaker.StateOpen || start.UnixNano() <= opened ||
		(b.slow > 0 && rtt > b.slow) || b.refused.Load() {
		return
	}
	if heard := b.ep.r.opts.HeardRegion; heard != nil && heard().UnixNano() <= opened {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	old := b.cb.Load()
	if gobreaker.State(b.state.Load()) != gobreaker.StateOpen {
		return // a call moved it to half-open meanwhile, or closed it
	}
	gen := b.gen.Add(1)
	b.cb.Store(b.fresh(gen))
	b.state.Store(int32(gobreaker.StateClosed))
	b.ep.r.emit(stateEvent{endpoint: b.ep.address, breaker: old.Name(), from: BreakerOpen, to: BreakerClosed})
}

// smallTrip is the number of calls failed in a row on which a breaker
// with fewer calls in its window than min trips: a quarter of min, at
// least 5 (5 of the default 20).
func smallTrip(min uint32) uint32 { return max(min/4, 5) }

// reported is the state the breaker last entered, read without moving it
// (see breaker.state).
func (b *breaker) reported() BreakerState { return breakerState(gobreaker.State(b.state.Load())) }

// countsAgainst reports whether err says something about Redis's health. A
// command Redis refused for its own key (a wrong type, a value that is not
// a number, a script error) does not: one hostile key must not open the
// breaker of the region. Redis refusing work as a whole does, a server
// that refuses scripts (scriptless.go) among it, and a protocol error,
// which no key causes: Redis answers one to a client that has not
// authenticated and sends a command of more than ten arguments ("ERR
// Protocol error: unauthenticated multibulk length"), where a shorter
// one gets NOAUTH, and closes its connection (before 2026-11-29 that
// reply passed the replay breaker's probe, and a node without the
// password flushed, and reconnected, a hundred times a second).
func countsAgainst(err error) bool {
	var rerr redis.Error
	if !errors.As(err, &rerr) || errors.Is(err, ErrScriptsRefused) {
		return true
	}
	for _, p := range []string{"LOADING", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "BUSY", "OOM", "NOAUTH", "WRONGPASS", "NOPERM", "MISCONF", "NOREPLICAS", "Protocol error"} {
		if redis.HasErrorPrefix(err, p) {
			return true
		}
	}
	return false
}

// open reports whether the breaker refuses calls right now (a cheap check
// before any work, so an open breaker costs a request nothing).
func (b *breaker) open() bool { return b.cb.Load().State() == gobreaker.StateOpen }

// guard runs fn, a call about cells cells, through the breaker,
// translating its refusals. A call that succeeded past the slow-call
// threshold, and slowPerCell more for each of its cells, counts as a
// failure for the breaker (unless this process was starved of CPU:
// starve.go), and as the success it was for the caller: the threshold
// judges Redis's answer to a request, and a round trip that carries a
// herd of cold reads (every key's new cell at a window's turn, thousands
// in one pipeline) takes Redis that much longer to run. Judged as one
// request, such herds tripped the breaker on a busy machine (a quarter of
// the runs of TestRead_ColdHerdAtRolloverDoesNotTripTheBreaker, 5,000
// reads), and every cold key then decided locally for the breaker's wait.
func (b *breaker) guard(cells int, fn func() error) error {
	_, err := b.cb.Load().Execute(func() (struct{}, error) {
		start := time.Now()
		err := explainScripts(fn())
		slow := b.slow + time.Duration(cells)*slowPerCell
		switch {
		case err == nil && b.slow > 0 && time.Since(start) > slow && !sched.starved(b.slow/2):
			b.ep.slowCalls.Add(1)
			return struct{}{}, errSlowCall
		case err != nil && isTimeout(err) && sched.starved(starvedTimeout):
			// Out of time because this process could not run: says
			// nothing about Redis.
			return struct{}{}, starvedError{err}
		}
		if err != nil && countsAgainst(err) {
			var rerr redis.Error
			b.refused.Store(errors.Is(err, ErrScriptsRefused) || errors.As(err, &rerr))
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

// stateEvent is one breaker transition on its way to OnStateChange.
type stateEvent struct {
	endpoint, breaker string
	from, to          BreakerState
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

// notify hands the queued transitions to OnStateChange, in order, until
// Close.
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
