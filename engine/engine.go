package engine

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/puzpuzpuz/xsync/v4"
)

// Defaults of Config. Each says why.
const (
	// DefaultMaxEntries bounds live entries: about 230 MB at the budget of
	// 250 bytes per entry, far beyond the keys an edge node sees in a window,
	// and small enough that a flood of identifiers cannot exhaust memory.
	DefaultMaxEntries = 1_000_000
	// DefaultReadTimeout bounds a synchronous origin read: a regional Redis
	// answers in about a millisecond, so 50 ms is a sick origin, and no
	// request should wait longer for one.
	DefaultReadTimeout = 50 * time.Millisecond
	// DefaultFreshness is how long an origin read or replay keeps a cell
	// fresh: short enough that an idle node never serves an old view for the
	// rest of a long window, long enough that a busy key is kept fresh by its
	// own replays.
	DefaultFreshness = time.Second
	// DefaultSlowTick replays keys below half their limit: ten round trips a
	// second per busy node, whatever the request rate.
	DefaultSlowTick = 100 * time.Millisecond
	// DefaultFastTick replays keys at half their limit or more, where other
	// nodes need our count soon.
	DefaultFastTick = 10 * time.Millisecond
	// DefaultReplayWorkers flush batches in parallel, so one slow partition
	// does not hold up the others.
	DefaultReplayWorkers = 8
	// DefaultJanitorInterval is how often idle entries and expired strict
	// deadlines are dropped.
	DefaultJanitorInterval = 10 * time.Second
)

// Config configures an Engine. The zero value is a local-only engine with
// every default.
type Config struct {
	// Now is the clock; default time.Now.
	Now func() time.Time
	// MaxEntries is the hard cap on live entries; default DefaultMaxEntries.
	MaxEntries int
	// ReadTimeout bounds every synchronous origin read; default
	// DefaultReadTimeout.
	ReadTimeout time.Duration
	// Freshness is how long a read or replay keeps a cell fresh; default
	// DefaultFreshness.
	Freshness time.Duration
	// SlowTick and FastTick are the replay intervals below and above half
	// the limit; defaults DefaultSlowTick and DefaultFastTick.
	SlowTick, FastTick time.Duration
	// ReplayWorkers is the number of concurrent flushes; default
	// DefaultReplayWorkers.
	ReplayWorkers int
	// JanitorInterval is how often idle entries are dropped; default
	// DefaultJanitorInterval.
	JanitorInterval time.Duration
	// OnFirstDenial, if set, is called once per cell, on the request path,
	// when the cell denies its first request. It must not block.
	OnFirstDenial func(Denial)
	// OnEvict, if set, is called after the entry cap forced evictions, with
	// their number. It runs on the janitor goroutine.
	OnEvict func(n int)

	// Manual starts no background loop: replay and the janitor run only
	// when ReplayOnce, Sweep and Evict are called. For tests and embedders
	// that drive time themselves.
	Manual bool
}

// Timing is the part of the configuration that follows the origin's
// settings and may change while the engine runs (a reload that changes
// them). Zero fields keep their current value.
type Timing struct {
	ReadTimeout, Freshness, SlowTick, FastTick time.Duration
}

// SetTiming changes the read timeout, freshness and replay ticks; the ticks
// take effect at their next firing.
func (e *Engine) SetTiming(t Timing) {
	for _, f := range []struct {
		v   time.Duration
		dst *atomic.Int64
	}{{t.ReadTimeout, &e.readTimeout}, {t.Freshness, &e.freshness}, {t.SlowTick, &e.slowTick}, {t.FastTick, &e.fastTick}} {
		if f.v > 0 {
			f.dst.Store(int64(f.v))
		}
	}
}

// Timing returns the read timeout, freshness and replay ticks in force.
func (e *Engine) Timing() Timing {
	return Timing{
		ReadTimeout: e.readTimeoutD(),
		Freshness:   time.Duration(e.freshness.Load()),
		SlowTick:    time.Duration(e.slowTick.Load()),
		FastTick:    time.Duration(e.fastTick.Load()),
	}
}

