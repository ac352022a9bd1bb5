package origin

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// expireAt is when the cell (key, seq) may leave Redis: the end of the cell
// plus two windows. Past its own end the cell is still weighted as the
// previous cell for one window, and one more window of slack covers clock
// skew between nodes and a replay that arrives late; so a cell never
// expires while it is still weighted, and a lost PEXPIREAT is repeated by
// the next flush (it is idempotent), so no key lives forever.
func expireAt(key engine.Key, seq int64) time.Time {
	return time.UnixMilli((seq + 3) * windowMs(key.Window))
}

// flush writes the items idx of batch (all when idx is nil) in one
// pipeline of INCRBY + PEXPIREAT, and re-adds lost contributions in a
// second one when a total comes back below Own.
func (ep *endpoint) flush(ctx context.Context, batch []engine.Delta, idx []int) error {
	if ep.r.closed.Load() {
		return ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if ep.open() {
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
	var invalid []error
	valid := 0
	for j := 0; j < n; j++ {
		d := item(j)
		switch {
		case d.Key.Window < time.Millisecond:
			invalid = append(invalid, fmt.Errorf("zone %q: window %s is below one millisecond", d.Key.Namespace, d.Key.Window))
		case d.Delta < 0:
			invalid = append(invalid, fmt.Errorf("zone %q: negative delta %d", d.Key.Namespace, d.Delta))
		default:
			keys[j] = cellKey(ep.r.prefix, d.Key, d.Sequence)
			valid++
		}
	}
	if valid == 0 {
		return errors.Join(invalid...)
	}

	err := ep.guard(func() error {
		pipe := ep.client.Pipeline()
		incr := make([]*redis.IntCmd, n)
		for j, k := range keys {
			if k == "" {
				continue
			}
			d := item(j)
			incr[j] = pipe.IncrBy(ctx, k, d.Delta)
			pipe.PExpireAt(ctx, k, expireAt(d.Key, d.Sequence))
		}
		ep.roundTrips.Add(1)
		_, err := pipe.Exec(ctx)

		var short []int
		for j, c := range incr {
			if c == nil || c.Err() != nil {
				continue
			}
			d := item(j)
			d.Total, d.Done = c.Val(), true
			if d.Total < d.Own {
				short = append(short, j)
			}
		}
		if len(short) > 0 {
			if rerr := ep.readd(ctx, keys, short, item); rerr != nil {
				err = errors.Join(err, rerr)
			}
		}
		return err
	})
	return errors.Join(append([]error{err}, invalid...)...)
}

// readd adds Own − Total to the cells at positions short, whose totals came
// back below this process's own contribution: Redis lost it (restarted
// empty, or the key was evicted). The items are already Done (their delta
// is applied); a failure here leaves Total as it was, and the next flush of
// the cell sees the shortfall again.
func (ep *endpoint) readd(ctx context.Context, keys []string, short []int, item func(int) *engine.Delta) error {
	pipe := ep.client.Pipeline()
	add := make([]*redis.IntCmd, len(short))
	for i, j := range short {
		d := item(j)
		add[i] = pipe.IncrBy(ctx, keys[j], d.Own-d.Total)
		pipe.PExpireAt(ctx, keys[j], expireAt(d.Key, d.Sequence))
	}
	ep.roundTrips.Add(1)
	_, err := pipe.Exec(ctx)
	for i, j := range short {
		if add[i].Err() != nil {
			continue
		}
		d := item(j)
		ep.readded.Add(uint64(d.Own - d.Total))
		d.Total = add[i].Val()
	}
	if err != nil {
		return fmt.Errorf("re-add lost contributions: %w", err)
	}
	return nil
}
