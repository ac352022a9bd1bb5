package origin

import (
	"math"
	"testing"
	"time"
)

// TestSchedWatch_P99CountsOnlyTheWakeUpsSinceTheLastLook: the scheduler's
// histogram is cumulative, so the percentile that decides whether this
// process was starved is that of the wake-ups since the previous look.
func TestSchedWatch_P99CountsOnlyTheWakeUpsSinceTheLastLook(t *testing.T) {
	// Buckets: below 0, [0, 1ms), [1ms, 10ms), [10ms, 100ms), [100ms, ∞).
	buckets := []float64{math.Inf(-1), 0, 0.001, 0.01, 0.1, math.Inf(1)}
	for _, tc := range []struct {
		name         string
		prev, counts []uint64
		want         time.Duration
	}{
		{"nothing new", []uint64{0, 5, 5, 5, 5}, []uint64{0, 5, 5, 5, 5}, 0},
		{"all fast", []uint64{0, 0, 0, 0, 0}, []uint64{0, 100, 0, 0, 0}, 0},
		{"one slow in a hundred", []uint64{0, 0, 0, 0, 0}, []uint64{0, 99, 0, 0, 1}, 0},
		{"two slow in a hundred", []uint64{0, 0, 0, 0, 0}, []uint64{0, 98, 0, 2, 0}, 10 * time.Millisecond},
		{"old slow wake-ups forgotten", []uint64{0, 0, 0, 0, 50}, []uint64{0, 100, 0, 0, 50}, 0},
		{"new slow wake-ups counted", []uint64{0, 100, 0, 0, 0}, []uint64{0, 100, 100, 0, 0}, time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := p99Since(tc.prev, tc.counts, buckets); got != tc.want {
				t.Fatalf("p99Since = %s, want %s", got, tc.want)
			}
		})
	}
}

// TestSchedWatch_TheFirstLookCountsSinceTheProcessStarted: a process's
// first slow calls came with no earlier look to subtract, and read as not
// starved whatever the histogram said.
func TestSchedWatch_TheFirstLookCountsSinceTheProcessStarted(t *testing.T) {
	buckets := []float64{math.Inf(-1), 0, 0.001, 0.01, 0.1, math.Inf(1)}
	var w schedWatch
	w.took([]uint64{0, 10, 0, 90, 0}, buckets)
	if w.p99 != 10*time.Millisecond {
		t.Fatalf("first look: p99 %s, want 10ms (90 of 100 wake-ups waited 10 ms and more)", w.p99)
	}
	w.took([]uint64{0, 110, 0, 90, 0}, buckets)
	if w.p99 != 0 {
		t.Fatalf("second look: p99 %s, want 0 (only fast wake-ups since the first)", w.p99)
	}
}
