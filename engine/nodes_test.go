package engine

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// TestProperty_NodesAgreeWithOneCounter drives several engines that share
// one origin (each engine a process of one region) through a seeded
// random sequence of operations: decisions and batches with random costs
// on hot and cold keys, replay ticks, Forget, eviction and sweeps, a
// reload (the engine handed a new origin object of the same process),
// clock steps of one node forward and back, the origin restarted empty
// and the origin unreachable for a while. One central counter receives
// every admitted unit, in the window the admitting node counted it in.
//
// The invariant, in DESIGN's terms: while the origin is reachable, a
// request is admitted only if the central count of its key, weighed as
// the engine weighs (current + ⌊previous × (1 − progress)⌋), plus its cost
// stays within limit + slack, where the slack is what the other nodes
// admitted that the deciding node cannot know yet: their admissions since
// its view of the key was taken (its last read or replay), and those they
// had not replayed then, a slow tick's worth (admissions.others). A
// request is never denied while that count with its cost is within the
// limit: no node counts a unit that was not admitted. After a fault (the
// origin restarted empty or unreachable, a node's clock stepped), the
// bound holds again within one flush period.
//
// A failure prints the seed and the shortest list of operations found that
// still fails (each operation removed in turn while the failure stays).
// RATELIMIT_PROPERTY_DURATION=10m runs seeds for that long (`make
// property`); the default is a few seconds within `make test`.
func TestProperty_NodesAgreeWithOneCounter(t *testing.T) {
	budget := 4 * time.Second
	if testing.Short() {
		budget = time.Second
	}
	if v := os.Getenv("RATELIMIT_PROPERTY_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("RATELIMIT_PROPERTY_DURATION: %v", err)
		}
		budget = d
	}
	seeds := []uint64{1, 2, 3, 4, 5, 6, 7, 8}
	if *propertySeed != 0 {
		seeds = []uint64{*propertySeed}
		budget = 0
	}
	start := time.Now()
	runs, decisions := 0, 0
	var over, overSlack int64
	for i := 0; ; i++ {
		var seed uint64
		switch {
		case i < len(seeds):
			seed = seeds[i]
		case time.Since(start) < budget:
			seed = uint64(time.Now().UnixNano())
		default:
			if runs == 0 || decisions < 10_000 {
				t.Fatalf("only %d runs and %d decisions checked", runs, decisions)
			}
			t.Logf("%d runs, %d decisions checked against the central counter; largest over-admission %d units (its slack %d)",
				runs, decisions, over, overSlack)
			return
		}
		ops := genOps(seed, 3000)
		res := runNodes(t, seed, ops)
		runs++
		decisions += res.decisions
		if res.over > over {
			over, overSlack = res.over, res.overSlack
		}
		if res.err == nil {
			continue
		}
		short, serr := shrinkOps(t, ops)
		if os.Getenv("RATELIMIT_PROPERTY_TRACE") != "" {
			simTrace = true
			runNodes(t, seed, short)
			simTrace = false
		}
		var b strings.Builder
		for i, o := range short[1:] {
			fmt.Fprintf(&b, "\n\t%d: %s", i+1, o)
		}
		t.Fatalf("seed %d (rerun: go test ./engine -run TestProperty_NodesAgreeWithOneCounter -property.seed=%d): %v\nshortest failing run found, %d nodes, %d of %d operations (%v):%s",
			seed, seed, res.err, short[0].node+1, len(short)-1, len(ops)-1, serr, b.String())
	}
}

var propertySeed = flag.Uint64("property.seed", 0, "run TestProperty_NodesAgreeWithOneCounter with this seed only")

// The simulated region: replay ticks as the defaults have them.
const (
	simFastTick = 10 // ms
	simSlowTick = 100
	// simFlushPeriod is how long after a fault the bound must hold again:
	// the slow tick (the longest a unit waits for replay), a fast tick,
	// and the restart detection (one slow tick, see opRestart).
	simFlushPeriod = 2*simSlowTick + simFastTick
	simMaxCost     = 3
	simMaxWindow   = 2000 // ms, the longest window of simKeys
)

type simKey struct {
	id     string
	window time.Duration
	limit  int64
}

// simKeys are the keys of a run: hot keys of small and larger limits on
// two window lengths, then cold keys (one request or few each).
var simKeys = func() []simKey {
	ks := []simKey{
		{"h0", time.Second, 5}, {"h1", time.Second, 20}, {"h2", 2 * time.Second, 50},
		{"h3", 2 * time.Second, 100}, {"h4", time.Second, 1},
	}
	for i := 0; i < 40; i++ {
		ks = append(ks, simKey{"c" + strconv.Itoa(i), time.Second, 10})
	}
	return ks
}()

