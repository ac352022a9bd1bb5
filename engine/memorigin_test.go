package engine

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"
)

// memOrigin is an in-memory Origin for the engine's own tests, with the
// idempotent write the real one has (a contribution per process and cell
// incarnation, raised to an absolute total): it counts calls and can block,
// fail or ignore its context on demand. Several engines share one store
// through peer, each as its own process. What Redis does is tested against
// Redis in package origin.
type memOrigin struct {
	*memStore
	node string

	reads, flushes, reserves atomic.Int64
	// noPrev counts the writes that asked for no previous cell, late the
	// writes sent marked late.
	noPrev, late atomic.Int64
	// flakyFlushes is how many of the next writes fail (below 0: none).
	flakyFlushes atomic.Int64
	// lostReplies is how many of the next reservations run and then fail,
	// as one whose answer a timeout lost after the origin ran it (below 0:
	// none).
	lostReplies atomic.Int64
	// readErr, flushErr and reserveErr, when set, fail the next calls.
	readErr, flushErr, reserveErr atomic.Pointer[error]
	// gate, when set, blocks reads and reservations until it is closed,
	// ignoring ctx (a hung origin).
	gate atomic.Pointer[chan struct{}]
	// entered counts reads that reached the gate.
	entered atomic.Int64
	// flushGate, when set, blocks writes until it is closed, before they
	// reach the store (a write in flight).
	flushGate atomic.Pointer[chan struct{}]
	// reserveDelay and flushDelay, when set, are how long each reservation
	// and each write takes (a round trip).
	reserveDelay, flushDelay atomic.Int64
	// global, when set, is what other regions counted in a cell, as the
	// region's cross-region role leaves it at the origin.
	global func(id cellID) (int64, bool)
}

// memStore is what the origin holds, shared by the processes that use it.
type memStore struct {
	mu     sync.Mutex
	totals map[cellID]int64
	// fields are the contributions of each cell: one per process and
	// incarnation, as the origin's contribution hash holds them.
	fields map[cellID]map[writer]int64
	// down, when set, fails every call of every process.
	down atomic.Bool
}

type cellID struct {
	key Key
	seq int64
}

// writer names one field of a contribution hash.
type writer struct {
	node string
	inc  uint32
}

func newMemOrigin() *memOrigin {
	return &memOrigin{memStore: &memStore{totals: map[cellID]int64{}, fields: map[cellID]map[writer]int64{}}, node: "self"}
}

// field returns the contribution hash of id, made if missing.
func (s *memStore) field(id cellID) map[writer]int64 {
	h := s.fields[id]
	if h == nil {
		h = map[writer]int64{}
		s.fields[id] = h
	}
	return h
}

// peer returns another process's view of the same store.
func (m *memOrigin) peer(node string) *memOrigin { return &memOrigin{memStore: m.memStore, node: node} }

// totalsLocked is what a call about the cell id answers the incarnation inc
// of m's process: Shared when the hash holds any other field, as the
// origin's HLEN does.
func (m *memOrigin) totalsLocked(id cellID, inc uint32) Totals {
	h := m.fields[id]
	t := Totals{Cur: m.totals[id], Prev: m.totals[cellID{id.key, id.seq - 1}], Mine: h[writer{m.node, inc}], Shared: len(h) > 1, Processes: int64(len(h))}
	if m.global != nil {
		t.Global, _ = m.global(id)
		t.GlobalPrev, _ = m.global(cellID{id.key, id.seq - 1})
	}
	return t
}

func (m *memOrigin) Read(ctx context.Context, key Key, seq int64, inc uint32) (Totals, error) {
	m.reads.Add(1)
	m.entered.Add(1)
	if g := m.gate.Load(); g != nil {
		// A hung server: the read returns at ctx's deadline, as the
		// Origin contract asks (the real origin's does).
		select {
		case <-*g:
		case <-ctx.Done():
			return Totals{}, ctx.Err()
		}
	}
	if p := m.readErr.Load(); p != nil {
		return Totals{}, *p
	}
	if m.down.Load() {
		return Totals{}, errOriginDown
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	id := cellID{key, seq}
	if h := m.field(id); h[writer{m.node, inc}] == 0 {
		h[writer{m.node, inc}] = 0 // a read registers the process, as readLua does
	}
	return m.totalsLocked(id, inc), nil
}

// raise is the idempotent write: this process's contribution rises to own.
func (m *memOrigin) raise(id cellID, inc uint32, own int64) {
	h, f := m.field(id), writer{m.node, inc}
	if d := own - h[f]; d > 0 {
		m.totals[id] = SatAdd(m.totals[id], d)
		h[f] = own
	}
}

func (m *memOrigin) Flush(ctx context.Context, batch []Delta) error {
	m.flushes.Add(1)
	for i := range batch {
		if batch[i].Late {
			m.late.Add(1)
		}
	}
	if g := m.flushGate.Load(); g != nil {
		<-*g
	}
	if d := m.flushDelay.Load(); d > 0 {
		time.Sleep(time.Duration(d))
	}
	if p := m.flushErr.Load(); p != nil {
		return *p
	}
	if m.down.Load() || m.flakyFlushes.Add(-1) >= 0 {
		return errOriginDown
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for i := range batch {
		id := cellID{batch[i].Key, batch[i].Sequence}
		m.raise(id, batch[i].Incarnation, batch[i].Own)
		batch[i].Totals = m.totalsLocked(id, batch[i].Incarnation)
		if batch[i].NoPrev { // the origin leaves the previous cell out
			batch[i].Totals.Prev, batch[i].Totals.GlobalPrev = 0, 0
			m.noPrev.Add(1)
		}
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
	if m.down.Load() {
		return errOriginDown
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	id := cellID{r.Key, r.Sequence}
	h, f := m.field(id), writer{m.node, r.Incarnation}
	m.raise(id, r.Incarnation, r.Own)
	prev := m.totals[cellID{r.Key, r.Sequence - 1}]
	w := r.Key.Window.Milliseconds()
	admit := func(cost int64) bool {
		cur := m.totals[id]
		if !fits(SatAdd(cur, r.Global), SatAdd(prev, r.GlobalPrev), cost, r.Limit, w, r.Elapsed) {
			return false
		}
		m.totals[id] = SatAdd(cur, cost)
		h[f] = SatAdd(h[f], cost)
		return true
	}
	r.Admitted = admit(r.Cost)
	r.JoinedAdmitted = make([]bool, len(r.Joined))
	for i, c := range r.Joined {
		r.JoinedAdmitted[i] = admit(c)
	}
	r.Totals = m.totalsLocked(id, r.Incarnation)
	if m.lostReplies.Add(-1) >= 0 {
		return errOriginDown
	}
	return nil
}

// setGlobal sets what other regions counted in each cell.
func (m *memOrigin) setGlobal(f func(id cellID) (int64, bool)) {
	m.mu.Lock()
	m.global = f
	m.mu.Unlock()
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
	m.totals, m.fields = map[cellID]int64{}, map[cellID]map[writer]int64{}
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
