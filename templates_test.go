package ratelimit

import (
	"context"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

func TestTemplate_Eval(t *testing.T) {
	repl := caddy.NewReplacer()
	repl.Set("test.a", "alpha")
	repl.Set("test.n", 42)
	tests := []struct {
		raw, want string
		single    bool
	}{
		{"constant", "constant", false},
		{"{test.a}", "alpha", true},
		{"{test.n}", "42", true},
		{"{test.missing}", "", true},
		{"{test.a}:{test.n}", "alpha:42", false},
		{"tenant-{test.a}", "tenant-alpha", false},
		{`\{test.a\}`, "{test.a}", false},
	}
	for _, tc := range tests {
		tpl := newTemplate(tc.raw)
		if got := tpl.eval(httptest.NewRequest("GET", "/", nil), repl); got != tc.want {
			t.Errorf("eval(%q) = %q, want %q", tc.raw, got, tc.want)
		}
		if (tpl.single != "") != tc.single {
			t.Errorf("%q: single-placeholder fast path = %q", tc.raw, tpl.single)
		}
	}
	if tpl := newTemplate("{test.a}"); tpl.eval(httptest.NewRequest("GET", "/", nil), nil) != "" {
		t.Errorf("eval without a replacer = %q", tpl.eval(httptest.NewRequest("GET", "/", nil), nil))
	}
}

// TestTemplate_DirectReadsAgreeWithCaddysReplacer checks the placeholders
// read straight from the request against Caddy's own replacer.
func TestTemplate_DirectReadsAgreeWithCaddysReplacer(t *testing.T) {
	r := httptest.NewRequest("GET", "/p?q=1", nil)
	r.RemoteAddr = "[2001:db8::7]:5555"
	r.Header.Add("X-Api-Key", "k1")
	r.Header.Add("X-Multi", "a")
	r.Header.Add("X-Multi", "b")
	ctx := context.WithValue(r.Context(), caddyhttp.VarsCtxKey, map[string]any{"client_ip": "203.0.113.9", "n": 7})
	r = r.WithContext(ctx)
	repl := caddyhttp.NewTestReplacer(r)
	for _, raw := range []string{
		"{http.request.header.X-API-Key}",
		"{http.request.header.x-multi}",
		"{http.request.header.Absent}",
		"{http.vars.client_ip}",
		"{http.vars.n}",
		"{http.vars.absent}",
		"{http.request.remote.host}",
	} {
		direct := newTemplate(raw)
		if direct.direct == directNone {
			t.Fatalf("%s is not read directly", raw)
		}
		viaRepl := direct
		viaRepl.direct = directNone
		got, want := direct.eval(r, nil), viaRepl.eval(r, repl)
		if got != want {
			t.Errorf("%s: direct %q, replacer %q", raw, got, want)
		}
	}
	r.RemoteAddr = "/run/caddy.sock"
	if tpl := newTemplate("{http.request.remote.host}"); tpl.eval(r, nil) != "/run/caddy.sock" {
		t.Errorf("unix socket remote host = %q", tpl.eval(r, nil))
	}
}

// TestRedisOption_UnresolvedPlaceholderFailsProvision: a runtime
// placeholder that resolves to nothing fails provisioning with the field
// named, not a silent local-only start.
func TestRedisOption_UnresolvedPlaceholderFailsProvision(t *testing.T) {
	cfg, err := resolveOrigin(originConfigWith("{env.RATELIMIT_TEST_UNSET_VARIABLE}"))
	if err == nil {
		t.Fatalf("resolved to %v", cfg.Redis)
	}
	if !strings.Contains(err.Error(), "redis") {
		t.Fatalf("error %q does not name the field", err)
	}
	t.Setenv("RATELIMIT_TEST_SET_VARIABLE", "redis://:pw@127.0.0.1:6379")
	cfg, err = resolveOrigin(originConfigWith("{env.RATELIMIT_TEST_SET_VARIABLE}"))
	if err != nil || cfg.Redis[0] != "redis://:pw@127.0.0.1:6379" {
		t.Fatalf("resolve = %v, %v", cfg.Redis, err)
	}
}

func originConfigWith(url string) origin.Config { return origin.Config{Redis: []string{url}} }

// TestLiteral_AgreesWithProvisioning: what caddy adapt checks of a value
// written out (literal) is what provisioning uses, for each field that
// takes placeholders. A value with no '{' is taken as written: Caddy's
// replacer would unescape its "\}" too, and identifier_secret went through
// it, so a 16-byte secret ending in "\}" passed adapt and failed at load,
// 15 bytes long, without a line.
func TestLiteral_AgreesWithProvisioning(t *testing.T) {
	for _, s := range []string{`abcdefghijklmn\}`, `redis://:p\}w@127.0.0.1:6379`, `a\{b`, `a\\}b`, `plain`, `}{`} {
		lit, ok := literal(s)
		if !ok {
			t.Fatalf("%q: not a literal", s)
		}
		if ids, err := newIdentities(s, false); len(lit) >= minSecretLen && (err != nil || string(ids.secret) != lit) {
			t.Errorf("identifier_secret %q: adapt checks %q, provisioning uses %q (%v)", s, lit, ids.secret, err)
		}
		dsn, err := resolveDSN("mysql", s)
		if err != nil || dsn != lit {
			t.Errorf("mysql %q: adapt checks %q, provisioning uses %q (%v)", s, lit, dsn, err)
		}
		cfg, err := resolveOrigin(originConfigWith(s))
		if err != nil || cfg.Redis[0] != lit {
			t.Errorf("redis %q: adapt checks %q, provisioning uses %v (%v)", s, lit, cfg.Redis, err)
		}
	}
}
