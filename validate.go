package ratelimit

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"

	"github.com/edgelimit/caddy-ratelimit/origin"
)

// Validation: the checks a handler's and the app's settings go through. The
// Caddyfile parser calls the same validators line by line (so `caddy adapt`
// names the line), and Validate calls them again for JSON configs, which
// the parser never sees.

// Validate checks the configuration; it is also what rejects a bad JSON
// config, since the Caddyfile parser's checks do not run on JSON.
func (h *Handler) Validate() error {
	if len(h.Zones) == 0 {
		return errors.New("ratelimit: at least one zone is required")
	}
	if len(h.Zones) > maxZones {
		return fmt.Errorf("ratelimit: %d zones: one handler takes at most %d zones", len(h.Zones), maxZones)
	}
	if err := validateHeaders(h.Headers); err != nil {
		return fmt.Errorf("ratelimit: %w", err)
	}
	if err := validateOnMissingKey(h.OnMissingKey); err != nil {
		return fmt.Errorf("ratelimit: %w", err)
	}
	if err := validateRetryJitter(time.Duration(h.RetryJitter)); err != nil {
		return fmt.Errorf("ratelimit: %w", err)
	}
	seen := make(map[string]struct{}, len(h.Zones))
	for i, z := range h.Zones {
		if z == nil {
			return fmt.Errorf("ratelimit: zone %d is null", i)
		}
		if _, dup := seen[z.Name]; dup {
			return fmt.Errorf("ratelimit: zone %q defined twice in one handler", z.Name)
		}
		seen[z.Name] = struct{}{}
		if err := z.validate(); err != nil {
			return fmt.Errorf("ratelimit: zone %q: %w", z.Name, err)
		}
	}
	return nil
}

func (z *Zone) validate() error {
	if err := validateZoneName(z.Name); err != nil {
		return err
	}
	if z.Key == "" {
		return errors.New("missing key")
	}
	if err := validatePlaceholders("key", z.Key); err != nil {
		return err
	}
	if _, err := keyGlue(z.Key); err != nil {
		return err
	}
	if err := validateNoShorthand("key", z.Key); err != nil {
		return err
	}
	if err := validateLimit(z.Limit); err != nil {
		return err
	}
	if err := validateWindow(time.Duration(z.Window)); err != nil {
		return err
	}
	if err := validateCost(string(z.Cost)); err != nil {
		return err
	}
	if err := validateNoShorthand("cost", string(z.Cost)); err != nil {
		return err
	}
	if z.DefaultCost < 0 {
		return fmt.Errorf("default_cost %d is negative", z.DefaultCost)
	}
	if err := validateUnits("default_cost", z.DefaultCost); err != nil {
		return err
	}
	if z.DefaultCost != 0 && !strings.ContainsAny(string(z.Cost), "{}") {
		return fmt.Errorf("default_cost is for a cost placeholder; cost %q is a constant, charged as written (1 when not given)", string(z.Cost))
	}
	if z.MinCost != nil {
		if err := validateCostBound("min_cost", *z.MinCost); err != nil {
			return err
		}
	}
	if z.MaxCost != nil {
		if err := validateCostBound("max_cost", *z.MaxCost); err != nil {
			return err
		}
	}
	if err := z.validateCostBounds("default_cost"); err != nil {
		return err
	}
	v4, v6 := z.prefixes()
	for id, l := range z.Overrides {
		if err := validateOverride(id, l); err != nil {
			return err
		}
		if err := validateOverrideForKey(id, z.Key, v4, v6); err != nil {
			return err
		}
	}
	if z.IPv4Prefix != 0 {
		if err := validateIPPrefix("ipv4_prefix", z.IPv4Prefix, 32); err != nil {
			return err
		}
	}
	if z.IPv6Prefix != 0 {
		if err := validateIPPrefix("ipv6_prefix", z.IPv6Prefix, 128); err != nil {
			return err
		}
	}
	return nil
}

// The validators below are shared by Validate and the Caddyfile parser, so
// both say the same thing.

// validateZoneName checks a zone name: it travels in headers (quoted
// without escaping), origin keys and metric labels.
func validateZoneName(name string) error {
	if name == "" {
		return errors.New("zone name is empty")
	}
	return validateName("zone name", name)
}

// validateRegion checks a region name; empty is a single-region setup.
func validateRegion(region string) error {
	if region == "" {
		return nil
	}
	return validateName("region", region)
}

