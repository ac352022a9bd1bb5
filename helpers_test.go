package ratelimit

// Helpers shared by the package's tests: a fake clock for the pooled
// engine, a handler provisioned without a running Caddy, and one request
// through it, and the README's sections.

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
	"go.uber.org/zap"
)

// windowStart is a time at the start of a minute and an hour window.
var windowStart = time.Unix(1_700_000_000/3600*3600, 0)

// useClock makes the next engine the pool creates run on a fake clock set to
// windowStart + offset. The pool must be empty: the clock of an engine
// cannot change.
func useClock(t *testing.T, offset time.Duration) *testclock.Clock {
	t.Helper()
	if n, ok := pool.References(poolKey); ok {
		t.Fatalf("engine pool still has %d users from an earlier test", n)
	}
	clk := testclock.New(windowStart.Add(offset))
	useEngineClock(t, clk.Now)
	return clk
}

// useEngineClock makes the engine of the next config read now as its
// process's clock, until the test ends.
func useEngineClock(t *testing.T, now func() time.Time) {
	t.Helper()
	old := newEngineConfig
	newEngineConfig = func() engine.Config { return engine.Config{Now: now} }
	t.Cleanup(func() { newEngineConfig = old })
}

// provisionTest provisions h against app (a fresh one if nil) without a
// running Caddy config and releases it when the test ends.
func provisionTest(t *testing.T, app *App, h *Handler) *Handler {
	t.Helper()
	if app == nil {
		app = new(App)
	}
	h.logger = zap.NewNop()
	if err := h.provision(app); err != nil {
		_ = h.Cleanup()
		t.Fatalf("provision: %v", err)
	}
	t.Cleanup(func() {
		if err := h.Cleanup(); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	return h
}

// zoneOf is a zone keyed by the {test.<name>} placeholder.
func zoneOf(name string, limit int64, window time.Duration) *Zone {
	return &Zone{Name: name, Key: "{test." + name + "}", Limit: limit, Window: caddy.Duration(window)}
}

// result is what one request through the handler came to.
type result struct {
	status int // 200 when the next handler ran
	err    error
	header http.Header
}

func (r result) get(k string) string { return r.header.Get(k) }

// serve sends one request through h with the given placeholder values
// ({test.<name>}).
func serve(h *Handler, vars map[string]string) result {
	repl := caddy.NewReplacer()
	for k, v := range vars {
		repl.Set("test."+k, v)
	}
	req := httptest.NewRequest(http.MethodGet, "/", nil)
	req = req.WithContext(context.WithValue(req.Context(), caddy.ReplacerCtxKey, repl))
	rec := httptest.NewRecorder()
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		w.WriteHeader(http.StatusOK)
		return nil
	})
	err := h.ServeHTTP(rec, req, next)
	res := result{err: err, header: rec.Header()}
	if err == nil {
		res.status = rec.Code
	} else {
		var he caddyhttp.HandlerError
		if errors.As(err, &he) {
			res.status = he.StatusCode
		}
	}
	return res
}

func wantStatus(t *testing.T, r result, status int) {
	t.Helper()
	if r.status != status {
		t.Fatalf("status %d (err %v), want %d", r.status, r.err, status)
	}
}

func wantHeader(t *testing.T, r result, key, want string) {
	t.Helper()
	if got, ok := r.header[http.CanonicalHeaderKey(key)]; want == "" && ok {
		t.Fatalf("%s: %q, want absent", key, got)
	}
	if got := r.get(key); got != want {
		t.Fatalf("%s: %q, want %q", key, got, want)
	}
}

// statusDoc decodes what the tests read of GET /ratelimit/status.
type statusDoc struct {
	Region      string       `json:"region"`
	Identifiers string       `json:"identifiers"`
	Zones       []zoneStatus `json:"zones"`
	Engine      struct {
		Entries      int64      `json:"entries"`
		FirstDenials int64      `json:"first_denials"`
		LastRead     *time.Time `json:"last_read"`
	} `json:"engine"`
	Origin *struct {
		Endpoints []struct {
			Address string `json:"address"`
			Breaker string `json:"breaker"`
		} `json:"endpoints"`
	} `json:"origin"`
}

// readmeSection returns the README and its "### <heading>" section, up to
// the next heading of that level.
func readmeSection(t *testing.T, heading string) (readme, section string) {
	t.Helper()
	b, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(b), "\n### "+heading+"\n")
	if !ok {
		t.Fatalf("README has no %s section", heading)
	}
	section, _, _ = strings.Cut(rest, "\n### ")
	return string(b), section
}

// heldState acquires the process's state for the test and releases it at
// its end.
func heldState(t *testing.T) *state {
	t.Helper()
	st, err := acquireState(nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := releaseState(); err != nil {
			t.Error(err)
		}
	})
	return st
}
