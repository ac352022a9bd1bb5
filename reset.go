package ratelimit

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// Resets beyond one node: DELETE /ratelimit/counters?…&scope=region|global
// makes a key start over from zero in its current window on every node of
// the region, or of every region, and stay so. The region's Redis marks
// the key's cells (origin/reset.go: what they held before, the region's
// units and what it imported, never comes back, whatever a node replays
// or a region publishes later); the reset itself is a record in the
// region's hash of overrides (overrides.go), and every node that hears of
// it drops its own state of the key and the units it had not replayed
// (engine.DropMatching). A global reset travels like an override: the
// role's holder writes it to MySQL, every other region's holder marks its
// own region's cells when it first reads it (mysql_region.go) and leaves
// it for its nodes. Published rows keep their totals (they only grow) and
// carry each region's mark (the reset's version and the region's total
// then), so every region takes off exactly what another counted before
// its own mark (origin/reset.go).

// resetLife is how long a reset's record is kept: two of the zone's
// longest windows (the reset window and the one it weighs in), at least a
// minute.
func resetLife(defs []zoneDef) time.Duration {
	return max(2*slicesMax(defWindows(defs)), time.Minute)
}

func slicesMax(ws []time.Duration) time.Duration {
	var m time.Duration
	for _, w := range ws {
		m = max(m, w)
	}
	return m
}

// resetKey is DELETE /ratelimit/counters: scope node (the default)
// forgets the key here; region and global reset it everywhere they reach.
func resetKey(w http.ResponseWriter, r *http.Request, st *state, zoneName, id string, defs []zoneDef, scope string) error {
	switch scope {
	case scopeNode:
		return forgetKey(w, st, zoneName, id, defs)
	case scopeRegion, scopeGlobal:
	default:
		return badRequest("scope is node, region or global")
	}
	// An address prefix in a form the zone never counts resets nothing:
	// it was answered 200, "reset": true, and the range stayed denied
	// (TestOperator_AResetOfAnAddressPrefixThatNeverMatches).
	if err := checkOverrideAddress(id, defs); err != nil {
		return err
	}
	rb := st.overridesRedis()
	switch {
	case rb == nil:
		return badRequest("scope " + scope + " needs the region's Redis: this node counts alone (scope=node forgets the key here)")
	case scope == scopeGlobal && currentProp.Load() == nil:
		return badRequest("scope global needs the cross-region layer (a mysql line): scope=region resets the key in this region")
	}
	view := st.apps.view()
	now := st.engine.Now() // the region's clock: the reset marks the window the region counts in
	rec := overrideRec{Zone: zoneName, Identifier: storedIdentifier(st, id, defs), Form: view.ids.form(), Reset: true, Global: scope == scopeGlobal, Region: view.region,
		CreatedMs: now.UnixMilli(), Version: now.UnixMicro(), ExpiresMs: now.Add(resetLife(defs)).UnixMilli()}
	// This node's unreplayed units go out before the cells are marked, and
	// it forgets the key only once the region took the reset: a reset
	// that fails (503) changes nothing here. What it admits between the
	// two writes is dropped with the key, as on the nodes that hear of it.
	ctx, cancel := context.WithTimeout(r.Context(), time.Second)
	defer cancel()
	took, err := storeReset(ctx, st, rb, &rec)
	if next := replacedRedis(st, rb); err != nil && next != nil {
		// A reload closed the client under the reset: again, on the one
		// in use, unless its record took. Marks are not idempotent: a
		// region reset's sets the cell's mark at its total then, and made
		// again it took off the units written since the first, admitted
		// after the reset
		// (TestReset_ARetryAfterAReloadKeepsUnitsWrittenSinceTheMarks).
		if ok, _ := tookAnyway(next, rec); ok {
			took, err = 1, nil
		} else {
			took, err = storeReset(ctx, st, next, &rec)
		}
	}
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusServiceUnavailable, Err: err}
	}
	if took == 0 {
		return caddy.APIError{HTTPStatus: http.StatusConflict,
			Err: errors.New("the region took a newer change of this key meanwhile: send the reset again")}
	}
	forgetHeld(st, rec)
	overrides.merge([]overrideRec{rec})
	resetsTotal.WithLabelValues(scope).Inc()
	view.logger.Info("key reset", append([]zap.Field{zap.String("by", r.RemoteAddr), zap.String("zone", zoneName),
		zap.String("scope", scope)}, shownFields(view.ids, rec.Identifier)...)...)
	return writeJSON(w, resetDoc{Zone: zoneName, shownID: showID(view.ids.shown(engine.NormalizeIdentifier(maskKeyID(id, defs[0].key, defs[0].v4, defs[0].v6)))),
		Scope: scope, Reset: true})
}

// storeReset writes the reset rec to the region's Redis rb: this node's
// unreplayed units of the key, the cells' marks, then its record. It
// returns how many records took (0: the region holds a newer change).
func storeReset(ctx context.Context, st *state, rb *origin.Redis, rec *overrideRec) (int, error) {
	// The reset comes after the region's last change of the key (made on a
	// node whose clock runs ahead): its record would not take, and the
	// nodes would never hear of it.
	held, _, err := rb.OverrideVersion(ctx, rec.field())
	rec.Version = max(rec.Version, held+1)
	if err == nil {
		err = flushHeld(st, *rec)
	}
	if err == nil {
		err = resetRegionCells(ctx, rb, st, *rec)
	}
	if err != nil {
		return 0, errors.Join(errOverrideStore, err)
	}
	took, err := rb.PutOverrides(ctx, []origin.Override{rec.regionValue()}, rec.Global)
	if err != nil {
		// Redis may have run it, and its reply come too late: the
		// region's nodes then forget the key, and so must this one.
		ok, rerr := tookAnyway(rb, *rec)
		if ok {
			return 1, nil
		}
		// The cells' marks went out before the record: a record that
		// could not even be sent leaves them, and the answer says the
		// region may hold the reset, not that nothing is stored.
		return 0, errors.Join(storeFailed(rerr, nil), err)
	}
	return took, nil
}

