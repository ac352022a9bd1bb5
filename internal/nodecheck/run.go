package nodecheck

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// Cluster is the region a list runs on: n engines, each its own process to
// one shared origin, on clocks the runner sets.
type Cluster interface {
	// Engine is node i's engine, configured with FastTick and SlowTick,
	// Manual (the runner drives replay and the janitor) and a small entry
	// cap (24), so that eviction happens.
	Engine(i int) *engine.Engine
	// SetClock sets node i's clock.
	SetClock(i int, t time.Time)
	// Reload hands node i's engine a new origin object of the same
	// process, as a config reload does.
	Reload(i int)
	// Detach takes node i's origin out, as a reload to a config without
	// Redis does (the engine decides alone); Reload puts one back.
	Detach(i int)
	// Restart empties the origin, as a Redis restarted empty.
	Restart()
	// Flush empties the origin as an operator's FLUSHALL does: the
	// server keeps running (and its run ID).
	Flush()
	// Noticed reports whether node i's origin has noticed that the origin
	// lost its data (Restart or Flush) since the last loss, once it could
	// have: the origin watches for that every slow tick.
	Noticed(i int) bool
	// Renew restarts node i's process: its engine closes (writing what it
	// holds) and a new one, of a new process ID, takes its place with an
	// origin.
	Renew(i int)
	// SetDown makes the origin unreachable, or reachable again.
	SetDown(down bool)
	// ResetCells marks the key's cell seq and the one before it as reset
	// for the region (origin.Redis.ResetCells with version 0).
	ResetCells(key engine.Key, seq int64) error
	// Settle returns once the engines' background work (reads started
	// without waiting) has finished, or as soon as it can.
	Settle()
}

// Result is what a run found.
type Result struct {
	// Decisions counts the decisions checked.
	Decisions int
	// Over is the largest over-admission seen outside faults (units past
	// the limit), with the slack it was allowed.
	Over, OverSlack int64
	// Err is the first violation of the invariant; nil when none.
	Err error
}

// Trace, when set, receives a line per checked decision.
type Trace func(format string, args ...any)

// Run runs ops on c, which has Nodes(ops) nodes, from base (a time whose
// windows are live at the origin: a real Redis expires the keys of a past
// one), and checks every decision against one central counter that
// receives every admitted unit, in the window the admitting node counted it
// in.
//
// The invariant, in DESIGN's terms: while the origin is reachable, a
// request is admitted only if the central count of its key, weighed as the
// engine weighs (current + ⌊previous × (1 − progress)⌋), plus its cost
// stays within limit + slack, where the slack is what the other nodes
// admitted that the deciding node cannot know yet: their admissions since
// its view of the key was taken (its last read or replay, KeyState's
// ViewedAt), and those they had not replayed then: a slow tick and a fast
// one's worth, and every unit a node admitted while it could not replay
// (the origin unreachable, or the node reloaded without it), which
// reaches the origin within a flush period of its return. A request is never denied while that count with its cost is
// within the limit: no node counts a unit that was not admitted. After a
// fault (the origin restarted empty or unreachable, a node's clock
// stepped, a node reloaded without the origin and with it again), the
// bound holds again within one flush period.
func Run(c Cluster, ops []Op, base time.Time, trace Trace) Result {
	r := &runner{c: c, base: base, trace: trace, n: Nodes(ops),
		quietTill: -1, resendAt: -1, renewedAt: -1, central: map[cellID]int64{}, recent: admissions{}, limits: map[string]int64{}}
	r.offsets = make([]time.Duration, r.n)
	r.detached = make([]bool, r.n)
	r.alone = make([]map[cellID]int64, r.n)
	for i := range r.n {
		c.SetClock(i, base)
	}
	for i, o := range ops[1:] {
		if err := r.do(i+1, o); err != nil {
			r.res.Err = err
			break
		}
		c.Settle()
	}
	return r.res
}

