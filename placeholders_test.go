package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// placeholdersOf serves one request through h and returns what the
// {http.ratelimit.*} placeholders read afterwards.
func placeholdersOf(t *testing.T, h *Handler, vars map[string]string) map[string]string {
	t.Helper()
	req := requestWith(vars)
	next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
	_ = h.ServeHTTP(httptest.NewRecorder(), req, next)
	repl := req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	out := map[string]string{}
	for _, k := range []string{"zone", "limit", "remaining", "reset", "decision", "identifier"} {
		v, ok := repl.GetString("http.ratelimit." + k)
		if !ok {
			v = "<unset>"
		}
		out[k] = v
	}
	return out
}

func wantPlaceholders(t *testing.T, got map[string]string, want string) {
	t.Helper()
	var b strings.Builder
	for _, k := range []string{"zone", "limit", "remaining", "reset", "decision", "identifier"} {
		b.WriteString(k + "=" + got[k] + " ")
	}
	if s := strings.TrimSpace(b.String()); s != want {
		t.Fatalf("placeholders\n %s\nwant\n %s", s, want)
	}
}

// TestPlaceholders_SpeakOfTheZoneThatDecided: the most constrained zone of
// an allowed request, the zone that denied a denied one.
func TestPlaceholders_SpeakOfTheZoneThatDecided(t *testing.T) {
	useClock(t, 15*time.Second)
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("ph_wide", 10, time.Minute), zoneOf("ph_tight", 2, time.Minute)}})
	id := map[string]string{"ph_wide": "customer-1234567890", "ph_tight": "customer-1234567890"}
	wantPlaceholders(t, placeholdersOf(t, h, id),
		"zone=ph_tight limit=2 remaining=1 reset=45 decision=allowed identifier=cust…")
	placeholdersOf(t, h, id)
	wantPlaceholders(t, placeholdersOf(t, h, id),
		"zone=ph_tight limit=2 remaining=0 reset=45 decision=denied identifier=cust…")
}

func TestPlaceholders_DryRunSkipAndMissingKey(t *testing.T) {
	useClock(t, 0)
	dry := provisionTest(t, nil, &Handler{DryRun: true, Zones: []*Zone{zoneOf("ph_dry", 1, time.Minute)}})
	placeholdersOf(t, dry, map[string]string{"ph_dry": "k"})
	wantPlaceholders(t, placeholdersOf(t, dry, map[string]string{"ph_dry": "k"}),
		"zone=ph_dry limit=1 remaining=0 reset=60 decision=dry_run_denied identifier=…")
	skip := provisionTest(t, nil, &Handler{OnMissingKey: "skip", Zones: []*Zone{zoneOf("ph_skip", 1, time.Minute)}})
	wantPlaceholders(t, placeholdersOf(t, skip, nil), "zone= limit= remaining= reset= decision=skipped identifier=")
	deny := provisionTest(t, nil, &Handler{OnMissingKey: "deny", Zones: []*Zone{zoneOf("ph_deny", 1, time.Minute)}})
	wantPlaceholders(t, placeholdersOf(t, deny, nil), "zone=ph_deny limit= remaining= reset= decision=denied identifier=")
}

// TestPlaceholders_AFirstDecisionAsksNoOtherPlaceholder: a request as
// Caddy's server makes it (a replacer with an HTTP provider, request
// variables), decided by one directive, then by a second. To learn
// whether a decision came before, the first asked the replacer for one of
// its own placeholders, which called every provider, Caddy's HTTP one
// among them: a call whose large frame grew the goroutine's stack (3.4 %
// of Caddy's CPU in the load test's allow row). The providers are now
// asked nothing of ours until something reads a placeholder, and the
// second decision still speaks over the first.
func TestPlaceholders_AFirstDecisionAsksNoOtherPlaceholder(t *testing.T) {
	useClock(t, 15*time.Second)
	loose := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("ph_first", 10, time.Minute)}})
	strict := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("ph_second", 1, time.Minute)}})
	asked := 0
	req := requestWith(map[string]string{"ph_first": "k", "ph_second": "k"})
	repl := req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	repl.Map(func(key string) (any, bool) {
		if strings.HasPrefix(key, placeholderPrefix) {
			asked++
		}
		return nil, false
	})
	req = req.WithContext(context.WithValue(req.Context(), caddyhttp.VarsCtxKey, map[string]any{}))
	next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
	for i, h := range []*Handler{loose, strict, strict} {
		_ = h.ServeHTTP(httptest.NewRecorder(), req, next)
		if asked != 0 {
			t.Fatalf("decision %d asked the other providers for a placeholder of ours %d times", i+1, asked)
		}
	}
	for k, want := range map[string]string{"decision": "denied", "zone": "ph_second", "remaining": "0"} {
		if got, _ := repl.GetString(placeholderPrefix + k); got != want {
			t.Errorf("%s%s = %q after the third decision, want %q", placeholderPrefix, k, got, want)
		}
	}
}

