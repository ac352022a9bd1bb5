package engine

import (
	"context"
	"sync/atomic"
	"time"
)

// Forget drops key's entry and strict deadline on this process. With an
// origin the next request reads the key again from it. It reports whether
// there was anything to forget.
func (e *Engine) Forget(key Key) bool {
	z, id, ok := e.findKey(key)
	if !ok {
		return false
	}
	return e.forget(z, id)
}

// ForgetMatching forgets, as Forget does, every key of the zone namespace
// with window whose identifier (as the engine holds it: normalized, see
// NormalizeIdentifier) match accepts, and returns how many. For a key
// named as it left the process (an HMAC, a hashed long identifier), as a
// region's reset names it; it scans the zone.
func (e *Engine) ForgetMatching(namespace string, window time.Duration, match func(id string) bool) int {
	z, ok := e.lookupZone(Key{Namespace: namespace, Window: window})
	if !ok {
		return 0
	}
	var ids []string
	z.entries.Range(func(id string, _ *entry) bool {
		if match(id) {
			ids = append(ids, id)
		}
		return true
	})
	z.strict.Range(func(id string, _ *atomic.Int64) bool {
		if match(id) {
			ids = append(ids, id)
		}
		return true
	})
	n := 0
	for _, id := range ids {
		if e.forget(z, id) {
			n++
		}
	}
	return n
}

// forget drops the entry and strict deadline of the normalized id.
func (e *Engine) forget(z *Zone, id string) bool {
	found := false
	if o := e.getOrigin(); o != nil {
		// The units this process has not replayed yet go out first: the
		// key's next request here reads the origin, which must hold them,
		// or it would admit them again. A write of the key's already on
		// its way is waited for, for the same reason (its units would
		// otherwise reach the origin after that read). A failed write
		// leaves them queued.
		if en, ok := z.entries.Load(id); ok {
			batch := make([]Delta, 0, 2)
			for _, c := range [2]*cell{en.cur.Load(), en.prev.Load()} {
				if c != nil && c != tombstone && e.awaitFlush(c) {
					batch = e.take(batch, z, en, c, true)
				}
			}
			_ = e.flush(context.Background(), o, batch)
		}
	}
	if en, ok := z.entries.LoadAndDelete(id); ok {
		found = true
		if e.origin.Load() != nil {
			e.requeue(z, en) // pending units still reach the origin
			e.bury(z, en)
		}
		if c := en.cur.Swap(tombstone); c != tombstone {
			e.live.Add(-1)
		}
	}
	if _, ok := z.strict.LoadAndDelete(id); ok {
		e.strictLive.Add(-1)
		found = true
	}
	return found
}
