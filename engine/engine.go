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
	// DefaultReplayWorkers flush the fast tier's batches in parallel, so one
	// slow partition does not hold up the others; the slow tier's go out one
	// at a time (replayLoop).
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
	// ReplayWorkers is the number of concurrent flushes of the fast tier;
	// default DefaultReplayWorkers. The slow tier flushes one batch at a time.
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

func (e *Engine) readTimeoutD() time.Duration { return time.Duration(e.readTimeout.Load()) }
func (e *Engine) freshnessMs() int64          { return time.Duration(e.freshness.Load()).Milliseconds() }
func (e *Engine) fastTickMs() int64           { return time.Duration(e.fastTick.Load()).Milliseconds() }

// Engine decides limits. It is safe for concurrent use; one Engine serves a
// whole process.
type Engine struct {
	cfg   Config
	clock func() time.Time // Config.Now: the process's clock
	// offsetMs is what the engine adds to its process's clock, in ms: the
	// region's clock (the origin's) less the process's, as SetClockOffset
	// was last told (0: the process's own).
	offsetMs atomic.Int64
	zones    *xsync.Map[zoneKey, *Zone]
	live     atomic.Int64
	flights  *xsync.Map[*cell, *flight]
	// reservations are the origin decisions in flight, one per cell.
	reservations *xsync.Map[*cell, *group]
	origin       atomic.Pointer[originBox]
	// unsent is set once the engine has let an origin go (SetOrigin(nil)
	// after one), and stays: its cells are linked cells, which keep the
	// units they admit without an origin pending for the next (allow), and
	// the cells they drop are remembered (buryCell), so that the next
	// origin gets those too (sendUnsent). Never cleared, so that a request
	// that found no origin keeps its units pending whatever a reload does
	// meanwhile. An engine that never had one skips that on one load.
	unsent atomic.Bool
	// detached is set from letting an origin go until the next comes,
	// which it tells to hand that one every count (resendAll).
	detached atomic.Bool
	// linkAll is set while cells are linked cells whatever the origin: a
	// cross-region layer is attached, or unsent is set. One load on a
	// decision's path instead of two; relink keeps it, under linkMu.
	linkAll atomic.Bool
	linkMu  sync.Mutex
	// strictLive counts strict deadlines, bounded by MaxEntries.
	strictLive atomic.Int64

	// queues are the replay queues, made (and the replay loop started)
	// when an origin is first set.
	queues    atomic.Pointer[replayQueues]
	queueLen  int
	queueOnce sync.Once
	bgReads   atomic.Int64

	stats counters
	// flushEnded, when set, is closed when the next write of deltas
	// ends: what a forget waits on for a cell in flight (forget.go).
	flushEnded atomic.Pointer[chan struct{}]
	// outlasted is the flushEnded channel (as flushEndedWhile returns
	// it) whose wait ran out a request's deadline (holdWrites): until a
	// write ends, and closes it, a reservation waits for no write.
	outlasted atomic.Value
	// forgets are the keys a forget is writing (forget.go).
	forgets forgetting
	// graves are recently dropped cells, for Resend (janitor.go).
	graves graveyard
	// orphans are the cells of keys let go whose units the origin lacks,
	// for the keys' next entries (orphan.go).
	orphans orphans
	// failing holds one bit per partition of the origin (see Partitioned;
	// bit p mod maxPartitions), set by a failed call on it, cleared by the
	// next success there; untrusted ends, per partition, the suspect
	// period that starts then, and untrustedMax is the latest of them
	// (read.go). An origin of one partition uses bit and slot 0 only.
	failing      atomic.Uint64
	untrusted    [maxPartitions]atomic.Int64
	untrustedMax atomic.Int64
	// processes is how many processes the origin records as live in the
	// region, this one included (SetProcesses); 0 when it does not say.
	processes atomic.Int64

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

// originBox lets an interface sit in an atomic.Pointer. parts is the
// origin as Partitioned when it has more than one partition, else nil.
type originBox struct {
	o     Origin
	parts Partitioned
}

// orDefault sets *v to d when it is unset (zero or less).
func orDefault[T int | time.Duration](v *T, d T) {
	if *v <= 0 {
		*v = d
	}
}

// New returns an engine and starts its janitor; the replay loop starts with
// the first origin. Close stops them.
func New(cfg Config) *Engine {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	orDefault(&cfg.MaxEntries, DefaultMaxEntries)
	orDefault(&cfg.ReadTimeout, DefaultReadTimeout)
	orDefault(&cfg.Freshness, DefaultFreshness)
	orDefault(&cfg.SlowTick, DefaultSlowTick)
	orDefault(&cfg.FastTick, DefaultFastTick)
	orDefault(&cfg.ReplayWorkers, DefaultReplayWorkers)
	orDefault(&cfg.JanitorInterval, DefaultJanitorInterval)
	e := &Engine{
		cfg:          cfg,
		clock:        cfg.Now,
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
		if e.origin.Load() != nil {
			e.unsent.Store(true)
			e.detached.Store(true)
			e.relink()
		}
		e.origin.Store(nil)
		return
	}
	e.makeQueues()
	b := &originBox{o: o}
	if p, ok := o.(Partitioned); ok && p.Partitions() > 1 {
		b.parts = p
	}
	e.origin.Store(b)
	if e.detached.Swap(false) { // once: a later reload of the same origin sends nothing again
		e.resendAll()
	}
}

// SetProcesses tells the engine how many processes share its origin, this
// one included, as the origin's own record of them says (n ≤ 0: unknown).
// A young cell (see cellLinks.young) counts that many processes near its
// limit (see nearLimit): the processes that meet a key in one burst have
// each read it, but the first to read it found none of the others there.
func (e *Engine) SetProcesses(n int64) { e.processes.Store(max(n, 0)) }

// Origin returns the current origin, or nil when local-only.
func (e *Engine) Origin() Origin { return e.getOrigin() }

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

// now is the time the engine decides at: its process's clock, moved by the
// offset to the region's clock (SetClockOffset).
func (e *Engine) now() time.Time {
	t := e.clock()
	if d := e.offsetMs.Load(); d != 0 {
		t = t.Add(time.Duration(d) * time.Millisecond)
	}
	return t
}

// nowMs is now in Unix ms: every decision reads it, so the offset is added
// to the milliseconds rather than to a time.Time.
func (e *Engine) nowMs() int64 { return e.clock().UnixMilli() + e.offsetMs.Load() }

// Now is the time the engine decides at: Config.Now moved by
// SetClockOffset. Windows that the layers above compute (a reset's) must
// be the engine's.
func (e *Engine) Now() time.Time { return e.now() }

// NowMs is Now in Unix ms, without making a time.Time: for callers on the
// request path that judge a time on the engine's clock (a runtime
// override's expiry).
func (e *Engine) NowMs() int64 { return e.nowMs() }

// SetClockOffset makes the engine decide on its process's clock plus d:
// the origin's clock (Redis's), as the origin measured it, so that the
// processes of a region, whatever their own clocks say, agree on the
// windows they count in (epoch-aligned windows are only shared while the
// clocks agree: a process whose clock ran 3 s behind the others of a
// 10 s window counted a window of its own in the first 3 s of every
// window, and the region admitted up to 1.6 times the limit in 10 s). A
// change is a step of the engine's clock, which the engine is built to
// survive (a key never moves back to an older window).
// The offset is kept in whole milliseconds, the engine's unit.
func (e *Engine) SetClockOffset(d time.Duration) {
	e.offsetMs.Store(d.Round(time.Millisecond).Milliseconds())
}

// ProcessClock is the process's clock the engine reads (Config.Now),
// without the offset: what an origin measures the region's clock against.
func (e *Engine) ProcessClock() func() time.Time { return e.clock }

// ClockOffset is what SetClockOffset last set.
func (e *Engine) ClockOffset() time.Duration {
	return time.Duration(e.offsetMs.Load()) * time.Millisecond
}