// TestPlaceholders_IdentifierLeavesAsConfigured: the HMAC under
// identifier_secret, whole with log_identifiers, truncated otherwise; an
// identifier over 64 bytes as the engine keeps it, hashed, as the log
// lines and the admin API show it. The placeholder showed its raw bytes
// instead (whole or cut), which no log line or admin answer does.
func TestPlaceholders_IdentifierLeavesAsConfigured(t *testing.T) {
	useClock(t, 0)
	const secret = "0123456789abcdef-secret"
	long := strings.Repeat("L", 80)
	hashed := engine.NormalizeIdentifier(long)
	for _, tc := range []struct {
		app      *App
		id, want string
	}{
		{&App{}, "sk_live_abcdefghij", "sk_l…"},
		{&App{LogIdentifiers: true}, "sk_live_abcdefghij", "sk_live_abcdefghij"},
		{&App{IdentifierSecret: secret}, "sk_live_abcdefghij", identifierHMAC([]byte(secret), "sk_live_abcdefghij")},
		{&App{}, long, truncateIdentifier(hashed)},
		{&App{LogIdentifiers: true}, long, hashed},
		{&App{IdentifierSecret: secret}, long, identifierHMAC([]byte(secret), hashed)},
	} {
		ids, err := newIdentities(tc.app.IdentifierSecret, tc.app.LogIdentifiers)
		if err != nil {
			t.Fatal(err)
		}
		tc.app.ids = ids
		h := provisionTest(t, tc.app, &Handler{Zones: []*Zone{zoneOf("ph_id", 5, time.Minute)}})
		if got := placeholdersOf(t, h, map[string]string{"ph_id": tc.id})["identifier"]; got != tc.want {
			t.Errorf("identifier %.20q…: %q, want %q", tc.id, got, tc.want)
		}
		if fields := ids.logFields(hashed); tc.id == long && !strings.Contains(fmt.Sprint(fields), strings.TrimSuffix(tc.want, "…")) {
			t.Errorf("the log line's fields %v do not show what the placeholder does, %q", fields, tc.want)
		}
	}
}

// TestCaddy_PlaceholdersInARouteAnErrorRouteAndTheAccessLog: the README's
// example: a response and an error body read the decision, and the access
// log carries it (log_append).
func TestCaddy_PlaceholdersInARouteAnErrorRouteAndTheAccessLog(t *testing.T) {
	useClock(t, 15*time.Second)
	logFile := filepath.Join(t.TempDir(), "access.log")
	routes := fmt.Sprintf(`
	log {
		output file %s
		format json
	}
	log_append ratelimit_decision {http.ratelimit.decision}
	log_append ratelimit_zone {http.ratelimit.zone}
	handle /ph {
		ratelimit {
			zone e2e_ph {
				key    {http.request.header.X-Key}
				limit  2
				window 1m
			}
		}
		respond "{http.ratelimit.decision} {http.ratelimit.zone} {http.ratelimit.remaining}"
	}
	handle_errors 429 {
		respond "{http.ratelimit.decision} by {http.ratelimit.zone}: retry in {http.ratelimit.reset} s" 429
	}`, logFile)
	tester, _, base := startCaddy(t, func(admin, port int) string { return e2eConfig(admin, port, routes) })
	get(t, tester, base+"/ph", "X-Key", "k").expect(t, 200, "allowed e2e_ph 1")
	get(t, tester, base+"/ph", "X-Key", "k").expect(t, 200, "allowed e2e_ph 0")
	get(t, tester, base+"/ph", "X-Key", "k").expect(t, 429, "denied by e2e_ph: retry in 45 s")
	var lines []string
	redistest.Eventually(t, 5*time.Second, "three access log lines", func() bool {
		b, _ := os.ReadFile(logFile)
		lines = strings.Split(strings.TrimSpace(string(b)), "\n")
		return len(lines) >= 3
	})
	for i, want := range []string{"allowed", "allowed", "denied"} {
		var entry map[string]any
		if err := json.Unmarshal([]byte(lines[i]), &entry); err != nil {
			t.Fatal(err)
		}
		if entry["ratelimit_decision"] != want || entry["ratelimit_zone"] != "e2e_ph" {
			t.Fatalf("access log line %d: decision %v zone %v, want %s e2e_ph", i, entry["ratelimit_decision"], entry["ratelimit_zone"], want)
		}
	}
}

