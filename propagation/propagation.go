package propagation

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sony/gobreaker/v2"
	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// Tunables that are not settings. Each says why.
const (
	// BreakerName names the write breaker in logs and metrics.
	BreakerName = "ratelimit_propagation_writes"
	// CleanupInterval is how often expired rows are deleted: rows expire
	// two windows after their cell (a minute at least), so a minute keeps
	// the tables within a few windows of live rows.
	CleanupInterval = time.Minute
	// cleanupFirst is when a node first cleans after it starts: rows
	// that expired while the fleet was down go soon, not a minute later.
	cleanupFirst = 5 * time.Second
	// cleanupChunk bounds one DELETE: short statements hold locks briefly,
	// so cleanup never blocks the upserts of a busy minute.
	cleanupChunk = 1000
	// cleanupMaxChunks bounds one cleanup run; what is left waits a minute.
	cleanupMaxChunks = 100
	// pageSize is the rows of one page of a periodic pull.
	pageSize = 1000
	// maxPages bounds one periodic pull (a million rows); the rest waits
	// for the next sync rather than holding the loop.
	maxPages = 1000
	// denialQueue is the capacity of the first-denial queue between the
	// request path and the writer: more first denials than a node sees in
	// a flush interval; past it a denial row is dropped (counted), never
	// waited for.
	denialQueue = 4096
	// maxDenialBatches bounds the batches of denial rows one flush writes.
	// One a flush (500 rows, and a flush every second and its own length)
	// wrote about 250 rows a second, with MySQL healthy: a flood of first
	// denials faster than that piled up, and most of its rows expired
	// unwritten (an audit: 58 % of 60,255). A backlog is written at up to
	// eight batches a flush; a quiet flush writes one or none.
	maxDenialBatches = 8
	// maxPendingDenials bounds the denial rows kept for retry while MySQL
	// is down; each is also dropped once its expires_ms passes.
	maxPendingDenials = 100_000
	// maxImports bounds the cells whose foreign counts are remembered,
	// which includes imports waiting for a key this node has not seen
	// (identifier_secret): about 200 bytes each.
	maxImports = 500_000
	// migrateRetry is how often a failed migration is retried: MySQL being
	// down at start must not fail Start, and the tables appear within
	// seconds of it coming back.
	migrateRetry = 2 * time.Second
	// maxIdleConns and maxOpenConns size the pool: four loops, one query
	// each at a time, plus a spare.
	maxIdleConns = 5
	maxOpenConns = 5
	// recentRows is how many emitted and applied denial rows the admin API
	// lists.
	recentRows = 256
	// jitterShare spreads the loops of many nodes: ±20 % of each interval.
	jitterShare = 0.2
	// breakerProbes is how many writes a half-open breaker lets through.
	breakerProbes = 1
	// breakerBuckets divides the breaker's interval into rolling buckets.
	breakerBuckets = 10
	// wholeEvery: a table is read whole every this many syncs (and when a
	// process starts or takes the role); between, pulls read what changed.
	// The whole read is the safety net for what a read of changes cannot
	// see: rows written by versions without the change column, and a
	// database clock stepped back further than changeMargin.
	wholeEvery = 10
	// changeMargin is how far before the newest change seen a read of
	// changes starts: it covers transactions that commit after a later
	// one (their change time is their statement's, not their commit's)
	// and a replica applying them in commit order.
	changeMargin = 2 * time.Second
	// maxRegistered bounds the cells a holder publishes for its region
	// and the cells a node remembers registering: about 150 bytes each.
	maxRegistered = 1_000_000
	// registerBatch bounds the registrations a node sends per flush; the
	// rest wait for the next.
	registerBatch = 10_000
	// regionChunk bounds the cells of one call to the region (totals,
	// imports), so a call stays within the query timeout.
	regionChunk = 10_000
)

// Engine is what the layer needs of the engine (*engine.Engine).
type Engine interface {
	// ScanCells calls f with the current and previous cell of every key
	// whose window is at least minWindow.
	ScanCells(minWindow time.Duration, f func(v *engine.CellView) bool)
	// MarkPublished records the regional count last published.
	MarkPublished(key engine.Key, seq, n int64) bool
	// RaiseRegional raises a cell's regional count to what this region
	// published before (a restarted process of its own region).
	RaiseRegional(key engine.Key, seq, n int64) bool
	// HasEntry reports whether the engine holds the key.
	HasEntry(key engine.Key) bool
	// ImportGlobal raises a cell's imported count.
	ImportGlobal(key engine.Key, seq, total int64, create bool) bool
}