// Now is the engine's clock (Config.Now).
func (e *Engine) Now() time.Time { return e.now() }

func (e *Engine) readTimeoutD() time.Duration { return time.Duration(e.readTimeout.Load()) }
func (e *Engine) freshnessMs() int64          { return time.Duration(e.freshness.Load()).Milliseconds() }
func (e *Engine) fastTickMs() int64           { return time.Duration(e.fastTick.Load()).Milliseconds() }

// Denial describes the first denial of a cell.
type Denial struct {
	Limit
	// Sequence is the denying cell's sequence.
	Sequence int64
	// Used is the effective count before the request's cost.
	Used int64
}

// Engine decides limits. It is safe for concurrent use; one Engine serves a
// whole process.
type Engine struct {
	cfg     Config
	now     func() time.Time
	zones   *xsync.Map[zoneKey, *Zone]
	live    atomic.Int64
	flights *xsync.Map[*cell, *flight]
	// reservations are the origin decisions in flight, one per cell.
	reservations *xsync.Map[*cell, *group]
	origin       atomic.Pointer[originBox]
	// strictLive counts strict deadlines, bounded by MaxEntries.
	strictLive atomic.Int64

	// queues are the replay queues, made (and the replay loop started)
	// when an origin is first set.
	queues    atomic.Pointer[replayQueues]
	queueLen  int
	queueOnce sync.Once
	bgReads   atomic.Int64

	stats counters
	// graves are recently dropped cells, for Resend (janitor.go).
	graves graveyard
	// failing is set by a failed origin call, cleared by the next success;
	// untrusted ends the suspect period that starts then (read.go).
	failing   atomic.Bool
	untrusted atomic.Int64

	// The Timing values, in nanoseconds.
	readTimeout, freshness, slowTick, fastTick atomic.Int64

	evictNow chan struct{}
	stop     chan struct{}
	// life guards stopped against the start of the replay loop, so Close
	// never races a loop starting.
	life    sync.Mutex
	stopped bool
	wg      sync.WaitGroup

	// global is the cross-region layer, if any (see global.go).
	global atomic.Pointer[globalBox]
}

// originBox lets an interface sit in an atomic.Pointer.
type originBox struct{ o Origin }

// New returns an engine and starts its janitor; the replay loop starts with
// the first origin. Close stops them.
func New(cfg Config) *Engine {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.MaxEntries <= 0 {
		cfg.MaxEntries = DefaultMaxEntries
	}
	if cfg.ReadTimeout <= 0 {
		cfg.ReadTimeout = DefaultReadTimeout
	}
	if cfg.Freshness <= 0 {
		cfg.Freshness = DefaultFreshness
	}
	if cfg.SlowTick <= 0 {
		cfg.SlowTick = DefaultSlowTick
	}
	if cfg.FastTick <= 0 {
		cfg.FastTick = DefaultFastTick
	}
	if cfg.ReplayWorkers <= 0 {
		cfg.ReplayWorkers = DefaultReplayWorkers
	}
	if cfg.JanitorInterval <= 0 {
		cfg.JanitorInterval = DefaultJanitorInterval
	}
	e := &Engine{
		cfg:          cfg,
		now:          cfg.Now,
		zones:        xsync.NewMap[zoneKey, *Zone](),
		flights:      xsync.NewMap[*cell, *flight](),
		reservations: xsync.NewMap[*cell, *group](),
		queueLen:     replayQueueLen,
		evictNow:     make(chan struct{}, 1),
		stop:         make(chan struct{}),
	}
	e.SetTiming(Timing{ReadTimeout: cfg.ReadTimeout, Freshness: cfg.Freshness, SlowTick: cfg.SlowTick, FastTick: cfg.FastTick})
	if !cfg.Manual {
		e.wg.Add(1)
		go e.janitorLoop()
	}
	return e
}

// SetOrigin attaches the regional origin, or detaches it with nil (local
// only). Cells already counted keep their counts. The replay loop starts
// with the first origin: a local-only engine runs no replay goroutine.
func (e *Engine) SetOrigin(o Origin) {
	if o == nil {
		e.origin.Store(nil)
		return
	}
	e.makeQueues()
	e.origin.Store(&originBox{o})
}

