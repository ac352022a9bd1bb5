package ratelimit

import (
	"context"
	"encoding/json"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/origin"
	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// Runtime overrides: operators change a key's limit through the admin API
// (overrides_admin.go), without a reload. Precedence: a runtime override,
// then the Caddyfile's override line, then the zone's limit.
//
// The process keeps one book of them (it outlives reloads). Where a
// change is stored follows the backends: with MySQL, every region
// (ratelimit_overrides, carried by the region's role holder like the
// counts); with Redis only, the region (a hash in its Redis, whose every
// change is announced to the region's nodes: overrides_sync.go);
// local-only, this process. Every change has a version (its time in µs
// on the region's clock: regionClock), and every copy keeps the newest,
// so nodes that hear changes in different orders end the same. Expiry is
// judged on the region's clock too.

// overrideRec is one override, or its removal.
type overrideRec struct {
	Zone string `json:"zone,omitempty"`
	// Identifier is as the handler counts it (an IP masked to its
	// prefix, a long one hashed), an HMAC under identifier_secret.
	Identifier string `json:"identifier,omitempty"`
	Limit      int64  `json:"limit"`
	// ExpiresMs is when it lapses (Unix ms), 0 never; a removal lapses a
	// day after it was made, once every region had time to read it.
	ExpiresMs int64  `json:"expires_ms,omitempty"`
	Reason    string `json:"reason,omitempty"`
	Region    string `json:"region,omitempty"`
	CreatedMs int64  `json:"created_ms"`
	Version   int64  `json:"version"`
	Deleted   bool   `json:"deleted,omitempty"`
	// Reset makes this record a reset of the key (reset.go), not an
	// override: it travels the same way, under a name of its own.
	Reset bool `json:"reset,omitempty"`
	// Global: a reset for every region (scope global), which the role's
	// holder writes to MySQL; a region's own reset stays in the region.
	Global bool `json:"global,omitempty"`
	// Form says which identifier_secret Identifier is an HMAC under
	// (identities.form), "" for one stored as it is, or by a build before
	// forms (which applies under any setting, as it did). It is part of
	// the name, never of the value, so that an override made under one
	// secret never applies under another or none: without it, an HMAC
	// named under a secret removed since would be the raw identifier that
	// is its text.
	Form string `json:"-"`
}

// resetMark starts the zone part of a reset's name (in the region's hash
// and in MySQL): no zone name holds it, so a reset never takes an
// override's place. formMark follows the zone when the identifier is an
// HMAC, with the form after it (9 bytes: a reset's name fits MySQL's 80).
// A build before forms takes such a name for a zone no config defines,
// and leaves it alone. regionResetMark follows resetMark in the name of
// a reset of the region alone, which never leaves the region's hash: a
// region reset made after a global one of the same key, before the role's
// holder took the global one for MySQL, once replaced it under their one
// name, and the holder, which reads what a queued name holds when it
// takes it, found a region reset and wrote nothing: the global reset
// reached no other region
// (TestReset_ARegionResetRightAfterAGlobalOneLeavesItToTravel). A build
// before this mark names region resets as global ones (their record says
// which), and takes one named so for a zone no config defines.
const (
	resetMark       = propagation.ResetMark // MySQL's cleanup tells resets by it
	formMark        = "\x02"
	regionResetMark = "\x03"
)

// bookZone is the zone part of r's name.
func (r *overrideRec) bookZone() string {
	z := r.Zone
	if r.Form != "" {
		z += formMark + r.Form
	}
	switch {
	case r.Reset && !r.Global:
		return resetMark + regionResetMark + z
	case r.Reset:
		return resetMark + z
	}
	return z
}

// fromBookZone splits a name's zone part into the zone, whether it names
// a reset, whether the name is a region reset's (regionResetMark), and
// the identifier's form.
func fromBookZone(z string) (zone string, reset, regionOnly bool, form string) {
	z, reset = strings.CutPrefix(z, resetMark)
	if reset {
		z, regionOnly = strings.CutPrefix(z, regionResetMark)
	}
	zone, form, _ = strings.Cut(z, formMark)
	return zone, reset, regionOnly, form
}

// tombstoneLife is how long a removal is kept, so that every region reads
// it before it lapses.
const tombstoneLife = 24 * time.Hour

// forgetMs is when the region's Redis may forget r (Unix ms; r has an
// expiry). A removal or a reset, when it lapses: a removal lapses a day
// after it was made already. An override that expires, a day after it
// lapsed, as a removal is kept: until then its record tells a node that
// did not hear of it while it was live (its Redis did not answer it)
// that it replaced the override the node still holds. Dropped as it
// lapsed, it left that node applying the older override for good, where
// the others applied the zone's limit
// (TestOverrides_ANodeCutOffWhileAChangeLapsedDropsWhatItReplaced).
// Nodes do not apply it meanwhile (live), nor keep it in their books
// (overrideBook.prune).
func (r *overrideRec) forgetMs() int64 {
	if r.Deleted || r.Reset {
		return r.ExpiresMs
	}
	// Saturated: a row whose expiry is near the largest time (written by
	// hand, or hostile) would wrap to the past and be dropped while live.
	return engine.SatAdd(r.ExpiresMs, tombstoneLife.Milliseconds())
}

// after reports whether r is a later change than old: a newer version,
// or the same one made in a region whose name sorts after old's (two
// regions' operators who changed the key at once past the same held
// version), as MySQL and the region's Redis order them.
func (r *overrideRec) after(old *overrideRec) bool {
	return r.Version > old.Version || r.Version == old.Version && r.Region > old.Region
}

// live reports whether r applies at now (Unix ms).
func (r *overrideRec) live(now int64) bool {
	return !r.Deleted && (r.ExpiresMs == 0 || r.ExpiresMs > now)
}

// field is r's name in the region's hash: zone and identifier, which a
// zone name (no NUL) cannot blur.
func (r *overrideRec) field() string { return r.bookZone() + "\x00" + r.Identifier }

// regionValue is r as the region's hash holds it. Zone and identifier
// are the field, bytes as they are (JSON would mangle an identifier that
// is not UTF-8); the value is the rest, in JSON.
func (r *overrideRec) regionValue() origin.Override {
	v := *r
	v.Zone, v.Identifier, v.Reset = "", "", false
	b, _ := json.Marshal(v) // strings and numbers always encode
	return origin.Override{Field: r.field(), Version: r.Version, Value: string(b)}
}

func recOfRegion(o origin.Override) (overrideRec, bool) {
	var r overrideRec
	zone, id, ok := strings.Cut(o.Field, "\x00")
	if !ok || json.Unmarshal([]byte(o.Value), &r) != nil || r.Zone != "" || r.Identifier != "" || r.Reset {
		return r, false
	}
	var regionOnly bool
	r.Zone, r.Reset, regionOnly, r.Form = fromBookZone(zone)
	if regionOnly {
		r.Global = false
	}
	r.Identifier, r.Version = id, o.Version
	return r, true
}

// row is r as ratelimit_overrides holds it. A reset has no limit: its
// row's limit column carries when it was made (Unix ms), which its
// version does not say when the reset had to come after a newer change
// of the key (made on a node whose clock runs ahead); the windows it
// clears are those of when it was made (resetSeq). A row without it (a
// build before) is read as made at its version.
func (r *overrideRec) row() propagation.OverrideRow {
	limit := r.Limit
	if r.Reset {
		limit = r.CreatedMs
	}
	return propagation.OverrideRow{Namespace: r.bookZone(), Identifier: r.Identifier, Limit: limit, ExpiresMs: r.ExpiresMs,
		Reason: r.Reason, Region: r.Region, Version: r.Version, Deleted: r.Deleted}
}

func recOfRow(o *propagation.OverrideRow) overrideRec {
	zone, reset, _, form := fromBookZone(o.Namespace)
	limit, created := o.Limit, o.Version/1000
	if reset {
		if limit > 0 {
			created = limit
		}
		limit = 0
	}
	return overrideRec{Zone: zone, Identifier: o.Identifier, Limit: limit, ExpiresMs: o.ExpiresMs,
		Reason: o.Reason, Region: o.Region, CreatedMs: created, Version: o.Version, Deleted: o.Deleted, Reset: reset, Global: reset, Form: form}
}

// regionClock is the clock overrides are judged and stamped on: the
// engine's, which is the region's (Redis's, as the heartbeats measure it)
// with Redis and the process's without, or the process's while no engine
// runs. On the process's clock, two nodes of a region whose clocks were
// 30 s apart disagreed for 30 s on whether an override with an expiry
// applied: the node ahead took it for lapsed as it heard of it
// (TestOverrides_ANodeAheadAppliesAnOverrideUntilTheRegionsExpiry), the
// node behind applied it 30 s past it
// (TestOverrides_ANodeBehindStopsApplyingAnOverrideAtTheRegionsExpiry).
type regionClock struct{ e atomic.Pointer[engine.Engine] }

// nowMs is the clock in Unix ms. The request path reads it when an
// override it found has an expiry: an atomic load and the engine's clock.
func (c *regionClock) nowMs() int64 {
	if e := c.e.Load(); e != nil {
		return e.NowMs()
	}
	return time.Now().UnixMilli()
}

// use makes e's clock the overrides' (acquireState).
func (c *regionClock) use(e *engine.Engine) { c.e.Store(e) }

// drop goes back to the process's clock when e, closed, was the one used.
func (c *regionClock) drop(e *engine.Engine) { c.e.CompareAndSwap(e, nil) }

// overrideKey names an override in the book.
type overrideKey struct{ zone, id string }

// overrideSet is what the request path reads: the live overrides by zone
// and identifier, immutable once published.
type overrideSet struct {
	zones map[string]map[string]overrideLimit
	// mapID turns an identifier into the form they are stored in (an
	// HMAC under identifier_secret); nil when stored as they are.
	mapID func(string) string
	// n is how many overrides it holds, live when it was built.
	n int
	// clock judges the overrides' expiry: the book's.
	clock *regionClock
}

type overrideLimit struct {
	limit, expiresMs int64
	// formed: the override names its form, and wins over one of the same
	// identifier by a build before forms.
	formed bool
}

// limit returns the runtime override of zone for the handler's
// identifier id (masked, not normalized yet), if one applies now.
func (s *overrideSet) limit(zone, id string) (int64, bool) {
	zm := s.zones[zone]
	if zm == nil {
		return 0, false
	}
	// NormalizeIdentifier is not inlined: the call only when it hashes.
	if len(id) > engine.MaxIdentifierLen {
		id = engine.NormalizeIdentifier(id)
	}
	return s.find(zm, id)
}

// limitNormalized is limit for an identifier normalized already, as the
// engine keeps it (a key's, which the counters route shows). It is not
// normalized again: a hashed identifier is 65 bytes, and hashing it
// again would find the override of the raw identifier that is the
// hash's text, another key.
func (s *overrideSet) limitNormalized(zone, norm string) (int64, bool) {
	zm := s.zones[zone]
	if zm == nil {
		return 0, false
	}
	return s.find(zm, norm)
}

// find looks up the normalized identifier norm in a zone's overrides.
func (s *overrideSet) find(zm map[string]overrideLimit, norm string) (int64, bool) {
	if s.mapID != nil {
		norm = s.mapID(norm)
	}
	o, ok := zm[norm]
	if !ok || (o.expiresMs != 0 && s.clock.nowMs() >= o.expiresMs) {
		return 0, false
	}
	return o.limit, true
}

// overrideBook is the process's overrides: every override and removal it
// knows, newest version of each, and the set the request path reads.
type overrideBook struct {
	mu   sync.Mutex
	recs map[overrideKey]overrideRec
	// mapID is the identifier mapping of the newest app, form its form
	// (identities.form): the records of another form do not apply.
	mapID func(string) string
	form  string
	// from is where the book's overrides come from: the Redis it last
	// loaded (origin.Redis.Placement), sourceNode while the process counts
	// alone, "" before either.
	from string

	// clock is the region's clock, which every record is judged on.
	clock regionClock

	set atomic.Pointer[overrideSet]
	// loading is set while a process's first load from its backends runs:
	// decisions wait for it (at most loadTimeout), so a restarted node
	// applies the overrides from its first decision.
	loading atomic.Bool
	loaded  chan struct{}
	once    bool // the first load was started

	changes atomic.Int64 // changes that took, any source

	// changing serialises the admin API's changes of overrides on this
	// node, each from its precondition's check to its record in the book,
	// so that two conditional changes of one override never both pass.
	// It is held across the store's round trip (at most a second): admin
	// changes are few.
	changing sync.Mutex
}

// loadTimeout bounds how long decisions wait for the first load.
const loadTimeout = 2 * time.Second

// overrides is the process's book; it outlives reloads.
var overrides = &overrideBook{recs: map[overrideKey]overrideRec{}}

// merge takes recs that are newer than what the book holds and republishes
// the set; it returns how many took.
// Resets that took are handed to onResets (reset.go), after the book is
// unlocked.
func (b *overrideBook) merge(recs []overrideRec) int {
	b.mu.Lock()
	n := 0
	var resets []overrideRec
	for _, r := range recs {
		k := overrideKey{r.bookZone(), r.Identifier}
		if old, ok := b.recs[k]; ok && !r.after(&old) {
			continue
		}
		b.recs[k] = r
		n++
		if r.Reset {
			resets = append(resets, r)
		}
	}
	if n > 0 {
		b.changes.Add(int64(n))
		b.publishLocked()
	}
	b.mu.Unlock()
	if len(resets) > 0 {
		onResets(resets)
	}
	return n
}

// get returns the book's override of (zone, id) in the current form,
// removals included, or one by a build before forms, the live one first.
func (b *overrideBook) get(zone, id string) (overrideRec, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	r, ok := b.recs[overrideKey{(&overrideRec{Zone: zone, Form: b.form}).bookZone(), id}]
	if b.form != "" && (!ok || !r.live(b.clock.nowMs())) {
		if old, found := b.recs[overrideKey{zone, id}]; found && (!ok || old.live(b.clock.nowMs())) {
			return old, true
		}
	}
	return r, ok
}

// heardFrom reports whether the book holds the global reset rec, or a
// later one of its key, heard from source (origin.Redis.Placement): the
// region there recorded it, and marked its cells before it did. A region
// reset of the key (a build before regionResetMark kept it under the same
// name) says nothing of the global one's marks.
func (b *overrideBook) heardFrom(rec overrideRec, source string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	old, ok := b.recs[overrideKey{rec.bookZone(), rec.Identifier}]
	return ok && b.from == source && old.Reset && old.Global && !rec.after(&old)
}

// olderForm returns the live override of (zone, id) by a build before
// forms, when the book's form is a secret's: a change of the key under
// the secret removes it too, so that one change does what it says.
func (b *overrideBook) olderForm(zone, id string) (overrideRec, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.form == "" {
		return overrideRec{}, false
	}
	r, ok := b.recs[overrideKey{zone, id}]
	return r, ok && r.live(b.clock.nowMs())
}

// applies reports whether r is of the book's form, or of no form (a
// build before forms). Under a secret, a record of no form applies only
// when its identifier could be an HMAC: one stored raw (set before the
// secret was added, or in a region without it) never matches a request,
// which is looked up by its HMAC, and listing it would show the raw
// identifier.
func (b *overrideBook) applies(r *overrideRec) bool {
	switch r.Form {
	case b.form:
		return true
	case "":
		return isHMAC(r.Identifier)
	}
	return false
}

// live returns the live overrides of zone whose stored identifier starts
// with prefix, in no order.
func (b *overrideBook) live(zone, prefix string) []overrideRec {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.clock.nowMs()
	var out []overrideRec
	for k, r := range b.recs {
		if r.Zone == zone && !r.Reset && b.applies(&r) && strings.HasPrefix(k.id, prefix) && r.live(now) {
			out = append(out, r)
		}
	}
	return out
}

// setMapping makes mapID the identifiers' stored form (identifier_secret),
// of the form given.
func (b *overrideBook) setMapping(mapID func(string) string, form string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.mapID, b.form = mapID, form
	b.publishLocked()
}

// sourceNode is the book's source while the process has no Redis.
const sourceNode = "node"

// source returns where the book's overrides come from.
func (b *overrideBook) source() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.from
}