// Shrink removes operations from ops one chunk at a time while run still
// fails, halving the chunks down to single operations, until no removal
// keeps it failing. It returns the shortest list found and its failure.
func Shrink(ops []Op, run func([]Op) error) ([]Op, error) {
	var last error
	fails := func(o []Op) bool {
		if err := run(o); err != nil {
			last = err
			return true
		}
		return false
	}
	cur := ops
	for progress := true; progress; {
		progress = false
		for chunk := len(cur) / 2; chunk >= 1; chunk /= 2 {
			for i := 1; i < len(cur); { // the first operation carries the node count
				end := min(i+chunk, len(cur))
				try := append(append([]Op(nil), cur[:i]...), cur[end:]...)
				if fails(try) {
					cur, progress = try, true
					continue
				}
				i = end
			}
		}
	}
	fails(cur)
	return cur, last
}

type cellID struct {
	id     string
	w, seq int64
}

type runner struct {
	c       Cluster
	base    time.Time
	trace   Trace
	n       int
	offsets []time.Duration
	res     Result

	// limits are the keys' limits an operator changed (OpLimit), by
	// identifier: every node applies a change from its next decision.
	limits map[string]int64 // by Key.name

	now       int64 // the true clock, ms since base
	ticks     int
	quietTill int64 // faults: the bound holds again after this
	down      bool
	detached  []bool // nodes reloaded without the origin
	resendAt  int64
	renewedAt int64 // the last OpRenew, or -1
	central   map[cellID]int64
	recent    admissions
	// alone is, by node, what each node admitted since the origin went
	// down, while it ran with it and on the true clock (see aloneCheck).
	alone []map[cellID]int64
}

var bg = context.Background()

func (r *runner) fault(until int64) { r.quietTill = max(r.quietTill, until) }

func (r *runner) nodeNow(i int) int64 { return r.now + r.offsets[i].Milliseconds() }

func (r *runner) setClock(i int) {
	r.c.SetClock(i, r.base.Add(time.Duration(r.now)*time.Millisecond+r.offsets[i]))
}

func limitOf(k Key, cost int64) engine.Limit {
	return engine.Limit{Key: engine.Key{Namespace: Zone, Identifier: k.ID, Window: k.Window}, Limit: k.Limit, Cost: cost}
}

// effective is the central count of k weighed at at (ms since base).
func (r *runner) effective(k Key, at int64) int64 { return r.weighed(r.central, k, at) }

// weighed is the count of k in counts weighed at at (ms since base), as
// the engine weighs: current + ⌊previous × (1 − progress)⌋.
func (r *runner) weighed(counts map[cellID]int64, k Key, at int64) int64 {
	w := k.Window.Milliseconds()
	abs := r.base.UnixMilli() + at
	seq, rem := abs/w, abs%w
	prev := counts[cellID{k.ID, w, seq - 1}]
	return counts[cellID{k.ID, w, seq}] + prev*(w-rem)/w
}

// check judges node i's verdict on k at cost against the central count
// before it, and charges the central counter when admitted.
func (r *runner) check(op, i int, k Key, cost int64, allowed bool) error {
	at := r.nodeNow(i)
	eff := r.effective(k, at)
	quiet := r.now <= r.quietTill || r.down || slices.Contains(r.detached, true)
	// The node's view of the key was taken at its last read or replay: what
	// the others had not replayed by then is what its decision cannot
	// weigh.
	view := r.now
	if ks, ok := r.c.Engine(i).Inspect(engine.Key{Namespace: Zone, Identifier: k.ID, Window: k.Window}); ok && !ks.ViewedAt.IsZero() {
		view = min(view, ks.ViewedAt.UnixMilli()-r.base.UnixMilli()-r.offsets[i].Milliseconds())
	}
	slack := r.recent.others(i, k.name(), view)
	if !quiet && allowed && eff+cost-k.Limit > r.res.Over {
		r.res.Over, r.res.OverSlack = eff+cost-k.Limit, slack
	}
	if r.trace != nil {
		var views []any
		for j := range r.n {
			ks, _ := r.c.Engine(j).Inspect(engine.Key{Namespace: Zone, Identifier: k.ID, Window: k.Window})
			views = append(views, ks.Cells)
		}
		w := k.Window.Milliseconds()
		seq := (r.base.UnixMilli() + at) / w
		r.trace("op %d t=%d node %d %s cost %d allowed=%v central=%d (%d %d) slack=%d quiet=%v views=%+v", op, r.now, i, k.name(), cost, allowed, eff, r.central[cellID{k.ID, w, seq}], r.central[cellID{k.ID, w, seq - 1}], slack, quiet, views)
	}
	if err := r.aloneCheck(op, i, k, cost, allowed, at); err != nil {
		return err
	}
	switch {
	case quiet:
	case allowed && eff+cost > k.Limit+slack:
		return fmt.Errorf("operation %d: node %d admitted %s (cost %d) at a central count of %d: over limit %d + slack %d",
			op, i, k.name(), cost, eff, k.Limit, slack)
	case !allowed && eff+cost <= k.Limit:
		return fmt.Errorf("operation %d: node %d denied %s (cost %d) at a central count of %d: within limit %d",
			op, i, k.name(), cost, eff, k.Limit)
	}
	if allowed {
		w := k.Window.Milliseconds()
		r.central[cellID{k.ID, w, (r.base.UnixMilli() + at) / w}] += cost
		reach := r.now + slowMs + fastMs
		if r.down || r.detached[i] {
			reach = held // until the node can replay again
		}
		r.recent.add(i, k.name(), r.now, reach, cost)
	}
	return nil
}

