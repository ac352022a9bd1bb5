package propagation

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"time"

	"go.uber.org/zap"
)

// The loops and their ticks: Start runs each tick on its own loop
// (jittered), migrating first; tests call the ticks directly.

// FlushOnce is one flush tick. Every node of a region leaves its first
// denials and the cells worth publishing in the region, then tries the
// role. The holder (or a process of its own region) takes what the nodes
// left, writes denial rows, publishes the counts due, reads what changed
// in both tables (or a table whole when due), and hands the imports on:
// to the region's Redis, or to its own engine.
func (p *Propagator) FlushOnce(ctx context.Context) {
	p.flushing.Lock()
	defer p.flushing.Unlock()
	p.handDue()
	if p.region != nil {
		p.putDenials(ctx)
		p.registerCells(ctx)
	}
	asked := time.Now()
	held, taken := p.holdRole(ctx)
	if !held {
		return
	}
	if p.region != nil {
		ctx = context.WithValue(ctx, leaseKey{}, &heldLease{until: asked.Add(p.leaseTTL())})
	}
	p.remigrate(ctx)
	if taken {
		p.takeRole()
	}
	var due *regionRead
	if p.region != nil {
		p.takeRegistrations(ctx)
		p.takeDenials(ctx)
		// The totals are read before the overrides are taken: a count
		// holding units admitted after a reset then reaches MySQL after
		// the reset does, never before (other regions take off what they
		// imported when they read the reset).
		due = p.readRegistered(ctx)
		p.takeOverrides(ctx, taken)
	}
	p.writeDenials(ctx)
	p.writeOverrides(ctx)
	if due != nil {
		p.publishRegistered(ctx, due)
	} else {
		p.publishScanned(ctx)
	}
	p.pull(ctx, Counts)
	if !p.cfg.NoDenialGossip {
		p.pull(ctx, Denials)
	}
	p.pullOverrides(ctx)
	if p.region != nil {
		p.sendImports(ctx)
	}
}

// GlobalSyncOnce is one global sync tick: the next flush publishes every
// cell worth it that grew, not only the hot ones; every wholeEvery syncs
// it reads the published counts whole (and a holder every registration).
// It also forgets what expired, asks the replica how far behind it is,
// and reads the database's clock and which server answers for it.
func (p *Propagator) GlobalSyncOnce(ctx context.Context) {
	now := p.now().UnixMilli()
	p.pruneMember(now)
	if p.role.Load() == roleMember {
		return
	}
	p.mu.Lock()
	p.fullPush = true
	p.pushes++
	if p.syncs[Counts]++; p.syncs[Counts] >= wholeEvery {
		p.syncs[Counts] = 0
		p.fullPull[Counts] = true
		p.fullPull[Overrides] = true
		p.fullTake = p.region != nil
	}
	p.mu.Unlock()
	p.prune(now)
	p.checkLag(ctx)
	p.checkClock(ctx)
}

// FlushAll is a flush that publishes every cell worth it that grew, as
// the flush after a global sync does: the last flush of a process that
// stops. Its flushes had published only the cells at half their limit or
// more, and the cells below waited for a global sync of a process of the
// region that never came when it was the region's last: the other
// regions never saw those units (an audit: a single-node region stopped
// after 120 requests of a limit of 300, and the other region admitted
// 300 more; TestCaddy_TheLastNodeOfARegionPublishesAsItStops).
func (p *Propagator) FlushAll(ctx context.Context) {
	p.mu.Lock()
	p.fullPush = true
	p.pushes++
	p.mu.Unlock()
	p.FlushOnce(ctx)
}

// BlocklistSyncOnce is one blocklist sync tick: every wholeEvery syncs the
// next flush reads the denial rows whole.
func (p *Propagator) BlocklistSyncOnce(context.Context) {
	if p.cfg.NoDenialGossip || p.role.Load() == roleMember {
		return
	}
	p.mu.Lock()
	if p.syncs[Denials]++; p.syncs[Denials] >= wholeEvery {
		p.syncs[Denials] = 0
		p.fullPull[Denials] = true
	}
	p.mu.Unlock()
}

// readWholeNext makes the next flush read every table whole, as at start
// (the package's tests call it; the loops set the same flags).
func (p *Propagator) readWholeNext() {
	p.mu.Lock()
	p.fullPull = [tables]bool{true, true, true}
	p.mu.Unlock()
}