// validateName checks a zone or region name (what says which): at most
// maxZoneName bytes of letters, digits, '_', '-' and '.'.
func validateName(what, name string) error {
	if len(name) > maxZoneName {
		return fmt.Errorf("%s %q is longer than %d bytes", what, name, maxZoneName)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-' || c == '.') {
			return fmt.Errorf("%s %q: only letters, digits, '_', '-' and '.' are allowed", what, name)
		}
	}
	return nil
}

func validateLimit(limit int64) error {
	if limit <= 0 {
		return fmt.Errorf("limit must be positive, got %d", limit)
	}
	return validateUnits("limit", limit)
}

// validateUnits rejects a limit or cost (what says which) above maxUnits.
func validateUnits(what string, n int64) error {
	if n > maxUnits {
		return fmt.Errorf("%s %d is above the largest count, %d (2^53-1)", what, n, int64(maxUnits))
	}
	return nil
}

func validateWindow(w time.Duration) error {
	if w < minWindow {
		return fmt.Errorf("window must be at least %s, got %s", minWindow, w)
	}
	if w > maxWindow {
		return fmt.Errorf("window must be at most %s (3650d), got %s", maxWindow, w)
	}
	if w%time.Second != 0 {
		return fmt.Errorf("window must be a whole number of seconds, got %s", w)
	}
	return nil
}

// validateCost checks a cost: empty, an integer, or one placeholder alone.
// Text beside a placeholder is kept by the replacer: `5{x}` charges 50
// when x is 0, and `{x}x` is never an integer, every request charged the
// default cost.
func validateCost(cost string) error {
	if strings.ContainsAny(cost, "{}") {
		if err := validatePlaceholders("cost", cost); err != nil {
			return err
		}
		switch first := firstPlaceholder(cost); first {
		case cost:
			return nil
		case "": // escaped braces only: text, checked as an integer below
		default:
			return fmt.Errorf("cost %q is neither an integer nor one placeholder: text beside a placeholder makes the cost another number or none; write the placeholder alone, %s (a map can compute a cost from several values)", cost, first)
		}
	}
	if cost == "" {
		return nil
	}
	n, err := strconv.ParseInt(cost, 10, 64)
	switch {
	case errors.Is(err, strconv.ErrRange) && n > 0:
		return fmt.Errorf("cost %s is above the largest count, %d (2^53-1)", cost, int64(maxUnits))
	case err != nil || n < 0:
		return fmt.Errorf("cost %q is neither a non-negative integer nor a placeholder", cost)
	}
	return validateUnits("cost", n)
}

// validatePlaceholders rejects a key or cost (what says which) whose
// braces do not pair up: Caddy's replacer leaves an unclosed placeholder
// as text, so `{api_cost` would be a constant that never parses (every
// request charged the default cost) and `{http.request.header.X-Key` one
// bucket for everyone.
//
// It also rejects a placeholder that names nothing: `{}`, or a name whose
// last field is empty (`{http.request.header.}`, what `{header.}` expands
// to, `{query.}`): Caddy reads a header, query argument or cookie of no
// name, empty for every request, so the key is one count shared by every
// client under the default on_missing_key, and the cost always the
// default.
func validatePlaceholders(what, v string) error {
	open, start := false, 0
	for i := 0; i < len(v); i++ {
		switch v[i] {
		case '\\':
			i++ // an escaped brace is text
		case '{':
			if open {
				return fmt.Errorf("%s %q opens a placeholder inside another", what, v)
			}
			open, start = true, i
		case '}':
			if !open {
				return fmt.Errorf("%s %q closes a placeholder it never opened (a '}' without its '{')", what, v)
			}
			open = false
			if name := v[start+1 : i]; name == "" || strings.HasSuffix(name, ".") {
				return fmt.Errorf("%s %q has a placeholder %s that names no field: it is empty for every request", what, v, v[start:i+1])
			}
			if err := validatePlaceholderName(v[start+1 : i]); err != "" {
				return fmt.Errorf("%s %q has a placeholder %s %s: it is empty for every request%s", what, v, v[start:i+1], err, writeHeader(v[start+1:i]))
			}
		}
	}
	if open {
		return fmt.Errorf("%s %q has an unclosed placeholder (a '{' without its '}')", what, v)
	}
	return nil
}

