package origin

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// A flush sends the cells in chunks, one EVALSHA of cellsScript (scripts.go)
// per chunk, in one pipeline per endpoint: each cell's contribution hash
// records the own total of each process's incarnation, so the write is
// idempotent and a Redis restarted empty is repaired by the next flush of
// each cell, exactly. When Redis does not know the script (restarted,
// failed over), the pipeline's failed items are sent again with its
// source (EVAL), which loads it on the server that answers: they are
// idempotent too.

// Flush raises this process's own total in each item's cell to its Own
// in one pipeline per endpoint, and stores the cell's totals and Done for
// each item Redis applied. See scripts.go: the write is
// idempotent, so a Redis restarted empty gets every unit back exactly once.
//
// Endpoints are written concurrently; an endpoint whose breaker is open or
// whose round trip fails leaves its items not Done. The error joins every
// endpoint's error.
func (r *Redis) Flush(ctx context.Context, batch []engine.Delta) error {
	if len(batch) == 0 {
		return nil
	}
	ctx, cancel := boundContext(ctx)
	defer cancel()
	if len(r.endpoints) == 1 {
		return r.endpoints[0].flushRecorded(ctx, batch, nil)
	}
	groups := make(map[*endpoint][]int, len(r.endpoints))
	for i := range batch {
		ep := r.route(batch[i].Key)
		groups[ep] = append(groups[ep], i)
	}
	if len(groups) == 1 {
		for ep := range groups {
			return ep.flushRecorded(ctx, batch, nil)
		}
	}
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	for ep, idx := range groups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Each goroutine writes only its own items of batch.
			if err := ep.flushRecorded(ctx, batch, idx); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// flushRecorded flushes the items idx of batch (all of them when idx is
// nil) to this endpoint, and counts the call.
func (ep *endpoint) flushRecorded(ctx context.Context, batch []engine.Delta, idx []int) error {
	start := time.Now()
	n := len(batch)
	if idx != nil {
		n = len(idx)
	}
	err := ep.flush(ctx, batch, idx)
	ep.record(OpFlush, err, start, n)
	if err != nil {
		return fmt.Errorf("redis flush %s (%d cells): %w", ep.address, n, err)
	}
	return nil
}

// boundContext gives ctx a deadline no later than maxCallTimeout from now.
func boundContext(ctx context.Context) (context.Context, context.CancelFunc) {
	limit := time.Now().Add(maxCallTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(limit) {
		return ctx, func() {}
	}
	return context.WithDeadline(ctx, limit)
}

// flush writes the items idx of batch (all when idx is nil).
func (ep *endpoint) flush(ctx context.Context, batch []engine.Delta, idx []int) error {
	if ep.r.closed.Load() {
		return ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if ep.replay.open() {
		return ErrBreakerOpen
	}
	if err := ep.begin(); err != nil {
		return err
	}
	defer ep.end()
	n := len(batch)
	if idx != nil {
		n = len(idx)
	}
	item := func(j int) *engine.Delta {
		if idx == nil {
			return &batch[j]
		}
		return &batch[idx[j]]
	}

	var invalid []error
	todo := make([]int, 0, n)
	for j := 0; j < n; j++ {
		d := item(j)
		switch {
		case d.Key.Window < time.Millisecond:
			invalid = append(invalid, fmt.Errorf("zone %q: window %s is below one millisecond", d.Key.Namespace, d.Key.Window))
		case d.Own < 0 || d.Own > engine.MaxCount:
			invalid = append(invalid, fmt.Errorf("zone %q: own total %d out of range", d.Key.Namespace, d.Own))
		default:
			todo = append(todo, j)
		}
	}
	if len(todo) == 0 {
		return errors.Join(invalid...)
	}

	var errs []error
	err := ep.replay.guard(len(todo), func() error {
		var err error
		for attempt := 0; attempt < 2 && len(todo) > 0; attempt++ {
			var again []int
			again, err = ep.write(ctx, todo, item, attempt > 0)
			if len(again) == 0 {
				break
			}
			// Redis lost its scripts: send those items again with the
			// script's source, which loads it on the server that answers
			// (see readBatch).
			todo = again
		}
		return err
	})
	if err != nil {
		errs = append(errs, err)
	}
	return errors.Join(append(errs, invalid...)...)
}

// write sends the items todo in chunks (ep.chunk), one call of cellsScript
// per chunk (with its source when eval), all in one pipeline; it marks the items Redis
// applied and returns those of chunks Redis refused for an unknown script.
// A chunk's arguments are built in a few buffers, and its reply is one
// string, so the cost per cell on this side is a few bytes copied rather
// than a command, its argument values and its reply values.
//
// The error is the first call's error (the pipeline's), which the breaker
// judges. A cell whose commands Redis refuses fails alone, inside the
// script, and is reported in the error without reaching the breaker.
func (ep *endpoint) write(ctx context.Context, todo []int, item func(int) *engine.Delta, eval bool) ([]int, error) {
	chunk := ep.chunk()
	pipe := ep.client.Pipeline()
	cmds := make([]*redis.Cmd, 0, (len(todo)+chunk-1)/chunk)
	for lo := 0; lo < len(todo); lo += chunk {
		part := todo[lo:min(lo+chunk, len(todo))]
		cmds = append(cmds, pipe.Do(ctx, ep.manyArgs(cellsScript, source(eval), len(part), func(i int) (engine.Key, int64, cellFlags) {
			d := item(part[i])
			var f cellFlags
			if !d.NoPrev {
				f = withPrev
			}
			if d.Late {
				f |= markNext
			}
			return d.Key, d.Sequence, f
		}, func(b []byte, i int) []byte {
			d := item(part[i])
			b = strconv.AppendUint(b, uint64(d.Incarnation), 10)
			b = append(b, ' ')
			b = strconv.AppendInt(b, d.Own, 10)
			b = append(b, ' ')
			return strconv.AppendInt(b, expireAt(d.Key, d.Sequence).UnixMilli(), 10)
		})...))
	}
	ep.roundTrips.Add(1)
	_, err := pipe.Exec(ctx)
	var noScript []int
	refused := 0
	for i, c := range cmds {
		part := todo[i*chunk : min((i+1)*chunk, len(todo))]
		if c.Err() != nil {
			if redis.HasErrorPrefix(c.Err(), "NOSCRIPT") {
				noScript = append(noScript, part...)
			}
			continue
		}
		reply, terr := c.Text()
		if terr != nil {
			continue
		}
		refused += parseMany(reply, len(part), func(i int, t engine.Totals) {
			d := item(part[i])
			d.Totals = t
			d.Done = true
		})
	}
	if err == nil && refused > 0 {
		err = refusedCells(refused)
	}
	return noScript, err
}