// Propagator is the cross-region layer of one config. It implements
// engine.Global: attach it with engine.SetGlobal after Start.
type Propagator struct {
	// flushing serialises FlushOnce: the stop's FlushAll runs while the
	// loops still may, and a flush of the loop could take the region's
	// registrations between FlushAll's look at them and its publish.
	flushing sync.Mutex
	cfg      Config
	eng      Engine
	store    Store
	region   Region // nil: the process is its own region
	log      *zap.Logger
	addr     string
	now      func() time.Time
	cb       *gobreaker.CircuitBreaker[struct{}]
	// cbState is the state cb last entered, for Stats: gobreaker's State()
	// moves an open breaker whose timeout passed to half-open, so a status
	// or a metrics scrape read that way turned it half-open (and logged
	// the change) with nothing probing. A write moves it; a read does not.
	cbState atomic.Int32
	gate    func(write func() error) error

	ready   atomic.Bool
	denials chan engine.GlobalDenial
	role    atomic.Int32
	holder  atomic.Pointer[string]

	// mu guards what the holder (or a process of its own region) keeps.
	mu         sync.Mutex
	pending    map[Cell]*BlocklistRow // denial rows not yet written
	taken      map[Cell]BlocklistRow  // denial rows taken from the region, as taken
	reg        map[Cell]*regCell      // the region's registered cells
	imports    map[Cell]*cellImport
	own        map[Cell]*ownMark     // this region's published global resets (publish.go)
	importDue  map[Cell]struct{}     // imports the region has not taken yet
	ahead      map[Cell]update       // imports for windows not begun here yet
	index      map[zoneID]string     // row identifier → raw identifier (MapID)
	cursor     [tables]cursor        // where the next pull of changes starts
	dbClock    dbClock               // the database's clock, as last read (pull.go)
	server     string                // the server writes go to, as last read (checkServer)
	fullPull   [tables]bool          // the next pull of the table reads it whole
	fullPush   bool                  // the next push publishes every grown cell
	republish  bool                  // and every published one (Config.Republish), until a whole push is done
	pushes     int64                 // counts the settings of fullPush: a whole push clears only what it read (publish.go)
	otherForms map[string]bool       // regions whose rows name identifiers of another form, logged (otherForm)
	badWindows map[string]bool       // regions whose rows name windows no zone can have, logged (badWindow)
	fullTake   bool                  // the next take reads every registration
	syncs      [tables]int           // syncs since the table's last whole read
	ovPending  map[Cell]*OverrideRow // overrides changed here or in the region, not yet written
	ovTakeAll  bool                  // the next take reads every override the region holds
	ovHeld     map[Cell]OverrideRow  // the newest override of each key written or read, until it lapses (lost.go)
	// resetsMarked: the global resets whose rows this holder marked
	// (markResets), by zone and identifier, until they lapse.
	resetsMarked map[Cell]OverrideRow
	onOverrides  func([]OverrideRow)
	resetCells   func(OverrideRow) (namespace, identifier string, ok bool)
	mismatched   map[zoneWindow]bool // zones over another window here, logged once (pull.go)
	recentOut    []BlocklistRow
	recentIn     []BlocklistRow
	importCount  atomic.Int64

	// member guards what every node of a region keeps.
	member struct {
		sync.Mutex
		registered map[engineCell]registration // cells this node registered
		unput      map[Cell]*BlocklistRow      // denial rows not yet left in the region
	}

	stats counters
	lost  lostSchema // a statement found the schema gone (lost.go)

	stop     chan struct{}
	stopOnce sync.Once
	wg       sync.WaitGroup
	started  atomic.Bool

	// roleHeld is whether the process holds the region's role
	// (Options.RoleHeld): what role changes are counted and logged by.
	roleHeld *atomic.Bool
}

// cursor is where a table's next pull of changes starts: the newest row
// seen (by change time, then key) and when it was first seen.
type cursor struct {
	newest *RowKey
	seenAt int64 // Unix ms, this process's clock
}

// zoneID is a key without its sequence, as rows name it.
type zoneID struct {
	ns, id string
	w      int64
}

// cellImport is what other regions counted in one cell, per region.
type cellImport struct {
	regions map[string]*regionPart
	expires int64
	// changes counts the merges that were news, so that an import sent
	// while another came stays due.
	changes int64
	// withParts: the cell's imports go to the region part by part, since
	// a region published a global reset of it or the region reset it.
	withParts bool
}

// regionPart is what one region counted in a cell, as its rows said: the
// largest published count and denial count, and the newest global reset
// it published for the cell with its base.
type regionPart struct {
	count, denied int64
	ver, base     int64
}

// counted is the larger of the two tables' counts.
func (r *regionPart) counted() int64 { return max(r.count, r.denied) }

