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
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// FuzzHandler_WhatValidatesServes: any JSON config of the handler (the
// golden files' handlers among the seeds) and any request headers. A
// config that Validate accepts provisions, and a request through it is
// passed on (200) or denied with a 429, whatever its key and cost headers
// hold, twice; never a panic or any other answer. A config Validate
// refuses is refused with a reason before anything runs. `go test -fuzz
// FuzzHandler_WhatValidatesServes -run '^$' .` runs the fuzzer.
func FuzzHandler_WhatValidatesServes(f *testing.F) {
	seeds := 0
	for _, g := range goldens(f) {
		var cfg any
		if json.Unmarshal([]byte(g.want), &cfg) != nil {
			continue // an error file
		}
		for _, h := range handlersIn(cfg) {
			b, err := json.Marshal(h)
			if err != nil {
				f.Fatal(err)
			}
			f.Add(string(b), "alice", "1")
			seeds++
		}
	}
	if seeds == 0 {
		f.Fatal("no handler in the golden files")
	}
	f.Add(`{"zones":[{"name":"z","key":"{http.request.header.X-Key}","limit":1,"window":1000000000,"cost":"{http.request.header.X-Cost}","max_cost":5}]}`, "\x00:{}", "-9223372036854775808")
	f.Fuzz(func(t *testing.T, config, key, cost string) {
		h := new(Handler)
		if err := json.Unmarshal([]byte(config), h); err != nil {
			return
		}
		if err := h.Validate(); err != nil {
			if err.Error() == "" {
				t.Fatal("refused without a reason")
			}
			return
		}
		h.logger = zap.NewNop()
		if err := h.provision(new(App)); err != nil {
			_ = h.Cleanup()
			if strings.Contains(err.Error(), "redefined") {
				return // a zone of an earlier input, not yet released: the pool is the process's
			}
			t.Fatalf("validated, but provisioning fails: %v\n%s", err, config)
		}
		defer func() {
			if err := h.Cleanup(); err != nil {
				t.Error(err)
			}
		}()
		for range 2 {
			req := httptest.NewRequest(http.MethodGet, "http://example.com/api/x", nil)
			for _, name := range []string{"X-Key", "X-Api-Key", "X-Cost", "X-Tenant"} {
				req.Header[name] = []string{key}
			}
			req.Header["X-Cost"] = []string{cost}
			repl := caddyhttp.NewTestReplacer(req)
			req = req.WithContext(context.WithValue(req.Context(), caddy.ReplacerCtxKey, repl))
			rec := httptest.NewRecorder()
			err := h.ServeHTTP(rec, req, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
				w.WriteHeader(http.StatusOK)
				return nil
			}))
			var he caddyhttp.HandlerError
			switch {
			case err == nil && rec.Code == http.StatusOK:
			case errors.As(err, &he) && he.StatusCode == http.StatusTooManyRequests:
			default:
				t.Fatalf("answered %d, %v\nconfig %s\nkey %q cost %q", rec.Code, err, config, key, cost)
			}
		}
	})
}

// handlersIn returns the ratelimit handlers of a decoded JSON config.
func handlersIn(v any) []map[string]any {
	var out []map[string]any
	switch v := v.(type) {
	case map[string]any:
		if v["handler"] == "ratelimit" {
			return []map[string]any{v}
		}
		for _, c := range v {
			out = append(out, handlersIn(c)...)
		}
	case []any:
		for _, c := range v {
			out = append(out, handlersIn(c)...)
		}
	}
	return out
}

// FuzzApp_WhatValidatesProvisions: any JSON config of the `ratelimit` app
// (the golden files' among the seeds). A config the app's validation
// accepts provisions (which starts no I/O), but where it names a runtime
// placeholder, known only then, or a process that ran another config
// refuses it (a region changed): JSON configs are never adapted, so what
// validation lets through fails when Caddy loads the config. `go test
// -fuzz FuzzApp_WhatValidatesProvisions -run '^$' .` runs the fuzzer.
func FuzzApp_WhatValidatesProvisions(f *testing.F) {
	for _, g := range goldens(f) {
		var cfg struct {
			Apps map[string]json.RawMessage `json:"apps"`
		}
		if json.Unmarshal([]byte(g.want), &cfg) == nil && cfg.Apps["ratelimit"] != nil {
			f.Add(string(cfg.Apps["ratelimit"]))
		}
	}
	f.Fuzz(func(t *testing.T, config string) {
		a := new(App)
		if err := json.Unmarshal([]byte(config), a); err != nil || a.Validate() != nil {
			return
		}
		if hasPlaceholder(config) {
			return // a value known only when Caddy loads the config
		}
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		defer cancel()
		err := a.Provision(ctx)
		if err != nil && !strings.Contains(err.Error(), "restart Caddy to") {
			t.Fatalf("validated, but provisioning fails: %v\n%s", err, config)
		}
		if err := a.Cleanup(); err != nil {
			t.Error(err)
		}
	})
}
