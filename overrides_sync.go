package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
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

// errOverrideUnknown is a change whose write failed in a way that does
// not say whether Redis ran it (its reply came too late, the connection
// broke), and that could not be read back: the region may hold it.
var errOverrideUnknown = errors.New("the region's Redis did not answer, and may hold the change: it was not applied here; send it again (a repeat changes nothing more)")

// tookAnyway reads back, within a second of its own, whether the region
// holds rec in its version after a write of it that failed: Redis may
// have run a write whose reply came after the call's deadline, and its
// other nodes then apply the change. It reports whether the region holds
// it, and the read's error.
func tookAnyway(o *origin.Redis, rec overrideRec) (bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	held, ok, err := o.OverrideVersion(ctx, rec.field())
	return err == nil && ok && held == rec.Version, err
}

// storeFailed is the error of a change whose write failed with err and
// did not take: stored nowhere when the read back answered, or when the
// write never left this node (its connection could not be made: the
// client makes no retries, so nothing reached Redis), unknown otherwise.
// A Redis that is down refuses both the write and the read back, and was
// answered "may hold the change" before 2026-11-28
// (TestOperator_AChangeWithRedisDownIsStoredNowhere in integration/).
// A reset passes no err: its marks went out before its record.
func storeFailed(readBack, err error) error {
	if readBack != nil && !neverSent(err) {
		return errOverrideUnknown
	}
	return errOverrideStore
}