// aloneCheck judges, while the origin is down, node i's admission of k at
// cost (at: the node's clock) against what the node itself admitted of k
// since it went down, weighed as the central count is: deciding alone, a
// node weighs at least its own units. The central check waits out an
// outage, and a key evicted or forgotten during one whose write failed
// had its next entry start from nothing, and admit its limit again, within
// it (engine/orphan.go). Not judged: a node detached (it runs local-only,
// where an evicted key starts over) or on a stepped clock (a cell far
// ahead replaced by one of the true window holds none of that window's
// units), both since the outage began; units a node counted before it
// (an entry evicted then, its units written, starts from the origin it
// cannot read now).
func (r *runner) aloneCheck(op, i int, k Key, cost int64, allowed bool, at int64) error {
	if !r.down || r.alone[i] == nil {
		return nil
	}
	if r.detached[i] || r.offsets[i] != 0 {
		r.alone[i] = nil
		return nil
	}
	if !allowed {
		return nil
	}
	if own := r.weighed(r.alone[i], k, at); own+cost > k.Limit {
		return fmt.Errorf("operation %d: node %d admitted %s (cost %d) with the origin down, at %d units it had admitted itself since: over limit %d",
			op, i, k.name(), cost, own, k.Limit)
	}
	w := k.Window.Milliseconds()
	r.alone[i][cellID{k.ID, w, (r.base.UnixMilli() + at) / w}] += cost
	return nil
}