// Origin returns the current origin, or nil when local-only.
func (e *Engine) Origin() Origin { return e.getOrigin() }

// Flush replays every pending delta to the current origin now, within
// ctx's deadline; a no-op without origin.
func (e *Engine) Flush(ctx context.Context) error {
	if o := e.getOrigin(); o != nil {
		return e.flushAll(ctx, o)
	}
	return nil
}

// FlushTo replays every pending delta to o now, within ctx's deadline,
// whatever origin the engine uses: for a config whose origin is being let
// go (a reload without it) while it can still take the units.
func (e *Engine) FlushTo(ctx context.Context, o Origin) error {
	if o == nil {
		return nil
	}
	return e.flushAll(ctx, o)
}

// makeQueues makes the replay queues and starts the replay loop, once.
func (e *Engine) makeQueues() {
	e.queueOnce.Do(func() {
		e.queues.Store(&replayQueues{slow: newQueue(e.queueLen), fast: newQueue(e.queueLen)})
		e.life.Lock()
		defer e.life.Unlock()
		if !e.cfg.Manual && !e.stopped {
			e.wg.Add(1)
			go e.replayLoop()
		}
	})
}

func (e *Engine) getOrigin() Origin {
	if b := e.origin.Load(); b != nil {
		return b.o
	}
	return nil
}

// Close stops the background goroutines, then replays every pending delta
// to the origin within ctx's deadline. Decisions made after Close still
// work, locally.
func (e *Engine) Close(ctx context.Context) error {
	// Stop the loops first: their flushes in flight finish, so the final
	// sweep below sees every cell settled.
	e.life.Lock()
	if !e.stopped {
		e.stopped = true
		close(e.stop)
	}
	e.life.Unlock()
	e.wg.Wait()
	return e.Flush(ctx)
}

func (e *Engine) nowMs() int64 { return e.now().UnixMilli() }

// located is one limit resolved to its cell at the time of the decision.
type located struct {
	zone *Zone
	id   string
	en   *entry
	cur  *cell
	w, r int64
	// wouldDeny and dryRetry record, for a dry-run limit of a batch, the
	// denial it would have been.
	wouldDeny bool
	dryRetry  time.Duration
}

func (lc *located) key() Key { return lc.zone.key(lc.id) }

// locate finds (or creates) the entry of l and its current cell at now.
// With linked set (the engine has an origin or a global layer, whose
// counters only a linked cell holds) the cell is a linked cell: a plain
// cell made before is upgraded here, before the decision charges it.
//
// Nearly every decision finds the entry's current cell to be the cell of
// now: that is tested with one multiplication, and the sequence of now (a
// division) is computed only when it is not (see rotate).
func (e *Engine) locate(lc *located, l *Limit, now int64, linked bool) {
	z := l.Zone
	if z == nil {
		z = e.Zone(l.Namespace, l.Window)
	}
	id := l.Identifier
	if len(id) > MaxIdentifierLen {
		id = NormalizeIdentifier(id)
	}
	w := z.w
	for {
		en, ok := z.entries.Load(id)
		if !ok {
			en = e.insert(z, id, now/w, linked)
		}
		// c.seq ≥ 0 leaves out the tombstone (and the truncated division
		// of a clock before 1970, which rotate handles as it always did).
		c := en.cur.Load()
		if c.seq < 0 || uint64(now-c.seq*w) >= uint64(w) {
			if c = e.rotate(z, id, en, now, w, linked); c == nil {
				continue
			}
		}
		if linked {
			if c = e.link(z, id, en, &en.cur, c); c == nil {
				continue
			}
			// The limit the count is decided against, for the cross-region
			// layer; written only when it changes.
			if x := c.links(); x != nil && x.limit.Load() != l.Limit {
				x.limit.Store(l.Limit)
			}
		}
		r := now - c.seq*w
		if r < 0 {
			r = 0
		}
		lc.zone, lc.id, lc.en, lc.cur, lc.w, lc.r = z, id, en, c, w, r
		return
	}
}

