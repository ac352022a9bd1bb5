package engine

import (
	"sync/atomic"
	"time"
)

// counters are the engine's own monotonic counters.
type counters struct {
	reads, readErrors, readWaitTimeouts, sharedReads atomic.Int64
	syncReads, backgroundReads, unreadDecisions      atomic.Int64
	reservations, reservationsAdmitted               atomic.Int64
	reservationsDenied, reservationErrors            atomic.Int64
	reservationWaits                                 atomic.Int64
	flushes, flushErrors                             atomic.Int64
	replayDrops, evictions, firstDenials             atomic.Int64
	// evictionsDeferred counts evicted keys whose write the eviction's
	// budget did not start (see writeEvicted).
	evictionsDeferred  atomic.Int64
	resends, lostUnits atomic.Int64
	// slowOverruns counts slow ticks that came while the slow tier's
	// flush of an earlier tick still ran (see replayLoop).
	slowOverruns atomic.Int64
	// flushing is the cells taken out of the replay queues into a write
	// that has not returned yet (see take, flush and giveBack).
	flushing            atomic.Int64
	lastRead, lastFlush atomic.Int64 // Unix ms
}

// Stats is a snapshot of the engine for operators.
type Stats struct {
	// Entries is the number of live keys; StrictKeys the number of keys in
	// strict mode now (as StrictKeys lists them).
	Entries, StrictKeys int64
	// Evictions counts entries evicted by the cap; EvictionsDeferred
	// those of them whose write the eviction did not start within its
	// budget (a slow origin): their units went to the replay's queues.
	Evictions, EvictionsDeferred int64
	// FirstDenials counts cells that denied their first request.
	FirstDenials int64
	// PendingCells is the number of cells whose units the origin may not
	// have yet: queued for replay, or in a write that has not returned
	// (a cell whose write left the queue is still pending); ReplayDrops
	// counts cells a full queue could not take (their units stay pending).
	PendingCells, ReplayDrops int64
	// SlowOverruns counts slow ticks that came while the slow tier was
	// still flushing an earlier tick's cells, one batch at a time: its
	// replay falling behind its tick.
	SlowOverruns int64
	// Reads and ReadErrors count origin reads; ReadWaitTimeouts the
	// requests that stopped waiting for one at the read timeout;
	// SharedReads the requests that joined a read already in flight.
	Reads, ReadErrors, ReadWaitTimeouts, SharedReads int64
	// SyncReads counts decisions that waited for an origin read (cold,
	// stale at half the limit, or near the limit); BackgroundReads the
	// refreshes started without waiting.
	SyncReads, BackgroundReads int64
	// UnreadDecisions counts decisions made in a cold cell without reading
	// it first: a limit far above the request's cost (see unread).
	UnreadDecisions int64
	// Reservations counts the request-path round trips that decide
	// requests at the origin (shared cells near their limit or in strict
	// mode); each decides its leader and the requests that joined it.
	// ReservationsAdmitted and ReservationsDenied count the requests by
	// verdict, ReservationErrors the requests whose reservation failed or
	// timed out (decided again, locally), ReservationWaits the requests
	// that joined a reservation rather than send one.
	Reservations, ReservationsAdmitted, ReservationsDenied int64
	ReservationErrors, ReservationWaits                    int64
	// Flushes and FlushErrors count replay batches.
	Flushes, FlushErrors int64
	// Resends counts cells whose whole total was sent again because the
	// origin lost it (restarted empty); LostUnits the committed units given
	// up unsent when the origin went away (see DropUnsent).
	Resends, LostUnits int64
	// LastRead and LastFlush are the last successful origin read and flush;
	// zero if none.
	LastRead, LastFlush time.Time
}

// Stats returns a snapshot of the engine's counters.
func (e *Engine) Stats() Stats { return e.StatsIn(nil) }

// StatsIn is Stats with StrictKeys counted in the zones in accepts (see
// StrictCountIn).
func (e *Engine) StatsIn(in func(namespace string, window time.Duration) bool) Stats {
	s := &e.stats
	return Stats{
		Entries:           e.live.Load(),
		StrictKeys:        e.StrictCountIn(in),
		Evictions:         s.evictions.Load(),
		EvictionsDeferred: s.evictionsDeferred.Load(),
		FirstDenials:      s.firstDenials.Load(),
		PendingCells:      int64(e.queue(Slow).len()+e.queue(Fast).len()) + s.flushing.Load(),
		ReplayDrops:       s.replayDrops.Load(),
		SlowOverruns:      s.slowOverruns.Load(),
		Reads:             s.reads.Load(),
		ReadErrors:        s.readErrors.Load(),
		ReadWaitTimeouts:  s.readWaitTimeouts.Load(),
		SharedReads:       s.sharedReads.Load(),
		SyncReads:         s.syncReads.Load(),
		BackgroundReads:   s.backgroundReads.Load(),
		UnreadDecisions:   s.unreadDecisions.Load(),

		Reservations:         s.reservations.Load(),
		ReservationsAdmitted: s.reservationsAdmitted.Load(),
		ReservationsDenied:   s.reservationsDenied.Load(),
		ReservationErrors:    s.reservationErrors.Load(),
		ReservationWaits:     s.reservationWaits.Load(),

		Flushes:     s.flushes.Load(),
		FlushErrors: s.flushErrors.Load(),
		Resends:     s.resends.Load(),
		LostUnits:   s.lostUnits.Load(),
		LastRead:    msTime(s.lastRead.Load()),
		LastFlush:   msTime(s.lastFlush.Load()),
	}
}

// StrictCountIn is how many keys are in strict mode now in the zones in
// accepts by namespace and window (every zone when in is nil), as
// StrictKeys lists them: a caller that knows which zones a loaded config
// defines counts the keys of those alone, as it lists them. A deadline
// that passed is left out, though the key lingers in its zone's map until
// the next sweep (the count once included it, and the strict_keys gauge
// stood above /ratelimit/strict until the janitor's next pass, up to 10
// s). It walks the keys in strict mode, few beside the entries, once a
// scrape or status call.
func (e *Engine) StrictCountIn(in func(namespace string, window time.Duration) bool) int64 {
	now := e.nowMs()
	var n int64
	if !e.strictOn() {
		return 0
	}
	e.rangeZones(func(z *Zone) bool {
		if in != nil && !in(z.name, z.window) {
			return true
		}
		z.strict.Range(func(_ string, d *atomic.Int64) bool {
			if u := d.Load(); u > now && !strictStale(z, u, now) {
				n++
			}
			return true
		})
		return true
	})
	return n
}

func msTime(ms int64) time.Time {
	if ms == 0 {
		return time.Time{}
	}
	return time.UnixMilli(ms)
}