// setSource records where the book's overrides come from.
func (b *overrideBook) setSource(from string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.from = from
}

// replace makes recs the book (a node joining a region: see
// regionWatch.join), from the source given, and returns how many live
// overrides and resets it held that recs do not hold, or hold in another
// version: the region's wins, older or newer. Resets it had not heard of
// go to onResets, as merge's do.
func (b *overrideBook) replace(recs []overrideRec, from string) int {
	now := b.clock.nowMs()
	b.mu.Lock()
	next := make(map[overrideKey]overrideRec, len(recs))
	var resets []overrideRec
	for _, r := range recs {
		k := overrideKey{r.bookZone(), r.Identifier}
		if old, ok := b.recs[k]; (!ok || old.Version < r.Version) && r.Reset {
			resets = append(resets, r)
		}
		next[k] = r
	}
	dropped := 0
	for k, r := range b.recs {
		if n, ok := next[k]; (!ok || n.Version != r.Version) && r.live(now) {
			dropped++
		}
	}
	b.recs, b.from = next, from
	b.changes.Add(1)
	b.publishLocked()
	b.mu.Unlock()
	if len(resets) > 0 {
		onResets(resets)
	}
	return dropped
}

// form is the current form of stored identifiers.
func (b *overrideBook) currentForm() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.form
}

