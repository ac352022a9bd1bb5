package simmodel

import (
	"context"
	"math/rand/v2"
	"sort"
	"sync"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// Redis is one region's Redis as the origin's scripts and the cross-region
// role use it: per cell the region's total (field t), what other regions
// counted (g) and one record per process incarnation, raised to an
// absolute total (origin/scripts.go); the role's lease, registry and
// denials (origin/role.go). It is safe for concurrent use.
type Redis struct {
	mu   sync.Mutex
	now  func() int64
	rng  *rand.Rand
	link Link
	down bool
	// runID is what INFO server reports, changed by each Restart.
	runID int64

	timeouts Timeouts
	cells    map[CellID]*Hash
	role     roleState
	// processes is the region's set of processes (origin/processes.go):
	// node → when its record lapses (ms).
	processes map[string]int64
	imports   []landing // the role's imports on their way, by when they land
	cost      RedisCost
	watch     func(id CellID, cur, prev Hash, at int64)
}

// Timeouts are the callers' bounds on calls, in milliseconds: a call
// slower than its bound fails (and, having reached Redis, was run there).
type Timeouts struct {
	// Read bounds reads and reservations (the engine's read_timeout).
	Read float64
	// Flush bounds a replay (the engine's flush timeout).
	Flush float64
	// Role bounds the cross-region role's calls (mysql_timeout).
	Role float64
}

// DefaultTimeouts are the defaults of the engine and the propagation
// layer.
var DefaultTimeouts = Timeouts{Read: 50, Flush: 1000, Role: 1000}

// CellID names a cell: a key and a sequence.
type CellID struct {
	Key engine.Key
	Seq int64
}

// Hash is one cell's hash.
type Hash struct {
	// T is the region's total; G what other regions counted (the role's
	// import).
	T, G int64
	// Expires is when the cell goes (Unix ms).
	Expires int64
	// Late is the scripts' l: a late write reached the previous cell, so
	// every answer about this one carries that cell's totals.
	Late bool
	// R and RG are a region reset's marks (origin/reset.go): what T and G
	// were when an operator reset the key. The cell says T − R and G − RG.
	R, RG int64
	recs  []record
	// marked: the hash holds only a late write's mark, and the expiry that
	// write gave it; the first write sets the cell's own (raise's made).
	marked bool
}

// Records is the number of process records in the cell (field n).
func (h *Hash) Records() int { return len(h.recs) }

type record struct {
	node string
	inc  uint32
	own  int64
}

// RedisCost is what a Redis did.
type RedisCost struct {
	// Calls are the commands clients sent: a script call, one command of
	// a pipeline. Reads, Reserves, Flushes (script calls of replays),
	// Role, Info, Overrides (the nodes' looks at the region's runtime
	// overrides) and Heartbeats (their records among the region's
	// processes) split them.
	Calls, Reads, Reserves, Flushes, Role, Info, Overrides, Heartbeats int64
	// Processed is what Redis counts in total_commands_processed: the
	// commands clients sent and those the scripts ran.
	Processed int64
}

// Add adds o to c.
func (c *RedisCost) Add(o RedisCost) {
	c.Calls += o.Calls
	c.Reads += o.Reads
	c.Reserves += o.Reserves
	c.Flushes += o.Flushes
	c.Role += o.Role
	c.Info += o.Info
	c.Overrides += o.Overrides
	c.Heartbeats += o.Heartbeats
	c.Processed += o.Processed
}

// manyChunk is the cells of one script call outside a Cluster
// (origin/many.go).
const manyChunk = 64

// NewRedis returns an empty Redis on the clock now (Unix ms) behind link,
// whose random draws come from seed.
func NewRedis(now func() int64, seed uint64, link Link, t Timeouts) *Redis {
	return &Redis{now: now, rng: newRand(seed, 1), link: link, timeouts: t,
		cells: map[CellID]*Hash{}, role: newRoleState(), processes: map[string]int64{}}
}

// SetDown makes Redis unreachable, or reachable again, whatever its Link
// says.
func (r *Redis) SetDown(down bool) {
	r.mu.Lock()
	r.down = down
	r.mu.Unlock()
}

// Restart empties Redis, as a restart without persistence does, and gives
// it a new run ID.
func (r *Redis) Restart() {
	r.mu.Lock()
	r.runID++
	r.cells = map[CellID]*Hash{}
	r.role = newRoleState()
	r.processes = map[string]int64{}
	r.imports = nil
	r.mu.Unlock()
}

// Watch sets f, called (with the lock held: f must not call r) after
// every change of a cell's T or G with the cell, the cell before it and
// the time of the change.
func (r *Redis) Watch(f func(id CellID, cur, prev Hash, at int64)) {
	r.mu.Lock()
	r.watch = f
	r.mu.Unlock()
}

// Cost returns what Redis did so far.
func (r *Redis) Cost() RedisCost {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cost
}

// Cell returns a copy of the cell id, after the imports that landed by
// now.
func (r *Redis) Cell(id CellID) (Hash, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.land(r.now())
	h := r.cells[id]
	if h == nil {
		return Hash{}, false
	}
	return Hash{T: h.T, G: h.G, Expires: h.Expires}, true
}

// Expire deletes the cells whose expiry passed, as Redis does; it returns
// how many went.
func (r *Redis) Expire() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	n := 0
	for id, h := range r.cells {
		if h.Expires <= now {
			delete(r.cells, id)
			n++
		}
	}
	return n
}

