package ratelimit

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// resetOverrides empties the process's book before and after a test: it
// outlives reloads, so it outlives tests too.
func resetOverrides(t *testing.T) {
	t.Helper()
	clear := func() {
		overrides.mu.Lock()
		overrides.recs = map[overrideKey]overrideRec{}
		overrides.once, overrides.loaded = false, nil
		overrides.loading.Store(false)
		overrides.set.Store(nil)
		overrides.mu.Unlock()
	}
	clear()
	t.Cleanup(clear)
}

// overrideConfig is one zone, limit 2 a minute, with a Caddyfile override
// of 4 for "file-key" and IPv6 identifiers masked to /64.
func overrideConfig(global string) func(admin, port int) string {
	return func(admin, port int) string {
		return caddyConfig(admin, port, global, `
	handle {
		ratelimit {
			zone ov {
				key         {http.request.header.X-Key}
				limit       2
				window      1m
				override    file-key 4
				ipv6_prefix 64
			}
		}
		respond "ok"
	}`)
	}
}

func adminSend(t *testing.T, admin int, method, path, body string) adminReply {
	t.Helper()
	req, err := http.NewRequest(method, fmt.Sprintf("http://localhost:%d%s", admin, path), strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	status, header, b := roundTrip(t, http.DefaultClient, req)
	return adminReply{status: status, header: header, body: b}
}

// admitted sends n requests for key and counts the 200s.
func admitted(t *testing.T, base, key string, n int) int {
	t.Helper()
	ok := 0
	for range n {
		req, _ := http.NewRequest(http.MethodGet, base+"/", nil)
		req.Header.Set("X-Key", key)
		if status, _, _ := roundTrip(t, http.DefaultClient, req); status == http.StatusOK {
			ok++
		}
	}
	return ok
}

// TestOverrides_RuntimeOverrideChangesALimitWithoutAReload: a PUT raises a
// denied key's limit at once, a runtime override wins over the Caddyfile's
// override line, a DELETE restores the denials, an override that expires
// lapses by itself, and a reload keeps the process's overrides.
func TestOverrides_RuntimeOverrideChangesALimitWithoutAReload(t *testing.T) {
	resetOverrides(t)
	tester, admin, base := startCaddy(t, overrideConfig(""))
	if n := admitted(t, base, "cust", 5); n != 2 {
		t.Fatalf("admitted %d of 5 at limit 2", n)
	}
	var doc overrideDoc
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=cust", `{"limit": 6, "reason": "plan upgrade"}`).
		decode(t, http.StatusOK, &doc)
	if doc.Scope != scopeNode || doc.Limit != 6 || doc.Reason != "plan upgrade" || doc.Expires != nil {
		t.Fatalf("PUT answered %+v, want limit 6 at scope node", doc)
	}
	if n := admitted(t, base, "cust", 6); n != 4 {
		t.Fatalf("after raising the limit to 6, admitted %d more, want 4", n)
	}
	// Precedence: runtime override > Caddyfile override > zone limit.
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=file-key", `{"limit": 1}`).decode(t, http.StatusOK, &doc)
	if n := admitted(t, base, "file-key", 4); n != 1 {
		t.Fatalf("file-key admitted %d, want the runtime override's 1 (not the Caddyfile's 4)", n)
	}
	adminSend(t, admin, http.MethodDelete, "/ratelimit/overrides?zone=ov&identifier=cust", "").decode(t, http.StatusOK, &doc)
	if !doc.Removed {
		t.Fatalf("DELETE answered %+v", doc)
	}
	if n := admitted(t, base, "cust", 2); n != 0 {
		t.Fatalf("after removing the override, admitted %d, want the zone's limit again (denied)", n)
	}
	if r := adminDo(t, admin, http.MethodGet, "/ratelimit/overrides?zone=ov&identifier=cust"); r.status != http.StatusNotFound {
		t.Fatalf("GET of a removed override: %d %s", r.status, r.body)
	}
	// An override that expires lapses by itself.
	exp := time.Now().Add(1500 * time.Millisecond).UTC().Format(time.RFC3339Nano)
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=brief", `{"limit": 100, "expires": "`+exp+`"}`).decode(t, http.StatusOK, &doc)
	if n := admitted(t, base, "brief", 3); n != 3 {
		t.Fatalf("under a limit-100 override, admitted %d of 3", n)
	}
	redistest.Eventually(t, 5*time.Second, "the override lapses", func() bool {
		return adminDo(t, admin, http.MethodGet, "/ratelimit/overrides?zone=ov&identifier=brief").status == http.StatusNotFound
	})
	if n := admitted(t, base, "brief", 1); n != 0 {
		t.Fatalf("after the override lapsed, a key over the zone's limit admitted %d", n)
	}
	// A reload keeps the process's overrides.
	tester.InitServer(overrideConfig("")(admin, portOf(t, base)), "caddyfile")
	var list overrideListDoc
	adminDo(t, admin, http.MethodGet, "/ratelimit/overrides?zone=ov").decode(t, http.StatusOK, &list)
	if len(list.Overrides) != 1 || list.Overrides[0].Identifier != "file-key" || list.Overrides[0].Limit != 1 {
		t.Fatalf("after a reload the overrides are %+v, want file-key's", list.Overrides)
	}
}

func portOf(t *testing.T, base string) int {
	t.Helper()
	var p int
	if _, err := fmt.Sscanf(base[strings.LastIndex(base, ":")+1:], "%d", &p); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestOverrides_IdentifiersAreMatchedAsTheHandlerCountsThem: an override
// set for one IPv6 address applies to its whole /64, as the zone counts.
func TestOverrides_IdentifiersAreMatchedAsTheHandlerCountsThem(t *testing.T) {
	resetOverrides(t)
	_, admin, base := startCaddy(t, overrideConfig(""))
	var doc overrideDoc
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=2001:db8:1:2::1", `{"limit": 0}`).decode(t, http.StatusOK, &doc)
	if doc.Identifier != "2001:db8:1:2::/64" {
		t.Fatalf("stored as %q, want the /64", doc.Identifier)
	}
	if n := admitted(t, base, "2001:db8:1:2::99", 2); n != 0 {
		t.Fatalf("limit 0 on the /64 admitted %d for another address in it", n)
	}
	if n := admitted(t, base, "2001:db8:1:3::1", 2); n != 2 {
		t.Fatalf("another /64 admitted %d, want its 2", n)
	}
}

// TestOverrides_BadInputIsRefusedAndStoresNothing: every malformed change
// is a 400 with a JSON error (an unknown zone a 404), and none is stored.
func TestOverrides_BadInputIsRefusedAndStoresNothing(t *testing.T) {
	resetOverrides(t)
	_, admin, _ := startCaddy(t, overrideConfig(""))
	past := time.Now().Add(-time.Minute).UTC().Format(time.RFC3339)
	const path = "/ratelimit/overrides?zone=ov&identifier=k"
	cases := []struct {
		name, method, path, body string
		status                   int
	}{
		{"negative limit", http.MethodPut, path, `{"limit": -1}`, 400},
		{"huge limit", http.MethodPut, path, `{"limit": 9007199254740992}`, 400},
		{"limit past int64", http.MethodPut, path, `{"limit": 99999999999999999999}`, 400},
		{"fractional limit", http.MethodPut, path, `{"limit": 1.5}`, 400},
		{"no limit", http.MethodPut, path, `{"reason": "x"}`, 400},
		{"malformed JSON", http.MethodPut, path, `{"limit": `, 400},
		{"two values", http.MethodPut, path, `{"limit": 1} {"limit": 2}`, 400},
		{"unknown field", http.MethodPut, path, `{"limit": 1, "scope": "global"}`, 400},
		{"expiry in the past", http.MethodPut, path, `{"limit": 1, "expires": "` + past + `"}`, 400},
		{"expiry not a time", http.MethodPut, path, `{"limit": 1, "expires": "tomorrow"}`, 400},
		{"reason too long", http.MethodPut, path, `{"limit": 1, "reason": "` + strings.Repeat("r", 513) + `"}`, 400},
		{"body over 64 KiB", http.MethodPut, path, `{"limit": 1, "reason": "` + strings.Repeat("r", 70<<10) + `"}`, 400},
		{"no identifier", http.MethodPut, "/ratelimit/overrides?zone=ov", `{"limit": 1}`, 400},
		{"empty identifier", http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=", `{"limit": 1}`, 400},
		{"unknown parameter", http.MethodPut, path + "&scope=global", `{"limit": 1}`, 400},
		{"no zone", http.MethodPut, "/ratelimit/overrides?identifier=k", `{"limit": 1}`, 400},
		{"unknown zone", http.MethodPut, "/ratelimit/overrides?zone=nope&identifier=k", `{"limit": 1}`, 404},
		{"POST", http.MethodPost, path, `{"limit": 1}`, 405},
		{"DELETE of none", http.MethodDelete, path, "", 404},
	}
	for _, c := range cases {
		r := adminSend(t, admin, c.method, c.path, c.body)
		if r.status != c.status {
			t.Errorf("%s: %d %s, want %d", c.name, r.status, bytes.TrimSpace(r.body), c.status)
			continue
		}
		if c.status != 405 && !bytes.HasPrefix(bytes.TrimSpace(r.body), []byte("{")) {
			t.Errorf("%s: body %q is not a JSON error", c.name, r.body)
		}
	}
	if n := overrides.active(); n != 0 {
		t.Fatalf("%d overrides stored after bad input", n)
	}
}

// TestOverrides_RegionScopeReachesTheOtherNodesThroughRedis: with Redis,
// a PUT is stored in the region (scope region); a change another node
// left in the region reaches this one within a few fast ticks, and a
// process that starts applies the region's overrides from its first
// decision.
func TestOverrides_RegionScopeReachesTheOtherNodesThroughRedis(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion ov-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t}", srv.URL())
	// Another node's change, in the region before this process starts.
	other, err := origin.New(origin.Config{Redis: []string{srv.URL()}}, origin.Options{NodeID: "other"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Close() })
	put := func(id string, limit int64) {
		t.Helper()
		rec := overrideRec{Zone: "ov", Identifier: id, Limit: limit, Region: "ov-test", CreatedMs: time.Now().UnixMilli(), Version: time.Now().UnixMicro()}
		if _, err := other.PutOverrides(context.Background(), []origin.Override{rec.regionValue()}, false); err != nil {
			t.Fatal(err)
		}
	}
	put("early", 0)
	_, admin, base := startCaddy(t, overrideConfig(global))
	if n := admitted(t, base, "early", 1); n != 0 {
		t.Fatalf("the region's limit-0 override set before start admitted %d on the first request", n)
	}
	var doc overrideDoc
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=mine", `{"limit": 7}`).decode(t, http.StatusOK, &doc)
	if doc.Scope != scopeRegion {
		t.Fatalf("scope %q, want region", doc.Scope)
	}
	_, all, err := other.Overrides(context.Background())
	if err != nil || len(all) != 2 {
		t.Fatalf("the region holds %+v (%v), want early and mine", all, err)
	}
	put("late", 0)
	start := time.Now()
	redistest.Eventually(t, 5*time.Second, "another node's change applied here", func() bool { return admitted(t, base, "late", 1) == 0 })
	t.Logf("another node's change applied here within %s", time.Since(start))
}
