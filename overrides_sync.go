package ratelimit

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/origin"
	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// Where overrides come from and go to: the region's Redis (each change
// announced to the region's nodes), MySQL through the cross-region layer,
// or this process only.

// Scopes an override change reaches, as the admin API says them.
const (
	scopeNode   = "node"
	scopeRegion = "region"
	scopeGlobal = "global"
)

// overrideScope is where a change made now is stored: every region with
// MySQL, the region with Redis, else this process.
func overrideScope(st *state) string {
	switch {
	case currentProp.Load() != nil:
		return scopeGlobal
	case st.currentOrigin() != nil:
		return scopeRegion
	}
	return scopeNode
}

// errOverrideStore is a change the region's Redis did not take: nothing
// was stored anywhere.
var errOverrideStore = errors.New("the region's Redis did not take the change")

// storeOverride stores a change where its scope says and applies it here.
// With Redis the region takes it first (and queues it for MySQL when the
// cross-region layer runs): a change the region did not take is stored
// nowhere. Without Redis, a process of its own region queues it for MySQL.
func storeOverride(ctx context.Context, st *state, rec overrideRec) (string, error) {
	scope := overrideScope(st)
	rb := st.overridesRedis()
	switch {
	case rb != nil:
		ctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		if _, err := rb.PutOverrides(ctx, []origin.Override{rec.regionValue()}, scope == scopeGlobal); err != nil {
			return scope, errors.Join(errOverrideStore, err)
		}
	case scope == scopeGlobal:
		currentProp.Load().PutOverride(rec.row())
	}
	overrides.merge([]overrideRec{rec})
	return scope, nil
}

// overridesRedis is the origin in use as a store of overrides, or nil.
func (s *state) overridesRedis() *origin.Redis {
	if r, ok := s.currentOrigin().(*origin.Redis); ok {
		return r
	}
	return nil
}

// loadRegionOverrides reads every override the region holds into the
// book and drops those that lapsed from the region; it returns the
// region's change counter they are as of.
func loadRegionOverrides(ctx context.Context, o *origin.Redis) (int64, error) {
	v, all, err := o.Overrides(ctx)
	if err != nil {
		return 0, err
	}
	now := time.Now().UnixMilli()
	recs := make([]overrideRec, 0, len(all))
	var lapsed []origin.Override
	for _, ov := range all {
		r, ok := recOfRegion(ov)
		if !ok {
			continue
		}
		if r.ExpiresMs != 0 && r.ExpiresMs <= now {
			lapsed = append(lapsed, ov)
		}
		recs = append(recs, r)
	}
	overrides.merge(recs)
	overrides.prune(now)
	return v, o.DropOverrides(ctx, lapsed)
}

// watchOverrides keeps the book up to date with the region's Redis: it
// loads every override at once (decisions wait for the process's first
// load), then reads the region's change counter, and every override when
// it moved, on each notice of a change (origin.WatchOverrides) and on a
// timer, until stop closes. The timer is the slow tick while the
// subscription to the notices is live (a check that bounds what a lost
// notice costs) and the fast tick while it is not: an idle node sends ten
// commands a second rather than a hundred, and a change arrives within a
// round trip rather than within a fast tick.
func (b *redisBackend) watchOverrides(stop <-chan struct{}) {
	log := b.a.logger
	load := func(ctx context.Context) (int64, error) {
		ctx, cancel := context.WithTimeout(ctx, max(b.timing.ReadTimeout, loadTimeout/2))
		defer cancel()
		return loadRegionOverrides(ctx, b.origin)
	}
	wake := make(chan struct{}, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go b.origin.WatchOverrides(ctx, func(bool) {
		select {
		case wake <- struct{}{}:
		default:
		}
	})
	seen, err := load(ctx)
	overrides.endLoad()
	if err != nil {
		seen = -1
		log.Warn("loading the region's runtime overrides: retried each fast tick", zap.Error(err))
	}
	timer := time.NewTimer(b.timing.FastTick)
	defer timer.Stop()
	for {
		select {
		case <-stop:
			return
		case <-timer.C:
		case <-wake:
		}
		if b.origin.OverrideNotices() {
			timer.Reset(b.timing.SlowTick)
		} else {
			timer.Reset(b.timing.FastTick)
		}
		ctx, cancel := context.WithTimeout(context.Background(), b.timing.ReadTimeout)
		v, err := b.origin.OverridesVersion(ctx)
		cancel()
		if err != nil || v == seen {
			continue
		}
		if got, err := load(context.Background()); err == nil {
			seen = got
		}
		overrides.prune(time.Now().UnixMilli())
	}
}

// mysqlOverrideHooks are the cross-region layer's hooks of a process
// that is its own region: overrides pulled from MySQL go to the book.
func mysqlOverrideHooks(opts *propagation.Options) {
	opts.OnOverrides = func(rows []propagation.OverrideRow) {
		recs := make([]overrideRec, len(rows))
		for i := range rows {
			recs[i] = recOfRow(&rows[i])
		}
		overrides.merge(recs)
		overrides.prune(time.Now().UnixMilli())
	}
}

// loadMySQLOverrides is the first load of a process that is its own
// region: every override MySQL holds, before its first decision.
// It tries again until loadTimeout while the schema is being made.
func (b *mysqlBackend) loadMySQLOverrides(p *propagation.Propagator) {
	defer overrides.endLoad()
	ctx, cancel := context.WithTimeout(context.Background(), loadTimeout)
	defer cancel()
	var rows []propagation.OverrideRow
	var err error
	for {
		if rows, err = p.LoadOverrides(ctx); err == nil || ctx.Err() != nil {
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
	if err != nil {
		b.a.logger.Warn("loading the runtime overrides from MySQL: the pulls bring them", zap.Error(err))
	}
	recs := make([]overrideRec, len(rows))
	for i := range rows {
		recs[i] = recOfRow(&rows[i])
	}
	overrides.merge(recs)
}
