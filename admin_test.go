package ratelimit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// startCaddy loads cfg into the in-process Caddy on the package's admin
// port, and unloads every ratelimit config when the test ends, so the next
// test starts with an empty engine pool.
func startCaddy(t *testing.T, cfg func(admin, port int) string) (*caddytest.Tester, int, string) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts Caddy")
	}
	admin, port := e2eAdminPort(t), redistest.MustFreePort(t)
	tester := caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{AdminPort: admin})
	t.Cleanup(func() {
		tester.InitServer(e2eConfig(admin, port, ""), "caddyfile")
		if n, ok := pool.References(poolKey); ok {
			t.Errorf("engine pool still has %d users after unloading", n)
		}
	})
	tester.InitServer(cfg(admin, port), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	return tester, admin, fmt.Sprintf("http://127.0.0.1:%d", port)
}

// adminReply is one answer of the admin endpoint.
type adminReply struct {
	status int
	header http.Header
	body   []byte
}

func adminDo(t *testing.T, admin int, method, path string) adminReply {
	t.Helper()
	req, err := http.NewRequest(method, fmt.Sprintf("http://localhost:%d%s", admin, path), nil)
	if err != nil {
		t.Fatal(err)
	}
	status, header, body := roundTrip(t, http.DefaultClient, req)
	return adminReply{status: status, header: header, body: body}
}

// wantJSON fails unless the reply has the status and a JSON body equal to
// want (compared as decoded values, so key order and spacing do not
// matter).
func (r adminReply) wantJSON(t *testing.T, status int, want string) {
	t.Helper()
	if r.status != status {
		t.Fatalf("status %d, want %d; body %s", r.status, status, r.body)
	}
	if ct := r.header.Get("Content-Type"); ct != "application/json" {
		t.Fatalf("Content-Type %q, want application/json", ct)
	}
	var got, exp any
	if err := json.Unmarshal(r.body, &got); err != nil {
		t.Fatalf("body is not JSON: %v: %s", err, r.body)
	}
	if err := json.Unmarshal([]byte(want), &exp); err != nil {
		t.Fatalf("bad expectation: %v", err)
	}
	if !reflect.DeepEqual(got, exp) {
		t.Fatalf("body\n%s\nwant\n%s", r.body, want)
	}
}

// decode decodes the reply's body into v after checking its status.
func (r adminReply) decode(t *testing.T, status int, v any) {
	t.Helper()
	if r.status != status {
		t.Fatalf("status %d, want %d; body %s", r.status, status, r.body)
	}
	if err := json.Unmarshal(r.body, v); err != nil {
		t.Fatalf("decoding %s: %v", r.body, err)
	}
}

// fakeOrigin is an origin that always answers at once with empty cells:
// with it the engine enters strict mode on denials, as it does with Redis.
type fakeOrigin struct{}

func (fakeOrigin) Read(context.Context, engine.Key, int64, uint32) (engine.Totals, error) {
	return engine.Totals{}, nil
}

func (fakeOrigin) Flush(_ context.Context, batch []engine.Delta) error {
	for i := range batch {
		batch[i].Totals, batch[i].Done = engine.Totals{Cur: batch[i].Own, Mine: batch[i].Own}, true
	}
	return nil
}

func (fakeOrigin) Reserve(context.Context, *engine.Reservation) error {
	return errors.New("the fake origin decides nothing")
}

// fakeView is what the status reads of an origin.
type fakeView struct{ stats origin.Stats }

func (v fakeView) Stats() origin.Stats { return v.stats }

func (fakeView) Peek(context.Context, engine.Key, int64) (engine.Totals, error) {
	return engine.Totals{}, errors.New("a fake origin holds nothing")
}

const adminRoutes = `
	handle /api {
		ratelimit {
			zone adm_key {
				key      {http.request.header.X-Key}
				limit    3
				window   1m
				override vip 10
			}
			zone adm_ip {
				key         {http.request.header.X-IP}
				limit       100
				window      1h
				ipv4_prefix 24
			}
		}
		respond "ok"
	}
`

