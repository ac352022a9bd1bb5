package nodecheck

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// MemoryCluster is a Cluster whose origin is in memory: a model of the
// Redis scripts' semantics (one record per process and cell incarnation,
// raised to an absolute total; the region's totals; a read registers the
// process), which fails every call while down and empties on Restart.
type MemoryCluster struct {
	store   *memStore
	engines []*engine.Engine
	clocks  []*testclock.Clock
}

// NewMemoryCluster returns n engines on one in-memory origin. Close them
// with Close.
func NewMemoryCluster(n int) *MemoryCluster {
	c := &MemoryCluster{store: &memStore{totals: map[memCell]int64{}, fields: map[memCell]map[memField]int64{}}}
	for i := range n {
		clk := testclock.New(time.Unix(0, 0))
		e := engine.New(EngineConfig(clk.Now))
		e.SetOrigin(&memOrigin{store: c.store, node: strconv.Itoa(i)})
		c.engines = append(c.engines, e)
		c.clocks = append(c.clocks, clk)
	}
	return c
}

// EngineConfig is the configuration of a Cluster's engines.
func EngineConfig(now func() time.Time) engine.Config {
	return engine.Config{Now: now, Manual: true, MaxEntries: 24, ReadTimeout: 50 * time.Millisecond,
		FastTick: FastTick, SlowTick: SlowTick}
}

// Engine implements Cluster.
func (c *MemoryCluster) Engine(i int) *engine.Engine { return c.engines[i] }

// SetClock implements Cluster.
func (c *MemoryCluster) SetClock(i int, t time.Time) { c.clocks[i].Set(t) }

// Reload implements Cluster.
func (c *MemoryCluster) Reload(i int) {
	c.engines[i].SetTiming(engine.Timing{FastTick: FastTick, SlowTick: SlowTick})
	c.engines[i].SetOrigin(&memOrigin{store: c.store, node: strconv.Itoa(i)})
}

// Restart implements Cluster.
func (c *MemoryCluster) Restart() {
	c.store.mu.Lock()
	c.store.totals, c.store.fields = map[memCell]int64{}, map[memCell]map[memField]int64{}
	c.store.mu.Unlock()
}

// SetDown implements Cluster.
func (c *MemoryCluster) SetDown(down bool) { c.store.down.Store(down) }

// Settle implements Cluster; a test running the cluster in a synctest
// bubble waits there instead.
func (c *MemoryCluster) Settle() {}

// Close closes the engines.
func (c *MemoryCluster) Close() {
	for _, e := range c.engines {
		_ = e.Close(context.Background())
	}
}

// errDown is the error of every call while the origin is down.
var errDown = errors.New("origin down")

type memCell struct {
	key engine.Key
	seq int64
}

type memField struct {
	node string
	inc  uint32
}

// memStore is what the origin holds, shared by the processes that use it.
type memStore struct {
	mu     sync.Mutex
	totals map[memCell]int64
	fields map[memCell]map[memField]int64
	down   atomic.Bool
}

// memOrigin is one process's connection to the store.
type memOrigin struct {
	store *memStore
	node  string
}

var _ engine.Origin = (*memOrigin)(nil)

func (m *memOrigin) hash(id memCell) map[memField]int64 {
	h := m.store.fields[id]
	if h == nil {
		h = map[memField]int64{}
		m.store.fields[id] = h
	}
	return h
}

func (m *memOrigin) totals(id memCell, inc uint32) engine.Totals {
	h := m.store.fields[id]
	return engine.Totals{Cur: m.store.totals[id], Prev: m.store.totals[memCell{id.key, id.seq - 1}],
		Mine: h[memField{m.node, inc}], Shared: len(h) > 1}
}

// raise is the idempotent write: the incarnation's record rises to own.
func (m *memOrigin) raise(id memCell, inc uint32, own int64) {
	h, f := m.hash(id), memField{m.node, inc}
	if d := own - h[f]; d > 0 {
		m.store.totals[id] = engine.SatAdd(m.store.totals[id], d)
		h[f] = own
	}
}

func (m *memOrigin) Read(_ context.Context, key engine.Key, seq int64, inc uint32) (engine.Totals, error) {
	if m.store.down.Load() {
		return engine.Totals{}, errDown
	}
	m.store.mu.Lock()
	defer m.store.mu.Unlock()
	id := memCell{key, seq}
	if h, f := m.hash(id), (memField{m.node, inc}); true {
		if _, ok := h[f]; !ok {
			h[f] = 0 // a read registers the process
		}
	}
	return m.totals(id, inc), nil
}

func (m *memOrigin) Flush(_ context.Context, batch []engine.Delta) error {
	if m.store.down.Load() {
		return errDown
	}
	m.store.mu.Lock()
	defer m.store.mu.Unlock()
	for i := range batch {
		d := &batch[i]
		id := memCell{d.Key, d.Sequence}
		m.raise(id, d.Incarnation, d.Own)
		d.Totals, d.Done = m.totals(id, d.Incarnation), true
	}
	return nil
}

func (m *memOrigin) Reserve(_ context.Context, r *engine.Reservation) error {
	if m.store.down.Load() {
		return errDown
	}
	m.store.mu.Lock()
	defer m.store.mu.Unlock()
	id := memCell{r.Key, r.Sequence}
	h, f := m.hash(id), memField{m.node, r.Incarnation}
	m.raise(id, r.Incarnation, r.Own)
	prev := engine.SatAdd(m.store.totals[memCell{r.Key, r.Sequence - 1}], r.GlobalPrev)
	w := r.Key.Window.Milliseconds()
	admit := func(cost int64) bool {
		cur := engine.SatAdd(m.store.totals[id], r.Global)
		room := r.Limit - cur - cost
		if room < 0 || (r.Elapsed < w && prev*(w-r.Elapsed) >= (room+1)*w) {
			return false
		}
		m.store.totals[id] = engine.SatAdd(m.store.totals[id], cost)
		h[f] = engine.SatAdd(h[f], cost)
		return true
	}
	r.Admitted = admit(r.Cost)
	r.JoinedAdmitted = make([]bool, len(r.Joined))
	for i, c := range r.Joined {
		r.JoinedAdmitted[i] = admit(c)
	}
	r.Totals = m.totals(id, r.Incarnation)
	return nil
}