// rotate returns en's cell for now when the current cell is not (the
// window has moved on, the clock stepped, or the entry was removed): the
// rotated cell, or a cell ahead of now, or a replacement of a cell more
// than a window ahead. nil: removed by the janitor between the load and
// the rotation, or rotated by another request meanwhile; look again, a
// fresh entry may already stand in its place.
func (e *Engine) rotate(z *Zone, id string, en *entry, now, w int64, linked bool) *cell {
	seq := now / w
	c, gone := en.current(seq, linked)
	if gone[0] != nil || gone[1] != nil {
		e.buryCells(z, id, gone)
	}
	if c != nil && c.state.Load()&stRead == 0 && e.origin.Load() == nil {
		c.setBits(stRead) // nothing to read: as insert marks a new entry's cell
	}
	if c != nil && c.seq > seq+1 && e.nowMs()/w+1 < c.seq {
		// More than a window ahead of a clock read just now: the clock
		// stepped back (a request that read it long ago finds the clock
		// past seq and keeps the cell).
		stale := c
		var dropped *cell
		c, dropped = en.replaceStale(c, seq, linked)
		if c != nil {
			e.buryCell(z, id, stale)
		}
		if dropped != nil {
			// Its units, replayed or not, must come back should the
			// origin restart empty (see Resend).
			e.buryCell(z, id, dropped)
		}
		if c != nil && e.origin.Load() == nil {
			c.setBits(stRead) // as insert marks a new entry's cell
		}
	}
	return c
}

// insert adds a new entry for id, or returns the one that won a race. Its
// cell is a linked cell when linked is set.
func (e *Engine) insert(z *Zone, id string, seq int64, linked bool) *entry {
	hasOrigin := e.origin.Load() != nil
	en, loaded := z.entries.LoadOrCompute(id, func() (*entry, bool) {
		c := newCell(seq, linked)
		if !hasOrigin {
			c.setBits(stRead)
		}
		n := &entry{}
		n.cur.Store(c)
		return n, false
	})
	if !loaded {
		e.entryCreated(z, id, seq)
		if e.live.Add(1) > int64(e.cfg.MaxEntries) {
			select {
			case e.evictNow <- struct{}{}:
			default:
			}
		}
	}
	return en
}

// link returns c, which slot (en.cur or en.prev) holds, as a linked cell:
// c itself when it is one, else its upgrade (nil: look again).
func (e *Engine) link(z *Zone, id string, en *entry, slot *atomic.Pointer[cell], c *cell) *cell {
	if c.state.Load()&stLinked != 0 {
		return c
	}
	return e.upgrade(z, id, en, slot, c)
}

// upgrade replaces c, a plain cell that slot (en.cur or en.prev) holds,
// with a linked copy and returns the copy; nil when slot no longer holds
// c (rotated, removed, or upgraded by another caller: look again).
//
// The copy is installed by compare-and-swap, then what was charged into c
// between the copy and the swap is added to it: count and spec are read
// again after the swap and their change added. A unit charged into c after
// that re-read is lost. Only a request that located c while the engine had
// neither origin nor global layer can still charge it then (every other
// one upgrades, or finds the upgrade, before it charges), and only in the
// nanoseconds between its lookup and its compare-and-swap: at most one
// request per goroutine that was in that window at the swap.
//
// A current cell upgraded while the engine has an origin hands its
// committed units over: they become pending and replay, as if they had
// been committed with the origin in place. A plain current cell holds only
// this process's units (nothing merges into it before its upgrade), so
// none is counted twice. A previous cell is not handed over: the origin's
// totals may have been merged into it, and it weighs less every moment.
func (e *Engine) upgrade(z *Zone, id string, en *entry, slot *atomic.Pointer[cell], c *cell) *cell {
	n := newCell(c.seq, true)
	count, spec := c.count.Load(), c.spec.Load()
	n.count.Store(count)
	n.spec.Store(spec)
	n.state.Store(c.state.Load() | stLinked)
	if testHookUpgrade != nil {
		testHookUpgrade(c)
	}
	if !slot.CompareAndSwap(c, n) {
		return nil
	}
	count2, spec2 := c.count.Load(), c.spec.Load()
	if d := count2 - count; d > 0 {
		addSat(&n.count, d)
	} else if d < 0 {
		n.count.Add(d) // a batch rolled back
	}
	n.spec.Add(spec2 - spec)
	n.setBits(c.state.Load() & stBlocked) // a first denial meanwhile
	if slot == &en.cur && e.origin.Load() != nil {
		if u := count2 - spec2; u > 0 {
			n.links().pending.Add(u)
			e.markDirty(z, id, n, true) // first units: the fast tick, as in committed
		}
	}
	return n
}

