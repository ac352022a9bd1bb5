package engine

import (
	"context"
	"strings"
	"testing"
	"time"
)

// partedOrigin is a memOrigin on two partitions, as several redis lines
// make: keys whose identifier begins with "dead" live on partition 1,
// which fails every call, the others on partition 0, which answers.
type partedOrigin struct {
	*memOrigin
}

func (p *partedOrigin) Partitions() int { return 2 }

func (p *partedOrigin) Partition(key Key) int {
	if strings.HasPrefix(key.Identifier, "dead") {
		return 1
	}
	return 0
}

func (p *partedOrigin) Read(ctx context.Context, key Key, seq int64, inc uint32) (Totals, error) {
	if p.Partition(key) == 1 {
		p.reads.Add(1)
		return Totals{}, errOriginDown
	}
	return p.memOrigin.Read(ctx, key, seq, inc)
}

func (p *partedOrigin) Reserve(ctx context.Context, r *Reservation) error {
	if p.Partition(r.Key) == 1 {
		p.reserves.Add(1)
		return errOriginDown
	}
	return p.memOrigin.Reserve(ctx, r)
}

// Flush writes the live partition's items and leaves the dead one's not
// Done, as the Redis origin's Flush does with one endpoint down.
func (p *partedOrigin) Flush(ctx context.Context, batch []Delta) error {
	var live []Delta
	var at []int
	for i := range batch {
		if p.Partition(batch[i].Key) == 0 {
			live, at = append(live, batch[i]), append(at, i)
		}
	}
	err := p.memOrigin.Flush(ctx, live)
	for j, i := range at {
		batch[i].Totals, batch[i].Done = live[j].Totals, live[j].Done
	}
	if err == nil && len(live) < len(batch) {
		err = errOriginDown
	}
	return err
}

func withPartedOrigin(t *testing.T) (*Engine, *partedOrigin) {
	t.Helper()
	e, _ := newTestEngine(t, manual(Config{}))
	o := &partedOrigin{newMemOrigin()}
	e.SetOrigin(o)
	return e, o
}

// TestPartitions_ADeadPartitionLeavesAYoungCellOnALiveOneWithTheOrigin:
// with one engine-wide failing flag, a failed call on a dead partition
// made every young cell of the live ones decide locally (as if the whole
// origin failed) until some call succeeded again: in a region of four, a
// key meeting the others in a burst kept no share of the last tenth for
// them, and no request went to the origin.
func TestPartitions_ADeadPartitionLeavesAYoungCellOnALiveOneWithTheOrigin(t *testing.T) {
	e, o := withPartedOrigin(t)
	e.SetProcesses(4)
	l := lim("k", time.Minute, 1000, 1)
	if !e.Decide(bg, l).Allowed { // its cold read answers
		t.Fatal("denied below the limit")
	}
	e.Decide(bg, lim("dead", time.Minute, 1000, 1)) // its cold read fails
	for range 299 {
		if !e.Decide(bg, l).Allowed {
			t.Fatal("denied below the limit")
		}
	}
	if got := o.memOrigin.reserves.Load(); got < 300/34 {
		t.Errorf("a young cell on a live partition sent %d reservations for 300 requests at a limit of 1,000 in a region of four, another partition down; want one for every 33 units", got)
	}
}

// TestPartitions_ACellOnADeadPartitionWaitsToReadAgain: a cell whose cold
// read failed decides locally for coldReadRetry; with one engine-wide
// flag, any answer from a live partition ended that, and each request for
// a key on the dead partition read (and waited on) it again.
func TestPartitions_ACellOnADeadPartitionWaitsToReadAgain(t *testing.T) {
	e, o := withPartedOrigin(t)
	dead := lim("dead", time.Minute, 10, 1)
	for i := range 5 {
		e.Decide(bg, dead)
		e.Decide(bg, lim("k"+string(rune('a'+i)), time.Minute, 10, 1)) // a cold read that answers
	}
	if got := o.reads.Load() - 5; got != 1 {
		t.Errorf("a key on a dead partition read it %d times in 5 decisions within the cold read's retry; want 1", got)
	}
}

// TestPartitions_OneOriginFailsAsAWhole: an origin of one partition (no
// Partitioned) keeps one state, as before: a failure anywhere makes a
// failed cold read of another key wait, and an answer ends it.
func TestPartitions_OneOriginFailsAsAWhole(t *testing.T) {
	e, _, o := withOrigin(t, Config{})
	o.failReads(errOriginDown)
	e.Decide(bg, lim("a", time.Minute, 10, 1))
	o.failReads(nil)
	reads := o.reads.Load()
	e.Decide(bg, lim("a", time.Minute, 10, 1))
	if got := o.reads.Load() - reads; got != 0 {
		t.Errorf("a failed cold read read again %d times while the origin failed; want 0", got)
	}
	e.Decide(bg, lim("b", time.Minute, 10, 1)) // answers: the origin is back
	reads = o.reads.Load()
	e.Decide(bg, lim("a", time.Minute, 10, 1))
	if got := o.reads.Load() - reads; got != 1 {
		t.Errorf("a failed cold read read %d times once the origin answered; want 1", got)
	}
}
