package origin

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// Read batching. Every new sequence makes every active key's new cell cold
// at once, and each cold cell waits for a cold read: a herd of thousands of
// reads at every window rollover. Sent one round trip each, they would queue
// for connections, time out, and trip the breaker on a healthy Redis. So
// reads queue per endpoint and a few batchers send them in pipelines: an
// idle endpoint sends a lone read at once, a busy one sends many per round
// trip.
const (
	// maxReadRoundTrips is the number of read pipelines in flight per
	// endpoint; with the replay workers it stays below poolSize, so reads
	// never wait for a connection.
	maxReadRoundTrips = 8
	// maxReadBatch is the most cell pairs in one read pipeline: about 40
	// KiB of request for typical keys, a millisecond of Redis time, so one
	// batch never holds the others back for long.
	maxReadBatch = 256
	// roundTripFloor is the least time a read pipeline gets, whatever is
	// left of its callers' budgets. The breaker judges Redis by its round
	// trips; a pipeline sent with 2 ms left because its reads queued behind
	// a herd (or a busy CPU) would time out and count as a Redis failure
	// that was ours. Callers still leave at their own deadlines: a late
	// answer only serves the breaker, and a hung Redis still trips it
	// within a second (maxReadRoundTrips pipelines every 250 ms).
	roundTripFloor = 250 * time.Millisecond
)

// readReq is one Read waiting for a batch. The batcher writes totals or
// err, then closes done; the reader looks at them only after done.
type readReq struct {
	ctx         context.Context
	deadline    time.Time
	key         engine.Key
	seq         int64
	incarnation uint32
	totals      engine.Totals
	err         error
	done        chan struct{}
}

// Read returns the totals of the cell (key, seq) and of the cell before it,
// with the own total recorded for this process's incarnation inc of the
// cell, which it registers in the cell; a missing cell is 0. It returns by
// ctx's deadline whatever Redis does, and at once when the endpoint's
// request-path breaker is open. Concurrent reads of one endpoint share
// round trips.
func (r *Redis) Read(ctx context.Context, key engine.Key, seq int64, inc uint32) (engine.Totals, error) {
	start := time.Now()
	ep := r.route(key)
	t, err := ep.read(ctx, key, seq, inc)
	ep.record(OpRead, err, start, 2)
	if err != nil {
		return engine.Totals{}, fmt.Errorf("redis read %s (zone %q): %w", ep.address, key.Namespace, err)
	}
	return t, nil
}

