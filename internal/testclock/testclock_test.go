package testclock

import (
	"testing"
	"time"
)

func TestFreshWindow_CurrentWindowJustBegan(t *testing.T) {
	for _, now := range []time.Time{
		time.UnixMilli(1_795_465_476_205),
		time.UnixMilli(1_700_000_000_000 + 59_999),
		time.UnixMilli(1_800_000_000_001),
	} {
		w, ok := FreshWindow(now, 60*time.Second, 120*time.Second, 30*time.Second)
		if !ok {
			t.Fatalf("%v: no window", now)
		}
		if w < 60*time.Second || w > 120*time.Second || w%time.Second != 0 {
			t.Fatalf("%v: window %v outside [60s, 120s] or not whole seconds", now, w)
		}
		ms := now.UnixMilli()
		elapsed := time.Duration(ms%w.Milliseconds()) * time.Millisecond
		if w-elapsed < 30*time.Second {
			t.Fatalf("%v: window %v has %v left, want at least 30s", now, w, w-elapsed)
		}
		// No other length in the range began more recently.
		for o := 60 * time.Second; o <= 120*time.Second; o += time.Second {
			e := time.Duration(ms%o.Milliseconds()) * time.Millisecond
			if o-e >= 30*time.Second && e < elapsed {
				t.Fatalf("%v: window %v began %v ago, but %v began %v ago", now, w, elapsed, o, e)
			}
		}
	}
	if _, ok := FreshWindow(time.UnixMilli(59_000), 60*time.Second, 60*time.Second, 30*time.Second); ok {
		t.Fatal("a window with 1 s left was offered for a need of 30 s")
	}
}
