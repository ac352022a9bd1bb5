package ratelimit

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// TestKeyDoc_LimitOfTheDefinitionWithTheKeysWindow: a zone defined with
// two windows shows each key the limit of the definition with the key's
// window (an override's where one matches), and the room left never below
// zero; deadlines that are not set show as null.
func TestKeyDoc_LimitOfTheDefinitionWithTheKeysWindow(t *testing.T) {
	minute := &Handler{zones: []zone{{name: "kd", limit: 10, window: time.Minute, overrides: map[string]int64{"vip": 50}}}}
	hour := &Handler{zones: []zone{{name: "kd", limit: 100, window: time.Hour}}}
	defs := []zoneDef{{handler: hour, window: time.Hour}, {handler: minute, window: time.Minute}}
	strict := time.UnixMilli(1_800_000_060_123).Add(456 * time.Microsecond)
	for _, tc := range []struct {
		id                       string
		window                   time.Duration
		effective                int64
		wantLimit, wantRemaining int64
	}{
		{"a", time.Minute, 12, 10, 0},
		{"vip", time.Minute, 12, 50, 38},
		{"a", time.Hour, 30, 100, 70},
	} {
		ks := engine.KeyState{
			Key:         engine.Key{Namespace: "kd", Identifier: tc.id, Window: tc.window},
			Effective:   tc.effective,
			StrictUntil: strict,
			Cells:       []engine.CellState{{Sequence: 7, Regional: tc.effective, Pending: 2, Blocked: true}},
		}
		doc := keyDocOf(ks, defs, identities{})
		if doc.Limit != tc.wantLimit || doc.Remaining != tc.wantRemaining || doc.WindowMs != tc.window.Milliseconds() {
			t.Errorf("%s per %s: limit %d remaining %d window %d ms, want %d, %d, %d",
				tc.id, tc.window, doc.Limit, doc.Remaining, doc.WindowMs, tc.wantLimit, tc.wantRemaining, tc.window.Milliseconds())
		}
		if doc.FreshUntil != nil || doc.StrictUntil == nil || !doc.StrictUntil.Equal(strict.Truncate(time.Millisecond)) {
			t.Errorf("%s: fresh %v, strict %v: want null and %s to the millisecond", tc.id, doc.FreshUntil, doc.StrictUntil, strict)
		}
		if len(doc.Cells) != 1 || doc.Cells[0].Sequence != 7 || doc.Cells[0].Pending != 2 || !doc.Cells[0].Blocked {
			t.Errorf("%s: cells %+v", tc.id, doc.Cells)
		}
	}
}

// TestKeyDoc_ShowsTheIdentifiersHMAC: under identifier_secret the counters
// route never shows an identifier whole.
func TestKeyDoc_ShowsTheIdentifiersHMAC(t *testing.T) {
	ids := identities{secret: []byte("s3cret")}
	ks := engine.KeyState{Key: engine.Key{Namespace: "kd", Identifier: "alice", Window: time.Minute}}
	doc := keyDocOf(ks, nil, ids)
	if doc.Identifier != ids.shown("alice") || doc.Identifier == "alice" || doc.Limit != 0 {
		t.Fatalf("identifier %q limit %d: want the HMAC and no limit without a definition", doc.Identifier, doc.Limit)
	}
}

// TestListMax_DefaultAndBounds: a listing returns defaultListMax keys
// unless told, and refuses a max outside 1 to maxListMax with a 400.
func TestListMax_DefaultAndBounds(t *testing.T) {
	for _, tc := range []struct {
		q    map[string]string
		want int
		bad  bool
	}{
		{q: map[string]string{}, want: defaultListMax},
		{q: map[string]string{"max": "1"}, want: 1},
		{q: map[string]string{"max": "10000"}, want: maxListMax},
		{q: map[string]string{"max": "0"}, bad: true},
		{q: map[string]string{"max": "10001"}, bad: true},
		{q: map[string]string{"max": "-1"}, bad: true},
		{q: map[string]string{"max": "ten"}, bad: true},
	} {
		n, err := listMax(tc.q)
		var apiErr caddy.APIError
		switch {
		case tc.bad && (!errors.As(err, &apiErr) || apiErr.HTTPStatus != http.StatusBadRequest):
			t.Errorf("max %q: %d, %v; want a 400", tc.q["max"], n, err)
		case !tc.bad && (err != nil || n != tc.want):
			t.Errorf("max %q: %d, %v; want %d", tc.q["max"], n, err, tc.want)
		}
	}
}

// TestCounters_DeleteWithAnEmptyScopeIsRefused: `scope=` names no scope,
// so a DELETE with it is a 400 that forgets nothing; leaving scope out,
// or scope=node, forgets the key on this node.
func TestCounters_DeleteWithAnEmptyScopeIsRefused(t *testing.T) {
	resetOverrides(t)
	_, admin, base := startCaddy(t, overrideConfig(""))
	for _, k := range []string{"k1", "k2"} {
		if n := admitted(t, base, k, 1); n != 1 {
			t.Fatalf("%s: admitted %d of 1", k, n)
		}
	}
	r := adminDo(t, admin, http.MethodDelete, "/ratelimit/counters?zone=ov&identifier=k1&scope=")
	var e struct{ Error string }
	r.decode(t, http.StatusBadRequest, &e)
	if !strings.Contains(e.Error, "scope") {
		t.Fatalf("error %q does not name the scope", e.Error)
	}
	var doc keyDoc
	adminDo(t, admin, http.MethodGet, "/ratelimit/counters?zone=ov&identifier=k1").decode(t, http.StatusOK, &doc)
	if doc.Effective != 1 {
		t.Fatalf("after a refused DELETE, k1 counts %d, want its 1", doc.Effective)
	}
	for path, id := range map[string]string{"identifier=k1": "k1", "identifier=k2&scope=node": "k2"} {
		var fd forgetDoc
		adminDo(t, admin, http.MethodDelete, "/ratelimit/counters?zone=ov&"+path).decode(t, http.StatusOK, &fd)
		if !fd.Forgotten || fd.Identifier != id {
			t.Fatalf("DELETE %s answered %+v", path, fd)
		}
	}
}

