package ratelimit

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// resetOverrides empties the process's book before and after a test: it
// outlives reloads, so it outlives tests too.
func resetOverrides(t *testing.T) {
	t.Helper()
	clear := func() {
		overrides.mu.Lock()
		overrides.recs = map[overrideKey]overrideRec{}
		overrides.from = ""
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

// admitted sends n requests for key and counts the 200s. A request on a
// new connection that the server closed unanswered is sent once more:
// after a reload the old server, still shutting down, may accept a
// connection in its last instant and close it before any handler ran
// (see get; once in a run of every package at once, the first request
// after a reload failed with EOF).
func admitted(t *testing.T, base, key string, n int) int {
	t.Helper()
	awaitOneServer(t, base)
	ok := 0
	for range n {
		req, _ := http.NewRequest(http.MethodGet, base+"/", nil)
		req.Header.Set("X-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) {
			resp, err = http.DefaultClient.Do(req)
		}
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			ok++
		}
	}
	return ok
}

// awaitOneServer waits until one config's server alone holds the
// listener of rawURL's address. Caddy shares a listener between the old
// config's server and the new one's, and a reload returns while the old
// one is still shutting down: until it lets go of the listener it
// accepts connections too, and closes them unanswered (EOF) or answers
// them under the old config (TestOverrides_AZoneARemovedConfigDefinedKeepsItsOverrides
// met the first once in a run of every package at once).
func awaitOneServer(t *testing.T, rawURL string) {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	servers := func() int { return caddy.ListenerUsage("tcp", u.Host) }
	redistest.Eventually(t, 10*time.Second, "the old config's server let go of "+u.Host, func() bool { return servers() <= 1 })
	if servers() == 0 {
		t.Fatalf("no server listens on %s", u.Host)
	}
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

// TestOverrides_LongIdentifiersAreNormalizedOnce: an identifier over 64
// bytes is hashed once, on every path. A runtime override of one, and a
// Caddyfile override of one, are applied by the handler and shown by the
// counters route (one key and the listing); a raw identifier whose text
// is that hash ("#" and 64 hex digits, 65 bytes) is another key, with its
// own override. The same with identifier_secret (stored as HMACs), with
// and without the region's Redis.
func TestOverrides_LongIdentifiersAreNormalizedOnce(t *testing.T) {
	const secret = "identifier-secret-0123456789"
	long, fileLong := strings.Repeat("L", 100), strings.Repeat("F", 100)
	sum := sha256.Sum256([]byte(long))
	hashLike := "#" + hex.EncodeToString(sum[:]) // long's stored form, sent raw
	for _, tc := range []struct {
		name   string
		secret bool
		redis  bool
	}{
		{name: "raw"},
		{name: "identifier_secret", secret: true},
		{name: "identifier_secret with Redis", secret: true, redis: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resetOverrides(t)
			var opts []string
			if tc.redis {
				opts = append(opts, "redis "+redistest.Start(t).URL(), "fast_tick 10ms")
			}
			ids := identities{}
			if tc.secret {
				opts = append(opts, "identifier_secret "+secret)
				ids.secret = []byte(secret)
			}
			global := ""
			if len(opts) > 0 {
				global = "\tratelimit {\n\t\t" + strings.Join(opts, "\n\t\t") + "\n\t}"
			}
			_, admin, base := startCaddy(t, func(admin, port int) string {
				return caddyConfig(admin, port, global, `
	ratelimit {
		zone ov {
			key      {http.request.header.X-Key}
			limit    2
			window   1m
			override `+fileLong+` 4
		}
	}
	respond "ok"`)
			})
			stored := func(id string) string { return ids.shown(engine.NormalizeIdentifier(id)) }
			for _, o := range []struct {
				id    string
				limit int
			}{{long, 3}, {hashLike, 0}} {
				var doc overrideDoc
				adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier="+url.QueryEscape(o.id),
					fmt.Sprintf(`{"limit": %d}`, o.limit)).decode(t, http.StatusOK, &doc)
				if doc.Identifier != stored(o.id) {
					t.Fatalf("override stored as %q, want %q", doc.Identifier, stored(o.id))
				}
			}
			if stored(long) == stored(hashLike) {
				t.Fatalf("a hashed identifier and the raw identifier of its text are both stored as %q", stored(long))
			}
			for _, k := range []struct {
				id          string
				send, admit int
			}{{long, 4, 3}, {hashLike, 1, 0}, {fileLong, 5, 4}} {
				if n := admitted(t, base, k.id, k.send); n != k.admit {
					t.Fatalf("%.12s…: admitted %d of %d, want %d", k.id, n, k.send, k.admit)
				}
			}
			want := map[string]int64{stored(long): 3, stored(hashLike): 0, stored(fileLong): 4}
			for _, id := range []string{long, hashLike, fileLong} {
				var doc keyDoc
				adminDo(t, admin, http.MethodGet, "/ratelimit/counters?zone=ov&identifier="+url.QueryEscape(id)).decode(t, http.StatusOK, &doc)
				if doc.Identifier != stored(id) || doc.Limit != want[doc.Identifier] {
					t.Errorf("counters of %.12s…: identifier %q limit %d (effective %d), want %q limit %d",
						id, doc.Identifier, doc.Limit, doc.Effective, stored(id), want[stored(id)])
				}
			}
			var list keyListDoc
			adminDo(t, admin, http.MethodGet, "/ratelimit/counters?zone=ov").decode(t, http.StatusOK, &list)
			if len(list.Keys) != len(want) {
				t.Fatalf("the listing holds %d keys, want %d: %+v", len(list.Keys), len(want), list.Keys)
			}
			for _, k := range list.Keys {
				if l, ok := want[k.Identifier]; !ok || k.Limit != l {
					t.Errorf("listing: %q limit %d, want %d", k.Identifier, k.Limit, l)
				}
			}
		})
	}
}

