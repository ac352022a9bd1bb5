package nodecheck

import (
	"flag"
	"fmt"
	"os"
	"testing"
	"testing/synctest"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

var (
	propertySeed  = flag.Uint64("property.seed", 0, "run TestProperty_NodesAgreeWithOneCounter with this seed only")
	propertyTrace = flag.Bool("property.trace", false, "log every checked decision of the shortest failing run")
)

// memoryBase is a time half a second into a window of every key's length.
var memoryBase = time.UnixMilli(1_700_000_000/86400*86400*1000 + 500)

// runMemory runs ops on a MemoryCluster in a synctest bubble, so the
// engines' goroutines (reads in the background) finish between operations:
// one list, one result.
func runMemory(t *testing.T, ops []Op, trace Trace) Result {
	var res Result
	t.Run("run", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			c := &settled{NewMemoryCluster(Nodes(ops))}
			defer c.Close()
			res = Run(c, ops, memoryBase, trace)
		})
	})
	return res
}

// settled waits in the synctest bubble after each operation.
type settled struct{ *MemoryCluster }

func (settled) Settle() { synctest.Wait() }

// TestProperty_NodesAgreeWithOneCounter drives 2 to 5 engines that share
// one in-memory origin (each engine a process of one region) through
// seeded random lists of decisions and batches with random costs on hot
// and cold keys, replay ticks, Forget, eviction and sweeps, reloads, clock
// steps of one node forward and back, the origin restarted empty and the
// origin unreachable for a while, and checks them against one central
// counter (see Run for the invariant and its slack).
//
// A failure prints the seed and the shortest list found that still fails.
// By default it runs eight fixed seeds, so that the suite judges the same
// runs every time; RATELIMIT_PROPERTY_DURATION=10m runs new seeds for that
// long (`make property`), which is where new defects are found (the README
// lists those open). integration's TestProperty_NodesOnRedis runs the same
// lists on real Redis.
func TestProperty_NodesAgreeWithOneCounter(t *testing.T) {
	var budget time.Duration
	if v := os.Getenv("RATELIMIT_PROPERTY_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("RATELIMIT_PROPERTY_DURATION: %v", err)
		}
		budget = d
	}
	seeds := []uint64{1, 2, 3, 4, 5, 6, 7, 8}
	if *propertySeed != 0 {
		seeds, budget = []uint64{*propertySeed}, 0
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
			if decisions < 10_000 && *propertySeed == 0 { // a rerun of one seed checks what it checks
				t.Fatalf("only %d runs and %d decisions checked", runs, decisions)
			}
			t.Logf("%d runs, %d decisions checked against the central counter; largest over-admission %d units (its slack %d)",
				runs, decisions, over, overSlack)
			return
		}
		ops := Gen(seed, 3000, AllFaults)
		res := runMemory(t, ops, nil)
		runs++
		decisions += res.Decisions
		if res.Over > over {
			over, overSlack = res.Over, res.OverSlack
		}
		if res.Err == nil {
			continue
		}
		short, serr := Shrink(ops, func(o []Op) error { return runMemory(t, o, nil).Err })
		if *propertyTrace {
			runMemory(t, short, t.Logf)
		}
		t.Fatalf("seed %d: %v\n%s\nrerun: go test ./internal/nodecheck -run TestProperty_NodesAgreeWithOneCounter -property.seed=%d [-property.trace]",
			seed, res.Err, Describe(short, serr), seed)
	}
}

// apart is a region of two nodes that never see each other's units: each
// is the only node of a MemoryCluster of its own. Run must catch what it
// admits.
type apart [2]*MemoryCluster

func (c apart) Engine(i int) *engine.Engine { return c[i].Engine(0) }
func (c apart) SetClock(i int, t time.Time) { c[i].SetClock(0, t) }
func (c apart) Reload(i int)                { c[i].Reload(0) }
func (c apart) Detach(i int)                { c[i].Detach(0) }
func (c apart) Restart()                    { c[0].Restart(); c[1].Restart() }
func (c apart) SetDown(down bool)           { c[0].SetDown(down); c[1].SetDown(down) }
func (c apart) Settle()                     { synctest.Wait() }
func (c apart) Close()                      { c[0].Close(); c[1].Close() }

