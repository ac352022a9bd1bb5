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
	origin  atomic.Pointer[originBox]

	// queues are the replay queues, made when an origin is first set.
	queues    atomic.Pointer[replayQueues]
	queueOnce sync.Once
	bgReads   atomic.Int64

	stats counters

	// The Timing values, in nanoseconds.
	readTimeout, freshness, slowTick, fastTick atomic.Int64

	evictNow chan struct{}
	stop     chan struct{}
	stopOnce sync.Once
	wg       sync.WaitGroup

	// global is the cross-region layer, if any (see global.go).
	global atomic.Pointer[globalBox]
}

// originBox lets an interface sit in an atomic.Pointer.
type originBox struct{ o Origin }

// New returns an engine and starts its background goroutines (janitor and
// replay); Close stops them.
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
		cfg:      cfg,
		now:      cfg.Now,
		zones:    xsync.NewMap[zoneKey, *Zone](),
		flights:  xsync.NewMap[*cell, *flight](),
		evictNow: make(chan struct{}, 1),
		stop:     make(chan struct{}),
	}
	e.SetTiming(Timing{ReadTimeout: cfg.ReadTimeout, Freshness: cfg.Freshness, SlowTick: cfg.SlowTick, FastTick: cfg.FastTick})
	if !cfg.Manual {
		e.wg.Add(2)
		go e.janitorLoop()
		go e.replayLoop()
	}
	return e
}

// SetOrigin attaches the regional origin, or detaches it with nil (local
// only). Cells already counted keep their counts.
func (e *Engine) SetOrigin(o Origin) {
	if o == nil {
		e.origin.Store(nil)
		return
	}
	e.makeQueues()
	e.origin.Store(&originBox{o})
}

