package nodecheck

import (
	"flag"
	"os"
	"testing"
	"testing/synctest"
	"time"
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
