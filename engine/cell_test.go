package engine

import (
	"reflect"
	"testing"
	"time"
	"unsafe"
)

// hasPointers reports whether a value of type t holds anything the garbage
// collector scans.
func hasPointers(t reflect.Type) bool {
	switch k := t.Kind(); {
	case k >= reflect.Bool && k <= reflect.Complex128:
		return false
	case k == reflect.Array:
		return t.Len() > 0 && hasPointers(t.Elem())
	case k == reflect.Struct:
		for i := range t.NumField() {
			if hasPointers(t.Field(i).Type) {
				return true
			}
		}
		return false
	}
	return true
}

func TestCell_SizesAndNoPointers(t *testing.T) {
	if s := unsafe.Sizeof(cell{}); s != 24 {
		t.Errorf("a plain cell is %d bytes, want 24", s)
	}
	// 104 until a cell remembered when it was made (cellLinks.made): 112
	// is the size class a linked cell of its own took at 104 already.
	if s := unsafe.Sizeof(linkedCell{}); s != 112 {
		t.Errorf("a linked cell is %d bytes, want 112", s)
	}
	if s := unsafe.Sizeof(entry{}); s != 16 {
		t.Errorf("an entry is %d bytes, want 16 (its name and first cell follow it)", s)
	}
	if s := entryBytes(7, false); s != 48 {
		t.Errorf("a local key of 7 bytes is %d bytes, want 48 (a size class of its own)", s)
	}
	for _, typ := range []reflect.Type{reflect.TypeFor[cell](), reflect.TypeFor[linkedCell]()} {
		if hasPointers(typ) {
			t.Errorf("%v holds a pointer: the garbage collector would scan every cell", typ)
		}
	}
}

func TestCell_PlainOnlyWhenTheEngineSyncsWithNothing(t *testing.T) {
	for _, tc := range []struct {
		name   string
		attach func(e *Engine)
		linked bool
	}{
		{"local-only", func(*Engine) {}, false},
		{"origin", func(e *Engine) { e.SetOrigin(newMemOrigin()) }, true},
		{"global layer", func(e *Engine) { e.SetGlobal(nopGlobal{}) }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, clk := newTestEngine(t, manual(Config{}))
			tc.attach(e)
			l := lim("k", time.Minute, 10, 1)
			e.Decide(bg, l) // the entry's first cell
			clk.Advance(time.Minute)
			e.Decide(bg, l) // a rotated cell
			en := entryOf(t, e, l.Key)
			for name, c := range map[string]*cell{"first": en.prev.Load(), "rotated": en.cur.Load()} {
				if c == nil {
					t.Fatalf("no %s cell", name)
				}
				if got := c.links() != nil; got != tc.linked {
					t.Errorf("%s cell: linked = %v, want %v", name, got, tc.linked)
				}
			}
		})
	}
}

// TestCell_StepIsMeasuredOverHalfATickAtLeast drives measure with answers
// at chosen times (tick 10 ms): the first answer's growth is the step;
// later ones count only half a tick or more after the mark, scaled to a
// tick below one, whole above.
func TestCell_StepIsMeasuredOverHalfATickAtLeast(t *testing.T) {
	const tick = 10
	var x cellLinks
	for _, tc := range []struct {
		name      string
		f, d, now int64
		step      int64
	}{
		{"first answer: what the others counted before", 5, 5, 1000, 5},
		{"2 ms later: too soon to measure", 8, 3, 1002, 5},
		{"half a tick: 3 units scaled to a tick", 8, 0, 1005, 6},
		{"two ticks: 12 units taken whole", 20, 12, 1025, 12},
		{"no growth: the step stands", 20, 0, 1040, 12},
	} {
		x.measure(tc.f, tc.d, tc.now, tick)
		if got := x.step.Load(); got != tc.step {
			t.Fatalf("%s: step %d, want %d", tc.name, got, tc.step)
		}
	}
}

// TestCell_MergesOnlyRaise: a merge raises the count to the origin's view
// plus what the origin has not seen, never lowers it, and a total that may
// hold units pending again (stUnsure) is not merged at all.
func TestCell_MergesOnlyRaise(t *testing.T) {
	c := newCell(1, true)
	x := c.links()
	c.count.Store(5)
	x.own.Store(3)
	x.pending.Store(2)
	c.mergeOrigin(10)
	if got := c.count.Load(); got != 12 {
		t.Fatalf("count %d after a total of 10, want 10 + 2 pending", got)
	}
	c.mergeOrigin(4)
	if got := c.count.Load(); got != 12 {
		t.Fatalf("count %d after a smaller total, want 12 kept", got)
	}
	// The others hold 15 − 3 (this incarnation's record): with own and
	// pending, 17.
	c.mergeAnswer(15, 3)
	if got := c.count.Load(); got != 17 {
		t.Fatalf("count %d after an answer of 15 (mine 3), want 12 others + 3 own + 2 pending", got)
	}
	c.setBits(stUnsure)
	c.mergeOrigin(100)
	if got := c.count.Load(); got != 17 {
		t.Fatalf("count %d: a total merged while pending units may be in it", got)
	}
}

// A cell's sequence and its state share a word: setting and clearing
// every state bit leaves the sequence as it was, at both ends of its range
// and for the tombstone's -1, and the sequence leaves the bits alone.
func TestCell_StateBitsLeaveTheSequence(t *testing.T) {
	const every = (stPrevSettled<<1 - 1) &^ stLinked // stLinked is set at allocation only
	for _, seq := range []int64{-1 << 51, -1, 0, 1, 1_790_000_000_000, 1<<51 - 1} {
		for _, linked := range []bool{false, true} {
			c := newCell(seq, linked)
			base := uint32(0)
			if linked {
				base = stLinked
			}
			if c.seq() != seq || c.state() != base {
				t.Fatalf("new cell %d (linked %v): seq %d state %#x", seq, linked, c.seq(), c.state())
			}
			if !c.setBits(every) || c.seq() != seq || c.state() != base|every {
				t.Fatalf("cell %d with every bit: seq %d state %#x, want %#x", seq, c.seq(), c.state(), base|every)
			}
			c.clearBits(every)
			if c.seq() != seq || c.state() != base {
				t.Fatalf("cell %d cleared: seq %d state %#x, want %#x", seq, c.seq(), c.state(), base)
			}
		}
	}
}
