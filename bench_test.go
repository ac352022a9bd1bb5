package ratelimit

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// warmRequest returns a handler of the given zones (limits too high to deny)
// and a function that serves one request on a warm key through it.
func warmRequest(tb testing.TB, headers string, zones int) func() {
	tb.Helper()
	var zs []*Zone
	vars := map[string]string{}
	for i := range zones {
		name := string(rune('a' + i))
		zs = append(zs, zoneOf(name, 1<<50, time.Hour))
		vars[name] = "203.0.113.7"
	}
	h := &Handler{Zones: zs, Headers: headers}
	if t, ok := tb.(*testing.T); ok {
		provisionTest(t, nil, h)
	} else {
		provisionBench(tb.(*testing.B), h)
	}
	fresh, rec := freshRequests(tb, vars), httptest.NewRecorder()
	next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
	serveOne := func() {
		if err := h.ServeHTTP(rec, fresh(), next); err != nil {
			tb.Fatal(err)
		}
	}
	serveOne() // warm: the entry exists from now on
	return serveOne
}

// requestBatch is how many requests freshRequests makes at a time.
const requestBatch = 256

// freshRequests returns a function that returns a new request, with a
// replacer of its own holding vars as requestWith's and a provider more,
// at each call. Caddy
// makes one replacer per request, and the handler answers the
// placeholders of a request decided twice another way (see publish): a
// replacer kept across requests would time that path, or grow by a
// provider a request. They are made requestBatch at a time, a
// benchmark's timer stopped, so that neither its time nor its
// allocations count them; a test's AllocsPerRun of fewer calls than that
// after the first sees none of them either.
func freshRequests(tb testing.TB, vars map[string]string) func() *http.Request {
	b, bench := tb.(*testing.B)
	var reqs []*http.Request
	return func() *http.Request {
		if len(reqs) == 0 {
			if bench {
				b.StopTimer()
			}
			reqs = make([]*http.Request, requestBatch)
			for i := range reqs {
				reqs[i] = requestWith(vars)
				// As Caddy's are when a handler runs: a provider mapped
				// after the first three (the request's own placeholders).
				repl := reqs[i].Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
				repl.Map(func(string) (any, bool) { return nil, false })
			}
			if bench {
				b.StartTimer()
			}
		}
		req := reqs[0]
		reqs = reqs[1:]
		return req
	}
}

// requestWith is a GET whose replacer holds the placeholders
// {test.<name>} with the given values.
func requestWith(vars map[string]string) *http.Request {
	repl := caddy.NewReplacer()
	for k, v := range vars {
		repl.Set("test."+k, v)
	}
	req := httptest.NewRequest(http.MethodGet, "/", nil)
	return req.WithContext(context.WithValue(req.Context(), caddy.ReplacerCtxKey, repl))
}

func provisionBench(b *testing.B, h *Handler) {
	if err := h.provision(new(App)); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = h.Cleanup() })
}

// placeholderAllocs is the allocation every decided request makes for its
// {http.ratelimit.*} placeholders: one closure holding the outcome.
const placeholderAllocs = 1

// TestHandler_Allocations pins the allocations of a request on a warm
// key. Allowed: the placeholders' one without headers, one more with any
// header set whose values fit in 256 bytes (their bytes and the value
// slices together), two when they do not. Denied, as Caddy serves it
// without error routes (the handler writes the 429): the placeholders'
// one and one block for every header value, Retry-After's included (with
// headers off, Retry-After's block alone).
func TestHandler_Allocations(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector changes allocations")
	}
	useClock(t, 0)
	for _, tc := range []struct {
		headers string
		zones   int
		deny    bool
		want    float64
	}{
		{"off", 1, false, placeholderAllocs},
		{"off", 3, false, placeholderAllocs},
		{"draft", 1, false, placeholderAllocs + 1},
		{"draft", 3, false, placeholderAllocs + 1},
		{"both", 2, false, placeholderAllocs + 1},
		{"both", 8, false, placeholderAllocs + 2},
		{"off", 1, true, placeholderAllocs + 1},
		{"draft", 1, true, placeholderAllocs + 1},
		{"both", 2, true, placeholderAllocs + 1},
	} {
		serveOne := warmRequest(t, tc.headers, tc.zones)
		if tc.deny {
			serveOne = deniedRequests(t, tc.headers, tc.zones, 201)
		}
		if got := testing.AllocsPerRun(200, serveOne); got > tc.want {
			t.Errorf("headers %s, %d zones, deny %v: %.1f allocations per request, want at most %.0f", tc.headers, tc.zones, tc.deny, got, tc.want)
		}
	}
}

// deniedRequests returns a handler of the given zones, each with a limit
// of 1 already used, and a function that serves the next of n requests
// through it, each denied. What a request itself costs is made
// beforehand: its request, and its replacer and response header map as
// Caddy's are when a handler runs (a provider mapped after the first
// three, a Server field set).
func deniedRequests(t *testing.T, headers string, zones, n int) func() {
	t.Helper()
	var zs []*Zone
	vars := map[string]string{}
	for i := range zones {
		name := string(rune('a' + i))
		zs = append(zs, zoneOf(name, 1, time.Hour))
		vars[name] = "203.0.113.7"
	}
	h := provisionTest(t, nil, &Handler{Zones: zs, Headers: headers})
	next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
	reqs := make([]*http.Request, n+2)
	ws := make([]*codeWriter, n+2)
	for i := range reqs {
		req := requestWith(vars)
		repl := req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
		repl.Map(func(string) (any, bool) { return nil, false })
		reqs[i] = req.WithContext(context.WithValue(req.Context(), caddyhttp.ServerCtxKey, new(caddyhttp.Server)))
		ws[i] = &codeWriter{header: http.Header{"Server": {"Caddy"}}}
	}
	i := 0
	serveOne := func() {
		if err := h.ServeHTTP(ws[i], reqs[i], next); err != nil {
			t.Fatal(err)
		}
		i++
	}
	serveOne() // uses up the limit of 1
	serveOne()
	if w := ws[1]; w.code != http.StatusTooManyRequests || w.header.Get("Retry-After") == "" {
		t.Fatalf("headers %s: got %d, Retry-After %q; want a 429 with Retry-After", headers, w.code, w.header.Get("Retry-After"))
	}
	return serveOne
}

