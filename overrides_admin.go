package ratelimit

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// The admin API's runtime overrides:
//
//	PUT    /ratelimit/overrides?zone=Z&identifier=I   {"limit": N, "expires": "RFC 3339" | null, "reason": "text"}
//	GET    /ratelimit/overrides?zone=Z[&prefix=P][&max=N]
//	GET    /ratelimit/overrides?zone=Z&identifier=I
//	DELETE /ratelimit/overrides?zone=Z&identifier=I
//
// A change of one override may be conditional (If-Match, If-None-Match:
// overrides_preconditions.go).
//
// Identifiers are taken as the handler counts them: an IP address is
// masked to the zone's prefix, a long one hashed, and under
// identifier_secret only the HMAC is stored and shown.

// Bounds of an override's body.
const (
	maxOverrideBody   = 64 << 10
	drainOverrideBody = 1 << 20 // read and dropped past maxOverrideBody
	maxOverrideReason = 512
)

// overrideBody is what a PUT sends.
type overrideBody struct {
	Limit   *int64     `json:"limit"`
	Expires *time.Time `json:"expires"`
	Reason  string     `json:"reason"`
}

// overrideDoc is one override as the API shows it.
type overrideDoc struct {
	Zone string `json:"zone"`
	shownID
	Limit   int64      `json:"limit"`
	Expires *time.Time `json:"expires"`
	Reason  string     `json:"reason"`
	Region  string     `json:"region,omitempty"`
	Created time.Time  `json:"created"`
	// ETag is the override's entity tag, quoted as the ETag header
	// shows it, for If-Match.
	ETag string `json:"etag"`
	// Scope is where the change was stored (node, region or global), in
	// the answer to a change.
	Scope string `json:"scope,omitempty"`
	// Removed is set in the answer to a DELETE.
	Removed bool `json:"removed,omitempty"`
}

func docOf(r overrideRec) overrideDoc {
	d := overrideDoc{Zone: r.Zone, shownID: showID(r.Identifier), Limit: r.Limit, Reason: r.Reason, Region: r.Region,
		Created: time.UnixMilli(r.CreatedMs).UTC(), ETag: etagOf(r)}
	if r.ExpiresMs != 0 && !r.Deleted {
		t := time.UnixMilli(r.ExpiresMs).UTC()
		d.Expires = &t
	}
	return d
}

// overrideListDoc is a listing.
type overrideListDoc struct {
	Zone   string `json:"zone"`
	Prefix string `json:"prefix"`
	// PrefixHex is the prefix's bytes in hex when it is not valid UTF-8,
	// as in the listing of counters: JSON shows each bad byte as U+FFFD.
	PrefixHex string        `json:"prefix_hex,omitempty"`
	Max       int           `json:"max"`
	Truncated bool          `json:"truncated"`
	Overrides []overrideDoc `json:"overrides"`
}

func (a *AdminAPI) handleOverrides(w http.ResponseWriter, r *http.Request) error {
	if err := allowMethods(w, r, http.MethodGet, http.MethodPut, http.MethodDelete); err != nil {
		return err
	}
	kq, err := parseKeyQuery(r, "override")
	if err != nil {
		return err
	}
	if r.Method != http.MethodGet && (!kq.byID || kq.id == "") {
		return badRequest("a change names one key: the identifier parameter is required and not empty")
	}
	pre, err := parsePreconditions(r.Header)
	if err != nil {
		return err
	}
	zoneName, st := kq.zone, kq.st
	if !kq.byID {
		if pre.given() {
			return badRequest("If-Match and If-None-Match apply to one override (give the identifier parameter): a listing has no entity tag")
		}
		return writeJSON(w, listOverrides(zoneName, kq.prefix, kq.max))
	}
	stored := storedIdentifier(st, kq.id, kq.defs)
	switch r.Method {
	case http.MethodPut:
		if err := checkOverrideAddress(kq.id, kq.defs); err != nil {
			return err
		}
		return putOverride(w, r, pre, st, zoneName, stored)
	case http.MethodDelete:
		return deleteOverride(w, r, pre, st, zoneName, stored)
	}
	rec, ok := overrides.get(zoneName, stored)
	if !ok || !rec.live(st.engine.NowMs()) {
		return errNoOverride(zoneName)
	}
	w.Header().Set("ETag", etagOf(rec))
	if err := pre.check(rec, true, r.Method); err == errNotModified {
		w.WriteHeader(http.StatusNotModified)
		return nil
	} else if err != nil {
		return err
	}
	return writeJSON(w, docOf(rec))
}