type opKind uint8

const (
	opDecide opKind = iota
	opBatch
	opTick
	opForget
	opEvict
	opSweep
	opReload
	opStep    // the node's clock jumps an hour ahead, or back
	opRestart // the origin restarted empty
	opDown    // the origin unreachable, or back
)

// op is one operation; its fields are read by its kind.
type op struct {
	kind        opKind
	node        int
	key, key2   int
	cost, cost2 int64
}

func (o op) String() string {
	switch o.kind {
	case opDecide:
		return fmt.Sprintf("node %d decides %s cost %d", o.node, simKeys[o.key].id, o.cost)
	case opBatch:
		return fmt.Sprintf("node %d decides %s cost %d and %s cost %d together", o.node, simKeys[o.key].id, o.cost, simKeys[o.key2].id, o.cost2)
	case opTick:
		return fmt.Sprintf("the clock advances %d ms (replay ticks)", simFastTick)
	case opForget:
		return fmt.Sprintf("node %d forgets %s", o.node, simKeys[o.key].id)
	case opEvict:
		return fmt.Sprintf("node %d evicts past its entry cap", o.node)
	case opSweep:
		return fmt.Sprintf("node %d's janitor sweeps", o.node)
	case opReload:
		return fmt.Sprintf("node %d reloads (a new origin object of the same process)", o.node)
	case opStep:
		return fmt.Sprintf("node %d's clock steps an hour forward, or back", o.node)
	case opRestart:
		return "the origin restarts empty"
	case opDown:
		return "the origin becomes unreachable, or reachable again"
	}
	return "?"
}

// genOps draws n operations from seed. The first operation's node picks
// the number of nodes: 2 to 5.
func genOps(seed uint64, n int) []op {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	nodes := 2 + rng.IntN(4)
	ops := make([]op, 0, n)
	cost := func() int64 {
		if rng.IntN(20) == 0 {
			return 0
		}
		return 1 + rng.Int64N(simMaxCost)
	}
	key := func() int {
		if rng.IntN(4) == 0 {
			return 5 + rng.IntN(len(simKeys)-5) // cold
		}
		return rng.IntN(5)
	}
	for len(ops) < n {
		o := op{node: rng.IntN(nodes)}
		switch r := rng.IntN(1000); {
		case r < 640:
			o.kind, o.key, o.cost = opDecide, key(), cost()
		case r < 680:
			o.kind, o.key, o.cost, o.key2, o.cost2 = opBatch, key(), cost(), key(), cost()
			if simKeys[o.key].id == simKeys[o.key2].id {
				continue
			}
		case r < 950:
			o.kind = opTick
		case r < 962:
			o.kind, o.key = opForget, rng.IntN(5)
		case r < 970:
			o.kind = opEvict
		case r < 975:
			o.kind = opSweep
		case r < 982:
			o.kind = opReload
		case r < 988:
			o.kind = opStep
		case r < 993:
			o.kind = opRestart
		default:
			o.kind = opDown
		}
		ops = append(ops, o)
	}
	// The node count travels with the list, so a shrunk list keeps it.
	ops = append([]op{{kind: opTick, node: nodes - 1}}, ops...)
	return ops
}

// simTrace logs every checked decision of the shortest failing run
// (RATELIMIT_PROPERTY_TRACE=1).
var simTrace bool

type simResult struct {
	decisions int
	// over is the largest over-admission checked (units past the limit),
	// with the slack it was allowed.
	over, overSlack int64
	err             error
}

// runNodes runs ops in a synctest bubble, so the engines' goroutines (reads
// in the background) finish between operations: one list, one result.
func runNodes(t *testing.T, seed uint64, ops []op) simResult {
	var res simResult
	t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) { res = simulate(t, ops) })
	})
	return res
}