// codeWriter is a response writer that keeps its status and nothing else.
type codeWriter struct {
	header http.Header
	code   int
}

func (w *codeWriter) Header() http.Header         { return w.header }
func (w *codeWriter) Write(b []byte) (int, error) { return len(b), nil }
func (w *codeWriter) WriteHeader(code int)        { w.code = code }

func BenchmarkHandler_Allow(b *testing.B) {
	for _, bc := range []struct {
		name    string
		headers string
		zones   int
	}{
		{"1zone_off", "off", 1},
		{"1zone_draft", "draft", 1},
		{"3zones_both", "both", 3},
	} {
		b.Run(bc.name, func(b *testing.B) {
			serveOne := warmRequest(b, bc.headers, bc.zones)
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				serveOne()
			}
		})
	}
}

// BenchmarkHandler_AllowDeny measures a warm key's allow path and deny path
// through ServeHTTP, with and without response headers. It uses only what
// the handler had before metrics existed, so the same file runs against an
// older tree to measure what the metrics cost (README, "Operating it").
func BenchmarkHandler_AllowDeny(b *testing.B) {
	for _, bc := range []struct {
		name    string
		limit   int64
		headers string
	}{
		{"allow_off", 1 << 50, "off"},
		{"deny_off", 1, "off"},
		{"allow_draft", 1 << 50, "draft"},
		{"deny_draft", 1, "draft"},
	} {
		b.Run(bc.name, func(b *testing.B) {
			h := &Handler{Zones: []*Zone{zoneOf("bench", bc.limit, time.Hour)}, Headers: bc.headers}
			provisionBench(b, h)
			fresh, rec := freshRequests(b, map[string]string{"bench": "api-key-0123456789"}), httptest.NewRecorder()
			next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
			// The first request is allowed and uses up a limit of 1: every
			// later one in the hour is denied.
			if err := h.ServeHTTP(rec, fresh(), next); err != nil {
				b.Fatal(err)
			}
			deny := bc.limit == 1
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				err := h.ServeHTTP(rec, fresh(), next)
				if deny != (err != nil) {
					b.Fatalf("deny %v, got error %v", deny, err)
				}
			}
			if deny {
				var he caddyhttp.HandlerError
				if err := h.ServeHTTP(rec, fresh(), next); !errors.As(err, &he) || he.StatusCode != http.StatusTooManyRequests {
					b.Fatalf("want a 429, got %v", err)
				}
			}
		})
	}
}

// BenchmarkHandler_Keys cycles warm requests through n distinct keys (the
// load harness's keys100k row in process): what a large key set adds to a
// decision is the cost of reaching an entry that is not in the CPU's caches.
func BenchmarkHandler_Keys(b *testing.B) {
	for _, n := range []int{1, 100_000} {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			h := &Handler{Zones: []*Zone{zoneOf("k", 1<<50, time.Hour)}}
			provisionBench(b, h)
			ids := make([]string, n)
			for i := range ids {
				ids[i] = "k" + strconv.Itoa(i)
			}
			fresh := freshRequests(b, map[string]string{"k": ids[0]})
			rec := httptest.NewRecorder()
			next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
			serve := func(i int) {
				req := fresh()
				req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer).Set("test.k", ids[i%n])
				clear(rec.Header())
				if err := h.ServeHTTP(rec, req, next); err != nil {
					b.Fatal(err)
				}
			}
			for i := range ids { // every key warm
				serve(i)
			}
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				serve(i)
				i++
			}
		})
	}
}

// BenchmarkHandler_RuntimeOverrides is a warm allowed request with no
// runtime override loaded, and with 10,000 loaded in the request's zone
// (none of them its key's, and its key's own): the request path's lookup
// is one atomic load without overrides, one map lookup with them.
func BenchmarkHandler_RuntimeOverrides(b *testing.B) {
	for _, bc := range []struct {
		name   string
		loaded int
		own    bool
		// expires: the own key's override has an expiry, which the
		// request path judges on the region's clock.
		expires bool
	}{{"none", 0, false, false}, {"10000_other_keys", 10_000, false, false}, {"10000_own_key", 10_000, true, false},
		{"10000_own_key_expiring", 10_000, true, true}} {
		b.Run(bc.name, func(b *testing.B) {
			overrides.mu.Lock()
			overrides.recs = map[overrideKey]overrideRec{}
			overrides.mu.Unlock()
			b.Cleanup(func() {
				overrides.mu.Lock()
				overrides.recs = map[overrideKey]overrideRec{}
				overrides.publishLocked()
				overrides.mu.Unlock()
			})
			var recs []overrideRec
			for i := range bc.loaded {
				recs = append(recs, overrideRec{Zone: "a", Identifier: "other-" + strconv.Itoa(i), Limit: 1 << 50, Version: 1})
			}
			if bc.own {
				own := overrideRec{Zone: "a", Identifier: "203.0.113.7", Limit: 1 << 50, Version: 1}
				if bc.expires {
					own.ExpiresMs = time.Now().Add(time.Hour).UnixMilli()
				}
				recs = append(recs, own)
			}
			overrides.merge(recs)
			serveOne := warmRequest(b, "off", 1)
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				serveOne()
			}
		})
	}
}