// TestCaddy_READMEErrorBodySaysWhenToComeBack runs the error route of the
// README's Placeholders example ("an error body that says when to come
// back") as written there, over the example's zone (limit 100 a minute):
// a client that comes back after the seconds the body names must pass,
// and the number must be the response's Retry-After. The example named
// {http.ratelimit.reset}, the end of the fixed window: the 100 units
// counted in it still weigh 100 at the first moment of the next one, so a
// client denied 15 s into the window was told "retry in 45 s" (Retry-After
// 46) and was denied again at 45 s.
func TestCaddy_READMEErrorBodySaysWhenToComeBack(t *testing.T) {
	_, section := readmeSection(t, "Placeholders")
	_, rest, ok := strings.Cut(section, "\thandle_errors 429 {")
	if !ok {
		t.Fatal("the Placeholders section has no handle_errors 429 route")
	}
	errorRoute, _, _ := strings.Cut(rest, "\n\t}")
	clk := useClock(t, 15*time.Second)
	routes := fmt.Sprintf(`
	handle /come-back {
		ratelimit {
			zone per_key {
				key    {http.request.header.X-API-Key}
				limit  100
				window 1m
			}
		}
		respond "ok"
	}
	handle_errors 429 {%s
	}`, errorRoute)
	tester, _, base := startCaddy(t, func(admin, port int) string { return e2eConfig(admin, port, routes) })
	for i := 0; i < 100; i++ {
		get(t, tester, base+"/come-back", "X-API-Key", "k").expect(t, 200, "ok")
	}
	r := get(t, tester, base+"/come-back", "X-API-Key", "k")
	if r.status != 429 {
		t.Fatalf("the 101st request: status %d, want 429", r.status)
	}
	m := regexp.MustCompile(`retry in (\d+) s`).FindStringSubmatch(r.body)
	if m == nil {
		t.Fatalf("error body %q names no wait", r.body)
	}
	if ra := r.header.Get("Retry-After"); m[1] != ra {
		t.Errorf("error body %q says retry in %s s, Retry-After says %s", r.body, m[1], ra)
	}
	n, _ := strconv.Atoi(m[1])
	clk.Advance(time.Duration(n) * time.Second)
	if r := get(t, tester, base+"/come-back", "X-API-Key", "k"); r.status != 200 {
		t.Errorf("came back after the %d s the error body named: status %d %q", n, r.status, r.body)
	}
}

