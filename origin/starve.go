package origin

import (
	"math"
	"runtime/metrics"
	"sync"
	"time"
)

// A round trip measured in this process includes the time its goroutines
// wait to run. When the process is starved of CPU (a cold-key herd at a
// window rollover on one core), a healthy Redis looks slow, and counting
// those calls as slow would open the request path's breaker for nothing.
// So a slow call counts against the breaker only when the process itself
// was not starved: when the Go scheduler's recent wake-up latency (its 99th
// percentile since the last look) stays under half the slow-call
// threshold; and a call that timed out while goroutines waited 25 ms and
// more to run is excluded from the breaker's counts (breaker.go).

// schedSampleEvery bounds how often the scheduler's latency histogram is
// read: it is cumulative, so the latency of the last interval is a delta.
const schedSampleEvery = 50 * time.Millisecond

const schedLatencies = "/sched/latencies:seconds"

// schedWatch keeps the last look at the scheduler's latency histogram.
type schedWatch struct {
	mu     sync.Mutex
	at     time.Time
	prev   []uint64
	p99    time.Duration
	sample []metrics.Sample
}

var sched = &schedWatch{sample: []metrics.Sample{{Name: schedLatencies}}}

// starved reports whether goroutines of this process recently waited at
// least limit to run (at the 99th percentile).
func (w *schedWatch) starved(limit time.Duration) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if now := time.Now(); now.Sub(w.at) >= schedSampleEvery {
		w.at = now
		w.look()
	}
	return w.p99 >= limit
}

// look reads the histogram and computes the 99th percentile of the wake-ups
// since the previous look.
func (w *schedWatch) look() {
	metrics.Read(w.sample)
	if w.sample[0].Value.Kind() != metrics.KindFloat64Histogram {
		return
	}
	h := w.sample[0].Value.Float64Histogram()
	w.took(h.Counts, h.Buckets)
}

// took sets p99 from a reading of the histogram. The first reading has no
// previous one and counts every wake-up since the process started: it
// used to only keep the counts and read as not starved, so the first slow
// calls of a process, a cold herd on one core at its first window's turn,
// all counted against the breaker, and five of them in a row opened it on
// a healthy Redis (CI, TestRollover_ColdHerdOnOneCore…, 1 run in 4 with
// the machine's two cores busy).
func (w *schedWatch) took(counts []uint64, buckets []float64) {
	if len(w.prev) != len(counts) {
		w.prev = make([]uint64, len(counts))
	}
	w.p99 = p99Since(w.prev, counts, buckets)
	copy(w.prev, counts)
}

// p99Since is the 99th percentile of the wake-ups that the histogram
// (counts, buckets) counted since prev, at the lower bound of its bucket;
// 0 when there were none.
func p99Since(prev, counts []uint64, buckets []float64) time.Duration {
	var total uint64
	for i, c := range counts {
		total += c - prev[i]
	}
	if total == 0 {
		return 0
	}
	want := total - total/100 // the wake-up at the 99th percentile
	var acc uint64
	for i, c := range counts {
		acc += c - prev[i]
		if acc >= want {
			// buckets[i] is the bucket's lower bound.
			lo := buckets[i]
			if math.IsInf(lo, -1) {
				lo = 0
			}
			return time.Duration(lo * float64(time.Second))
		}
	}
	return 0 // not reached: acc ends at total
}
