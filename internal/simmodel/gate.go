package simmodel

import (
	"errors"
	"time"
)

// ErrGateOpen is a write refused by an open Gate.
var ErrGateOpen = errors.New("simmodel: write breaker open")

// Gate is the propagation layer's write breaker on the simulated clock
// (propagation.Options.WriteGate): the rules of its gobreaker settings,
// which read the wall clock. Closed, it trips when, over the last
// Interval, at least MinRequests writes were made and FailureRatio of them
// failed; open, it refuses every write for Timeout; then one probe decides
// whether it closes again or opens for another Timeout.
type Gate struct {
	now          func() int64
	interval     int64
	timeout      int64
	minRequests  int
	failureRatio float64

	open    bool
	until   int64 // open until
	opened  int64 // when it last opened
	probing bool  // half-open: the next write is the probe
	recent  []outcome
	// Refused counts the writes refused while open; Tripped the times it
	// opened.
	Refused, Tripped int64
}

type outcome struct {
	at     int64
	failed bool
}

// NewGate returns a closed Gate on the clock now (Unix ms) with the
// breaker's settings.
func NewGate(now func() int64, interval, timeout time.Duration, minRequests int, failureRatio float64) *Gate {
	return &Gate{now: now, interval: interval.Milliseconds(), timeout: timeout.Milliseconds(),
		minRequests: minRequests, failureRatio: failureRatio}
}

// Do runs write unless the gate is open.
func (g *Gate) Do(write func() error) error {
	now := g.now()
	if g.open {
		if now < g.until {
			g.Refused++
			return ErrGateOpen
		}
		g.open, g.probing = false, true
	}
	err := write()
	failed := err != nil
	if g.probing {
		g.probing = false
		g.recent = g.recent[:0]
		if failed {
			g.trip(now)
		}
		return err
	}
	g.recent = append(g.recent, outcome{now, failed})
	cut := 0
	for cut < len(g.recent) && g.recent[cut].at <= now-g.interval {
		cut++
	}
	g.recent = append(g.recent[:0], g.recent[cut:]...)
	if failed {
		fails := 0
		for _, o := range g.recent {
			if o.failed {
				fails++
			}
		}
		if len(g.recent) >= g.minRequests && float64(fails) >= g.failureRatio*float64(len(g.recent)) {
			g.trip(now)
		}
	}
	return err
}

// Heard closes an open gate that opened before at, when a round trip
// made outside it that began at at came back: a node's restart watch,
// every slow tick, whose answer closes the origin's breakers at once
// (origin's breaker.answeredOutside). The model's Redis refuses no call
// with a reply, which keeps a real breaker open.
func (g *Gate) Heard(at int64) {
	if g.open && g.opened < at {
		g.open, g.probing = false, false
		g.recent = g.recent[:0]
	}
}

func (g *Gate) trip(now int64) {
	g.open, g.until, g.opened = true, now+g.timeout, now
	g.recent = g.recent[:0]
	g.Tripped++
}