// TestCounters_MalformedUTF8IdentifiersStayApart: two identifiers that
// differ only in a byte that is not UTF-8 looked the same in every answer
// (JSON shows such a byte as U+FFFD); the answers now carry their bytes
// in hex beside them, and an identifier of valid UTF-8 gets no hex.
func TestCounters_MalformedUTF8IdentifiersStayApart(t *testing.T) {
	resetOverrides(t)
	_, admin, base := startCaddy(t, overrideConfig(""))
	for _, k := range []string{"a\x80", "a\x81", "ok"} {
		if n := admitted(t, base, k, 1); n != 1 {
			t.Fatalf("%q: admitted %d of 1", k, n)
		}
	}
	var list keyListDoc
	adminDo(t, admin, http.MethodGet, "/ratelimit/counters?zone=ov").decode(t, http.StatusOK, &list)
	hexes := map[string]string{}
	for _, k := range list.Keys {
		hexes[k.Identifier+"|"+k.IdentifierHex] = k.IdentifierHex
	}
	for _, want := range []string{"a\uFFFD|6180", "a\uFFFD|6181", "ok|"} {
		if _, ok := hexes[want]; !ok {
			t.Errorf("the listing lacks %q: %v", want, hexes)
		}
	}
	var doc keyDoc
	adminDo(t, admin, http.MethodGet, "/ratelimit/counters?zone=ov&identifier=a%81").decode(t, http.StatusOK, &doc)
	if doc.IdentifierHex != "6181" {
		t.Fatalf("the key a\\x81 shows as %q, hex %q", doc.Identifier, doc.IdentifierHex)
	}
	var ov overrideDoc
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=a%80", `{"limit": 7}`).decode(t, http.StatusOK, &ov)
	if ov.IdentifierHex != "6180" {
		t.Fatalf("the override of a\\x80 shows as %q, hex %q", ov.Identifier, ov.IdentifierHex)
	}
}

// TestListKeys_AnOldWindowsKeysTakeNoPlace: keys of a window no loaded
// config uses linger until the janitor drops them. A listing dropped them
// after taking its max, so it showed fewer keys than there were (none,
// here) and said it was truncated.
func TestListKeys_AnOldWindowsKeysTakeNoPlace(t *testing.T) {
	st := heldState(t)
	decide := func(id string, w time.Duration) {
		st.engine.Decide(context.Background(), engine.Limit{Key: engine.Key{Namespace: "lk", Identifier: id, Window: w}, Limit: 10, Cost: 1})
	}
	for _, id := range []string{"a", "b", "c"} {
		decide(id, time.Hour) // the window of an earlier config
	}
	decide("d", time.Minute)
	decide("e", time.Minute)
	defs := []zoneDef{{handler: &Handler{zones: []zone{{name: "lk", limit: 10, window: time.Minute}}}, window: time.Minute}}
	for _, c := range []struct {
		max       int
		keys      string
		truncated bool
	}{{2, "d e", false}, {1, "d", true}} {
		doc := listKeys(st, "lk", "", c.max, defs)
		var got []string
		for _, k := range doc.Keys {
			got = append(got, k.Identifier)
		}
		if strings.Join(got, " ") != c.keys || doc.Truncated != c.truncated {
			t.Errorf("max %d: keys %v, truncated %v; want %s, %v", c.max, got, doc.Truncated, c.keys, c.truncated)
		}
	}
}

// TestListStrict_AnOldWindowsKeysAreNotTheZones: a key in strict mode in a
// window no loaded config uses any more (the zone's window changed in a
// reload) keeps its deadline until it passes, but it is not the zone's:
// the strict listing showed it and counted it in its total, where the
// counters listing leaves such keys out.
func TestListStrict_AnOldWindowsKeysAreNotTheZones(t *testing.T) {
	st := heldState(t)
	st.engine.SetOrigin(fakeOrigin{}) // strict mode is an origin's: without one there is none
	defer st.engine.SetOrigin(nil)
	deny := func(id string, w time.Duration) {
		l := engine.Limit{Key: engine.Key{Namespace: "ls", Identifier: id, Window: w}, Limit: 2, Cost: 1}
		for range 3 { // the third is denied at the limit: strict mode
			st.engine.Decide(context.Background(), l)
		}
	}
	deny("old", time.Hour) // the window of an earlier config
	deny("new", time.Minute)
	defs := []zoneDef{{handler: &Handler{zones: []zone{{name: "ls", limit: 2, window: time.Minute}}}, window: time.Minute}}
	defsOf := func(zone string) []zoneDef {
		if zone == "ls" {
			return defs
		}
		return nil
	}
	for _, byZone := range []bool{true, false} {
		doc := listStrict(st, "ls", byZone, 10, defsOf)
		var got []string
		for _, k := range doc.Keys {
			got = append(got, k.Identifier)
		}
		if strings.Join(got, " ") != "new" || doc.Total != 1 || doc.Truncated {
			t.Errorf("by zone %v: keys %v, total %d, truncated %v; want new alone", byZone, got, doc.Total, doc.Truncated)
		}
	}
}
