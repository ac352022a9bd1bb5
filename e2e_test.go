package ratelimit

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// adminPort is the in-process Caddy's admin port, chosen once: caddytest
// starts Caddy the first time and reuses it afterwards (-count=N).
var adminPort struct {
	once sync.Once
	port int
}

func e2eAdminPort(t *testing.T) int {
	adminPort.once.Do(func() { adminPort.port = redistest.MustFreePort(t) })
	return adminPort.port
}

// e2eConfig renders a Caddyfile for the in-process Caddy: its admin endpoint
// on a port of its own (never caddytest's default 2999, so this package and
// others can test in parallel), one plain-HTTP site on loopback.
func e2eConfig(admin, port int, routes string) string {
	return caddyConfig(admin, port, "", routes)
}

// caddyConfig is e2eConfig with extra global options (a `ratelimit` block,
// a `log` block).
func caddyConfig(admin, port int, globals, routes string) string {
	return fmt.Sprintf(`{
	admin localhost:%d
	http_port %d
	auto_https off
	persist_config off
	skip_install_trust
	grace_period 1ns
%s
}

http://127.0.0.1:%d {
	bind 127.0.0.1
%s
	respond "fallback"
}
`, admin, port, globals, port, routes)
}

// e2eRoutes is the first config: one zone on /one, two zones on /two, and
// an error route, so denials are seen through Caddy's error flow.
const e2eRoutes = `
	handle /one {
		ratelimit {
			zone e2e_one {
				key    {http.request.header.X-Key}
				limit  3
				window 1m
			}
		}
		respond "one"
	}
	handle /two {
		ratelimit {
			zone e2e_tight {
				key    {http.request.header.X-Key}
				limit  1
				window 1m
			}
			zone e2e_wide {
				key    {http.request.header.X-Tenant}
				limit  10
				window 1h
			}
			headers both
		}
		respond "two"
	}
	handle_errors 429 {
		respond "slow down: {err.message}" {err.status_code}
	}
`

// e2eRoutesReloaded keeps zone e2e_one with a higher limit and drops /two.
const e2eRoutesReloaded = `
	handle /one {
		ratelimit {
			zone e2e_one {
				key    {http.request.header.X-Key}
				limit  5
				window 1m
			}
			headers legacy
		}
		respond "one again"
	}
`

type e2eResponse struct {
	status int
	body   string
	header http.Header
}

func get(t *testing.T, tester *caddytest.Tester, url string, headers ...string) e2eResponse {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	awaitOneServer(t, url)
	// A connection of its own: a reload shuts the old server down within a
	// grace period of 1 ns, and a kept-alive connection it accepted could be
	// reset under the next request.
	req.Close = true
	// Caddy hands its listener from the old server to the new one on a
	// reload; a connection the old server accepted in its last instant is
	// closed unanswered (EOF). That request never reached a handler, so it
	// is sent once more.
	if resp, err := tester.Client.Do(req); err == nil {
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return e2eResponse{status: resp.StatusCode, body: string(body), header: resp.Header}
	} else if !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) {
		t.Fatal(err)
	}
	status, header, body := roundTrip(t, tester.Client, req)
	return e2eResponse{status: status, body: string(body), header: header}
}

// awaitNewConfig sends requests to url (with headers) until one is
// answered the way only the config just loaded answers (isNew), at most
// 100 of them. A connection the old server accepted in the reload's last
// instant is still served by the old config after the reload returned,
// its handler's limit and headers included (once in a CI run: alice's
// first request after the reload to a limit of 5 was denied at the old
// limit of 3). The probes use keys of their own.
func awaitNewConfig(t *testing.T, tester *caddytest.Tester, url string, isNew func(e2eResponse) bool, headers ...string) {
	t.Helper()
	for range 100 {
		if isNew(get(t, tester, url, headers...)) {
			return
		}
	}
	t.Fatalf("%s: no answer of the config just loaded in 100 requests", url)
}

// roundTrip sends req with c and returns the response's status, header and
// body.
func roundTrip(t *testing.T, c *http.Client, req *http.Request) (int, http.Header, []byte) {
	t.Helper()
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header, body
}

func (r e2eResponse) expect(t *testing.T, status int, body string, headers ...string) {
	t.Helper()
	if r.status != status || r.body != body {
		t.Fatalf("got %d %q, want %d %q", r.status, r.body, status, body)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		k, want := headers[i], headers[i+1]
		got, present := r.header[http.CanonicalHeaderKey(k)]
		switch {
		case want == "" && present:
			t.Fatalf("%s: %q, want absent", k, got)
		case want != "" && r.header.Get(k) != want:
			t.Fatalf("%s: %q, want %q", k, r.header.Get(k), want)
		}
	}
}

