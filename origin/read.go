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
// at once, and each cold cell is hydrated by a read: a herd of thousands of
// reads at every window rollover. Sent one round trip each, they would queue
// for connections, time out, and trip the breaker on a healthy Redis. So
// reads queue per endpoint and a few drainers send them in pipelines: an idle
// endpoint sends a lone read at once, a busy one sends many per round trip.
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

// readReq is one Read waiting for a batch. The drainer writes totals or
// err, then closes done; the reader looks at them only after done.
type readReq struct {
	ctx      context.Context
	deadline time.Time
	key      engine.Key
	seq      int64
	inc      uint32
	totals   engine.Totals
	err      error
	done     chan struct{}
}

func (ep *endpoint) read(ctx context.Context, key engine.Key, seq int64, inc uint32) (engine.Totals, error) {
	if err := ctx.Err(); err != nil {
		return engine.Totals{}, err
	}
	if ep.r.closed.Load() {
		return engine.Totals{}, ErrClosed
	}
	if ep.sync.open() {
		return engine.Totals{}, ErrBreakerOpen
	}
	if key.Window < time.Millisecond {
		return engine.Totals{}, fmt.Errorf("window %s is below one millisecond", key.Window)
	}
	q := &readReq{ctx: ctx, key: key, seq: seq, inc: inc, done: make(chan struct{})}
	q.deadline = time.Now().Add(maxCallTimeout)
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
		// The drainer skips or finishes q on its own; nobody reads it.
		return engine.Totals{}, ctx.Err()
	}
}

// enqueue adds q to the queue and starts a drainer if fewer than
// maxReadRoundTrips run. The caller never does I/O itself, so it is free to
// leave at its deadline.
func (ep *endpoint) enqueue(q *readReq) error {
	ep.mu.Lock()
	if ep.closing {
		ep.mu.Unlock()
		return ErrClosed
	}
	ep.queue = append(ep.queue, q)
	start := ep.drainers < maxReadRoundTrips
	if start {
		ep.drainers++
	}
	ep.mu.Unlock()
	if start {
		go ep.drain()
	}
	return nil
}

// drain sends queued reads in batches until the queue is empty.
func (ep *endpoint) drain() {
	for {
		batch := ep.take()
		if batch == nil {
			return
		}
		ep.readBatch(batch)
	}
}

// take removes up to maxReadBatch live requests from the queue, dropping
// those whose callers already left; nil (and one drainer fewer) when none
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
		ep.drainers--
		if ep.drainers == 0 {
			ep.idle.Broadcast()
		}
		return nil
	}
	return batch
}