// firstPlaceholder is v's first placeholder, braces included, or "" when
// v has none (an escaped brace is text). v's braces pair up.
func firstPlaceholder(v string) string {
	start := -1
	for i := 0; i < len(v); i++ {
		switch v[i] {
		case '\\':
			i++
		case '{':
			start = i
		case '}':
			return v[start : i+1]
		}
	}
	return ""
}

// validatePlaceholderName says why a placeholder of that name is empty
// for every request, "" when it may not be: whitespace in the name, which
// no placeholder has (`{client_ip }`), a header of no name
// (`{http.request.header}`), or a header name no request has (RFC 9110
// field names are tokens: `{http.request.header.X:Key}`). Other unknown
// names are left alone: map and vars make their own (`{header.X.Key}`,
// which the Caddyfile does not expand, may be a map's output).
func validatePlaceholderName(name string) string {
	const header, short = "http.request.header", "header"
	switch {
	case strings.IndexFunc(name, unicode.IsSpace) >= 0:
		return "with whitespace in its name, which no placeholder has"
	case name == header || name == short:
		return "that names no field"
	}
	field, ok := strings.CutPrefix(name, header+".")
	if !ok {
		field, ok = strings.CutPrefix(name, short+".")
	}
	switch {
	case !ok:
		return ""
	case !isToken(field):
		return fmt.Sprintf("whose header name %q is no HTTP field name (RFC 9110: letters, digits and !#$%%&'*+-.^_`|~), which no request has", field)
	case isMovedHeader(field):
		// Until 2026-11-29 {header.Host} was accepted, and every client
		// shared the count of the empty key (an audit;
		// `go test -run 'Golden/err_key_header_host' .`).
		return fmt.Sprintf("of the header %q, which Go's HTTP server takes out of the request's header fields", field)
	}
	return ""
}

// isMovedHeader says whether Go's HTTP server takes the header field out
// of a request's header map (Host into Request.Host; Transfer-Encoding and
// Trailer into the body's framing), so that a placeholder of it is empty.
func isMovedHeader(field string) bool {
	return strings.EqualFold(field, "Host") || strings.EqualFold(field, "Transfer-Encoding") || strings.EqualFold(field, "Trailer")
}

// writeHeader is the advice after validatePlaceholderName's reason: the
// placeholder to write, for a header of no name or the Host header.
func writeHeader(name string) string {
	if name == "http.request.header" || name == "header" {
		return "; write {http.request.header.NAME}"
	}
	for _, p := range []string{"http.request.header.", "header."} {
		if f, ok := strings.CutPrefix(name, p); ok && strings.EqualFold(f, "Host") {
			return "; write {http.request.host} (the host without the port) or {http.request.hostport}"
		}
	}
	return ""
}

// isToken says whether s is an RFC 9110 token, what a field name is.
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}

// validateNoShorthand rejects a key or cost (what says which) that uses a
// Caddyfile shorthand such as {remote_host}. The Caddyfile adapter expands
// them, so only a JSON config can hold one, and Caddy's replacer knows
// none: the key would be empty for every request (one count shared by
// every client), the cost always the default.
func validateNoShorthand(what, v string) error {
	if !strings.Contains(v, "{") {
		return nil
	}
	// {file.NAME} is also Caddy's placeholder of a file's contents, which
	// the replacer knows: it is left as it is.
	const file = "{file."
	masked := strings.ReplaceAll(v, file, "\x00file.")
	seg := caddyfile.Segment{{Text: masked}}
	httpcaddyfile.NewShorthandReplacer().ApplyToSegment(&seg)
	if full := seg[0].Text; full != masked {
		return fmt.Errorf("%s %q uses a Caddyfile shorthand, which only the Caddyfile adapter expands: in JSON write %s",
			what, v, strings.ReplaceAll(full, "\x00file.", file))
	}
	return nil
}

// validateCostBound checks min_cost or max_cost (what says which) alone.
func validateCostBound(what string, n int64) error {
	if n < 0 {
		return fmt.Errorf("%s %d is negative", what, n)
	}
	return validateUnits(what, n)
}