// TestCaddy_EndToEnd runs Caddy in-process with the module: statuses and
// both header sets for one and two zones, a denial that charges no other
// zone, a reload that keeps the counts, and no engine goroutine left once
// the last config using it is unloaded.
func TestCaddy_EndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy")
	}
	// 15 s into a minute (and an hour) window, frozen: header values are
	// exact.
	useClock(t, 15*time.Second)
	admin, port := e2eAdminPort(t), redistest.MustFreePort(t)
	base := fmt.Sprintf("http://127.0.0.1:%d", port)

	tester := caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{AdminPort: admin})
	tester.InitServer(e2eConfig(admin, port, e2eRoutes), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	st := lookupState()
	if st == nil {
		t.Fatal("no engine in the pool after loading a config with ratelimit")
	}

	t.Run("one zone", func(t *testing.T) {
		for r := 2; r >= 0; r-- {
			get(t, tester, base+"/one", "X-Key", "alice").expect(t, 200, "one",
				"RateLimit-Policy", `"e2e_one";q=3;w=60`,
				"RateLimit", fmt.Sprintf(`"e2e_one";r=%d;t=45`, r),
				"X-RateLimit-Remaining", "",
				"Retry-After", "")
		}
		// The error route shapes the body; the identifier appears nowhere.
		get(t, tester, base+"/one", "X-Key", "alice").expect(t, 429, "slow down: rate limit exceeded: zone e2e_one",
			"RateLimit-Policy", `"e2e_one";q=3;w=60`,
			"RateLimit", `"e2e_one";r=0;t=45`,
			"Retry-After", "46")
		get(t, tester, base+"/one", "X-Key", "bob").expect(t, 200, "one", "RateLimit", `"e2e_one";r=2;t=45`)
	})

	t.Run("two zones", func(t *testing.T) {
		get(t, tester, base+"/two", "X-Key", "k1", "X-Tenant", "acme").expect(t, 200, "two",
			"RateLimit-Policy", `"e2e_tight";q=1;w=60, "e2e_wide";q=10;w=3600`,
			"RateLimit", `"e2e_tight";r=0;t=45, "e2e_wide";r=9;t=3585`,
			"X-RateLimit-Limit", "1",
			"X-RateLimit-Remaining", "0",
			"X-RateLimit-Reset", "45")
		// Denied by the tight zone twice: the wide zone is not charged.
		for range 2 {
			get(t, tester, base+"/two", "X-Key", "k1", "X-Tenant", "acme").expect(t, 429, "slow down: rate limit exceeded: zone e2e_tight",
				"RateLimit", `"e2e_tight";r=0;t=45, "e2e_wide";r=9;t=3585`,
				"X-RateLimit-Limit", "1",
				"X-RateLimit-Remaining", "0",
				"Retry-After", "46")
		}
		get(t, tester, base+"/two", "X-Key", "k2", "X-Tenant", "acme").expect(t, 200, "two",
			"RateLimit", `"e2e_tight";r=0;t=45, "e2e_wide";r=8;t=3585`)
	})

	t.Run("reload keeps counts", func(t *testing.T) {
		tester.InitServer(e2eConfig(admin, port, e2eRoutesReloaded), "caddyfile")
		if t.Failed() {
			t.FailNow()
		}
		if lookupState() != st {
			t.Fatal("the reload replaced the engine")
		}
		awaitNewConfig(t, tester, base+"/one", func(r e2eResponse) bool { return r.header.Get("X-RateLimit-Limit") == "5" }, "X-Key", "probe-reload")
		// alice used 3 of the zone's units before the reload; the limit is
		// now 5.
		get(t, tester, base+"/one", "X-Key", "alice").expect(t, 200, "one again",
			"X-RateLimit-Limit", "5",
			"X-RateLimit-Remaining", "1",
			"X-RateLimit-Reset", "45",
			"RateLimit", "")
		get(t, tester, base+"/one", "X-Key", "alice").expect(t, 200, "one again", "X-RateLimit-Remaining", "0")
		// 5 units weigh ⌊5 × (1 − p)⌋ ≤ 4 from 1 ms into the next window:
		// 45 s + 1 ms, 46 s rounded up.
		get(t, tester, base+"/one", "X-Key", "alice").expect(t, 429, "", "X-RateLimit-Remaining", "0", "Retry-After", "46")
	})

	t.Run("unload stops the engine", func(t *testing.T) {
		tester.InitServer(e2eConfig(admin, port, ""), "caddyfile")
		if t.Failed() {
			t.FailNow()
		}
		awaitNewConfig(t, tester, base+"/one", func(r e2eResponse) bool { return r.body == "fallback" })
		get(t, tester, base+"/one").expect(t, 200, "fallback", "RateLimit", "", "X-RateLimit-Limit", "")
		if n, ok := pool.References(poolKey); ok {
			t.Fatalf("engine pool still has %d users after the last ratelimit config was unloaded", n)
		}
		waitNoEngineGoroutines(t)
	})
}

// clientCostRoutes is the README's old example: a zone that takes its cost
// from a header the client sends.
const clientCostRoutes = `
	handle /cost {
		ratelimit {
			zone e2e_client_cost {
				key    {http.request.header.X-Key}
				limit  10
				window 1m
				cost   {http.request.header.X-Cost} 1
			}
			headers off
		}
		respond "cost"
	}
`

