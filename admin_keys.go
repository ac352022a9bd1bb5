package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// The admin routes about a zone's keys: GET and DELETE /ratelimit/counters
// (the reset of a region or every region is reset.go's), GET
// /ratelimit/strict, and the query of one key or a listing that the
// overrides' routes (overrides_admin.go) read too.

// Bounds of the key listings.
const (
	// defaultListMax is how many keys a listing returns unless told: a
	// screenful, cheap to produce on a busy node.
	defaultListMax = 100
	// maxListMax caps a listing: the engine is scanned on the admin
	// goroutine, and a million-key answer would be a denial of service of
	// the admin endpoint by itself.
	maxListMax = 10_000
)

// keyDoc is one key of GET /ratelimit/counters.
type keyDoc struct {
	Zone string `json:"zone"`
	shownID
	WindowMs int64 `json:"window_ms"`
	// Limit is the zone's limit for this identifier (an override's when one
	// matches): the lowest of the newest config's handlers that define the
	// zone.
	Limit       int64      `json:"limit"`
	Effective   int64      `json:"effective"`
	Remaining   int64      `json:"remaining"`
	StrictUntil *time.Time `json:"strict_until"`
	FreshUntil  *time.Time `json:"fresh_until"`
	Cells       []cellDoc  `json:"cells"`
}

// cellDoc is one cell of a keyDoc: the current one, then the previous.
type cellDoc struct {
	Sequence    int64 `json:"sequence"`
	Regional    int64 `json:"regional"`
	Speculative int64 `json:"speculative"`
	Global      int64 `json:"global"`
	Pending     int64 `json:"pending"`
	Blocked     bool  `json:"blocked"`
	// GlobalByRegion is what each foreign region counted in the cell, as
	// imported by the cross-region layer; omitted without it.
	GlobalByRegion map[string]int64 `json:"global_by_region,omitempty"`
}

// keyListDoc is a listing of GET /ratelimit/counters.
type keyListDoc struct {
	Zone   string `json:"zone"`
	Prefix string `json:"prefix"`
	// PrefixHex is the prefix in hex when it is not valid UTF-8, which
	// JSON cannot carry (as identifier_hex).
	PrefixHex string `json:"prefix_hex,omitempty"`
	Max       int    `json:"max"`
	// Truncated reports that more keys matched than Max.
	Truncated bool     `json:"truncated"`
	Keys      []keyDoc `json:"keys"`
}

// forgetDoc is DELETE /ratelimit/counters.
type forgetDoc struct {
	Zone string `json:"zone"`
	shownID
	Forgotten bool `json:"forgotten"`
}

// strictDoc is GET /ratelimit/strict.
type strictDoc struct {
	Total     int            `json:"total"`
	Truncated bool           `json:"truncated"`
	Keys      []strictKeyDoc `json:"keys"`
}

type strictKeyDoc struct {
	Zone string `json:"zone"`
	shownID
	WindowMs int64     `json:"window_ms"`
	Until    time.Time `json:"until"`
}

// handleCounters is GET /ratelimit/counters (one key, or a listing) and
// DELETE (forgetting a key on this node, or its reset: reset.go).
func (a *AdminAPI) handleCounters(w http.ResponseWriter, r *http.Request) error {
	if err := allowMethods(w, r, http.MethodGet, http.MethodDelete); err != nil {
		return err
	}
	kq, err := parseKeyQuery(r, "key", "scope")
	if err != nil {
		return err
	}
	scope, hasScope := kq.q["scope"]
	switch {
	case r.Method == http.MethodDelete && !kq.byID:
		return badRequest("DELETE forgets one key: the identifier parameter is required")
	case hasScope && r.Method != http.MethodDelete:
		return badRequest("scope applies to DELETE only")
	case hasScope && scope == "":
		// Not taken for node: an empty value is more likely a script's
		// unset variable than a choice, and region or global may have
		// been meant.
		return badRequest("scope is empty: give node, region or global, or leave it out for node")
	case !hasScope:
		scope = scopeNode
	}
	zoneName, id, st, defs := kq.zone, kq.id, kq.st, kq.defs
	if !kq.byID {
		return writeJSON(w, listKeys(st, zoneName, kq.prefix, kq.max, defs))
	}
	// The handler counts an IP address by its prefix; so does the lookup.
	if id != "" {
		id = maskKeyID(id, defs[0].key, defs[0].v4, defs[0].v6)
	}
	if r.Method == http.MethodDelete {
		return resetKey(w, r, st, zoneName, id, defs, scope)
	}
	ids := st.apps.view().ids
	unread := false
	for _, window := range defWindows(defs) {
		ks, ok, read := regionView(r.Context(), st, engine.Key{Namespace: zoneName, Identifier: id, Window: window})
		if ok {
			return writeJSON(w, keyDocOf(ks, defs, ids))
		}
		unread = unread || !read
	}
	if unread {
		// Not a 404: the region may count the key (before 2026-11-29 a
		// node that held none said "no counters" while Redis was down).
		return caddy.APIError{HTTPStatus: http.StatusServiceUnavailable,
			Err: fmt.Errorf("this node holds no counters for this identifier in zone %q, and the region's Redis did not answer: what the region counts of it is unknown", zoneName)}
	}
	return errNoKey(zoneName)
}

