package engine

import "sync/atomic"

// Strict mode: a denial records a deadline per (namespace, identifier,
// window), not per sequence: the end of the sliding window that ends at the
// denial, one window length later. So it survives the rollover into the
// next fixed window, where the denied cell still weighs as the previous
// one. Until the deadline, a decision that would allow first
// refreshes from the origin. Counts only grow, so a refresh can never turn a
// denial into an allow: denials themselves never wait.

// markStrict raises id's strict deadline to until (Unix ms), at now (the
// engine's clock). The first denial of a key allocates its deadline; later
// ones are an atomic max, but for a deadline left by a clock that stepped
// back (strictStale), which the new one replaces. New keys past MaxEntries
// strict deadlines are not recorded: strict mode is a refinement, and a
// flood of denied identifiers must not grow memory.
func (e *Engine) markStrict(z *Zone, id string, until, now int64) {
	d, ok := z.strict.Load(id)
	if !ok {
		if e.strictLive.Load() >= int64(e.cfg.MaxEntries) {
			return
		}
		var created bool
		d, _ = z.strict.LoadOrCompute(id, func() (*atomic.Int64, bool) {
			created = true
			return new(atomic.Int64), false
		})
		if created {
			e.strictLive.Add(1)
		}
	}
	for {
		old := d.Load()
		if (until <= old && !strictStale(z, old, now)) || d.CompareAndSwap(old, until) {
			return
		}
	}
}

// strictStale reports whether the deadline until lies further ahead of now
// than a denial can set it: a window past the end of a cell at most one
// window ahead of now (a cell further ahead is stale and replaced; see
// locate). Such a deadline was set while the clock ran ahead (an NTP step,
// a resumed VM, the moments before a heartbeat measured Redis's clock
// again), and holding it kept every request of the key that would pass
// going to the origin first for as long as the clock had been ahead (an
// hour's step: an hour of a round trip a request;
// TestStrict_ADeadlineFromAClockAheadLapsesWhenTheClockComesBack).
func strictStale(z *Zone, until, now int64) bool { return until > now+2*z.w }

// strictUntil returns id's strict deadline in Unix ms at now, or 0: none,
// or one a clock that stepped back left (strictStale).
func strictUntil(z *Zone, id string, now int64) int64 {
	if d, ok := z.strict.Load(id); ok {
		if u := d.Load(); !strictStale(z, u, now) {
			return u
		}
	}
	return 0
}

// strictOn reports whether strict mode applies: only with an origin,
// whose count a deadline makes a decision refresh from. A detached origin
// (a reload without Redis) leaves the deadlines its denials set, and they
// count again if one comes back before they pass: the denials were at
// the region's count, which Redis still holds. Meanwhile no key is in
// strict mode: until 2026-11-29 the status, the strict_keys gauge,
// /ratelimit/strict and a key's strict_until showed them without an
// origin, up to a window after the reload
// (TestCaddy_NoStrictKeysWithoutRedis in the root package).
func (e *Engine) strictOn() bool { return e.origin.Load() != nil }
