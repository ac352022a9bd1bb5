package origin

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// A flush sends, per cell, in one pipeline per endpoint:
//
//	INCRBY    <cell> <delta>                 → the cell's total
//	PEXPIREAT <cell> <end of cell + 2 windows>
//	HINCRBY   <cell>:own <node> <delta>      → this process's units, as Redis knows them
//	PEXPIREAT <cell>:own <same>
//
// The hash <cell>:own records each process's contribution to the cell. When
// a process's field comes back below the item's Own (every unit the engine
// has committed to the cell), Redis lost that many of its units: it was
// restarted empty, or failed over to a replica that had not seen them. The
// process then adds exactly the missing units to the cell and to its field
// in a second round trip. Every process does the same for its own units, so
// after a restart each live process's contribution is back exactly once:
// nothing lost, nothing doubled. (Comparing the cell's total with Own
// instead would only detect a loss while the total is below one process's
// share, and would lose the other processes' units whenever several share
// the cell.)
//
// A process that commits nothing more to a cell after Redis lost it does
// not re-add its units; the engine still holds them locally and keeps
// deciding with them. The second round trip happens only after a loss.
//
// Two flushes of one cell by one process may overlap (a replay tick while
// the previous tick's flush of a slow Redis is still out, or shutdown's
// final flush beside the replay loop), and Redis may apply them in either
// order. The later one's Own then counts units the earlier one has not
// landed yet, and its field would look short. So a flush that overlapped
// another of the same cell never re-adds: the cell's next flush compares
// again, on a field that has every earlier flush in it.

// expireAt is when the cell (key, seq) may leave Redis: the end of the cell
// plus two windows. Past its own end the cell is still weighted as the
// previous cell for one window, and one more window of slack covers clock
// skew between nodes and a replay that arrives late; so a cell never
// expires while it is still weighted, and a lost PEXPIREAT is repeated by
// the next flush (it is idempotent), so no key lives forever.
func expireAt(key engine.Key, seq int64) time.Time {
	return time.UnixMilli((seq + 3) * windowMs(key.Window))
}

// flush writes the items idx of batch (all when idx is nil), then re-adds
// lost units in a second pipeline when needed.
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
		case d.Delta < 0 || d.Own < d.Delta:
			invalid = append(invalid, fmt.Errorf("zone %q: delta %d with own %d", d.Key.Namespace, d.Delta, d.Own))
		default:
			keys[j] = cellKey(ep.r.prefix, d.Key, d.Sequence)
			valid++
		}
	}
	if valid == 0 {
		return errors.Join(invalid...)
	}

	flights := make([]*cellFlight, n)
	for j, k := range keys {
		if k != "" {
			flights[j] = inflight.begin(ep.r.nodeID, k)
		}
	}
	defer func() {
		for _, f := range flights {
			if f != nil {
				inflight.end(f)
			}
		}
	}()

	err := ep.guard(func() error {
		pipe := ep.client.Pipeline()
		total := make([]*redis.IntCmd, n)
		mine := make([]*redis.IntCmd, n)
		for j, k := range keys {
			if k == "" {
				continue
			}
			d := item(j)
			at := expireAt(d.Key, d.Sequence)
			own := ownersKey(k)
			total[j] = pipe.IncrBy(ctx, k, d.Delta)
			pipe.PExpireAt(ctx, k, at)
			mine[j] = pipe.HIncrBy(ctx, own, ep.r.nodeID, d.Delta)
			pipe.PExpireAt(ctx, own, at)
		}
		ep.roundTrips.Add(1)
		_, err := pipe.Exec(ctx)

		var short []shortfall
		for j, c := range total {
			if c == nil || c.Err() != nil {
				continue
			}
			d := item(j)
			d.Total, d.Done = c.Val(), true
			// The field's reply is lost only with the connection; then the
			// next flush of the cell checks again.
			if m := mine[j]; m.Err() == nil && m.Val() < d.Own && !inflight.overlapped(flights[j]) {
				short = append(short, shortfall{j: j, units: d.Own - m.Val()})
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

// shortfall is a cell whose own field came back units below Own.
type shortfall struct {
	j     int
	units int64
}

// readd adds each shortfall's units to its cell and to this process's field.
// The items are already Done (their delta is applied); a failure here
// leaves Total as it was, and the next flush of the cell finds the
// shortfall again.
func (ep *endpoint) readd(ctx context.Context, keys []string, short []shortfall, item func(int) *engine.Delta) error {
	pipe := ep.client.Pipeline()
	add := make([]*redis.IntCmd, len(short))
	for i, s := range short {
		d := item(s.j)
		at := expireAt(d.Key, d.Sequence)
		own := ownersKey(keys[s.j])
		add[i] = pipe.IncrBy(ctx, keys[s.j], s.units)
		pipe.PExpireAt(ctx, keys[s.j], at)
		pipe.HIncrBy(ctx, own, ep.r.nodeID, s.units)
		pipe.PExpireAt(ctx, own, at)
	}
	ep.roundTrips.Add(1)
	_, err := pipe.Exec(ctx)
	for i, s := range short {
		if add[i].Err() != nil {
			continue
		}
		ep.readded.Add(uint64(s.units))
		item(s.j).Total = add[i].Val()
	}
	if err != nil {
		return fmt.Errorf("re-add lost contributions: %w", err)
	}
	return nil
}

// inflight tracks the cells being flushed, per process and cell key, in the
// whole process: an origin swapped in by a config reload flushes the same
// cells under the same node ID as the one it replaces.
var inflight = &flightTable{cells: make(map[string]*cellFlight)}

type flightTable struct {
	mu    sync.Mutex
	cells map[string]*cellFlight
}

// cellFlight is one cell with flushes in flight. overlap is set once two
// flushes of the cell were out at the same time, and stays set until none is.
type cellFlight struct {
	key     string
	n       int
	overlap bool
}

func (t *flightTable) begin(node, cell string) *cellFlight {
	k := node + "\x00" + cell
	t.mu.Lock()
	defer t.mu.Unlock()
	f := t.cells[k]
	if f == nil {
		f = &cellFlight{key: k}
		t.cells[k] = f
	}
	f.n++
	if f.n > 1 {
		f.overlap = true
	}
	return f
}

func (t *flightTable) overlapped(f *cellFlight) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return f.overlap
}

func (t *flightTable) end(f *cellFlight) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if f.n--; f.n == 0 {
		delete(t.cells, f.key)
	}
}