// resetDoc is the answer to a reset beyond this node.
type resetDoc struct {
	Zone string `json:"zone"`
	shownID
	Scope string `json:"scope"`
	Reset bool   `json:"reset"`
}

// resetRegionCells marks the key's cell of the reset's own window (see
// resetSeq) in every window its zone has here, and the
// one before it, in the region's Redis; a global reset under its version,
// which every region marks alike. A global reset another region hears
// late (MySQL held it back) so never takes off units counted after it.
func resetRegionCells(ctx context.Context, o *origin.Redis, st *state, rec overrideRec) error {
	var version int64
	if rec.Global {
		version = rec.Version
	}
	for _, w := range resetWindows(st, rec.Zone) {
		key := engine.Key{Namespace: rec.Zone, Identifier: rec.Identifier, Window: w}
		if err := o.ResetCells(ctx, key, resetSeq(rec, w), version); err != nil {
			return err
		}
	}
	return nil
}

// forgetHeld drops this process's state of the reset key in every window
// of its zone, and the units it has not replayed of the reset's window and
// the one before it, the cells the reset marks: admitted before it heard
// of the reset (the node that made it wrote those before the marks), they
// would count again after the marks (engine.DropMatching). Units of a
// later window are written, and so are those of a cell this process made
// after the reset was made (its window's sequence is resetSeq's): a node
// cut off from Redis that met the key after the reset admitted them after
// it, and dropped, the region admitted the limit again.
func forgetHeld(st *state, rec overrideRec) {
	for _, w := range resetWindows(st, rec.Zone) {
		st.engine.DropMatching(rec.Zone, w, heldMatch(st, rec), resetMadeMs(rec))
	}
}

// resetWindows are the windows a reset of zone takes effect in here: its
// loaded configs' windows of the zone, and every other window the engine
// holds the zone's keys in. A node reloaded to a config without the zone
// (or with it at another window) keeps its engine's cells of the old
// window, and a later reload weighs them again: a reset heard meanwhile
// once dropped nothing there, and the node denied what the region had
// room for (TestReset_ARegionResetWhileTheZoneIsNotLoadedHereTakesItsUnitsOff).
func resetWindows(st *state, zone string) []time.Duration {
	ws := defWindows(st.zones.definitions(zone, st.apps.view().app))
	for _, w := range st.engine.Windows(zone) {
		if !slices.Contains(ws, w) {
			ws = append(ws, w)
		}
	}
	return ws
}

// resetSeq is the sequence of the window of length w a reset was made in:
// when it was made, not its version, which comes after the region's
// newest change of the key and may lie windows ahead (made on a node whose
// clock runs ahead): the reset then cleared windows to come and left the
// current one. A record without the time (written by a build before
// records carried it) says it by its version.
func resetSeq(rec overrideRec, w time.Duration) int64 {
	return resetMadeMs(rec) / w.Milliseconds()
}

// resetMadeMs is when a reset was made (Unix ms), by its version when
// its record does not say (resetSeq).
func resetMadeMs(rec overrideRec) int64 {
	if rec.CreatedMs > 0 {
		return rec.CreatedMs
	}
	return rec.Version / 1000
}

// flushHeld writes what this process has not replayed yet of the reset
// key in every window of its zone, and returns the first error.
func flushHeld(st *state, rec overrideRec) error {
	for _, w := range resetWindows(st, rec.Zone) {
		if err := st.engine.FlushMatching(rec.Zone, w, heldMatch(st, rec)); err != nil {
			return err
		}
	}
	return nil
}

// heldMatch matches the reset key's identifier as it left the process.
func heldMatch(st *state, rec overrideRec) func(id string) bool {
	mapID := st.apps.view().ids.mapper()
	if mapID != nil {
		return func(id string) bool { return mapID(id) == rec.Identifier }
	}
	return func(id string) bool { return id == rec.Identifier }
}

// onResets is what the book does with resets it had not heard of: this
// process forgets the keys (a reset that lapsed already is left alone).
// A reset made before the engine was is left alone too: every unit the
// engine holds was admitted after it, and the region must count them (a
// node started while Redis did not answer it hears of an earlier reset
// when Redis is back; dropping its units let it admit the limit again).
var onResets = func(recs []overrideRec) {
	st := lookupState()
	if st == nil {
		return
	}
	form := st.apps.view().ids.form()
	for _, rec := range recs {
		if resetTakesHeld(st, rec) && (rec.Form == "" || rec.Form == form) {
			forgetHeld(st, rec)
		}
	}
}

// resetTakesHeld reports whether a reset heard of now takes off units
// this process holds: it has not lapsed, and it was made after the
// engine began. Both are read on the region's clock, the one resetKey
// stamps a reset with (engine.Now), the engine's start as the first
// heartbeat measured it on that clock (state.startedRegionMs). On this
// process's own clock a node 30 s behind its Redis took a reset made 10 s before its engine
// began for a later one, and a node 30 s ahead took a live reset of a
// 10 s window for one that had lapsed
// (TestReset_HeardLateIsJudgedOnTheRegionsClock). Before the first
// heartbeat measured Redis's clock, the offset is 0 and the process's
// clock is all there is.
func resetTakesHeld(st *state, rec overrideRec) bool {
	started := st.startedRegionMs()
	return rec.ExpiresMs > st.engine.Now().UnixMilli() && resetMadeMs(rec) >= started
}