// prune forgets what lapsed (removals a day old included) and republishes
// when anything went; it returns what went.
func (b *overrideBook) prune(now int64) []overrideRec {
	b.mu.Lock()
	defer b.mu.Unlock()
	var gone []overrideRec
	for k, r := range b.recs {
		if r.ExpiresMs != 0 && r.ExpiresMs <= now {
			gone = append(gone, r)
			delete(b.recs, k)
		}
	}
	if len(gone) > 0 {
		b.publishLocked()
	}
	return gone
}

// republish rebuilds the request path's set on the clock of now: the
// set holds what was live when it was built, and an override that had
// lapsed then on a clock since stepped back (a node's first measurement
// of Redis's clock, behind its own) applies again.
func (b *overrideBook) republish() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.publishLocked()
}

// publishLocked rebuilds the request path's set from the live overrides.
func (b *overrideBook) publishLocked() {
	now := b.clock.nowMs()
	s := &overrideSet{zones: map[string]map[string]overrideLimit{}, mapID: b.mapID, clock: &b.clock}
	for k, r := range b.recs {
		if r.Reset || !r.live(now) || !b.applies(&r) {
			continue
		}
		zm := s.zones[r.Zone]
		if zm == nil {
			zm = map[string]overrideLimit{}
			s.zones[r.Zone] = zm
		}
		if old, ok := zm[k.id]; ok {
			if old.formed {
				continue
			}
			s.n--
		}
		zm[k.id] = overrideLimit{limit: r.Limit, expiresMs: r.ExpiresMs, formed: r.Form != ""}
		s.n++
	}
	if s.n == 0 {
		b.set.Store(nil)
		return
	}
	b.set.Store(s)
}

