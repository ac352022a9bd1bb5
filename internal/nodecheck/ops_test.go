package nodecheck

import (
	"reflect"
	"strings"
	"testing"
)

// TestGen_OneSeedOneList: a seed draws the same list every time, headed
// by the node count (2 to 5 nodes), with the operations asked for, on
// nodes of the list and keys of Keys, a batch on two keys.
func TestGen_OneSeedOneList(t *testing.T) {
	for seed := uint64(1); seed <= 20; seed++ {
		ops := Gen(seed, 500, AllFaults)
		if !reflect.DeepEqual(ops, Gen(seed, 500, AllFaults)) {
			t.Fatalf("seed %d drew two lists", seed)
		}
		n := Nodes(ops)
		if len(ops) != 501 || ops[0].Kind != OpTick || n < 2 || n > 5 {
			t.Fatalf("seed %d: %d operations, header %+v", seed, len(ops), ops[0])
		}
		for i, o := range ops[1:] {
			if o.Node < 0 || o.Node >= n || o.Key < 0 || o.Key >= len(Keys) || o.Cost < 0 || (o.Cost > maxCost && o.Cost != hugeCost) ||
				(o.Kind == OpLimit) != (o.Limit > 0) {
				t.Fatalf("seed %d, operation %d: %+v", seed, i+1, o)
			}
			if o.Kind == OpBatch && o.Key == o.Key2 {
				t.Fatalf("seed %d, operation %d: a batch of one key twice", seed, i+1)
			}
		}
	}
	if reflect.DeepEqual(Gen(1, 100, AllFaults), Gen(2, 100, AllFaults)) {
		t.Fatal("seeds 1 and 2 drew one list")
	}
}

// TestGen_OnlyTheFaultsAskedFor: a list for a real origin holds none of
// the faults it cannot do; a list with all of them holds each.
func TestGen_OnlyTheFaultsAskedFor(t *testing.T) {
	count := func(ops []Op) map[Kind]int {
		n := map[Kind]int{}
		for _, o := range ops[1:] {
			n[o.Kind]++
		}
		return n
	}
	none := count(Gen(7, 5000, Faults{More: true}))
	if none[OpRestart]+none[OpDown]+none[OpStep]+none[OpDetach]+none[OpReset]+none[OpLimit]+none[OpFlush]+none[OpStepBack] != 0 || none[OpDecide] == 0 || none[OpRenew] == 0 {
		t.Fatalf("no faults asked for: %v", none)
	}
	all := count(Gen(7, 5000, AllFaults))
	for k := OpDecide; k <= OpStepBack; k++ {
		if all[k] == 0 {
			t.Errorf("no %s in 5000 operations", Op{Kind: k})
		}
	}
	// Resets are drawn apart: without them a seed's list is the one it
	// made before they were, so a seed that found a defect still runs it.
	noResets := AllFaults
	noResets.Reset, noResets.More = false, false
	before := Gen(7, 5000, noResets)
	withResets := AllFaults
	withResets.More = false
	var kept []Op
	for _, o := range Gen(7, 5000, withResets) {
		if o.Kind != OpReset && o.Kind != OpLimit {
			kept = append(kept, o)
		}
	}
	if !reflect.DeepEqual(kept, before[:len(kept)]) {
		t.Error("drawing resets changed the other operations of the list")
	}
	// So are the operations added since (Faults.More).
	kept = nil
	for _, o := range Gen(7, 5000, AllFaults) {
		switch {
		case o.Kind == OpFlush, o.Kind == OpRenew, o.Kind == OpStepBack, o.Key == twinKey, o.Cost == hugeCost:
		default:
			kept = append(kept, o)
		}
	}
	if all := Gen(7, 5000, withResets); !reflect.DeepEqual(kept, all[:len(kept)]) {
		t.Error("drawing the added operations changed the others of the list")
	}
}

// TestOp_StringNamesEveryKind: every operation reads as a sentence in a
// failure's list, naming its node and keys.
func TestOp_StringNamesEveryKind(t *testing.T) {
	for k := OpDecide; k <= OpStepBack; k++ {
		if s := (Op{Kind: k, Node: 3, Key: 1, Key2: 2, Cost: 2}).String(); s == "?" || s == "" {
			t.Errorf("kind %d reads %q", k, s)
		}
	}
	if s := (Op{Kind: OpBatch, Node: 3, Key: 1, Key2: 2, Cost: 2, Cost2: 1}).String(); s != "node 3 decides h1 cost 2 and h2 cost 1 together" {
		t.Errorf("a batch reads %q", s)
	}
	if s := Describe([]Op{{Kind: OpTick, Node: 1}, {Kind: OpRestart}}, nil); !strings.Contains(s, "2 nodes, 1 operations") || !strings.Contains(s, "1: the origin restarts empty") {
		t.Errorf("describe: %q", s)
	}
}
