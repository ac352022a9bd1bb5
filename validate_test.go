package ratelimit

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
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
		{"jitter past a Duration", func(h *Handler) { h.RetryJitter = 1<<63 - 1 }, "retry_jitter 2562047h47m16.854775807s is above 24h0m0s"},
		{"window of centuries", func(h *Handler) { h.Zones[0].Window = caddy.Duration(2500000 * time.Hour) }, "window must be at most 87600h0m0s (3650d)"},
		{"unclosed key placeholder", func(h *Handler) { h.Zones[0].Key = "{http.request.header.X-Key" }, `key "{http.request.header.X-Key" has an unclosed placeholder`},
		{"unopened key placeholder", func(h *Handler) { h.Zones[0].Key = "client_ip}" }, `key "client_ip}" closes a placeholder it never opened`},
		{"unclosed cost placeholder", func(h *Handler) { h.Zones[0].Cost = "{api_cost" }, `cost "{api_cost" has an unclosed placeholder`},
		{"key placeholder of no field", func(h *Handler) { h.Zones[0].Key = "t-{http.request.header.}" }, `key "t-{http.request.header.}" has a placeholder {http.request.header.} that names no field`},
		{"empty key placeholder", func(h *Handler) { h.Zones[0].Key = "{}" }, `key "{}" has a placeholder {} that names no field`},
		{"cost placeholder then text", func(h *Handler) { h.Zones[0].Cost = "{http.request.header.X-Cost}x" }, `cost "{http.request.header.X-Cost}x" is neither an integer nor one placeholder: text beside a placeholder makes the cost another number or none; write the placeholder alone, {http.request.header.X-Cost}`},
		{"text then cost placeholder", func(h *Handler) { h.Zones[0].Cost = "5{x}" }, `cost "5{x}" is neither an integer nor one placeholder`},
		{"escaped braces as cost", func(h *Handler) { h.Zones[0].Cost = `\{x\}` }, `is neither a non-negative integer nor a placeholder`},
		{"key placeholder with a space", func(h *Handler) { h.Zones[0].Key = "{http.vars.client_ip }" }, `key "{http.vars.client_ip }" has a placeholder {http.vars.client_ip } with whitespace in its name`},
		{"key of a header of no name", func(h *Handler) { h.Zones[0].Key = "{header}" }, `key "{header}" has a placeholder {header} that names no field: it is empty for every request; write {http.request.header.NAME}`},
		{"key of a header name with a colon", func(h *Handler) { h.Zones[0].Key = "t-{http.request.header.X:Key}" }, `whose header name "X:Key" is no HTTP field name`},
		{"key of a header name with a tab", func(h *Handler) { h.Zones[0].Key = "{http.request.header.X\tKey}" }, `with whitespace in its name`},
		{"cost of a header of no name", func(h *Handler) { h.Zones[0].Cost = "{http.request.header}" }, `cost "{http.request.header}" has a placeholder {http.request.header} that names no field`},
		{"cost of a header name with a space", func(h *Handler) { h.Zones[0].Cost = "{http.request.header.X Cost}" }, `with whitespace in its name`},
		{"cost placeholder of no field", func(h *Handler) { h.Zones[0].Cost = "{http.request.header.}" }, `cost "{http.request.header.}" has a placeholder {http.request.header.} that names no field`},
		{"default cost with a constant cost", func(h *Handler) { h.Zones[0].Cost, h.Zones[0].DefaultCost = "5", 30 }, `default_cost is for a cost placeholder; cost "5" is a constant`},
		{"override of one address under /24", func(h *Handler) {
			h.Zones[0].IPv4Prefix, h.Zones[0].Overrides = 24, map[string]int64{"203.0.113.5": 0}
		}, `override "203.0.113.5" never matches: the zone counts this address as 203.0.113.0/24`},
		{"override of a /48 under /64", func(h *Handler) { h.Zones[0].Overrides = map[string]int64{"2001:db8::/48": 0} }, "so a /48 never matches"},
		{"default cost with no cost", func(h *Handler) { h.Zones[0].DefaultCost = 3 }, `default_cost is for a cost placeholder; cost "" is a constant`},
		{"limit above 2^53-1", func(h *Handler) { h.Zones[0].Limit = 1 << 53 }, "limit 9007199254740992 is above the largest count, 9007199254740991"},
		{"cost above 2^53-1", func(h *Handler) { h.Zones[0].Cost = "9007199254740992" }, "cost 9007199254740992 is above the largest count"},
		{"default cost above 2^53-1", func(h *Handler) { h.Zones[0].DefaultCost = 1 << 53 }, "default_cost 9007199254740992 is above the largest count"},
		{"negative min_cost", func(h *Handler) { h.Zones[0].MinCost = int64p(-1) }, "min_cost -1 is negative"},
		{"negative max_cost", func(h *Handler) { h.Zones[0].MaxCost = int64p(-1) }, "max_cost -1 is negative"},
		{"min_cost above 2^53-1", func(h *Handler) { h.Zones[0].MinCost = int64p(1 << 53) }, "min_cost 9007199254740992 is above the largest count"},
		{"max_cost above 2^53-1", func(h *Handler) { h.Zones[0].MaxCost = int64p(1 << 53) }, "max_cost 9007199254740992 is above the largest count"},
		{"max_cost 0 below the default min_cost", func(h *Handler) { h.Zones[0].MaxCost = int64p(0) }, "max_cost 0 is below min_cost, which is 1 when not given"},
		{"min_cost above max_cost", func(h *Handler) { h.Zones[0].MinCost, h.Zones[0].MaxCost = int64p(5), int64p(4) }, "min_cost 5 is above max_cost 4"},
		{"default cost below min_cost", func(h *Handler) {
			h.Zones[0].Cost, h.Zones[0].DefaultCost, h.Zones[0].MinCost = "{x}", 2, int64p(3)
		}, "default_cost 2 is outside [min_cost 3, max_cost 9007199254740991]"},
		{"default cost above max_cost", func(h *Handler) {
			h.Zones[0].Cost, h.Zones[0].DefaultCost, h.Zones[0].MaxCost = "{x}", 20, int64p(10)
		}, "default_cost 20 is outside [min_cost 1, max_cost 10]"},
		{"implicit default cost below min_cost", func(h *Handler) { h.Zones[0].Cost, h.Zones[0].MinCost = "{x}", int64p(3) }, "default_cost, 1 when not given, is outside [min_cost 3"},
		{"placeholder with max_cost 0", func(h *Handler) {
			h.Zones[0].Cost, h.Zones[0].MinCost, h.Zones[0].MaxCost = "{x}", int64p(0), int64p(0)
		}, "max_cost 0 leaves no room for the default cost"},
		{"constant cost below a written min_cost", func(h *Handler) { h.Zones[0].Cost, h.Zones[0].MinCost = "0", int64p(1) }, "constant cost 0 is below min_cost 1"},
		{"constant cost above a written max_cost", func(h *Handler) { h.Zones[0].Cost, h.Zones[0].MaxCost = "11", int64p(10) }, "constant cost 11 is above max_cost 10"},
		{"no cost below a written min_cost", func(h *Handler) { h.Zones[0].MinCost = int64p(2) }, "constant cost 1 is below min_cost 2"},
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

