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
	if s := unsafe.Sizeof(cell{}); s != 32 {
		t.Errorf("a plain cell is %d bytes, want 32", s)
	}
	if s := unsafe.Sizeof(linkedCell{}); s != 96 {
		t.Errorf("a linked cell is %d bytes, want 96 (a size class of its own)", s)
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
