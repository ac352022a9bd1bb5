package ratelimit

import (
	"context"
	"encoding/json"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/origin"
	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// redisRegion is the region's shared state in its Redis as the
// cross-region layer sees it (propagation.Region): the origin's role API.
// Identifiers pass as they are: the layer's are the rows', which are the
// origin's keys' (HMACs under identifier_secret in both).
type redisRegion struct {
	o *origin.Redis
	// st is the process's state: the windows of the zone a reset marks.
	st *state
	// region is the region's name (App.Region); database the MySQL
	// database the node writes to (propagation.DatabaseOf).
	region, database string
}

func roleKey(c propagation.Cell) engine.Key {
	return engine.Key{Namespace: c.Namespace, Identifier: c.Identifier, Window: time.Duration(c.WindowMs) * time.Millisecond}
}

func roleCell(c propagation.Cell) origin.RoleCell {
	return origin.RoleCell{Key: roleKey(c), Sequence: c.Sequence}
}

func layerCell(k engine.Key, seq int64) propagation.Cell {
	return propagation.Cell{Namespace: k.Namespace, Identifier: k.Identifier, WindowMs: k.Window.Milliseconds(), Sequence: seq}
}

func (r redisRegion) NodeID() string { return r.o.NodeID() }

func (r redisRegion) Lease(ctx context.Context, ttl time.Duration) (string, error) {
	return r.o.LeaseFor(ctx, ttl, r.region, r.database)
}

func (r redisRegion) ReleaseLease(ctx context.Context) error { return r.o.ReleaseLease(ctx) }

func (r redisRegion) Register(ctx context.Context, cells []propagation.RegionCell) error {
	out := make([]origin.RoleCell, len(cells))
	for i, c := range cells {
		out[i] = roleCell(c.Cell)
		out[i].Limit, out[i].Expires, out[i].Hot = c.Limit, c.Expires, c.Hot
	}
	return r.o.Register(ctx, out)
}

func (r redisRegion) TakeRegistered(ctx context.Context, all bool, now int64) ([]propagation.RegionCell, error) {
	cells, err := r.o.TakeRegistered(ctx, all, now)
	out := make([]propagation.RegionCell, len(cells))
	for i, c := range cells {
		out[i] = propagation.RegionCell{Cell: layerCell(c.Key, c.Sequence), Limit: c.Limit, Expires: c.Expires, Hot: c.Hot}
	}
	return out, err
}

// denial is a denial row as the region holds it: its JSON, which encodes
// the same row the same way every time (DenialsWritten compares it).
func denial(row propagation.BlocklistRow) origin.RoleDenial {
	b, _ := json.Marshal(row) // a struct of strings and numbers always encodes
	c := propagation.Cell{Namespace: row.Namespace, Identifier: row.Identifier, WindowMs: row.WindowMs, Sequence: row.Sequence}
	return origin.RoleDenial{Key: roleKey(c), Sequence: row.Sequence, Row: string(b)}
}

func (r redisRegion) PutDenials(ctx context.Context, rows []propagation.BlocklistRow) error {
	out := make([]origin.RoleDenial, len(rows))
	for i, row := range rows {
		out[i] = denial(row)
	}
	return r.o.PutDenials(ctx, out)
}

// TakeDenials returns the rows left in the region; one that does not
// decode (written by another version) is skipped and left in place, for
// a holder of the version that wrote it (the registry's hashes have no
// expiry: such a row stays until one takes it). The row's cell is the one its field names: JSON
// carries an identifier's bytes that are not UTF-8 as U+FFFD, and the
// holder once wrote such a denial under another identifier and, its
// removal naming another field, left it in the region for good
// (TestRegionAdapter_DenialsKeepTheirIdentifierBytes).
func (r redisRegion) TakeDenials(ctx context.Context) ([]propagation.BlocklistRow, error) {
	ds, err := r.o.TakeDenials(ctx)
	out := make([]propagation.BlocklistRow, 0, len(ds))
	for _, d := range ds {
		var row propagation.BlocklistRow
		if json.Unmarshal([]byte(d.Row), &row) == nil {
			c := layerCell(d.Key, d.Sequence)
			row.Namespace, row.Identifier, row.WindowMs, row.Sequence = c.Namespace, c.Identifier, c.WindowMs, c.Sequence
			out = append(out, row)
		}
	}
	return out, err
}

func (r redisRegion) DenialsWritten(ctx context.Context, rows []propagation.BlocklistRow) error {
	out := make([]origin.RoleDenial, len(rows))
	for i, row := range rows {
		out[i] = denial(row)
	}
	return r.o.DenialsWritten(ctx, out)
}

func (r redisRegion) Totals(ctx context.Context, cells []propagation.Cell) ([]propagation.RegionTotal, error) {
	in := make([]origin.RoleCell, len(cells))
	for i, c := range cells {
		in[i] = roleCell(c)
	}
	ts, err := r.o.CellTotals(ctx, in)
	out := make([]propagation.RegionTotal, len(ts))
	for i, t := range ts {
		out[i] = propagation.RegionTotal{Count: t.Count, ResetVersion: t.ResetVersion, ResetBase: t.ResetBase}
	}
	return out, err
}

func (r redisRegion) Import(ctx context.Context, ims []propagation.RegionImport) error {
	out := make([]origin.RoleImport, len(ims))
	for i, im := range ims {
		var parts []origin.ImportPart
		if im.Parts != nil {
			parts = make([]origin.ImportPart, len(im.Parts))
			for j, p := range im.Parts {
				parts[j] = origin.ImportPart{Region: p.Region, Count: p.Count, Denied: p.Denied, ResetVersion: p.ResetVersion, ResetBase: p.ResetBase}
			}
		}
		out[i] = origin.RoleImport{Key: roleKey(im.Cell), Sequence: im.Sequence, Count: im.Count, Parts: parts}
	}
	err := r.o.Import(ctx, out)
	for i := range out {
		ims[i].WantsParts = out[i].WantsParts
	}
	return err
}

// Interface guard.
var _ propagation.Region = redisRegion{}

// TakeOverrides takes the region's override changes for MySQL, and its
// resets for every region; a reset of the region alone stays in it.
func (r redisRegion) TakeOverrides(ctx context.Context, all bool) ([]propagation.OverrideRow, error) {
	os, err := r.o.TakeOverrides(ctx, all)
	out := make([]propagation.OverrideRow, 0, len(os))
	for _, o := range os {
		if rec, ok := recOfRegion(o); ok && (!rec.Reset || rec.Global) {
			out = append(out, rec.row())
		}
	}
	return out, err
}

// ApplyOverrides leaves the changes in the region's hash. A reset the
// region has not heard of first marks the region's cells of the key, so
// the region's count and what it imported start over here too; the
// region that made it, or a holder reading it again, finds it held.
//
// A region reset by a build before regionResetMark shares the key's name
// in the hash with a global one: such a region reset made here after the
// global one (before its row arrived, or while MySQL held it back) is the
// newer record, and the global reset was once taken for one held. The region then never marked under its
// version and published no mark of it: the other regions counted
// nothing of the key from here for the rest of the window, and this
// region weighed their units from before their marks
// (TestReset_AGlobalResetHeardAfterARegionResetStillMarksTheRegion). The
// cells are marked under its version then, and the newer record stays.
func (r redisRegion) ApplyOverrides(ctx context.Context, rows []propagation.OverrideRow) error {
	os := make([]origin.Override, 0, len(rows))
	for i := range rows {
		rec := recOfRow(&rows[i])
		if rec.Reset {
			rec.Global = true
			if held, ok, err := r.o.HeldOverride(ctx, rec.field()); err != nil {
				return err
			} else if ok && held.Version >= rec.Version {
				if h, known := recOfRegion(held); known && !h.Global {
					// The region's own reset, newer: the cells still
					// take the global one's mark (a no-op where they
					// hold it or a newer one).
					if err := resetRegionCells(ctx, r.o, r.st, rec); err != nil {
						return err
					}
				}
				continue
			}
			// Marked before it is recorded: a node that hears of it and
			// drops the key reads marked cells. A reset this process has
			// heard of from this region (or made in it) was marked when
			// it was recorded there; the region's Redis no longer holding
			// it means it restarted empty since, and lost the marks with
			// the cells. The nodes sent their cells again less what the
			// reset took off, so marking again took off the units
			// admitted since the reset a second time: the region could
			// admit them again, and the holder published its count under
			// the reset with no base, below its row, which stopped
			// growing (TestReset_AResetTheRegionHeardIsNotMarkedAgainAfterARestart;
			// the root's TestReset_RedisRestartedEmptyAfterAGlobalResetPublishesItsUnits
			// failed when the holder's pull brought its own reset back
			// only after the restart). The record is written back. So
			// is one this region made, which it marked when it made it,
			// heard of or not: a holder whose process started after the
			// reset, its book loaded from the emptied Redis, took it for
			// news (TestReset_AResetTheRegionMadeIsNotMarkedAgainByAHolderStartedSince).
			// A reset made elsewhere that this region marked before its
			// Redis restarted cannot be told from one it never heard
			// of, and such a holder marks it again.
			if !overrides.heardFrom(rec, r.o.Placement()) && (r.region == "" || rec.Region != r.region) {
				if err := resetRegionCells(ctx, r.o, r.st, rec); err != nil {
					return err
				}
			}
		}
		os = append(os, rec.regionValue())
	}
	_, err := r.o.PutOverrides(ctx, os, false)
	return err
}

// Interface guards.
var _ propagation.OverrideRegion = redisRegion{}
