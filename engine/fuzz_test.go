package engine

import (
	"math"
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
				clk.Advance(time.Duration(int64(arg)*17) * time.Millisecond)
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

// FuzzHostileCostsAndLimits decides one key with costs and limits drawn
// from the whole int64 range (negative, huge, changing between requests as
// reloads change limits), dry runs among them, and checks after each step:
//   - the count never decreases, never leaves [0, MaxCount];
//   - an admitted (not dry-run) request charged exactly its clamped cost and
//     left the count within its clamped limit;
//   - a denied request charged nothing.
//
// Run it with: go test -run '^$' -fuzz FuzzHostileCostsAndLimits ./engine
func FuzzHostileCostsAndLimits(f *testing.F) {
	f.Add(int64(10), int64(1), int64(5), int64(math.MaxInt64), false)
	f.Add(int64(math.MaxInt64), int64(math.MaxInt64), int64(-1), int64(math.MinInt64), true)
	f.Add(int64(MaxCount), int64(MaxCount), int64(MaxCount), int64(1), true)
	f.Fuzz(func(t *testing.T, limit1, cost1, limit2, cost2 int64, dry bool) {
		e, _ := newTestEngine(t, manual(Config{}))
		k := Key{"z", "k", time.Minute}
		count := func() int64 {
			ks, ok := e.Inspect(k)
			if !ok || len(ks.Cells) == 0 {
				return 0
			}
			return ks.Cells[0].Regional
		}
		steps := []Limit{
			{Key: k, Limit: limit1, Cost: cost1, DryRun: dry},
			{Key: k, Limit: limit2, Cost: cost2},
			{Key: k, Limit: limit1, Cost: cost2, DryRun: !dry},
			{Key: k, Limit: limit2, Cost: cost1},
		}
		for i := 0; i < 3; i++ {
			for _, l := range steps {
				before := count()
				d := e.Decide(bg, l)
				after := count()
				if after < before || after < 0 || after > MaxCount {
					t.Fatalf("%+v: count %d → %d", l, before, after)
				}
				cost, limit := ClampCount(l.Cost), ClampCount(l.Limit)
				switch {
				case l.DryRun:
					if after != SatAdd(before, cost) {
						t.Fatalf("dry run %+v: count %d → %d, want +%d", l, before, after, cost)
					}
				case d.Allowed:
					if after != before+cost || after > limit {
						t.Fatalf("admitted %+v: count %d → %d over limit %d", l, before, after, limit)
					}
				default:
					if after != before {
						t.Fatalf("denied %+v charged: count %d → %d", l, before, after)
					}
				}
			}
		}
	})
}
