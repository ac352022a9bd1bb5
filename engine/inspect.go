package engine

import (
	"cmp"
	"container/heap"
	"slices"
	"sort"
	"strings"
	"sync/atomic"
	"time"
)

// CellState is one cell of a key as an operator sees it.
type CellState struct {
	// Sequence is the cell's window number: floor(unix_ms / window_ms).
	Sequence int64
	// Regional is the committed count (local and merged from the origin),
	// Speculative the units reserved by batches in flight, Global the count
	// imported from other regions, Pending the committed units not yet
	// replayed.
	Regional, Speculative, Global, Pending int64
	// Blocked is set once the cell has denied a request.
	Blocked bool
}

// KeyState is a key as an operator sees it, at the time of the call.
type KeyState struct {
	Key Key
	// Effective is current + ⌊previous × (1 − progress)⌋: what a
	// request of cost 0 would be weighed against.
	Effective int64
	// StrictUntil and FreshUntil are the strict-mode and freshness deadlines;
	// zero when unset or passed.
	StrictUntil, FreshUntil time.Time
	// ViewedAt is when the origin's view of the key was last taken (a read
	// or a replay of its current cell, or of the previous one, sent then);
	// zero when it never was.
	ViewedAt time.Time
	// Cells holds the current cell first, then the previous one, if any.
	Cells []CellState
}

// Inspect returns the state of key now, or false if the engine holds no
// entry for it. Identifiers are normalized as in decisions.
func (e *Engine) Inspect(key Key) (KeyState, bool) {
	z, id, ok := e.findKey(key)
	if !ok {
		return KeyState{}, false
	}
	en, ok := z.entries.Load(id)
	if !ok {
		return KeyState{}, false
	}
	return e.inspect(z, id, en, e.nowMs())
}

func (e *Engine) inspect(z *Zone, id string, en *entry, now int64) (KeyState, bool) {
	c := en.cur.Load()
	if c == tombstone {
		return KeyState{}, false
	}
	w := z.w
	seq := now / w
	ks := KeyState{Key: z.key(id)}
	// Weigh the cells as a decision now would, without rotating anything.
	var cur, prev *cell
	switch {
	case c.seq() >= seq:
		cur, prev = c, en.previous(c)
	case c.seq() == seq-1:
		prev = c
	}
	r := now - seq*w
	if cur != nil && cur.seq() > seq {
		r = 0
	}
	var curN, prevN int64
	if cur != nil {
		curN = cur.total()
		ks.Cells = append(ks.Cells, cellState(cur))
		if f := cur.freshUntil(); cur.state()&stRead != 0 && f > now {
			ks.FreshUntil = time.UnixMilli(f)
		}
		if at, ok := e.viewedAt(cur, now); ok {
			ks.ViewedAt = at
		}
	}
	if prev != nil {
		prevN = prev.total()
		ks.Cells = append(ks.Cells, cellState(prev))
		// A cell just rotated to has no view of its own yet: the key's
		// last look at the origin is the previous cell's (a read answers
		// both).
		if at, ok := e.viewedAt(prev, now); ok && at.After(ks.ViewedAt) {
			ks.ViewedAt = at
		}
	}
	ks.Effective = curN + weighted(prevN, w, r)
	if s := strictUntil(z, id, now); s > now && e.strictOn() {
		ks.StrictUntil = time.UnixMilli(s)
	}
	return ks, true
}

// Overlay returns key's state with the region's totals t raised in: t is
// what the origin holds of the key's current cell and of the one before
// it (a peek, which registers nothing), so the result is the region's
// view as far as this process can tell, other regions' counts included,
// also for a key this process does not hold. ok is false when neither
// this process nor t knows of any count.
func (e *Engine) Overlay(key Key, t Totals) (ks KeyState, ok bool) {
	z, _, found := e.findKey(key)
	if !found {
		return KeyState{}, false
	}
	ks, ok = e.Inspect(key)
	ks.Key = z.key(NormalizeIdentifier(key.Identifier))
	now := e.nowMs()
	seq := now / z.w
	raised := [2]struct{ regional, global int64 }{{t.Cur, t.Global}, {t.Prev, t.GlobalPrev}}
	var totals [2]int64
	for i := range raised {
		want := seq - int64(i)
		j := slices.IndexFunc(ks.Cells, func(c CellState) bool { return c.Sequence == want })
		if j < 0 {
			if raised[i].regional == 0 && raised[i].global == 0 {
				continue
			}
			ks.Cells = append(ks.Cells, CellState{Sequence: want})
			j = len(ks.Cells) - 1
		}
		c := &ks.Cells[j]
		c.Regional = max(c.Regional, raised[i].regional)
		c.Global = max(c.Global, raised[i].global)
		totals[i] = SatAdd(SatAdd(c.Regional, c.Speculative), c.Global)
		ok = true
	}
	slices.SortFunc(ks.Cells, func(a, b CellState) int { return cmp.Compare(b.Sequence, a.Sequence) })
	ks.Effective = SatAdd(totals[0], weighted(totals[1], z.w, now-seq*z.w))
	return ks, ok
}