// storedIdentifier is id as overrides store it: masked to the zone's IP
// prefix as the handler counts it, hashed when long, an HMAC under
// identifier_secret.
func storedIdentifier(st *state, id string, defs []zoneDef) string {
	id = engine.NormalizeIdentifier(maskKeyID(id, defs[0].key, defs[0].v4, defs[0].v6))
	if m := st.apps.view().ids.mapper(); m != nil {
		id = m(id)
	}
	return id
}

// checkOverrideAddress refuses a change of an identifier that the zone's
// key never writes, as the Caddyfile's override line does: an address
// prefix of another length than the zone counts, an address inside a
// prefix, upper-case hex, a whole address with /32; under a key with text
// around its placeholder, or of several, one without that text, with a
// separator or '%' raw in a value, or with every value empty. An address
// is masked first, as the handler masks it (maskKeyID). Before
// 2026-11-28 an address prefix in another form was stored with a 200 and
// never applied: an operator blocking 203.0.113.0/16 in a zone counting
// by /24 blocked nothing (TestOperator_AnAddressPrefixThatNeverMatches in
// integration/); before 2026-11-29 so was any identifier such a key
// never writes, and an address in one was masked as if the whole
// identifier were one
// (TestOverrides_AKeyOfPlaceholdersAndTextIsTakenAsTheHandlerWritesIt).
// The error does not name the identifier, which logs carry shortened or
// as its HMAC only.
func checkOverrideAddress(id string, defs []zoneDef) error {
	d := defs[0]
	masked := maskKeyID(id, d.key, d.v4, d.v6)
	if validateOverrideForKey(masked, d.key, d.v4, d.v6) == nil {
		return nil
	}
	address := fmt.Sprintf("the zone counts IPv4 addresses by /%d and IPv6 ones by /%d, written as a prefix's first address, in lower case, "+
		"and a whole address without /32 or /128 (or give one address: it is masked to the zone's prefix)", d.v4, d.v6)
	t := newKeyTemplate(d.key)
	switch glue, _ := keyGlue(d.key); {
	case t.parts == nil && holdsAddress(t.single) && !isPrefix(masked):
		return badRequest("the identifier is no IP address (leading zeros, spaces, a shortened IPv4 address or a zone after a prefix make none), " +
			"and the zone's key holds one: " + address)
	case t.parts == nil:
		return badRequest("the identifier is an address prefix that no request's identifier equals: " + address)
	case glue == nil:
		return badRequest(fmt.Sprintf("the identifier is none the zone's key %q writes: give the key's text around its placeholder "+
			"with a value between that is not empty; in a value, %s", d.key, address))
	}
	return badRequest(fmt.Sprintf("the identifier is none the zone's key %q writes: give the key's text around its placeholders, "+
		"not every value empty, and in a value '%%' and the first byte of each text between placeholders as %%XX (':' is %%3A); "+
		"in a value, %s", d.key, address))
}

// isPrefix says whether netip parses s as an address prefix.
func isPrefix(s string) bool {
	_, err := netip.ParsePrefix(s)
	return err == nil
}

// listOverrides lists up to max live overrides of the zone, in identifier
// order.
func listOverrides(zoneName, prefix string, max int) overrideListDoc {
	recs := overrides.live(zoneName, prefix)
	slices.SortFunc(recs, func(a, b overrideRec) int { return strings.Compare(a.Identifier, b.Identifier) })
	doc := overrideListDoc{Zone: zoneName, Prefix: prefix, PrefixHex: showID(prefix).IdentifierHex, Max: max, Truncated: len(recs) > max, Overrides: []overrideDoc{}}
	for _, rec := range recs[:min(len(recs), max)] {
		doc.Overrides = append(doc.Overrides, docOf(rec))
	}
	return doc
}