// TestZone_CostBoundsAccepted: the cost settings that agree with each
// other pass Validate, and compile to the bounds costOf uses. A constant
// cost is only held to the bounds the config writes: `cost 0` alone is a
// zone that only reads.
func TestZone_CostBoundsAccepted(t *testing.T) {
	for _, tc := range []struct {
		name         string
		zone         func(z *Zone)
		lo, hi, dflt int64
	}{
		{"defaults", func(z *Zone) {}, 1, maxUnits, 1},
		{"constant zero", func(z *Zone) { z.Cost = "0" }, 1, maxUnits, 1},
		{"constant zero under max_cost", func(z *Zone) { z.Cost, z.MaxCost = "0", int64p(5) }, 1, 5, 1},
		{"constant zero with min_cost 0", func(z *Zone) { z.Cost, z.MinCost, z.MaxCost = "0", int64p(0), int64p(0) }, 0, 0, 1},
		{"placeholder, free floor", func(z *Zone) { z.Cost, z.MinCost = "{x}", int64p(0) }, 0, maxUnits, 1},
		{"placeholder, default at min_cost", func(z *Zone) { z.Cost, z.DefaultCost, z.MinCost = "{x}", 3, int64p(3) }, 3, maxUnits, 3},
		{"placeholder, default at max_cost", func(z *Zone) { z.Cost, z.DefaultCost, z.MaxCost = "{x}", 10, int64p(10) }, 1, 10, 10},
		{"placeholder, one cost", func(z *Zone) { z.Cost, z.MinCost, z.MaxCost = "{x}", int64p(1), int64p(1) }, 1, 1, 1},
		{"largest bounds", func(z *Zone) {
			z.Cost, z.DefaultCost, z.MinCost, z.MaxCost = "{x}", maxUnits, int64p(maxUnits), int64p(maxUnits)
		}, maxUnits, maxUnits, maxUnits},
	} {
		t.Run(tc.name, func(t *testing.T) {
			z := zoneOf("z", 5, time.Minute)
			tc.zone(z)
			h := &Handler{Zones: []*Zone{z}}
			if err := h.Validate(); err != nil {
				t.Fatalf("Validate: %v", err)
			}
			h.compile()
			if c := h.zones[0]; c.minCost != tc.lo || c.maxCost != tc.hi || c.defaultCost != tc.dflt {
				t.Fatalf("compiled to [%d, %d], default %d; want [%d, %d], default %d", c.minCost, c.maxCost, c.defaultCost, tc.lo, tc.hi, tc.dflt)
			}
		})
	}
}

