package engine

import (
	"slices"
	"testing"
	"time"
)

func TestZone_OnePerNamespaceAndWholeMillisecondWindow(t *testing.T) {
	e, _ := newTestEngine(t, Config{})
	z := e.Zone("api", time.Second)
	if z.Name() != "api" || z.Window() != time.Second {
		t.Fatalf("zone %q %v, want api 1s", z.Name(), z.Window())
	}
	for _, tc := range []struct {
		ns   string
		w    time.Duration
		same bool
	}{
		{"api", time.Second, true},
		{"api", time.Second + 999*time.Microsecond, true}, // truncated to whole milliseconds
		{"api", time.Second + time.Millisecond, false},
		{"web", time.Second, false},
	} {
		if got := e.Zone(tc.ns, tc.w) == z; got != tc.same {
			t.Errorf("Zone(%q, %v) is the first zone: %v, want %v", tc.ns, tc.w, got, tc.same)
		}
	}
}

func TestZone_WindowIsAtLeastAMillisecond(t *testing.T) {
	e, clk := newTestEngine(t, Config{})
	for _, w := range []time.Duration{0, -time.Second, 500 * time.Microsecond} {
		if got := e.Zone("z", w).Window(); got != time.Millisecond {
			t.Errorf("Zone(z, %v).Window() = %v, want 1ms", w, got)
		}
	}
	// Such a zone decides as a one-millisecond window.
	l := Limit{Key: Key{Namespace: "z", Identifier: "k"}, Limit: 1, Cost: 1}
	if !e.Decide(bg, l).Allowed || e.Decide(bg, l).Allowed {
		t.Fatal("a limit of 1 in a window of 0 did not admit exactly one request")
	}
	clk.Advance(2 * time.Millisecond)
	if !e.Decide(bg, l).Allowed {
		t.Fatal("denied two windows of a millisecond later")
	}
}

func TestZone_LookupMakesNoZone(t *testing.T) {
	e, _ := newTestEngine(t, Config{})
	key := Key{Namespace: "z", Identifier: "k", Window: time.Minute}
	if _, ok := e.lookupZone(key); ok {
		t.Fatal("found a zone nobody made")
	}
	if e.Forget(key) || e.HasEntry(key) {
		t.Fatal("a key of a zone nobody made was held")
	}
	if _, ok := e.lookupZone(key); ok {
		t.Fatal("a lookup made the zone")
	}
	z := e.Zone("z", time.Minute)
	if got, ok := e.lookupZone(key); !ok || got != z {
		t.Fatal("the zone made by Zone is not the one looked up")
	}
}

// TestZone_WindowsListsEveryWindowOfANamespace: the windows of the zones
// of one namespace the engine holds, in order, whatever else it holds (a
// reset takes effect in each: the root's resetWindows).
func TestZone_WindowsListsEveryWindowOfANamespace(t *testing.T) {
	e := New(Config{Manual: true})
	e.Zone("api", time.Minute)
	e.Zone("api", time.Second)
	e.Zone("other", time.Hour)
	if got := e.Windows("api"); !slices.Equal(got, []time.Duration{time.Second, time.Minute}) {
		t.Fatalf("windows of api: %v, want [1s 1m0s]", got)
	}
	if got := e.Windows("none"); len(got) != 0 {
		t.Fatalf("windows of a namespace never counted: %v", got)
	}
}
