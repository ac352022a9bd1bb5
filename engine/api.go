package engine

import (
	"context"
	"time"
)

// Key identifies one limit: the zone it belongs to (its namespace), the
// evaluated identifier and the window length. The limit value itself is not
// part of the key: it may change between requests (overrides, reloads).
type Key struct {
	// Namespace is the zone name.
	Namespace string
	// Identifier is the evaluated key of the request (an API key, an IP
	// prefix, a tenant). Identifiers longer than MaxIdentifierLen bytes are
	// replaced by a fixed-size hash (see NormalizeIdentifier).
	Identifier string
	// Window is the length of one fixed window; it is used at millisecond
	// precision and must be at least one millisecond.
	Window time.Duration
}

// Limit is one limit to decide for a request.
type Limit struct {
	Key
	// Zone, if set, is the zone of Key.Namespace and Key.Window resolved
	// beforehand with Engine.Zone; it saves a lookup per decision, and its
	// namespace and window are used instead of Key's.
	Zone *Zone
	// Limit is the number of units admitted per sliding window (≥ 0).
	Limit int64
	// Cost is the number of units this request consumes (≥ 0).
	Cost int64
	// DryRun charges the cost whatever the verdict: the request is served,
	// so it counts. The decision still reports the verdict the limit would
	// have given, with Remaining after the charge; a would-be denial records
	// nothing (no strict mode, no first-denial notification). In a batch a
	// dry-run limit never makes the batch fail.
	DryRun bool
}

// Never is the RetryAfter of a request whose cost exceeds its limit: it can
// never pass, whatever the wait.
const Never time.Duration = -1

// Decision is the engine's answer for one limit.
type Decision struct {
	// Allowed reports whether the request passes this limit. In a batch
	// (DecideMany) it reports the limit's own verdict; the batch passes only
	// when every limit allows.
	Allowed bool
	// ChargedAnyway reports, for a batch that did not pass, a limit the
	// origin admitted and charged before another limit of the batch
	// denied: its units stay counted (a charge at the origin is not taken
	// back). False everywhere else.
	ChargedAnyway bool
	// Limit is the limit the decision was made against.
	Limit int64
	// Remaining is floor(max(0, limit − effective)) after the decision, where
	// effective = current + ⌊previous × (1 − progress)⌋; a denied or rolled back
	// request charged nothing.
	Remaining int64
	// Reset is the time until the end of the current fixed window.
	Reset time.Duration
	// RetryAfter is, for a denied limit, the earliest time after which the
	// same request would pass if no other traffic arrived; Never when its cost
	// exceeds the limit. Zero when allowed.
	RetryAfter time.Duration
}

// Origin is what the engine needs of a regional origin (Redis in
// production). Implementations do I/O only; the engine decides when to call
// them and merges what they return with max.
//
// Every write is idempotent: it carries this process's absolute total for
// the cell (Own), and the origin raises its record of this process's
// contribution to that total and adds the difference to the cell. A
// replayed write, a lost reply, two overlapping writes of one cell and an
// origin restarted empty are then no-ops or exact re-adds.
//
// The record is kept per incarnation of the cell in this process (see
// Delta.Incarnation): a key forgotten, evicted or replaced and made again
// in the same window starts a new record beside the old one, so what this
// process added to a cell never shrinks within a window, whatever happens
// to the key in memory.
type Origin interface {
	// Read returns the origin's view of the cell of key at sequence seq and
	// of the previous cell (seq − 1), with Mine the record of incarnation
	// inc; it registers inc in the cell (see Totals.Shared). The engine
	// calls it with a deadline in ctx (the read timeout) and never on a
	// denial, and it must return by that deadline: a decision that waits
	// for a read runs it on its own goroutine (a goroutine of its own for
	// every read cost a cold decision about 15 % of its CPU), so a Read
	// that outlives its ctx holds the request. An error that refused the call without sending it (an open
	// breaker) says so with a method Refused() bool (see refused): the
	// decision waited for nothing, and no read is counted.
	Read(ctx context.Context, key Key, seq int64, inc uint32) (Totals, error)
	// Flush raises, for each item, this process's contribution to the cell
	// to batch[i].Own, adds the difference to the cell, and stores the
	// results in batch[i].Totals, setting batch[i].Done for every item the
	// origin applied. Items left not Done are given back to their cells and
	// replayed later; writes being idempotent, an applied item reported not
	// Done (a lost reply) costs one repeated no-op, never a double count.
	Flush(ctx context.Context, batch []Delta) error
	// Reserve decides r at the origin, atomically: it applies r.Own as a
	// Flush would, then admits r.Cost only if the region's count, the
	// weighted previous cell, r.Global and the cost stay within r.Limit,
	// charging it in the same step. It stores the verdict and the totals in
	// r. The engine calls it with a deadline in ctx.
	Reserve(ctx context.Context, r *Reservation) error
}