// TestZone_CostBoundsFromJSON: min_cost 0 written in JSON is 0, not the
// default 1, and bad bounds fail Validate with the field's name.
func TestZone_CostBoundsFromJSON(t *testing.T) {
	load := func(t *testing.T, zone string) (*Handler, error) {
		t.Helper()
		var h Handler
		if err := json.Unmarshal([]byte(`{"zones": [`+zone+`]}`), &h); err != nil {
			t.Fatal(err)
		}
		return &h, h.Validate()
	}
	h, err := load(t, `{"name": "a", "key": "k", "limit": 5, "window": "1m", "cost": "{x}", "min_cost": 0, "max_cost": 100}`)
	if err != nil {
		t.Fatal(err)
	}
	h.compile()
	if z := h.zones[0]; z.minCost != 0 || z.maxCost != 100 {
		t.Fatalf("compiled to [%d, %d], want [0, 100]", z.minCost, z.maxCost)
	}
	for _, tc := range []struct{ zone, want string }{
		{`"min_cost": -1`, `zone "a": min_cost -1 is negative`},
		{`"max_cost": 0`, `zone "a": max_cost 0 is below min_cost`},
		{`"min_cost": 7, "max_cost": 6`, `zone "a": min_cost 7 is above max_cost 6`},
		{`"max_cost": 9007199254740992`, `zone "a": max_cost 9007199254740992 is above the largest count`},
		{`"min_cost": 2, "default_cost": 1`, `zone "a": default_cost 1 is outside [min_cost 2`},
	} {
		_, err := load(t, `{"name": "a", "key": "k", "limit": 5, "window": "1m", "cost": "{x}", `+tc.zone+`}`)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Validate() = %v, want %q", tc.zone, err, tc.want)
		}
	}
}

