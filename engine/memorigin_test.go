package engine

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"
)

// memOrigin is an in-memory Origin for the engine's own tests, with the
// idempotent write the real one has (a contribution per process, raised to
// an absolute total): it counts calls and can block, fail or ignore its
// context on demand. What Redis does is tested against Redis in package
// origin.
type memOrigin struct {
	mu     sync.Mutex
	totals map[cellID]int64
	mine   map[cellID]int64 // this process's recorded contribution

	reads, flushes, reserves atomic.Int64
	// readErr, flushErr and reserveErr, when set, fail the next calls.
	readErr, flushErr, reserveErr atomic.Pointer[error]
	// gate, when set, blocks reads and reservations until it is closed,
	// ignoring ctx (a hung origin).
	gate atomic.Pointer[chan struct{}]
	// entered counts reads that reached the gate.
	entered atomic.Int64
	// reserveDelay, when set, is how long each reservation takes (a round
	// trip).
	reserveDelay atomic.Int64
}

type cellID struct {
	key Key
	seq int64
}

func newMemOrigin() *memOrigin {
	return &memOrigin{totals: map[cellID]int64{}, mine: map[cellID]int64{}}
}

func (m *memOrigin) Read(ctx context.Context, key Key, seq int64) (Totals, error) {
	m.reads.Add(1)
	m.entered.Add(1)
	if g := m.gate.Load(); g != nil {
		<-*g
	}
	if p := m.readErr.Load(); p != nil {
		return Totals{}, *p
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	id := cellID{key, seq}
	return Totals{Cur: m.totals[id], Prev: m.totals[cellID{key, seq - 1}], Mine: m.mine[id]}, nil
}

// raise is the idempotent write: this process's contribution rises to own.
func (m *memOrigin) raise(id cellID, own int64) {
	if d := own - m.mine[id]; d > 0 {
		m.totals[id] = SatAdd(m.totals[id], d)
		m.mine[id] = own
	}
}

func (m *memOrigin) Flush(ctx context.Context, batch []Delta) error {
	m.flushes.Add(1)
	if p := m.flushErr.Load(); p != nil {
		return *p
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for i := range batch {
		id := cellID{batch[i].Key, batch[i].Sequence}
		m.raise(id, batch[i].Own)
		batch[i].Totals = Totals{Cur: m.totals[id], Prev: m.totals[cellID{batch[i].Key, batch[i].Sequence - 1}], Mine: m.mine[id]}
		batch[i].Done = true
	}
	return nil
}

func (m *memOrigin) Reserve(ctx context.Context, r *Reservation) error {
	m.reserves.Add(1)
	if g := m.gate.Load(); g != nil {
		<-*g
	}
	if d := m.reserveDelay.Load(); d > 0 {
		time.Sleep(time.Duration(d))
	}
	if p := m.reserveErr.Load(); p != nil {
		return *p
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	id := cellID{r.Key, r.Sequence}
	m.raise(id, r.Own)
	prev := m.totals[cellID{r.Key, r.Sequence - 1}]
	w := r.Key.Window.Milliseconds()
	admit := func(cost int64) bool {
		cur := m.totals[id]
		if !fits(SatAdd(cur, r.Global), SatAdd(prev, r.GlobalPrev), cost, r.Limit, w, r.Elapsed) {
			return false
		}
		m.totals[id] = SatAdd(cur, cost)
		m.mine[id] = SatAdd(m.mine[id], cost)
		return true
	}
	r.Admitted = admit(r.Cost)
	r.JoinedAdmitted = make([]bool, len(r.Joined))
	for i, c := range r.Joined {
		r.JoinedAdmitted[i] = admit(c)
	}
	r.Totals = Totals{Cur: m.totals[id], Prev: prev, Mine: m.mine[id]}
	return nil
}

// add is another node's traffic reaching the origin.
func (m *memOrigin) add(key Key, seq, n int64) {
	m.mu.Lock()
	m.totals[cellID{key, seq}] += n
	m.mu.Unlock()
}

func (m *memOrigin) total(key Key, seq int64) int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.totals[cellID{key, seq}]
}

// restart forgets everything, as a Redis restarted empty.
func (m *memOrigin) restart() {
	m.mu.Lock()
	m.totals, m.mine = map[cellID]int64{}, map[cellID]int64{}
	m.mu.Unlock()
}

func setErr(p *atomic.Pointer[error], err error) {
	if err == nil {
		p.Store(nil)
		return
	}
	p.Store(&err)
}

func (m *memOrigin) failReads(err error)    { setErr(&m.readErr, err) }
func (m *memOrigin) failFlushes(err error)  { setErr(&m.flushErr, err) }
func (m *memOrigin) failReserves(err error) { setErr(&m.reserveErr, err) }

var errOriginDown = errors.New("origin down")
