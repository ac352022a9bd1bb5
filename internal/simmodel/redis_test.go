package simmodel

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/propagation"
)

var bg = context.Background()

// clock is a settable simulated clock.
type clock struct{ ms int64 }

func (c *clock) now() int64 { return c.ms }

var key = engine.Key{Namespace: "z", Identifier: "k", Window: time.Minute}

func TestRedis_WritesRaiseAbsoluteTotals(t *testing.T) {
	clk := &clock{ms: 60_000}
	r := NewRedis(clk.now, 1, Link{}, DefaultTimeouts)
	a, b := r.Origin("a"), r.Origin("b")
	flush := func(o engine.Origin, own int64) engine.Totals {
		d := []engine.Delta{{Key: key, Sequence: 1, Incarnation: 1, Own: own}}
		if err := o.Flush(bg, d); err != nil || !d[0].Done {
			t.Fatalf("flush: %v, done %v", err, d[0].Done)
		}
		return d[0].Totals
	}
	flush(a, 5)
	flush(a, 5) // a replay of the same total is a no-op
	got := flush(b, 3)
	if got.Cur != 8 || got.Mine != 3 || !got.Shared {
		t.Fatalf("totals %+v, want cur 8, mine 3, shared", got)
	}
	if c := r.Cost(); c.Calls != 3 || c.Flushes != 3 {
		t.Fatalf("cost %+v, want 3 calls", c)
	}
}

func TestRedis_ReserveWeighsImportedCounts(t *testing.T) {
	clk := &clock{ms: 60_000}
	r := NewRedis(clk.now, 1, Link{}, DefaultTimeouts)
	o := r.Origin("a")
	if err := o.Flush(bg, []engine.Delta{{Key: key, Sequence: 1, Incarnation: 1, Own: 6}}); err != nil {
		t.Fatal(err)
	}
	tick := &Tick{}
	tick.Begin(clk.ms)
	if err := r.Region("a", tick).Import(bg, []propagation.RegionImport{{Cell: propagation.Cell{Namespace: "z", Identifier: "k", WindowMs: 60_000, Sequence: 1}, Count: 3}}); err != nil {
		t.Fatal(err)
	}
	res := &engine.Reservation{Key: key, Sequence: 1, Incarnation: 1, Own: 6, Cost: 1, Joined: []int64{1}, Limit: 10, Elapsed: 1000}
	if err := o.Reserve(bg, res); err != nil {
		t.Fatal(err)
	}
	if !res.Admitted || res.JoinedAdmitted[0] || res.Totals.Cur != 7 || res.Totals.Global != 3 {
		t.Fatalf("reservation %+v: want the first admitted (6 + 3 + 1 = 10), the second not, cur 7, global 3", res)
	}
}

func TestRedis_DownFailsEveryCall(t *testing.T) {
	clk := &clock{ms: 60_000}
	r := NewRedis(clk.now, 1, Link{Outages: []Span{{From: 60_000, To: 61_000}}}, DefaultTimeouts)
	o := r.Origin("a")
	if _, err := o.Read(bg, key, 1, 1); !errors.Is(err, ErrDown) {
		t.Fatalf("read during an outage: %v", err)
	}
	clk.ms = 61_000
	if _, err := o.Read(bg, key, 1, 1); err != nil {
		t.Fatalf("read after the outage: %v", err)
	}
	if c := r.Cost(); c.Calls != 1 {
		t.Fatalf("%d calls counted, want the one that reached Redis", c.Calls)
	}
}

// TestRedis_AMarkedCellTakesItsOwnExpiryFromItsFirstWrite: a late write
// marks the next cell, which then expires with the late cell, as the
// scripts leave it; the first write of the cell's own, a process's or an
// import, gives it the cell's expiry, as the scripts treat a hash without
// t as new. Before the fix an import kept the mark's, a window early.
func TestRedis_AMarkedCellTakesItsOwnExpiryFromItsFirstWrite(t *testing.T) {
	clk := &clock{ms: 60_000}
	r := NewRedis(clk.now, 1, Link{}, DefaultTimeouts)
	late := []engine.Delta{{Key: key, Sequence: 1, Incarnation: 1, Own: 2, Late: true}}
	if err := r.Origin("a").Flush(bg, late); err != nil || !late[0].Done {
		t.Fatalf("flush: %v", err)
	}
	next := CellID{key, 2}
	if h, ok := r.Cell(next); !ok || h.Expires != expireAt(key, 1) {
		t.Fatalf("the marked cell %+v (%v), want the late cell's expiry %d", h, ok, expireAt(key, 1))
	}
	r.mu.Lock()
	r.sendImport(clk.ms, next, 3)
	r.mu.Unlock()
	if h, ok := r.Cell(next); !ok || h.G != 3 || h.Expires != expireAt(key, 2) {
		t.Fatalf("after an import the cell is %+v (%v), want g 3 and its own expiry %d", h, ok, expireAt(key, 2))
	}
}
