package sim

import (
	"math/rand/v2"
	"testing"
)

// TestQueue_PopsByTimeThenByScheduleOrder: events come out in time order,
// and events of one millisecond in the order they were pushed, whatever
// order the heap holds them in: what keeps a run the same every time.
func TestQueue_PopsByTimeThenByScheduleOrder(t *testing.T) {
	var q queue
	rng := rand.New(rand.NewPCG(1, 2))
	const n = 2000
	for i := range n {
		q.push(rng.Int64N(50), evRequest, i) // many events share a millisecond
	}
	last := event{at: -1}
	for i := range n {
		e, ok := q.pop()
		if !ok {
			t.Fatalf("the queue ran dry after %d of %d events", i, n)
		}
		if e.at < last.at || (e.at == last.at && e.idx <= last.idx) {
			t.Fatalf("event %d (at %d, pushed %d) came after one at %d, pushed %d", i, e.at, e.idx, last.at, last.idx)
		}
		last = e
	}
	if _, ok := q.pop(); ok {
		t.Fatal("an event left in an emptied queue")
	}
}