// validateCostBounds checks what a zone's cost settings say together, each
// one having passed its own check; dflt is what the default cost is called
// where it is written. min_cost must not exceed max_cost. With a
// placeholder, the default cost must lie within them: it is charged as it
// is, so a default outside the bounds would be a way around them. A
// constant cost is charged as written, not clamped (a constant 0 is a zone
// that only reads), but one outside a bound the config writes contradicts
// it: the operator meant one of the two, and the config cannot say which.
func (z *Zone) validateCostBounds(dflt string) error {
	lo, hi := z.costBounds()
	switch {
	case lo <= hi:
	case z.MinCost == nil:
		return fmt.Errorf("max_cost %d is below min_cost, which is %d when not given", hi, lo)
	default:
		return fmt.Errorf("min_cost %d is above max_cost %d", lo, hi)
	}
	if cost := string(z.Cost); cost == "" || !strings.ContainsAny(cost, "{}") {
		n := int64(defaultCost)
		if cost != "" {
			n, _ = strconv.ParseInt(cost, 10, 64) // checked by validateCost
		}
		switch {
		case z.MinCost != nil && n < lo:
			return fmt.Errorf("constant cost %d is below min_cost %d: the bounds apply to a cost placeholder, a constant cost is charged as written", n, lo)
		case z.MaxCost != nil && n > hi:
			return fmt.Errorf("constant cost %d is above max_cost %d: the bounds apply to a cost placeholder, a constant cost is charged as written", n, hi)
		}
		return nil
	}
	d := z.defaultCost()
	switch {
	case hi == 0:
		return errors.New("max_cost 0 leaves no room for the default cost (at least 1): a zone that charges nothing has the constant cost 0")
	case d >= lo && d <= hi:
		return nil
	case z.DefaultCost == 0:
		return fmt.Errorf("%s, %d when not given, is outside [min_cost %d, max_cost %d]: give one within them", dflt, d, lo, hi)
	}
	return fmt.Errorf("%s %d is outside [min_cost %d, max_cost %d]", dflt, d, lo, hi)
}

func validateOverride(id string, limit int64) error {
	if id == "" {
		return errors.New("override with an empty identifier")
	}
	if hasPlaceholder(id) {
		// Compared with the request's identifier as written: a placeholder
		// here is never replaced, and the override would never match.
		return fmt.Errorf("override %q: an override's identifier is compared as written, so a placeholder in it is never replaced; write the identifier itself ({$VAR} is replaced when the Caddyfile is adapted), or set a runtime override through the admin API", id)
	}
	if limit < 0 {
		return fmt.Errorf("override %q: limit must not be negative, got %d", id, limit)
	}
	if err := validateUnits("limit", limit); err != nil {
		return fmt.Errorf("override %q: %w", id, err)
	}
	return nil
}

// hasPlaceholder reports whether s holds what Caddy's replacer takes for a
// placeholder: a '{', a name, then a '}'.
func hasPlaceholder(s string) bool {
	for {
		i := strings.IndexByte(s, '{')
		if i < 0 {
			return false
		}
		s = s[i+1:]
		j := strings.IndexAny(s, "{}")
		if j > 0 && s[j] == '}' {
			return true
		}
	}
}

// validateOverrideForKey rejects an override that the zone's key never
// makes. A composite key masks each value, never the whole identifier,
// which may then look like an address ("3A::A") without being one.
func validateOverrideForKey(id, key string, v4, v6 int) error {
	if glue, err := keyGlue(key); err == nil && glue != nil {
		return validateOverrideKey(id, key, v4, v6)
	}
	if first, last, ok := keyTextAround(key); ok && first+last != "" {
		// One placeholder with text around it: the value between the
		// texts is masked as a key of the placeholder alone is.
		v, ok := between(id, first, last)
		if !ok {
			return fmt.Errorf("override %q never matches under key %q: the key's text around its placeholder is not there", id, key)
		}
		if v == "" {
			return fmt.Errorf("override %q never matches under key %q: its value is empty, which is a missing key", id, key)
		}
		if err := validateOverrideIP(v, v4, v6, holdsAddress(keyPlaceholders(key)[0])); err != nil {
			return fmt.Errorf("override %q never matches under key %q: the value: %w", id, key, err)
		}
		return nil
	}
	t := newTemplate(key)
	return validateOverrideIP(id, v4, v6, t.single != "" && holdsAddress(t.single))
}

// holdsAddress says whether the placeholder name always holds an IP
// address as netip writes it: Caddy's client_ip is a parsed address (or
// "@" from a unix socket, or empty, a missing key).
func holdsAddress(name string) bool {
	return name == "http.vars.client_ip"
}

// keyPlaceholders returns the names of key's placeholders in order, nil
// for a key Caddy's replacer cannot parse.
func keyPlaceholders(key string) []string {
	var names []string
	_, err := caddy.NewReplacer().ReplaceFunc(key, func(name string, _ any) (any, error) {
		names = append(names, name)
		return "", nil
	})
	if err != nil {
		return nil
	}
	return names
}