// sum is the cell's imported count, resets aside: the larger of the two
// tables' counts, summed over the regions.
func (ci *cellImport) sum() int64 {
	var s int64
	for _, r := range ci.regions {
		s = engine.SatAdd(s, r.counted())
	}
	return s
}

// parts is the cell's imports region by region, for the region's Redis.
func (ci *cellImport) parts() []ImportPart {
	out := make([]ImportPart, 0, len(ci.regions))
	for name, r := range ci.regions {
		out = append(out, ImportPart{Region: name, Count: r.count, Denied: r.denied, ResetVersion: r.ver, ResetBase: r.base})
	}
	return out
}

// Options are the hooks a Propagator is made with.
type Options struct {
	// Logger receives the layer's log lines and go-sql-driver's own.
	Logger *zap.Logger
	// Now is the clock (default time.Now); it must agree with the engine's.
	Now func() time.Time
	// OnBreakerChange is told the write breaker's transitions.
	OnBreakerChange func(from, to string)
	// Region is the region's shared state (its Redis): the nodes of a
	// region then share one MySQL client, the role's holder. Nil: the
	// process is its own region (Config.Region names it alone).
	Region Region
	// Store replaces MySQL (the simulator's model); nil opens Config.DSN.
	Store Store
	// OnOverrides receives the runtime overrides pulled from MySQL, for a
	// process that is its own region (a region's holder hands them to the
	// region instead).
	OnOverrides func([]OverrideRow)
	// WriteGate, if set, stands in for the write breaker: it runs write, or
	// refuses it with an error, as the breaker would. The simulator's gate
	// keeps the breaker's rules on its simulated clock (the breaker reads
	// the wall clock, which would make a simulated outage end at a time
	// that depends on the machine's speed). Nil: the breaker.
	WriteGate func(write func() error) error
	// ResetCells, if set, names the count rows a row of ratelimit_overrides
	// resets for every region: their namespace and identifier, ok false
	// for a row that is no such reset. The holder marks its region's rows
	// of the key as it hears of the reset (Store's MarkResetCounts). Nil:
	// none is marked so.
	ResetCells func(OverrideRow) (namespace, identifier string, ok bool)
	// RoleHeld, if set, is whether the process holds the region's role,
	// shared by the propagators it makes in turn (each reload makes one,
	// which runs beside the old one for a moment): a new propagator that
	// finds the role with its process's node neither counts nor logs
	// taking it, and the one that sees it go counts and logs that once.
	// Nil: the propagator's own.
	RoleHeld *atomic.Bool
}

// New builds a Propagator around eng without any I/O: `caddy validate`
// builds configs it never runs. Start begins the work.
func New(cfg Config, eng Engine, opts Options) (*Propagator, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := opts.Logger
	if log == nil {
		log = zap.NewNop()
	}
	store, addr := opts.Store, "model"
	if store == nil {
		s, a, err := openStore(cfg, log)
		if err != nil {
			return nil, err
		}
		store, addr = s, a
	}
	now := opts.Now
	if now == nil {
		now = time.Now
	}
	p := &Propagator{
		cfg:          cfg,
		eng:          eng,
		store:        store,
		region:       opts.Region,
		log:          log,
		addr:         addr,
		now:          now,
		gate:         opts.WriteGate,
		roleHeld:     opts.RoleHeld,
		denials:      make(chan engine.GlobalDenial, denialQueue),
		pending:      make(map[Cell]*BlocklistRow),
		taken:        make(map[Cell]BlocklistRow),
		reg:          make(map[Cell]*regCell),
		imports:      make(map[Cell]*cellImport),
		own:          make(map[Cell]*ownMark),
		importDue:    make(map[Cell]struct{}),
		ahead:        make(map[Cell]update),
		index:        make(map[zoneID]string),
		ovPending:    make(map[Cell]*OverrideRow),
		ovHeld:       make(map[Cell]OverrideRow),
		resetsMarked: make(map[Cell]OverrideRow),
		onOverrides:  opts.OnOverrides,
		resetCells:   opts.ResetCells,
		fullPull:     [tables]bool{true, true, true},
		fullPush:     cfg.Republish,
		republish:    cfg.Republish,
		stop:         make(chan struct{}),
	}
	if p.roleHeld == nil {
		p.roleHeld = new(atomic.Bool)
	}
	p.stats.replicaLagMs.Store(-1)
	p.member.registered = make(map[engineCell]registration)
	p.member.unput = make(map[Cell]*BlocklistRow)
	if p.region != nil {
		p.role.Store(roleMember)
	}
	p.cb = newBreaker(cfg.Breaker, log, &p.cbState, opts.OnBreakerChange)
	return p, nil
}