// TestCost_ClientZeroIsClampedToMinCost: a client that sends a cost of 0,
// in any spelling ParseInt takes for zero, is charged min_cost (1 by
// default), so it gets the zone's limit and no more; each such request is
// counted as clamped at the min bound.
func TestCost_ClientZeroIsClampedToMinCost(t *testing.T) {
	useClock(t, 15*time.Second)
	tester, admin, base := startCaddy(t, func(admin, port int) string { return e2eConfig(admin, port, clientCostRoutes) })
	before := scrape(t, admin)
	zeros := []string{"0", "00", "+0", "-0"}
	admitted := 0
	for i := range 60 {
		r := get(t, tester, base+"/cost", "X-Key", "attacker", "X-Cost", zeros[i%len(zeros)])
		switch r.status {
		case 200:
			admitted++
		case 429:
		default:
			t.Fatalf("request %d: status %d", i, r.status)
		}
	}
	if admitted != 10 {
		t.Fatalf("%d of 60 requests with a cost of zero admitted, want 10 (the limit)", admitted)
	}
	after := scrape(t, admin)
	for series, want := range map[string]float64{
		`caddy_ratelimit_clamped_costs_total{bound="min",zone="e2e_client_cost"}`: 60,
		`caddy_ratelimit_clamped_costs_total{bound="max",zone="e2e_client_cost"}`: 0,
		`caddy_ratelimit_invalid_costs_total{zone="e2e_client_cost"}`:             0,
	} {
		if got, ok := after[series]; !ok || got-before[series] != want {
			t.Errorf("%s: +%v (present %v), want +%v", series, got-before[series], ok, want)
		}
	}
}

// operatorCostRoutes is the README's example: the cost comes from a map the
// operator writes, by endpoint; a cost header the client sends is ignored.
const operatorCostRoutes = `
	map {path} {api_cost} {
		~^/api/search  5
		~^/api/export  20
		default        1
	}
	handle /api/* {
		ratelimit {
			zone e2e_operator_cost {
				key      {http.request.header.X-API-Key}
				limit    100
				window   1m
				cost     {api_cost} 1
				max_cost 20
			}
		}
		respond "api"
	}
`

// TestCost_OperatorMapSetsTheCost runs the README's example: each endpoint
// is charged what the operator's map says, whatever the client sends.
func TestCost_OperatorMapSetsTheCost(t *testing.T) {
	useClock(t, 15*time.Second)
	tester, _, base := startCaddy(t, func(admin, port int) string { return e2eConfig(admin, port, operatorCostRoutes) })
	for _, step := range []struct {
		path      string
		remaining int
	}{
		{"/api/search", 95},
		{"/api/export", 75},
		{"/api/items", 74},
		{"/api/search?q=x", 69},
	} {
		get(t, tester, base+step.path, "X-API-Key", "k1", "X-Cost", "0").expect(t, 200, "api",
			"RateLimit", fmt.Sprintf(`"e2e_operator_cost";r=%d;t=45`, step.remaining))
	}
}

// TestCaddy_AnErrorRoutesDirectiveDecidesAgain: a `ratelimit` in an error
// route is a directive of its own (README, "Two directives are two
// decisions"): a request the site's route admitted and that then failed
// is decided and charged again there, in the same zone as well.
func TestCaddy_AnErrorRoutesDirectiveDecidesAgain(t *testing.T) {
	useClock(t, 0)
	const zone = `ratelimit {
			zone e2e_twice {
				key    {http.request.header.X-Key}
				limit  10
				window 1m
			}
		}`
	routes := `
	route /fail {
		` + zone + `
		error "upstream failed" 502
	}
	handle_errors {
		` + zone + `
		respond "{http.ratelimit.remaining}" {err.status_code}
	}`
	tester, _, base := startCaddy(t, func(admin, port int) string { return e2eConfig(admin, port, routes) })
	get(t, tester, base+"/fail", "X-Key", "k").expect(t, 502, "8", "RateLimit", `"e2e_twice";r=8;t=60`)
	get(t, tester, base+"/fail", "X-Key", "k").expect(t, 502, "6")
}

// TestCaddy_ADenialInAnErrorRouteIsA429: a directive in an error route
// (limiting the clients that draw many 404s) that denies writes the 429
// itself, with Retry-After. Caddy runs no error route for an error route's
// error: it logged "error handling handler error" at error level for each
// denial and wrote the first error's status, so the client saw a 404
// with an empty body and never a 429.
func TestCaddy_ADenialInAnErrorRouteIsA429(t *testing.T) {
	useClock(t, 0)
	routes := `
	route /missing {
		error "no such page" 404
	}
	handle_errors 404 {
		ratelimit {
			zone e2e_404s {
				key    {http.request.header.X-Key}
				limit  1
				window 1m
			}
		}
		respond "not found" 404
	}`
	tester, _, base := startCaddy(t, func(admin, port int) string { return e2eConfig(admin, port, routes) })
	get(t, tester, base+"/missing", "X-Key", "k").expect(t, 404, "not found", "RateLimit", `"e2e_404s";r=0;t=60`)
	get(t, tester, base+"/missing", "X-Key", "k").expect(t, 429, "", "RateLimit", `"e2e_404s";r=0;t=60`, "Retry-After", "61")
}
