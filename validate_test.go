package ratelimit

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

func TestHandler_ValidateRejectsBadJSON(t *testing.T) {
	good := func() *Zone { return zoneOf("z", 5, time.Minute) }
	tests := []struct {
		name string
		mod  func(h *Handler)
		want string
	}{
		{"no zones", func(h *Handler) { h.Zones = nil }, "at least one zone"},
		{"null zone", func(h *Handler) { h.Zones = append(h.Zones, nil) }, "zone 1 is null"},
		{"duplicate", func(h *Handler) { h.Zones = append(h.Zones, good()) }, `zone "z" defined twice`},
		{"bad name", func(h *Handler) { h.Zones[0].Name = `a"b` }, "only letters"},
		{"empty name", func(h *Handler) { h.Zones[0].Name = "" }, "zone name is empty"},
		{"missing key", func(h *Handler) { h.Zones[0].Key = "" }, "missing key"},
		{"zero limit", func(h *Handler) { h.Zones[0].Limit = 0 }, "limit must be positive"},
		{"short window", func(h *Handler) { h.Zones[0].Window = caddy.Duration(999 * time.Millisecond) }, "window must be at least 1s"},
		{"fractional window", func(h *Handler) { h.Zones[0].Window = caddy.Duration(2500 * time.Millisecond) }, "whole number of seconds"},
		{"bad cost", func(h *Handler) { h.Zones[0].Cost = "many" }, `cost "many"`},
		{"negative default cost", func(h *Handler) { h.Zones[0].DefaultCost = -1 }, "default_cost -1"},
		{"negative override", func(h *Handler) { h.Zones[0].Overrides = map[string]int64{"x": -1} }, `override "x"`},
		{"empty override", func(h *Handler) { h.Zones[0].Overrides = map[string]int64{"": 1} }, "empty identifier"},
		{"ipv4 prefix", func(h *Handler) { h.Zones[0].IPv4Prefix = 40 }, "ipv4_prefix must be between 1 and 32"},
		{"ipv6 prefix", func(h *Handler) { h.Zones[0].IPv6Prefix = -1 }, "ipv6_prefix must be between 1 and 128"},
		{"headers", func(h *Handler) { h.Headers = "x" }, "headers must be"},
		{"on_missing_key", func(h *Handler) { h.OnMissingKey = "x" }, "on_missing_key must be"},
		{"jitter", func(h *Handler) { h.RetryJitter = -1 }, "retry_jitter"},
		{"limit above 2^53-1", func(h *Handler) { h.Zones[0].Limit = 1 << 53 }, "limit 9007199254740992 is above the largest count, 9007199254740991"},
		{"cost above 2^53-1", func(h *Handler) { h.Zones[0].Cost = "9007199254740992" }, "cost 9007199254740992 is above the largest count"},
		{"default cost above 2^53-1", func(h *Handler) { h.Zones[0].DefaultCost = 1 << 53 }, "default_cost 9007199254740992 is above the largest count"},
		{"override above 2^53-1", func(h *Handler) { h.Zones[0].Overrides = map[string]int64{"x": 1 << 53} }, `override "x": limit 9007199254740992 is above`},
		{"65 zones", func(h *Handler) {
			for i := range 64 {
				h.Zones = append(h.Zones, zoneOf(fmt.Sprintf("z%d", i), 5, time.Minute))
			}
		}, "at most 64 zones"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := &Handler{Zones: []*Zone{good()}}
			if err := h.Validate(); err != nil {
				t.Fatalf("valid handler rejected: %v", err)
			}
			tc.mod(h)
			err := h.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate() = %v, want error containing %q", err, tc.want)
			}
		})
	}
}