// Cells is the number of cells held.
func (r *Redis) Cells() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.cells)
}

// Mark counts the restart watch's read of its mark (a GET, once a
// second: origin/restart.go), which an operator's FLUSHALL takes away.
// Drawn with no latency or failure of its own, it leaves the model's
// random draws as they were.
func (r *Redis) Mark() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.down {
		return
	}
	r.cost.Calls++
	r.cost.Processed++
}

// Info counts one INFO server, the origin's check of the run ID on every
// slow tick, and returns the run ID, which only Restart changes; it fails
// while Redis is unreachable.
func (r *Redis) Info() (runID int64, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, err := r.call(r.timeouts.Role); err != nil {
		return 0, err
	}
	r.cost.Calls++
	r.cost.Info++
	r.cost.Processed++
	return r.runID, nil
}

// OverridesState counts one look of a node at the region's runtime
// overrides (origin.Redis.OverridesState): a pipeline of GET of the change
// counter and HGET of the region's mark, which every node sends each
// slow_tick while it is subscribed to their notices (overrides_sync.go),
// bounded by the read timeout. The model keeps no overrides: the counter
// never moves, and no look reads more.
func (r *Redis) OverridesState() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	applied, err := r.call(r.timeouts.Read)
	if applied {
		r.cost.Calls += 2
		r.cost.Overrides += 2
		r.cost.Processed += 2
	}
	return err
}

// Heartbeat renews node's record among the region's processes until lapse
// ms from now, drops the records that lapsed and returns how many are
// live, this one included (origin/processes.go): one script call, which
// runs TIME, ZREMRANGEBYSCORE, ZADD, PTTL, PEXPIRE and ZCARD. timeout
// bounds the call (ms; the real one, the heartbeat's interval).
func (r *Redis) Heartbeat(node string, lapse, timeout float64) (int64, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	applied, err := r.call(timeout)
	if !applied {
		return 0, err
	}
	r.cost.Calls++
	r.cost.Heartbeats++
	r.cost.Processed += 7
	now := r.now()
	for n, until := range r.processes {
		if until <= now {
			delete(r.processes, n)
		}
	}
	r.processes[node] = now + int64(lapse)
	if err != nil {
		return 0, err
	}
	return int64(len(r.processes)), nil
}

// call draws the fate of one call with timeout; applied reports whether
// Redis ran it (it may have, and still failed for the caller).
func (r *Redis) call(timeout float64) (applied bool, err error) {
	now := r.now()
	if r.down {
		return false, ErrDown
	}
	_, applied, err = r.link.call(r.rng, now, timeout)
	return applied, err
}

// expireAt is when a cell's hash expires: two windows after its own
// (origin/keys.go).
func expireAt(key engine.Key, seq int64) int64 { return (seq + 3) * key.Window.Milliseconds() }

// hash returns the cell id, making it with its expiry when new.
func (r *Redis) hash(id CellID) (*Hash, bool) {
	h := r.cells[id]
	if h != nil {
		return h, false
	}
	h = &Hash{Expires: expireAt(id.Key, id.Seq)}
	r.cells[id] = h
	return h, true
}

// written is hash for a write of the cell's own (a process's or an
// import): a hash that holds only a late write's mark is new to it, as
// the scripts see a hash without t, and takes the cell's own expiry.
func (r *Redis) written(id CellID) (*Hash, bool) {
	h, made := r.hash(id)
	if h.marked {
		h.marked, h.Expires, made = false, expireAt(id.Key, id.Seq), true
	}
	return h, made
}