// readOverrideBody decodes and checks a PUT's body: nothing is stored
// unless all of it is right.
func readOverrideBody(r *http.Request, now time.Time) (overrideBody, error) {
	var body overrideBody
	raw, err := io.ReadAll(http.MaxBytesReader(nil, r.Body, maxOverrideBody))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			// Read what the client is still sending (within a bound), so
			// that it reads the 400: the admin server closes a connection
			// it was asked to close with the rest of the body unread, and
			// the client, still writing, got a reset instead (CI, once,
			// for a body of 70 KiB).
			_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, drainOverrideBody))
			return body, badRequest(fmt.Sprintf("the body is over %d bytes", maxOverrideBody))
		}
		return body, badRequest("reading the body: " + err.Error())
	}
	if !utf8.Valid(raw) {
		// encoding/json would store each bad byte of the reason as U+FFFD.
		return body, badRequest("the body is not UTF-8 (JSON text is; the reason would be stored altered)")
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&body); err != nil {
		return body, badRequest("the body is not an override: " + err.Error())
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return body, badRequest("the body holds more than one JSON value")
	}
	if err := checkOverrideNames(raw); err != nil {
		return body, err
	}
	switch {
	case body.Limit == nil:
		return body, badRequest(`the body needs a "limit"`)
	case *body.Limit < 0 || *body.Limit > maxUnits:
		return body, badRequest(fmt.Sprintf("limit %d is out of range: 0 (blocks) to %d", *body.Limit, int64(maxUnits)))
	case body.Expires != nil && !body.Expires.After(now):
		return body, badRequest("expires is not in the future")
	case len(body.Reason) > maxOverrideReason:
		return body, badRequest(fmt.Sprintf("the reason is over %d bytes", maxOverrideReason))
	}
	return body, nil
}

// overrideNames are the names of a PUT's body, as written there.
var overrideNames = []string{"limit", "expires", "reason"}

// checkOverrideNames refuses an ambiguous body that encoding/json took:
// it keeps the last of two "limit"s, and takes "LIMIT" for "limit". raw
// is one JSON object of known names, up to case (decoded already).
func checkOverrideNames(raw []byte) error {
	dec := json.NewDecoder(bytes.NewReader(raw))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return nil // null: the checks of the decoded body answer
	}
	var seen []string
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return badRequest("the body is not an override: " + err.Error())
		}
		name, _ := t.(string)
		switch {
		case !slices.Contains(overrideNames, name):
			return badRequest(fmt.Sprintf(`the body's field %q is none of "limit", "expires" and "reason" (names are lower case)`, name))
		case slices.Contains(seen, name):
			return badRequest(fmt.Sprintf("the body gives %q twice", name))
		}
		seen = append(seen, name)
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return badRequest("the body is not an override: " + err.Error())
		}
		if name == "reason" && loneSurrogate(v) {
			return badRequest(`the reason holds half of a UTF-16 pair as a \u escape (a lone surrogate), which no UTF-8 text holds: it would be stored as U+FFFD, altered`)
		}
	}
	return nil
}

// loneSurrogate reports whether s, a JSON string as written, holds a \u
// escape of a surrogate that is not one half of a pair: encoding/json
// decodes it as U+FFFD.
func loneSurrogate(s []byte) bool {
	escaped := func(i int) (rune, bool) { // the \uXXXX at s[i:], if any
		if i+6 > len(s) || s[i] != '\\' || s[i+1] != 'u' {
			return 0, false
		}
		r, err := strconv.ParseUint(string(s[i+2:i+6]), 16, 16)
		return rune(r), err == nil
	}
	for i := 0; i < len(s); i++ {
		if s[i] != '\\' {
			continue
		}
		r, ok := escaped(i)
		if !ok {
			i++ // an escape of one byte: \\ among them
			continue
		}
		i += 5
		switch {
		case r >= 0xDC00 && r <= 0xDFFF:
			return true
		case r >= 0xD800 && r <= 0xDBFF:
			if low, ok := escaped(i + 1); !ok || low < 0xDC00 || low > 0xDFFF {
				return true
			}
			i += 6
		}
	}
	return false
}

