package origin

import (
	"context"
	"errors"
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

// readReq is one Read waiting for a batch. The drainer writes cur, prev and
// err, then closes done; the reader looks at them only after done.
type readReq struct {
	ctx       context.Context
	deadline  time.Time
	cur, prev string
	curN      int64
	prevN     int64
	err       error
	done      chan struct{}
}

func (ep *endpoint) read(ctx context.Context, key engine.Key, seq int64) (cur, prev int64, err error) {
	if err := ctx.Err(); err != nil {
		return 0, 0, err
	}
	if ep.r.closed.Load() {
		return 0, 0, ErrClosed
	}
	if ep.open() {
		return 0, 0, ErrBreakerOpen
	}
	if key.Window < time.Millisecond {
		return 0, 0, fmt.Errorf("window %s is below one millisecond", key.Window)
	}
	q := &readReq{ctx: ctx, done: make(chan struct{})}
	q.deadline = time.Now().Add(maxCallTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(q.deadline) {
		q.deadline = d
	}
	q.cur, q.prev = cellKeys(ep.r.prefix, key, seq)
	if err := ep.enqueue(q); err != nil {
		return 0, 0, err
	}
	select {
	case <-q.done:
		return q.curN, q.prevN, q.err
	case <-ctx.Done():
		// The drainer skips or finishes q on its own; nobody reads it.
		return 0, 0, ctx.Err()
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

// readBatch sends one pipeline of MGETs, one per request, and hands each
// request its result. The pipeline runs until the latest deadline in the
// batch (at least roundTripFloor), not bound to any one caller's context:
// the others still wait.
func (ep *endpoint) readBatch(batch []*readReq) {
	deadline := time.Now().Add(roundTripFloor)
	for _, q := range batch {
		if q.deadline.After(deadline) {
			deadline = q.deadline
		}
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	cmds := make([]*redis.SliceCmd, len(batch))
	err := ep.guard(func() error {
		pipe := ep.client.Pipeline()
		for i, q := range batch {
			// Both keys share a hash tag, so this MGET is single-slot in a
			// Cluster too.
			cmds[i] = pipe.MGet(ctx, q.cur, q.prev)
		}
		ep.roundTrips.Add(1)
		_, err := pipe.Exec(ctx)
		return err
	})
	for i, q := range batch {
		if errors.Is(err, ErrBreakerOpen) {
			q.err = err
		} else {
			q.curN, q.prevN, q.err = parseMGet(cmds[i])
		}
		close(q.done)
	}
}

// parseMGet reads the two totals of an MGET; a missing cell is 0.
func parseMGet(cmd *redis.SliceCmd) (cur, prev int64, err error) {
	vals, err := cmd.Result()
	if err != nil {
		return 0, 0, err
	}
	if len(vals) != 2 {
		return 0, 0, fmt.Errorf("MGET returned %d values for 2 keys", len(vals))
	}
	if cur, err = parseTotal(vals[0]); err != nil {
		return 0, 0, err
	}
	if prev, err = parseTotal(vals[1]); err != nil {
		return 0, 0, err
	}
	return cur, prev, nil
}

func parseTotal(v any) (int64, error) {
	switch t := v.(type) {
	case nil:
		return 0, nil
	case string:
		n, err := strconv.ParseInt(t, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("cell holds a non-integer value: %w", err)
		}
		return n, nil
	case int64:
		return t, nil
	}
	return 0, fmt.Errorf("cell holds an unexpected %T", v)
}
