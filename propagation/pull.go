package propagation

import (
	"context"
	"errors"
	"math"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// Pulls: what other regions counted. A pull reads the rows whose counts
// rose since the newest change it saw, through the updated_ms index: a
// table nobody writes costs a pull nothing. For changeMargin after a new
// newest row, pulls start changeMargin before it, for the transactions
// that commit after a later one (a row's change time is its statement's,
// not its commit's); after that, from the millisecond after it. A table is
// read whole at start, when a node takes the role, and every wholeEvery
// syncs. Each row raises, per cell and foreign region, the larger of the
// two tables' counts; the cell's imported count is their sum, handed to
// the region's Redis (where every node's round trips find it) or to this
// process's engine.

// pull reads table t's changes, or the whole table when due.
func (p *Propagator) pull(ctx context.Context, t Table) {
	if t == Counts {
		now := p.now().UnixMilli()
		var own map[Cell]struct{} // this region's rows a whole read found
		s, isSQL := p.store.(*sqlStore)
		if isSQL {
			p.mu.Lock()
			if p.fullPull[Counts] {
				own = make(map[Cell]struct{})
			}
			p.mu.Unlock()
		}
		done := pullTable(p, ctx, t, p.store.ReadCounts, (*CountRow).key, func(rows []CountRow) {
			for i := range rows {
				if own != nil && rows[i].Region == p.cfg.Region {
					own[rows[i].cell()] = struct{}{}
				}
			}
			p.applyCounts(rows, p.now().UnixMilli())
		})
		if own != nil && done {
			if s.replica {
				// A replica may not have applied a row just written:
				// what it lacks is looked for on the server writes go
				// to, and only what that lacks too is missing.
				if !p.ownRowsMissing(own, now) {
					return
				}
				if own = p.ownWrittenRows(ctx, s, now); own == nil {
					return
				}
			}
			p.checkOwnRows(own, now)
		}
	} else {
		pullTable(p, ctx, t, p.store.ReadDenials, (*BlocklistRow).key, func(rows []BlocklistRow) { p.applyBlocklist(rows, p.now().UnixMilli()) })
	}
}

// pullTable reads table t's changes, or the whole table when due, hands
// each page to apply, and reports whether it read to the end.
func pullTable[T any](p *Propagator, ctx context.Context, t Table,
	read func(context.Context, Read) ([]T, error), key func(*T) *RowKey, apply func([]T)) bool {
	p.mu.Lock()
	whole := p.fullPull[t]
	r := Read{Changed: !whole, Now: p.now().UnixMilli(), Limit: pageSize}
	if c := p.cursor[t]; !whole && c.newest != nil {
		if r.Now-c.seenAt < changeMargin.Milliseconds() {
			r.Since = c.newest.UpdatedMs - changeMargin.Milliseconds()
		} else {
			// Past the margin every row of the newest change time has
			// committed and been read: start after that time, so the
			// index range holds none of them (a resume after the newest
			// row's key would make the server read each again).
			r.Since = c.newest.UpdatedMs + 1
		}
	}
	p.mu.Unlock()
	if !readPages(p, ctx, t, r, read, key, apply) {
		return false
	}
	p.stats.lastPull[t].Store(p.now().UnixMilli())
	if whole {
		p.stats.wholeReads.Add(1)
		p.mu.Lock()
		p.fullPull[t] = false
		p.mu.Unlock()
	} else {
		p.stats.changeReads.Add(1)
	}
	return true
}

// readPages reads the pages of r (at most maxPages), hands each to apply
// and moves the table's cursor to the newest row seen. It reports
// whether it read to the end; a failed read is logged and ends the pull,
// keeping what was imported.
func readPages[T any](p *Propagator, ctx context.Context, t Table, r Read,
	read func(context.Context, Read) ([]T, error), key func(*T) *RowKey, apply func([]T)) bool {
	whole, err := eachPage(p, ctx, r, read, key, func(rows []T) {
		apply(rows)
		p.stats.rowsRead[t].Add(int64(len(rows)))
		advance(p, t, rows, key)
	})
	if err != nil {
		p.readFailed(t.what(), err)
		if !p.readsReplica() {
			p.noteSchemaGone(err)
		}
		return false
	}
	return whole
}

// eachPage reads the pages of r, at most maxPages, and hands each to
// each: the loop of a pull (readPages) and of the reads beside it, which
// move no cursor. It reports whether it read to the end, or the error of
// the read that failed.
func eachPage[T any](p *Propagator, ctx context.Context, r Read,
	read func(context.Context, Read) ([]T, error), key func(*T) *RowKey, each func([]T)) (bool, error) {
	for range maxPages {
		var rows []T
		err := p.query(ctx, func(ctx context.Context) error {
			var err error
			rows, err = read(ctx, r)
			return err
		})
		if err != nil {
			return false, err
		}
		each(rows)
		if len(rows) < r.Limit {
			return true, nil
		}
		r.After = key(&rows[len(rows)-1])
	}
	return false, nil
}

// advance moves table t's cursor to the newest of rows, if it is newer,
// leaving out rows stamped ahead of the database's clock (see checkClock).
func advance[T any](p *Propagator, t Table, rows []T, key func(*T) *RowKey) {
	p.mu.Lock()
	defer p.mu.Unlock()
	ceiling := p.dbClock.ceiling(p.now().UnixMilli())
	var newest *RowKey
	for i := range rows {
		if k := key(&rows[i]); k.UpdatedMs <= ceiling && (newest == nil || newer(k, newest)) {
			newest = k
		}
	}
	if c := &p.cursor[t]; newest != nil && (c.newest == nil || newer(newest, c.newest)) {
		c.newest, c.seenAt = newest, p.now().UnixMilli()
	}
}

// ClockStore is a Store that reads the database's clock, the one that
// stamps updated_ms (MySQL does).
type ClockStore interface {
	Clock(ctx context.Context) (int64, error)
}

// dbClock is the database's clock as last read (db), with this process's
// clock then (local); zero before the first read.
type dbClock struct{ db, local int64 }

// ceiling is the newest change time a row can carry at now (this
// process's clock), with the margin for late commits: math.MaxInt64 while
// the database's clock is unknown.
func (c dbClock) ceiling(now int64) int64 {
	if c.db == 0 {
		return math.MaxInt64
	}
	return c.db + max(now-c.local, 0) + changeMargin.Milliseconds()
}

// checkClock reads the database's clock (each global sync). The pulls of
// changes trust it to move forward: a clock that stepped back (a failover
// to a server whose clock is behind, an NTP step) stamps the rows it
// changes before the newest change seen, and the pulls missed them until
// the clock passed that time again (minutes), the others' counts arriving
// only with the whole reads. A cursor ahead of the clock now starts over:
// the next pull reads the table whole, and from then on the cursor leaves
// out rows stamped ahead of the clock (advance).
func (p *Propagator) checkClock(ctx context.Context) {
	cs, ok := p.store.(ClockStore)
	if !ok {
		return
	}
	var db int64
	if err := p.query(ctx, func(ctx context.Context) error {
		var err error
		db, err = cs.Clock(ctx)
		return err
	}); err != nil {
		p.readFailed("the database's clock", err)
		p.noteSchemaGone(err)
		return
	}
	p.noteServer()
	p.mu.Lock()
	p.dbClock = dbClock{db: db, local: p.now().UnixMilli()}
	var ahead int64
	for t := range tables {
		if c := p.cursor[t]; c.newest != nil && c.newest.UpdatedMs > db+changeMargin.Milliseconds() {
			ahead = max(ahead, c.newest.UpdatedMs-db)
			p.cursor[t] = cursor{}
			p.fullPull[t] = true
		}
	}
	p.mu.Unlock()
	if ahead > 0 {
		if c := p.stats.clockSteps.Add(1); c == 1 || c%100 == 0 {
			p.log.Warn("the database's clock is behind the newest change pulled (it stepped back: a failover, an NTP step): reading every table whole, then pulling changes from its clock on",
				zap.String("database", p.addr), zap.Duration("behind", time.Duration(ahead)*time.Millisecond), zap.Int64("clock_steps", c))
		}
	}
}

// ServerStore is a ClockStore that names the server writes go to, as
// its last clock read found it (MySQL's server_id; "" when unknown).
type ServerStore interface {
	Server() string
}

// noteServer records which server answers for the database, as the last
// clock read found it. Another one than before is a failover, or the
// database restored or replaced: rows the old server held may be missing
// on the new one (a promoted replica holds what it had applied, not what
// the primary last committed). A cell was published again only when its
// count grew, so a count that stood still after a failover never reached
// the new primary, and the other regions, reading it, left its units out
// for the rest of the window. Now every cell worth publishing is
// published again (a holder takes every registration and override of its
// region again) and every table is read whole from the new server; the
// upserts only raise rows, so what the new server kept counts once.
func (p *Propagator) noteServer() {
	ss, ok := p.store.(ServerStore)
	if !ok {
		return
	}
	id := ss.Server()
	if id == "" {
		return
	}
	p.mu.Lock()
	was := p.server
	p.server = id
	changed := was != "" && id != was
	if changed {
		p.publishAgainLocked()
	}
	p.mu.Unlock()
	if changed {
		p.log.Warn("another server answers for the database (a failover, a restore): publishing every cell again and reading every table whole",
			zap.String("database", p.addr), zap.String("server_id", id), zap.String("was", was))
	}
}

// publishAgainLocked makes the next pushes publish every cell worth it
// again, whether or not it grew (a holder takes every registration and
// override of its region again), and the next pulls read every table
// whole: the database lost rows this process wrote (noteServer,
// remigrate). The upserts only raise rows, so what the database kept
// counts once. p.mu is held.
func (p *Propagator) publishAgainLocked() {
	p.fullPush, p.republish = true, true
	p.pushes++
	p.fullPull = [tables]bool{true, true, true}
	p.cursor = [tables]cursor{}
	if p.region != nil {
		p.fullTake, p.ovTakeAll = true, true
		for _, r := range p.reg {
			r.published, r.publishedReset = 0, 0
		}
	}
}

// newer orders rows as a pull of changes reads them: by change time, then
// by key.
func newer(a, b *RowKey) bool {
	if a.UpdatedMs != b.UpdatedMs {
		return a.UpdatedMs > b.UpdatedMs
	}
	return compareKeys(a, b) > 0
}

func (p *Propagator) readFailed(what string, err error) {
	if errors.Is(err, errLeaseLost) || p.stopped(err) {
		return
	}
	if c := p.stats.readErrors.Add(1); c == 1 || c%100 == 0 {
		p.log.Warn("mysql read failed: keeping the imported counts we have",
			zap.String("what", what), zap.String("database", p.addr), zap.Int64("read_errors", c), zap.Error(err))
	}
}

// update is an import to hand to the engine once p.mu is released (the
// engine may call EntryCreated, which takes it).
type update struct {
	key      engine.Key
	seq, sum int64
	create   bool
	own      bool
	// wait: the key is not held here yet; the import waits in the map.
	wait bool
}

// zoneWindow is a zone and a window length (ms) another region counts
// it over.
type zoneWindow struct {
	ns string
	w  int64
}

// maxMismatched bounds the zone windows windowMismatch remembers.
const maxMismatched = 1024

// windowMismatch logs, once per zone and window, a foreign row of a zone
// this config counts over other windows: the cell it names is one no
// request here weighs, so the regions count the zone apart and together
// admit each region's limit, and without a word that said why.
func (p *Propagator) windowMismatch(ns string, windowMs int64, region string) {
	if p.cfg.Windows == nil || region == p.cfg.Region {
		return
	}
	k := zoneWindow{ns, windowMs}
	p.mu.Lock()
	seen := p.mismatched[k]
	p.mu.Unlock()
	if seen {
		return
	}
	here := p.cfg.Windows(ns)
	w := time.Duration(windowMs) * time.Millisecond
	if len(here) == 0 || slices.Contains(here, w) {
		return
	}
	first := firstOf(&p.mu, &p.mismatched, k)
	if first {
		p.log.Warn("another region counts a zone over a window this region does not: its counts of the zone count nowhere here, and the regions together admit each one's limit; give the zone the same window in every region",
			zap.String("zone", ns), zap.String("region", region), zap.Duration("window", w), zap.Durations("windows_here", here))
	}
}

// firstOf records k in the set *m (made when nil) and reports whether it
// was not there, so that what is logged once per k is; the set holds at
// most maxMismatched keys, past which nothing is first. It holds mu,
// which guards *m.
func firstOf[K comparable](mu *sync.Mutex, m *map[K]bool, k K) bool {
	mu.Lock()
	defer mu.Unlock()
	if *m == nil {
		*m = map[K]bool{}
	}
	if (*m)[k] || len(*m) >= maxMismatched {
		return false
	}
	(*m)[k] = true
	return true
}

// MaxRowWindow is the longest window a row may name, as a zone's window
// may be no longer (the root's maxWindow). A longer one counts nowhere,
// and one of 2^62 ms or more overflows a time.Duration: a row that named
// one once became a zero-length window, by which the import divided, and
// the panic killed the process of every region that read it.
const MaxRowWindow = 3650 * 24 * time.Hour

// badWindow reports a row whose window no zone can have, and logs the
// first such row of each region: not written by this layer (another
// tool, a corrupt restore).
func (p *Propagator) badWindow(windowMs int64, region string) bool {
	if windowMs <= MaxRowWindow.Milliseconds() {
		return false
	}
	first := firstOf(&p.mu, &p.badWindows, region)
	if first {
		p.log.Warn("a row names a window no zone can have (over ten years): its rows are skipped; something other than this layer writes the tables",
			zap.String("region", region), zap.Int64("window_ms", windowMs))
	}
	return true
}

// otherForm reports whether a row's identifier is of another form than
// this config's (Config.OwnID), and logs the first such row of each
// region: its region has no identifier_secret, or another one.
func (p *Propagator) otherForm(id, region string) bool {
	if p.cfg.OwnID == nil || p.cfg.OwnID(id) {
		return false
	}
	first := firstOf(&p.mu, &p.otherForms, region)
	if first {
		p.log.Warn("another region's rows name identifiers that are not HMACs under this region's identifier_secret: its counts are skipped here; give every region the same secret",
			zap.String("region", region))
	}
	return true
}

// applyCounts merges published counts into the imports.
func (p *Propagator) applyCounts(rows []CountRow, now int64) {
	var ups []update
	for i := range rows {
		r := &rows[i]
		if r.ExpiresMs <= now || r.WindowMs < p.cfg.MinWindow.Milliseconds() || p.badWindow(r.WindowMs, r.Region) ||
			p.otherForm(r.Identifier, r.Region) {
			continue
		}
		p.windowMismatch(r.Namespace, r.WindowMs, r.Region)
		// The lock is taken per row: EntryCreated takes it on the request
		// path and must never wait for a whole page.
		p.mu.Lock()
		u, ok := p.mergeLocked(r.cell(), r.Region, regionPart{count: r.Count, ver: r.ResetVersion, base: r.ResetBase}, r.ExpiresMs)
		p.mu.Unlock()
		if ok {
			ups = append(ups, u)
			p.stats.countsApplied.Add(1)
		}
	}
	p.hand(ups)
}

// applyBlocklist merges denial rows: count_cur into the row's own
// sequence, count_prev into the one before.
func (p *Propagator) applyBlocklist(rows []BlocklistRow, now int64) {
	var ups []update
	for i := range rows {
		r := &rows[i]
		if r.ExpiresMs <= now || r.WindowMs < p.cfg.MinWindow.Milliseconds() || p.badWindow(r.WindowMs, r.Region) ||
			p.otherForm(r.Identifier, r.Region) {
			continue
		}
		p.windowMismatch(r.Namespace, r.WindowMs, r.Region)
		p.mu.Lock() // per row, as in applyCounts
		applied := false
		if u, ok := p.mergeLocked(r.cell(), r.Region, regionPart{denied: r.CountCur}, r.ExpiresMs); ok {
			ups, applied = append(ups, u), true
		}
		// The previous cell weighs until the row's own window ends, a
		// window before the row expires: past that, prune took it, and
		// each whole read made it anew as news (the listing showed the
		// row ten times, and a region with Redis queued an import of a
		// window gone).
		if prevExpires := r.ExpiresMs - r.WindowMs; r.CountPrev > 0 && prevExpires > now {
			prev := r.cell()
			prev.Sequence--
			if u, ok := p.mergeLocked(prev, r.Region, regionPart{denied: r.CountPrev}, prevExpires); ok {
				ups, applied = append(ups, u), true
			}
		}
		if applied && r.Region != p.cfg.Region {
			p.stats.denialsApplied.Add(1)
			p.recentIn = appendRecent(p.recentIn, *r)
		}
		p.mu.Unlock()
	}
	p.hand(ups)
}

// mergeLocked records what region counted in cell c (one row's part: a
// published count with its reset, or a denial's count) and returns the
// engine update it calls for, if it is news. A region's own rows never
// come back as foreign: a process of its own region raises its regional
// count with them (it restarted, or another of its processes wrote them);
// a region with Redis has its total there and skips them. Foreign ones
// are kept per region: the region's Redis gets their sum, or each part
// for a cell some region reset (importDue), the engine their sum. p.mu is
// held.
func (p *Propagator) mergeLocked(c Cell, region string, in regionPart, expires int64) (update, bool) {
	n := in.counted()
	if n <= 0 && in.ver <= 0 {
		return update{}, false
	}
	raw, known := c.Identifier, true
	if p.cfg.MapID != nil && p.region == nil {
		raw, known = p.index[zoneID{c.Namespace, c.Identifier, c.WindowMs}]
	}
	key := engine.Key{Namespace: c.Namespace, Identifier: raw, Window: time.Duration(c.WindowMs) * time.Millisecond}
	if region == p.cfg.Region {
		if p.region != nil && in.ver > MarksResets {
			if o := p.own[c]; o != nil && o.ver <= in.ver {
				o.base = max(o.base, in.base)
				if o.ver < in.ver {
					o.base = in.base
				}
				o.ver, o.expires = in.ver, max(o.expires, expires)
			} else if o == nil && len(p.own) < maxImports {
				p.own[c] = &ownMark{ver: in.ver, base: in.base, expires: expires}
			}
		}
		if !known || p.region != nil || n <= 0 {
			return update{}, false
		}
		return update{key: key, seq: c.Sequence, sum: n, own: true}, true
	}
	ci := p.imports[c]
	if ci == nil {
		if len(p.imports) >= maxImports {
			p.stats.importDrops.Add(1)
			return update{}, false
		}
		ci = &cellImport{regions: make(map[string]*regionPart, 2), expires: expires}
		p.imports[c] = ci
		p.importCount.Store(int64(len(p.imports)))
	}
	r := ci.regions[region]
	if r == nil {
		r = new(regionPart)
		ci.regions[region] = r
	}
	// News is what changes a count anyone weighs: the larger of the two
	// tables' counts, or a newer reset (with its base; the same one, the
	// larger base: one mark, so one base, and a retry), or, once the
	// region published a reset, its published count on its own.
	was := r.counted()
	rose := in.count > r.count
	r.count, r.denied = max(r.count, in.count), max(r.denied, in.denied)
	news := r.counted() > was || (rose && r.ver > MarksResets)
	if in.ver > r.ver || (in.ver == r.ver && in.base > r.base) {
		r.ver, r.base, news = in.ver, in.base, true
	}
	ci.withParts = ci.withParts || r.ver > MarksResets
	if !news {
		return update{}, false
	}
	ci.changes++
	ci.expires = max(ci.expires, expires)
	if p.region != nil {
		p.importDue[c] = struct{}{}
		return update{wait: true}, true
	}
	if !known {
		// Waits in the map until the key's entry is created here.
		return update{wait: true}, true
	}
	return update{key: key, seq: c.Sequence, sum: ci.sum(), create: p.cfg.MapID == nil}, true
}

// hand applies updates to the engine. An import for a window that has not
// begun on this node's clock (the other region's clock is ahead, or this
// one behind) waits until it begins here: the engine holds no cell ahead
// of its clock, and the count, recorded as imported, would not be news to
// the next pull.
func (p *Propagator) hand(ups []update) {
	now := p.now().UnixMilli()
	for _, u := range ups {
		if u.wait {
			continue
		}
		if u.own {
			p.eng.RaiseRegional(u.key, u.seq, u.sum)
			continue
		}
		if u.seq > now/u.key.Window.Milliseconds() {
			p.defer_(u)
			continue
		}
		p.eng.ImportGlobal(u.key, u.seq, u.sum, u.create)
	}
}

// defer_ keeps u, an import for a window ahead of this node's clock, for
// handDue; a later import of the same cell replaces it (sums only grow).
func (p *Propagator) defer_(u update) {
	c := Cell{u.key.Namespace, u.key.Identifier, u.key.Window.Milliseconds(), u.seq}
	p.mu.Lock()
	if len(p.ahead) < maxImports {
		p.ahead[c] = u
	}
	p.mu.Unlock()
}

// handDue applies the imports kept for windows that have begun here since,
// and forgets those whose window has passed.
func (p *Propagator) handDue() {
	now := p.now().UnixMilli()
	var due []update
	p.mu.Lock()
	for c, u := range p.ahead {
		switch cur := now / c.WindowMs; {
		case u.seq <= cur-2:
			delete(p.ahead, c)
		case u.seq <= cur:
			due = append(due, u)
			delete(p.ahead, c)
		}
	}
	p.mu.Unlock()
	for _, u := range due {
		p.eng.ImportGlobal(u.key, u.seq, u.sum, u.create)
	}
}

// sendImports hands the imported counts that changed to the region's
// Redis, a chunk at a time; a chunk that fails is sent again on the next
// flush.
func (p *Propagator) sendImports(ctx context.Context) {
	p.mu.Lock()
	ims := make([]RegionImport, 0, len(p.importDue))
	changes := make([]int64, 0, len(p.importDue))
	for c := range p.importDue {
		if ci := p.imports[c]; ci != nil {
			im := RegionImport{Cell: c, Count: ci.sum()}
			if ci.withParts {
				im.Parts = ci.parts()
			}
			ims = append(ims, im)
			changes = append(changes, ci.changes)
		} else {
			delete(p.importDue, c)
		}
	}
	p.mu.Unlock()
	for lo := 0; lo < len(ims); lo += regionChunk {
		part := ims[lo:min(lo+regionChunk, len(ims))]
		if err := p.query(ctx, func(ctx context.Context) error { return p.region.Import(ctx, part) }); err != nil {
			p.regionFailed("handing imported counts to the region", err)
			continue
		}
		p.mu.Lock()
		for j, im := range part {
			ci := p.imports[im.Cell]
			switch {
			case ci != nil && im.WantsParts:
				ci.withParts = true // stays due, to go part by part
			case ci == nil || ci.changes == changes[lo+j]:
				delete(p.importDue, im.Cell) // unless it changed meanwhile
			}
		}
		p.mu.Unlock()
		p.stats.importsSent.Add(int64(len(part)))
	}
}

// prune forgets expired imports and index entries of keys the engine no
// longer holds.
func (p *Propagator) prune(now int64) {
	p.mu.Lock()
	for c, ci := range p.imports {
		if ci.expires <= now {
			delete(p.imports, c)
			delete(p.importDue, c)
		}
	}
	p.importCount.Store(int64(len(p.imports)))
	for c, o := range p.own {
		if o.expires <= now {
			delete(p.own, c)
		}
	}
	// A map keeps the room of its largest size: after a flood drained,
	// the layer's empty maps held 65 MB (an audit, 190,000 keys). An
	// empty one is made anew.
	renew(&p.pending)
	renew(&p.taken)
	renew(&p.reg)
	renew(&p.imports)
	renew(&p.own)
	renew(&p.importDue)
	renew(&p.ahead)
	renew(&p.ovPending)
	idx := make([]zoneID, 0, len(p.index))
	raws := make([]string, 0, len(p.index))
	for z, raw := range p.index {
		idx = append(idx, z)
		raws = append(raws, raw)
	}
	p.mu.Unlock()
	p.member.Lock()
	renew(&p.member.registered)
	renew(&p.member.unput)
	p.member.Unlock()
	var gone []zoneID
	for i, z := range idx {
		if !p.eng.HasEntry(engine.Key{Namespace: z.ns, Identifier: raws[i], Window: time.Duration(z.w) * time.Millisecond}) {
			gone = append(gone, z)
		}
	}
	if len(gone) == 0 {
		return
	}
	p.mu.Lock()
	for _, z := range gone {
		delete(p.index, z)
	}
	p.mu.Unlock()
}

// renew makes *m anew when it is empty, giving back the room it grew to.
func renew[K comparable, V any](m *map[K]V) {
	if len(*m) == 0 {
		*m = make(map[K]V)
	}
}

// ForeignCounts returns, for the cell (key, seq), what each foreign region
// counted, as imported; nil when nothing was, or when another node of
// the region holds the role (only the holder pulls the rows). A region
// that published a global reset counts from its mark (count − base), as
// the region's Redis weighs it once this region marked the same reset.
func (p *Propagator) ForeignCounts(key engine.Key, seq int64) map[string]int64 {
	if p.role.Load() == roleMember {
		return nil // the holder pulls the rows: what this node pulled when it held the role is stale
	}
	c := Cell{key.Namespace, p.rowID(key.Identifier), key.Window.Milliseconds(), seq}
	p.mu.Lock()
	defer p.mu.Unlock()
	ci := p.imports[c]
	if ci == nil {
		return nil
	}
	out := make(map[string]int64, len(ci.regions))
	for name, r := range ci.regions {
		out[name] = r.counted()
		if r.ver > MarksResets {
			out[name] = max(r.count-r.base, 0)
		}
	}
	return out
}
