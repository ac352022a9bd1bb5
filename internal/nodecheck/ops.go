// Package nodecheck is the multi-node reference test of the rate limiter:
// several engines of one region, sharing one origin, driven through a
// seeded random list of operations and faults, and checked against one
// central counter of everything admitted (see Run for the invariant).
//
// The engines and their origin are a Cluster: an in-memory one in this
// package's tests, real Redis processes in the integration tests. A failing
// list shrinks to the shortest one found that still fails (Shrink).
package nodecheck

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"
)

// The region's replay ticks, as the engine's defaults have them; a Cluster
// configures its engines with them.
const (
	FastTick = 10 * time.Millisecond
	SlowTick = 100 * time.Millisecond
)

const (
	fastMs = int64(FastTick / time.Millisecond)
	slowMs = int64(SlowTick / time.Millisecond)
	// flushPeriod is how long after a fault the bound must hold again:
	// the slow tick (the longest a unit waits for replay), a fast tick,
	// and the restart's detection (one slow tick, see OpRestart).
	flushPeriod = 2*slowMs + fastMs
	maxCost     = 3
	maxWindow   = int64(2000) // ms, the longest window of Keys
)

// Key is one key of a run, with its limit.
type Key struct {
	ID     string
	Window time.Duration
	Limit  int64
}

// Zone is the namespace of every key of a run.
const Zone = "z"

// Keys are the keys of a run: hot keys of small and larger limits on two
// window lengths, then cold keys (one request or few each).
var Keys = func() []Key {
	ks := []Key{
		{"h0", time.Second, 5}, {"h1", time.Second, 20}, {"h2", 2 * time.Second, 50},
		{"h3", 2 * time.Second, 100}, {"h4", time.Second, 1},
	}
	for i := 0; i < coldKeys; i++ {
		ks = append(ks, Key{"c" + strconv.Itoa(i), time.Second, 10})
	}
	// Last, h0's identifier on the other window length: a key of its own
	// (its own cells, limit and resets), drawn by Faults.More only.
	return append(ks, Key{"h0", 2 * time.Second, 8})
}()

// hotKeys is how many of Keys are hot, coldKeys how many cold; twinKey is
// the index of h0 on two seconds.
const (
	hotKeys  = 5
	coldKeys = 40
	twinKey  = hotKeys + coldKeys
)

// hugeCost is the largest cost a zone charges (2^53−1): a placeholder's
// cost is clamped to it at most.
const hugeCost = 1<<53 - 1

// Kind is what an operation does.
type Kind uint8

// The operations.
const (
	OpDecide   Kind = iota // a node decides a key at a cost
	OpBatch                // a node decides two keys together
	OpTick                 // the clock advances a fast tick; the replay ticks run
	OpForget               // a node forgets a key (the admin API's DELETE)
	OpEvict                // a node evicts past its entry cap
	OpSweep                // a node's janitor sweeps
	OpReload               // a node gets a new origin object of the same process
	OpStep                 // a node's clock steps an hour ahead, or back
	OpRestart              // the origin restarts empty
	OpDown                 // the origin becomes unreachable, or reachable again
	OpDetach               // a node's reload takes the origin out, or puts it back
	OpReset                // a node resets a key for the region (the admin API's scope=region)
	OpLimit                // an operator changes a key's limit (a runtime override), or restores it
	OpFlush                // an operator's FLUSHALL empties the origin, which keeps running
	OpRenew                // a node's process restarts: a new process (node ID) with no state
	OpStepBack             // a node's clock steps an hour back, or forward again
)

// Op is one operation; its fields are read by its kind.
type Op struct {
	Kind        Kind
	Node        int
	Key, Key2   int
	Cost, Cost2 int64
	// Limit is an OpLimit's new limit.
	Limit int64
}

func (o Op) String() string {
	switch o.Kind {
	case OpDecide:
		return fmt.Sprintf("node %d decides %s cost %d", o.Node, Keys[o.Key].name(), o.Cost)
	case OpBatch:
		return fmt.Sprintf("node %d decides %s cost %d and %s cost %d together", o.Node, Keys[o.Key].ID, o.Cost, Keys[o.Key2].ID, o.Cost2)
	case OpTick:
		return fmt.Sprintf("the clock advances %d ms (replay ticks)", fastMs)
	case OpForget:
		return fmt.Sprintf("node %d forgets %s", o.Node, Keys[o.Key].name())
	case OpEvict:
		return fmt.Sprintf("node %d evicts past its entry cap", o.Node)
	case OpSweep:
		return fmt.Sprintf("node %d's janitor sweeps", o.Node)
	case OpReload:
		return fmt.Sprintf("node %d reloads (a new origin object of the same process)", o.Node)
	case OpStep:
		return fmt.Sprintf("node %d's clock steps an hour forward, or back", o.Node)
	case OpRestart:
		return "the origin restarts empty"
	case OpDown:
		return "the origin becomes unreachable, or reachable again"
	case OpDetach:
		return fmt.Sprintf("node %d reloads without the origin, or with it again", o.Node)
	case OpReset:
		return fmt.Sprintf("node %d resets %s for the region", o.Node, Keys[o.Key].name())
	case OpLimit:
		return fmt.Sprintf("an operator sets %s's limit to %d", Keys[o.Key].ID, o.Limit)
	case OpFlush:
		return "an operator flushes the origin (FLUSHALL)"
	case OpRenew:
		return fmt.Sprintf("node %d's process restarts (a new process ID)", o.Node)
	case OpStepBack:
		return fmt.Sprintf("node %d's clock steps an hour back, or forward again", o.Node)
	}
	return "?"
}

