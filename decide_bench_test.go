package ratelimit

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

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
			repl := caddy.NewReplacer()
			repl.Set("test.bench", "api-key-0123456789")
			req := httptest.NewRequest(http.MethodGet, "/", nil)
			req = req.WithContext(context.WithValue(req.Context(), caddy.ReplacerCtxKey, repl))
			rec := httptest.NewRecorder()
			next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
			// The first request is allowed and uses up a limit of 1: every
			// later one in the hour is denied.
			if err := h.ServeHTTP(rec, req, next); err != nil {
				b.Fatal(err)
			}
			deny := bc.limit == 1
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				err := h.ServeHTTP(rec, req, next)
				if deny != (err != nil) {
					b.Fatalf("deny %v, got error %v", deny, err)
				}
			}
			if deny {
				var he caddyhttp.HandlerError
				if err := h.ServeHTTP(rec, req, next); !errors.As(err, &he) || he.StatusCode != http.StatusTooManyRequests {
					b.Fatalf("want a 429, got %v", err)
				}
			}
		})
	}
}