func (h *Hash) rec(node string, inc uint32) *record {
	for i := range h.recs {
		if h.recs[i].node == node && h.recs[i].inc == inc {
			return &h.recs[i]
		}
	}
	return nil
}

// raise is the scripts' raise(): the record (node, inc) rises to own and
// the difference is added to t; a missing record is registered (n + 1).
// It returns the cell and the commands the script body ran: HMGET, and
// HSET (with PEXPIREAT for a new cell) when it wrote.
func (r *Redis) raise(id CellID, node string, inc uint32, own int64) (*Hash, int64) {
	h, made := r.written(id)
	rec := h.rec(node, inc)
	wrote := rec == nil || own > rec.own
	if rec == nil {
		h.recs = append(h.recs, record{node: node, inc: inc})
		rec = &h.recs[len(h.recs)-1]
	}
	if d := own - rec.own; d > 0 {
		h.T = engine.SatAdd(h.T, d)
		rec.own = own
		r.changed(id, h)
	}
	switch {
	case wrote && made:
		return h, 3
	case wrote:
		return h, 2
	}
	return h, 1
}

func (r *Redis) changed(id CellID, h *Hash) { r.notify(id, h, r.now()) }

// notify tells the watcher of a change of id at at (r.mu held).
func (r *Redis) notify(id CellID, h *Hash, at int64) {
	if r.watch == nil {
		return
	}
	var prev Hash
	if p := r.cells[CellID{id.Key, id.Seq - 1}]; p != nil {
		prev = Hash{T: p.T, G: p.G, Expires: p.Expires}
	}
	r.watch(id, Hash{T: h.T, G: h.G, Expires: h.Expires}, prev, at)
}

// says is what the cell says of the region's count and the imported one:
// T and G less a reset's marks.
func (h *Hash) says() (cur, global int64) { return max(h.T-h.R, 0), max(h.G-h.RG, 0) }

// totals is what a read returns for the record (node, inc) of id.
func (r *Redis) totals(id CellID, node string, inc uint32) engine.Totals {
	h := r.cells[id]
	var t engine.Totals
	if h != nil {
		t.Cur, t.Global = h.says()
		t.Shared, t.Processes = len(h.recs) > 1, int64(len(h.recs))
		if rec := h.rec(node, inc); rec != nil {
			t.Mine = rec.own
		}
	}
	if p := r.cells[CellID{id.Key, id.Seq - 1}]; p != nil {
		t.Prev, t.GlobalPrev = p.says()
	}
	return t
}

// ResetCells is a region reset of key (origin.Redis.ResetCells with
// version 0): the cell seq and the one before it, where they exist, say
// nothing of what they held before it, whatever is written to them
// later of that.
func (r *Redis) ResetCells(key engine.Key, seq int64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	applied, err := r.call(r.timeouts.Read)
	if !applied {
		return err
	}
	r.cost.Calls++
	for _, s := range []int64{seq, seq - 1} {
		if h := r.cells[CellID{key, s}]; h != nil && !h.marked {
			h.R, h.RG = h.T, h.G
			r.cost.Processed += 2 // HMGET, HSET
		}
	}
	return err
}

// Origin returns node's connection to r: what one process's engine uses.
func (r *Redis) Origin(node string) engine.Origin { return &originConn{r: r, node: node} }

// originConn is one process's origin on a model Redis.
type originConn struct {
	r    *Redis
	node string
}

var _ engine.Origin = (*originConn)(nil)

func (o *originConn) Read(_ context.Context, key engine.Key, seq int64, inc uint32) (engine.Totals, error) {
	r := o.r
	r.mu.Lock()
	defer r.mu.Unlock()
	applied, err := r.call(r.timeouts.Read)
	if !applied {
		return engine.Totals{}, err
	}
	r.land(r.now())
	id := CellID{key, seq}
	_, cmds := r.raise(id, o.node, inc, 0)
	r.cost.Calls++
	r.cost.Reads++
	r.cost.Processed += 1 + cmds + 1 // EVALSHA, raise, HMGET of the previous cell
	if err != nil {
		return engine.Totals{}, err
	}
	return r.totals(id, o.node, inc), nil
}