func cellState(c *cell) CellState {
	spec := c.spec.Load()
	return CellState{
		Sequence:    c.seq(),
		Regional:    c.count.Load() - spec,
		Speculative: spec,
		Global:      c.globalCount(),
		Pending:     c.pending(),
		Blocked:     c.state()&stBlocked != 0,
	}
}

// Scan returns up to max keys of the namespace whose identifier starts with
// prefix, sorted by identifier and window (all of them when max < 0); of
// the given windows only, when there are any. It keeps only the first max
// while it scans, so a listing of a few keys costs no sort of every key.
func (e *Engine) Scan(namespace, prefix string, max int, windows ...time.Duration) []KeyState {
	if max == 0 {
		return nil
	}
	now := e.nowMs()
	var top keyHeap
	e.rangeZones(func(z *Zone) bool {
		if z.name != namespace || (len(windows) > 0 && !slices.Contains(windows, z.window)) {
			return true
		}
		z.entries.Range(func(id string, en *entry) bool {
			if !strings.HasPrefix(id, prefix) {
				return true
			}
			if max > 0 && len(top) == max && !keyLess(id, z.window, top[0].Key) {
				return true // after every key kept so far
			}
			if ks, ok := e.inspect(z, id, en, now); ok {
				heap.Push(&top, ks)
				if max > 0 && len(top) > max {
					heap.Pop(&top)
				}
			}
			return true
		})
		return true
	})
	out := []KeyState(top)
	sort.Slice(out, func(i, j int) bool { return keyLess(out[i].Key.Identifier, out[i].Key.Window, out[j].Key) })
	return out
}

// keyLess orders keys of one namespace by identifier, then window.
func keyLess(id string, w time.Duration, k Key) bool {
	if id != k.Identifier {
		return id < k.Identifier
	}
	return w < k.Window
}

// keyHeap is a max-heap of keys by keyLess: its root is the last key kept.
type keyHeap []KeyState

func (h keyHeap) Len() int { return len(h) }
func (h keyHeap) Less(i, j int) bool {
	return keyLess(h[j].Key.Identifier, h[j].Key.Window, h[i].Key)
}
func (h keyHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *keyHeap) Push(x any)   { *h = append(*h, x.(KeyState)) }
func (h *keyHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// StrictKey is one key in strict mode.
type StrictKey struct {
	Key   Key
	Until time.Time
}

// StrictKeys returns the keys whose strict deadline has not passed, sorted
// by namespace, identifier and window; none without an origin (strictOn).
func (e *Engine) StrictKeys() []StrictKey {
	now := e.nowMs()
	var out []StrictKey
	if !e.strictOn() {
		return out
	}
	e.rangeZones(func(z *Zone) bool {
		z.strict.Range(func(id string, d *atomic.Int64) bool {
			if u := d.Load(); u > now && !strictStale(z, u, now) {
				out = append(out, StrictKey{Key: z.key(id), Until: time.UnixMilli(u)})
			}
			return true
		})
		return true
	})
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i].Key, out[j].Key
		if a.Namespace != b.Namespace {
			return a.Namespace < b.Namespace
		}
		if a.Identifier != b.Identifier {
			return a.Identifier < b.Identifier
		}
		return a.Window < b.Window
	})
	return out
}

// viewedAt is when c's view of the origin was taken: its freshness deadline
// less the freshness. None for a cell never read, nor for one whose view
// lies ahead of now (taken while the clock was ahead, which has since
// stepped back).
func (e *Engine) viewedAt(c *cell, now int64) (time.Time, bool) {
	f := c.freshUntil()
	if c.state()&stRead == 0 || f <= 0 || f-e.freshnessMs() > now {
		return time.Time{}, false
	}
	return time.UnixMilli(f - e.freshnessMs()), true
}