func putOverride(w http.ResponseWriter, r *http.Request, pre preconditions, st *state, zoneName, id string) error {
	// The body is checked first: a bad one is a 400 whatever the
	// preconditions say (RFC 9110, 13.2.1).
	body, err := readOverrideBody(r, st.engine.Now())
	if err != nil {
		return err
	}
	overrides.changing.Lock()
	defer overrides.changing.Unlock()
	// The region's clock (the engine's): what the region's nodes judge
	// the expiry on, and what orders its changes.
	now := st.engine.Now()
	// A change comes after the one it replaces, whatever this clock says.
	version := now.UnixMicro()
	old, ok := overrides.get(zoneName, id)
	if ok {
		version = max(version, old.Version+1)
	}
	if err := pre.check(old, ok && old.live(now.UnixMilli()), r.Method); err != nil {
		return err
	}
	rec := overrideRec{Zone: zoneName, Identifier: id, Limit: *body.Limit, Reason: body.Reason,
		Region: st.apps.view().region, CreatedMs: now.UnixMilli(), Version: version, Form: st.apps.view().ids.form()}
	if body.Expires != nil {
		rec.ExpiresMs = body.Expires.UnixMilli()
	}
	return changeOverride(w, r, st, rec, "set", checkedIn(pre, old, ok, rec, r.Method))
}

// removeOlderForm removes the live override of (zone, id) by a build
// before forms, after a change of the key under identifier_secret: the
// change's own record wins over it already (overrideBook.publishLocked),
// and this keeps it from coming back when that record is removed.
func removeOlderForm(ctx context.Context, st *state, zoneName, id string, now time.Time) error {
	old, ok := overrides.olderForm(zoneName, id)
	if !ok {
		return nil
	}
	rec := overrideRec{Zone: zoneName, Identifier: id, Region: st.apps.view().region, Deleted: true,
		CreatedMs: now.UnixMilli(), Version: max(now.UnixMicro(), old.Version+1), ExpiresMs: now.Add(tombstoneLife).UnixMilli()}
	_, _, err := storeOverride(ctx, st, rec)
	return err
}

func deleteOverride(w http.ResponseWriter, r *http.Request, pre preconditions, st *state, zoneName, id string) error {
	overrides.changing.Lock()
	defer overrides.changing.Unlock()
	now := st.engine.Now() // the region's clock, as in putOverride
	old, ok := overrides.get(zoneName, id)
	var unheard error
	if !ok || !old.live(now.UnixMilli()) {
		unheard = hearFromRegion(r.Context(), st, zoneName, id)
		old, ok = overrides.get(zoneName, id)
	}
	if !ok || !old.live(now.UnixMilli()) {
		if unheard != nil {
			// Not a 404: the region may hold one (before 2026-11-29, a
			// removal made while Redis was down said there was none).
			return caddy.APIError{HTTPStatus: http.StatusServiceUnavailable,
				Err: fmt.Errorf("this node holds no runtime override for this identifier in zone %q, and the region's Redis did not answer: nothing changed", zoneName)}
		}
		// A 404 whatever the preconditions say (RFC 9110, 13.2.1).
		return errNoOverride(zoneName)
	}
	if err := pre.check(old, true, r.Method); err != nil {
		return err
	}
	// The removal takes the name of what it removes: under a secret, the
	// override of this form, or else one by a build before forms.
	rec := overrideRec{Zone: zoneName, Identifier: id, Region: st.apps.view().region, Deleted: true,
		CreatedMs: now.UnixMilli(), Version: max(now.UnixMicro(), old.Version+1), ExpiresMs: now.Add(tombstoneLife).UnixMilli(), Form: old.Form}
	return changeOverride(w, r, st, rec, "removed", checkedIn(pre, old, true, rec, r.Method))
}