// TestOverrides_AnotherSecretsOverridesDoNotApply: an override is named
// by its identifier's form, so one made under identifier_secret applies
// under that secret only. Once it applied, after the secret was removed,
// to the raw identifier that is its HMAC's text (a client sending that
// text took another key's limit); now it applies again when the secret
// comes back. An override by a build before forms, an HMAC under the
// secret, still applies, and a change of its key under the secret takes
// its place.
func TestOverrides_AnotherSecretsOverridesDoNotApply(t *testing.T) {
	resetOverrides(t)
	const secret = "0123456789abcdef0123"
	withSecret := overrideConfig("\tratelimit {\n\t\tidentifier_secret " + secret + "\n\t}")
	tester, admin, base := startCaddy(t, withSecret)
	port := portOf(t, base)
	var doc overrideDoc
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=bob", `{"limit": 0}`).decode(t, http.StatusOK, &doc)
	hmacOfBob := identifierHMAC([]byte(secret), "bob")
	if doc.Identifier != hmacOfBob {
		t.Fatalf("the override is named %q, want bob's HMAC %q", doc.Identifier, hmacOfBob)
	}
	if n := admitted(t, base, "bob", 1); n != 0 {
		t.Fatalf("bob blocked under the secret: admitted %d", n)
	}

	tester.InitServer(overrideConfig("")(admin, port), "caddyfile") // the secret removed
	if n := admitted(t, base, hmacOfBob, 2); n != 2 {
		t.Fatalf("without the secret, the raw identifier %q took bob's block: admitted %d of 2", hmacOfBob, n)
	}
	if r := adminDo(t, admin, http.MethodGet, "/ratelimit/overrides?zone=ov&identifier="+hmacOfBob); r.status != http.StatusNotFound {
		t.Fatalf("without the secret, the override shows for the raw identifier: %d %s", r.status, r.body)
	}

	tester.InitServer(withSecret(admin, port), "caddyfile") // the secret back
	if n := admitted(t, base, "bob", 1); n != 0 {
		t.Fatalf("with the secret back, bob admitted %d: its block should apply again", n)
	}

	// An override a build before forms stored: bob's HMAC, no form.
	old := overrideRec{Zone: "ov", Identifier: identifierHMAC([]byte(secret), "carol"), Limit: 0,
		CreatedMs: time.Now().UnixMilli(), Version: time.Now().UnixMicro()}
	overrides.merge([]overrideRec{old})
	if n := admitted(t, base, "carol", 1); n != 0 {
		t.Fatalf("an override of no form, under the secret it was made with, admitted %d", n)
	}
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=carol", `{"limit": 5}`).decode(t, http.StatusOK, &doc)
	if n := admitted(t, base, "carol", 6); n != 5 {
		t.Fatalf("carol's override of 5 set under the secret admitted %d of 6", n)
	}
	adminDo(t, admin, http.MethodDelete, "/ratelimit/overrides?zone=ov&identifier=carol").decode(t, http.StatusOK, &doc)
	if r := adminDo(t, admin, http.MethodGet, "/ratelimit/overrides?zone=ov&identifier=carol"); r.status != http.StatusNotFound {
		t.Fatalf("after one DELETE carol still has an override: %d %s", r.status, r.body)
	}
}

// TestOverrides_NamesCarryTheForm: a record's name in the region's hash
// and in MySQL carries its form, and reads back whole; a name of no form
// (a build before forms) reads as one.
func TestOverrides_NamesCarryTheForm(t *testing.T) {
	for _, r := range []overrideRec{
		{Zone: "z", Identifier: "id", Form: "h0123abcd", Limit: 3, Version: 7},
		{Zone: "z", Identifier: "id", Form: "h0123abcd", Reset: true, Version: 8},
		{Zone: "z", Identifier: "id", Limit: 4, Version: 9},
		{Zone: "z", Identifier: "id", Reset: true, Version: 10},
	} {
		got, ok := recOfRegion(r.regionValue())
		if !ok || got.Zone != r.Zone || got.Identifier != r.Identifier || got.Form != r.Form || got.Reset != r.Reset || got.Limit != r.Limit {
			t.Errorf("%+v through the region's hash: %+v (%v)", r, got, ok)
		}
		row := r.row()
		if len(row.Namespace) > 80 {
			t.Errorf("%+v: namespace of %d bytes, over MySQL's 80", r, len(row.Namespace))
		}
		if got := recOfRow(&row); got.Zone != r.Zone || got.Form != r.Form || got.Reset != r.Reset {
			t.Errorf("%+v through MySQL: %+v", r, got)
		}
	}
	long := overrideRec{Zone: strings.Repeat("z", maxZoneName), Identifier: "id", Form: "h0123abcd", Reset: true}
	if n := len(long.row().Namespace); n > 80 {
		t.Errorf("a reset of a 64-byte zone under a secret has a namespace of %d bytes, over MySQL's 80", n)
	}
}