// snapshot returns the current cell's own count n, as a compare-and-swap
// must expect it, with the weighed counts derived from that same load.
func (lc *located) snapshot() (n, cur, prev int64) {
	n = lc.cur.count.Load()
	cur = SatAdd(n, lc.cur.globalCount())
	if p := lc.en.previous(lc.cur); p != nil {
		// p.total(), which is over the inlining budget.
		prev = SatAdd(p.count.Load(), p.globalCount())
	}
	return n, cur, prev
}

// clampLimit bounds a limit's units to [0, MaxCount], so that no cost or
// limit, however hostile, can overflow the arithmetic or refund units.
func clampLimit(l *Limit) {
	if uint64(l.Cost) > MaxCount {
		l.Cost = ClampCount(l.Cost)
	}
	if uint64(l.Limit) > MaxCount {
		l.Limit = ClampCount(l.Limit)
	}
}

// charge adds cost to the cell's count if it still holds n, the count the
// verdict was computed from, and reports whether it did. A concurrent
// allow changes the count and forces a recomputation; global and previous
// counts are not part of the swap: they only grow, and a change there can
// only have made the verdict a little early, never admit past the count.
func charge(c *cell, n, cost int64) bool {
	return cost == 0 || c.count.CompareAndSwap(n, SatAdd(n, cost))
}

// Decide decides one limit and, when it allows, charges its cost. A denial
// never waits. With an origin, a cold or stale cell is read first, and a
// shared cell near its limit (or in strict mode) is decided at the origin;
// all of it within one read timeout, after which the decision is local.
//
// The steps below fill d in place rather than return a Decision each: a
// 40-byte result handed up through three calls was copied at each level,
// and each copy read back stores just made (a store-forwarding stall),
// which cost as much as the rest of a local decision.
func (e *Engine) Decide(ctx context.Context, l Limit) (d Decision) {
	clampLimit(&l)
	now := e.nowMs()
	o := e.getOrigin()
	var lc located
	e.locate(&lc, &l, now, o != nil || e.global.Load() != nil)
	if o == nil {
		e.decideLocal(&d, &lc, &l)
		return d
	}
	var dl deadline
	defer dl.stop()
	if f := e.converge(o, &lc, &l, now); f != nil {
		e.stats.syncReads.Add(1)
		if !dl.wait(ctx, e, f.done) {
			e.stats.readWaitTimeouts.Add(1)
		}
	}
	e.decideAtOrigin(ctx, &d, o, &lc, &l, now, &dl)
	return d
}

// decideLocal decides lc on local counts alone, into d.
func (e *Engine) decideLocal(d *Decision, lc *located, l *Limit) {
	for {
		n, cur, prev := lc.snapshot()
		ok := fits(cur, prev, l.Cost, l.Limit, lc.w, lc.r)
		if !ok && !l.DryRun {
			e.deny(d, lc, l, cur, prev)
			return
		}
		if charge(lc.cur, n, l.Cost) {
			e.allow(d, lc, l, ok, cur, prev)
			return
		}
	}
}