// neverSent reports whether err is a failure to connect: the call's
// command was never written.
func neverSent(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// errOverrideUnchecked is a conditional change the region's Redis could
// not be asked about (down, refusing connections, no answer in time): its
// precondition holds region-wide or it does not, and this node cannot
// tell, so nothing was stored. The node's own book is not enough: a
// change made on another node may not have reached it.
var errOverrideUnchecked = errors.New("the region's Redis could not check the precondition (If-Match / If-None-Match) against what the region holds: nothing was changed; send it again once the region's Redis answers")

// storeOverride stores a change where its scope says and applies it here,
// and returns it as stored. With Redis the region takes it first (and
// queues it for MySQL when the cross-region layer runs): a change the
// region did not take is stored nowhere. An operator's change comes after
// whatever the region holds of the key: when the region holds a version
// ahead of this node's clock (made on a node whose clock runs fast, or by
// another operator a moment before), the change is stamped past it and
// stored again, once; a change that still does not take answers 409.
// Without Redis, a process of its own region queues it for MySQL.
func storeOverride(ctx context.Context, st *state, rec overrideRec) (overrideRec, string, error) {
	return storeChecked(ctx, st, rec, nil)
}

// storeChecked is storeOverride of a change made under cond, which the
// region's Redis checks in the same step as each write, the second one
// stamped past a newer version included: the condition is about what the
// region holds, which a version bump does not change. A change whose
// condition fails there is a 412 naming what the region holds, and one
// the region could not check a 503 (errOverrideUnchecked). Without Redis
// cond was checked against the node's book alone, by the caller.
func storeChecked(ctx context.Context, st *state, rec overrideRec, cond *regionCondition) (overrideRec, string, error) {
	scope := overrideScope(st)
	rb := st.overridesRedis()
	switch {
	case rb != nil:
		ctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		for try := 0; ; try++ {
			n, err := putInRegion(ctx, st, rb, rec, cond, scope == scopeGlobal)
			if _, failed := err.(caddy.APIError); failed {
				return rec, scope, err
			}
			if err != nil {
				took, rerr := tookAnyway(rb, rec)
				if !took {
					if next := replacedRedis(st, rb); next != nil {
						// A reload closed the client under the call:
						// the same change again, on the one in use.
						rb = next
						try--
						continue
					}
					failed := storeFailed(rerr, err)
					if cond != nil && failed == errOverrideStore {
						failed = errOverrideUnchecked
					}
					return rec, scope, errors.Join(failed, err)
				}
				n = 1
			}
			if n > 0 {
				break
			}
			held, _, err := rb.OverrideVersion(ctx, rec.field())
			if err != nil {
				return rec, scope, errors.Join(errOverrideStore, err)
			}
			if try > 0 {
				return rec, scope, caddy.APIError{HTTPStatus: http.StatusConflict,
					Err: fmt.Errorf("the region holds a newer change of this key (version %d): read it with GET and try again", held)}
			}
			rec.Version = max(rec.Version, held+1)
		}
	case scope == scopeGlobal:
		currentProp.Load().PutOverride(rec.row())
	}
	overrides.merge([]overrideRec{rec})
	return rec, scope, nil
}

// putInRegion writes rec to the region's Redis, under cond when there is
// one, and returns how many fields took (0: the region holds a newer
// version). A condition the region found false is a 412 (a
// caddy.APIError), and what the region held, newer than the book's copy,
// goes into the book: the node knows at once what the 412 named.
func putInRegion(ctx context.Context, st *state, rb *origin.Redis, rec overrideRec, cond *regionCondition, queue bool) (int, error) {
	if cond == nil {
		return rb.PutOverrides(ctx, []origin.Override{rec.regionValue()}, queue)
	}
	nowMs := st.engine.NowMs()
	got, err := rb.PutOverrideIf(ctx, rec.regionValue(), cond.origin(nowMs), queue)
	switch {
	case err != nil:
		return 0, err
	case got.Failed:
		if held, ok := recOfRegion(got.Held); got.Holds && ok {
			overrides.merge([]overrideRec{held})
		}
		return 0, cond.failed(got.Held, got.Holds, nowMs)
	case got.Took:
		return 1, nil
	}
	return 0, nil
}

// replacedRedis is the region's Redis in use when a reload replaced rb
// with it, else nil. A reload makes the origin again and closes the old
// one, so an admin change whose call was on its way then failed with a
// closed connection, and its read back too: a 503 for a change that the
// region's Redis, reachable all along, would have taken. The call is
// made again once on the new origin (a repeat changes nothing more).
func replacedRedis(st *state, rb *origin.Redis) *origin.Redis {
	if next := st.overridesRedis(); next != nil && next != rb {
		return next
	}
	return nil
}

// overridesRedis is the origin in use as a store of overrides, or nil.
func (s *state) overridesRedis() *origin.Redis {
	if r, ok := s.currentOrigin().(*origin.Redis); ok {
		return r
	}
	return nil
}

// loadRegionOverrides reads every override the region holds, hands them
// to take (the book's merge, or its replace when a node joins), and drops
// from the region those it may forget (overrideRec.forgetMs); it returns
// the region's change counter they are as of.
func loadRegionOverrides(ctx context.Context, o *origin.Redis, nowMs func() int64, take func([]overrideRec)) (int64, error) {
	v, all, err := o.Overrides(ctx)
	if err != nil {
		return 0, err
	}
	now := nowMs()
	recs := make([]overrideRec, 0, len(all))
	var lapsed []origin.Override
	for _, ov := range all {
		r, ok := recOfRegion(ov)
		if !ok {
			continue
		}
		if r.ExpiresMs != 0 && r.forgetMs() <= now {
			lapsed = append(lapsed, ov)
		}
		recs = append(recs, r)
	}
	take(recs)
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
// round trip rather than within a fast tick. When the region lost its
// overrides, the node writes back those it holds (regionWatch.look). st
// is the app's state when the watch began: the app's own field is cleared
// by its Cleanup, which may run while a look is under way.
func (b *redisBackend) watchOverrides(st *state, stop <-chan struct{}) {
	w := &regionWatch{o: b.origin, log: b.a.logger, readTimeout: b.timing.ReadTimeout, heard: b.heard,
		global: func() bool { return overrideScope(st) == scopeGlobal }, regionNow: st.engine.Now,
		clockKnown: func() bool { _, ok := b.origin.ClockOffset(); return ok }}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	wake := make(chan struct{}, 1)
	go b.origin.WatchOverrides(ctx, func(bool) {
		select {
		case wake <- struct{}{}:
		default:
		}
	})
	// The first load waits until the config runs alone: one started beside
	// the running config may yet fail to start, and its join would have
	// replaced the book with its region's overrides for good, the node's
	// own dropped (TestOverrides_AReloadThatFailsToStartKeepsTheNodesOverrides).
	for {
		alone, changed := st.apps.runsAlone(b.a)
		if alone {
			break
		}
		select {
		case <-stop:
			if b.ownsLoad {
				overrides.abortLoad()
			}
			return
		case <-changed:
		}
	}
	err := w.start(time.Now())
	overrides.endLoad()
	if err != nil {
		w.log.Warn("loading the region's runtime overrides: retried each fast tick, or each slow tick while the subscription to change notices is live", zap.Error(err))
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
		w.look(time.Now())
	}
}

// Writing back. A Redis restarted empty (or flushed, or failed over to a
// replica that had not got them, or whose hash of overrides was evicted)
// has lost the region's overrides, removals and resets, while the nodes
// that ran before hold them in their books: a node started then would
// load none and apply the Caddyfile's limits where the others apply the
// overrides. A node sees the loss by the region's mark, a random word
// the first node to find none sets in the hash, which goes with it (also
// by the change counter going back, and by the origin's restart watch).
// Each node that sees it writes back every record it holds that has not
// lapsed, with its version (origin.RestoreOverrides):
// a field takes only a newer version, so the writes of several nodes at
// once, in any order, leave the newest of each, and a removal keeps out
// the override it removed even when a node that missed it writes that
// back. Its change moves the counter, and the nodes, new ones included,
// load the region again.
//
// What version order cannot fix is a newer version no node holds any
// more: a removal lapses a day after it was made (tombstoneLife). A node
// that could not read the region for that long may hold an override
// removed meanwhile, and writes nothing back.

// writeBackMargin: an override that lapses within it is not written
// back. It would lapse everywhere by then, and a node whose clock runs
// ahead that dropped it from the region would only see it written back
// again. A reset is written back until it lapses: it lives two of its
// zone's windows, at least a minute, so one of a window of 30 s or less
// was never written back, nor any in its last minute, and the role's
// next holder, reading MySQL whole, found a global reset the region did
// not hold and marked its cells again, taking off the units counted
// since the reset in its window
// (TestReset_RedisRestartedEmptyInAGlobalResetsLastMinuteKeepsItsRecord).
// Lapse is judged on the region's clock (regionWatch.nowMs), as a load
// judges it: the margin covers what a node's offset to the region's clock is
// wrong by (a heartbeat's round trip, its deadband), not a node's clock
// that runs a minute ahead.
const writeBackMargin = time.Minute

// regionWatch is what a node knows of the region's overrides between two
// looks at them.
type regionWatch struct {
	o           *origin.Redis
	log         *zap.Logger
	readTimeout time.Duration
	// global tells whether the region's changes go on to MySQL: the
	// records written back are queued for the role's holder again, as
	// the queue was lost with them (MySQL keeps the newer version too).
	global func() bool

	seen   int64     // the change counter the book is as of; -1 before a load
	mark   string    // the region's mark seen, "" before the first
	synced time.Time // when the book last had every change of the region; zero before a load
	// heard, if set, is told synced (Unix ns), for the origin's breakers.
	heard *atomic.Int64
	// restarts are the origin's restarts answered (origin.Restarts).
	restarts uint64
	failing  bool // the last write-back failed (logged once in a row)
	// regionNow is the region's clock (the engine's, Redis's with Redis);
	// nil for time.Now.
	regionNow func() time.Time
	// clockKnown tells whether regionNow is Redis's clock yet: false until
	// a heartbeat measured it (engine.Now is this node's own clock until
	// then). nil for known.
	clockKnown func() bool
}

// unmeasuredLapseMargin is how long past its expiry a record must be, on
// a node's own clock, for a load to drop it (from the book and from the
// region) before a heartbeat measured Redis's clock. A node starts by
// loading the region's overrides, at the time of its first heartbeat: a
// node 30 s ahead of its Redis whose load came first dropped an
// override with 25 s to run from the region, for every node
// (TestOverrides_AnOverrideHeardBeforeTheFirstHeartbeatAppliesOnceTheClockIsKnown).
// What is kept a while longer lapses all the same: each node judges a
// record's expiry itself, and a later load, once the clock is known,
// drops it. An hour: far past the offsets the heartbeats correct (the
// README's 1–30 s), and a lapsed record costs only its bytes meanwhile.
const unmeasuredLapseMargin = time.Hour

// lapseClockMs is the clock the records' lapse is judged on (Unix ms):
// the region's, which resets are stamped with (resetKey). On this node's
// own clock, a node 30 s ahead of its Redis took a reset of a 10 s window
// (it lives 20 s) for lapsed as it read it, and dropped it from the
// region before the other nodes heard of it
// (TestOverrides_ALoadJudgesLapseOnTheRegionsClock). Until a heartbeat
// measured Redis's clock it is an hour behind this node's own
// (unmeasuredLapseMargin).
func (w *regionWatch) lapseClockMs() int64 {
	if w.clockKnown != nil && !w.clockKnown() {
		return w.nowMs() - unmeasuredLapseMargin.Milliseconds()
	}
	return w.nowMs()
}

// nowMs is regionNow in Unix ms.
func (w *regionWatch) nowMs() int64 {
	if w.regionNow != nil {
		return w.regionNow().UnixMilli()
	}
	return time.Now().UnixMilli()
}

// start is the first load of a watch; its first look, a fast tick or a
// notice later, reads the region's mark.
func (w *regionWatch) start(now time.Time) error {
	w.seen, w.restarts = -1, w.o.Restarts()
	if from := overrides.source(); from != "" && from != w.o.Placement() {
		return w.join(now, from)
	}
	return w.load(now)
}

// join is the first load of a node that comes to the region from
// elsewhere: a config without Redis, where it kept its own overrides, or
// another region's Redis. The region's overrides replace the book: what
// the node held beside them (changed while it counted alone, or the
// other region's) would apply on this node only, and never reach the
// region's other nodes.
func (w *regionWatch) join(now time.Time, from string) error {
	dropped := 0
	err := w.loadInto(now, func(recs []overrideRec) { dropped = overrides.replace(recs, w.o.Placement()) })
	if dropped > 0 {
		w.log.Warn("joined the region's runtime overrides: dropped those this node held that the region does not",
			zap.String("from", from), zap.Int("dropped", dropped))
	}
	return err
}

// look reads the region's change counter and mark. When the region lost
// what the book holds (its mark changed or went, the counter went back,
// or the watch saw Redis restart), it writes the book back and marks the
// region; it loads the overrides when the counter moved. A write-back
// that failed is tried again at the next look.
func (w *regionWatch) look(now time.Time) {
	restarts := w.o.Restarts()
	ctx, cancel := context.WithTimeout(context.Background(), w.readTimeout)
	defer cancel()
	v, mark, err := w.o.OverridesState(ctx)
	if err != nil {
		return
	}
	why := w.loss(v, mark, restarts)
	if why != "" && w.writeBack(now, why) != nil {
		return
	}
	w.restarts = restarts
	if mark == "" {
		if mark, err = w.o.MarkOverrides(ctx); err != nil {
			return // a loss seen again at the next look is written back again, to no effect
		}
	}
	w.mark = mark
	if why == "" && v == w.seen {
		w.sync(now)
		return
	}
	_ = w.load(now)
}

// loss says how the region lost its overrides, or "" when it did not.
func (w *regionWatch) loss(v int64, mark string, restarts uint64) string {
	switch {
	case w.mark != "" && mark != w.mark:
		return "the region's mark is not the one seen"
	case v < w.seen:
		return "the change counter went back"
	case restarts != w.restarts:
		return "Redis restarted"
	}
	return ""
}

// load reads the region's overrides into the book, and forgets what
// lapsed there whether or not the region answered.
func (w *regionWatch) load(now time.Time) error {
	return w.loadInto(now, func(recs []overrideRec) { overrides.merge(recs) })
}

// loadInto is load with the region's overrides handed to take.
func (w *regionWatch) loadInto(now time.Time, take func([]overrideRec)) error {
	ctx, cancel := context.WithTimeout(context.Background(), max(w.readTimeout, loadTimeout/2))
	defer cancel()
	v, err := loadRegionOverrides(ctx, w.o, w.lapseClockMs, take)
	overrides.prune(w.lapseClockMs())
	if err != nil {
		return err
	}
	overrides.setSource(w.o.Placement())
	w.seen = v
	w.sync(now)
	loadedVersion.Store(v)
	return nil
}

// sync records that the book had every change of the region at now.
func (w *regionWatch) sync(now time.Time) {
	w.synced = now
	if w.heard != nil {
		w.heard.Store(now.UnixNano())
	}
}

// loadedVersion is the change counter the process's last load of a
// region's overrides read: tests await a watch's load of the changes they
// made before they plant one it must not have heard of.
var loadedVersion atomic.Int64

// writeBack writes the book's records that have not lapsed back to the
// region, unless the book is too old to (above).
func (w *regionWatch) writeBack(now time.Time, why string) error {
	switch {
	case w.synced.IsZero():
		return nil // it never read the region: nothing of it to write back
	case now.Sub(w.synced) >= tombstoneLife:
		w.log.Warn("the region's Redis lost its runtime overrides, and this node last read them too long ago to write its own back: it could bring back removed ones",
			zap.String("why", why), zap.Time("last_read", w.synced))
		return nil
	}
	nowMs := w.nowMs()
	recs := overrides.unexpired(nowMs)
	global := w.global()
	var queued, kept []origin.Override
	for _, r := range recs {
		if !r.Reset && r.ExpiresMs != 0 && r.ExpiresMs <= nowMs+writeBackMargin.Milliseconds() {
			continue
		}
		if global && (!r.Reset || r.Global) {
			queued = append(queued, r.regionValue())
		} else {
			kept = append(kept, r.regionValue())
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), loadTimeout)
	defer cancel()
	took, err := w.o.RestoreOverrides(ctx, kept, false)
	if err == nil {
		var n int
		n, err = w.o.RestoreOverrides(ctx, queued, true)
		took += n
	}
	if err != nil {
		if !w.failing {
			w.log.Warn("writing back the region's runtime overrides: tried again at each look until it succeeds", zap.String("why", why), zap.Error(err))
		}
		w.failing = true
		return err
	}
	w.failing = false
	fields := []zap.Field{zap.String("why", why), zap.Int("held", len(recs)), zap.Int("written", took)}
	if took == 0 { // the region had them (a failover), or another node wrote them first
		w.log.Debug("the region's Redis lost its runtime overrides: wrote back those this node holds", fields...)
		return nil
	}
	w.log.Warn("the region's Redis lost its runtime overrides: wrote back those this node holds", fields...)
	return nil
}

// unexpired returns the book's records, removals and resets included,
// that lapse after the time given (Unix ms) or never.
func (b *overrideBook) unexpired(after int64) []overrideRec {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]overrideRec, 0, len(b.recs))
	for _, r := range b.recs {
		if r.ExpiresMs == 0 || r.ExpiresMs > after {
			out = append(out, r)
		}
	}
	return out
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
		overrides.prune(overrides.clock.nowMs())
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