// keyTextAround returns the texts before and after the placeholder of a
// key of exactly one placeholder, ok false for any other key.
func keyTextAround(key string) (first, last string, ok bool) {
	texts := keyTexts(key)
	if len(texts) != 2 {
		return "", "", false
	}
	return texts[0], texts[1], true
}

// keyTexts returns the texts of key around and between its placeholders,
// one more than it has placeholders, or nil for a key Caddy's replacer
// cannot parse or with a NUL byte (the mark that finds the placeholders
// here; keyGlue refuses it).
func keyTexts(key string) []string {
	const mark = "\x00"
	if strings.Contains(key, mark) {
		return nil
	}
	marked, err := caddy.NewReplacer().ReplaceFunc(key, func(string, any) (any, error) { return mark, nil })
	if err != nil {
		return nil
	}
	return strings.Split(marked, mark)
}

// validateOverrideKey rejects an override that the composite key never
// makes (keyParts): there each placeholder's value is written with '%'
// and the first byte of every text between placeholders as %XX, so an
// override holding them raw inside a value (an IPv6 address under
// "{client_ip}:{…}", a '%') is compared and never equal, and so is one
// whose value is an address in another form than the zone masks it to
// (validateOverrideIP). A key of fewer
// than two placeholders escapes nothing and takes any override.
func validateOverrideKey(id, key string, v4, v6 int) error {
	glue, err := keyGlue(key)
	if err != nil || glue == nil {
		return nil // a bad key is reported as such
	}
	texts := keyTexts(key)
	if texts == nil {
		return nil
	}
	var escape [256]bool
	for _, c := range glue {
		escape[c] = true
	}
	never := func(why string) error {
		return fmt.Errorf("override %q never matches under key %q: %s; in a value, write '%%' and the first byte of each text between placeholders as %%XX (':' is %%3A)", id, key, why)
	}
	values, why := splitKeyID(id, texts, &escape)
	if why != "" {
		return never(why)
	}
	names := keyPlaceholders(key)
	present := false
	for i, v := range values {
		present = present || v != ""
		// A value that is an address is masked as a key of one
		// placeholder is: the same forms are written.
		addr := i < len(names) && holdsAddress(names[i]) && v != ""
		if err := validateOverrideIP(unescapeValue(v), v4, v6, addr); err != nil {
			return fmt.Errorf("override %q never matches under key %q: a value: %w", id, key, err)
		}
	}
	if !present {
		return never("every value is empty, which is a missing key")
	}
	return nil
}

// between returns what id holds between first and last, ok false when
// it does not begin with first and end with last after it.
func between(id, first, last string) (string, bool) {
	rest, ok := strings.CutPrefix(id, first)
	if !ok {
		return "", false
	}
	return strings.CutSuffix(rest, last)
}

// splitKeyID returns the values, still escaped, that id holds between
// the texts of a composite key (texts[0] before its first placeholder,
// texts[len-1] after its last) which escapes the bytes escape marks, or
// why id is no identifier that key writes.
func splitKeyID(id string, texts []string, escape *[256]bool) (values []string, why string) {
	rest, ok := between(id, texts[0], texts[len(texts)-1])
	if !ok {
		return nil, "the key's text around its placeholders is not there"
	}
	seps := texts[1 : len(texts)-1]
	for i := 0; ; i++ {
		// The value runs to the next raw byte the key escapes: the
		// separator that ends it, or, after the last one, none.
		j := 0
		for j < len(rest) && (rest[j] == '%' || !escape[rest[j]]) {
			if rest[j] == '%' {
				if j+2 >= len(rest) || !isUpperHex(rest[j+1]) || !isUpperHex(rest[j+2]) || !escape[unhex(rest[j+1])<<4|unhex(rest[j+2])] {
					return nil, "a '%' in a value is not the %XX of a byte the key escapes"
				}
				j += 2
			}
			j++
		}
		values = append(values, rest[:j])
		if i == len(seps) {
			if j < len(rest) {
				return nil, "a value holds a separator raw"
			}
			return values, ""
		}
		if !strings.HasPrefix(rest[j:], seps[i]) {
			return nil, "a value holds a separator raw"
		}
		rest = rest[j+len(seps[i]):]
	}
}