// Partitioned is implemented by an origin whose keys live on partitions
// that fail apart (several Redis servers, each key on one). The engine then
// keeps its record of the origin's failures per partition: a partition
// down does not make the keys of the others decide as if the whole origin
// failed, and an answer from one of them does not make the keys of the
// dead one read it again at once. An origin that does not implement it, or
// has one partition, fails as a whole.
type Partitioned interface {
	// Partitions is how many partitions the origin has.
	Partitions() int
	// Partition is the index of key's partition, from 0 to Partitions()−1.
	// The engine asks it only while a partition fails or is suspect (see
	// read.go), from the request path.
	Partition(key Key) int
}

// maxPartitions bounds the partitions the engine tells apart: partition p
// shares the state of p mod maxPartitions (a failure there counts for
// both).
const maxPartitions = 64

// Totals is what the origin holds for a cell and the cell before it.
type Totals struct {
	// Cur and Prev are the region's totals of the cell and of the previous
	// cell, saturated at MaxCount.
	Cur, Prev int64
	// Mine is this incarnation's contribution to Cur as the origin records
	// it. Cur − Mine is what other processes (and earlier incarnations of
	// the cell in this one) added.
	Mine int64
	// Shared reports that the origin records another process in the cell,
	// even one that has added nothing yet: processes register in a cell
	// when they first read it, so that two processes starting on one key at
	// once know of each other before either has replayed a unit.
	Shared bool
	// Processes is how many process records the origin holds in the cell
	// (each process and incarnation that read or wrote it), 0 when the
	// origin does not say: near the limit each process keeps what it
	// admits unseen to its share of the room (see nearLimit).
	Processes int64
	// Global and GlobalPrev are what other regions counted in the cell and
	// in the previous cell, as the region's cross-region role left them at
	// the origin: the engine raises its imported counts to them.
	Global, GlobalPrev int64
}

// Delta is one cell's committed units that are due for replay to the origin.
type Delta struct {
	// Key and Sequence name the cell.
	Key      Key
	Sequence int64
	// Incarnation tells this cell from earlier ones of the same key and
	// sequence in this process (the key forgotten, evicted, or replaced
	// after a clock step, and made again): the origin keeps one record per
	// incarnation, so the new one's units add to the old one's instead of
	// hiding below its total. Unique per process for as long as a cell
	// lives in the origin.
	Incarnation uint32
	// Delta is the number of units committed locally since the cell's last
	// replay (for accounting; the write itself is Own).
	Delta int64
	// Own is every unit this process has committed to the cell, Delta
	// included: the absolute total the origin raises this process's
	// contribution to.
	Own int64
	// NoPrev tells the origin that the process has the previous cell's
	// final totals: the answer may leave them out (Totals.Prev and
	// GlobalPrev 0), which a merge ignores.
	NoPrev bool
	// Late tells the origin that the write may land after the other
	// processes took the cell's totals as final (see prevFinal): the cell's
	// window ended more than a slow tick and a fast one before the write
	// was sent (units held through an outage, or while the process ran
	// without an origin). The origin then makes its answers about the next
	// cell carry this one's totals again, whatever their NoPrev.
	Late bool
	// Totals is set by Flush: the cell's totals after the write, with the
	// previous cell's (unless NoPrev, and the origin has had no late write
	// to it: see Late), as a read returns them.
	Totals Totals
	// Done is set by Flush for each item the origin applied.
	Done bool

	zone *Zone
	en   *entry // the entry the cell was queued from (see Engine.flush)
	cell *cell
	fast bool // drained from the fast queue
}

// Reservation is one request decided at the origin.
type Reservation struct {
	// Key, Sequence and Incarnation name the cell, as in Delta.
	Key         Key
	Sequence    int64
	Incarnation uint32
	// Own is this process's absolute total for the cell before the request:
	// the origin raises its record to it first, as a Flush would.
	Own int64
	// Cost and Limit are the request's.
	Cost, Limit int64
	// Joined are the costs of the requests that joined this one while the
	// reservation before it was in flight. The origin decides each after
	// Cost, in order, as if they came one after another, and charges those
	// it admits in the same step.
	Joined []int64
	// Elapsed is the milliseconds elapsed in the window at the decision,
	// which weighs the previous cell: it passes with
	// cur + Global + cost + ⌊(prev + GlobalPrev) × (w − Elapsed) / w⌋ ≤ Limit.
	Elapsed int64
	// Global and GlobalPrev are the units this process imported from other
	// regions for the cell and the previous cell; the origin does not hold
	// them, but they count.
	Global, GlobalPrev int64

	// Admitted, JoinedAdmitted (one verdict per Joined cost) and Totals are
	// set by Reserve. Totals.Cur and Totals.Mine include every cost
	// admitted.
	Admitted       bool
	JoinedAdmitted []bool
	Totals         Totals
}