// active is the number of overrides that apply now: those of the set
// that have not lapsed on its clock. The set is built again only when
// the book changes, and a node prunes its book only when the region
// changed something (never without Redis or MySQL): its count of what
// was live then counted an override that lapsed until the region's next
// change, or for good (TestMetrics_AnOverrideThatLapsedIsNoLongerActive).
func (b *overrideBook) active() int {
	s := b.set.Load()
	if s == nil {
		return 0
	}
	now := s.clock.nowMs()
	n := 0
	for _, zm := range s.zones {
		for _, o := range zm {
			if o.expiresMs == 0 || now < o.expiresMs {
				n++
			}
		}
	}
	return n
}

// beginLoad marks the process's first load from its backends as running,
// once per process: a reload keeps the overrides the book has.
// It reports whether this call began it: the caller then owns it, and
// ends it (endLoad) when its config starts, or gives it up (abortLoad)
// when its config is thrown away unstarted.
func (b *overrideBook) beginLoad() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.once {
		return false
	}
	b.once = true
	b.loaded = make(chan struct{})
	b.loading.Store(true)
	return true
}

// abortLoad gives up a first load whose config never started (a reload
// that failed after provisioning it): decisions stop waiting for it at
// once, where they waited out loadTimeout, and the next config that
// loads the process's overrides waits for its own first load.
func (b *overrideBook) abortLoad() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.loading.Load() {
		b.loading.Store(false)
		close(b.loaded)
	}
	b.once = false
}