// TestAdmin_Routes drives every route of the admin API through Caddy's
// real admin endpoint: status, one key, listings, strict mode, forgetting
// a key, and every error status.
func TestAdmin_Routes(t *testing.T) {
	// 15 s into a minute window, frozen: every number below is exact.
	clk := useClock(t, 15*time.Second)
	now := clk.Now()
	tester, admin, base := startCaddy(t, func(admin, port int) string {
		return caddyConfig(admin, port, "\tratelimit {\n\t\tregion test-1\n\t}", adminRoutes)
	})
	hit := func(key, ip string) int {
		var hdr []string
		if key != "" {
			hdr = append(hdr, "X-Key", key)
		}
		return get(t, tester, base+"/api", append(hdr, "X-IP", ip)...).status
	}
	for i, want := range []int{200, 200, 200, 429} {
		if got := hit("alice", "203.0.113.9"); got != want {
			t.Fatalf("alice request %d: %d, want %d", i+1, got, want)
		}
	}
	hit("bob", "203.0.113.10")
	hit("vip", "198.51.100.1")
	hit("", "198.51.100.2") // no key: the zone's shared bucket

	seq := now.UnixMilli() / 60_000
	// 15 s into the hour (and the minute): no previous cell, so effective
	// is the current count.
	t.Run("one key", func(t *testing.T) {
		adminDo(t, admin, "GET", "/ratelimit/counters?zone=adm_key&identifier=alice").wantJSON(t, 200, fmt.Sprintf(`{
			"zone": "adm_key", "identifier": "alice", "window_ms": 60000,
			"limit": 3, "effective": 3, "remaining": 0,
			"strict_until": null, "fresh_until": null,
			"cells": [{"sequence": %d, "regional": 3, "speculative": 0, "global": 0, "pending": 0, "blocked": true}]
		}`, seq))
		// The override applies; an empty identifier is the shared bucket.
		adminDo(t, admin, "GET", "/ratelimit/counters?zone=adm_key&identifier=vip").wantJSON(t, 200, fmt.Sprintf(`{
			"zone": "adm_key", "identifier": "vip", "window_ms": 60000,
			"limit": 10, "effective": 1, "remaining": 9,
			"strict_until": null, "fresh_until": null,
			"cells": [{"sequence": %d, "regional": 1, "speculative": 0, "global": 0, "pending": 0, "blocked": false}]
		}`, seq))
		var shared keyDoc
		adminDo(t, admin, "GET", "/ratelimit/counters?zone=adm_key&identifier=").decode(t, 200, &shared)
		if shared.Identifier != "" || shared.Effective != 1 {
			t.Fatalf("shared bucket: %+v", shared)
		}
		// An address is looked up by the prefix the zone counts it by.
		var ip keyDoc
		adminDo(t, admin, "GET", "/ratelimit/counters?zone=adm_ip&identifier=203.0.113.200").decode(t, 200, &ip)
		if ip.Identifier != "203.0.113.0/24" || ip.Effective != 4 || ip.WindowMs != 3_600_000 {
			t.Fatalf("IP prefix: %+v", ip)
		}
	})

	t.Run("listing", func(t *testing.T) {
		var all keyListDoc
		adminDo(t, admin, "GET", "/ratelimit/counters?zone=adm_key").decode(t, 200, &all)
		if got := identifiersOf(all.Keys); !reflect.DeepEqual(got, []string{"", "alice", "bob", "vip"}) || all.Truncated || all.Max != defaultListMax {
			t.Fatalf("listing: %v truncated %v max %d", got, all.Truncated, all.Max)
		}
		var two keyListDoc
		adminDo(t, admin, "GET", "/ratelimit/counters?zone=adm_key&max=2").decode(t, 200, &two)
		if got := identifiersOf(two.Keys); !reflect.DeepEqual(got, []string{"", "alice"}) || !two.Truncated {
			t.Fatalf("max=2: %v truncated %v", got, two.Truncated)
		}
		var pre keyListDoc
		adminDo(t, admin, "GET", "/ratelimit/counters?zone=adm_ip&prefix=198.51").decode(t, 200, &pre)
		if got := identifiersOf(pre.Keys); !reflect.DeepEqual(got, []string{"198.51.100.0/24"}) || pre.Keys[0].Effective != 2 {
			t.Fatalf("prefix: %+v", pre)
		}
		// A prefix that is not UTF-8 comes back in hex too: JSON carries
		// it as U+FFFD, which names no key.
		var binary keyListDoc
		adminDo(t, admin, "GET", "/ratelimit/counters?zone=adm_key&prefix=%FFa").decode(t, 200, &binary)
		if binary.PrefixHex != "ff61" || len(binary.Keys) != 0 {
			t.Fatalf("binary prefix: %+v", binary)
		}
		if pre.PrefixHex != "" {
			t.Fatalf("a UTF-8 prefix came with a hex form: %+v", pre)
		}
	})

	t.Run("status", func(t *testing.T) {
		r := adminDo(t, admin, "GET", "/ratelimit/status")
		var doc map[string]any
		r.decode(t, 200, &doc)
		if doc["region"] != "test-1" || doc["identifiers"] != "raw" {
			t.Fatalf("region/identifiers: %s", r.body)
		}
		for _, k := range []string{"origin", "propagation"} {
			if v, ok := doc[k]; !ok || v != nil {
				t.Fatalf("%s: %v (present %v), want null", k, v, ok)
			}
		}
		var st statusDoc
		r.decode(t, 200, &st)
		wantZones := []zoneStatus{
			{Name: "adm_ip", Key: "{http.request.header.X-IP}", WindowMs: 3_600_000},
			{Name: "adm_key", Key: "{http.request.header.X-Key}", WindowMs: 60_000},
		}
		if !reflect.DeepEqual(st.Zones, wantZones) {
			t.Fatalf("zones %+v, want %+v", st.Zones, wantZones)
		}
		// adm_key: "", alice, bob, vip; adm_ip: two /24 prefixes.
		if st.Engine.Entries != 6 || st.Engine.FirstDenials != 1 || st.Engine.LastRead != nil {
			t.Fatalf("engine %+v", st.Engine)
		}
	})

	t.Run("strict and origin", func(t *testing.T) {
		if got := adminDo(t, admin, "GET", "/ratelimit/strict"); string(got.body) != "{\"total\":0,\"truncated\":false,\"keys\":[]}\n" {
			t.Fatalf("no strict keys without an origin: %s", got.body)
		}
		st := lookupState()
		st.engine.SetOrigin(fakeOrigin{})
		st.setOrigin(fakeView{origin.Stats{Endpoints: []origin.EndpointStats{{
			Address: "redis://127.0.0.1:6379/0", Kind: "standalone", Breaker: origin.BreakerOpen, ReplayBreaker: origin.BreakerClosed,
			Calls:    map[string]map[string]uint64{"read": {"ok": 2}},
			LastRead: now,
		}}}})
		t.Cleanup(func() {
			st.engine.SetOrigin(nil)
			st.setOrigin(nil)
		})
		for range 4 {
			hit("carol", "192.0.2.1")
		}
		until := now.Add(time.Minute).UTC().Format(time.RFC3339Nano)
		adminDo(t, admin, "GET", "/ratelimit/strict").wantJSON(t, 200, fmt.Sprintf(`{
			"total": 1, "truncated": false,
			"keys": [{"zone": "adm_key", "identifier": "carol", "window_ms": 60000, "until": %q}]
		}`, until))
		adminDo(t, admin, "GET", "/ratelimit/strict?zone=adm_ip").wantJSON(t, 200, `{"total": 0, "truncated": false, "keys": []}`)
		var carol keyDoc
		adminDo(t, admin, "GET", "/ratelimit/counters?zone=adm_key&identifier=carol").decode(t, 200, &carol)
		if carol.StrictUntil == nil || !carol.StrictUntil.Equal(now.Add(time.Minute)) || carol.FreshUntil == nil {
			t.Fatalf("carol: strict %v fresh %v", carol.StrictUntil, carol.FreshUntil)
		}

		var doc struct {
			Origin json.RawMessage `json:"origin"`
		}
		adminDo(t, admin, "GET", "/ratelimit/status").decode(t, 200, &doc)
		want := fmt.Sprintf(`{"endpoints":[{"address":"redis://127.0.0.1:6379/0","kind":"standalone","breaker":"open","replay_breaker":"closed","calls":{"read":{"ok":2}},"round_trips":0,"slow_calls":0,"last_read":%q,"last_flush":null,"last_error":"","last_error_at":null}],"restarts":0,"override_notices":false,"processes":0,"builds":null,"clock_offset_ms":0}`,
			now.UTC().Format(time.RFC3339Nano))
		if string(doc.Origin) != want {
			t.Fatalf("origin\n%s\nwant\n%s", doc.Origin, want)
		}
	})

	t.Run("forget", func(t *testing.T) {
		adminDo(t, admin, "DELETE", "/ratelimit/counters?zone=adm_key&identifier=alice").
			wantJSON(t, 200, `{"zone": "adm_key", "identifier": "alice", "forgotten": true}`)
		adminDo(t, admin, "GET", "/ratelimit/counters?zone=adm_key&identifier=alice").wantError(t, 404, "alice")
		adminDo(t, admin, "DELETE", "/ratelimit/counters?zone=adm_key&identifier=alice").wantError(t, 404, "alice")
		// Forgotten on this node: alice starts over.
		if got := hit("alice", "203.0.113.9"); got != 200 {
			t.Fatalf("alice after forget: %d", got)
		}
		// Forgetting clears strict mode too.
		adminDo(t, admin, "DELETE", "/ratelimit/counters?zone=adm_key&identifier=carol").decode(t, 200, new(forgetDoc))
		if r := adminDo(t, admin, "GET", "/ratelimit/strict"); !strings.Contains(string(r.body), `"total":0`) {
			t.Fatalf("strict after forgetting carol: %s", r.body)
		}
	})

	t.Run("errors", func(t *testing.T) {
		for _, tc := range []struct {
			method, path string
			status       int
			allow        string
		}{
			{"GET", "/ratelimit/counters", 400, ""},
			{"GET", "/ratelimit/counters?zone=", 400, ""},
			{"GET", "/ratelimit/counters?zone=adm_key&identifier=secret-id&prefix=a", 400, ""},
			{"GET", "/ratelimit/counters?zone=adm_key&identifier=secret-id&max=5", 400, ""},
			{"GET", "/ratelimit/counters?zone=adm_key&max=0", 400, ""},
			{"GET", "/ratelimit/counters?zone=adm_key&max=10001", 400, ""},
			{"GET", "/ratelimit/counters?zone=adm_key&max=ten", 400, ""},
			{"GET", "/ratelimit/counters?zone=adm_key&zone=adm_ip", 400, ""},
			{"GET", "/ratelimit/counters?zone=adm_key&id=secret-id", 400, ""},
			{"GET", "/ratelimit/counters?zone=%zz", 400, ""},
			{"DELETE", "/ratelimit/counters?zone=adm_key", 400, ""},
			{"DELETE", "/ratelimit/counters?zone=adm_key&prefix=a", 400, ""},
			{"GET", "/ratelimit/status?verbose=1", 400, ""},
			{"GET", "/ratelimit/strict?max=-1", 400, ""},
			{"GET", "/ratelimit/strict?identifier=secret-id", 400, ""},
			{"GET", "/ratelimit/counters?zone=nope&identifier=secret-id", 404, ""},
			{"GET", "/ratelimit/counters?zone=nope", 404, ""},
			{"GET", "/ratelimit/counters?zone=adm_key&identifier=secret-id", 404, ""},
			{"DELETE", "/ratelimit/counters?zone=adm_key&identifier=secret-id", 404, ""},
			{"GET", "/ratelimit/strict?zone=nope", 404, ""},
			{"POST", "/ratelimit/status", 405, "GET, HEAD"},
			{"PUT", "/ratelimit/counters?zone=adm_key&identifier=secret-id", 405, "GET, HEAD, DELETE"},
			{"POST", "/ratelimit/counters", 405, "GET, HEAD, DELETE"},
			{"DELETE", "/ratelimit/strict", 405, "GET, HEAD"},
		} {
			r := adminDo(t, admin, tc.method, tc.path)
			r.wantError(t, tc.status, "secret-id")
			if got := r.header.Get("Allow"); got != tc.allow {
				t.Errorf("%s %s: Allow %q, want %q", tc.method, tc.path, got, tc.allow)
			}
		}
	})
}

