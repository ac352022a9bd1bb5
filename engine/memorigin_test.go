package engine

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
)

// memOrigin is an in-memory Origin for the engine's own tests: it counts
// calls and can block, fail or ignore its context on demand. What Redis does
// is tested against Redis in package origin.
type memOrigin struct {
	mu     sync.Mutex
	totals map[cellID]int64

	reads, flushes atomic.Int64
	// readErr and flushErr, when set, fail the next calls.
	readErr, flushErr atomic.Pointer[error]
	// gate, when set, blocks reads until it is closed, ignoring ctx (a
	// hung origin).
	gate atomic.Pointer[chan struct{}]
	// entered counts reads that reached the gate.
	entered atomic.Int64
}

type cellID struct {
	key Key
	seq int64
}

func newMemOrigin() *memOrigin { return &memOrigin{totals: map[cellID]int64{}} }

func (m *memOrigin) Read(ctx context.Context, key Key, seq int64) (int64, int64, error) {
	m.reads.Add(1)
	m.entered.Add(1)
	if g := m.gate.Load(); g != nil {
		<-*g
	}
	if p := m.readErr.Load(); p != nil {
		return 0, 0, *p
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.totals[cellID{key, seq}], m.totals[cellID{key, seq - 1}], nil
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
		m.totals[id] += batch[i].Delta
		batch[i].Total = m.totals[id]
		batch[i].Done = true
	}
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

func (m *memOrigin) failReads(err error) {
	if err == nil {
		m.readErr.Store(nil)
		return
	}
	m.readErr.Store(&err)
}

func (m *memOrigin) failFlushes(err error) {
	if err == nil {
		m.flushErr.Store(nil)
		return
	}
	m.flushErr.Store(&err)
}

var errOriginDown = errors.New("origin down")
