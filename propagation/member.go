package propagation

import (
	"context"
	"errors"

	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// What every node of a region does, holder or not: it leaves in the
// region's Redis the cells worth publishing and its first denials, where
// the role's holder finds them. It never talks to MySQL (but for the
// migration check at start).

// engineCell names a cell as the engine does (the raw identifier).
type engineCell struct {
	key engine.Key
	seq int64
}

// registration is what a node last registered of a cell.
type registration struct {
	limit, expires int64
	hot            bool
}

// worth reports whether a cell's count is worth publishing, and whether
// it is hot. A cell is worth it once its region counted something and it
// is pressed (its key at half the limit or more), or its level (what all
// regions counted) reached publish_floor, or other regions count it too:
// below that, no spread of regions can together exceed the limit by much
// before the next sync, and idle keys cost no rows. A pressed cell is
// hot: published on every flush, not only at the sync.
func (p *Propagator) worth(v *engine.CellView) (worth, hot bool, pressure float64) {
	// The limit the count was decided against: a zone may carry
	// different limits in different sites, and overrides.
	limit := v.Limit
	if limit <= 0 || v.Regional <= 0 {
		return false, false, 0
	}
	pressure = float64(v.Effective) / float64(limit)
	hot = v.Effective*2 >= limit
	level := float64(max(engine.SatAdd(v.Regional, v.Global), v.Effective)) / float64(limit)
	return hot || v.Global > 0 || level >= p.cfg.PublishFloor, hot, pressure
}

// registerCells registers this node's cells worth publishing that it has
// not registered yet, or that turned hot or changed limit since: one
// HMAC per registration under identifier_secret, none per scan.
func (p *Propagator) registerCells(ctx context.Context) {
	type due struct {
		at  engineCell
		reg registration
	}
	var dues []due
	m := &p.member
	m.Lock()
	p.eng.ScanCells(p.cfg.MinWindow, func(v *engine.CellView) bool {
		worth, hot, _ := p.worth(v)
		if !worth {
			return true
		}
		at := engineCell{v.Key, v.Sequence}
		old, ok := m.registered[at]
		if ok && old.limit == v.Limit && (old.hot || !hot) {
			return true
		}
		w := v.Key.Window.Milliseconds()
		dues = append(dues, due{at, registration{limit: v.Limit, expires: expiresMs(v.Sequence, w), hot: hot || old.hot}})
		return len(dues) < registerBatch
	})
	m.Unlock()
	if len(dues) == 0 {
		return
	}
	cells := make([]RegionCell, len(dues))
	for i, d := range dues {
		k := d.at.key
		cells[i] = RegionCell{
			Cell:  Cell{k.Namespace, p.rowID(k.Identifier), k.Window.Milliseconds(), d.at.seq},
			Limit: d.reg.limit, Expires: d.reg.expires, Hot: d.reg.hot,
		}
	}
	if err := p.query(ctx, func(ctx context.Context) error { return p.region.Register(ctx, cells) }); err != nil {
		p.regionFailed("registering cells to publish", err)
		return
	}
	m.Lock()
	for _, d := range dues {
		if len(m.registered) < maxRegistered {
			m.registered[d.at] = d.reg
		}
	}
	m.Unlock()
	p.stats.registered.Add(int64(len(dues)))
}

// putDenials leaves this node's first denials in the region for the
// holder; those the region did not take are kept (until they expire) for
// the next flush.
func (p *Propagator) putDenials(ctx context.Context) {
	now := p.now().UnixMilli()
	m := &p.member
	m.Lock()
	p.drainDenials(m.unput)
	rows := make([]BlocklistRow, 0, len(m.unput))
	for c, r := range m.unput {
		if r.ExpiresMs <= now {
			delete(m.unput, c)
			p.stats.denialsExpired.Add(1)
			continue
		}
		rows = append(rows, *r)
	}
	m.Unlock()
	if len(rows) == 0 {
		return
	}
	if err := p.query(ctx, func(ctx context.Context) error { return p.region.PutDenials(ctx, rows) }); err != nil {
		p.regionFailed("leaving denial rows for the role's holder", err)
		return
	}
	m.Lock()
	for _, r := range rows {
		// A newer denial of the cell, queued meanwhile, stays.
		if cur := m.unput[r.cell()]; cur != nil && *cur == r {
			delete(m.unput, r.cell())
		}
	}
	m.Unlock()
	p.stats.denialsLeft.Add(int64(len(rows)))
}

// pruneMember forgets registrations of cells that expired.
func (p *Propagator) pruneMember(now int64) {
	m := &p.member
	m.Lock()
	defer m.Unlock()
	for at, r := range m.registered {
		if r.expires <= now {
			delete(m.registered, at)
		}
	}
}

// regionFailed logs a failed call to the region's Redis: one line per
// streak start, then one per hundred (the metrics count every one).
func (p *Propagator) regionFailed(what string, err error) {
	if errors.Is(err, errLeaseLost) || p.stopped(err) {
		return
	}
	if c := p.stats.regionErrors.Add(1); c == 1 || c%100 == 0 {
		p.log.Warn("the region's Redis did not answer the cross-region layer: kept for the next flush",
			zap.String("what", what), zap.Int64("region_errors", c), zap.Error(err))
	}
}
