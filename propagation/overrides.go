package propagation

import (
	"context"
	"fmt"
	"slices"
	"strings"
)

// Runtime overrides between regions. An operator's change of a key's limit
// (or its removal, a tombstone) is a row of ratelimit_overrides, keyed by
// zone and identifier, whose version (the change's time in µs) orders the
// changes: a write replaces a row only with a newer version, so every
// region ends on the same newest change whatever order the writes take.
// They travel the way counts do: a node leaves its change in the region
// (OverrideRegion) or, without Redis, queues it here (PutOverride); the
// holder writes the changes to MySQL on its flush, pulls what changed and
// hands it to the region's Redis (or, without Redis, to OnOverrides), so
// the nodes that do not hold the role make no MySQL statement for them
// either.

// OverrideRow is one runtime override as ratelimit_overrides holds it.
type OverrideRow struct {
	Namespace, Identifier string
	// Limit replaces the zone's limit for the identifier (0 blocks).
	Limit int64
	// ExpiresMs is when the override lapses (Unix ms); 0 never. A
	// removal's row lapses a day after it, once every region read it.
	ExpiresMs int64
	// Reason is the operator's note.
	Reason string
	// Region made the change.
	Region string
	// Version orders the changes of a row: their time, in µs.
	Version int64
	// Deleted marks a removal.
	Deleted bool
	// UpdatedMs is when the row last changed, on the database's clock.
	UpdatedMs int64
}

func (r *OverrideRow) key() *RowKey {
	return &RowKey{UpdatedMs: r.UpdatedMs, Namespace: r.Namespace, Identifier: r.Identifier}
}

// Live reports whether the override applies at now (Unix ms).
func (r *OverrideRow) Live(now int64) bool {
	return !r.Deleted && (r.ExpiresMs == 0 || r.ExpiresMs > now)
}

// OverrideStore is a Store that carries overrides (MySQL does).
type OverrideStore interface {
	// UpsertOverrides writes rows newer than those held.
	UpsertOverrides(ctx context.Context, rows []*OverrideRow) error
	// ReadOverrides reads one page of overrides (Read.Now is ignored: a
	// removal must travel too).
	ReadOverrides(ctx context.Context, r Read) ([]OverrideRow, error)
	// MarkResetCounts marks region's published counts of a key with the
	// global reset ver where they hold an older one, taking off all they
	// count; it returns how many rows it marked.
	MarkResetCounts(ctx context.Context, region, namespace, identifier string, ver int64) (int64, error)
}

// OverrideRegion is a Region that carries overrides (the region's Redis).
type OverrideRegion interface {
	// TakeOverrides returns the changes made in the region that the
	// holder has not taken; with all, every override it holds.
	TakeOverrides(ctx context.Context, all bool) ([]OverrideRow, error)
	// ApplyOverrides leaves changes read from MySQL in the region, where
	// its nodes read them.
	ApplyOverrides(ctx context.Context, rows []OverrideRow) error
}

// maxPendingOverrides bounds the changes waiting to be written; beyond it
// the oldest are dropped (a whole read of the region's Redis by the next
// holder writes them again).
const maxPendingOverrides = 100_000

// HasRegion reports whether the process is a node of a region (the
// region's Redis) rather than its own region.
func (p *Propagator) HasRegion() bool { return p.region != nil }

// overrideStore returns the store's override side, or nil.
func (p *Propagator) overrideStore() OverrideStore {
	s, _ := p.store.(OverrideStore)
	return s
}

// PutOverride queues a change made on this process for the next flush.
// For a process that is its own region (no Redis); a node of a region
// leaves its changes in the region for the holder.
func (p *Propagator) PutOverride(r OverrideRow) {
	p.mu.Lock()
	defer p.mu.Unlock()
	k := Cell{Namespace: r.Namespace, Identifier: r.Identifier}
	if old, ok := p.ovPending[k]; ok && old.Version >= r.Version {
		return
	}
	if len(p.ovPending) >= maxPendingOverrides {
		return
	}
	p.ovPending[k] = &r
}

// PendingOverrides returns the changes not written yet. What a layer that
// stopped still holds (Stop writes them once, and MySQL may not have
// answered) is the next config's to write (PutOverride) after a reload:
// a process that is its own region has them nowhere else.
func (p *Propagator) PendingOverrides() []OverrideRow {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]OverrideRow, 0, len(p.ovPending))
	for _, r := range p.ovPending {
		out = append(out, *r)
	}
	return out
}

// takeOverrides takes the region's changes for the holder to write: all
// of them on taking the role, after another server took the database's
// writes (checkServer), and after a take that failed, which may have
// emptied the queue it never read the changes of: those were never
// written, and the other regions never applied them
// (TestOverrides_ATakeThatFailedIsFollowedByAWholeOne).
func (p *Propagator) takeOverrides(ctx context.Context, all bool) {
	reg, ok := p.region.(OverrideRegion)
	if !ok || p.overrideStore() == nil {
		return
	}
	p.mu.Lock()
	again := p.ovTakeAll
	p.mu.Unlock()
	// Within the lease, as every call of a flush: a flush that found its
	// role gone once still popped the region's changes, which it then
	// never wrote, and the new holder, which had taken every change
	// before, never saw them (TestOverrides_AHolderWhoseRoleIsGoneTakesNoChange).
	var rows []OverrideRow
	err := p.query(ctx, func(ctx context.Context) error {
		var err error
		rows, err = reg.TakeOverrides(ctx, all || again)
		return err
	})
	if err != nil {
		p.regionFailed("taking the region's overrides", err)
		p.mu.Lock()
		p.ovTakeAll = true
		p.mu.Unlock()
		return
	}
	if again {
		p.mu.Lock()
		p.ovTakeAll = false
		p.mu.Unlock()
	}
	for _, r := range rows {
		p.PutOverride(r)
	}
}

