package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func TestHandler_DenialChargesNoOtherZone(t *testing.T) {
	useClock(t, 0)
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("tight", 1, time.Minute), zoneOf("wide", 10, time.Minute)}})

	r := serve(h, map[string]string{"tight": "x", "wide": "shared"})
	wantStatus(t, r, http.StatusOK)
	wantHeader(t, r, "RateLimit", `"tight";r=0;t=60, "wide";r=9;t=60`)
	for range 3 {
		r = serve(h, map[string]string{"tight": "x", "wide": "shared"})
		wantStatus(t, r, http.StatusTooManyRequests)
		wantHeader(t, r, "RateLimit", `"tight";r=0;t=60, "wide";r=9;t=60`)
	}
	r = serve(h, map[string]string{"tight": "y", "wide": "shared"})
	wantStatus(t, r, http.StatusOK)
	wantHeader(t, r, "RateLimit", `"tight";r=0;t=60, "wide";r=8;t=60`)
}

func TestHandler_Cost(t *testing.T) {
	useClock(t, 0)
	static := provisionTest(t, nil, &Handler{Zones: []*Zone{
		{Name: "static", Key: "{test.k}", Limit: 10, Window: caddy.Duration(time.Minute), Cost: "4"},
	}})
	r := serve(static, map[string]string{"k": "a"})
	wantHeader(t, r, "RateLimit", `"static";r=6;t=60`)

	dyn := provisionTest(t, nil, &Handler{Zones: []*Zone{
		{Name: "dyn", Key: "{test.k}", Limit: 100, Window: caddy.Duration(time.Minute), Cost: "{test.cost}", DefaultCost: 7},
	}})
	tests := []struct {
		cost      string
		remaining int64
		invalid   bool
	}{
		{"3", 97, false},
		{"0", 96, false}, // min_cost, 1 by default
		{"abc", 89, true},
		{"-2", 82, true},
		{"", 75, true},
		{"1.5", 68, true},
		{"10", 58, false},
	}
	for _, tc := range tests {
		invalid := invalidCostsTotal.WithLabelValues("dyn")
		before := counterValue(t, invalid)
		r := serve(dyn, map[string]string{"k": "a", "cost": tc.cost})
		wantStatus(t, r, http.StatusOK)
		wantHeader(t, r, "RateLimit", fmt.Sprintf(`"dyn";r=%d;t=60`, tc.remaining))
		if got := counterValue(t, invalid) - before; got != map[bool]float64{false: 0, true: 1}[tc.invalid] {
			t.Fatalf("cost %q: invalid-cost counter moved by %v", tc.cost, got)
		}
	}
}

// TestHandler_PlaceholderCostAboveTheMaximumIsClamped: a cost placeholder
// that evaluates to more than the largest count (2^53-1), even past int64,
// is charged the largest count, never the default cost: a huge cost is no
// free pass.
func TestHandler_PlaceholderCostAboveTheMaximumIsClamped(t *testing.T) {
	useClock(t, 0)
	const largest = 1<<53 - 1
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{
		{Name: "huge", Key: "{test.k}", Limit: largest, Window: caddy.Duration(time.Minute), Cost: "{test.cost}"},
	}})
	invalid := invalidCostsTotal.WithLabelValues("huge")
	before := counterValue(t, invalid)
	for _, cost := range []string{"9007199254740992", "9223372036854775808", "99999999999999999999999"} {
		r := serve(h, map[string]string{"k": cost, "cost": cost})
		wantStatus(t, r, http.StatusOK)
		wantHeader(t, r, "RateLimit", `"huge";r=0;t=60`)
		wantStatus(t, serve(h, map[string]string{"k": cost, "cost": "1"}), http.StatusTooManyRequests)
	}
	if got := counterValue(t, invalid) - before; got != 0 {
		t.Fatalf("a cost above the largest count was counted invalid %v times", got)
	}
}

func TestHandler_Overrides(t *testing.T) {
	useClock(t, 0)
	z := zoneOf("api", 2, time.Minute)
	z.Overrides = map[string]int64{"premium": 100, "banned": 0}
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{z, zoneOf("other", 50, time.Hour)}, Headers: "both"})

	r := serve(h, map[string]string{"api": "premium", "other": "o"})
	wantStatus(t, r, http.StatusOK)
	wantHeader(t, r, "RateLimit-Policy", `"api";q=100;w=60, "other";q=50;w=3600`)
	wantHeader(t, r, "RateLimit", `"api";r=99;t=60, "other";r=49;t=3600`)
	wantHeader(t, r, "X-RateLimit-Limit", "50")

	r = serve(h, map[string]string{"api": "regular", "other": "o"})
	wantHeader(t, r, "RateLimit-Policy", `"api";q=2;w=60, "other";q=50;w=3600`)
	wantHeader(t, r, "X-RateLimit-Limit", "2")

	r = serve(h, map[string]string{"api": "banned", "other": "o"})
	wantStatus(t, r, http.StatusTooManyRequests)
	wantHeader(t, r, "RateLimit-Policy", `"api";q=0;w=60, "other";q=50;w=3600`)
	wantHeader(t, r, "Retry-After", "")
}