func (o *originConn) Flush(_ context.Context, batch []engine.Delta) error {
	r := o.r
	r.mu.Lock()
	defer r.mu.Unlock()
	applied, err := r.call(r.timeouts.Flush)
	if !applied {
		return err
	}
	r.land(r.now())
	calls := int64((len(batch) + manyChunk - 1) / manyChunk)
	r.cost.Calls += calls
	r.cost.Flushes += calls
	r.cost.Processed += calls
	for i := range batch {
		d := &batch[i]
		id := CellID{d.Key, d.Sequence}
		h, cmds := r.raise(id, o.node, d.Incarnation, d.Own)
		r.cost.Processed += cmds
		withPrev := !d.NoPrev || h.Late
		if withPrev {
			r.cost.Processed++ // HMGET of the previous cell
		}
		if d.Late {
			// HSET and PTTL of the next cell, and PEXPIREAT when that made it.
			next, made := r.hash(CellID{d.Key, d.Sequence + 1})
			next.Late = true
			r.cost.Processed += 2
			if made {
				next.Expires, next.marked = h.Expires, true
				r.cost.Processed++
			}
		}
		if err == nil {
			d.Totals, d.Done = r.totals(id, o.node, d.Incarnation), true
			if !withPrev {
				d.Totals.Prev, d.Totals.GlobalPrev = 0, 0
			}
		}
	}
	return err
}

func (o *originConn) Reserve(_ context.Context, res *engine.Reservation) error {
	r := o.r
	r.mu.Lock()
	defer r.mu.Unlock()
	applied, err := r.call(r.timeouts.Read)
	if !applied {
		return err
	}
	r.land(r.now())
	id := CellID{res.Key, res.Sequence}
	h, cmds := r.raise(id, o.node, res.Incarnation, res.Own)
	r.cost.Calls++
	r.cost.Reserves++
	r.cost.Processed += 1 + cmds + 1
	var pt, pg int64
	if p := r.cells[CellID{res.Key, res.Sequence - 1}]; p != nil {
		pt, pg = p.says()
	}
	cur, g := h.says()
	imported := max(res.Global, g)
	weighed := engine.SatAdd(pt, max(res.GlobalPrev, pg))
	w := res.Key.Window.Milliseconds()
	var charged int64
	admit := func(cost int64) bool {
		room := res.Limit - engine.SatAdd(engine.SatAdd(cur, charged), imported) - cost
		if room < 0 || (weighed != 0 && res.Elapsed < w && weighed*(w-res.Elapsed) >= (room+1)*w) {
			return false
		}
		charged += cost
		return true
	}
	admitted := admit(res.Cost)
	joined := make([]bool, len(res.Joined))
	for i, c := range res.Joined {
		joined[i] = admit(c)
	}
	if charged > 0 {
		h.T = engine.SatAdd(h.T, charged)
		rec := h.rec(o.node, res.Incarnation)
		rec.own = engine.SatAdd(rec.own, charged)
		r.cost.Processed++
		r.changed(id, h)
	}
	if err != nil {
		return err
	}
	res.Admitted, res.JoinedAdmitted = admitted, joined
	res.Totals = r.totals(id, o.node, res.Incarnation)
	return nil
}

// landing is an import of the role on its way to a cell.
type landing struct {
	at    int64
	id    CellID
	count int64
}

// land applies the imports that landed by now (r.mu held).
func (r *Redis) land(now int64) {
	i := 0
	for ; i < len(r.imports) && r.imports[i].at <= now; i++ {
		im := r.imports[i]
		h, _ := r.written(im.id)
		if im.count > h.G {
			h.G = im.count
			r.notify(im.id, h, im.at)
		}
	}
	if i > 0 {
		r.imports = append(r.imports[:0], r.imports[i:]...)
	}
}

// sendImport queues an import to land at at (r.mu held).
func (r *Redis) sendImport(at int64, id CellID, count int64) {
	l := landing{at: at, id: id, count: count}
	i := sort.Search(len(r.imports), func(i int) bool { return r.imports[i].at > at })
	r.imports = append(r.imports, landing{})
	copy(r.imports[i+1:], r.imports[i:])
	r.imports[i] = l
}

// cellOf names a role cell as the engine does.
func cellOf(c propagation.Cell) CellID {
	return CellID{engine.Key{Namespace: c.Namespace, Identifier: c.Identifier, Window: msDuration(c.WindowMs)}, c.Sequence}
}

// Sub subtracts o from c.
func (c *RedisCost) Sub(o RedisCost) {
	c.Calls -= o.Calls
	c.Reads -= o.Reads
	c.Reserves -= o.Reserves
	c.Flushes -= o.Flushes
	c.Role -= o.Role
	c.Info -= o.Info
	c.Overrides -= o.Overrides
	c.Heartbeats -= o.Heartbeats
	c.Processed -= o.Processed
}