// SwapOrigin replaces the origin with new only if it is old, and reports
// whether it did: a config that attached an origin can detach it on Stop
// without undoing a newer config's.
func (e *Engine) SwapOrigin(old, new Origin) bool {
	for {
		cur := e.origin.Load()
		if (cur == nil && old != nil) || (cur != nil && cur.o != old) {
			return false
		}
		var n *originBox
		if new != nil {
			e.makeQueues()
			n = &originBox{new}
		}
		if e.origin.CompareAndSwap(cur, n) {
			return true
		}
	}
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

func (e *Engine) makeQueues() {
	e.queueOnce.Do(func() {
		e.queues.Store(&replayQueues{slow: newRing(replayQueueLen), fast: newRing(replayQueueLen)})
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
	e.stopOnce.Do(func() { close(e.stop) })
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
	// dryRetry is the Retry-After a dry-run limit's denial would have had.
	dryRetry time.Duration
}

func (lc *located) key() Key { return lc.zone.key(lc.id) }

// locate finds (or creates) the entry of l and its current cell at now.
func (e *Engine) locate(lc *located, l *Limit, now int64) {
	z := l.Zone
	if z == nil {
		z = e.Zone(l.Namespace, l.Window)
	}
	id := l.Identifier
	if len(id) > MaxIdentifierLen {
		id = NormalizeIdentifier(id)
	}
	w := z.w
	seq := now / w
	for {
		en, ok := z.entries.Load(id)
		if !ok {
			en = e.insert(z, id, seq)
		}
		if c := en.current(seq); c != nil {
			r := now - c.seq*w
			if r < 0 {
				r = 0
			}
			lc.zone, lc.id, lc.en, lc.cur, lc.w, lc.r = z, id, en, c, w, r
			return
		}
		// Removed by the janitor between the load and the rotation: look
		// again, a fresh entry may already stand in its place.
	}
}

// insert adds a new entry for id, or returns the one that won a race.
func (e *Engine) insert(z *Zone, id string, seq int64) *entry {
	hasOrigin := e.origin.Load() != nil
	en, loaded := z.entries.LoadOrCompute(id, func() (*entry, bool) {
		c := &cell{seq: seq}
		if !hasOrigin {
			c.state.Store(stHydrated)
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

// counts returns the cell's weighed counts: current and previous.
func (lc *located) counts() (cur, prev int64) {
	_, cur, prev = lc.snapshot()
	return cur, prev
}

// snapshot returns the current cell's own count n, as a compare-and-swap
// must expect it, with the weighed counts derived from that same load.
func (lc *located) snapshot() (n, cur, prev int64) {
	n = lc.cur.count.Load()
	cur = n + lc.cur.global.Load()
	if p := lc.en.previous(lc.cur); p != nil {
		prev = p.total()
	}
	return n, cur, prev
}

// Decide decides one limit and, when it allows, charges its cost.
func (e *Engine) Decide(ctx context.Context, l Limit) Decision {
	now := e.nowMs()
	var lc located
	e.locate(&lc, &l, now)
	if o := e.getOrigin(); o != nil {
		e.converge(ctx, o, &lc, &l, now)
	}
	for {
		n, cur, prev := lc.snapshot()
		if !fits(cur, prev, l.Cost, l.Limit, lc.w, lc.r) {
			if l.DryRun {
				return e.dryRunDeny(&lc, &l)
			}
			var d Decision
			e.deny(&d, &lc, &l, cur, prev)
			return d
		}
		// The swap expects the count the verdict was computed from, so a
		// concurrent allow forces a recomputation. Global and previous
		// counts are not part of the swap: they only grow, from the origin,
		// and a change there can only have made this verdict a little
		// early, never admit past the local count.
		if l.Cost == 0 || lc.cur.count.CompareAndSwap(n, n+l.Cost) {
			e.committed(&lc, l.Cost, cur+l.Cost+weighted(prev, lc.w, lc.r), l.Limit)
			return Decision{
				Allowed:   true,
				Limit:     l.Limit,
				Remaining: remaining(cur+l.Cost, prev, l.Limit, lc.w, lc.r),
				Reset:     msDuration(lc.w - lc.r),
			}
		}
	}
}

// deny builds a denial and records what a denial records: strict mode and
// the cell's first denial. It never waits and never calls the origin.
func (e *Engine) deny(d *Decision, lc *located, l *Limit, cur, prev int64) {
	d.Allowed = false
	d.Limit = l.Limit
	d.Remaining = remaining(cur, prev, l.Limit, lc.w, lc.r)
	d.Reset = msDuration(lc.w - lc.r)
	if ra := retryAfterMs(cur, prev, l.Cost, l.Limit, lc.w, lc.r); ra < 0 {
		d.RetryAfter = Never
	} else {
		d.RetryAfter = msDuration(ra)
	}
	if e.origin.Load() != nil {
		markStrict(lc.zone, lc.id, lc.cur.seq*lc.w+lc.r+lc.w)
	}
	if lc.cur.state.Load()&stBlocked == 0 && lc.cur.setBits(stBlocked) {
		e.stats.firstDenials.Add(1)
		if f := e.cfg.OnFirstDenial; f != nil {
			used := cur + weighted(prev, lc.w, lc.r)
			lim := *l
			lim.Key, lim.Zone = lc.key(), lc.zone
			f(Denial{Limit: lim, Sequence: lc.cur.seq, Used: used})
		}
		e.globalDenial(lc, l, cur, prev)
	}
}

// dryRunDeny charges a request that the limit would have denied and
// reports the denial it would have been.
func (e *Engine) dryRunDeny(lc *located, l *Limit) Decision {
	var d Decision
	for {
		n, cur, prev := lc.snapshot()
		d = Decision{Limit: l.Limit, Reset: msDuration(lc.w - lc.r), RetryAfter: Never}
		if ra := retryAfterMs(cur, prev, l.Cost, l.Limit, lc.w, lc.r); ra >= 0 {
			d.RetryAfter = msDuration(ra)
		}
		if lc.cur.count.CompareAndSwap(n, n+l.Cost) {
			d.Remaining = remaining(cur+l.Cost, prev, l.Limit, lc.w, lc.r)
			e.committed(lc, l.Cost, cur+l.Cost+weighted(prev, lc.w, lc.r), l.Limit)
			return d
		}
	}
}

// committed records cost committed units in the cell for replay; effective
// is the key's effective count with them, which picks the replay tier.
func (e *Engine) committed(lc *located, cost, effective, limit int64) {
	if cost == 0 || e.origin.Load() == nil {
		return
	}
	lc.cur.pending.Add(cost)
	e.markDirty(lc.zone, lc.id, lc.cur, pressureAtLeast(effective, limit, 1, 2))
}

// DecideMany decides several limits all-or-nothing: every cost is reserved
// speculatively, and either every reservation commits (the request passes
// every limit) or every one is rolled back, so a denial by one limit charges
// no other. out[i] receives limit i's own verdict; len(out) must be at least
// len(ls). It reports whether the request passes.
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
	now := e.nowMs()
	o := e.getOrigin()
	lcs = lcs[:len(ls)]
	for i := range ls {
		e.locate(&lcs[i], &ls[i], now)
		if o != nil {
			e.converge(ctx, o, &lcs[i], &ls[i], now)
		}
	}
	reserved := 0
	denied := false
	var dryDenied uint64 // bit i: dry-run limit i would have denied
	for i := range ls {
		ok := e.reserve(&lcs[i], ls[i].Cost, ls[i].Limit, ls[i].DryRun)
		if !ok {
			denied = true
			break
		}
		if ls[i].DryRun && ok && e.wouldDeny(&lcs[i], &ls[i]) {
			dryDenied |= 1 << (i % 64)
		}
		reserved++
	}
	if denied {
		// Give back every reservation before any verdict is written, so a
		// limit's Remaining shows the state without this request.
		for i := 0; i < reserved; i++ {
			lcs[i].cur.count.Add(-ls[i].Cost)
			lcs[i].cur.spec.Add(-ls[i].Cost)
		}
		for i := range ls {
			cur, prev := lcs[i].counts()
			if fits(cur, prev, ls[i].Cost, ls[i].Limit, lcs[i].w, lcs[i].r) {
				out[i] = Decision{
					Allowed:   true,
					Limit:     ls[i].Limit,
					Remaining: remaining(cur, prev, ls[i].Limit, lcs[i].w, lcs[i].r),
					Reset:     msDuration(lcs[i].w - lcs[i].r),
				}
				continue
			}
			e.deny(&out[i], &lcs[i], &ls[i], cur, prev)
		}
		return false
	}
	for i := range ls {
		lc := &lcs[i]
		// Commit: the reservation stops being speculative. count already
		// holds it, so the committed count only grows.
		lc.cur.spec.Add(-ls[i].Cost)
		cur, prev := lc.counts()
		e.committed(lc, ls[i].Cost, cur+weighted(prev, lc.w, lc.r), ls[i].Limit)
		out[i] = Decision{
			Allowed:   true,
			Limit:     ls[i].Limit,
			Remaining: remaining(cur, prev, ls[i].Limit, lc.w, lc.r),
			Reset:     msDuration(lc.w - lc.r),
		}
		if dryDenied&(1<<(i%64)) != 0 {
			out[i].Allowed = false
			out[i].RetryAfter = lc.dryRetry
		}
	}
	return true
}

// wouldDeny reports whether a dry-run reservation just made went past the
// limit, and keeps the Retry-After the denial would have had.
func (e *Engine) wouldDeny(lc *located, l *Limit) bool {
	_, cur, prev := lc.snapshot()
	cur -= l.Cost // the state before this request's own reservation
	if fits(cur, prev, l.Cost, l.Limit, lc.w, lc.r) {
		return false
	}
	lc.dryRetry = Never
	if ra := retryAfterMs(cur, prev, l.Cost, l.Limit, lc.w, lc.r); ra >= 0 {
		lc.dryRetry = msDuration(ra)
	}
	return true
}

// reserve adds cost to the cell's count as a speculative reservation if it
// fits, or in any case for a dry run.
func (e *Engine) reserve(lc *located, cost, limit int64, dryRun bool) bool {
	// spec first: a reader that sees the count raised also sees it marked
	// speculative, so nothing replays a reservation that may roll back.
	lc.cur.spec.Add(cost)
	if dryRun {
		lc.cur.count.Add(cost)
		return true
	}
	for {
		n, cur, prev := lc.snapshot()
		if !fits(cur, prev, cost, limit, lc.w, lc.r) {
			lc.cur.spec.Add(-cost)
			return false
		}
		if cost == 0 || lc.cur.count.CompareAndSwap(n, n+cost) {
			return true
		}
	}
}

func msDuration(ms int64) time.Duration { return time.Duration(ms) * time.Millisecond }