// do runs operation number op.
func (r *runner) do(op int, o Op) error {
	i := o.Node % r.n
	e := r.c.Engine(i)
	switch o.Kind {
	case OpDecide:
		k := r.key(o.Key)
		d := e.Decide(bg, limitOf(k, o.Cost))
		r.res.Decisions++
		return r.check(op, i, k, o.Cost, d.Allowed)
	case OpBatch:
		return r.batch(op, i, o)
	case OpTick:
		return r.tick()
	case OpForget:
		e.Forget(limitOf(Keys[o.Key], 0).Key)
	case OpEvict:
		e.Evict()
	case OpSweep:
		if r.offsets[i] != 0 {
			// A compound fault: the janitor of a node whose clock is an
			// hour ahead drops the entries of the real window as idle,
			// and their units are not sent again should the origin restart
			// empty before that window ends. Checked again from the window
			// after next.
			r.fault(r.now + 2*maxWindow)
		}
		e.Sweep()
	case OpReload:
		r.c.Reload(i)
		if r.detached[i] {
			r.detached[i] = false
			r.released()
			r.fault(r.now + flushPeriod)
		}
	case OpDetach:
		if r.detached[i] {
			r.c.Reload(i)
		} else {
			r.c.Detach(i)
			r.recent.hold(func(node int) bool { return node == i }, r.now)
		}
		r.detached[i] = !r.detached[i]
		r.released()
		r.fault(r.now + flushPeriod)
	case OpStep, OpStepBack:
		switch {
		case r.offsets[i] != 0:
			r.offsets[i] = 0
		case o.Kind == OpStep:
			r.offsets[i] = time.Hour
		default:
			r.offsets[i] = -time.Hour
		}
		r.setClock(i)
		r.fault(r.now + flushPeriod)
	case OpRestart, OpFlush:
		if o.Kind == OpRestart {
			r.c.Restart()
		} else {
			r.c.Flush()
		}
		r.resendAt = r.now + slowMs
		r.fault(r.resendAt + flushPeriod)
		if r.renewedAt >= 0 && r.now-r.renewedAt < 2*maxWindow+flushPeriod {
			// A process that ended wrote its units, and no one holds
			// them any more to send again: the origin lacks them until
			// their windows end. Checked again from the window after next.
			r.fault(r.now + 2*maxWindow)
		}
	case OpRenew:
		// A process that stops writes what it holds, which it can only
		// with the origin: a process that ends without it loses what it
		// did not write (not drawn).
		if r.down || r.detached[i] {
			return nil
		}
		if r.resendAt >= 0 {
			// The origin lost its data and the process ends before it
			// is noticed: no one sends its units again. Checked again
			// from the window after next.
			r.fault(r.now + 2*maxWindow)
		}
		r.c.Renew(i)
		r.setClock(i)
		r.renewedAt = r.now
		for _, list := range r.recent {
			for j := range list {
				if list[j].node == i && list[j].reach > r.now {
					list[j].reach = r.now
				}
			}
		}
	case OpReset:
		return r.reset(op, i, Keys[o.Key])
	case OpLimit:
		r.limits[Keys[o.Key].name()] = o.Limit
	case OpDown:
		r.down = !r.down
		r.c.SetDown(r.down)
		for j := range r.alone {
			r.alone[j] = nil
			if r.down && !r.detached[j] && r.offsets[j] == 0 {
				r.alone[j] = map[cellID]int64{}
			}
		}
		if r.down {
			r.recent.hold(func(int) bool { return true }, r.now)
		}
		r.released()
		r.fault(r.now + flushPeriod)
	}
	return nil
}

// reset runs an OpReset as the admin API makes a region reset (the root's
// reset.go): node i writes what it has not replayed of the key, the
// origin marks the key's cell of node i's window and the one before it,
// and every node drops its state of the key and its units of those cells
// not replayed yet (it hears of the reset; here at once). The central
// count of both cells starts over: the marks take off what the origin
// holds, the drops what it does not. A reset needs the region: while the
// origin is down, or node i runs without it, it is refused and changes
// nothing. While another node runs without the origin (it hears of no
// reset, and replays its units into the marked cells later) or a clock
// runs an hour off, the reset is made and the check waits two windows.
func (r *runner) reset(op, i int, k Key) error {
	if r.down || r.detached[i] {
		return nil
	}
	key := limitOf(k, 0).Key
	match := func(id string) bool { return id == k.ID }
	e := r.c.Engine(i)
	if err := e.FlushMatching(Zone, k.Window, match); err != nil {
		return fmt.Errorf("operation %d: node %d could not write its units of %s before a reset: %v", op, i, k.ID, err)
	}
	w := k.Window.Milliseconds()
	at := r.base.UnixMilli() + r.nodeNow(i)
	seq := at / w
	if err := r.c.ResetCells(key, seq); err != nil {
		return fmt.Errorf("operation %d: the origin refused node %d's reset of %s: %v", op, i, k.ID, err)
	}
	for j := range r.n {
		if !r.detached[j] {
			r.c.Engine(j).DropMatching(Zone, k.Window, match, at)
		}
	}
	if slices.Contains(r.detached, true) || slices.ContainsFunc(r.offsets, func(d time.Duration) bool { return d != 0 }) {
		r.fault(r.now + 2*maxWindow)
	}
	delete(r.central, cellID{k.ID, w, seq})
	delete(r.central, cellID{k.ID, w, seq - 1})
	delete(r.recent, k.name())
	return nil
}

// key is Keys[i] with the limit an operator gave it, if any.
func (r *runner) key(i int) Key {
	k := Keys[i]
	if l, ok := r.limits[k.name()]; ok {
		k.Limit = l
	}
	return k
}