func TestHandler_IPPrefixesShareACount(t *testing.T) {
	useClock(t, 0)
	z := zoneOf("ip", 2, time.Minute)
	z.IPv4Prefix = 24
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{z}})

	wantStatus(t, serve(h, map[string]string{"ip": "2001:db8:1:2::1"}), http.StatusOK)
	// Same /64 (the default), other address: same bucket.
	wantStatus(t, serve(h, map[string]string{"ip": "2001:db8:1:2:ffff::9"}), http.StatusOK)
	wantStatus(t, serve(h, map[string]string{"ip": "2001:db8:1:2:abcd::1"}), http.StatusTooManyRequests)
	wantStatus(t, serve(h, map[string]string{"ip": "2001:db8:1:3::1"}), http.StatusOK)

	wantStatus(t, serve(h, map[string]string{"ip": "192.0.2.1"}), http.StatusOK)
	wantStatus(t, serve(h, map[string]string{"ip": "::ffff:192.0.2.200"}), http.StatusOK)
	wantStatus(t, serve(h, map[string]string{"ip": "192.0.2.77"}), http.StatusTooManyRequests)
	wantStatus(t, serve(h, map[string]string{"ip": "192.0.3.1"}), http.StatusOK)
}

func TestHandler_OnMissingKey(t *testing.T) {
	useClock(t, 0)
	zones := func(n string) []*Zone { return []*Zone{zoneOf(n, 2, time.Minute), zoneOf("present", 10, time.Minute)} }

	t.Run("shared", func(t *testing.T) {
		h := provisionTest(t, nil, &Handler{Zones: zones("m_shared")})
		for range 2 {
			wantStatus(t, serve(h, map[string]string{"present": "p"}), http.StatusOK)
		}
		r := serve(h, map[string]string{"present": "p"})
		wantStatus(t, r, http.StatusTooManyRequests)
		wantStatus(t, serve(h, map[string]string{"m_shared": "someone", "present": "p"}), http.StatusOK)
	})
	t.Run("skip", func(t *testing.T) {
		h := provisionTest(t, nil, &Handler{Zones: zones("m_skip"), OnMissingKey: "skip"})
		for range 3 {
			r := serve(h, map[string]string{"present": "q"})
			wantStatus(t, r, http.StatusOK)
			wantHeader(t, r, "RateLimit-Policy", `"present";q=10;w=60`)
		}
		r := serve(h, nil) // every zone skipped: no decision, no headers
		wantStatus(t, r, http.StatusOK)
		wantHeader(t, r, "RateLimit", "")
		r = serve(h, map[string]string{"present": "q"})
		wantHeader(t, r, "RateLimit", `"present";r=6;t=60`)
	})
	t.Run("deny", func(t *testing.T) {
		h := provisionTest(t, nil, &Handler{Zones: zones("m_deny"), OnMissingKey: "deny"})
		missing := decisionsTotal.WithLabelValues("m_deny", resultMissingKey)
		before := counterValue(t, missing)
		r := serve(h, map[string]string{"present": "d"})
		wantStatus(t, r, http.StatusTooManyRequests)
		if !errors.Is(r.err, ErrMissingKey) {
			t.Fatalf("error %v does not wrap ErrMissingKey", r.err)
		}
		if counterValue(t, missing) != before+1 {
			t.Fatal("missing-key denial not counted")
		}
		// Nothing was charged to the zone that had a key.
		r = serve(h, map[string]string{"m_deny": "k", "present": "d"})
		wantHeader(t, r, "RateLimit", `"m_deny";r=1;t=60, "present";r=9;t=60`)
	})
}

// TestHandler_ConcurrentRequestsNeverExceedLimit runs 64 goroutines on one
// key within one fixed window: exactly the limit passes.
func TestHandler_ConcurrentRequestsNeverExceedLimit(t *testing.T) {
	useClock(t, 5*time.Second)
	const limit, workers, each = 100, 64, 20
	single := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("race", limit, time.Minute)}})
	// The batch path: a second zone that never denies.
	batch := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("race2", limit, time.Minute), zoneOf("roomy", 1<<40, time.Minute)}})

	for _, tc := range []struct {
		name string
		h    *Handler
		vars map[string]string
	}{
		{"decide", single, map[string]string{"race": "k"}},
		{"decide_many", batch, map[string]string{"race2": "k", "roomy": "k"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var allowed atomic.Int64
			var wg sync.WaitGroup
			start := make(chan struct{})
			for range workers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					for range each {
						if r := serve(tc.h, tc.vars); r.err == nil {
							allowed.Add(1)
						}
					}
				}()
			}
			close(start)
			wg.Wait()
			if got := allowed.Load(); got != limit {
				t.Fatalf("%d requests admitted, want exactly %d", got, limit)
			}
		})
	}
}

