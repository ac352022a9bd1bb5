package ratelimit

import (
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// compositeZone is a zone of limit 1 keyed by the template key.
func compositeZone(name, key string) *Zone {
	return &Zone{Name: name, Key: key, Limit: 1, Window: caddy.Duration(time.Minute)}
}

// TestHandler_CompositeKeysKeepTheirValuesApart: under "{a}:{b}" a value
// holding the separator moved a boundary, so ("t:u","v") and ("t","u:v")
// were one key "t:u:v", and the second client was denied by the first's
// count.
func TestHandler_CompositeKeysKeepTheirValuesApart(t *testing.T) {
	useClock(t, 0)
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{compositeZone("comp_sep", "{test.a}:{test.b}")}})
	for _, v := range []map[string]string{
		{"a": "t:u", "b": "v"},
		{"a": "t", "b": "u:v"},
		{"a": "t%3Au", "b": "v"}, // what the first escapes to: '%' is escaped too
		{"a": "t", "b": "u"},
	} {
		wantStatus(t, serve(h, v), http.StatusOK)
	}
	wantStatus(t, serve(h, map[string]string{"a": "t:u", "b": "v"}), http.StatusTooManyRequests)
}

// TestZone_TouchingPlaceholdersAreRejected: "{a}{b}" cannot tell
// ("x","yz") from ("xy","z"); it was accepted and counted both as "xyz".
func TestZone_TouchingPlaceholdersAreRejected(t *testing.T) {
	for _, key := range []string{"{test.a}{test.b}", "k-{test.a}{test.b}:{test.c}"} {
		err := compositeZone("comp_touch", key).validate()
		if err == nil || !strings.Contains(err.Error(), "nothing between them") {
			t.Fatalf("key %q: %v, want a rejection", key, err)
		}
	}
	for _, key := range []string{"{test.a}:{test.b}", "ip-{test.a}", "{test.a}", "const", `{test.a}\{{test.b}`} {
		if err := compositeZone("comp_ok", key).validate(); err != nil {
			t.Fatalf("key %q: %v", key, err)
		}
	}
}

// TestHandler_CompositeKeyMasksItsAddresses: an IP address inside a
// composite key was counted whole, so "{client_ip}-{tenant}" counted each
// /128 of a client's /64 (or each IPv4 address under ipv4_prefix 24)
// apart: a free bypass of the prefix.
func TestHandler_CompositeKeyMasksItsAddresses(t *testing.T) {
	useClock(t, 0)
	z := compositeZone("comp_ip", "{test.a}-{test.b}")
	z.IPv4Prefix = 24
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{z}})
	wantStatus(t, serve(h, map[string]string{"a": "2001:db8:1:2::1", "b": "t"}), http.StatusOK)
	wantStatus(t, serve(h, map[string]string{"a": "2001:db8:1:2::2", "b": "t"}), http.StatusTooManyRequests)
	wantStatus(t, serve(h, map[string]string{"a": "192.0.2.1", "b": "t"}), http.StatusOK)
	wantStatus(t, serve(h, map[string]string{"a": "192.0.2.9", "b": "t"}), http.StatusTooManyRequests)
	wantStatus(t, serve(h, map[string]string{"a": "192.0.2.9", "b": "u"}), http.StatusOK)
}

// TestHandler_CompositeKeyOfEmptyPlaceholdersIsMissing: "{a}:{b}" with
// both placeholders empty evaluated to ":", never empty, so
// on_missing_key deny admitted such requests into one shared bucket.
func TestHandler_CompositeKeyOfEmptyPlaceholdersIsMissing(t *testing.T) {
	useClock(t, 0)
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{compositeZone("comp_miss", "{test.a}:{test.b}")}, OnMissingKey: "deny"})
	r := serve(h, nil)
	wantStatus(t, r, http.StatusTooManyRequests)
	if !errors.Is(r.err, ErrMissingKey) {
		t.Fatalf("error %v, want ErrMissingKey", r.err)
	}
	// One part present is a key.
	wantStatus(t, serve(h, map[string]string{"b": "v"}), http.StatusOK)
}