// Faults selects the faults a list may hold: a real origin cannot do all
// that the in-memory one does cheaply.
type Faults struct {
	Restart, Down, Step, Detach bool
	// Reset draws operators' actions too, region resets and limit changes
	// (OpReset, OpLimit: actions, not faults, drawn apart so that a list
	// without them is the one its seed made before they were).
	Reset bool
	// More draws the operations added since, from a stream of their own
	// (so that a list without them is the one its seed made before): an
	// operator's FLUSHALL (with Restart), a node's process restarted, a
	// node's clock an hour back (with Step), h0's identifier decided,
	// forgotten and reset (with Reset) on a second window length, and
	// costs of 2^53−1.
	More bool
}

// AllFaults is every fault, and resets.
var AllFaults = Faults{Restart: true, Down: true, Step: true, Detach: true, Reset: true, More: true}

// name is the key's identifier and window, as the runner tells keys
// apart: h0 is on two windows.
func (k Key) name() string {
	if k.Window == time.Second {
		return k.ID
	}
	return k.ID + "/" + k.Window.String()
}

// Gen draws n operations from seed. The list starts with a tick whose node
// is the number of nodes less one (2 to 5 nodes), so a shrunk list keeps
// its node count.
func Gen(seed uint64, n int, faults Faults) []Op {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	// Resets come from a stream of their own: a list without them is the
	// list a seed made before they were drawn.
	resets := rand.New(rand.NewPCG(seed^0x7265736574, seed))
	more := rand.New(rand.NewPCG(seed^0x6d6f7265, seed))
	nodes := 2 + rng.IntN(4)
	ops := make([]Op, 0, n+1)
	ops = append(ops, Op{Kind: OpTick, Node: nodes - 1})
	cost := func() int64 {
		if rng.IntN(20) == 0 {
			return 0
		}
		return 1 + rng.Int64N(maxCost)
	}
	key := func() int {
		if rng.IntN(4) == 0 {
			return hotKeys + rng.IntN(coldKeys) // cold
		}
		return rng.IntN(hotKeys)
	}
	for len(ops) <= n {
		o := Op{Node: rng.IntN(nodes)}
		switch r := rng.IntN(1000); {
		case r < 640:
			o.Kind, o.Key, o.Cost = OpDecide, key(), cost()
		case r < 680:
			o.Kind, o.Key, o.Cost, o.Key2, o.Cost2 = OpBatch, key(), cost(), key(), cost()
			if o.Key == o.Key2 {
				continue
			}
		case r < 950:
			o.Kind = OpTick
		case r < 962:
			o.Kind, o.Key = OpForget, rng.IntN(hotKeys)
		case r < 970:
			o.Kind = OpEvict
		case r < 975:
			o.Kind = OpSweep
		case r < 978:
			o.Kind = OpReload
		case r < 982:
			if !faults.Detach {
				continue
			}
			o.Kind = OpDetach
		case r < 988:
			if !faults.Step {
				continue
			}
			o.Kind = OpStep
		case r < 993:
			if !faults.Restart {
				continue
			}
			o.Kind = OpRestart
		default:
			if !faults.Down {
				continue
			}
			o.Kind = OpDown
		}
		ops = append(ops, o)
		if faults.More && len(ops) <= n {
			node := more.IntN(nodes)
			switch x := more.IntN(1000); {
			case x < 3:
				if faults.Restart {
					ops = append(ops, Op{Kind: OpFlush})
				}
			case x < 6:
				ops = append(ops, Op{Kind: OpRenew, Node: node})
			case x < 9:
				if faults.Step {
					ops = append(ops, Op{Kind: OpStepBack, Node: node})
				}
			case x < 50:
				ops = append(ops, Op{Kind: OpDecide, Node: node, Key: twinKey, Cost: 1 + more.Int64N(maxCost)})
			case x < 54:
				ops = append(ops, Op{Kind: OpDecide, Node: node, Key: more.IntN(hotKeys), Cost: hugeCost})
			case x < 57:
				ops = append(ops, Op{Kind: OpForget, Node: node, Key: twinKey})
			case x < 60:
				if faults.Reset {
					ops = append(ops, Op{Kind: OpReset, Node: node, Key: twinKey})
				}
			}
		}
		if !faults.Reset || len(ops) > n {
			continue
		}
		switch x := resets.IntN(1000); {
		case x < 6:
			ops = append(ops, Op{Kind: OpReset, Node: resets.IntN(nodes), Key: resets.IntN(hotKeys)})
		case x < 10:
			// Half the Caddyfile's limit, the same (the override removed),
			// or twice it; never 0, which blocks every request, cost 0 too.
			k := resets.IntN(hotKeys)
			l := [3]int64{max(Keys[k].Limit/2, 1), Keys[k].Limit, 2 * Keys[k].Limit}[resets.IntN(3)]
			ops = append(ops, Op{Kind: OpLimit, Key: k, Limit: l})
		}
	}
	return ops
}

// Nodes is the number of nodes of a list made by Gen.
func Nodes(ops []Op) int { return ops[0].Node + 1 }