// keyQuery is the query of a route about a zone's keys: one key
// (identifier) or a listing (prefix, max), of a zone a loaded config
// defines.
type keyQuery struct {
	q                map[string]string
	zone, id, prefix string
	byID             bool
	max              int
	st               *state
	defs             []zoneDef
}

// parseKeyQuery reads a keyQuery; what names the thing an identifier
// selects, in errors. An unknown zone is a 404.
func parseKeyQuery(r *http.Request, what string, extra ...string) (keyQuery, error) {
	var kq keyQuery
	q, err := parseQuery(r, append([]string{"zone", "identifier", "prefix", "max"}, extra...)...)
	if err != nil {
		return kq, err
	}
	kq.q = q
	if kq.zone = q["zone"]; kq.zone == "" {
		return kq, badRequest("the zone parameter is required")
	}
	kq.id, kq.byID = q["identifier"]
	var byPrefix, hasMax bool
	kq.prefix, byPrefix = q["prefix"]
	_, hasMax = q["max"]
	if kq.byID && (byPrefix || hasMax) {
		return kq, badRequest("identifier selects one " + what + ": prefix and max apply to listings only")
	}
	if kq.max, kq.st, err = listing(q); err != nil {
		return kq, err
	}
	if kq.defs = kq.st.zones.definitions(kq.zone, kq.st.apps.view().app); len(kq.defs) == 0 {
		return kq, errNoZone(kq.zone)
	}
	return kq, nil
}

// regionView is key as this process holds it, with what the region's
// Redis holds of it raised in (a peek, which registers nothing): the
// other nodes' units and the other regions' counts the role's holder left
// there, also for a key this process has not seen. Without Redis, or when
// it does not answer within the read timeout, it is this process's view.
//
// read is false when Redis was asked and did not answer.
func regionView(ctx context.Context, st *state, key engine.Key) (ks engine.KeyState, ok, read bool) {
	o := st.currentOrigin()
	if o == nil {
		ks, ok = st.engine.Inspect(key)
		return ks, ok, true
	}
	ctx, cancel := context.WithTimeout(ctx, st.engine.Timing().ReadTimeout)
	defer cancel()
	peek := key
	peek.Identifier = engine.NormalizeIdentifier(key.Identifier)
	if m := st.apps.view().ids.mapper(); m != nil {
		peek.Identifier = m(peek.Identifier)
	}
	t, err := o.Peek(ctx, peek, st.engine.Now().UnixMilli()/key.Window.Milliseconds())
	if err != nil {
		ks, ok = st.engine.Inspect(key)
		return ks, ok, false
	}
	ks, ok = st.engine.Overlay(key, t)
	return ks, ok, true
}

// listKeys lists up to max keys of the zone whose identifier starts with
// prefix.
func listKeys(st *state, zoneName, prefix string, max int, defs []zoneDef) keyListDoc {
	ids := st.apps.view().ids
	doc := keyListDoc{Zone: zoneName, Prefix: prefix, PrefixHex: showID(prefix).IdentifierHex, Max: max, Keys: []keyDoc{}}
	// Keys of a window no loaded config uses any more linger until the
	// janitor drops them; they are not the zone's, and take no place.
	windows := defWindows(defs)
	if len(windows) == 0 {
		return doc
	}
	found := st.engine.Scan(zoneName, prefix, max+1, windows...)
	doc.Truncated = len(found) > max
	for _, ks := range found[:min(len(found), max)] {
		doc.Keys = append(doc.Keys, keyDocOf(ks, defs, ids))
	}
	return doc
}

// forgetKey forgets the key in every window the zone is defined with.
func forgetKey(w http.ResponseWriter, st *state, zoneName, id string, defs []zoneDef) error {
	forgotten := false
	for _, window := range defWindows(defs) {
		if st.engine.Forget(engine.Key{Namespace: zoneName, Identifier: id, Window: window}) {
			forgotten = true
		}
	}
	if !forgotten {
		return errNoKey(zoneName)
	}
	ids := st.apps.view().ids
	return writeJSON(w, forgetDoc{Zone: zoneName, shownID: showID(ids.shown(engine.NormalizeIdentifier(id))), Forgotten: true})
}

// errNoZone is the 404 for a zone no loaded config defines.
func errNoZone(zone string) error {
	return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("zone %q is not defined by any loaded config", zone)}
}

// errNoKey never names the identifier: Caddy logs admin errors.
func errNoKey(zone string) error {
	return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no counters for this identifier in zone %q on this node", zone)}
}