// allow builds, into d, the decision of a charged request and queues its
// units for replay. ok is the limit's verdict, false only for a dry run
// (charged because the request is served anyway, reported as the denial
// it would have been, recording nothing a denial records).
func (e *Engine) allow(d *Decision, lc *located, l *Limit, ok bool, cur, prev int64) {
	after := SatAdd(cur, l.Cost)
	if l.Cost != 0 && e.origin.Load() != nil {
		e.committed(lc, l.Cost, SatAdd(after, weighted(prev, lc.w, lc.r)), l.Limit)
	}
	lc.passed(d, l.Limit, after, prev)
	if !ok {
		d.Allowed = false
		d.RetryAfter = retryAfter(cur, prev, l.Cost, l.Limit, lc.w, lc.r)
	}
}

// passed writes to d the decision of a request that passes limit, with the
// counts (cur, prev) after it.
func (lc *located) passed(d *Decision, limit, cur, prev int64) {
	d.Allowed = true
	d.Limit = limit
	d.Remaining = remaining(cur, prev, limit, lc.w, lc.r)
	d.Reset = msDuration(lc.w - lc.r)
	d.RetryAfter = 0
}

// retryAfter is the Retry-After of a denial at (cur, prev), or Never.
func retryAfter(cur, prev, cost, limit, w, r int64) time.Duration {
	ra := retryAfterMs(cur, prev, cost, limit, w, r)
	if ra < 0 {
		return Never
	}
	// At least a millisecond even where the origin denied what the local
	// counts would pass (it weighs counts this process never saw).
	return msDuration(max(ra, 1))
}

// deny builds a denial into d and records what a denial records: strict
// mode and the cell's first denial. It never waits and never calls the
// origin.
func (e *Engine) deny(d *Decision, lc *located, l *Limit, cur, prev int64) {
	d.Allowed = false
	d.Limit = l.Limit
	d.Remaining = remaining(cur, prev, l.Limit, lc.w, lc.r)
	d.Reset = msDuration(lc.w - lc.r)
	d.RetryAfter = retryAfter(cur, prev, l.Cost, l.Limit, lc.w, lc.r)
	if e.origin.Load() != nil {
		e.markStrict(lc.zone, lc.id, lc.cur.seq*lc.w+lc.r+lc.w)
	}
	if lc.cur.state.Load()&stBlocked == 0 && lc.cur.setBits(stBlocked) {
		e.firstDenial(lc, l, cur, prev)
	}
}

// firstDenial records the first denial of lc's cell: counted, notified
// (Config.OnFirstDenial) and handed to the cross-region layer. Out of
// deny, so that deny, which every denial runs, stays small.
func (e *Engine) firstDenial(lc *located, l *Limit, cur, prev int64) {
	e.stats.firstDenials.Add(1)
	if f := e.cfg.OnFirstDenial; f != nil {
		used := SatAdd(cur, weighted(prev, lc.w, lc.r))
		lim := *l
		lim.Key, lim.Zone = lc.key(), lc.zone
		f(Denial{Limit: lim, Sequence: lc.cur.seq, Used: used})
	}
	e.globalDenial(lc, l, cur, prev)
}

// committed records cost committed units in the cell for replay; effective
// is the key's effective count with them, which picks the replay tier.
func (e *Engine) committed(lc *located, cost, effective, limit int64) {
	if cost == 0 || e.origin.Load() == nil {
		return
	}
	x := lc.cur.links()
	if x == nil {
		// Located before the origin was set: the units are in the count,
		// which an upgrade hands over (see upgrade).
		return
	}
	x.pending.Add(cost)
	// The first units of a cell replay on the fast tick: a key that starts
	// on several processes at once is known to be shared within a tick.
	fast := lc.cur.state.Load()&stShared != 0 || x.own.Load() == 0 || pressureAtLeast(effective, limit, 1, 2)
	e.markDirty(lc.zone, lc.id, lc.cur, fast)
}

