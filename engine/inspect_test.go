package engine

import (
	"testing"
	"time"
)

func TestScan_KeepsTheFirstKeysInOrder(t *testing.T) {
	e, _ := newTestEngine(t, manual(Config{}))
	ids := []string{"m", "c", "x", "a", "q", "b", "z", "d"}
	for _, id := range ids {
		e.Decide(bg, lim(id, time.Minute, 10, 1))
		e.Decide(bg, lim(id, time.Hour, 10, 1))
	}
	got := e.Scan("zone", "", 5)
	want := []Key{{"zone", "a", time.Minute}, {"zone", "a", time.Hour}, {"zone", "b", time.Minute}, {"zone", "b", time.Hour}, {"zone", "c", time.Minute}}
	if len(got) != len(want) {
		t.Fatalf("Scan returned %d keys, want %d", len(got), len(want))
	}
	for i := range want {
		if got[i].Key != want[i] {
			t.Fatalf("Scan[%d] = %v, want %v", i, got[i].Key, want[i])
		}
	}
	if all := e.Scan("zone", "", -1); len(all) != 2*len(ids) {
		t.Fatalf("Scan(-1) returned %d keys, want %d", len(all), 2*len(ids))
	}
}