// TestOverride_PlaceholderIsRejected: an override's identifier is compared
// with the request's identifier as written; a placeholder in it ({env.VIP},
// a header) is never replaced, so the override never matched and the
// config said nothing. Both the Caddyfile and a JSON config now fail.
func TestOverride_PlaceholderIsRejected(t *testing.T) {
	for _, id := range []string{"{env.VIP_KEY}", "{http.request.header.X-Vip}", "vip-{env.N}"} {
		src := ":80 {\n\tratelimit {\n\t\tzone z {\n\t\t\tkey {http.request.header.X-Key}\n\t\t\tlimit 5\n\t\t\twindow 1m\n\t\t\toverride " + id + " 100\n\t\t}\n\t}\n}\n"
		out, err := adapt(t, src)
		if err == nil || !strings.Contains(err.Error(), "placeholder") || !strings.Contains(err.Error(), "Caddyfile:7") {
			t.Errorf("override %s: adapted to %s, error %v; want a placeholder error at Caddyfile:7", id, out, err)
		}
		z := zoneOf("z", 5, time.Minute)
		z.Overrides = map[string]int64{id: 100}
		if err := (&Handler{Zones: []*Zone{z}}).Validate(); err == nil || !strings.Contains(err.Error(), "placeholder") {
			t.Errorf("override %s in JSON: Validate said %v, want a placeholder error", id, err)
		}
	}
	// Braces that make no placeholder are text, compared as written.
	z := zoneOf("z", 5, time.Minute)
	z.Overrides = map[string]int64{"a{b": 100, "c}d": 100}
	if err := (&Handler{Zones: []*Zone{z}}).Validate(); err != nil {
		t.Errorf("overrides of unpaired braces: %v", err)
	}
}

// TestZone_CaddyfileShorthandInJSONIsRejected: the Caddyfile adapter
// expands shorthands ({remote_host}, {header.X}); a JSON config does not,
// and Caddy's replacer knows none of them, so a JSON key of {remote_host}
// was empty for every request: one shared count for every client (the
// default on_missing_key), or none counted with skip. Validate now names
// the placeholder to write.
func TestZone_CaddyfileShorthandInJSONIsRejected(t *testing.T) {
	// What such a key was: empty, for any client.
	r := httptest.NewRequest("GET", "http://example.com/", nil)
	r.RemoteAddr = "203.0.113.7:1234"
	shorthand, full := newKeyTemplate("{remote_host}"), newKeyTemplate("{http.request.remote.host}")
	repl := caddyhttp.NewTestReplacer(r)
	if id := shorthand.evalKey(r, repl, 32, 64); id != "" {
		t.Fatalf("{remote_host} in JSON evaluated to %q; the premise is that it is empty", id)
	}
	if id := full.evalKey(r, repl, 32, 64); id != "203.0.113.7" {
		t.Fatalf("{http.request.remote.host} evaluated to %q", id)
	}

	for _, tc := range []struct{ key, cost, want string }{
		{"{remote_host}", "", "{http.request.remote.host}"},
		{"{client_ip}", "", "{http.vars.client_ip}"},
		{"tenant-{header.X-Tenant}", "", "{http.request.header.X-Tenant}"},
		{"{http.request.remote.host}", "{header.X-Cost}", "{http.request.header.X-Cost}"},
	} {
		z := zoneOf("z", 5, time.Minute)
		z.Key = tc.key
		z.Cost = caddyhttp.WeakString(tc.cost)
		err := (&Handler{Zones: []*Zone{z}}).Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("key %q cost %q: Validate said %v; want it to name %s", tc.key, tc.cost, err, tc.want)
		}
	}
	z := zoneOf("z", 5, time.Minute)
	z.Key = "{http.request.header.X-Key}:{http.vars.client_ip}"
	z.Cost = "{file.cost}" // Caddy's own placeholder of a file's contents
	if err := (&Handler{Zones: []*Zone{z}}).Validate(); err != nil {
		t.Errorf("full placeholders: %v", err)
	}
}