// DecideMany decides several limits all-or-nothing: every cost is reserved
// speculatively, and either every reservation commits (the request passes
// every limit) or every one is rolled back, so a denial by one limit charges
// no other. out[i] receives limit i's own verdict; len(out) must be at least
// len(ls). It reports whether the request passes.
//
// With an origin, the limits' reads are made in parallel and waited for
// together, within one read timeout. A batch does not reserve at the
// origin: a shared limit near its limit reads the origin's count (a check
// without charging) and its units reach the origin by replay, on the fast
// tick. So a batch can admit past a limit by what other processes admit
// between that read and their next replay (see the README's accuracy
// bound).
func (e *Engine) DecideMany(ctx context.Context, ls []Limit, out []Decision) bool {
	if len(ls) == 1 {
		out[0] = e.Decide(ctx, ls[0])
		return out[0].Allowed
	}
	var stack [8]located
	lcs := stack[:0]
	if len(ls) > len(stack) {
		lcs = make([]located, len(ls))
	}
	lcs = lcs[:len(ls)]
	now := e.nowMs()
	o := e.getOrigin()
	linked := o != nil || e.global.Load() != nil
	for i := range ls {
		clampLimit(&ls[i])
		e.locate(&lcs[i], &ls[i], now, linked)
	}
	if o != nil {
		e.convergeAll(ctx, o, lcs, ls, now)
	}
	reserved := 0
	for i := range ls {
		if !e.reserve(&lcs[i], &ls[i]) {
			break
		}
		reserved++
	}
	if reserved < len(ls) {
		// Give back every reservation before any verdict is written, so a
		// limit's Remaining shows the state without this request. spec
		// first: a merge that saw count without the units but spec with
		// them would add them back for good.
		for i := 0; i < reserved; i++ {
			lcs[i].cur.spec.Add(-ls[i].Cost)
			if testHookRollback != nil {
				testHookRollback(lcs[i].cur)
			}
			lcs[i].cur.count.Add(-ls[i].Cost)
		}
		for i := range ls {
			lc := &lcs[i]
			_, cur, prev := lc.snapshot()
			ok := fits(cur, prev, ls[i].Cost, ls[i].Limit, lc.w, lc.r)
			if !ok && !ls[i].DryRun {
				e.deny(&out[i], lc, &ls[i], cur, prev)
				continue
			}
			// A dry-run limit reports its verdict and records nothing.
			lc.passed(&out[i], ls[i].Limit, cur, prev)
			if !ok {
				out[i].Allowed = false
				out[i].RetryAfter = retryAfter(cur, prev, ls[i].Cost, ls[i].Limit, lc.w, lc.r)
			}
		}
		return false
	}
	for i := range ls {
		lc := &lcs[i]
		// Commit: the reservation stops being speculative. count already
		// holds it, so the committed count only grows.
		lc.cur.spec.Add(-ls[i].Cost)
		_, cur, prev := lc.snapshot()
		e.committed(lc, ls[i].Cost, SatAdd(cur, weighted(prev, lc.w, lc.r)), ls[i].Limit)
		lc.passed(&out[i], ls[i].Limit, cur, prev)
		if lc.wouldDeny {
			out[i].Allowed = false
			out[i].RetryAfter = lc.dryRetry
		}
	}
	return true
}

// reserve adds l's cost to the cell's count as a speculative reservation
// if it fits, or in any case for a dry run (which records the denial it
// would have been in lc).
func (e *Engine) reserve(lc *located, l *Limit) bool {
	// spec first: a reader that sees the count raised also sees it marked
	// speculative, so nothing replays a reservation that may roll back.
	lc.cur.spec.Add(l.Cost)
	for {
		n, cur, prev := lc.snapshot()
		ok := fits(cur, prev, l.Cost, l.Limit, lc.w, lc.r)
		if !ok && !l.DryRun {
			lc.cur.spec.Add(-l.Cost)
			return false
		}
		if charge(lc.cur, n, l.Cost) {
			lc.wouldDeny = !ok
			if !ok {
				lc.dryRetry = retryAfter(cur, prev, l.Cost, l.Limit, lc.w, lc.r)
			}
			return true
		}
	}
}

// testHookRollback, set by tests, runs between the two steps of a rollback.
var testHookRollback func(c *cell)

// testHookUpgrade, set by tests, runs in an upgrade between the copy of the
// plain cell c and the swap.
var testHookUpgrade func(c *cell)

func msDuration(ms int64) time.Duration { return time.Duration(ms) * time.Millisecond }