// batch runs an OpBatch. Its denial may come from the other limit, so
// only an admission is judged. A limit the origin admitted and charged
// before the other denied (ChargedAnyway) is judged and counted as an
// admission: its units are in the region's count.
func (r *runner) batch(op, i int, o Op) error {
	k1, k2 := r.key(o.Key), r.key(o.Key2)
	out := make([]engine.Decision, 2)
	ok := r.c.Engine(i).DecideMany(bg, []engine.Limit{limitOf(k1, o.Cost), limitOf(k2, o.Cost2)}, out)
	r.res.Decisions++
	if !ok {
		if out[0].ChargedAnyway {
			if err := r.check(op, i, k1, o.Cost, true); err != nil {
				return err
			}
		}
		if out[1].ChargedAnyway {
			return r.check(op, i, k2, o.Cost2, true)
		}
		return nil
	}
	if err := r.check(op, i, k1, o.Cost, true); err != nil {
		return err
	}
	return r.check(op, i, k2, o.Cost2, true)
}

// tick advances the clock a fast tick and runs the replay ticks due.
func (r *runner) tick() error {
	r.now += fastMs
	r.ticks++
	for i := range r.n {
		r.setClock(i)
	}
	if r.resendAt >= 0 && r.now >= r.resendAt {
		// The origin's loss is noticed within a slow tick (a restart by
		// its run ID, a FLUSHALL by the mark it took away): every node
		// sends its cells' totals again. A node running without the
		// origin is told when it has one again (here at once).
		r.resendAt = -1
		for i := range r.n {
			if !r.detached[i] && !r.down && !r.c.Noticed(i) {
				return fmt.Errorf("at t=%d ms: node %d did not notice that the origin lost its data %d ms before", r.now, i, slowMs)
			}
			r.c.Engine(i).Resend()
		}
	}
	for i := range r.n {
		e := r.c.Engine(i)
		_, _ = e.ReplayOnce(bg, engine.Fast)
		if r.ticks%int(slowMs/fastMs) == 0 {
			_, _ = e.ReplayOnce(bg, engine.Slow)
		}
	}
	return nil
}

// released gives the units held by nodes that can replay again (the
// origin reachable, the node not detached) the time by which they reach
// the origin: within a flush period from now.
func (r *runner) released() {
	if r.down {
		return
	}
	for _, list := range r.recent {
		for j := range list {
			if list[j].reach == held && !r.detached[list[j].node] {
				list[j].reach = r.now + flushPeriod
			}
		}
	}
}

// held is the reach of a unit whose node cannot replay it yet.
const held = math.MaxInt64

// admissions remembers what each node admitted of each key lately, for the
// slack of a check.
type admissions map[string][]admission

type admission struct {
	node int
	// reach is when the unit is at the origin at the latest: a slow tick
	// and a fast one after it was admitted, or, for a unit its node could
	// not replay, a flush period after it can (held until then).
	reach, cost int64
}

func (a admissions) add(node int, id string, at, reach, cost int64) {
	list := a[id]
	i := 0
	for i < len(list) && list[i].reach < at-5000 { // far beyond any view's age
		i++
	}
	a[id] = append(list[i:], admission{node, reach, cost})
}

// hold marks the units of the nodes whose(node) that have not reached the
// origin by now as held: those nodes cannot replay them for a while.
func (a admissions) hold(whose func(node int) bool, now int64) {
	for _, list := range a {
		for j := range list {
			if whose(list[j].node) && list[j].reach > now {
				list[j].reach = held
			}
		}
	}
}

// others is the slack a decision of node on id is allowed: what the other
// nodes admitted of the key that had not reached the origin when this
// node's view of it was taken (view). Until its next read or replay after
// they reach the origin, no decision of it, local or at the origin, can
// weigh them.
func (a admissions) others(node int, id string, view int64) int64 {
	var n int64
	for _, x := range a[id] {
		if x.node != node && x.reach > view {
			n += x.cost
		}
	}
	return n
}

// Describe lists a shrunk run for a failure message.
func Describe(ops []Op, err error) string {
	var b strings.Builder
	fmt.Fprintf(&b, "shortest failing run found, %d nodes, %d operations (%v):", Nodes(ops), len(ops)-1, err)
	for i, o := range ops[1:] {
		fmt.Fprintf(&b, "\n\t%d: %s", i+1, o)
	}
	return b.String()
}