// CleanupOnce deletes expired rows of every table in bounded chunks; the
// holder does it for its region. Safe on many processes at once: a row
// deleted twice is deleted once.
func (p *Propagator) CleanupOnce(ctx context.Context) int64 {
	if p.role.Load() == roleMember {
		return 0
	}
	now := p.now().UnixMilli()
	var total int64
	for t := range tables {
		if t == Overrides && p.overrideStore() == nil {
			continue
		}
		for range cleanupMaxChunks {
			var n int64
			err := p.query(ctx, func(ctx context.Context) error {
				var err error
				n, err = p.store.DeleteExpired(ctx, t, now, cleanupChunk)
				return err
			})
			if err != nil {
				p.readFailed("cleanup", err)
				p.noteSchemaGone(err)
				break
			}
			total += n
			if n < cleanupChunk {
				break
			}
		}
	}
	p.stats.cleanupDeleted.Add(total)
	return total
}

// checkLag asks the replica pulls read from how far behind it is.
func (p *Propagator) checkLag(ctx context.Context) {
	if p.cfg.ReadDSN == "" {
		return
	}
	err := p.query(ctx, func(ctx context.Context) error {
		lag, known, err := p.store.ReplicaLag(ctx)
		ms := lag.Milliseconds()
		if !known {
			ms = -1
		}
		p.stats.replicaLagMs.Store(ms)
		return err
	})
	if err != nil && !p.stopped(err) {
		p.stats.replicaLagMs.Store(-1)
		if c := p.stats.lagErrors.Add(1); c == 1 {
			p.log.Warn("cannot read the replica's lag (SHOW REPLICA STATUS failed: the replica does not answer, or its user lacks REPLICATION CLIENT, SLAVE MONITOR on MariaDB): the status shows the newest row's age only",
				zap.Error(err))
		}
	}
}

// Start starts the loops. It succeeds with MySQL down: the schema is
// migrated in the background once MySQL answers, and until then writes
// wait (denial rows are kept until they expire).
func (p *Propagator) Start() {
	if !p.started.CompareAndSwap(false, true) {
		return
	}
	// With mysql_migrate off the loop only checks the schema (sqlStore):
	// the layer is ready once the tables are there.
	p.wg.Add(2)
	go p.migrateLoop()
	go p.drainLoop()
	p.loop(p.cfg.Flush, p.cfg.Flush, func(ctx context.Context) { p.FlushOnce(ctx) })
	p.loop(p.cfg.GlobalSync, p.cfg.GlobalSync, func(ctx context.Context) { p.GlobalSyncOnce(ctx) })
	p.loop(p.cfg.BlocklistSync, p.cfg.BlocklistSync, func(ctx context.Context) { p.BlocklistSyncOnce(ctx) })
	p.loop(cleanupFirst, CleanupInterval, func(ctx context.Context) { p.CleanupOnce(ctx) })
}

// denialDrainEvery is how often the queued first denials move into the
// rows kept for writing (a holder's, or a member's to leave in the
// region), whatever MySQL does. The queue holds a flush's worth; a flush
// that waits out MySQL's timeouts (every pull of a hung server a
// query's timeout) took seconds, or never ran while the schema waited
// for MySQL, and a flood of first denials meanwhile filled the queue and
// lost the rest, with the kept rows far from their bound (an audit:
// 121,187 of 246,174 lost with MariaDB stopped for 60 s, the pending
// rows never past 86,000 of 100,000).
const denialDrainEvery = 100 * time.Millisecond

// drainLoop drains the first-denial queue every denialDrainEvery until
// Stop.
func (p *Propagator) drainLoop() {
	defer p.wg.Done()
	t := time.NewTicker(denialDrainEvery)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			return
		case <-t.C:
		}
		if len(p.denials) == 0 {
			continue
		}
		if p.region != nil {
			p.member.Lock()
			p.drainDenials(p.member.unput)
			p.member.Unlock()
			continue
		}
		p.mu.Lock()
		p.drainDenials(p.pending)
		p.mu.Unlock()
	}
}