// readBatch sends one pipeline of reads for the batch, one call of
// readScript per chunk of requests (ep.chunk), and hands each request its
// result. The pipeline
// runs until the latest deadline in the batch (at least roundTripFloor),
// not bound to any one caller's context: the others still wait. A Redis
// that lost its scripts gets them loaded and the pipeline sent once more
// (reads are idempotent).
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
	err := ep.sync.guard(func() error {
		var err error
		for attempt := 0; attempt < 2; attempt++ {
			pipe := ep.client.Pipeline()
			cmds = cmds[:0]
			for lo := 0; lo < len(batch); lo += chunk {
				cmds = append(cmds, ep.sendReads(ctx, pipe, batch[lo:min(lo+chunk, len(batch))]))
			}
			ep.roundTrips.Add(1)
			if _, err = pipe.Exec(ctx); err == nil || !redis.HasErrorPrefix(err, "NOSCRIPT") {
				return err
			}
			if lerr := readScript.Load(ctx, ep.client).Err(); lerr != nil {
				return fmt.Errorf("load read script: %w", lerr)
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

// sendReads queues the call of readScript that reads part on pipe.
func (ep *endpoint) sendReads(ctx context.Context, pipe redis.Pipeliner, part []*readReq) *redis.Cmd {
	return pipe.Do(ctx, ep.manyArgs(readScript, len(part), func(i int) (engine.Key, int64) {
		return part[i].key, part[i].seq
	}, func(b []byte, i int) []byte {
		b = strconv.AppendUint(b, uint64(part[i].inc), 10)
		b = append(b, ' ')
		return strconv.AppendInt(b, expireAt(part[i].key, part[i].seq).UnixMilli(), 10)
	})...)
}

// parseReads hands each request of part its totals or its error, from
// their call c.
func parseReads(c *redis.Cmd, part []*readReq) {
	reply, err := c.Text()
	if err != nil {
		for _, q := range part {
			q.err = err
		}
		return
	}
	// A cell the reply leaves out was refused, or the reply is malformed.
	for _, q := range part {
		q.err = refusedCells(1)
	}
	parseMany(reply, len(part), func(i int, v [4]int64) {
		part[i].totals = engine.Totals{Cur: v[0], Prev: v[1], Mine: v[2], Shared: v[3] > 1}
		part[i].err = nil
	})
}

// reserve runs the reservation script for res.
func (ep *endpoint) reserve(ctx context.Context, res *engine.Reservation) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if ep.r.closed.Load() {
		return ErrClosed
	}
	if ep.sync.open() {
		return ErrBreakerOpen
	}
	switch {
	case res.Key.Window < time.Millisecond:
		return fmt.Errorf("window %s is below one millisecond", res.Key.Window)
	case res.Own < 0 || res.Own > engine.MaxCount || res.Cost < 0 || res.Cost > engine.MaxCount ||
		res.Limit < 0 || res.Limit > engine.MaxCount:
		return fmt.Errorf("reservation out of range: own %d, cost %d, limit %d", res.Own, res.Cost, res.Limit)
	}
	costs := strconv.AppendInt(make([]byte, 0, 8*(1+len(res.Joined))), res.Cost, 10)
	for _, c := range res.Joined {
		if c < 0 || c > engine.MaxCount {
			return fmt.Errorf("reservation out of range: joined cost %d", c)
		}
		costs = strconv.AppendInt(append(costs, ' '), c, 10)
	}
	cur, prev := cellKeys(ep.r.prefix, res.Key, res.Sequence)
	keys := []string{cur, ownersKey(cur), prev}
	args := []any{ep.r.nodeID + "." + strconv.FormatUint(uint64(res.Incarnation), 10), res.Own, expireAt(res.Key, res.Sequence).UnixMilli(), string(costs), res.Limit,
		windowMs(res.Key.Window), res.Elapsed, engine.ClampCount(res.Global), engine.ClampCount(res.GlobalPrev)}
	var vals []any
	err := ep.sync.guard(func() error {
		ep.roundTrips.Add(1)
		// Run sends EVALSHA, and EVAL when Redis lost the script: a
		// NOSCRIPT reply means nothing ran, so the retry charges once.
		var err error
		vals, err = reserveScript.Run(ctx, ep.client, keys, args...).Slice()
		return err
	})
	if err != nil {
		return err
	}
	if len(vals) != 5 {
		return fmt.Errorf("reserve script returned %v", vals)
	}
	verdicts, ok := vals[0].(string)
	if !ok || len(verdicts) != 1+len(res.Joined) {
		return fmt.Errorf("reserve script returned %v", vals)
	}
	var n [4]int64
	for i := range n {
		if n[i], ok = vals[i+1].(int64); !ok {
			return fmt.Errorf("reserve script returned %v", vals)
		}
	}
	res.Admitted = verdicts[0] == '1'
	res.JoinedAdmitted = make([]bool, len(res.Joined))
	for i := range res.Joined {
		res.JoinedAdmitted[i] = verdicts[i+1] == '1'
	}
	res.Totals = engine.Totals{Cur: n[0], Prev: n[1], Mine: n[2], Shared: n[3] > 1}
	return nil
}