// read queues one read for a batch and waits for its answer or ctx.
func (ep *endpoint) read(ctx context.Context, key engine.Key, seq int64, inc uint32) (engine.Totals, error) {
	if err := ep.ready(ctx, key.Window); err != nil {
		return engine.Totals{}, err
	}
	q := &readReq{ctx: ctx, key: key, seq: seq, incarnation: inc, done: make(chan struct{})}
	q.deadline = time.Now().Add(ep.callTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(q.deadline) {
		q.deadline = d
	}
	if err := ep.enqueue(q); err != nil {
		return engine.Totals{}, err
	}
	select {
	case <-q.done:
		return q.totals, q.err
	case <-ctx.Done():
		// The batcher skips or finishes q on its own; nobody reads it.
		return engine.Totals{}, ctx.Err()
	}
}

// enqueue adds q to the queue and starts a batcher if fewer than
// maxReadRoundTrips run. The caller never does I/O itself, so it is free to
// leave at its deadline.
func (ep *endpoint) enqueue(q *readReq) error {
	ep.mu.Lock()
	if ep.closing {
		ep.mu.Unlock()
		return ErrClosed
	}
	ep.queue = append(ep.queue, q)
	start := ep.batchers < maxReadRoundTrips
	if start {
		ep.batchers++
	}
	ep.mu.Unlock()
	if start {
		go ep.sendBatches()
	}
	return nil
}

// sendBatches is a batcher: it sends queued reads in batches until the
// queue is empty.
func (ep *endpoint) sendBatches() {
	for {
		batch := ep.take()
		if batch == nil {
			return
		}
		ep.readBatch(batch)
	}
}

// take removes up to maxReadBatch live requests from the queue, dropping
// those whose callers already left; nil (and one batcher fewer) when none
// is left.
func (ep *endpoint) take() []*readReq {
	ep.mu.Lock()
	defer ep.mu.Unlock()
	now := time.Now()
	var batch []*readReq
	i := 0
	for ; i < len(ep.queue) && len(batch) < maxReadBatch; i++ {
		q := ep.queue[i]
		ep.queue[i] = nil
		if q.ctx.Err() != nil || !now.Before(q.deadline) {
			continue
		}
		batch = append(batch, q)
	}
	ep.queue = ep.queue[i:]
	if len(ep.queue) == 0 {
		ep.queue = nil // let the grown array go
	}
	if len(batch) == 0 {
		ep.batchers--
		if ep.batchers == 0 && ep.writes == 0 {
			ep.idle.Broadcast()
		}
		return nil
	}
	return batch
}

// readBatch sends one pipeline of reads for the batch, one call of
// cellsScript per chunk of requests (ep.chunk), and hands each request its
// result. The pipeline
// runs until the latest deadline in the batch (at least roundTripFloor),
// not bound to any one caller's context: the others still wait. A Redis
// that lost its scripts gets them loaded and the pipeline sent once more
// (reads are idempotent), with the script's source (EVAL), which loads it
// on the server that answers: a SCRIPT LOAD on its own may reach another
// server than the pipeline, as a pool's connections do after a failover
// that moved the name dialled (a stale connection to the old master,
// now a replica, answered NOSCRIPT to every EVALSHA while the loads went
// to the new master, and the writes never reached it).
func (ep *endpoint) readBatch(batch []*readReq) {
	deadline := time.Now().Add(roundTripFloor)
	for _, q := range batch {
		if q.deadline.After(deadline) {
			deadline = q.deadline
		}
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	chunk := ep.chunk()
	cmds := make([]*redis.Cmd, 0, (len(batch)+chunk-1)/chunk)
	err := ep.requests.guard(len(batch), func() error {
		var err error
		for attempt := 0; attempt < 2; attempt++ {
			pipe := ep.client.Pipeline()
			cmds = cmds[:0]
			for lo := 0; lo < len(batch); lo += chunk {
				cmds = append(cmds, ep.sendReads(ctx, pipe, batch[lo:min(lo+chunk, len(batch))], attempt > 0))
			}
			ep.roundTrips.Add(1)
			if _, err = pipe.Exec(ctx); err == nil || !redis.HasErrorPrefix(err, "NOSCRIPT") {
				return err
			}
		}
		return err
	})
	// cmds is empty when the breaker refused the call, else whole.
	for i, c := range cmds {
		part := batch[i*chunk : min((i+1)*chunk, len(batch))]
		parseReads(c, part)
		for _, q := range part {
			close(q.done)
		}
	}
	for _, q := range batch[min(len(cmds)*chunk, len(batch)):] { // never sent
		q.err = err
		close(q.done)
	}
}

// sendReads queues the call of cellsScript that reads part on pipe, with
// the script's source when eval.
func (ep *endpoint) sendReads(ctx context.Context, pipe redis.Pipeliner, part []*readReq, eval bool) *redis.Cmd {
	return pipe.Do(ctx, ep.manyArgs(cellsScript, source(eval), len(part), func(i int) (engine.Key, int64, cellFlags) {
		return part[i].key, part[i].seq, withPrev // a read takes the previous cell too
	}, func(b []byte, i int) []byte {
		b = strconv.AppendUint(b, uint64(part[i].incarnation), 10)
		b = append(b, " 0 "...) // a read registers the record, with no units
		return strconv.AppendInt(b, expireAt(part[i].key, part[i].seq).UnixMilli(), 10)
	})...)
}

// parseReads hands each request of part its totals or its error, from
// their call c.
func parseReads(c *redis.Cmd, part []*readReq) {
	reply, err := c.Text()
	if err != nil {
		err = explainScripts(err)
		for _, q := range part {
			q.err = err
		}
		return
	}
	// A cell the reply leaves out was refused, or the reply is malformed.
	for _, q := range part {
		q.err = refusedCells(1)
	}
	parseMany(reply, len(part), func(i int, t engine.Totals) {
		part[i].totals = t
		part[i].err = nil
	})
}

// Peek returns the region's totals of the cell (key, seq) and of the cell
// before it, other regions' counts included, without registering this
// process in the cell or writing anything: what the admin API shows of a
// key. A missing cell is 0.
func (r *Redis) Peek(ctx context.Context, key engine.Key, seq int64) (engine.Totals, error) {
	ep := r.route(key)
	cur, prev := cellKeys(r.prefix, key, seq)
	pipe := ep.client.Pipeline()
	c := pipe.HMGet(ctx, cur, "t", "g", "r", "rg")
	p := pipe.HMGet(ctx, prev, "t", "g", "r", "rg")
	if _, err := pipe.Exec(ctx); err != nil {
		return engine.Totals{}, fmt.Errorf("redis peek %s (zone %q): %w", ep.address, key.Namespace, err)
	}
	num := func(v []any, i int) int64 {
		s, _ := v[i].(string)
		n, _ := strconv.ParseInt(s, 10, 64)
		return engine.ClampCount(n)
	}
	// What a cell says: its reset marks taken off (scripts.go).
	says := func(v []any, i int) int64 { return max(num(v, i)-num(v, i+2), 0) }
	cv, pv := c.Val(), p.Val()
	return engine.Totals{Cur: says(cv, 0), Global: says(cv, 1), Prev: says(pv, 0), GlobalPrev: says(pv, 1)}, nil
}