// endLoad ends the first load (whether it succeeded or not).
func (b *overrideBook) endLoad() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.loading.Load() {
		b.loading.Store(false)
		close(b.loaded)
	}
}

// waitLoaded waits for the first load, at most loadTimeout and never past
// ctx: a decision made during it would miss the overrides.
func (b *overrideBook) waitLoaded(ctx context.Context) {
	b.mu.Lock()
	ch := b.loaded
	b.mu.Unlock()
	if ch == nil {
		return
	}
	t := time.NewTimer(loadTimeout)
	defer t.Stop()
	select {
	case <-ch:
	case <-t.C:
		b.endLoad()
	case <-ctx.Done():
	}
}

// runtimeLimit is the request path's lookup: the runtime override of
// zone for the handler's identifier id, if one applies.
func runtimeLimit(ctx context.Context, zone, id string) (int64, bool) {
	if overrides.loading.Load() {
		overrides.waitLoaded(ctx)
	}
	s := overrides.set.Load()
	if s == nil {
		return 0, false
	}
	return s.limit(zone, id)
}

// normalizedRuntimeLimit is runtimeLimit for an identifier the engine
// normalized already (see overrideSet.limitNormalized), for the admin
// path. The two are written out apiece: a shared helper with the wait in
// it is not inlined, and would cost the request path a call.
func normalizedRuntimeLimit(ctx context.Context, zone, norm string) (int64, bool) {
	if overrides.loading.Load() {
		overrides.waitLoaded(ctx)
	}
	s := overrides.set.Load()
	if s == nil {
		return 0, false
	}
	return s.limitNormalized(zone, norm)
}