// TestOverride_CompositeKeyOverrideThatCannotMatch: in a composite key
// each placeholder's value has '%' and the first byte of every separator
// written %XX, so an override written with them raw never matched: under
// `{client_ip}:{http.request.header.X-Key}` an IPv6 client is
// "2001%3Adb8%3A%3A/64:k", never "2001:db8::/64:k". Both the Caddyfile
// and Validate now say so; an override written as the key is made passes,
// and does match.
func TestOverride_CompositeKeyOverrideThatCannotMatch(t *testing.T) {
	const key = "{http.vars.client_ip}:{http.request.header.X-Key}"
	for _, id := range []string{"2001:db8::/64:k", "50%:k", "a:b:c"} {
		z := zoneOf("z", 5, time.Minute)
		z.Key = key
		z.Overrides = map[string]int64{id: 100}
		if err := (&Handler{Zones: []*Zone{z}}).Validate(); err == nil || !strings.Contains(err.Error(), "never matches") {
			t.Errorf("override %q: Validate said %v, want never matches", id, err)
		}
		src := ":80 {\n\tratelimit {\n\t\tzone z {\n\t\t\tkey " + key + "\n\t\t\tlimit 5\n\t\t\twindow 1m\n\t\t\toverride " + id + " 100\n\t\t}\n\t}\n}\n"
		if out, err := adapt(t, src); err == nil || !strings.Contains(err.Error(), "never matches") || !strings.Contains(err.Error(), "Caddyfile:7") {
			t.Errorf("override %q: adapted to %s, error %v; want never matches at Caddyfile:7", id, out, err)
		}
	}

	// A value that is an address is written as the zone masks it.
	for id, want := range map[string]string{"203.0.113.7:k": "203.0.113.0/24", "203.0.113.0/24:k": "", "2001%3Adb8%3A%3A7:k": "2001:db8::/64"} {
		z := zoneOf("z", 5, time.Minute)
		z.Key, z.IPv4Prefix = key, 24
		z.Overrides = map[string]int64{id: 100}
		err := (&Handler{Zones: []*Zone{z}}).Validate()
		if want == "" && err != nil || want != "" && (err == nil || !strings.Contains(err.Error(), want)) {
			t.Errorf("override %q under ipv4_prefix 24: Validate said %v, want %q", id, err, want)
		}
	}

	// The form the key makes is accepted, and is what a request makes.
	r := httptest.NewRequest("GET", "http://example.com/", nil)
	r.Header.Set("X-Key", "k:1")
	repl := caddyhttp.NewTestReplacer(r)
	repl.Set("http.vars.client_ip", "2001:db8::7")
	tpl := newKeyTemplate(key)
	id := tpl.evalKey(r, repl, 32, 64)
	z := zoneOf("z", 5, time.Minute)
	z.Key = key
	z.Overrides = map[string]int64{id: 100, "1%25:a": 100, "k:": 100}
	if err := (&Handler{Zones: []*Zone{z}}).Validate(); err != nil {
		t.Errorf("overrides %v as the key makes them: %v", z.Overrides, err)
	}
	if id != "2001%3Adb8%3A%3A/64:k%3A1" {
		t.Errorf("the key made %q", id)
	}

	// Whatever values a request brings, the identifier it makes passes.
	values := []string{"", "x", ":", "%", "%3A", "A", "3", "a::b", "%%", "1.2.3.4", "::1", "-", "--", "x-:y"}
	for _, k := range []string{"{http.vars.a}:{http.vars.b}", "p{http.vars.a}A{http.vars.b}s", "{http.vars.a}3{http.vars.b}::{http.vars.c}", "{http.vars.a}-:{http.vars.b}"} {
		tpl := newKeyTemplate(k)
		for _, a := range values {
			for _, b := range values {
				repl := caddyhttp.NewTestReplacer(r)
				repl.Set("http.vars.a", a)
				repl.Set("http.vars.b", b)
				repl.Set("http.vars.c", b+a)
				id := tpl.evalKey(r, repl, 32, 64)
				if id == "" {
					continue
				}
				z := zoneOf("z", 5, time.Minute)
				z.Key = k
				z.Overrides = map[string]int64{id: 100}
				if err := (&Handler{Zones: []*Zone{z}}).Validate(); err != nil {
					t.Errorf("key %q, values %q %q: %v", k, a, b, err)
				}
			}
		}
	}
}