// TestHandler_ServesAfterCleanup covers a request of the old config still
// running after a reload cleaned the config up: it is decided, locally.
func TestHandler_ServesAfterCleanup(t *testing.T) {
	useClock(t, 0)
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("late", 1, time.Minute)}})
	if err := h.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if _, ok := pool.References(poolKey); ok {
		t.Fatal("engine still pooled")
	}
	wantStatus(t, serve(h, map[string]string{"late": "k"}), http.StatusOK)
	wantStatus(t, serve(h, map[string]string{"late": "k"}), http.StatusTooManyRequests)
}

// TestHandler_DenialWithoutErrorRoutesIsWrittenDirectly: on a server with
// no handle_errors the 429 is written by the handler (what Caddy's default
// error handling would write); with error routes it goes through Caddy's
// error flow.
func TestHandler_DenialWithoutErrorRoutesIsWrittenDirectly(t *testing.T) {
	useClock(t, 15*time.Second)
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("direct", 1, time.Minute)}})
	request := func(srv *caddyhttp.Server) (*httptest.ResponseRecorder, error) {
		repl := caddy.NewReplacer()
		repl.Set("test.direct", "alice")
		req := httptest.NewRequest(http.MethodGet, "/", nil)
		ctx := context.WithValue(req.Context(), caddy.ReplacerCtxKey, repl)
		ctx = context.WithValue(ctx, caddyhttp.ServerCtxKey, srv)
		rec := httptest.NewRecorder()
		err := h.ServeHTTP(rec, req.WithContext(ctx), caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			w.WriteHeader(http.StatusOK)
			return nil
		}))
		return rec, err
	}
	plain := new(caddyhttp.Server)
	if rec, err := request(plain); err != nil || rec.Code != http.StatusOK {
		t.Fatalf("first request: %d, %v", rec.Code, err)
	}
	rec, err := request(plain)
	if err != nil || rec.Code != http.StatusTooManyRequests || rec.Body.Len() != 0 {
		t.Fatalf("denial without error routes: status %d, body %q, err %v; want an empty 429 written directly", rec.Code, rec.Body, err)
	}
	if rec.Header().Get("Retry-After") != "46" || rec.Header().Get("RateLimit") == "" {
		t.Fatalf("direct denial lost its headers: %v", rec.Header())
	}

	withRoutes := &caddyhttp.Server{Errors: &caddyhttp.HTTPErrorConfig{Routes: caddyhttp.RouteList{{}}}}
	rec, err = request(withRoutes)
	var he caddyhttp.HandlerError
	if !errors.As(err, &he) || he.StatusCode != http.StatusTooManyRequests || !errors.Is(err, ErrRateLimited) {
		t.Fatalf("denial with error routes returned %v (recorder %d), want a 429 HandlerError", err, rec.Code)
	}
	if len(he.ID) != 9 || he.Trace == "" {
		t.Fatalf("error ID %q, trace %q", he.ID, he.Trace)
	}
	first := he.ID
	_, err = request(withRoutes)
	if !errors.As(err, &he) || he.ID == first || strings.Contains(err.Error(), "alice") {
		t.Fatalf("second denial: %v with ID %q (first %q)", err, he.ID, first)
	}
}

// The rest of the route runs under ServeHTTP with little of the handler's
// stack beneath it: the zones' limits and decisions (about 1.2 KB) live in
// a frame that has returned by then, so a deep route (a reverse proxy's)
// does not carry them on every connection's stack. Measured as the
// distance between a local of the caller and one of the next handler (see
// stackUnder).
func TestHandler_LittleStackUnderTheRoute(t *testing.T) {
	useClock(t, 0)
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("k", 1<<50, time.Hour)}})
	req := requestWith(map[string]string{"k": "key-1"})
	depth := stackUnder(t, func(mark func()) error {
		return h.ServeHTTP(httptest.NewRecorder(), req, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
			mark()
			return nil
		}))
	})
	t.Logf("%d bytes of stack between the handler's caller and the next handler", depth)
	// ServeHTTP's frame, the next handler's and the call's own words: a few
	// hundred bytes (more under the race detector), against 1.3 KB before.
	if depth > 768 {
		t.Fatalf("%d bytes of stack between the handler's caller and the next handler, want at most 768", depth)
	}
}

