package simmodel

import (
	"errors"
	"math"
	"math/rand/v2"
)

// The errors a model returns for a call that did not get through.
var (
	// ErrDown: the server cannot be reached (an outage, a partition).
	ErrDown = errors.New("simmodel: server unreachable")
	// ErrLost: the call or its answer was lost on the way.
	ErrLost = errors.New("simmodel: call lost")
	// ErrTimeout: the answer came after the caller's timeout.
	ErrTimeout = errors.New("simmodel: timeout")
)

// Dist is a latency distribution in milliseconds: log-normal with the given
// median and 99th percentile. P99 at or below Median is a constant.
type Dist struct {
	Median, P99 float64
}

// z99 is the standard normal's 99th percentile.
const z99 = 2.326

// Sample draws one latency from d with rng.
func (d Dist) Sample(rng *rand.Rand) float64 {
	if d.P99 <= d.Median || d.Median <= 0 {
		return max(d.Median, 0)
	}
	sigma := math.Log(d.P99/d.Median) / z99
	return d.Median * math.Exp(sigma*rng.NormFloat64())
}

// Scaled returns d with both figures multiplied by f.
func (d Dist) Scaled(f float64) Dist { return Dist{d.Median * f, d.P99 * f} }

// Span is a stretch of simulated time, [From, To) in milliseconds.
type Span struct {
	From, To int64
}

// Has reports whether at lies in s.
func (s Span) Has(at int64) bool { return at >= s.From && at < s.To }

// Link is the path between clients and a server: each call's round trip,
// the share of calls lost, the spans during which the server cannot be
// reached (each call waits out its caller's timeout, as behind a
// partition) and those during which it is not running (each call is
// refused at once, as by a killed server's host).
type Link struct {
	Latency  Dist
	Loss     float64
	Outages  []Span
	Refusals []Span
}

// Down reports whether the server is unreachable or not running at at.
func (l *Link) Down(at int64) bool { return in(l.Outages, at) || in(l.Refusals, at) }

func in(spans []Span, at int64) bool {
	for _, s := range spans {
		if s.Has(at) {
			return true
		}
	}
	return false
}

// call draws the fate of one call at at with a caller's timeout (ms):
// its latency, and an error when it did not get through. applied reports
// whether the server ran it (a late answer was still run there). A late
// call's latency is its round trip, not the timeout: it reaches the server
// half of that in, and the caller, which gives up at its timeout, pays
// the timeout (Tick.add). Until 2026-11-29 it was the timeout, so a
// statement slower than mysql_timeout landed half a timeout in, however
// far the server: -cross-rtt 2s and 10000h gave the same table.
func (l *Link) call(rng *rand.Rand, at int64, timeout float64) (lat float64, applied bool, err error) {
	if in(l.Refusals, at) {
		return 0, false, ErrDown
	}
	if in(l.Outages, at) {
		return timeout, false, ErrDown
	}
	if l.Loss > 0 && rng.Float64() < l.Loss {
		return timeout, false, ErrLost
	}
	lat = l.Latency.Sample(rng)
	if timeout > 0 && lat > timeout {
		return lat, true, ErrTimeout
	}
	return lat, true, nil
}

// Tick is the simulated time that one iteration of a node's loop has used:
// each call it makes adds its latency, and what a call changes at a server
// takes effect when the call would have arrived there. The simulator
// begins a Tick before it calls one of the propagation layer's tick
// methods and reads how long it took after.
type Tick struct {
	// Start is when the iteration began (ms); Elapsed the latency of its
	// calls so far (ms).
	Start   int64
	Elapsed float64
}

// Begin starts an iteration at now.
func (t *Tick) Begin(now int64) { t.Start, t.Elapsed = now, 0 }

// At is the simulated time the iteration has reached.
func (t *Tick) At() int64 { return t.Start + int64(math.Ceil(t.Elapsed)) }

// add records a call's round trip lat and returns when its effect lands:
// half of it after the iteration's time before it. The iteration moves
// on by the round trip, or by the caller's timeout (ms; 0: none) when
// that is shorter: it stopped waiting then.
func (t *Tick) add(lat, timeout float64) int64 {
	if t == nil {
		return 0
	}
	land := t.Start + int64(math.Ceil(t.Elapsed+lat/2))
	if timeout > 0 {
		lat = min(lat, timeout)
	}
	t.Elapsed += lat
	return land
}

// newRand returns the seeded generator of a model.
func newRand(seed uint64, stream uint64) *rand.Rand {
	return rand.New(rand.NewPCG(seed, stream^0x9e3779b97f4a7c15))
}
