package propagation

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"
)

// Region is the region's shared state, in its Redis (the origin's role
// API, through the root's adapter): a lease names the one node of the
// region that talks to MySQL for all of them (the role's holder); every
// node leaves there the cells worth publishing and its first denials; the
// holder leaves there what other regions counted, which every node's
// reads and writes return beside the region's total. Identifiers are the
// rows' (HMACs under identifier_secret, as the region's Redis keys are).
type Region interface {
	// NodeID is this process's name in the lease.
	NodeID() string
	// Lease takes the role for ttl when no node holds it, or renews it
	// when this process does, and returns the holder's node ID.
	Lease(ctx context.Context, ttl time.Duration) (holder string, err error)
	// ReleaseLease gives the role up, if this process holds it.
	ReleaseLease(ctx context.Context) error
	// Register records cells for the holder to publish; registering a
	// cell again with the same limit and heat is a no-op.
	Register(ctx context.Context, cells []RegionCell) error
	// TakeRegistered returns the cells registered since the last take, or
	// with all every live one (a new holder's first look).
	TakeRegistered(ctx context.Context, all bool, now int64) ([]RegionCell, error)
	// PutDenials leaves denial rows for the holder; TakeDenials returns
	// those left; DenialsWritten removes those written, unless a newer
	// row of the same cell replaced them meanwhile.
	PutDenials(ctx context.Context, rows []BlocklistRow) error
	TakeDenials(ctx context.Context) ([]BlocklistRow, error)
	DenialsWritten(ctx context.Context, rows []BlocklistRow) error
	// Totals returns the region's total of each cell (zeros for one it
	// does not hold), in order: what its nodes counted, never what it
	// imported, and the cell's newest global reset.
	Totals(ctx context.Context, cells []Cell) ([]RegionTotal, error)
	// Import hands each cell's imports to the region, making the cell
	// when the region holds none yet, and sets WantsParts where it must.
	Import(ctx context.Context, imports []RegionImport) error
}

// RegionCell is a cell registered for the holder to publish.
type RegionCell struct {
	Cell
	// Limit is the limit of the cell's last decision in the registering
	// node; Expires (Unix ms) when the cell stops mattering.
	Limit, Expires int64
	// Hot: at half its limit or more, published on every flush.
	Hot bool
}

// RegionTotal is a region's total of a cell and the newest global reset
// it marked on the cell: the reset's version and the total then (0 and 0
// for none). Other regions take the base off the count.
//
// A region publishes the version MarksResets for a cell it never reset:
// it marks global resets, so until its mark of one arrives, other regions
// that marked it count nothing of the cell from it (origin/reset.go). A
// process without Redis, which cannot mark, publishes 0.
type RegionTotal struct {
	Count, ResetVersion, ResetBase int64
}

// MarksResets is the reset version of a cell a region that marks global
// resets never reset; a reset's version (Unix microseconds) is larger.
const MarksResets = 1

// RegionImport is what other regions counted in a cell, for the region:
// Count, the sum of their counts; Parts, each region's counts, for a cell
// some region published a global reset of or one the region wants them
// for (a region weighs them against its own mark: origin/reset.go).
type RegionImport struct {
	Cell
	Count int64
	Parts []ImportPart
	// WantsParts is set by Import when the import carried no parts and the
	// region reset the cell: it was left alone, and wants them.
	WantsParts bool
}

// ImportPart is what one foreign region counted in a cell: its largest
// published count and the newest reset it published with its base, and
// the largest count its denial rows gave.
type ImportPart struct {
	Region                  string
	Count, Denied           int64
	ResetVersion, ResetBase int64
}

// Roles a process plays in the cross-region layer.
const (
	// roleOwn: no Redis; the process is its own region and talks to MySQL
	// itself.
	roleOwn int32 = iota
	// roleMember: a node of a region whose role another node holds (or
	// nobody can: the region's Redis is down).
	roleMember
	// roleHolder: the node that talks to MySQL for its region.
	roleHolder
)

var roleNames = [...]string{roleOwn: "own-region", roleMember: "member", roleHolder: "holder"}

// leaseTTL is how long the role outlives its holder's last renewal: three
// flushes, and a query's timeout for a flush that ran long, so a live
// holder never loses it between two renewals.
func (p *Propagator) leaseTTL() time.Duration { return 3*p.cfg.Flush + p.cfg.Timeout }

// heldLease is the role's lease as a holder's flush holds it (in the
// flush's context): until is when it lapses by this process's reckoning,
// counted from before the call that renewed it; lost, that a renewal found
// it gone. Only the flush's goroutine touches it.
type heldLease struct {
	until time.Time
	lost  bool
}

type leaseKey struct{}

// errLeaseLost ends what is left of a flush whose holder lost the role
// during it: not a failure of MySQL or Redis (the breaker and the error
// counts leave it out), and the next holder does the work.
var errLeaseLost = errors.New("the region's cross-region role passed to another node during this flush")

// keepLease renews the flush's lease when a query that may run until
// need could outlast it. A flush that MySQL slows or stalls (each query
// waiting mysql_timeout, a whole read of many pages) once outlasted the
// lease it renewed at its start: another node took the role, and both
// talked to MySQL for the region until the first flush returned. Renewed
// as it goes, the flush keeps the role while it works, and stops at once
// if the role passed (the region's Redis did not answer the renewal, or
// another node holds it).
func (p *Propagator) keepLease(ctx context.Context, l *heldLease, need time.Time) error {
	if l.lost {
		return errLeaseLost
	}
	if !l.until.Before(need) {
		return nil
	}
	asked := time.Now()
	// The renewal's own query must not come back here.
	if held, _ := p.holdRole(context.WithValue(ctx, leaseKey{}, (*heldLease)(nil))); !held {
		l.lost = true
		return errLeaseLost
	}
	p.stats.leaseRenewals.Add(1)
	l.until = asked.Add(p.leaseTTL())
	return nil
}

