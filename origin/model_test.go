package origin

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// TestOrigin_TheSimulatorsModelAnswersAsRedis: the simulator's model of a
// region's Redis (internal/simmodel), on which every decision of a
// simulated node rests, answers the origin's calls as Redis runs the
// origin's scripts: a seeded list of reads, writes (with and without the
// previous cell), reservations of single costs and groups (against
// imported counts sent and held, and a previous cell weighed part of the
// way into the window) and imports from other regions, from two processes
// and two incarnations, gets the same verdicts and the same totals from
// both, call by call.
func TestOrigin_TheSimulatorsModelAnswersAsRedis(t *testing.T) {
	srv := redistest.Start(t)
	real := map[string]*Redis{}
	// The model's clock stands still: nothing here expires. (At 0 a role
	// call, whose arrival 0 means none, would not run.)
	start := time.Now().UnixMilli()
	m := simmodel.NewRedis(func() int64 { return start }, 1, simmodel.Link{}, simmodel.DefaultTimeouts)
	model := map[string]engine.Origin{}
	for _, n := range []string{"a", "b"} {
		real[n] = newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: n})
		model[n] = m.Origin(n)
	}
	seq := nowSeq()
	// Every 150 calls go to three new keys, before their counts pass
	// every limit the list draws.
	keys := func(i int) []engine.Key {
		e := i / 150
		return []engine.Key{key(fmt.Sprintf("model:%d:1", e)), key(fmt.Sprintf("model:%d:2", e)), key(fmt.Sprintf("model:%d:3", e))}
	}
	// own is each record's total so far, as the engine keeps it: a write
	// carries it, a reservation adds what it charged.
	type rec struct {
		node string
		inc  uint32
		key  string
		seq  int64
	}
	own := map[rec]int64{}
	rng := rand.New(rand.NewPCG(7, 11))
	w := keys(0)[0].Window.Milliseconds()
	// Times into the window where the previous cell's weight is a whole
	// fraction of it, so that a decision falls exactly on its bound now
	// and then, and times past the window, where it weighs nothing.
	elapsed := []int64{0, 1, w / 4, w / 3, w / 2, 2 * w / 3, 3 * w / 4, w - 1, w, w + 1, 7919, 31337}
	var verdicts [2]int
	for i := range 3000 {
		k := keys(i)[rng.IntN(3)]
		r := rec{[]string{"a", "b"}[rng.IntN(2)], uint32(1 + rng.IntN(2)), k.Identifier, seq - int64(rng.IntN(2))}
		var step string
		var got [2]string
		switch op := rng.IntN(10); {
		case op < 2:
			step = fmt.Sprintf("read %+v", r)
			for j, o := range []engine.Origin{real[r.node], model[r.node]} {
				tot, err := o.Read(ctxT(t), k, r.seq, r.inc)
				got[j] = fmt.Sprintf("%+v %v", tot, err)
			}
		case op < 5:
			add := int64(rng.IntN(6))
			if rng.IntN(8) == 0 {
				add = -1 // a late or repeated write that carries less: a no-op
			}
			o := max(own[r]+add, 0)
			own[r] = max(own[r], o)
			noPrev := rng.IntN(2) == 0
			step = fmt.Sprintf("write %+v own %d noPrev %v", r, o, noPrev)
			for j, or := range []engine.Origin{real[r.node], model[r.node]} {
				b := []engine.Delta{{Key: k, Sequence: r.seq, Incarnation: r.inc, Own: o, Delta: 1, NoPrev: noPrev}}
				err := or.Flush(ctxT(t), b)
				got[j] = fmt.Sprintf("%+v done %v %v", b[0].Totals, b[0].Done, err)
			}
		case op < 9:
			r.seq = seq
			res := engine.Reservation{Key: k, Sequence: r.seq, Incarnation: r.inc, Own: own[r],
				Cost: int64(1 + rng.IntN(4)), Limit: int64(5 + rng.IntN(40)), Elapsed: elapsed[rng.IntN(len(elapsed))],
				Global: int64(rng.IntN(12)), GlobalPrev: int64(rng.IntN(30))}
			for range rng.IntN(3) {
				res.Joined = append(res.Joined, int64(1+rng.IntN(3)))
			}
			step = fmt.Sprintf("reserve %+v cost %d joined %v limit %d elapsed %d global %d/%d",
				r, res.Cost, res.Joined, res.Limit, res.Elapsed, res.Global, res.GlobalPrev)
			var charged [2]int64
			for j, o := range []engine.Origin{real[r.node], model[r.node]} {
				x := res
				x.Joined = append([]int64(nil), res.Joined...)
				err := o.Reserve(ctxT(t), &x)
				got[j] = fmt.Sprintf("admitted %v %v %+v %v", x.Admitted, x.JoinedAdmitted, x.Totals, err)
				if j == 0 {
					verdicts[map[bool]int{false: 0, true: 1}[x.Admitted]]++
				}
				if x.Admitted {
					charged[j] += x.Cost
				}
				for n, ok := range x.JoinedAdmitted {
					if ok {
						charged[j] += x.Joined[n]
					}
				}
			}
			own[r] += charged[0]
		default:
			count := int64(rng.IntN(60))
			step = fmt.Sprintf("import %d into %s seq %d", count, r.key, r.seq)
			c := propagation.Cell{Namespace: k.Namespace, Identifier: k.Identifier, WindowMs: w, Sequence: r.seq}
			got[0] = fmt.Sprint(real[r.node].Import(ctxT(t), []RoleImport{{Key: k, Sequence: r.seq, Count: count}}))
			got[1] = fmt.Sprint(m.Region(r.node, nil).Import(context.Background(), []propagation.RegionImport{{Cell: c, Count: count}}))
		}
		if got[0] != got[1] {
			t.Fatalf("call %d, %s:\n  redis %s\n  model %s", i, step, got[0], got[1])
		}
	}
	// The list denies and admits often enough for the verdicts to say
	// something.
	if verdicts[0] < 100 || verdicts[1] < 100 {
		t.Fatalf("%d reservations denied and %d admitted: want at least 100 of each", verdicts[0], verdicts[1])
	}
}
