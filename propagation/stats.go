package propagation

import (
	"sync/atomic"
	"time"
)

// counters are the layer's monotonic counters.
type counters struct {
	denialsEmitted, denialsApplied, denialsFiltered, denialsExpired atomic.Int64
	denialQueueDrops                                                atomic.Int64
	countsPublished, countsApplied                                  atomic.Int64
	droppedBatches, writeErrors, readErrors, migrateErrors          atomic.Int64
	importDrops, waitingApplied, cleanupDeleted                     atomic.Int64
	lastPush, lastPull, lastBlocklistPull                           atomic.Int64 // Unix ms
}

// Stats is a snapshot of the layer for operators.
type Stats struct {
	// Region is the identity rows are written under; Database the
	// server's address and database name (never credentials).
	Region, Database string
	// Ready reports that the schema is known to exist (migrated, or
	// mysql_migrate off).
	Ready bool
	// Breaker is the write breaker's state: closed, half-open or open.
	Breaker string
	// LastPush is the last successful write; LastPull the last successful
	// read of published counts; LastBlocklistPull of denial rows.
	LastPush, LastPull, LastBlocklistPull time.Time
	// DenialsEmitted counts denial rows written; DenialsApplied foreign
	// denial rows that raised an import; DenialsFiltered first denials
	// below half the limit regionally (not written); DenialsExpired rows
	// dropped unwritten at their expiry; DenialQueueDrops first denials
	// a full queue could not take.
	DenialsEmitted, DenialsApplied, DenialsFiltered, DenialsExpired, DenialQueueDrops int64
	// CountsPublished counts count rows written; CountsApplied count rows
	// read that raised an import.
	CountsPublished, CountsApplied int64
	// DroppedBatches counts writes that failed or that the breaker refused;
	// WriteErrors and ReadErrors failed queries; MigrateErrors failed
	// migrations.
	DroppedBatches, WriteErrors, ReadErrors, MigrateErrors int64
	// PendingDenials are denial rows waiting to be written; Imports the
	// cells with foreign counts; ImportDrops imports the bound refused;
	// WaitingApplied imports applied when their key's entry was created.
	PendingDenials, Imports, ImportDrops, WaitingApplied int64
	// CleanupDeleted counts expired rows this node deleted.
	CleanupDeleted int64
}

func msTime(ms int64) time.Time {
	if ms == 0 {
		return time.Time{}
	}
	return time.UnixMilli(ms)
}

// Stats returns a snapshot of the layer.
func (p *Propagator) Stats() Stats {
	p.mu.Lock()
	pending, imports := int64(len(p.pending)+len(p.denials)), int64(len(p.imports))
	p.mu.Unlock()
	s := &p.stats
	return Stats{
		Region:            p.cfg.Region,
		Database:          p.addr,
		Ready:             p.ready.Load(),
		Breaker:           p.cb.State().String(),
		LastPush:          msTime(s.lastPush.Load()),
		LastPull:          msTime(s.lastPull.Load()),
		LastBlocklistPull: msTime(s.lastBlocklistPull.Load()),
		DenialsEmitted:    s.denialsEmitted.Load(),
		DenialsApplied:    s.denialsApplied.Load(),
		DenialsFiltered:   s.denialsFiltered.Load(),
		DenialsExpired:    s.denialsExpired.Load(),
		DenialQueueDrops:  s.denialQueueDrops.Load(),
		CountsPublished:   s.countsPublished.Load(),
		CountsApplied:     s.countsApplied.Load(),
		DroppedBatches:    s.droppedBatches.Load(),
		WriteErrors:       s.writeErrors.Load(),
		ReadErrors:        s.readErrors.Load(),
		MigrateErrors:     s.migrateErrors.Load(),
		PendingDenials:    pending,
		Imports:           imports,
		ImportDrops:       s.importDrops.Load(),
		WaitingApplied:    s.waitingApplied.Load(),
		CleanupDeleted:    s.cleanupDeleted.Load(),
	}
}
