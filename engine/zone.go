package engine

import (
	"slices"
	"sync/atomic"
	"time"

	"github.com/puzpuzpuz/xsync/v4"
)

// Zone is one (namespace, window) and the map of its keys, by identifier. A
// caller that decides the same zone often resolves it once with
// Engine.Zone and sets Limit.Zone, so a decision costs one lookup of a
// string key.
type Zone struct {
	name    string
	window  time.Duration
	w       int64     // window in milliseconds
	entries *entryMap // see entrymap.go
	strict  *xsync.Map[string, *atomic.Int64]
}

// Name returns the zone's namespace.
func (z *Zone) Name() string { return z.name }

// Window returns the zone's window, truncated to whole milliseconds.
func (z *Zone) Window() time.Duration { return z.window }

func (z *Zone) key(id string) Key { return Key{Namespace: z.name, Identifier: id, Window: z.window} }

type zoneKey struct {
	ns string
	w  int64
}

// Zone returns the zone of namespace and window, creating it on first use.
// The same arguments always return the same zone.
func (e *Engine) Zone(namespace string, window time.Duration) *Zone {
	w := int64(window / time.Millisecond)
	if w < 1 {
		w = 1
	}
	zk := zoneKey{namespace, w}
	if z, ok := e.zones.Load(zk); ok {
		return z
	}
	z, _ := e.zones.LoadOrCompute(zk, func() (*Zone, bool) {
		return &Zone{
			name:    namespace,
			window:  time.Duration(w) * time.Millisecond,
			w:       w,
			entries: newEntryMap(),
			strict:  xsync.NewMap[string, *atomic.Int64](),
		}, false
	})
	return z
}

// lookupZone returns the zone of key if it exists.
func (e *Engine) lookupZone(key Key) (*Zone, bool) {
	w := int64(key.Window / time.Millisecond)
	if w < 1 {
		w = 1
	}
	return e.zones.Load(zoneKey{key.Namespace, w})
}

// Windows returns the windows of the zones of namespace the engine holds,
// in increasing order: those of every config that counted the namespace
// since the engine began, loaded now or not.
func (e *Engine) Windows(namespace string) []time.Duration {
	var out []time.Duration
	e.rangeZones(func(z *Zone) bool {
		if z.name == namespace {
			out = append(out, z.window)
		}
		return true
	})
	slices.Sort(out)
	return out
}

// rangeZones calls f for every zone.
func (e *Engine) rangeZones(f func(z *Zone) bool) {
	e.zones.Range(func(_ zoneKey, z *Zone) bool { return f(z) })
}