// writeOverrides writes the pending changes; those not written stay.
func (p *Propagator) writeOverrides(ctx context.Context) {
	st := p.overrideStore()
	if st == nil {
		return
	}
	p.mu.Lock()
	rows := make([]*OverrideRow, 0, len(p.ovPending))
	for _, r := range p.ovPending {
		rows = append(rows, r)
	}
	p.mu.Unlock()
	if len(rows) == 0 {
		return
	}
	slices.SortFunc(rows, func(a, b *OverrideRow) int {
		return strings.Compare(a.Namespace+"\x00"+a.Identifier, b.Namespace+"\x00"+b.Identifier)
	})
	for start := 0; start < len(rows); start += p.cfg.Batch {
		batch := rows[start:min(start+p.cfg.Batch, len(rows))]
		if err := p.write(ctx, func(ctx context.Context) error { return st.UpsertOverrides(ctx, batch) }); err != nil {
			p.writeFailed("overrides", len(batch), err)
			return
		}
		p.mu.Lock()
		for _, r := range batch {
			k := Cell{Namespace: r.Namespace, Identifier: r.Identifier}
			if cur := p.ovPending[k]; cur == r {
				delete(p.ovPending, k)
			}
			p.holdOverrideLocked(*r)
		}
		p.mu.Unlock()
		p.stats.overridesWritten.Add(int64(len(batch)))
	}
}

// pullOverrides reads the overrides that changed (or all, when due) and
// hands them on: to the region's Redis, or to OnOverrides.
func (p *Propagator) pullOverrides(ctx context.Context) {
	st := p.overrideStore()
	if st == nil {
		return
	}
	// A whole read also checks that every override held here is still
	// there (checkOverrideRows).
	p.mu.Lock()
	whole := p.fullPull[Overrides]
	p.mu.Unlock()
	var got []OverrideRow
	if !pullTable(p, ctx, Overrides, st.ReadOverrides, (*OverrideRow).key, func(rows []OverrideRow) { got = append(got, rows...) }) {
		return
	}
	if whole {
		p.checkOverrideRows(ctx, got, p.now().UnixMilli())
	}
	p.mu.Lock()
	for _, r := range got {
		p.holdOverrideLocked(r)
	}
	p.mu.Unlock()
	if len(got) == 0 {
		return
	}
	p.markResets(ctx, st, got)
	if reg, ok := p.region.(OverrideRegion); ok {
		if err := reg.ApplyOverrides(ctx, got); err != nil {
			p.regionFailed("handing overrides to the region", err)
			// Read them again next time.
			p.mu.Lock()
			p.fullPull[Overrides] = true
			p.mu.Unlock()
		}
		return
	}
	if p.onOverrides != nil {
		p.onOverrides(got)
	}
}

// markResets marks this region's published counts of the keys that the
// live global resets among rows reset (MarkResetCounts), before the
// region marks its cells: a row of a cell the region's Redis lost (the
// region restarted whole, its Redis emptied) is never published again,
// and kept counting, in every other region, the units the reset took off.
// A reset is marked once by a holder (resetsMarked): a whole read of the
// overrides brings every live reset again, one statement each. A mark
// that fails is tried again at the next whole read.
func (p *Propagator) markResets(ctx context.Context, st OverrideStore, rows []OverrideRow) {
	if p.resetCells == nil {
		return
	}
	now := p.now().UnixMilli()
	p.mu.Lock()
	for k, m := range p.resetsMarked {
		if !m.Live(now) {
			delete(p.resetsMarked, k)
		}
	}
	p.mu.Unlock()
	for i := range rows {
		r := &rows[i]
		ns, id, ok := p.resetCells(*r)
		if !ok || !r.Live(now) {
			continue
		}
		k := Cell{Namespace: ns, Identifier: id}
		p.mu.Lock()
		m, marked := p.resetsMarked[k]
		p.mu.Unlock()
		if marked && m.Version >= r.Version {
			continue
		}
		if err := p.write(ctx, func(ctx context.Context) error {
			_, err := st.MarkResetCounts(ctx, p.cfg.Region, ns, id, r.Version)
			return err
		}); err != nil {
			p.writeFailed("reset marks", 1, err)
			p.mu.Lock()
			p.fullPull[Overrides] = true
			p.mu.Unlock()
			return
		}
		p.mu.Lock()
		if len(p.resetsMarked) < maxPendingOverrides {
			p.resetsMarked[k] = *r
		}
		p.mu.Unlock()
	}
}

// LoadOverrides reads every override once, for a process that starts:
// its first decision then already applies them. For a process that is its
// own region; a node of a region reads them from the region.
func (p *Propagator) LoadOverrides(ctx context.Context) ([]OverrideRow, error) {
	st := p.overrideStore()
	if st == nil {
		return nil, nil
	}
	var out []OverrideRow
	_, err := eachPage(p, ctx, Read{Limit: pageSize}, st.ReadOverrides, (*OverrideRow).key,
		func(rows []OverrideRow) { out = append(out, rows...) })
	if err != nil {
		return out, fmt.Errorf("load overrides: %w", err)
	}
	return out, nil
}

// Interface guards.
var _ OverrideStore = (*sqlStore)(nil)
