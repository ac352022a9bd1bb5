package engine

import (
	"math/big"
	"math/rand/v2"
	"testing"
	"time"
)

// refEngine is the sliding window written the straightforward way: a map
// of fixed-window counts and exact rational arithmetic. The engine must
// agree with it on every verdict, Remaining, Reset and Retry-After.
type refEngine struct {
	counts map[refCell]int64
}

type refCell struct {
	ns, id string
	w, seq int64
}

func (m *refEngine) state(l Limit, now int64) (cur, prev, w, r int64) {
	w = l.Window.Milliseconds()
	seq := now / w
	return m.counts[refCell{l.Namespace, l.Identifier, w, seq}],
		m.counts[refCell{l.Namespace, l.Identifier, w, seq - 1}], w, now % w
}

// effective is cur + ⌊prev × (w − r) / w⌋ + cost: the previous window's
// weight rounded down, as DESIGN states the rule.
func (m *refEngine) effective(cur, prev, cost, w, r int64) *big.Rat {
	weight := new(big.Int).Mul(big.NewInt(prev), big.NewInt(w-r))
	weight.Quo(weight, big.NewInt(w))
	eff := new(big.Rat).SetInt64(cur + cost)
	return eff.Add(eff, new(big.Rat).SetInt(weight))
}

func (m *refEngine) passes(cur, prev, cost, limit, w, r int64) bool {
	return m.effective(cur, prev, cost, w, r).Cmp(new(big.Rat).SetInt64(limit)) <= 0
}

// verdict decides l at now without charging it.
func (m *refEngine) verdict(l Limit, now int64) Decision {
	cur, prev, w, r := m.state(l, now)
	d := Decision{Limit: l.Limit, Reset: time.Duration(w-r) * time.Millisecond}
	d.Allowed = m.passes(cur, prev, l.Cost, l.Limit, w, r)
	if !d.Allowed {
		d.Remaining = m.remaining(cur, prev, l.Limit, w, r)
		d.RetryAfter = m.retryAfter(cur, prev, l.Cost, l.Limit, w, r)
	}
	return d
}

func (m *refEngine) remaining(cur, prev, limit, w, r int64) int64 {
	rest := new(big.Rat).Sub(new(big.Rat).SetInt64(limit), m.effective(cur, prev, 0, w, r))
	if rest.Sign() <= 0 {
		return 0
	}
	q := new(big.Int).Quo(rest.Num(), rest.Denom()) // floor for positive values
	return q.Int64()
}

// retryAfter binary-searches the first passing millisecond: with no new
// traffic the effective count never grows, so passing is monotone in time.
func (m *refEngine) retryAfter(cur, prev, cost, limit, w, r int64) time.Duration {
	if cost > limit {
		return Never
	}
	at := func(wait int64) bool {
		t := r + wait
		switch {
		case t >= 2*w:
			return m.passes(0, 0, cost, limit, w, t-2*w)
		case t >= w:
			return m.passes(0, cur, cost, limit, w, t-w)
		}
		return m.passes(cur, prev, cost, limit, w, t)
	}
	lo, hi := int64(1), 2*w
	for lo < hi {
		mid := (lo + hi) / 2
		if at(mid) {
			hi = mid
		} else {
			lo = mid + 1
		}
	}
	return time.Duration(lo) * time.Millisecond
}

func (m *refEngine) charge(l Limit, now int64) {
	w := l.Window.Milliseconds()
	m.counts[refCell{l.Namespace, l.Identifier, w, now / w}] += l.Cost
}

// decideMany is all-or-nothing: every limit passes and is charged, or none is.
func (m *refEngine) decideMany(ls []Limit, now int64) ([]Decision, bool) {
	out := make([]Decision, len(ls))
	all := true
	for i, l := range ls {
		out[i] = m.verdict(l, now)
		all = all && out[i].Allowed
	}
	for i, l := range ls {
		if all {
			m.charge(l, now)
		}
		if out[i].Allowed {
			cur, prev, w, r := m.state(l, now)
			out[i].Remaining = m.remaining(cur, prev, l.Limit, w, r)
		}
	}
	return out, all
}

func TestProperty_EngineAgreesWithReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	windows := []time.Duration{time.Second, 7 * time.Second, time.Minute}
	var passed, failed int
	for run := 0; run < 40; run++ {
		e, clk := newTestEngine(t, manual(Config{}))
		ref := &refEngine{counts: map[refCell]int64{}}
		clk.Set(time.UnixMilli(epoch + rng.Int64N(60_000)))
		randomLimit := func() Limit {
			return Limit{
				Key: Key{
					Namespace:  []string{"a", "b"}[rng.IntN(2)],
					Identifier: []string{"x", "y", "z"}[rng.IntN(3)],
					Window:     windows[rng.IntN(len(windows))],
				},
				Limit: []int64{0, 1, 3, 10, 25}[rng.IntN(5)],
				Cost:  rng.Int64N(5),
			}
		}
		for step := 0; step < 400; step++ {
			clk.Advance(time.Duration(rng.Int64N(1500)) * time.Millisecond)
			now := clk.UnixMilli()
			n := 1 + rng.IntN(3)
			ls := make([]Limit, 0, n)
			seen := map[Key]bool{}
			for len(ls) < n {
				l := randomLimit()
				if !seen[l.Key] { // one limit per key in a batch
					seen[l.Key] = true
					ls = append(ls, l)
				}
			}
			want, wantAll := ref.decideMany(ls, now)
			got := make([]Decision, len(ls))
			gotAll := e.DecideMany(bg, ls, got)
			if wantAll {
				passed++
			} else {
				failed++
			}
			if gotAll != wantAll {
				t.Fatalf("run %d step %d: batch %+v passed=%v, reference %v", run, step, ls, gotAll, wantAll)
			}
			for i := range ls {
				if got[i] != want[i] {
					t.Fatalf("run %d step %d: limit %+v at %d\n got  %+v\n want %+v", run, step, ls[i], now, got[i], want[i])
				}
			}
		}
	}
	if passed < 1000 || failed < 1000 {
		t.Fatalf("only %d passing and %d failing decisions compared", passed, failed)
	}
}