// TestOverride_KeyWithTextAroundOnePlaceholderThatCannotMatch: a key of
// one placeholder with text around it (`ip-{client_ip}`) masks the
// placeholder's value as `{client_ip}` alone does, but its overrides were
// checked as if the whole identifier were the value: `ip-192.0.2.1` under
// ipv4_prefix 24 (the key makes `ip-192.0.2.0/24`), or one without the
// key's text, was accepted and never matched. Both the Caddyfile and
// Validate now say so; what the key makes passes.
func TestOverride_KeyWithTextAroundOnePlaceholderThatCannotMatch(t *testing.T) {
	const key = "ip-{http.vars.client_ip}"
	for id, want := range map[string]string{
		"ip-192.0.2.1":   "192.0.2.0/24",
		"ip-2001:db8::1": "2001:db8::/64",
		"192.0.2.0/24":   "never matches",
		"ip-":            "never matches",
	} {
		z := zoneOf("z", 5, time.Minute)
		z.Key, z.IPv4Prefix = key, 24
		z.Overrides = map[string]int64{id: 100}
		if err := (&Handler{Zones: []*Zone{z}}).Validate(); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("override %q: Validate said %v, want %q", id, err, want)
		}
		src := ":80 {\n\tratelimit {\n\t\tzone z {\n\t\t\tkey " + key + "\n\t\t\tlimit 5\n\t\t\twindow 1m\n\t\t\tipv4_prefix 24\n\t\t\toverride " + id + " 100\n\t\t}\n\t}\n}\n"
		if out, err := adapt(t, src); err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "Caddyfile:8") {
			t.Errorf("override %q: adapted to %s, error %v; want %q at Caddyfile:8", id, out, err, want)
		}
	}

	// Whatever values a request brings, the identifier it makes passes.
	r := httptest.NewRequest("GET", "http://example.com/", nil)
	for _, k := range []string{key, "{http.vars.client_ip}-x", "p{http.vars.client_ip}s"} {
		tpl := newKeyTemplate(k)
		for _, v := range []string{"192.0.2.1", "2001:db8::7", "::ffff:192.0.2.1", "tenant", "ip-", "%", "192.0.2.0/24"} {
			repl := caddyhttp.NewTestReplacer(r)
			repl.Set("http.vars.client_ip", v)
			id := tpl.evalKey(r, repl, 24, 64)
			z := zoneOf("z", 5, time.Minute)
			z.Key, z.IPv4Prefix = k, 24
			z.Overrides = map[string]int64{id: 100}
			if err := (&Handler{Zones: []*Zone{z}}).Validate(); err != nil {
				t.Errorf("key %q, value %q: the identifier it makes, %q: %v", k, v, id, err)
			}
		}
	}
}

