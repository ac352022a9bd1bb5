package simmodel

import (
	"sort"

	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// A table keeps every row's history since the oldest view a replica may
// still read, so that a replica's read returns the rows as they were when
// it had applied the primary's changes up to then. The change log holds
// the versions in the order the primary made them (by updated_ms, the
// primary's clock), which is the order of the updated_ms index.

// rowKey is a row's unique key.
type rowKey struct {
	ns, id string
	w, seq int64
	region string
}

// less orders keys as the primary key does.
func (a rowKey) less(b rowKey) bool {
	switch {
	case a.ns != b.ns:
		return a.ns < b.ns
	case a.id != b.id:
		return a.id < b.id
	case a.w != b.w:
		return a.w < b.w
	case a.seq != b.seq:
		return a.seq < b.seq
	}
	return a.region < b.region
}

func keyOf(r *propagation.BlocklistRow) rowKey {
	return rowKey{r.Namespace, r.Identifier, r.WindowMs, r.Sequence, r.Region}
}

func countKey(r *propagation.CountRow) rowKey {
	return rowKey{r.Namespace, r.Identifier, r.WindowMs, r.Sequence, r.Region}
}

func afterKey(a *propagation.RowKey) rowKey {
	return rowKey{a.Namespace, a.Identifier, a.WindowMs, a.Sequence, a.Region}
}

// row is one row's life on the primary.
type row struct {
	key         rowKey
	first, last *version
	created     int64
	deleted     int64 // 0 while the primary holds it
}

// version is a row as one statement left it; ver and base are a count
// row's reset_version and reset_base.
type version struct {
	row                              *row
	updated                          int64
	count, cur, prev, limit, expires int64
	ver, base                        int64
	next                             *version
}

// at returns the row as it was at asOf (the row existed then).
func (x *row) at(asOf int64) *version {
	v := x.first
	for v.next != nil && v.next.updated <= asOf {
		v = v.next
	}
	return v
}

// liveAt reports whether the row existed at asOf.
func (x *row) liveAt(asOf int64) bool {
	return x.created <= asOf && (x.deleted == 0 || x.deleted > asOf)
}

// current reports whether v was the row's state at asOf.
func (v *version) current(asOf int64) bool {
	return v.updated <= asOf && (v.next == nil || v.next.updated > asOf) && (v.row.deleted == 0 || v.row.deleted > asOf)
}

type table struct {
	rows     map[rowKey]*row // live on the primary
	log      []*version
	sorted   []*row // key order, deleted rows until no view needs them
	unsorted []*row // made since the last sort
}

// insert makes a row with its first version at at.
func (t *table) insert(k rowKey, v *version, at int64) {
	x := &row{key: k, created: at, first: v, last: v}
	v.row, v.updated = x, at
	t.rows[k] = x
	t.log = append(t.log, v)
	t.unsorted = append(t.unsorted, x)
}

// rise appends v, the row's new state at at.
func (t *table) rise(x *row, v *version, at int64) {
	v.row, v.updated = x, at
	x.last.next = v
	x.last = v
	t.log = append(t.log, v)
}

// upsertCount is the store's INSERT … ON DUPLICATE KEY UPDATE: count =
// GREATEST(…), a newer reset_version replaces the row's reset, and its
// base with the larger of the write's and the row's count (the same one
// keeps the larger base), and updated_ms moves only when
// the count or the reset version rises. The model once kept neither
// reset column: every row read back as a region that cannot mark resets
// (0), and a reset marked on a count that did not rise was no change.
func (t *table) upsertCount(r *propagation.CountRow, at int64) {
	k := countKey(r)
	x := t.rows[k]
	if x == nil {
		t.insert(k, &version{count: r.Count, ver: r.ResetVersion, base: r.ResetBase, expires: r.ExpiresMs}, at)
		return
	}
	l := x.last
	l.expires = max(l.expires, r.ExpiresMs)
	base := l.base
	switch {
	case r.ResetVersion > l.ver:
		base = max(l.count, r.ResetBase)
	case r.ResetVersion == l.ver:
		base = max(base, r.ResetBase)
	}
	if r.Count > l.count || r.ResetVersion > l.ver {
		t.rise(x, &version{count: max(l.count, r.Count), ver: max(l.ver, r.ResetVersion), base: base, expires: l.expires}, at)
		return
	}
	l.base = base
}

// markReset is the store's MarkResetCounts: the rows of the key's
// region under an older reset take ver, their count as their base, and
// a change time.
func (t *table) markReset(region, ns, id string, ver, at int64) {
	var marked []*row
	for k, x := range t.rows {
		if k.region == region && k.ns == ns && k.id == id && x.last.ver < ver {
			marked = append(marked, x)
		}
	}
	// In key order, as the statement's rows: the log's order is the
	// run's, the same for every run of a seed.
	sort.Slice(marked, func(i, j int) bool { return marked[i].key.less(marked[j].key) })
	for _, x := range marked {
		l := x.last
		t.rise(x, &version{count: l.count, ver: ver, base: l.count, expires: l.expires}, at)
	}
}

// upsertDenial is the blocklist's upsert: counts rise by GREATEST, the
// limit is the newest, updated_ms moves when a count rises.
func (t *table) upsertDenial(r *propagation.BlocklistRow, at int64) {
	k := keyOf(r)
	x := t.rows[k]
	if x == nil {
		t.insert(k, &version{cur: r.CountCur, prev: r.CountPrev, limit: r.Limit, expires: r.ExpiresMs}, at)
		return
	}
	l := x.last
	l.limit = r.Limit
	l.expires = max(l.expires, r.ExpiresMs)
	if r.CountCur > l.cur || r.CountPrev > l.prev {
		t.rise(x, &version{cur: max(l.cur, r.CountCur), prev: max(l.prev, r.CountPrev), limit: r.Limit, expires: l.expires}, at)
	}
}

// changes is a read of changes as of asOf: the rows whose counts rose at
// or after r.Since, in (updated_ms, key) order, after r.After, live at
// r.Now; examined counts the index entries passed over.
func (t *table) changes(r propagation.Read, asOf int64) (out []*version, examined int64) {
	since := r.Since
	if r.After != nil {
		since = max(since, r.After.UpdatedMs)
	}
	i := sort.Search(len(t.log), func(i int) bool { return t.log[i].updated >= since })
	var cand []*version
	matches := 0
	for ; i < len(t.log); i++ {
		v := t.log[i]
		if v.updated > asOf {
			break
		}
		if matches >= r.Limit && v.updated != cand[len(cand)-1].updated {
			break
		}
		if !v.current(asOf) || (r.After != nil && !laterThan(v, r.After)) {
			continue
		}
		cand = append(cand, v)
		if v.expires > r.Now {
			matches++
		}
	}
	sort.SliceStable(cand, func(i, j int) bool {
		if cand[i].updated != cand[j].updated {
			return cand[i].updated < cand[j].updated
		}
		return cand[i].row.key.less(cand[j].row.key)
	})
	for _, v := range cand {
		examined++
		if v.expires > r.Now {
			out = append(out, v)
			if len(out) == r.Limit {
				break
			}
		}
	}
	return out, examined
}

// laterThan reports whether v comes after a in (updated_ms, key) order.
func laterThan(v *version, a *propagation.RowKey) bool {
	if v.updated != a.UpdatedMs {
		return v.updated > a.UpdatedMs
	}
	return afterKey(a).less(v.row.key)
}

// whole is a page of a whole read as of asOf: the rows live at r.Now in
// key order after r.After.
func (t *table) whole(r propagation.Read, asOf, oldest int64) (out []*version, examined int64) {
	t.sort(oldest)
	i := 0
	if r.After != nil {
		a := afterKey(r.After)
		i = sort.Search(len(t.sorted), func(i int) bool { return a.less(t.sorted[i].key) })
	}
	for ; i < len(t.sorted) && len(out) < r.Limit; i++ {
		x := t.sorted[i]
		if !x.liveAt(asOf) {
			continue
		}
		examined++
		if v := x.at(asOf); v.expires > r.Now {
			out = append(out, v)
		}
	}
	return out, examined
}

// sort merges the rows made since the last sort into the key order and
// drops the rows deleted before oldest.
func (t *table) sort(oldest int64) {
	if len(t.unsorted) == 0 {
		return
	}
	sort.Slice(t.unsorted, func(i, j int) bool { return t.unsorted[i].key.less(t.unsorted[j].key) })
	merged := make([]*row, 0, len(t.sorted)+len(t.unsorted))
	a, b := t.sorted, t.unsorted
	for len(a) > 0 || len(b) > 0 {
		var x *row
		if len(b) == 0 || (len(a) > 0 && !b[0].key.less(a[0].key)) {
			x, a = a[0], a[1:]
		} else {
			x, b = b[0], b[1:]
		}
		if x.deleted == 0 || x.deleted > oldest {
			merged = append(merged, x)
		}
	}
	t.sorted, t.unsorted = merged, nil
}

// deleteExpired deletes up to chunk rows that expired at now, in the
// expiry index's order, at the primary's time at.
func (t *table) deleteExpired(now int64, chunk int, at int64) int64 {
	var gone []*row
	for _, x := range t.rows {
		if x.last.expires <= now {
			gone = append(gone, x)
		}
	}
	sort.Slice(gone, func(i, j int) bool {
		if a, b := gone[i].last.expires, gone[j].last.expires; a != b {
			return a < b
		}
		return gone[i].key.less(gone[j].key)
	})
	if len(gone) > chunk {
		gone = gone[:chunk]
	}
	for _, x := range gone {
		x.deleted = at
		delete(t.rows, x.key)
	}
	return int64(len(gone))
}

// compact drops the versions no view needs any more: superseded, or of a
// row deleted, before oldest.
func (t *table) compact(oldest int64) {
	kept := t.log[:0]
	for _, v := range t.log {
		gone := (v.next != nil && v.next.updated <= oldest) || (v.row.deleted != 0 && v.row.deleted <= oldest)
		if !gone {
			kept = append(kept, v)
			continue
		}
		if v.row.first == v && v.next != nil {
			v.row.first = v.next
		}
	}
	clear(t.log[len(kept):])
	t.log = kept
	if len(t.unsorted) == 0 {
		// Drop deleted rows from the key order now and then too.
		t.unsorted = t.unsorted[:0]
		live := t.sorted[:0]
		for _, x := range t.sorted {
			if x.deleted == 0 || x.deleted > oldest {
				live = append(live, x)
			}
		}
		clear(t.sorted[len(live):])
		t.sorted = live
	}
}

// compact compacts both tables (m.mu held).
func (m *MySQL) compact() {
	oldest := m.oldestView(m.now())
	for _, t := range m.tables {
		t.compact(oldest)
	}
}