// maskKeyID is id, an identifier an operator names, as the zone's key
// writes it (template.evalKey): each placeholder's value that is an IP
// address masked to the zone's prefix, the whole identifier under a key
// of one placeholder, each value under a key with text around its
// placeholders or of several (escaped as the key escapes it). An id the
// key never writes is returned as it is, for validateOverrideForKey to
// refuse.
func maskKeyID(id, key string, v4, v6 int) string {
	t := newKeyTemplate(key)
	switch {
	case id == "" || t.literal:
		return id
	case t.parts == nil:
		return maskIP(id, v4, v6)
	}
	texts := keyTexts(key)
	var values []string
	switch {
	case texts == nil:
		return id
	case len(texts) == 2:
		// One placeholder: its value is written raw, whatever it holds.
		v, ok := between(id, texts[0], texts[1])
		if !ok {
			return id
		}
		values = []string{v}
	default:
		if values, _ = splitKeyID(id, texts, &t.parts.escape); values == nil {
			return id
		}
	}
	b := []byte(texts[0])
	for i, v := range values {
		if v != "" {
			v = t.parts.escapeValue(maskIP(unescapeValue(v), v4, v6))
		}
		b = append(append(b, v...), texts[i+1]...)
	}
	return string(b)
}

// unescapeValue undoes escapeValue on a value validateOverrideKey checked.
func unescapeValue(v string) string {
	if !strings.Contains(v, "%") {
		return v
	}
	b := make([]byte, 0, len(v))
	for i := 0; i < len(v); i++ {
		if v[i] == '%' {
			b = append(b, unhex(v[i+1])<<4|unhex(v[i+2]))
			i += 2
			continue
		}
		b = append(b, v[i])
	}
	return string(b)
}

func isUpperHex(c byte) bool { return c >= '0' && c <= '9' || c >= 'A' && c <= 'F' }

func unhex(c byte) byte {
	if c >= 'A' {
		return c - 'A' + 10
	}
	return c - '0'
}

// validateOverrideIP rejects an override of an IP address or prefix
// that no request's identifier can equal: the handler compares an
// override with the identifier masked to the zone's prefix, as
// netip writes it (203.0.113.0/24 under ipv4_prefix 24, 2001:db8:1:2::/64
// under the default ipv6_prefix, a whole IPv4 address as it is). Any other
// form of an address (one address under a shorter prefix, a prefix of
// another length, upper-case hex, an IPv4-mapped address) would be
// accepted and never match. When addr says that the key's placeholder
// always holds an address ({client_ip}), an address written in a form
// netip does not parse (01.2.3.4, 1.2.3.0/024, a zone, a space, 127.1)
// never matches either; other text is left as it is.
func validateOverrideIP(id string, v4, v6 int, addr bool) error {
	if p, err := netip.ParsePrefix(id); err == nil {
		bits, family := v6, "IPv6"
		if p.Addr().Is4() {
			bits, family = v4, "IPv4"
		}
		switch {
		case p.Bits() >= p.Addr().BitLen() && bits >= p.Addr().BitLen():
			return fmt.Errorf("override %q never matches: a whole address is written without a prefix, %s", id, p.Addr().Unmap())
		case p.Bits() != bits:
			return fmt.Errorf("override %q: the zone counts %s addresses by /%d, so a /%d never matches: write one override per /%d", id, family, bits, p.Bits(), bits)
		case p.Masked().String() != id:
			return fmt.Errorf("override %q never matches: the zone's identifiers are written %s", id, p.Masked())
		}
		return nil
	}
	if _, err := netip.ParseAddr(id); err != nil {
		if !addr || !addressLike(id) {
			return nil // not an address: compared as it is
		}
		return notAnAddress(id, v4, v6)
	}
	if m := maskIP(id, v4, v6); m != id {
		return fmt.Errorf("override %q never matches: the zone counts this address as %s (ipv4_prefix %d, ipv6_prefix %d); write that", id, m, v4, v6)
	}
	return nil
}

// addressLike says whether id, spaces around it, brackets around an IPv6
// address (as in a URL: [::1]) and an IPv6 zone aside, is made of what
// addresses and prefixes are: hex digits, '.', ':' and '/', with a '.' or
// ':'. A bracketed address was compared as text, and never matched
// (`override "[::1]" 1` under {client_ip}, in an audit).
func addressLike(id string) bool {
	s, _, _ := strings.Cut(unbracket(strings.TrimSpace(id)), "%")
	sep := false
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '.' || c == ':':
			sep = true
		case c == '/', c >= '0' && c <= '9', c >= 'a' && c <= 'f', c >= 'A' && c <= 'F':
		default:
			return false
		}
	}
	return sep
}

