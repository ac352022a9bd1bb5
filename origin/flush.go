package origin

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// A flush sends, per cell, one EVALSHA of writeScript (scripts.go) in one
// pipeline per endpoint: the cell's contribution hash records each
// process's absolute total, so the write is idempotent and a Redis restarted
// empty is repaired by the next flush of each cell, exactly. A script Redis
// does not know (restarted, failed over) is loaded and the pipeline's
// failed items sent again: they are idempotent too.

// expireAt is when the cell (key, seq) may leave Redis: the end of the cell
// plus two windows. Past its own end the cell is still weighted as the
// previous cell for one window, and one more window of slack covers clock
// skew between nodes and a replay that arrives late; so a cell never
// expires while it is still weighted, and a lost PEXPIREAT is repeated by
// the next write (it is idempotent), so no key lives forever.
func expireAt(key engine.Key, seq int64) time.Time {
	return time.UnixMilli((seq + 3) * windowMs(key.Window))
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

	keys := make([]string, n)
	prevs := make([]string, n)
	var invalid []error
	var todo []int
	for j := 0; j < n; j++ {
		d := item(j)
		switch {
		case d.Key.Window < time.Millisecond:
			invalid = append(invalid, fmt.Errorf("zone %q: window %s is below one millisecond", d.Key.Namespace, d.Key.Window))
		case d.Own < 0 || d.Own > engine.MaxCount:
			invalid = append(invalid, fmt.Errorf("zone %q: own total %d out of range", d.Key.Namespace, d.Own))
		default:
			keys[j], prevs[j] = cellKeys(ep.r.prefix, d.Key, d.Sequence)
			todo = append(todo, j)
		}
	}
	if len(todo) == 0 {
		return errors.Join(invalid...)
	}

	var errs []error
	err := ep.replay.guard(func() error {
		var err error
		for attempt := 0; attempt < 2 && len(todo) > 0; attempt++ {
			var again []int
			again, err = ep.writeOnce(ctx, keys, prevs, todo, item)
			if len(again) == 0 {
				break
			}
			// Redis lost its scripts: load and send those items again.
			if lerr := writeScript.Load(ctx, ep.client).Err(); lerr != nil {
				return fmt.Errorf("load write script: %w", lerr)
			}
			todo = again
		}
		return err
	})
	if err != nil {
		errs = append(errs, err)
	}
	return errors.Join(append(errs, invalid...)...)
}

// writeOnce sends one pipeline of writes for the items todo, marks those
// Redis applied, and returns the items Redis refused for an unknown script.
// Its error is the first command's error (the pipeline's), which the
// breaker judges: a command refused for its own key does not count.
func (ep *endpoint) writeOnce(ctx context.Context, keys, prevs []string, todo []int, item func(int) *engine.Delta) ([]int, error) {
	pipe := ep.client.Pipeline()
	cmds := make([]*redis.Cmd, len(todo))
	for i, j := range todo {
		d := item(j)
		at := expireAt(d.Key, d.Sequence).UnixMilli()
		cmds[i] = writeScript.EvalSha(ctx, pipe, []string{keys[j], ownersKey(keys[j]), prevs[j]},
			ep.r.nodeID, d.Own, at)
	}
	ep.roundTrips.Add(1)
	_, err := pipe.Exec(ctx)
	var noScript []int
	for i, j := range todo {
		c := cmds[i]
		if c.Err() != nil {
			if redis.HasErrorPrefix(c.Err(), "NOSCRIPT") {
				noScript = append(noScript, j)
			}
			continue
		}
		vals, perr := scriptInts(c, 4)
		if perr != nil {
			continue
		}
		d := item(j)
		d.Totals = engine.Totals{Cur: vals[0], Prev: vals[3], Mine: vals[1], Shared: vals[2] > 1}
		d.Done = true
	}
	return noScript, err
}

// scriptInts reads a script's reply of n integers.
func scriptInts(c *redis.Cmd, n int) ([]int64, error) {
	vals, err := c.Int64Slice()
	if err != nil {
		return nil, err
	}
	if len(vals) != n {
		return nil, fmt.Errorf("script returned %d values, want %d", len(vals), n)
	}
	return vals, nil
}
