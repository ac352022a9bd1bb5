package origin

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
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

// TestRole_TheSimulatorsModelAnswersAsRedis: the simulator's model of the
// cross-region role's keys answers as the origin's role does on Redis,
// step by step: who holds the lease as processes take, renew, release and
// let it lapse; which registrations a holder's take returns, queued or
// whole (a registration repeated unchanged, changed, or expired); which
// denial rows a take finds and which a write removes (not one a newer row
// of its cell replaced); and each cell's total.
func TestRole_TheSimulatorsModelAnswersAsRedis(t *testing.T) {
	srv := redistest.Start(t)
	ms := time.Now().UnixMilli()
	m := simmodel.NewRedis(func() int64 { return ms }, 1, simmodel.Link{}, simmodel.DefaultTimeouts)
	real := map[string]*Redis{}
	model := map[string]propagation.Region{}
	for _, n := range []string{"a", "b"} {
		real[n] = newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: n})
		model[n] = m.Region(n, nil)
	}
	const ttl = 300 * time.Millisecond
	seq := nowSeq()
	w := time.Minute.Milliseconds()
	now := time.Now().UnixMilli()
	cell := func(id string) propagation.Cell {
		return propagation.Cell{Namespace: "api", Identifier: id, WindowMs: w, Sequence: seq}
	}
	reg := func(id string, limit, expires int64, hot bool) propagation.RegionCell {
		return propagation.RegionCell{Cell: cell(id), Limit: limit, Expires: expires, Hot: hot}
	}
	den := func(id string, cur int64) propagation.BlocklistRow {
		c := cell(id)
		return propagation.BlocklistRow{Namespace: c.Namespace, Identifier: c.Identifier, WindowMs: c.WindowMs, Sequence: c.Sequence,
			Region: "r1", Limit: 10, CountCur: cur, ExpiresMs: (seq + 2) * w}
	}
	roleDenials := func(rows []propagation.BlocklistRow) []RoleDenial {
		out := make([]RoleDenial, len(rows))
		for i, r := range rows {
			b, err := json.Marshal(r)
			if err != nil {
				t.Fatal(err)
			}
			out[i] = RoleDenial{Key: key(r.Identifier), Sequence: r.Sequence, Row: string(b)}
		}
		return out
	}
	regText := func(cells []propagation.RegionCell) string {
		s := make([]string, len(cells))
		for i, c := range cells {
			s[i] = fmt.Sprintf("%s:%d/%d/%v", c.Identifier, c.Limit, c.Expires-now, c.Hot)
		}
		slices.Sort(s)
		return strings.Join(s, " ")
	}
	// Each step runs on Redis and on the model and says what it saw.
	type step struct {
		what  string
		real  func() string
		model func() string
	}
	lease := func(n string) step {
		return step{n + " leases",
			func() string { h, err := real[n].Lease(ctxT(t), ttl); return fmt.Sprint(h, err) },
			func() string { h, err := model[n].Lease(context.Background(), ttl); return fmt.Sprint(h, err) }}
	}
	release := func(n string) step {
		return step{n + " releases",
			func() string { return fmt.Sprint(real[n].ReleaseLease(ctxT(t))) },
			func() string { return fmt.Sprint(model[n].ReleaseLease(context.Background())) }}
	}
	lapse := step{"the lease lapses",
		func() string {
			deadline := time.Now().Add(5 * time.Second)
			for {
				h, err := real["a"].LeaseHolder(ctxT(t))
				if err != nil || h == "" || time.Now().After(deadline) {
					return fmt.Sprint(h, err)
				}
			}
		},
		func() string { ms += ttl.Milliseconds(); return fmt.Sprint("", nil) }}
	register := func(cells ...propagation.RegionCell) step {
		return step{"register " + regText(cells),
			func() string {
				in := make([]RoleCell, len(cells))
				for i, c := range cells {
					in[i] = RoleCell{Key: key(c.Identifier), Sequence: c.Sequence, Limit: c.Limit, Expires: c.Expires, Hot: c.Hot}
				}
				return fmt.Sprint(real["a"].Register(ctxT(t), in))
			},
			func() string { return fmt.Sprint(model["a"].Register(context.Background(), cells)) }}
	}
	take := func(all bool) step {
		return step{fmt.Sprintf("take (all %v)", all),
			func() string {
				cs, err := real["b"].TakeRegistered(ctxT(t), all, now)
				out := make([]propagation.RegionCell, len(cs))
				for i, c := range cs {
					out[i] = reg(c.Key.Identifier, c.Limit, c.Expires, c.Hot)
				}
				return fmt.Sprint(regText(out), err)
			},
			func() string {
				cs, err := model["b"].TakeRegistered(context.Background(), all, now)
				return fmt.Sprint(regText(cs), err)
			}}
	}
	denText := func(ds []RoleDenial, err error) string {
		s := make([]string, len(ds))
		for i, d := range ds {
			s[i] = d.Row
		}
		slices.Sort(s)
		return fmt.Sprint(strings.Join(s, " "), err)
	}
	putDenials := func(rows ...propagation.BlocklistRow) step {
		return step{fmt.Sprintf("put denials %v", rows),
			func() string { return fmt.Sprint(real["a"].PutDenials(ctxT(t), roleDenials(rows))) },
			func() string { return fmt.Sprint(model["a"].PutDenials(context.Background(), rows)) }}
	}
	takeDenials := step{"take denials",
		func() string { return denText(real["b"].TakeDenials(ctxT(t))) },
		func() string {
			rows, err := model["b"].TakeDenials(context.Background())
			return denText(roleDenials(rows), err)
		}}
	written := func(rows ...propagation.BlocklistRow) step {
		return step{fmt.Sprintf("denials written %v", rows),
			func() string { return fmt.Sprint(real["b"].DenialsWritten(ctxT(t), roleDenials(rows))) },
			func() string { return fmt.Sprint(model["b"].DenialsWritten(context.Background(), rows)) }}
	}
	totals := step{"totals of x and y",
		func() string {
			if err := real["a"].Flush(ctxT(t), []engine.Delta{{Key: key("x"), Sequence: seq, Incarnation: 1, Own: 4, Delta: 4}}); err != nil {
				return err.Error()
			}
			ts, err := real["b"].CellTotals(ctxT(t), []RoleCell{{Key: key("x"), Sequence: seq}, {Key: key("y"), Sequence: seq}})
			s := ""
			for _, c := range ts {
				s += fmt.Sprintf("%d ", c.Count)
			}
			return fmt.Sprint(s, err)
		},
		func() string {
			if err := m.Origin("a").Flush(context.Background(), []engine.Delta{{Key: key("x"), Sequence: seq, Incarnation: 1, Own: 4, Delta: 4}}); err != nil {
				return err.Error()
			}
			ts, err := model["b"].Totals(context.Background(), []propagation.Cell{cell("x"), cell("y")})
			s := ""
			for _, c := range ts {
				s += fmt.Sprintf("%d ", c.Count)
			}
			return fmt.Sprint(s, err)
		}}
	steps := []step{
		lease("a"), lease("b"), lease("a"), release("b"), lease("b"), release("a"), lease("b"), lease("a"),
		lapse, lease("a"), lease("b"),
		register(reg("x", 10, now+w, false), reg("y", 20, now+w, true)), take(false), take(false),
		register(reg("x", 10, now+w, false)), take(false),
		register(reg("x", 10, now+w, true)), take(false),
		register(reg("x", 12, now+2*w, true), reg("z", 5, now-1, false)), take(false), take(true), take(false),
		putDenials(den("x", 5), den("y", 7)), takeDenials, written(den("x", 5)), takeDenials,
		putDenials(den("y", 9)), written(den("y", 7)), takeDenials, written(den("y", 9)), takeDenials,
		totals,
	}
	for i, s := range steps {
		r, mo := s.real(), s.model()
		if r != mo {
			t.Errorf("step %d, %s:\n  redis %s\n  model %s", i, s.what, r, mo)
		}
	}
}
