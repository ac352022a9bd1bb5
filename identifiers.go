package ratelimit

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"strings"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2"
	"github.com/edgelimit/caddy-ratelimit/engine"
	"go.uber.org/zap"
)

// How identifiers appear outside the process. They are often API keys, so
// by default logs never carry them whole; the admin API, an operator's
// tool on a loopback socket, shows them as they are unless an
// identifier_secret asks for HMACs.
const (
	// minSecretLen is the shortest identifier_secret accepted: with fewer
	// than 128 bits of key, the HMAC of a low-entropy identifier (an IPv4
	// address has 32 bits) could be brute-forced secret and all.
	minSecretLen = 16
	// hmacHexLen is how many hex digits of the HMAC-SHA256 stand for an
	// identifier: 128 bits, short enough for a log line, long enough that
	// two identifiers never share one in practice.
	hmacHexLen = 32
	// truncateMax bounds the leading bytes a log keeps of an identifier
	// without a secret; truncateShare keeps at most a quarter, so a short
	// identifier (an IP address) keeps only its first bytes.
	truncateMax   = 8
	truncateShare = 4
)

// identities decides how identifiers are shown in admin output and logs.
// The zero value is the default: admin output raw, logs truncated.
type identities struct {
	// secret keys the HMAC; nil without identifier_secret.
	secret []byte
	// logRaw is log_identifiers: logs carry identifiers whole.
	logRaw bool
}

// newIdentities resolves the app's identifier settings. The secret may be
// a runtime placeholder ({env.…}), resolved here so that the JSON config
// the admin API serves holds only the placeholder. Errors never quote the
// secret.
func newIdentities(secret string, logRaw bool) (identities, error) {
	ids := identities{logRaw: logRaw}
	if secret == "" {
		return ids, nil
	}
	resolved := secret // taken as written without a placeholder, as literal reads it
	if strings.Contains(secret, "{") {
		resolved = caddy.NewReplacer().ReplaceKnown(secret, "")
	}
	if strings.TrimSpace(resolved) == "" {
		return ids, errors.New("identifier_secret is empty once its placeholders are replaced (is the environment variable set?)")
	}
	if len(resolved) < minSecretLen {
		return ids, fmt.Errorf("identifier_secret must be at least %d bytes, got %d", minSecretLen, len(resolved))
	}
	ids.secret = []byte(resolved)
	return ids, nil
}

// identifierHMAC is how an identifier leaves the process when a secret is
// set: the first 128 bits of HMAC-SHA256(secret, identifier), in lower-case
// hex. Every node that shares a backend must use the same secret, so that
// the same identifier maps to the same value everywhere (the Redis keys,
// the admin output and the logs of every node agree).
func identifierHMAC(secret []byte, id string) string {
	m := hmac.New(sha256.New, secret)
	_, _ = io.WriteString(m, id) // a hash never fails to write
	var sum [sha256.Size]byte
	return hex.EncodeToString(m.Sum(sum[:0])[:hmacHexLen/2])
}

