package ratelimit

import (
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

func TestIdentifierHMAC_StableKeyedAndBounded(t *testing.T) {
	a := []byte("0123456789abcdef")
	b := []byte("fedcba9876543210")
	h := identifierHMAC(a, "alice")
	if !regexp.MustCompile(`^[0-9a-f]{32}$`).MatchString(h) {
		t.Fatalf("HMAC %q is not 32 lower-case hex digits", h)
	}
	if identifierHMAC(a, "alice") != h {
		t.Fatal("same secret and identifier, different HMAC")
	}
	if identifierHMAC(b, "alice") == h {
		t.Fatal("another secret, same HMAC")
	}
	if identifierHMAC(a, "alicf") == h {
		t.Fatal("another identifier, same HMAC")
	}
	if long := identifierHMAC(a, strings.Repeat("x", 10_000)); len(long) != hmacHexLen {
		t.Fatalf("a long identifier's HMAC has %d digits", len(long))
	}
}

func TestTruncateIdentifier(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"sk_live_0123456789abcdef0123456789", "sk_live_…"},
		{"203.0.113.7", "20…"},
		{"2001:db8:1:2::/64", "2001…"},
		{"abc", "…"},
		{"", "…"},
		// The cut moves back to the start of a multi-byte character.
		{"ab€€€€", "ab…"},
	} {
		got := truncateIdentifier(tc.in)
		if got != tc.want {
			t.Errorf("truncate(%q) = %q, want %q", tc.in, got, tc.want)
		}
		if !utf8.ValidString(got) {
			t.Errorf("truncate(%q) = %q is not valid UTF-8", tc.in, got)
		}
	}
}

func TestIdentities_ShownAndLogged(t *testing.T) {
	const id = "sk_live_0123456789abcdef"
	secret := "0123456789abcdef0123"
	fields := func(ids identities) map[string]string {
		m := map[string]string{}
		for _, f := range ids.logFields(id) {
			m[f.Key] = f.String
		}
		return m
	}
	raw := identities{}
	if raw.shown(id) != id || raw.mapper() != nil || raw.hashed() {
		t.Fatal("without a secret, admin output shows identifiers as they are and nothing maps them")
	}
	if got := fields(raw); len(got) != 1 || got["identifier_truncated"] != "sk_liv…" {
		t.Fatalf("default log fields %v", got)
	}
	hashed, err := newIdentities(secret, false)
	if err != nil {
		t.Fatal(err)
	}
	want := identifierHMAC([]byte(secret), id)
	if hashed.shown(id) != want || hashed.mapper()(id) != want {
		t.Fatalf("with a secret, admin output and backends see %q / %q, want the HMAC %q", hashed.shown(id), hashed.mapper()(id), want)
	}
	if got := fields(hashed); len(got) != 1 || got["identifier_hmac"] != want {
		t.Fatalf("hashed log fields %v", got)
	}
	both, err := newIdentities(secret, true)
	if err != nil {
		t.Fatal(err)
	}
	if got := fields(both); len(got) != 2 || got["identifier"] != id || got["identifier_hmac"] != want {
		t.Fatalf("log_identifiers with a secret: %v", got)
	}
	if got := fields(identities{logRaw: true}); len(got) != 1 || got["identifier"] != id {
		t.Fatalf("log_identifiers: %v", got)
	}
}

func TestNewIdentities_ResolvesPlaceholdersAndNeverQuotesTheSecret(t *testing.T) {
	t.Setenv("RL_TEST_SECRET_OK", "a-secret-of-24-bytes-xyz")
	t.Setenv("RL_TEST_SECRET_SHORT", "short-s3cret")
	ids, err := newIdentities("{env.RL_TEST_SECRET_OK}", false)
	if err != nil || string(ids.secret) != "a-secret-of-24-bytes-xyz" {
		t.Fatalf("placeholder: %q, %v", ids.secret, err)
	}
	for _, bad := range []string{"{env.RL_TEST_SECRET_SHORT}", "{env.RL_TEST_SECRET_UNSET}", "short-s3cret"} {
		_, err := newIdentities(bad, false)
		if err == nil {
			t.Fatalf("%s accepted", bad)
		}
		if strings.Contains(err.Error(), "short-s3cret") {
			t.Fatalf("error quotes the secret: %v", err)
		}
	}
	if err := validateSecret("{env.ANYTHING}"); err != nil {
		t.Fatalf("a placeholder is checked at provisioning, not before: %v", err)
	}
	if err := validateSecret("short-s3cret"); err == nil || strings.Contains(err.Error(), "short-s3cret") {
		t.Fatalf("short literal: %v", err)
	}
}