// wantError fails unless the reply is a JSON error with the status whose
// message does not contain hidden (an identifier: Caddy logs admin errors).
func (r adminReply) wantError(t *testing.T, status int, hidden string) {
	t.Helper()
	var e struct {
		Error string `json:"error"`
	}
	if r.status != status {
		t.Fatalf("status %d, want %d; body %s", r.status, status, r.body)
	}
	if err := json.Unmarshal(r.body, &e); err != nil || e.Error == "" {
		t.Fatalf("status %d: body %s is not a JSON error (%v)", status, r.body, err)
	}
	if hidden != "" && strings.Contains(e.Error, hidden) {
		t.Fatalf("error message %q contains the identifier", e.Error)
	}
}

func identifiersOf(keys []keyDoc) []string {
	ids := []string{}
	for _, k := range keys {
		ids = append(ids, k.Identifier)
	}
	return ids
}

// TestAdmin_NotRunning answers 503 on every route when no loaded config
// uses the limiter: the admin module exists in every config, the engine
// only in those with a ratelimit handler or app.
func TestAdmin_NotRunning(t *testing.T) {
	_, admin, _ := startCaddy(t, func(admin, port int) string { return e2eConfig(admin, port, "") })
	for _, path := range []string{"/ratelimit/status", "/ratelimit/counters?zone=a&identifier=b", "/ratelimit/strict"} {
		adminDo(t, admin, "GET", path).wantError(t, 503, "")
	}
}

