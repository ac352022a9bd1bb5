package propagation

import (
	"context"

	"go.uber.org/zap"
)

// The loops' ticks. Each runs on its own loop (Start), and tests call
// them directly.

// FlushOnce is one flush tick. Every node of a region leaves its first
// denials and the cells worth publishing in the region, then tries the
// role. The holder (or a process of its own region) takes what the nodes
// left, writes denial rows, publishes the counts due, reads what changed
// in both tables (or a table whole when due), and hands the imports on:
// to the region's Redis, or to its own engine.
func (p *Propagator) FlushOnce(ctx context.Context) {
	p.handDue()
	if p.region != nil {
		p.putDenials(ctx)
		p.registerCells(ctx)
	}
	held, taken := p.holdRole(ctx)
	if !held {
		return
	}
	if taken {
		p.takeRole()
	}
	if p.region != nil {
		p.takeRegistrations(ctx)
		p.takeDenials(ctx)
		p.takeOverrides(ctx, taken)
	}
	p.writeDenials(ctx)
	p.writeOverrides(ctx)
	p.publish(ctx)
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
// It also forgets what expired and asks the replica how far behind it is.
func (p *Propagator) GlobalSyncOnce(ctx context.Context) {
	now := p.now().UnixMilli()
	p.pruneMember(now)
	if p.role.Load() == roleMember {
		return
	}
	p.mu.Lock()
	p.fullPush = true
	if p.syncs[Counts]++; p.syncs[Counts] >= wholeEvery {
		p.syncs[Counts] = 0
		p.fullPull[Counts] = true
		p.fullPull[Overrides] = true
		p.fullTake = p.region != nil
	}
	p.mu.Unlock()
	p.prune(now)
	p.checkLag(ctx)
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

// ReadWholeNext makes the next flush read every table whole, as at start:
// for tests and tools.
func (p *Propagator) ReadWholeNext() {
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
	if err != nil {
		p.stats.replicaLagMs.Store(-1)
		if c := p.stats.lagErrors.Add(1); c == 1 {
			p.log.Warn("cannot read the replica's lag (SHOW REPLICA STATUS needs the REPLICATION CLIENT privilege, or SLAVE MONITOR on MariaDB): the status shows the newest row's age only",
				zap.Error(err))
		}
	}
}