// notAnAddress is the error of an override that is no address or prefix
// netip parses, under a key that holds an address: it names the form to
// write when id is one written loosely (leading zeros, an IPv6 zone, a
// trailing '/', spaces around it), and the zone's forms otherwise.
func notAnAddress(id string, v4, v6 int) error {
	forms := fmt.Sprintf("a prefix's first address with /%d (IPv4) or /%d (IPv6), in lower case, or a whole address without a prefix", v4, v6)
	if w := looseAddress(id, v4, v6); w != "" {
		return fmt.Errorf("override %q never matches: the zone's key holds an IP address, written %s; write %s", id, forms, w)
	}
	return fmt.Errorf("override %q never matches: the zone's key holds an IP address, and this is no address netip parses; write %s", id, forms)
}

// looseAddress reads id as an address or prefix written loosely, and
// returns it as the zone writes it, or "" when it is none or would not
// match in any form.
func looseAddress(id string, v4, v6 int) string {
	s := unbracket(strings.TrimSpace(id))
	bits := -1
	if a, b, ok := strings.Cut(s, "/"); ok {
		b, _, _ = strings.Cut(b, "%") // a zone after the prefix
		if b != "" {
			n, err := strconv.Atoi(b)
			if err != nil || n < 0 {
				return ""
			}
			bits = n
		}
		s = a
	}
	s, _, _ = strings.Cut(s, "%")
	a, err := netip.ParseAddr(s)
	if err != nil {
		if a, err = parseZeroPaddedIPv4(s); err != nil {
			return ""
		}
	}
	w := a.String()
	if bits >= 0 && bits < a.BitLen() {
		p, err := a.Prefix(bits)
		if err != nil {
			return ""
		}
		w = p.String()
	} else if bits < 0 {
		w = maskIP(w, v4, v6) // one address: the zone counts its prefix
	}
	if validateOverrideIP(w, v4, v6, true) != nil {
		return ""
	}
	return w
}

// unbracket takes the brackets off an address written as in a URL,
// "[::1]" or "[2001:db8::]/64"; other text is returned as it is.
func unbracket(s string) string {
	if inner, ok := strings.CutPrefix(s, "["); ok {
		if addr, after, ok := strings.Cut(inner, "]"); ok && (after == "" || after[0] == '/') {
			return addr + after
		}
	}
	return s
}

// parseZeroPaddedIPv4 parses a dotted quad whose parts may have leading
// zeros, read as decimal (netip refuses them).
func parseZeroPaddedIPv4(s string) (netip.Addr, error) {
	parts := strings.Split(s, ".")
	if len(parts) != 4 {
		return netip.Addr{}, errors.New("not a dotted quad")
	}
	var b [4]byte
	for i, p := range parts {
		n, err := strconv.ParseUint(p, 10, 8)
		if err != nil || p == "" || len(p) > 3 {
			return netip.Addr{}, errors.New("not a dotted quad")
		}
		b[i] = byte(n)
	}
	return netip.AddrFrom4(b), nil
}

// validateIPPrefix checks an IP prefix length (ipv4_prefix, ipv6_prefix);
// not to be confused with the origin's key prefix.
func validateIPPrefix(name string, bits, max int) error {
	if bits < 1 || bits > max {
		return fmt.Errorf("%s must be between 1 and %d, got %d", name, max, bits)
	}
	return nil
}

// validateRetryJitter bounds retry_jitter: never negative (it only ever
// adds), at most maxRetryJitter, so that the wait it adds to can never
// overflow.
func validateRetryJitter(j time.Duration) error {
	switch {
	case j < 0:
		return fmt.Errorf("retry_jitter %s is negative", j)
	case j > maxRetryJitter:
		return fmt.Errorf("retry_jitter %s is above %s", j, maxRetryJitter)
	}
	return nil
}

func validateHeaders(mode string) error {
	switch mode {
	case "", headersDraft, headersLegacy, headersBoth, headersOff:
		return nil
	}
	return fmt.Errorf("headers must be draft, legacy, both or off, got %q", mode)
}

func validateOnMissingKey(mode string) error {
	switch mode {
	case "", missingShared, missingSkip, missingDeny:
		return nil
	}
	return fmt.Errorf("on_missing_key must be shared, skip or deny, got %q", mode)
}