// keyDocOf renders a key with the lowest limit that defs with its window
// apply to it: a zone of several sites may carry a limit in each, and the
// first def was the first handler Caddy provisioned, in the order of a
// map, so the limit shown moved from one reload to the next.
func keyDocOf(ks engine.KeyState, defs []zoneDef, ids identities) keyDoc {
	limit := int64(-1)
	for _, d := range defs {
		if d.window == ks.Key.Window {
			if l := d.limitFor(ks.Key.Namespace, ks.Key.Identifier); limit < 0 || l < limit {
				limit = l
			}
		}
	}
	limit = max(limit, 0)
	doc := keyDoc{
		Zone:        ks.Key.Namespace,
		shownID:     showID(ids.shown(ks.Key.Identifier)),
		WindowMs:    ks.Key.Window.Milliseconds(),
		Limit:       limit,
		Effective:   ks.Effective,
		Remaining:   max(0, limit-ks.Effective),
		StrictUntil: timeOrNull(ks.StrictUntil),
		FreshUntil:  timeOrNull(ks.FreshUntil),
		Cells:       make([]cellDoc, len(ks.Cells)),
	}
	for i, c := range ks.Cells {
		doc.Cells[i] = cellDoc{
			Sequence:    c.Sequence,
			Regional:    c.Regional,
			Speculative: c.Speculative,
			Global:      c.Global,
			Pending:     c.Pending,
			Blocked:     c.Blocked,
		}
		doc.Cells[i].GlobalByRegion = foreignCounts(ks.Key, c.Sequence) // mysql_status.go
	}
	return doc
}

// handleStrict is GET /ratelimit/strict: the keys in strict mode on this
// node, of one zone or all.
func (a *AdminAPI) handleStrict(w http.ResponseWriter, r *http.Request) error {
	if err := allowMethods(w, r, http.MethodGet); err != nil {
		return err
	}
	q, err := parseQuery(r, "zone", "max")
	if err != nil {
		return err
	}
	max, st, err := listing(q)
	if err != nil {
		return err
	}
	zoneName, byZone := q["zone"]
	if byZone && zoneName == "" {
		return badRequest("the zone parameter is empty: name a zone, or leave the parameter out for every zone")
	}
	if byZone && len(st.zones.definitions(zoneName, nil)) == 0 {
		return errNoZone(zoneName)
	}
	return writeJSON(w, listStrict(st, zoneName, byZone, max, func(zone string) []zoneDef {
		return st.zones.definitions(zone, nil)
	}))
}

// listStrict lists up to max keys in strict mode, of zoneName when byZone,
// whose zone a loaded config defines with their window (defsOf gives a
// zone's definitions). Keys of a window no loaded config uses any more
// keep their deadline until it passes; they are not the zone's, as the
// counters listing has them (listKeys), and the strict listing showed
// them and counted them in its total until 2026-11-28.
func listStrict(st *state, zoneName string, byZone bool, max int, defsOf func(zone string) []zoneDef) strictDoc {
	ids := st.apps.view().ids
	doc := strictDoc{Keys: []strictKeyDoc{}}
	loaded := loadedWindows(defsOf)
	for _, sk := range st.engine.StrictKeys() {
		if byZone && sk.Key.Namespace != zoneName {
			continue
		}
		if !loaded(sk.Key.Namespace, sk.Key.Window) {
			continue
		}
		doc.Total++
		if len(doc.Keys) == max {
			doc.Truncated = true
			continue
		}
		doc.Keys = append(doc.Keys, strictKeyDoc{
			Zone:     sk.Key.Namespace,
			shownID:  showID(ids.shown(sk.Key.Identifier)),
			WindowMs: sk.Key.Window.Milliseconds(),
			Until:    sk.Until.UTC(),
		})
	}
	return doc
}

// loadedWindows reports whether a loaded config defines a zone with a
// window (defsOf gives a zone's definitions), looking each zone up once.
func loadedWindows(defsOf func(zone string) []zoneDef) func(zone string, window time.Duration) bool {
	windows := map[string][]time.Duration{}
	return func(zone string, window time.Duration) bool {
		ws, ok := windows[zone]
		if !ok {
			ws = defWindows(defsOf(zone))
			windows[zone] = ws
		}
		return slices.Contains(ws, window)
	}
}

// engineStatsOf is the engine's stats as the status and the metrics show
// them: strict_keys counts the keys /ratelimit/strict lists, in the
// windows the loaded configs define their zones with. A reload that
// changed a zone's window leaves the old window's deadlines until they
// pass; until 2026-11-29 the gauge counted them and the listing did not
// (50 against 1 in an audit's run: TestStrictKeys_CountsWhatTheListingLists).
func engineStatsOf(st *state) engine.Stats {
	return st.engine.StatsIn(loadedWindows(func(zone string) []zoneDef {
		return st.zones.definitions(zone, nil)
	}))
}

// listing is what a listing route needs after its parameters: the max
// parameter and the running state.
func listing(q map[string]string) (int, *state, error) {
	max, err := listMax(q)
	if err != nil {
		return 0, nil, err
	}
	st, err := runningState()
	return max, st, err
}

// listMax is the max parameter: default defaultListMax, 1 to maxListMax.
func listMax(q map[string]string) (int, error) {
	s, ok := q["max"]
	if !ok {
		return defaultListMax, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > maxListMax {
		return 0, badRequest(fmt.Sprintf("max must be an integer from 1 to %d", maxListMax))
	}
	return n, nil
}