// isHMAC reports whether id has the shape of an identifierHMAC: hmacHexLen
// lower-case hex digits.
func isHMAC(id string) bool {
	if len(id) != hmacHexLen {
		return false
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// form names the secret identifiers are HMACs under, "" without one: the
// first 32 bits of an HMAC of a fixed text, enough to tell one secret
// from another without saying anything of it. A runtime override carries
// it (overrideRec.Form).
func (ids identities) form() string {
	if ids.secret == nil {
		return ""
	}
	return "h" + identifierHMAC(ids.secret, "\x00ratelimit identifier form")[:8]
}

// hashed reports whether identifiers are replaced by their HMAC.
func (ids identities) hashed() bool { return ids.secret != nil }

// shown is id as the admin API shows it.
func (ids identities) shown(id string) string {
	if ids.secret != nil {
		return identifierHMAC(ids.secret, id)
	}
	return id
}

// mapper returns the function that replaces identifiers leaving the
// process (for a backend's keys and rows), or nil when identifiers leave
// as they are.
func (ids identities) mapper() func(string) string {
	if ids.secret == nil {
		return nil
	}
	secret := ids.secret
	return func(id string) string { return identifierHMAC(secret, id) }
}

// logFields are the fields that stand for id in a log line: its HMAC with
// a secret, its first bytes without, and the identifier itself only when
// log_identifiers says so.
func (ids identities) logFields(id string) []zap.Field {
	var f []zap.Field
	if ids.logRaw {
		f = append(f, zap.String("identifier", id))
	}
	if ids.secret != nil {
		return append(f, zap.String("identifier_hmac", identifierHMAC(ids.secret, id)))
	}
	if !ids.logRaw {
		f = append(f, zap.String("identifier_truncated", truncateIdentifier(id)))
	}
	return f
}

// truncateIdentifier keeps the first quarter of id, at most truncateMax
// bytes, and marks the cut: "sk_live_9f2c…" shows the kind of key without
// the key. The cut never splits a UTF-8 sequence.
func truncateIdentifier(id string) string {
	n := min(len(id)/truncateShare, truncateMax)
	for n > 0 && n < len(id) && id[n]&0xC0 == 0x80 {
		n--
	}
	return id[:n] + "…"
}

// maskIP masks id to its network prefix when it is an IP address and
// returns it unchanged otherwise. An IPv4 address kept whole is returned as
// the address; a masked one as "addr/bits". IPv4-mapped IPv6 addresses count
// as IPv4.
func maskIP(id string, v4, v6 int) string {
	if v4 >= 32 && strings.IndexByte(id, ':') < 0 {
		// Without a colon id can only be an IPv4 address (kept whole) or
		// no address at all: returned as it is either way, without parsing.
		return id
	}
	if !maybeIP(id) {
		return id
	}
	addr, err := netip.ParseAddr(id)
	if err != nil {
		return id
	}
	canonical := !addr.Is4In6() && addr.Zone() == ""
	addr = addr.Unmap().WithZone("")
	bits := v6
	if addr.Is4() {
		bits = v4
	}
	if bits >= addr.BitLen() {
		if canonical && addr.Is4() {
			return id // ParseAddr accepts only the canonical dotted quad
		}
		return addr.String()
	}
	p, err := addr.Prefix(bits)
	if err != nil {
		return id
	}
	return p.String()
}

// maybeIP is a cheap filter that keeps non-IP keys (API keys, tenants) away
// from netip.ParseAddr, whose error would cost an allocation per request.
func maybeIP(s string) bool {
	if len(s) < 2 || len(s) > 64 && strings.IndexByte(s[:64], '%') < 0 {
		// No address is over 64 bytes; the zone after an IPv6 address's
		// '%' may be, and is dropped however long it is.
		return false
	}
	sep := false
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '.' || c == ':':
			sep = true
		case c >= '0' && c <= '9', c >= 'a' && c <= 'f', c >= 'A' && c <= 'F':
		case c == '%':
			return sep // an IPv6 zone follows
		default:
			return false
		}
	}
	return sep
}

// mappedOrigin replaces identifiers by their HMAC on their way to the
// origin (identifier_secret), so Redis keys never hold a raw identifier.
type mappedOrigin struct {
	engine.Origin
	mapID func(string) string
}

func (m *mappedOrigin) Read(ctx context.Context, key engine.Key, seq int64, inc uint32) (engine.Totals, error) {
	key.Identifier = m.mapID(key.Identifier)
	return m.Origin.Read(ctx, key, seq, inc)
}

func (m *mappedOrigin) Reserve(ctx context.Context, r *engine.Reservation) error {
	raw := r.Key.Identifier
	r.Key.Identifier = m.mapID(raw)
	err := m.Origin.Reserve(ctx, r)
	r.Key.Identifier = raw
	return err
}

// Partitions and Partition are the origin's (engine.Partitioned): a key
// is placed by its HMAC, as the origin sees it.
func (m *mappedOrigin) Partitions() int {
	if p, ok := m.Origin.(engine.Partitioned); ok {
		return p.Partitions()
	}
	return 1
}

func (m *mappedOrigin) Partition(key engine.Key) int {
	p, ok := m.Origin.(engine.Partitioned)
	if !ok || p.Partitions() == 1 {
		return 0
	}
	key.Identifier = m.mapID(key.Identifier)
	return p.Partition(key)
}

func (m *mappedOrigin) Flush(ctx context.Context, batch []engine.Delta) error {
	raw := make([]string, len(batch))
	for i := range batch {
		raw[i] = batch[i].Key.Identifier
		batch[i].Key.Identifier = m.mapID(raw[i])
	}
	err := m.Origin.Flush(ctx, batch)
	for i := range batch {
		batch[i].Key.Identifier = raw[i]
	}
	return err
}

// shownID is how an admin answer names an identifier: as text, and, when
// it is not valid UTF-8, also as the hex of its bytes. JSON shows each
// byte of a malformed sequence as U+FFFD, so two identifiers that differ
// only there would otherwise look alike.
type shownID struct {
	Identifier    string `json:"identifier"`
	IdentifierHex string `json:"identifier_hex,omitempty"`
}

// showID is the shownID of id, as it is shown (ids.shown).
func showID(id string) shownID {
	s := shownID{Identifier: id}
	if !utf8.ValidString(id) {
		s.IdentifierHex = hex.EncodeToString([]byte(id))
	}
	return s
}