// Stop stops the loops after one last write of what is pending, within
// ctx: a member leaves its denial rows in the region, a holder writes
// what it holds and gives the role up. Then it closes the connections.
// What it holds includes the override changes not yet written: a reload
// stops the old config's layer without a flush, and a change queued
// within a flush of it never reached MySQL
// (TestStop_WritesTheOverrideChangesItHolds).
func (p *Propagator) Stop(ctx context.Context) {
	p.stopOnce.Do(func() { close(p.stop) })
	p.wg.Wait()
	if p.started.Load() && p.ready.Load() {
		if p.region != nil {
			p.putDenials(ctx)
		}
		if p.role.Load() != roleMember {
			p.writeDenials(ctx)
			p.writeOverrides(ctx)
		}
		p.releaseRole(ctx)
	}
	_ = p.store.Close()
}

// loop runs fn after a jittered first delay, then every jittered interval,
// until Stop. Each run is bounded by the query timeout per query, so Stop
// waits at most for one run. A tick before the schema is ready is skipped.
func (p *Propagator) loop(first, interval time.Duration, fn func(context.Context)) {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() {
			select {
			case <-p.stop:
				cancel()
			case <-ctx.Done():
			}
		}()
		t := time.NewTimer(jitter(first))
		defer t.Stop()
		for {
			select {
			case <-p.stop:
				return
			case <-t.C:
			}
			if p.ready.Load() {
				fn(ctx)
			}
			t.Reset(jitter(interval))
		}
	}()
}

// stopped reports whether err is a query that Stop cancelled: the loops'
// queries in flight when a reload (or shutdown) stops the layer. That is
// no failure of MySQL or of the region's Redis, and is neither counted
// nor logged as one (a reload once counted and logged "mysql read
// failed ... context canceled"); the write breaker leaves it out too.
func (p *Propagator) stopped(err error) bool {
	if !errors.Is(err, context.Canceled) {
		return false
	}
	select {
	case <-p.stop:
		return true
	default:
		return false
	}
}

// jitter spreads d by ±jitterShare, so the nodes of a fleet do not query
// in step.
func jitter(d time.Duration) time.Duration {
	f := 1 - jitterShare + 2*jitterShare*rand.Float64()
	return time.Duration(float64(d) * f)
}

// schemaAnnounced holds the databases whose schema this process has said
// is ready at info level.
var schemaAnnounced sync.Map

func (p *Propagator) migrateLoop() {
	defer p.wg.Done()
	for {
		ctx, cancel := context.WithTimeout(context.Background(), p.cfg.Timeout*time.Duration(migrateSteps))
		err := p.store.Migrate(ctx)
		cancel()
		if err == nil {
			p.ready.Store(true)
			// Once per database and process at info: every reload's layer
			// migrates again, and said so at info each time (429 lines on
			// a node of an audit's reload storm).
			lvl := zap.DebugLevel
			if _, seen := schemaAnnounced.LoadOrStore(p.addr, struct{}{}); !seen {
				lvl = zap.InfoLevel
			}
			p.log.Log(lvl, "mysql schema ready", zap.String("database", p.addr))
			p.firstServer(context.Background())
			return
		}
		// The first failure and every hundredth after it: a wrong password
		// or database said once, in the first seconds, was easy to miss.
		if c := p.stats.migrateErrors.Add(1); c == 1 || c%100 == 0 {
			p.log.Warn("mysql schema migration failed; retrying in the background, cross-region counts wait",
				zap.String("database", p.addr), zap.Int64("migrate_errors", c), zap.Error(err))
		}
		select {
		case <-p.stop:
			return
		case <-time.After(migrateRetry):
		}
	}
}

// MigrateOnce migrates the schema on the calling goroutine and marks the
// layer ready: for tests and tools.
func (p *Propagator) MigrateOnce(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.Timeout*time.Duration(migrateSteps))
	defer cancel()
	if err := p.store.Migrate(ctx); err != nil {
		return err
	}
	p.ready.Store(true)
	p.firstServer(ctx)
	return nil
}

// firstServer reads which server the process starts on (ServerStore), so
// that a node that takes its region's role knows it before its first
// global sync as holder.
func (p *Propagator) firstServer(ctx context.Context) {
	cs, ok := p.store.(ClockStore)
	if _, names := p.store.(ServerStore); !ok || !names {
		return // a store that names no server gets no extra statement
	}
	if err := p.query(ctx, func(ctx context.Context) error { _, err := cs.Clock(ctx); return err }); err != nil {
		return // the first global sync reads it
	}
	p.noteServer()
}

// Ready reports whether the schema is known to exist.
func (p *Propagator) Ready() bool { return p.ready.Load() }
