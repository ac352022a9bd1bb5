package simmodel

import (
	"cmp"
	"context"
	"hash/fnv"
	"slices"
	"strconv"
	"time"

	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// The cross-region role's keys in a model Redis (origin/role.go): the
// lease, the registry of cells to publish with its queue of new
// registrations, and the denial rows left for the holder, spread over
// roleShards keys as the real ones are, so that the commands counted are
// those the real role sends. A call is one round trip however many shards
// it names, as the real calls pipeline them; a take of queued
// registrations is two (the pops, then the registrations they name).

// roleShards is the number of registry and denial keys (origin/role.go).
const roleShards = 16

// roleQueueBatch is the most queued registrations one LPOP takes.
const roleQueueBatch = 1000

type roleState struct {
	holder  string
	until   int64
	reg     map[propagation.Cell]propagation.RegionCell
	queued  [roleShards][]propagation.Cell
	denials map[propagation.Cell]propagation.BlocklistRow
}

func newRoleState() roleState {
	return roleState{reg: map[propagation.Cell]propagation.RegionCell{}, denials: map[propagation.Cell]propagation.BlocklistRow{}}
}

// shardOf spreads cells over the shards as the real keys' hash does.
func shardOf(c propagation.Cell) int {
	h := fnv.New64a()
	_, _ = h.Write([]byte(c.Namespace))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write([]byte(c.Identifier))
	_, _ = h.Write([]byte(strconv.FormatInt(c.WindowMs, 10) + ":" + strconv.FormatInt(c.Sequence, 10)))
	return int(h.Sum64() % roleShards)
}

// Region returns node's handle on the region's shared state in r: what one
// process's propagation layer uses. Each call adds its latency to tick
// (nil: none is kept), and an import lands in the cell when the call
// arrives.
func (r *Redis) Region(node string, tick *Tick) propagation.Region {
	return &regionConn{r: r, node: node, tick: tick}
}

// regionConn is one process's handle on the role's keys.
type regionConn struct {
	r    *Redis
	node string
	tick *Tick
}

var _ propagation.Region = (*regionConn)(nil)

// begin locks r and draws the fate of one call of the role; on success
// it returns when the call arrives. The caller unlocks.
func (c *regionConn) begin() (int64, error) {
	r := c.r
	r.mu.Lock()
	now := r.now()
	if r.down {
		c.tick.add(r.timeouts.Role, r.timeouts.Role)
		return 0, ErrDown
	}
	lat, applied, err := r.link.call(r.rng, now, r.timeouts.Role)
	at := c.tick.add(lat, r.timeouts.Role)
	if at == 0 {
		at = now
	}
	if !applied {
		return 0, err
	}
	r.land(now)
	return max(now, at), err
}

func (c *regionConn) count(calls, processed int64) {
	c.r.cost.Calls += calls
	c.r.cost.Role += calls
	c.r.cost.Processed += processed
}

// roleCall runs one call of the role: when it reached Redis, run does its
// work at the time it arrives and returns its answer, the commands the
// client sent and those Redis ran. What a call that reached Redis did
// stands and is counted even when its answer came too late for the
// caller, who then gets only the error.
func roleCall[T any](c *regionConn, run func(at int64) (out T, calls, processed int64)) (T, error) {
	var none T
	at, err := c.begin()
	defer c.r.mu.Unlock()
	if at == 0 {
		return none, err
	}
	out, calls, processed := run(at)
	c.count(calls, processed)
	if err != nil {
		return none, err
	}
	return out, nil
}

// do is roleCall for a call without an answer.
func (c *regionConn) do(run func(at int64) (calls, processed int64)) error {
	_, err := roleCall(c, func(at int64) (struct{}, int64, int64) {
		calls, processed := run(at)
		return struct{}{}, calls, processed
	})
	return err
}

func (c *regionConn) NodeID() string { return c.node }

func (c *regionConn) Lease(_ context.Context, ttl time.Duration) (string, error) {
	return roleCall(c, func(int64) (string, int64, int64) {
		s := &c.r.role
		now := c.r.now()
		// The script (origin's leaseScript) with the region and database
		// guards a node always names: EVALSHA and three GETs (the
		// region's guard, the database's, the lease), and when it holds
		// the lease, its PEXPIRE or SET and both guards' SETs. The model
		// counted the EVALSHA, one GET and one write, and an idle region
		// of four nodes sent Redis 361 commands a second in the model
		// against 412 (an audit).
		processed := int64(4)
		switch {
		case s.holder == c.node && s.until > now:
			s.until = now + ttl.Milliseconds()
			processed += 3
		case s.holder == "" || s.until <= now:
			s.holder, s.until = c.node, now+ttl.Milliseconds()
			processed += 3
		}
		return s.holder, 1, processed
	})
}

func (c *regionConn) ReleaseLease(context.Context) error {
	return c.do(func(int64) (int64, int64) {
		s := &c.r.role
		processed := int64(2)
		if s.holder == c.node && s.until > c.r.now() {
			s.holder, s.until = "", 0
			processed++
		}
		return 1, processed
	})
}

func (c *regionConn) Register(_ context.Context, cells []propagation.RegionCell) error {
	return c.do(func(int64) (int64, int64) {
		s := &c.r.role
		var used [roleShards]bool
		var calls, processed int64
		for _, rc := range cells {
			sh := shardOf(rc.Cell)
			if !used[sh] {
				used[sh] = true
				calls++
			}
			processed++ // HGET
			if old, ok := s.reg[rc.Cell]; !ok || old != rc {
				s.reg[rc.Cell] = rc
				s.queued[sh] = append(s.queued[sh], rc.Cell)
				processed += 2 // HSET, RPUSH
			}
		}
		return calls, calls + processed
	})
}

func (c *regionConn) TakeRegistered(_ context.Context, all bool, now int64) ([]propagation.RegionCell, error) {
	var queued bool
	out, err := roleCall(c, func(int64) ([]propagation.RegionCell, int64, int64) {
		var out []propagation.RegionCell
		var calls int64
		if all {
			out, calls = c.r.role.takeAll(now)
		} else {
			queued = c.r.role.anyQueued()
			out, calls = c.r.role.takeQueued(now)
		}
		slices.SortFunc(out, func(a, b propagation.RegionCell) int { return compareCells(a.Cell, b.Cell) })
		return out, calls, calls
	})
	if queued && err == nil {
		c.trip() // the queued cells' registrations, read once the pops answered
	}
	return out, err
}

// trip adds one more round trip to the call just made: a client's second
// pipeline, sent once the first answered.
func (c *regionConn) trip() {
	r := c.r
	r.mu.Lock()
	defer r.mu.Unlock()
	lat, _, _ := r.link.call(r.rng, r.now(), r.timeouts.Role)
	c.tick.add(lat, r.timeouts.Role)
}

// takeAll takes every registration that has not expired at now (a whole
// read of the registry), deleting those that have, and empties the
// queues; it returns the commands it took.
func (s *roleState) takeAll(now int64) ([]propagation.RegionCell, int64) {
	var out []propagation.RegionCell
	calls := int64(2 * roleShards) // DEL of the queue, HGETALL
	var expired [roleShards]bool
	for cell, rc := range s.reg {
		if rc.Expires <= now {
			delete(s.reg, cell)
			expired[shardOf(cell)] = true
			continue
		}
		out = append(out, rc)
	}
	for sh := range s.queued {
		s.queued[sh] = nil
		if expired[sh] {
			calls++ // HDEL
		}
	}
	return out, calls
}

// anyQueued reports whether a cell was registered since the last take.
func (s *roleState) anyQueued() bool {
	for _, q := range s.queued {
		if len(q) > 0 {
			return true
		}
	}
	return false
}

// takeQueued takes the registrations queued since the last take, each
// once, that have not expired at now; it returns the commands it took.
func (s *roleState) takeQueued(now int64) ([]propagation.RegionCell, int64) {
	var out []propagation.RegionCell
	var calls int64
	seen := map[propagation.Cell]bool{}
	for sh := range s.queued {
		q := s.queued[sh]
		calls += 1 + int64(len(q)/roleQueueBatch) // LPOP until short
		if len(q) > 0 {
			calls += int64((len(q) + roleQueueBatch - 1) / roleQueueBatch) // HMGET
		}
		for _, cell := range q {
			rc, ok := s.reg[cell]
			if ok && !seen[cell] && rc.Expires > now {
				seen[cell] = true
				out = append(out, rc)
			}
		}
		s.queued[sh] = nil
	}
	return out, calls
}

func (c *regionConn) PutDenials(_ context.Context, rows []propagation.BlocklistRow) error {
	return c.do(func(int64) (int64, int64) {
		for _, row := range rows {
			c.r.role.denials[rowCell(row)] = row
		}
		return int64(len(rows)), int64(len(rows))
	})
}

func (c *regionConn) TakeDenials(context.Context) ([]propagation.BlocklistRow, error) {
	return roleCall(c, func(int64) ([]propagation.BlocklistRow, int64, int64) {
		out := make([]propagation.BlocklistRow, 0, len(c.r.role.denials))
		for _, row := range c.r.role.denials {
			out = append(out, row)
		}
		slices.SortFunc(out, func(a, b propagation.BlocklistRow) int { return compareCells(rowCell(a), rowCell(b)) })
		return out, roleShards, roleShards
	})
}

func (c *regionConn) DenialsWritten(_ context.Context, rows []propagation.BlocklistRow) error {
	return c.do(func(int64) (int64, int64) {
		var used [roleShards]bool
		var calls, processed int64
		for _, row := range rows {
			cell := rowCell(row)
			if sh := shardOf(cell); !used[sh] {
				used[sh] = true
				calls++
			}
			processed++ // HGET
			if cur, ok := c.r.role.denials[cell]; ok && cur == row {
				delete(c.r.role.denials, cell)
				processed++ // HDEL
			}
		}
		return calls, calls + processed
	})
}

// Totals: the model has no resets, so every cell's reset is none.
func (c *regionConn) Totals(_ context.Context, cells []propagation.Cell) ([]propagation.RegionTotal, error) {
	return roleCall(c, func(int64) ([]propagation.RegionTotal, int64, int64) {
		out := make([]propagation.RegionTotal, len(cells))
		for i, cell := range cells {
			if h := c.r.cells[cellOf(cell)]; h != nil {
				out[i].Count = h.T
			}
		}
		return out, int64(len(cells)), int64(len(cells))
	})
}

func (c *regionConn) Import(_ context.Context, ims []propagation.RegionImport) error {
	return c.do(func(at int64) (int64, int64) {
		calls := int64((len(ims) + manyChunk - 1) / manyChunk)
		processed := calls
		for _, im := range ims {
			id := cellOf(im.Cell)
			// HMGET, and HSET of the sum when it rose (origin's
			// importScript); the model has no resets, so its imports never
			// go part by part.
			processed++ // HMGET
			if h := c.r.cells[id]; h == nil || h.G < im.Count {
				processed++ // HSET
				if h == nil {
					processed++ // PEXPIREAT
				}
			}
			c.r.sendImport(at, id, im.Count)
		}
		c.r.land(c.r.now())
		return calls, processed
	})
}

// TakeOverrides is the holder's take of the region's override changes
// (origin.Redis.TakeOverrides), every flush: one script call that runs
// LRANGE of the queue (and LTRIM and an HGET per change, of which the
// model has none); on taking the role, a pipeline of GET and HGETALL.
// The simulator changes no override: it returns none.
func (c *regionConn) TakeOverrides(_ context.Context, all bool) ([]propagation.OverrideRow, error) {
	return roleCall(c, func(int64) ([]propagation.OverrideRow, int64, int64) {
		if all {
			return nil, 2, 2
		}
		return nil, 1, 2
	})
}

// ApplyOverrides leaves overrides read from MySQL in the region: one
// script call writing each (origin.Redis.PutOverrides). The model keeps
// none; the simulator's MySQL holds none to apply.
func (c *regionConn) ApplyOverrides(_ context.Context, rows []propagation.OverrideRow) error {
	if len(rows) == 0 {
		return nil
	}
	return c.do(func(int64) (int64, int64) { return 1, 1 + 2*int64(len(rows)) })
}

var _ propagation.OverrideRegion = (*regionConn)(nil)

// Registered reports whether the region's registry holds cell.
func (r *Redis) Registered(cell propagation.Cell) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.role.reg[cell]
	return ok
}

// Holder returns the node holding the role at now, "" when none.
func (r *Redis) Holder() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.role.until <= r.now() {
		return ""
	}
	return r.role.holder
}

func rowCell(r propagation.BlocklistRow) propagation.Cell {
	return propagation.Cell{Namespace: r.Namespace, Identifier: r.Identifier, WindowMs: r.WindowMs, Sequence: r.Sequence}
}

func compareCells(a, b propagation.Cell) int {
	switch {
	case a.Namespace != b.Namespace:
		return cmp.Compare(a.Namespace, b.Namespace)
	case a.Identifier != b.Identifier:
		return cmp.Compare(a.Identifier, b.Identifier)
	case a.WindowMs != b.WindowMs:
		return cmp.Compare(a.WindowMs, b.WindowMs)
	}
	return cmp.Compare(a.Sequence, b.Sequence)
}

func msDuration(ms int64) time.Duration { return time.Duration(ms) * time.Millisecond }