// TestCaddy_PlaceholdersSpeakOfTheLastDirective: two `ratelimit` directives
// on one request, the first admitting it and the second denying it. The
// response's headers are the second's, and so must the placeholders be:
// an error body or access log line that read them said "allowed" by the
// first directive's zone on a 429 the second had denied.
func TestCaddy_PlaceholdersSpeakOfTheLastDirective(t *testing.T) {
	useClock(t, 15*time.Second)
	routes := `
	route /two {
		ratelimit {
			zone e2e_ph_loose {
				key    {http.request.header.X-Key}
				limit  100
				window 1m
			}
		}
		ratelimit {
			zone e2e_ph_strict {
				key    {http.request.header.X-Key}
				limit  1
				window 1m
			}
		}
		respond "{http.ratelimit.decision} {http.ratelimit.zone} {http.ratelimit.remaining}"
	}
	handle_errors 429 {
		respond "{http.ratelimit.decision} {http.ratelimit.zone} {http.ratelimit.remaining}" 429
	}`
	tester, _, base := startCaddy(t, func(admin, port int) string { return e2eConfig(admin, port, routes) })
	get(t, tester, base+"/two", "X-Key", "k").expect(t, 200, "allowed e2e_ph_strict 0",
		"RateLimit", `"e2e_ph_strict";r=0;t=45`)
	get(t, tester, base+"/two", "X-Key", "k").expect(t, 429, "denied e2e_ph_strict 0",
		"RateLimit", `"e2e_ph_strict";r=0;t=45`)
}

// TestCaddy_HeadersSpeakOfTheLastDirective: two directives on one request
// in different header modes, the second denying. Each set only its own
// mode's headers, so the second's 429 carried the first's RateLimit (98
// units left) beside its own X-RateLimit-Remaining: 0, and the other way
// round the first's X-RateLimit-* beside the second's RateLimit (an
// audit). The response's headers are the last decision's; a second
// directive's missing key, a 429 without rate limit headers, drops the
// first's too.
func TestCaddy_HeadersSpeakOfTheLastDirective(t *testing.T) {
	useClock(t, 15*time.Second)
	routes := `
	route /draft-then-legacy {
		ratelimit {
			zone e2e_hd_first {
				key    {http.request.header.X-Key}
				limit  100
				window 1m
			}
		}
		ratelimit {
			zone e2e_hd_second {
				key    {http.request.header.X-Key}
				limit  1
				window 1m
			}
			headers legacy
		}
		respond "ok"
	}
	route /legacy-then-draft {
		ratelimit {
			zone e2e_hd_third {
				key    {http.request.header.X-Key}
				limit  100
				window 1m
			}
			headers legacy
		}
		ratelimit {
			zone e2e_hd_fourth {
				key    {http.request.header.X-Key}
				limit  1
				window 1m
			}
		}
		respond "ok"
	}
	route /then-missing {
		ratelimit {
			zone e2e_hd_fifth {
				key    {http.request.header.X-Key}
				limit  100
				window 1m
			}
			headers both
		}
		ratelimit {
			zone e2e_hd_sixth {
				key    {http.request.header.X-Other}
				limit  1
				window 1m
			}
			on_missing_key deny
		}
		respond "ok"
	}`
	tester, _, base := startCaddy(t, func(admin, port int) string { return e2eConfig(admin, port, routes) })
	none := func(r e2eResponse, path string, names ...string) {
		t.Helper()
		for _, n := range names {
			if v := r.header.Values(n); len(v) != 0 {
				t.Errorf("%s: %d %s: %q, an earlier directive's", path, r.status, n, v)
			}
		}
	}
	get(t, tester, base+"/draft-then-legacy", "X-Key", "k").expect(t, 200, "ok", "X-RateLimit-Remaining", "0")
	r := get(t, tester, base+"/draft-then-legacy", "X-Key", "k")
	r.expect(t, 429, "", "X-RateLimit-Remaining", "0")
	none(r, "/draft-then-legacy", "RateLimit", "RateLimit-Policy")

	get(t, tester, base+"/legacy-then-draft", "X-Key", "k").expect(t, 200, "ok", "RateLimit", `"e2e_hd_fourth";r=0;t=45`)
	r = get(t, tester, base+"/legacy-then-draft", "X-Key", "k")
	r.expect(t, 429, "", "RateLimit", `"e2e_hd_fourth";r=0;t=45`)
	none(r, "/legacy-then-draft", "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset")

	r = get(t, tester, base+"/then-missing", "X-Key", "k")
	if r.status != 429 {
		t.Fatalf("/then-missing: status %d, want the missing key's 429", r.status)
	}
	none(r, "/then-missing", "RateLimit", "RateLimit-Policy", "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset")
}
