package sim

import (
	"cmp"
	"math/bits"
	"slices"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// What a run measures: every decision against one exact central sliding
// window counter per key that counts every unit the fleet admitted, in
// the order the requests came (is the world's count, with this request,
// within the limit?), the units each hot key admitted per
// window, the time from a key's first denial anywhere until every other
// region's view holds the key at its limit, and whether every unit
// admitted reached its region's count and, for the cells the region
// published, MySQL.

// ref is the central counter of one key: its current and previous fixed
// windows.
type ref struct{ seq, cur, prev int64 }

// fits is the engine's verdict (engine/window.go): cur + ⌊prev × (w −
// r) / w⌋ + cost ≤ limit, with the products in 128 bits as the engine's,
// which a limit times a window past 2⁶³ would overflow in 64.
func fits(cur, prev, cost, limit, w, r int64) bool {
	room := limit - cur - cost
	if room < 0 {
		return false
	}
	if prev == 0 || r >= w {
		return true
	}
	h1, l1 := bits.Mul64(uint64(prev), uint64(w-r))
	h2, l2 := bits.Mul64(uint64(room)+1, uint64(w))
	return h1 < h2 || (h1 == h2 && l1 < l2)
}

type winKey struct {
	key int32
	seq int64
}

type regKey struct {
	key    int32
	seq    int64
	region int32
}

// armed is a key's window that denied somewhere, waiting for the other
// regions' views to hold what the world had admitted in the window then.
type armed struct {
	at      int64
	target  int64
	pending []bool
	left    int
}

type measure struct {
	ks       *keyspace
	limit, w int64
	regions  int
	refs     map[int32]*ref

	decisions, allowed, falseAllows, falseDenies int64
	admitted                                     map[winKey]int64
	regional                                     map[regKey]int64
	armed                                        map[winKey]*armed
	latencies                                    []int64
	keyLatencies                                 map[string][]int64
	keyAdmitted                                  map[int32][]int64
	uncounted, unpublished                       int64
	hotIndex                                     map[string]int32
}

func newMeasure(ks *keyspace, limit int64, w time.Duration, regions int) *measure {
	m := &measure{ks: ks, limit: limit, w: w.Milliseconds(), regions: regions, refs: map[int32]*ref{},
		admitted: map[winKey]int64{}, regional: map[regKey]int64{}, armed: map[winKey]*armed{}, hotIndex: map[string]int32{},
		keyLatencies: map[string][]int64{}, keyAdmitted: map[int32][]int64{}}
	for i := range ks.hot {
		m.hotIndex[ks.name(int32(i))] = int32(i)
	}
	for i := range ks.extra {
		m.hotIndex[ks.extra[i]] = int32(ks.keys + i)
	}
	return m
}

// ideal is the central counter's verdict on one request: whether the
// units the whole fleet admitted of the key (current window and weighted
// previous one), with this request's, stay within the limit. It judges
// each decision against the world as it is at that moment; admitted
// requests are counted by count.
func (m *measure) ideal(key int32, at int64) bool {
	if int(key) >= m.ks.keys+len(m.ks.extra) {
		return true // a cold key's only request
	}
	r := m.refs[key]
	if r == nil {
		r = &ref{seq: at / m.w}
		m.refs[key] = r
	}
	return r.fits(at, m.limit, m.w)
}

// fits moves r to the window of at (Unix ms) and says whether one more
// unit fits there.
func (r *ref) fits(at, limit, w int64) bool {
	switch seq := at / w; {
	case seq == r.seq+1:
		r.seq, r.prev, r.cur = seq, r.cur, 0
	case seq > r.seq+1:
		r.seq, r.prev, r.cur = seq, 0, 0
	}
	return fits(r.cur, r.prev, 1, limit, w, at-r.seq*w)
}

// Reference is the central counter for decisions made outside the
// simulator (real processes' answers, recorded by a test): fed every
// decision on one limit in the order they were made, it counts those it
// would have made the other way, as a run's FalseAllows and FalseDenies.
type Reference struct {
	limit, w int64
	refs     map[string]*ref
	// Decisions, FalseAllows and FalseDenies are as in Result.
	Decisions, FalseAllows, FalseDenies int64
}

// NewReference returns the central counter of a limit per window.
func NewReference(limit int64, window time.Duration) *Reference {
	return &Reference{limit: limit, w: window.Milliseconds(), refs: map[string]*ref{}}
}

// Judge takes one decision: a request of key at (Unix ms, windows aligned
// to the epoch as the engine's) was allowed or denied.
func (r *Reference) Judge(key string, at int64, allowed bool) {
	c := r.refs[key]
	if c == nil {
		c = &ref{seq: at / r.w}
		r.refs[key] = c
	}
	ideal := c.fits(at, r.limit, r.w)
	r.Decisions++
	switch {
	case allowed && !ideal:
		r.FalseAllows++
	case !allowed && ideal:
		r.FalseDenies++
	}
	if allowed {
		c.cur++
	}
}

// count adds an admitted request to the central counter.
func (m *measure) count(key int32) {
	if r := m.refs[key]; r != nil {
		r.cur++
	}
}

// record counts one decision of the fleet; arm is called on a hot key's
// first denial in a window (the central counter holds the world's count of
// the window then).
func (m *measure) record(req request, allowed bool, arm func(k winKey, region int)) {
	ideal := m.ideal(req.key, req.at)
	m.decisions++
	switch {
	case allowed && !ideal:
		m.falseAllows++
	case !allowed && ideal:
		m.falseDenies++
	}
	if allowed {
		m.allowed++
		m.count(req.key)
	}
	if !m.ks.isHot(req.key) {
		return
	}
	k := winKey{req.key, req.at / m.w}
	if allowed {
		m.admitted[k]++
		m.regional[regKey{k.key, k.seq, req.region}]++
		if m.keyAdmitted[req.key] == nil {
			m.keyAdmitted[req.key] = make([]int64, m.regions)
		}
		m.keyAdmitted[req.key][req.region]++
	} else if m.armed[k] == nil {
		a := &armed{at: req.at, target: m.refs[req.key].cur, pending: make([]bool, m.regions)}
		for r := range m.regions {
			if r != int(req.region) {
				a.pending[r], a.left = true, a.left+1
			}
		}
		m.armed[k] = a
		arm(k, int(req.region))
	}
}

// view is told of a change of a region's cell (or looks at it when armed):
// once the region's view of an armed key's window (its own count and what
// it imported) holds every unit the world had admitted in the window at
// the first denial, the time since that denial is one sample. For a key
// that starts at one region this is the time until the others are at the
// limit; a key carried over from the window before is at the limit
// nowhere while the admissions keep pace with the previous window's
// decay, but its count still has to travel.
func (m *measure) view(region int, id simmodel.CellID, cur simmodel.Hash, at int64) {
	k, ok := m.hotIndex[id.Key.Identifier]
	if !ok {
		return
	}
	a := m.armed[winKey{k, id.Seq}]
	if a == nil || !a.pending[region] {
		return
	}
	if cur.T+cur.G >= a.target {
		a.pending[region] = false
		a.left--
		m.latencies = append(m.latencies, max(at-a.at, 0))
		m.keyLatencies[id.Key.Identifier] = append(m.keyLatencies[id.Key.Identifier], max(at-a.at, 0))
	}
}

// unreached counts the armed regions whose view never reached the limit.
func (m *measure) unreached() int {
	n := 0
	for _, a := range m.armed {
		n += a.left
	}
	return n
}

// windows returns admitted / limit of every hot key's window in [from, to)
// (sequences), or of every window seen when all, in window order (by
// sequence, then key).
func (m *measure) windows(from, to int64, all bool) []float64 {
	var ks []winKey
	for k := range m.admitted {
		if all || (k.seq >= from && k.seq < to) {
			ks = append(ks, k)
		}
	}
	slices.SortFunc(ks, func(a, b winKey) int {
		if a.seq != b.seq {
			return cmp.Compare(a.seq, b.seq)
		}
		return cmp.Compare(a.key, b.key)
	})
	out := make([]float64, len(ks))
	for i, k := range ks {
		out[i] = float64(m.admitted[k]) / float64(m.limit)
	}
	return out
}

// check compares, for the window seq of every hot key, what each region
// admitted with its Redis's count, and a published cell's count with
// MySQL's.
func (m *measure) check(seq int64, s *sim) {
	keys := make([]regKey, 0)
	for k := range m.regional {
		if k.seq == seq {
			keys = append(keys, k)
		}
	}
	slices.SortFunc(keys, func(a, b regKey) int {
		if a.key != b.key {
			return int(a.key - b.key)
		}
		return int(a.region - b.region)
	})
	for _, k := range keys {
		adm := m.regional[k]
		delete(m.regional, k)
		reg := s.regions[k.region]
		id := simmodel.CellID{Key: s.key(k.key), Seq: seq}
		h, _ := reg.redis.Cell(id)
		m.uncounted += max(0, adm-h.T)
		cell := propagation.Cell{Namespace: id.Key.Namespace, Identifier: id.Key.Identifier, WindowMs: m.w, Sequence: seq}
		if reg.redis.Registered(cell) {
			m.unpublished += max(0, h.T-s.mysql.Count(cell, reg.name))
		}
	}
}

// percentile returns the p-th percentile (0–1) of sorted xs.
func percentile(xs []int64, p float64) int64 {
	if len(xs) == 0 {
		return -1
	}
	i := int(p*float64(len(xs)-1) + 0.5)
	return xs[min(i, len(xs)-1)]
}