// holdRole takes or renews the region's role and reports whether this
// process holds it, and whether it just took it. A process without a
// region always holds its own. A failed lease call is a lost role: the
// region's Redis is down, and its publication waits for it.
func (p *Propagator) holdRole(ctx context.Context) (held, taken bool) {
	if p.region == nil {
		return true, p.role.Swap(roleOwn) != roleOwn
	}
	var holder string
	err := p.query(ctx, func(ctx context.Context) error {
		var err error
		holder, err = p.region.Lease(ctx, p.leaseTTL())
		return err
	})
	if p.stopped(err) {
		return false, false // the layer stops: its role is as it was, for releaseRole
	}
	var other interface{ OtherRegion() string }
	var otherDB interface{ OtherDatabase() string }
	switch {
	case err != nil && errors.As(err, &other):
		// A region line that names another region than the Redis's
		// other nodes: the role would publish their counts under this
		// node's name.
		if c := p.stats.leaseErrors.Add(1); c == 1 || c%100 == 0 {
			p.log.Error("a node of another region holds the role in this region's Redis: this node takes no role; check every node's region line",
				zap.String("region", p.cfg.Region), zap.String("holder_region", other.OtherRegion()), zap.Int64("lease_errors", c))
		}
	case err != nil && errors.As(err, &otherDB):
		// A mysql line that names another database than the region's
		// other nodes': taking the role when it is free would write the
		// region's counts there, and the other regions, reading the
		// first, would see none of them (an audit: a node of one region
		// on a second MariaDB took the role when the holder stopped, and
		// another region admitted 3 more after a burst of the limit).
		if c := p.stats.leaseErrors.Add(1); c == 1 || c%100 == 0 {
			p.log.Error("a node writing to another MySQL database holds the role in this region's Redis: this node takes no role; check every node's mysql line",
				zap.String("database", p.addr), zap.String("holder_database", otherDB.OtherDatabase()), zap.Int64("lease_errors", c))
		}
	case err != nil:
		if c := p.stats.leaseErrors.Add(1); c == 1 || c%100 == 0 {
			p.log.Warn("the region's Redis did not answer the role's lease: publication pauses until it does",
				zap.Int64("lease_errors", c), zap.Error(err))
		}
	}
	p.holder.Store(&holder)
	held = err == nil && holder == p.region.NodeID()
	was := p.role.Load() == roleHolder
	// The role changes when the process's holding does: a reload's new
	// propagator takes the role its process holds (was is false), and
	// once counted and logged that as taking it at every reload.
	switch {
	case held && !p.roleHeld.Swap(true):
		p.stats.roleTaken.Add(1)
		p.log.Info("took the region's cross-region role: this node talks to MySQL for the region", zap.String("node", holder))
	case !held && p.roleHeld.Swap(false):
		p.stats.roleLost.Add(1)
		p.log.Info("the region's cross-region role passed to another node", zap.String("holder", holder))
	}
	if held && !was {
		p.role.Store(roleHolder)
		return true, true
	}
	if !held {
		p.role.Store(roleMember)
	}
	return held, false
}

// takeRole readies a new holder: it reads every registration and both
// tables whole, and publishes every registered cell that grew.
func (p *Propagator) takeRole() {
	p.mu.Lock()
	p.fullTake = true
	p.fullPush = true
	p.pushes++
	p.fullPull = [tables]bool{true, true, true}
	p.allImportsDueLocked()
	p.mu.Unlock()
}

// RegionLost tells the layer that the region's Redis lost what it held
// (restarted empty: the root's restart watch sees its run ID change). The
// imports it held are gone, and the pulls bring none back, since none is
// news to the holder: every import the node holds is due again, so a
// holder sends them all at its next flush (an import only raises a count,
// so sending one twice changes nothing). The registry of cells to publish
// is gone too: every node registers its cells again at its next flush.
// It once registered only those that turned hot or changed limit since,
// so a later holder, which reads the registry whole when it takes the
// role, published none of the others for the rest of their window.
func (p *Propagator) RegionLost() {
	if p.region == nil {
		return
	}
	p.mu.Lock()
	p.allImportsDueLocked()
	p.mu.Unlock()
	m := &p.member
	m.Lock()
	clear(m.registered)
	m.Unlock()
}

// allImportsDueLocked makes every import held due for the region: a
// holder that takes the role (again) cannot know what the region kept.
// p.mu is held.
func (p *Propagator) allImportsDueLocked() {
	if p.region == nil {
		return
	}
	for c := range p.imports {
		p.importDue[c] = struct{}{}
	}
}

// releaseRole gives the role up on stop, so another node takes it at once
// rather than when the lease lapses.
func (p *Propagator) releaseRole(ctx context.Context) {
	if p.region == nil || p.role.Load() != roleHolder {
		return
	}
	if err := p.query(ctx, p.region.ReleaseLease); err != nil {
		p.log.Warn("releasing the region's cross-region role: the next node takes it when the lease lapses", zap.Error(err))
	}
	p.role.Store(roleMember)
}
