package propagation

import (
	"sync/atomic"
	"time"
)

// counters are the layer's monotonic counters.
type counters struct {
	denialsEmitted, denialsApplied, denialsFiltered, denialsExpired atomic.Int64
	denialQueueDrops, denialsLeft                                   atomic.Int64
	countsPublished, countsApplied                                  atomic.Int64
	droppedBatches, writeErrors, readErrors, migrateErrors          atomic.Int64
	importDrops, waitingApplied, cleanupDeleted, importsSent        atomic.Int64
	registered, registryDrops, regionErrors, leaseErrors, lagErrors atomic.Int64
	roleTaken, roleLost, leaseRenewals, wholeReads, changeReads     atomic.Int64
	overridesWritten, clockSteps                                    atomic.Int64
	schemaRemade, ownRowsMissing                                    atomic.Int64
	overrideRowsMissing                                             atomic.Int64
	rowsRead                                                        [tables]atomic.Int64
	lastPush                                                        atomic.Int64 // Unix ms
	lastPull                                                        [tables]atomic.Int64
	// replicaLagMs is the replica's last reported lag, -1 when unknown.
	replicaLagMs atomic.Int64
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
	// pull of published counts; LastBlocklistPull of denial rows.
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

	// Role is what this process does for its region: "holder" (it talks
	// to MySQL for the region), "member" (another node does, or none can
	// while the region's Redis is down), or "own-region" (no Redis: it is
	// its own region). Holder is the node ID that holds the role as last
	// seen ("" for own-region); NodeID this process's.
	Role, Holder, NodeID string
	// RoleTaken and RoleLost count the times this process took the role
	// and lost it to another node; LeaseErrors failed lease calls;
	// LeaseRenewals renewals during a flush that could have outlasted
	// the lease.
	RoleTaken, RoleLost, LeaseErrors, LeaseRenewals int64
	// Registered counts the cells this node registered for the holder to
	// publish; DenialsLeft the denial rows it left for the holder;
	// RegionErrors failed calls to the region's Redis.
	Registered, DenialsLeft, RegionErrors int64
	// RegistryCells is the cells the holder publishes for the region;
	// RegistryDrops registrations its bound refused; ImportsSent imported
	// counts handed to the region's Redis.
	RegistryCells, RegistryDrops, ImportsSent int64
	// CountRowsRead and DenialRowsRead count rows pulled; ChangeReads
	// pulls of what changed; WholeReads pulls of a whole table;
	// ClockSteps the times the database's clock was found behind the
	// newest change pulled (checkClock).
	CountRowsRead, DenialRowsRead, ChangeReads, WholeReads, ClockSteps int64
	// SchemaRemade counts the times a statement found a table or the
	// database gone (dropped by hand) and the schema was made again;
	// OwnRowsMissing the published rows of this region a whole read found
	// deleted (emptied by hand): their cells were published again.
	SchemaRemade, OwnRowsMissing int64
	// OverrideRowsMissing counts the overrides (removals and resets
	// included) a whole read of ratelimit_overrides lacked, or found in
	// an older version than the one written or read here (emptied by
	// hand): they were written back.
	OverrideRowsMissing int64
	// OverridesWritten and OverrideRowsRead count runtime overrides
	// written to and pulled from MySQL; PendingOverrides wait to be
	// written.
	OverridesWritten, OverrideRowsRead, PendingOverrides int64
	// ReplicaLag is how far mysql_read's replica said it was behind at
	// the last global sync; -1 when unknown (no replica, its SQL thread
	// stopped, or no right to ask). NewestRowAge is the age of the newest
	// change pulled, on this node's clock against the database's: an
	// upper bound of the lag while rows are written.
	ReplicaLag, NewestRowAge time.Duration
}

func msTime(ms int64) time.Time {
	if ms == 0 {
		return time.Time{}
	}
	return time.UnixMilli(ms)
}