// TestOverride_AddressInALooseFormUnderAnAddressKey: under {client_ip},
// whose values are addresses as netip writes them, an override that is
// an address or prefix written in another form never matches: caddy adapt
// and Validate reject it and name the form to write (until 2026-11-29
// each was accepted, and requests were counted at the zone's limit).
func TestOverride_AddressInALooseFormUnderAnAddressKey(t *testing.T) {
	for _, tc := range []struct{ key, id, want string }{
		{"{client_ip}", "1.2.3.0/024", "write 1.2.3.0/24"},
		{"{client_ip}", "01.2.4.0/24", "write 1.2.4.0/24"},
		{"{client_ip}", "1.2.3.0/24%eth0", "write 1.2.3.0/24"},
		{"{client_ip}", "1.2.3.4/", "write 1.2.3.0/24"},
		{"{client_ip}", "001.002.003.004", "write 1.2.3.0/24"},
		{"{client_ip}", "fe80::/64%eth0", "write fe80::/64"},
		{"{client_ip}", "fe80::1%eth0", "counts this address as fe80::/64"},
		{"{client_ip}", `" 1.2.3.0/24"`, "write 1.2.3.0/24"},
		{"{client_ip}", "127.1", "no address netip parses; write a prefix's first address with /24 (IPv4) or /64 (IPv6)"},
		{"{client_ip}", `"[::1]"`, "write ::/64"},
		{"{client_ip}", `"[2001:db8::]/64"`, "write 2001:db8::/64"},
		{"ip-{client_ip}", "ip-1.2.3.0/024", "write 1.2.3.0/24"},
		{"{client_ip}:{header.X-Key}", "01.2.3.0/24:k", "write 1.2.3.0/24"},
	} {
		src := `:8080 {
	ratelimit {
		zone z {
			key ` + tc.key + `
			limit 5
			window 1m
			override ` + tc.id + ` 9
			ipv4_prefix 24
		}
	}
	respond "ok"
}`
		if out, err := adapt(t, src); err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "never matches") || !strings.Contains(err.Error(), "Caddyfile:7") {
			t.Errorf("key %s, override %s: adapted to %s, error %v; want one at Caddyfile:7 containing %q", tc.key, tc.id, out, err, tc.want)
		}
	}
	// JSON: the same check, at load.
	h := &Handler{Zones: []*Zone{{Name: "z", Key: "{http.vars.client_ip}", Limit: 5, Window: caddy.Duration(time.Minute),
		IPv4Prefix: 24, Overrides: map[string]int64{"1.2.3.0/024": 9}}}}
	if err := h.Validate(); err == nil || !strings.Contains(err.Error(), `override "1.2.3.0/024" never matches`) || !strings.Contains(err.Error(), "write 1.2.3.0/24") {
		t.Errorf("Validate() = %v, want the override rejected with its form", err)
	}
	// Text that is no address is compared as it is, as before, and under a
	// key of any other placeholder every form is (a header may hold it).
	h.Zones[0].Overrides = map[string]int64{"not-an-address": 9, "@": 9}
	if err := h.Validate(); err != nil {
		t.Errorf("Validate() of text overrides = %v", err)
	}
	h.Zones[0].Key, h.Zones[0].Overrides = "{http.request.header.X-Key}", map[string]int64{"1.2.3.0/024": 9, "127.1": 9}
	if err := h.Validate(); err != nil {
		t.Errorf("Validate() of loose forms under a header key = %v", err)
	}
}

// TestOverrides_AnAddressInALooseFormIsA400: the admin API refuses what
// caddy adapt refuses, under {client_ip}: 127.1 and " 127.0.0.1" were
// stored with a 200 and never applied.
func TestOverrides_AnAddressInALooseFormIsA400(t *testing.T) {
	defs := []zoneDef{{key: "{http.vars.client_ip}", v4: 32, v6: 64}}
	for _, id := range []string{"127.1", " 127.0.0.1", "01.2.3.4", "1.2.3.0/024", "1.2.3.4/", "fe80::/64%eth0", "[::1]", "[2001:db8::]/64"} {
		err := checkOverrideAddress(id, defs)
		var ae caddy.APIError
		if !errors.As(err, &ae) || ae.HTTPStatus != http.StatusBadRequest || !strings.Contains(err.Error(), "no IP address") {
			t.Errorf("%q: %v, want a 400 saying the key holds an address", id, err)
		}
	}
	for _, id := range []string{"127.0.0.1", "fe80::1%eth0", "2001:db8::1", "not-an-address"} {
		if err := checkOverrideAddress(id, defs); err != nil {
			t.Errorf("%q: %v, want it taken", id, err)
		}
	}
}
