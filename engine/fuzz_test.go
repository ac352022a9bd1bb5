package engine

import (
	"testing"
	"time"
)

// FuzzDecisionSequence runs sequences of decisions, batches and clock
// moves drawn from the input and checks the engine's invariants after each
// step:
//   - a fixed-window cell never admits more than the limit locally;
//   - a rolled-back batch leaves no trace (no speculative units, counts
//     equal to what committed decisions charged);
//   - committed counts never decrease within a cell.
//
// Run it with: go test -run '^$' -fuzz FuzzDecisionSequence ./engine
func FuzzDecisionSequence(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 200, 3, 3, 3, 3})
	f.Add([]byte{255, 254, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 128, 0, 7})
	f.Fuzz(func(t *testing.T, ops []byte) {
		e, clk := newTestEngine(t, manual(Config{}))
		const limit = 6
		keys := []Key{{"a", "x", time.Second}, {"a", "y", time.Second}, {"b", "x", 3 * time.Second}}
		charged := map[refCell]int64{} // what committed decisions charged
		seen := map[refCell]int64{}    // committed count last observed
		for i := 0; i+1 < len(ops); i += 2 {
			op, arg := ops[i], ops[i+1]
			now := clk.UnixMilli()
			switch op % 4 {
			case 0:
				clk.AddMs(int64(arg) * 17)
				continue
			case 1:
				k := keys[int(arg)%len(keys)]
				cost := int64(arg>>4) % 4
				if e.Decide(bg, Limit{Key: k, Limit: limit, Cost: cost}).Allowed {
					w := k.Window.Milliseconds()
					charged[refCell{k.Namespace, k.Identifier, w, now / w}] += cost
				}
			default:
				ls := []Limit{
					{Key: keys[int(arg)%3], Limit: limit, Cost: int64(arg>>2) % 4},
					{Key: keys[(int(arg)+1)%3], Limit: limit, Cost: int64(arg>>4) % 4},
				}
				if e.DecideMany(bg, ls, make([]Decision, 2)) {
					for _, l := range ls {
						w := l.Window.Milliseconds()
						charged[refCell{l.Namespace, l.Identifier, w, now / w}] += l.Cost
					}
				}
			}
			for _, k := range keys {
				ks, ok := e.Inspect(k)
				if !ok {
					continue
				}
				w := k.Window.Milliseconds()
				for _, c := range ks.Cells {
					id := refCell{k.Namespace, k.Identifier, w, c.Sequence}
					if c.Speculative != 0 {
						t.Fatalf("cell %+v holds %d speculative units between decisions", id, c.Speculative)
					}
					if c.Regional > limit {
						t.Fatalf("cell %+v admitted %d over the limit %d", id, c.Regional, limit)
					}
					if c.Regional != charged[id] {
						t.Fatalf("cell %+v counts %d, committed decisions charged %d", id, c.Regional, charged[id])
					}
					if c.Regional < seen[id] {
						t.Fatalf("cell %+v committed count fell from %d to %d", id, seen[id], c.Regional)
					}
					seen[id] = c.Regional
				}
			}
		}
	})
}