// validateSecret rejects a literal identifier_secret that is too short; a
// placeholder is checked once resolved, at provisioning.
func validateSecret(secret string) error {
	v, ok := literal(secret)
	if secret == "" {
		return nil
	}
	if !ok {
		return loadable("identifier_secret", secret)
	}
	if len(v) < minSecretLen {
		return fmt.Errorf("identifier_secret must be at least %d bytes, got %d", minSecretLen, len(v))
	}
	return nil
}

// literal returns a setting that may hold runtime placeholders
// ({env.REDIS_URL}) as provisioning will see it when it holds none (Caddy's
// replacer unescapes \{ and \} in a value with a '{'), and ok false when it
// holds one, whose value is known only then. A '{' alone opens no
// placeholder: "{0" is a literal of two bytes, checked at adapt, where the
// error names the line, and not let through to fail at provisioning
// without one (FuzzCaddyfile_WhatAdaptsValidates).
func literal(s string) (v string, ok bool) {
	if !strings.Contains(s, "{") {
		return s, true
	}
	v, err := caddy.NewEmptyReplacer().ReplaceOrErr(s, false, true)
	return v, err == nil
}

// loadable checks that each placeholder of field's value s is one Caddy
// resolves when it loads the config: {env.NAME}, {file.PATH}, or one of
// its global ones ({system.hostname}). Any other ({0}, a request's
// {http.request.header.X}) never resolves there, and failed only then,
// with no line (FuzzCaddyfile_WhatAdaptsValidates). The error names the
// placeholder, never the value: it may be a password's.
func loadable(field, s string) error {
	// Past 100 braces that close nothing Caddy's replacer gives up on the
	// whole value, and provisioning read it as empty ("is the environment
	// variable set?"), with no line.
	if _, err := caddy.NewEmptyReplacer().ReplaceOrErr(s, false, false); err != nil {
		return fmt.Errorf("%s: %v (more than 100 '{' that no '}' closes): write a literal brace as \\{", field, err)
	}
	var bad *string // {} is one too
	r := caddy.NewEmptyReplacer()
	r.Map(func(key string) (any, bool) {
		named := func(prefix string) bool { return strings.HasPrefix(key, prefix) && len(key) > len(prefix) }
		if bad != nil || named("env.") || named("file.") { // a file is read when the config loads, not now
			return "", true
		}
		if _, known := caddy.NewReplacer().Get(key); !known {
			bad = &key
		}
		return "", true
	})
	r.ReplaceAll(s, "")
	if bad != nil {
		bad := *bad
		if len(bad) > 64 {
			bad = bad[:64] + "…"
		}
		return fmt.Errorf("%s: {%s} is no placeholder Caddy resolves when it loads the config: use {env.NAME} or {file.PATH}", field, bad)
	}
	return nil
}

// checkOrigin validates settings whose addresses may still hold runtime
// placeholders: those are checked once resolved, at provisioning.
func checkOrigin(c origin.Config) error {
	var err error
	stand := func(field, s, placeholder string) string {
		v, ok := literal(s)
		if !ok {
			v = placeholder
			err = cmp.Or(err, loadable(field, s))
		}
		return v
	}
	standAll := func(field string, in []string) []string {
		out := make([]string, len(in))
		for i, s := range in {
			out[i] = stand(field, s, "redis://placeholder.invalid:6379")
		}
		return out
	}
	c.Redis = standAll("redis", c.Redis)
	if c.Cluster != nil {
		cl := *c.Cluster
		cl.Addrs = standAll("redis_cluster", cl.Addrs)
		c.Cluster = &cl
	}
	if c.Sentinel != nil {
		s := *c.Sentinel
		s.Addrs = standAll("redis_sentinel", s.Addrs)
		s.SentinelPassword = stand("redis_sentinel password", s.SentinelPassword, "")
		c.Sentinel = &s
	}
	c.TLSCAFile = stand("tls_ca_file", c.TLSCAFile, "")
	if err != nil {
		return err
	}
	if len(c.Redis) == 0 && c.Cluster == nil && c.Sentinel == nil {
		// Tunables given before the address: the address check waits.
		c.Redis = []string{"redis://placeholder.invalid:6379"}
		if c.TLSCAFile != "" {
			c.Redis[0] = "rediss://placeholder.invalid:6379"
		}
	}
	return c.Validate()
}