// Stats returns a snapshot of the layer.
func (p *Propagator) Stats() Stats {
	st := p.stats.snapshot()
	p.mu.Lock()
	st.PendingDenials, st.Imports = int64(len(p.pending)+len(p.denials)), int64(len(p.imports))
	st.RegistryCells, st.PendingOverrides = int64(len(p.reg)), int64(len(p.ovPending))
	var newest int64
	for _, c := range p.cursor {
		if c.newest != nil {
			newest = max(newest, c.newest.UpdatedMs)
		}
	}
	p.mu.Unlock()
	p.member.Lock()
	st.PendingDenials += int64(len(p.member.unput))
	p.member.Unlock()
	// Not ready either while a statement has found the schema gone and
	// it is not made again yet: the layer once stayed ready with its
	// database dropped, every statement failing.
	st.Region, st.Database, st.Ready = p.cfg.Region, p.addr, p.ready.Load() && !p.lost.gone.Load()
	st.Breaker, st.Role = p.breakerState(), roleNames[p.role.Load()]
	if p.region != nil {
		st.NodeID = p.region.NodeID()
		if h := p.holder.Load(); h != nil {
			st.Holder = *h
		}
	}
	if lag := p.stats.replicaLagMs.Load(); p.cfg.ReadDSN != "" && lag >= 0 {
		st.ReplicaLag = time.Duration(lag) * time.Millisecond
	}
	if newest > 0 {
		st.NewestRowAge = max(0, p.now().Sub(time.UnixMilli(newest)))
	}
	return st
}

// snapshot reads the counters into a Stats; what the Propagator holds
// (queues, maps, the role) is Stats' part.
func (s *counters) snapshot() Stats {
	return Stats{
		LastPush:            msTime(s.lastPush.Load()),
		LastPull:            msTime(s.lastPull[Counts].Load()),
		LastBlocklistPull:   msTime(s.lastPull[Denials].Load()),
		DenialsEmitted:      s.denialsEmitted.Load(),
		DenialsApplied:      s.denialsApplied.Load(),
		DenialsFiltered:     s.denialsFiltered.Load(),
		DenialsExpired:      s.denialsExpired.Load(),
		DenialQueueDrops:    s.denialQueueDrops.Load(),
		CountsPublished:     s.countsPublished.Load(),
		CountsApplied:       s.countsApplied.Load(),
		DroppedBatches:      s.droppedBatches.Load(),
		WriteErrors:         s.writeErrors.Load(),
		ReadErrors:          s.readErrors.Load(),
		MigrateErrors:       s.migrateErrors.Load(),
		ImportDrops:         s.importDrops.Load(),
		WaitingApplied:      s.waitingApplied.Load(),
		CleanupDeleted:      s.cleanupDeleted.Load(),
		RoleTaken:           s.roleTaken.Load(),
		RoleLost:            s.roleLost.Load(),
		LeaseErrors:         s.leaseErrors.Load(),
		LeaseRenewals:       s.leaseRenewals.Load(),
		Registered:          s.registered.Load(),
		DenialsLeft:         s.denialsLeft.Load(),
		RegionErrors:        s.regionErrors.Load(),
		RegistryDrops:       s.registryDrops.Load(),
		ImportsSent:         s.importsSent.Load(),
		CountRowsRead:       s.rowsRead[Counts].Load(),
		DenialRowsRead:      s.rowsRead[Denials].Load(),
		OverridesWritten:    s.overridesWritten.Load(),
		OverrideRowsRead:    s.rowsRead[Overrides].Load(),
		ChangeReads:         s.changeReads.Load(),
		WholeReads:          s.wholeReads.Load(),
		ClockSteps:          s.clockSteps.Load(),
		SchemaRemade:        s.schemaRemade.Load(),
		OwnRowsMissing:      s.ownRowsMissing.Load(),
		OverrideRowsMissing: s.overrideRowsMissing.Load(),
		ReplicaLag:          -1,
		NewestRowAge:        -1,
	}
}
