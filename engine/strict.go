package engine

import "sync/atomic"

// Strict mode: a denial records a deadline per (namespace, identifier,
// window), not per sequence: the end of the sliding window that ends at the
// denial, one window length later. So it survives the rollover into the
// next fixed window, where the denied cell still weighs as the previous
// one. Until the deadline, a decision that would allow first
// refreshes from the origin. Counts only grow, so a refresh can never turn a
// denial into an allow: denials themselves never wait.

// markStrict raises id's strict deadline to until (Unix ms). The first
// denial of a key allocates its deadline; later ones are an atomic max. New
// keys past MaxEntries strict deadlines are not recorded: strict mode is a
// refinement, and a flood of denied identifiers must not grow memory.
func (e *Engine) markStrict(z *Zone, id string, until int64) {
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
		if until <= old || d.CompareAndSwap(old, until) {
			return
		}
	}
}

// strictUntil returns id's strict deadline in Unix ms, or 0.
func strictUntil(z *Zone, id string) int64 {
	if d, ok := z.strict.Load(id); ok {
		return d.Load()
	}
	return 0
}