// hearFromRegion takes into the book what the region's Redis holds of
// (zone, id), when it is newer: a removal made on this node before the
// notice of the change it removes arrived (a round trip or two after it
// was made on another node, longer while the subscription is down) found
// no override in the book and answered 404, and the override stayed in
// force on every node (TestOverrides_ARemovalOfAChangeNotHeardYetRemovesIt).
// A region that does not answer leaves the book as it is, and its error
// is returned.
func hearFromRegion(ctx context.Context, st *state, zone, id string) error {
	rb := st.overridesRedis()
	if rb == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	field := (&overrideRec{Zone: zone, Identifier: id, Form: overrides.currentForm()}).field()
	o, held, err := rb.HeldOverride(ctx, field)
	if err != nil || !held {
		return err
	}
	if rec, ok := recOfRegion(o); ok {
		overrides.merge([]overrideRec{rec})
	}
	return nil
}

// checkedIn is the condition the region's Redis checks a change rec under,
// nil for an unconditional one. It compares the field the node's book
// matched the condition against (old's, when the book holds one: under
// identifier_secret, that may be the override by a build before forms),
// so that the region judges what the node judged.
func checkedIn(pre preconditions, old overrideRec, held bool, rec overrideRec, method string) *regionCondition {
	if !pre.given() {
		return nil
	}
	field := rec.field()
	if held {
		field = old.field()
	}
	return &regionCondition{pre: pre, field: field, method: method}
}

// changeOverride stores a change, under cond when it is conditional,
// logs who made it and counts it.
func changeOverride(w http.ResponseWriter, r *http.Request, st *state, rec overrideRec, what string, cond *regionCondition) error {
	rec, scope, err := storeChecked(r.Context(), st, rec, cond)
	view := st.apps.view()
	if err == nil && rec.Form != "" {
		// The change took and wins over the older form's record already;
		// removing that one only keeps it from coming back should this
		// change be removed.
		if ferr := removeOlderForm(r.Context(), st, rec.Zone, rec.Identifier, time.UnixMicro(rec.Version)); ferr != nil {
			view.logger.Warn("runtime override "+what+", but the override of the key by a build before identifier forms stays", zap.Error(ferr))
		}
	}
	if err != nil {
		if ae, ok := err.(caddy.APIError); ok {
			return ae
		}
		return caddy.APIError{HTTPStatus: http.StatusServiceUnavailable, Err: err}
	}
	overrideChanges.WithLabelValues(what, scope).Inc()
	fields := append([]zap.Field{zap.String("by", r.RemoteAddr), zap.String("zone", rec.Zone), zap.String("scope", scope)},
		shownFields(view.ids, rec.Identifier)...)
	if !rec.Deleted {
		fields = append(fields, zap.Int64("limit", rec.Limit), zap.Int64("expires_ms", rec.ExpiresMs), zap.String("reason", rec.Reason))
	}
	view.logger.Info("runtime override "+what, fields...)
	doc := docOf(rec)
	doc.Scope, doc.Removed = scope, rec.Deleted
	w.Header().Set("ETag", doc.ETag)
	return writeJSON(w, doc)
}

// shownFields are the log fields of a stored identifier: under
// identifier_secret it already is the HMAC.
func shownFields(ids identities, stored string) []zap.Field {
	if ids.hashed() {
		return []zap.Field{zap.String("identifier_hmac", stored)}
	}
	return ids.logFields(stored)
}

// errNoOverride never names the identifier: Caddy logs admin errors.
func errNoOverride(zone string) error {
	if currentProp.Load() != nil {
		// Another region's change travels through MySQL for a flush or
		// two: a removal sent to this region at once got a bare 404 and
		// the override arrived after it (an audit).
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no runtime override for this identifier in zone %q in this region; one set in another region reaches it through MySQL within a few seconds", zone)}
	}
	return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no runtime override for this identifier in zone %q", zone)}
}