// newBreaker builds the write breaker, which keeps the state it enters in
// state.
func newBreaker(b Breaker, log *zap.Logger, state *atomic.Int32, onChange func(from, to string)) *gobreaker.CircuitBreaker[struct{}] {
	return gobreaker.NewCircuitBreaker[struct{}](gobreaker.Settings{
		Name:         BreakerName,
		MaxRequests:  breakerProbes,
		Interval:     b.Interval,
		BucketPeriod: b.Interval / breakerBuckets,
		Timeout:      b.Timeout,
		ReadyToTrip: func(n gobreaker.Counts) bool {
			done := n.TotalSuccesses + n.TotalFailures
			return done >= uint32(b.MinRequests) && float64(n.TotalFailures) >= b.FailureRatio*float64(done)
		},
		IsExcluded: func(err error) bool { return errors.Is(err, context.Canceled) || errors.Is(err, errLeaseLost) },
		OnStateChange: func(_ string, from, to gobreaker.State) {
			state.Store(int32(to))
			log.Info("mysql write breaker changed state",
				zap.String("breaker", BreakerName), zap.String("from", from.String()), zap.String("to", to.String()))
			if onChange != nil {
				onChange(from.String(), to.String())
			}
		},
	})
}

// breakerState is the state the write breaker last entered, read without
// moving it (see cbState).
func (p *Propagator) breakerState() string { return gobreaker.State(p.cbState.Load()).String() }

// Addr is the database's network address and name: never credentials.
func (p *Propagator) Addr() string { return p.addr }

// Region is the identity this node writes rows under.
func (p *Propagator) Region() string { return p.cfg.Region }

// Config returns the settings in force, defaults applied.
func (p *Propagator) Config() Config { return p.cfg }

// query runs fn with a context bounded by the query timeout. In a
// holder's flush it is bounded by the role's lease too, which it renews
// first when the query could outlast it (keepLease).
func (p *Propagator) query(ctx context.Context, fn func(ctx context.Context) error) error {
	deadline := time.Now().Add(p.cfg.Timeout)
	if l, _ := ctx.Value(leaseKey{}).(*heldLease); l != nil {
		if err := p.keepLease(ctx, l, deadline); err != nil {
			return err
		}
		if l.until.Before(deadline) {
			deadline = l.until
		}
	}
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	return fn(ctx)
}

// write runs one write through the breaker (or Options.WriteGate).
func (p *Propagator) write(ctx context.Context, fn func(ctx context.Context) error) error {
	if p.gate != nil {
		return p.gate(func() error { return p.query(ctx, fn) })
	}
	_, err := p.cb.Execute(func() (struct{}, error) {
		return struct{}{}, p.query(ctx, fn)
	})
	return err
}

// rowID is how an identifier appears in rows.
func (p *Propagator) rowID(id string) string {
	if p.cfg.MapID != nil {
		return p.cfg.MapID(id)
	}
	return id
}

// EntryCreated implements engine.Global: it indexes the key by its row
// identifier (one HMAC per entry under identifier_secret, none per
// request) and applies the imports that waited for it. Nodes of a region
// learn imports from the region's Redis instead, in their cold read.
func (p *Propagator) EntryCreated(key engine.Key, seq int64) {
	if p.region != nil || key.Window < p.cfg.MinWindow {
		return
	}
	id := key.Identifier
	if p.cfg.MapID == nil && p.importCount.Load() == 0 {
		return
	}
	rid := p.rowID(id)
	w := key.Window.Milliseconds()
	var sums [2]int64
	p.mu.Lock()
	if p.cfg.MapID != nil {
		p.index[zoneID{key.Namespace, rid, w}] = id
	}
	for i, s := range [2]int64{seq, seq - 1} {
		if ci := p.imports[Cell{key.Namespace, rid, w, s}]; ci != nil {
			sums[i] = ci.sum()
		}
	}
	p.mu.Unlock()
	for i, s := range [2]int64{seq, seq - 1} {
		if sums[i] > 0 && p.eng.ImportGlobal(key, s, sums[i], false) {
			p.stats.waitingApplied.Add(1)
		}
	}
}

// FirstDenial implements engine.Global: it queues a denial row, if the
// denial passes the filters, without ever waiting.
func (p *Propagator) FirstDenial(d engine.GlobalDenial) {
	if p.cfg.NoDenialGossip || d.Window < p.cfg.MinWindow {
		return
	}
	// A denial by a region that used less than half the limit came from
	// one oversized request, or from counts it imported: not worth
	// broadcasting, and never an echo of another region's row.
	if d.RegionalUsed*2 < d.Limit.Limit {
		p.stats.denialsFiltered.Add(1)
		return
	}
	select {
	case p.denials <- d:
	default:
		p.stats.denialQueueDrops.Add(1)
	}
}

var _ engine.Global = (*Propagator)(nil)