var _ Cluster = apart{}

// overAdmission is a list that apart fails: node 0 takes h0's limit (5),
// the clock moves past what the slack forgives, and node 1 admits one more.
func overAdmission() []Op {
	ops := []Op{{Kind: OpTick, Node: 1}}
	for range 5 {
		ops = append(ops, Op{Kind: OpDecide, Node: 0, Key: 0, Cost: 1})
	}
	for range 12 {
		ops = append(ops, Op{Kind: OpTick})
	}
	return append(ops, Op{Kind: OpDecide, Node: 1, Key: 0, Cost: 1})
}

// TestRun_CatchesAnOverAdmission: nodes that do not share their units
// admit past the limit beyond the slack, and Run names the operation, the
// node and the counts.
func TestRun_CatchesAnOverAdmission(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := apart{NewMemoryCluster(1), NewMemoryCluster(1)}
		defer c.Close()
		res := Run(c, overAdmission(), memoryBase, nil)
		want := "operation 18: node 1 admitted h0 (cost 1) at a central count of 5: over limit 5 + slack 0"
		if res.Err == nil || res.Err.Error() != want {
			t.Fatalf("error %v, want %q", res.Err, want)
		}
		if res.Decisions != 6 || res.Over != 1 || res.OverSlack != 0 {
			t.Fatalf("%d decisions, over by %d with slack %d; want 6, 1, 0", res.Decisions, res.Over, res.OverSlack)
		}
	})
}

// TestShrink_KeepsOnlyWhatTheFailureNeeds: a failure that needs a restart
// followed by an outage shrinks to those two operations after the first
// (which carries the node count), and reports the failure of that list.
func TestShrink_KeepsOnlyWhatTheFailureNeeds(t *testing.T) {
	ops := Gen(3, 400, AllFaults)
	fails := func(o []Op) error {
		restarted := false
		for _, op := range o[1:] {
			restarted = restarted || op.Kind == OpRestart
			if restarted && op.Kind == OpDown {
				return fmt.Errorf("%d operations", len(o)-1)
			}
		}
		return nil
	}
	if fails(ops) == nil {
		t.Fatal("seed 3's list has no restart before an outage: pick another seed")
	}
	short, err := Shrink(ops, fails)
	if len(short) != 3 || short[0] != ops[0] || short[1].Kind != OpRestart || short[2].Kind != OpDown {
		t.Fatalf("shrunk to %v", short)
	}
	if err == nil || err.Error() != "2 operations" {
		t.Fatalf("the shrunk list's failure: %v", err)
	}
}

// TestAdmissions_TheSlackIsTheOtherNodesUnitsSince: a node's slack counts
// what the other nodes admitted of the key after its view, never its own,
// nor another key's.
func TestAdmissions_TheSlackIsTheOtherNodesUnitsSince(t *testing.T) {
	a := admissions{}
	a.add(0, "k", 100, 2)
	a.add(1, "k", 200, 3)
	a.add(1, "other", 200, 7)
	a.add(2, "k", 300, 1)
	for _, tc := range []struct {
		node  int
		since int64
		want  int64
	}{{0, 0, 4}, {0, 250, 1}, {1, 0, 3}, {2, 150, 3}, {2, 300, 0}} {
		if got := a.others(tc.node, "k", tc.since); got != tc.want {
			t.Errorf("node %d since %d: slack %d, want %d", tc.node, tc.since, got, tc.want)
		}
	}
	// Admissions far older than any view are let go.
	a.add(0, "k", 10_000, 1)
	if len(a["k"]) != 1 {
		t.Fatalf("%d admissions kept, want the newest alone", len(a["k"]))
	}
}
