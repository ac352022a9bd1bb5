package simmodel

import (
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/propagation"
)

func TestRegion_LeasePassesWhenItLapses(t *testing.T) {
	clk := &clock{ms: 60_000}
	r := NewRedis(clk.now, 1, Link{}, DefaultTimeouts)
	a, b := r.Region("a", nil), r.Region("b", nil)
	if h, _ := a.Lease(bg, time.Second); h != "a" {
		t.Fatalf("a took %q", h)
	}
	if h, _ := b.Lease(bg, time.Second); h != "a" {
		t.Fatalf("b sees %q, want a", h)
	}
	clk.ms += 1000
	if h, _ := b.Lease(bg, time.Second); h != "b" {
		t.Fatalf("after the lease lapsed b sees %q, want b", h)
	}
}

func TestRegion_ImportLandsWhenTheCallArrives(t *testing.T) {
	clk := &clock{ms: 60_000}
	r := NewRedis(clk.now, 1, Link{Latency: Dist{Median: 40}}, DefaultTimeouts)
	tick := &Tick{}
	tick.Begin(clk.ms)
	tick.Elapsed = 100 // the iteration's earlier calls
	cell := propagation.Cell{Namespace: "z", Identifier: "k", WindowMs: 60_000, Sequence: 1}
	if err := r.Region("a", tick).Import(bg, []propagation.RegionImport{{Cell: cell, Count: 4}}); err != nil {
		t.Fatal(err)
	}
	id := CellID{key, 1}
	clk.ms = 60_119
	if h, _ := r.Cell(id); h.G != 0 {
		t.Fatalf("imported %d before the call arrived", h.G)
	}
	clk.ms = 60_120
	if h, _ := r.Cell(id); h.G != 4 {
		t.Fatalf("imported %d when the call arrived, want 4", h.G)
	}
	if tick.At() != 60_140 {
		t.Fatalf("the iteration reached %d, want 60140", tick.At())
	}
}

// TestRegion_TakeRegisteredReadsTheQueueOrTheWholeRegistry: the holder's
// usual take returns what was registered since the last one, once, in
// cell order; a whole take returns every live registration and deletes the
// expired ones. A registration made again unchanged is not queued again.
func TestRegion_TakeRegisteredReadsTheQueueOrTheWholeRegistry(t *testing.T) {
	clk := &clock{ms: 60_000}
	r := NewRedis(clk.now, 1, Link{}, DefaultTimeouts)
	reg := r.Region("a", nil)
	cell := func(id string, expires int64) propagation.RegionCell {
		return propagation.RegionCell{Cell: propagation.Cell{Namespace: "z", Identifier: id, WindowMs: 60_000, Sequence: 1}, Limit: 10, Expires: expires}
	}
	b, a := cell("b", 90_000), cell("a", 70_000)
	ids := func(all bool, now int64) string {
		rcs, err := reg.TakeRegistered(bg, all, now)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, rc := range rcs {
			out = append(out, rc.Identifier)
		}
		return strings.Join(out, " ")
	}
	if err := reg.Register(bg, []propagation.RegionCell{b, a}); err != nil {
		t.Fatal(err)
	}
	if got := ids(false, 60_000); got != "a b" {
		t.Fatalf("queued: %q, want a b", got)
	}
	if err := reg.Register(bg, []propagation.RegionCell{a}); err != nil {
		t.Fatal(err)
	}
	if got := ids(false, 60_000); got != "" {
		t.Fatalf("queued again after an unchanged registration: %q, want none", got)
	}
	if got := ids(true, 80_000); got != "b" || r.Registered(a.Cell) || !r.Registered(b.Cell) {
		t.Fatalf("whole take at 80000: %q, a registered %v; want b alone, a deleted", got, r.Registered(a.Cell))
	}
}

// TestRegion_HolderTakesTheRegionsOverridesEachFlush: the real region
// (mysql_region.go) carries overrides (propagation.OverrideRegion), and
// the holder takes the region's queue of changes on every flush: one
// script call (EVALSHA and its LRANGE), or on taking the role a pipeline
// of GET and HGETALL. The model keeps none, but the calls are made.
func TestRegion_HolderTakesTheRegionsOverridesEachFlush(t *testing.T) {
	clk := &clock{ms: 60_000}
	r := NewRedis(clk.now, 1, Link{}, DefaultTimeouts)
	reg, ok := r.Region("a", nil).(propagation.OverrideRegion)
	if !ok {
		t.Fatal("the model's region carries no overrides: the real holder takes them from Redis every flush")
	}
	if rows, err := reg.TakeOverrides(bg, false); err != nil || len(rows) != 0 {
		t.Fatalf("take: %v, %v", rows, err)
	}
	if c := r.Cost(); c.Calls != 1 || c.Role != 1 || c.Processed != 2 {
		t.Fatalf("cost of a take %+v: want one call, two commands run", c)
	}
	if _, err := reg.TakeOverrides(bg, true); err != nil {
		t.Fatal(err)
	}
	if c := r.Cost(); c.Calls != 3 || c.Processed != 4 {
		t.Fatalf("cost after a whole take %+v: want two calls more, two commands", c)
	}
}
