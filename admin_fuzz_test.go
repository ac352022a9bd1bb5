package ratelimit

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// FuzzAdmin_AnyRequestIsAnsweredBelow500: any method, path and query,
// If-Match header and body, sent to the admin API's routes while a config
// runs. Each gets an answer: a 2xx with a JSON body, or an error of
// status 4xx, never a 5xx (a server error for what is the client's) and
// never a panic. The seeds are the README's requests. `go test -fuzz
// FuzzAdmin_AnyRequestIsAnsweredBelow500 -run '^$' .` runs the fuzzer.
func FuzzAdmin_AnyRequestIsAnsweredBelow500(f *testing.F) {
	for _, s := range [][4]string{
		{"GET", "/ratelimit/status", "", ""},
		{"HEAD", "/ratelimit/status", "", ""},
		{"GET", "/ratelimit/counters?zone=fz&identifier=alice", "", ""},
		{"GET", "/ratelimit/counters?zone=fz&prefix=a&max=2", "", ""},
		{"DELETE", "/ratelimit/counters?zone=fz&identifier=alice&scope=node", "", ""},
		{"DELETE", "/ratelimit/counters?zone=fz&identifier=alice&scope=global", "", ""},
		{"GET", "/ratelimit/strict?zone=fz&max=1", "", ""},
		{"PUT", "/ratelimit/overrides?zone=fz&identifier=bob", "", `{"limit": 7, "expires": "2099-12-31T00:00:00Z", "reason": "r"}`},
		{"PUT", "/ratelimit/overrides?zone=fz&identifier=bob", `"1795588800123000"`, `{"limit": 8}`},
		{"GET", "/ratelimit/overrides?zone=fz&identifier=bob", "*", ""},
		{"GET", "/ratelimit/overrides?zone=fz&prefix=b&max=3", "", ""},
		{"DELETE", "/ratelimit/overrides?zone=fz&identifier=bob", "W/\"1\"", ""},
		{"PUT", "/ratelimit/overrides?zone=fip&identifier=203.0.113.0/24", "", `{"limit": 1}`},
	} {
		f.Add(s[0], s[1], s[2], s[3])
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	f.Cleanup(cancel)
	app := new(App)
	if err := app.Provision(ctx); err != nil {
		f.Fatal(err)
	}
	h := &Handler{Zones: []*Zone{zoneOf("fz", 3, 60e9), {Name: "fip", Key: "{test.fip}", Limit: 5, Window: caddy.Duration(60e9), IPv4Prefix: 24}}}
	h.logger = zap.NewNop()
	if err := h.provision(app); err != nil {
		f.Fatal(err)
	}
	if err := app.Start(); err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() {
		_ = app.Stop()
		_ = h.Cleanup()
		_ = app.Cleanup()
	})
	for _, id := range []string{"alice", "bob", "alice", "alice", "alice"} {
		serve(h, map[string]string{"fz": id, "fip": "203.0.113.9"})
	}
	routes := map[string]caddy.AdminHandler{}
	for _, r := range new(AdminAPI).Routes() {
		routes[r.Pattern] = r.Handler
	}
	f.Fuzz(func(t *testing.T, method, target, ifMatch, body string) {
		req, err := http.NewRequest(method, "http://localhost:2019"+target, strings.NewReader(body))
		if err != nil {
			return // no request an HTTP client could send
		}
		route, ok := routes[req.URL.Path]
		if !ok {
			return
		}
		if ifMatch != "" {
			req.Header.Set("If-Match", ifMatch)
		}
		rec := httptest.NewRecorder()
		if err := route.ServeHTTP(rec, req); err != nil {
			var ae caddy.APIError
			if !errors.As(err, &ae) || ae.HTTPStatus < 400 || ae.HTTPStatus >= 500 {
				t.Fatalf("%s %s: error %v (status %d), want a 4xx", method, target, err, ae.HTTPStatus)
			}
			return
		}
		if rec.Code >= 300 {
			t.Fatalf("%s %s: status %d without an error", method, target, rec.Code)
		}
		if method != http.MethodHead && !json.Valid(rec.Body.Bytes()) {
			t.Fatalf("%s %s: %d with a body that is not JSON: %q", method, target, rec.Code, rec.Body.String())
		}
	})
}