// TestHandler_LittleStackUnderA429: a denial's 429, which the handler
// writes itself on a server without error routes, is written once the
// decision's frames have returned, as the rest of an admitted request's
// route runs. It was written from serve's frame, about 1.1 KB deeper, and
// net/http's copy of the headers under it grew the connection's stack
// after each collection had shrunk it: 2 % of Caddy's CPU in the load
// test's deny row.
func TestHandler_LittleStackUnderA429(t *testing.T) {
	useClock(t, 0)
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("k", 1, time.Hour)}})
	req := requestWith(map[string]string{"k": "key-1"})
	req = req.WithContext(context.WithValue(req.Context(), caddyhttp.ServerCtxKey, &caddyhttp.Server{}))
	next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
	if err := h.ServeHTTP(httptest.NewRecorder(), req, next); err != nil {
		t.Fatal(err)
	}
	w := &markedWriter{ResponseWriter: httptest.NewRecorder()}
	depth := stackUnder(t, func(mark func()) error {
		w.mark = mark
		return h.ServeHTTP(w, req, next)
	})
	if w.status != http.StatusTooManyRequests {
		t.Fatalf("status %d, want 429", w.status)
	}
	t.Logf("%d bytes of stack between the handler's caller and the 429's WriteHeader", depth)
	if depth > 768 {
		t.Fatalf("%d bytes of stack between the handler's caller and the 429's WriteHeader, want at most 768", depth)
	}
}

// markedWriter calls mark when its header is written.
type markedWriter struct {
	http.ResponseWriter
	mark   func()
	status int
}

func (w *markedWriter) WriteHeader(status int) {
	w.status = status
	w.mark()
	w.ResponseWriter.WriteHeader(status)
}

// stackUnder runs serve on a goroutine whose stack was grown first, so
// that it does not move meanwhile, and returns the bytes of stack between
// serve's caller and the frame that called mark (the last call). It fails
// t when serve fails or never calls mark.
func stackUnder(t *testing.T, serve func(mark func()) error) uintptr {
	t.Helper()
	var under uintptr
	mark := func() {
		var here byte
		under = uintptr(unsafe.Pointer(&here))
	}
	done := make(chan uintptr)
	go func() {
		growStack(64)
		var here byte
		above := uintptr(unsafe.Pointer(&here))
		if err := serve(mark); err != nil {
			t.Error(err)
		}
		done <- above - under
	}()
	depth := <-done
	if under == 0 {
		t.Fatal("serve never called mark")
	}
	return depth
}

// growStack uses about kib KiB of stack, so that the goroutine's stack has
// grown past it when it returns.
//
//go:noinline
func growStack(kib int) byte {
	var pad [1024]byte
	if kib <= 1 {
		return pad[kib]
	}
	return growStack(kib-1) + pad[0]
}

// TestHandler_MissingKeyCountsNoZonesCost: under on_missing_key deny a
// request whose later zone has no key is denied with nothing counted, and
// that includes an earlier zone's invalid or clamped cost.
func TestHandler_MissingKeyCountsNoZonesCost(t *testing.T) {
	useClock(t, 0)
	h := provisionTest(t, nil, &Handler{OnMissingKey: "deny", Zones: []*Zone{
		{Name: "mk_cost", Key: "tenant", Limit: 100, Window: caddy.Duration(time.Minute), Cost: "{test.cost}", MaxCost: int64p(5)},
		{Name: "mk_key", Key: "{test.k}", Limit: 100, Window: caddy.Duration(time.Minute)},
	}})
	invalid := invalidCostsTotal.WithLabelValues("mk_cost")
	clamped := clampedCostsTotal.WithLabelValues("mk_cost", boundMax)
	invalidBefore, clampedBefore := counterValue(t, invalid), counterValue(t, clamped)
	for _, cost := range []string{"lots", "50"} {
		wantStatus(t, serve(h, map[string]string{"cost": cost}), http.StatusTooManyRequests)
	}
	if i, c := counterValue(t, invalid)-invalidBefore, counterValue(t, clamped)-clampedBefore; i != 0 || c != 0 {
		t.Fatalf("requests denied for a missing key counted %v invalid and %v clamped costs, want none", i, c)
	}
	for _, cost := range []string{"lots", "50"} {
		wantStatus(t, serve(h, map[string]string{"k": "a", "cost": cost}), http.StatusOK)
	}
	if i, c := counterValue(t, invalid)-invalidBefore, counterValue(t, clamped)-clampedBefore; i != 1 || c != 1 {
		t.Fatalf("requests with their keys counted %v invalid and %v clamped costs, want 1 and 1", i, c)
	}
}
