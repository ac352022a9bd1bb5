package engine

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

func TestStrict_DenialMakesNoOriginCallAndRolloverReserves(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	l := lim("k", time.Minute, 10, 1)
	o.add(l.Key, clk.UnixMilli()/60_000, 1) // shared from the first read
	for i := 0; i < 9; i++ {
		if !e.Decide(bg, l).Allowed {
			t.Fatal("denied below the limit")
		}
	}
	clk.Set(time.UnixMilli(epoch + 50_000))
	reads, reserves := o.reads.Load(), o.reserves.Load()
	for i := 0; i < 100; i++ {
		if e.Decide(bg, l).Allowed {
			t.Fatal("allowed over the limit")
		}
	}
	if o.reads.Load() != reads || o.reserves.Load() != reserves || o.flushes.Load() != 0 {
		t.Fatalf("denials called the origin: reads %d→%d, reserves %d→%d, flushes %d",
			reads, o.reads.Load(), reserves, o.reserves.Load(), o.flushes.Load())
	}
	ks, _ := e.Inspect(l.Key)
	wantUntil := time.UnixMilli(epoch + 110_000)
	if !ks.StrictUntil.Equal(wantUntil) {
		t.Fatalf("strict until %v, want one window after the last denial, %v", ks.StrictUntil, wantUntil)
	}
	// Next window, three quarters in: the previous cell weighs ⌊2.5⌋, so a
	// request would pass locally; strict mode sends it to the origin.
	clk.Set(time.UnixMilli(epoch + 60_000 + 45_000))
	if _, err := e.ReplayOnce(bg, Fast); err != nil {
		t.Fatal(err)
	}
	if _, err := replayBoth(e); err != nil {
		t.Fatal(err)
	}
	// A look at the key (cost 0) reads the stale shared cell; another
	// node's traffic reaches the origin after that read.
	peek := l
	peek.Cost = 0
	e.Decide(bg, peek)
	o.add(l.Key, clk.UnixMilli()/60_000, 8)
	reserves = o.reserves.Load()
	if d := e.Decide(bg, l); d.Allowed {
		t.Fatalf("strict mode did not ask the origin: %+v", d)
	}
	if o.reserves.Load() != reserves+1 {
		t.Fatalf("reservations = %d, want one", o.reserves.Load()-reserves)
	}
}

func TestStrict_DeadlinesAreBoundedByMaxEntries(t *testing.T) {
	e, _, _ := withOrigin(t, Config{MaxEntries: 10})
	for i := 0; i < 100; i++ {
		l := lim(strings.Repeat("x", i+1), time.Minute, 0, 1)
		if e.Decide(bg, l).Allowed {
			t.Fatal("a zero limit admitted")
		}
	}
	if n := len(e.StrictKeys()); n > 10 {
		t.Fatalf("%d strict deadlines, want at most MaxEntries = 10", n)
	}
}

// TestStrict_ADeadlineFromAClockAheadLapsesWhenTheClockComesBack: a key
// denied while the clock ran an hour ahead (an NTP step, a resumed VM, the
// second before a heartbeat measured Redis's clock again) got a strict
// deadline an hour ahead. Once the clock came back, its cell from the
// future was replaced (stale), but the deadline held: for the hour, every
// request of the shared key that would pass went to the origin first, a
// round trip a request, as if it had just been denied.
func TestStrict_ADeadlineFromAClockAheadLapsesWhenTheClockComesBack(t *testing.T) {
	e, clk, o := withOrigin(t, Config{})
	start := clk.Now()
	seq := clk.UnixMilli() / 60_000
	k, c := lim("k", time.Minute, 100, 1), lim("c", time.Minute, 100, 1)
	for _, l := range []Limit{k, c} {
		o.add(l.Key, seq, 10) // shared from the first read
	}
	// An hour ahead, another process took k to its limit; this one is denied.
	clk.Set(start.Add(time.Hour))
	o.add(k.Key, clk.UnixMilli()/60_000, 100)
	if e.Decide(bg, k).Allowed {
		t.Fatal("admitted over the limit an hour ahead")
	}
	clk.Set(start.Add(time.Second))
	for _, l := range []Limit{k, c} {
		if !e.Decide(bg, l).Allowed {
			t.Fatalf("%s denied at 11 of 100", l.Identifier)
		}
	}
	replayAll(t, e)
	count := func(l Limit) int64 {
		before := o.reserves.Load() + o.reads.Load()
		for range 20 {
			if !e.Decide(bg, l).Allowed {
				t.Fatalf("%s denied below the limit", l.Identifier)
			}
		}
		return o.reserves.Load() + o.reads.Load() - before
	}
	if nc, nk := count(c), count(k); nk > nc {
		t.Fatalf("the key denied an hour ahead made %d origin calls in 20 requests, the same key never denied %d", nk, nc)
	}
	if ks, _ := e.Inspect(k.Key); !ks.StrictUntil.IsZero() {
		t.Fatalf("strict until %v, an hour ahead of the clock", ks.StrictUntil)
	}
}

// TestEvict_TakesTheKeysStrictDeadline: an audit's case (2026-11-29).
// Strict deadlines are capped at MaxEntries, and a zone of a long window
// (a signup limit of 1 per 30 days) holds its deadlines for a month:
// once its denied keys filled the cap, evicting them kept their deadlines,
// and a key denied at its limit in any other zone got no strict mode,
// silently, for as long as the month lasted. The deadlines go with the
// keys an eviction takes, so the cap binds only when every key is in
// strict mode.
func TestEvict_TakesTheKeysStrictDeadline(t *testing.T) {
	e, clk, _ := withOrigin(t, Config{MaxEntries: 100})
	for i := range 100 {
		l := lim(fmt.Sprintf("ip%d", i), 30*24*time.Hour, 1, 1)
		l.Key.Namespace = "signup"
		e.Decide(bg, l)
		if e.Decide(bg, l).Allowed { // denied at the limit: strict for 30 days
			t.Fatalf("signup %d: a second request admitted at a limit of 1", i)
		}
	}
	if n := len(e.StrictKeys()); n != 100 {
		t.Fatalf("%d keys in strict mode after 100 denials; want 100", n)
	}
	clk.Advance(10 * time.Minute)
	api := lim("key-alice", time.Minute, 10, 1)
	api.Key.Namespace = "api"
	for range 5 { // heavier than any signup key: an eviction takes those first
		e.Decide(bg, api)
	}
	if n := e.Evict(); n == 0 { // as the janitor does when an insert passes the cap
		t.Fatal("nothing evicted past the cap")
	}
	if n, live := len(e.StrictKeys()), e.Stats().Entries; int64(n) > live {
		t.Errorf("%d keys in strict mode beside %d entries: an evicted key kept its deadline", n, live)
	}
	for range 6 {
		e.Decide(bg, api) // the sixth is denied
	}
	if ks, _ := e.Inspect(api.Key); ks.StrictUntil.IsZero() {
		t.Errorf("a key denied at its limit in a one-minute zone is in no strict mode: the 30-day zone's %d deadlines hold the cap", len(e.StrictKeys()))
	}
	// An evicted signup key comes back denied: its read brings the count.
	back := lim("ip0", 30*24*time.Hour, 1, 1)
	back.Key.Namespace = "signup"
	for i := range 100 {
		back.Key.Identifier = fmt.Sprintf("ip%d", i)
		if e.Decide(bg, back).Allowed {
			t.Fatalf("signup ip%d admitted again after its eviction", i)
		}
	}
}
