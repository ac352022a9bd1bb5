package sim

// The event queue: a binary heap ordered by time, then by the order the
// events were scheduled in, so that events of one millisecond run in a
// fixed order.

// kind is what an event does.
type kind uint8

const (
	evRequest       kind = iota // the next request of a traffic source
	evReplay                    // the replay ticks of the nodes of one phase
	evFlush                     // a node's mysql_flush tick
	evGlobalSync                // a node's global_sync tick
	evBlocklistSync             // a node's blocklist_sync tick
	evCleanup                   // a node's cleanup tick
	evSweep                     // a node's janitor
	evWindow                    // a window ends: Redis expires, counts are checked
	evFault                     // a region's Redis comes back empty (Fault.Empty)
)

type event struct {
	at   int64 // Unix ms
	seq  uint64
	kind kind
	idx  int32 // the source, node, phase or fault
}

type queue struct {
	h   []event
	seq uint64
}

func (q *queue) push(at int64, k kind, idx int) {
	q.seq++
	q.h = append(q.h, event{at: at, seq: q.seq, kind: k, idx: int32(idx)})
	q.up(len(q.h) - 1)
}

func (q *queue) pop() (event, bool) {
	if len(q.h) == 0 {
		return event{}, false
	}
	e := q.h[0]
	last := len(q.h) - 1
	q.h[0] = q.h[last]
	q.h = q.h[:last]
	if last > 0 {
		q.down(0)
	}
	return e, true
}

func (a event) before(b event) bool {
	if a.at != b.at {
		return a.at < b.at
	}
	return a.seq < b.seq
}

func (q *queue) up(i int) {
	for i > 0 {
		p := (i - 1) / 2
		if !q.h[i].before(q.h[p]) {
			return
		}
		q.h[i], q.h[p] = q.h[p], q.h[i]
		i = p
	}
}

func (q *queue) down(i int) {
	n := len(q.h)
	for {
		l := 2*i + 1
		if l >= n {
			return
		}
		m := l
		if r := l + 1; r < n && q.h[r].before(q.h[l]) {
			m = r
		}
		if !q.h[m].before(q.h[i]) {
			return
		}
		q.h[i], q.h[m] = q.h[m], q.h[i]
		i = m
	}
}