func TestMaskIP(t *testing.T) {
	tests := []struct {
		in     string
		v4, v6 int
		want   string
	}{
		{"192.0.2.17", 32, 64, "192.0.2.17"},
		{"192.0.2.17", 24, 64, "192.0.2.0/24"},
		{"192.0.2.17", 1, 64, "128.0.0.0/1"},
		{"::ffff:192.0.2.17", 32, 64, "192.0.2.17"},
		{"::ffff:192.0.2.17", 16, 64, "192.0.0.0/16"},
		{"2001:db8:aa:bb:cc:dd:ee:ff", 32, 64, "2001:db8:aa:bb::/64"},
		{"2001:DB8::1", 32, 128, "2001:db8::1"},
		{"2001:db8::1", 32, 48, "2001:db8::/48"},
		{"fe80::1%eth0", 32, 64, "fe80::/64"},
		{"fe80::1%eth0", 32, 128, "fe80::1"},
		// A zone that takes the identifier past 64 bytes is dropped too:
		// it was kept, each one a key of its own.
		{"fe80::1%" + strings.Repeat("z", 60), 32, 64, "fe80::/64"},
		{"fe80::1%" + strings.Repeat("z", 60), 32, 128, "fe80::1"},
		{strings.Repeat("0", 61) + "::1", 32, 64, strings.Repeat("0", 61) + "::1"},
		{"api-key-123", 24, 48, "api-key-123"},
		{"deadbeef", 24, 48, "deadbeef"},
		{"1.2.3", 24, 48, "1.2.3"},
		{"1.2.3.04", 24, 48, "1.2.3.04"},
		{"", 24, 48, ""},
		{"::", 32, 64, "::/64"},
	}
	for _, tc := range tests {
		if got := maskIP(tc.in, tc.v4, tc.v6); got != tc.want {
			t.Errorf("maskIP(%q, %d, %d) = %q, want %q", tc.in, tc.v4, tc.v6, got, tc.want)
		}
	}
}

// TestMappedOrigin_PlacesAKeyByItsHMAC: under identifier_secret the engine
// asks the origin it sees for a key's partition (engine.Partitioned), to
// keep the origin's failures per partition; the origin places the key by
// its HMAC, so the answer must be the HMAC's partition, not the raw
// identifier's.
func TestMappedOrigin_PlacesAKeyByItsHMAC(t *testing.T) {
	o, err := origin.New(origin.Config{Redis: []string{"redis://h1:1", "redis://h2:1", "redis://h3:1"}}, origin.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	secret := []byte("0123456789abcdef")
	mapID := func(id string) string { return identifierHMAC(secret, id) }
	var p engine.Partitioned = &mappedOrigin{Origin: o, mapID: mapID}
	if p.Partitions() != 3 {
		t.Fatalf("%d partitions through the mapping; want 3", p.Partitions())
	}
	moved := 0
	for i := range 100 {
		k := engine.Key{Namespace: "z", Identifier: fmt.Sprintf("tenant-%d", i), Window: time.Minute}
		mapped := k
		mapped.Identifier = mapID(k.Identifier)
		if got, want := p.Partition(k), o.Partition(mapped); got != want {
			t.Fatalf("%s: partition %d through the mapping; its HMAC is on %d", k.Identifier, got, want)
		}
		if o.Partition(k) != o.Partition(mapped) {
			moved++
		}
	}
	if moved == 0 {
		t.Fatal("every raw identifier on its HMAC's partition: the test proves nothing")
	}
}