// shrinkOps removes operations one chunk at a time while the run still
// fails, halving the chunks down to single operations, until no removal
// keeps it failing. It returns the shortest list and its failure.
func shrinkOps(t *testing.T, ops []op) ([]op, error) {
	var last error
	fails := func(o []op) bool {
		var res simResult
		t.Run("shrink", func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) { res = simulate(t, o) })
		})
		if res.err != nil {
			last = res.err
		}
		return res.err != nil
	}
	cur := ops
	for progress := true; progress; {
		progress = false
		for chunk := len(cur) / 2; chunk >= 1; chunk /= 2 {
			for i := 1; i < len(cur); { // the first operation carries the node count
				end := min(i+chunk, len(cur))
				try := append(append([]op(nil), cur[:i]...), cur[end:]...)
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

// simNode is one process of the region.
type simNode struct {
	e      *Engine
	clk    *testclock.Clock
	o      *memOrigin
	name   string
	offset time.Duration
}

// simulate runs ops and returns the first violation of the invariant.
func simulate(t *testing.T, ops []op) simResult {
	base := time.UnixMilli(epoch + 500) // half a second into a window
	store := newMemOrigin()
	n := ops[0].node + 1
	nodes := make([]*simNode, n)
	for i := range nodes {
		clk := testclock.New(base)
		e := New(Config{Now: clk.Now, Manual: true, MaxEntries: 24, ReadTimeout: 50 * time.Millisecond,
			FastTick: simFastTick * time.Millisecond, SlowTick: simSlowTick * time.Millisecond})
		nd := &simNode{e: e, clk: clk, name: strconv.Itoa(i)}
		nd.o = store.peer(nd.name)
		e.SetOrigin(nd.o)
		nodes[i] = nd
	}
	defer func() {
		for _, nd := range nodes {
			_ = nd.e.Close(bg)
		}
	}()
	var (
		res       simResult
		now       int64 // the true clock, ms since base
		ticks     int
		quietTill int64 = -1 // faults: the bound holds again after this
		down      bool
		resendAt  int64 = -1
		central         = map[refCell]int64{}
		recent          = admissions{}
	)
	fault := func(until int64) { quietTill = max(quietTill, until) }
	nodeNow := func(nd *simNode) int64 { return nd.clk.UnixMilli() }
	effective := func(k simKey, at int64) int64 {
		w := k.window.Milliseconds()
		seq, r := at/w, at%w
		return central[refCell{"z", k.id, w, seq}] + weighted(central[refCell{"z", k.id, w, seq - 1}], w, r)
	}
	limitOf := func(k simKey, cost int64) Limit {
		return Limit{Key: Key{Namespace: "z", Identifier: k.id, Window: k.window}, Limit: k.limit, Cost: cost}
	}
	// check judges one verdict of nd on k at cost against the central count
	// before it, and charges the central counter when admitted.
	check := func(i int, o op, nd *simNode, k simKey, cost int64, allowed bool) error {
		at := nodeNow(nd)
		eff := effective(k, at)
		quiet := now <= quietTill || down
		// The node's view of the key was taken at its last read or replay:
		// what the others admitted since (and what they had not replayed
		// then) is what its decision cannot weigh.
		since := now - simSlowTick - simFastTick
		if ks, ok := nd.e.Inspect(Key{"z", k.id, k.window}); ok && !ks.ViewedAt.IsZero() {
			since = min(since, ks.ViewedAt.UnixMilli()-base.UnixMilli()-nd.offset.Milliseconds()-simSlowTick-simFastTick)
		}
		slack := recent.others(o.node%len(nodes), k.id, since)
		if !quiet && allowed && eff+cost-k.limit > res.over {
			res.over, res.overSlack = eff+cost-k.limit, slack
		}
		switch {
		case quiet:
		case allowed && eff+cost > k.limit+slack:
			return fmt.Errorf("operation %d: node %d admitted %s (cost %d) at a central count of %d: over limit %d + slack %d",
				i, o.node%len(nodes), k.id, cost, eff, k.limit, slack)
		case !allowed && eff+cost <= k.limit:
			return fmt.Errorf("operation %d: node %d denied %s (cost %d) at a central count of %d: within limit %d",
				i, o.node%len(nodes), k.id, cost, eff, k.limit)
		}
		if simTrace {
			ks, _ := nd.e.Inspect(Key{"z", k.id, k.window})
			w := k.window.Milliseconds()
			t.Logf("op %d t=%d node %d %s cost %d allowed=%v central=%d (cells %d+%d) quiet=%v; node's view %d %+v; origin %d+%d",
				i, now, o.node%len(nodes), k.id, cost, allowed, eff, central[refCell{"z", k.id, w, at / w}], central[refCell{"z", k.id, w, at/w - 1}], quiet,
				ks.Effective, ks.Cells, store.total(Key{"z", k.id, k.window}, at/w), store.total(Key{"z", k.id, k.window}, at/w-1))
		}
		if allowed {
			w := k.window.Milliseconds()
			central[refCell{"z", k.id, w, at / w}] += cost
			recent.add(o.node%len(nodes), k.id, now, cost)
		}
		return nil
	}
	for i, o := range ops[1:] {
		i++
		nd := nodes[o.node%len(nodes)]
		switch o.kind {
		case opDecide:
			k := simKeys[o.key]
			d := nd.e.Decide(bg, limitOf(k, o.cost))
			res.decisions++
			if err := check(i, o, nd, k, o.cost, d.Allowed); err != nil {
				res.err = err
				return res
			}
		case opBatch:
			k1, k2 := simKeys[o.key], simKeys[o.key2]
			out := make([]Decision, 2)
			ok := nd.e.DecideMany(bg, []Limit{limitOf(k1, o.cost), limitOf(k2, o.cost2)}, out)
			res.decisions++
			// A batch reads instead of reserving: it may over-admit by what
			// others admit until their next replay, within the same slack.
			if ok {
				for _, c := range []struct {
					k    simKey
					cost int64
				}{{k1, o.cost}, {k2, o.cost2}} {
					if err := check(i, o, nd, c.k, c.cost, true); err != nil {
						res.err = err
						return res
					}
				}
			}
		case opTick:
			now += simFastTick
			ticks++
			for _, x := range nodes {
				x.clk.Set(base.Add(time.Duration(now)*time.Millisecond + x.offset))
			}
			if resendAt >= 0 && now >= resendAt {
				// The origin's restart is noticed (its run ID) within a
				// slow tick: every node sends its live totals again.
				for _, x := range nodes {
					x.e.Resend()
				}
				resendAt = -1
			}
			for _, x := range nodes {
				_, _ = x.e.ReplayOnce(bg, Fast)
				if ticks%(simSlowTick/simFastTick) == 0 {
					_, _ = x.e.ReplayOnce(bg, Slow)
				}
			}
			if simTrace {
				var b strings.Builder
				for j, x := range nodes {
					ks, _ := x.e.Inspect(Key{"z", "h2", 2 * time.Second})
					fmt.Fprintf(&b, " node %d %+v q=%d/%d;", j, ks.Cells, x.e.queue(Fast).len(), x.e.queue(Slow).len())
				}
				t.Logf("tick t=%d origin h2 %d:%s", now, store.total(Key{"z", "h2", 2 * time.Second}, (base.UnixMilli()+now)/2000), b.String())
			}
		case opForget:
			nd.e.Forget(limitOf(simKeys[o.key], 0).Key)
		case opEvict:
			nd.e.Evict()
		case opSweep:
			if nd.offset != 0 {
				// A compound fault: the janitor of a node whose clock is an
				// hour ahead drops the entries of the real window as idle,
				// and their units are not sent again should the origin
				// restart empty before that window ends. Checked again
				// from the window after next.
				fault(now + 2*simMaxWindow)
			}
			nd.e.Sweep()
		case opReload:
			nd.o = store.peer(nd.name)
			nd.e.SetTiming(Timing{FastTick: simFastTick * time.Millisecond, SlowTick: simSlowTick * time.Millisecond})
			nd.e.SetOrigin(nd.o)
		case opStep:
			if nd.offset == 0 {
				nd.offset = time.Hour
			} else {
				nd.offset = 0
				fault(now + simFlushPeriod)
			}
			nd.clk.Set(base.Add(time.Duration(now)*time.Millisecond + nd.offset))
			fault(now + simFlushPeriod)
		case opRestart:
			store.restart()
			resendAt = now + simSlowTick
			fault(resendAt + simFlushPeriod)
		case opDown:
			down = !down
			store.down.Store(down)
			fault(now + simFlushPeriod)
		}
		synctest.Wait()
	}
	return res
}

// admissions remembers what each node admitted of each key lately, for
// the slack of a check.
type admissions map[string][]admission

type admission struct {
	node     int
	at, cost int64
}

func (a admissions) add(node int, id string, at, cost int64) {
	list := a[id]
	i := 0
	for i < len(list) && list[i].at < at-5000 { // far beyond any view's age
		i++
	}
	a[id] = append(list[i:], admission{node, at, cost})
}

// others is the slack the design allows a decision of node on id: what
// the other nodes admitted of the key after since, the time of the node's
// view of the key less the longest the others' units wait for replay (a
// slow tick). Their units reach the origin within a replay interval and
// this node's view within its next read or replay; until then no decision
// of it, local or at the origin, can weigh them (DESIGN, "The
// invariant").
func (a admissions) others(node int, id string, since int64) int64 {
	var n int64
	for _, x := range a[id] {
		if x.node != node && x.at > since {
			n += x.cost
		}
	}
	return n
}