// TestAdmin_AnUnknownPathIsAJSON404: a path under /ratelimit/ that is no
// route was the admin server's text/plain "404 page not found", where the
// README says errors are JSON; it is a JSON 404 now, which lists the
// routes, and the routes themselves still answer.
func TestAdmin_AnUnknownPathIsAJSON404(t *testing.T) {
	_, admin, _ := startCaddy(t, overrideConfig(""))
	for _, path := range []string{"/ratelimit/nope", "/ratelimit/", "/ratelimit/status/", "/ratelimit/counters/x?zone=ov"} {
		r := adminDo(t, admin, "GET", path)
		r.wantError(t, 404, "")
		if !strings.Contains(string(r.body), "/ratelimit/overrides") {
			t.Errorf("GET %s: %s does not list the routes", path, r.body)
		}
	}
	adminDo(t, admin, "GET", "/ratelimit/status").decode(t, 200, &map[string]any{})
	if r := adminDo(t, admin, "GET", "/ratelimit/blocklist"); r.status != 404 || strings.Contains(string(r.body), "no such route") {
		t.Errorf("/ratelimit/blocklist without MySQL: %d %s, want the blocklist's own 404", r.status, r.body)
	}
}

// TestAdmin_HeadAnswersAsGet: a HEAD of a route that answers GET got a
// 405, so a monitor that checks the API with HEAD saw it failing. It now
// gets GET's status and headers (an override's ETag among them) and no
// body; a route's errors are GET's too, and a 405 lists HEAD in Allow.
func TestAdmin_HeadAnswersAsGet(t *testing.T) {
	resetOverrides(t)
	_, admin, _ := startCaddy(t, overrideConfig(""))
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=head-key", `{"limit": 7}`).decode(t, http.StatusOK, new(overrideDoc))
	for _, path := range []string{"/ratelimit/status", "/ratelimit/strict", "/ratelimit/counters?zone=ov",
		"/ratelimit/overrides?zone=ov", "/ratelimit/overrides?zone=ov&identifier=head-key", "/ratelimit/overrides?zone=nope"} {
		get, head := adminDo(t, admin, http.MethodGet, path), adminDo(t, admin, http.MethodHead, path)
		if head.status != get.status || len(head.body) != 0 {
			t.Errorf("HEAD %s: status %d with %d bytes, want GET's %d and none", path, head.status, len(head.body), get.status)
		}
		for _, h := range []string{"Content-Type", "ETag"} {
			if head.header.Get(h) != get.header.Get(h) {
				t.Errorf("HEAD %s: %s %q, GET's %q", path, h, head.header.Get(h), get.header.Get(h))
			}
		}
	}
	if etag := adminDo(t, admin, http.MethodHead, "/ratelimit/overrides?zone=ov&identifier=head-key").header.Get("ETag"); etag == "" {
		t.Error("HEAD of one override has no ETag")
	}
	r := adminDo(t, admin, http.MethodPost, "/ratelimit/overrides?zone=ov&identifier=head-key")
	if r.status != http.StatusMethodNotAllowed || r.header.Get("Allow") != "GET, HEAD, PUT, DELETE" {
		t.Errorf("POST: %d, Allow %q, want 405 with GET, HEAD, PUT, DELETE", r.status, r.header.Get("Allow"))
	}
}
