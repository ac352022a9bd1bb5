package ratelimit

// Placeholders. A zone's key and cost are templates, prepared once at
// provisioning and evaluated for every request; the app's backend
// addresses and secrets hold runtime placeholders ({env.REDIS_URL}),
// resolved once at provisioning.

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/textproto"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// template is a placeholder string prepared for cheap evaluation.
type template struct {
	raw string
	// single is the placeholder name when raw is exactly one placeholder,
	// which is looked up without building a string.
	single string
	// literal is true when raw has no placeholder at all.
	literal bool
	// direct, when set, reads the single placeholder's value straight from
	// the request, as Caddy's replacer would but without going through it
	// (the replacer's lookup costs about a microsecond a request).
	direct directKind
	// field is the canonical header name or the variable name of direct.
	field string
	// parts is set for a key that is neither a literal nor exactly one
	// placeholder (a composite such as "{a}:{b}" or "ip-{client_ip}"): its
	// placeholders' values are masked and escaped one by one (evalKey).
	parts *keyParts
}

// keyParts is how a composite key keeps its placeholders' values apart.
// Each value is masked to its prefix when it is an IP address, as a key of
// one placeholder is, and then percent-encoded: '%' and the first byte of
// each text between two placeholders become %XX. A value then never holds
// the text that ends it, so the key parses back to its values: ("t:u","v")
// and ("t","u:v") under "{a}:{b}" are "t%3Au:v" and "t:u%3Av", never one
// bucket. Two placeholders with nothing between them could not be told
// apart ("x"+"yz" and "xy"+"z"), so such a key is rejected (keyGlue).
type keyParts struct {
	escape [256]bool
}

// directKind names the placeholders that keys use most, read directly.
type directKind uint8

const (
	directNone       directKind = iota
	directHeader                // {http.request.header.NAME}
	directVar                   // {http.vars.NAME}, e.g. {client_ip}
	directRemoteHost            // {http.request.remote.host}
)

// keyGlue returns the bytes a composite key escapes in its values: '%'
// and the first byte of every text between two placeholders, none with
// fewer than two placeholders. err says why a key cannot keep its values
// apart: two placeholders that touch, or a NUL in its text (the mark that
// finds the placeholders here).
func keyGlue(raw string) ([]byte, error) {
	const mark = "\x00"
	if strings.Contains(raw, mark) {
		return nil, errors.New("key has a NUL byte")
	}
	marked, err := caddy.NewReplacer().ReplaceFunc(raw, func(string, any) (any, error) { return mark, nil })
	if err != nil {
		return nil, err
	}
	segs := strings.Split(marked, mark)
	if len(segs) < 3 {
		return nil, nil
	}
	glue := []byte{'%'}
	for _, g := range segs[1 : len(segs)-1] {
		if g == "" {
			return nil, fmt.Errorf("key %q has two placeholders with nothing between them, so two requests whose values differ only in where one ends (\"x\"+\"yz\" and \"xy\"+\"z\") would share a count: put a separator between them, e.g. {a}:{b}", raw)
		}
		glue = append(glue, g[0])
	}
	return glue, nil
}

// newKeyTemplate is newTemplate for a zone's key: a composite key (neither
// a literal nor exactly one placeholder) gets its keyParts.
func newKeyTemplate(raw string) template {
	t := newTemplate(raw)
	if t.literal || t.single != "" {
		return t
	}
	glue, _ := keyGlue(raw) // Zone.validate rejects a key it cannot keep apart
	t.parts = new(keyParts)
	for _, c := range glue {
		t.parts.escape[c] = true
	}
	return t
}

// newTemplate prepares raw for evaluation: a literal, a single placeholder
// (looked up by name, or read straight from the request for the common
// ones), or a general string for Caddy's replacer.
func newTemplate(raw string) template {
	t := template{raw: raw}
	if !strings.ContainsAny(raw, "{}") {
		t.literal = true
		return t
	}
	if len(raw) > 2 && raw[0] == '{' && raw[len(raw)-1] == '}' {
		name := raw[1 : len(raw)-1]
		// File placeholders are memoised by ReplaceAll only; escapes need its
		// parser.
		if !strings.ContainsAny(name, "{}\\") && !strings.HasPrefix(name, "file.") {
			t.single = name
		}
		switch {
		case t.single == "":
		case strings.HasPrefix(name, "http.request.header.") && len(name) > len("http.request.header."):
			t.direct, t.field = directHeader, textproto.CanonicalMIMEHeaderKey(strings.TrimPrefix(name, "http.request.header."))
		case strings.HasPrefix(name, "http.vars.") && len(name) > len("http.vars."):
			t.direct, t.field = directVar, strings.TrimPrefix(name, "http.vars.")
		case name == "http.request.remote.host":
			t.direct = directRemoteHost
		}
	}
	return t
}

// evalKey evaluates a zone's key for request r: an identifier that is an
// IP address is masked to its prefix (v4 or v6 bits). In a composite key
// each placeholder's value is masked and escaped (keyParts), and a key
// whose placeholders are all empty is missing (""), as a key of one empty
// placeholder is.
func (t *template) evalKey(r *http.Request, repl *caddy.Replacer, v4, v6 int) string {
	if t.parts == nil {
		id := t.eval(r, repl)
		if id == "" {
			return ""
		}
		return maskIP(id, v4, v6)
	}
	if repl == nil {
		return ""
	}
	present := false
	id, _ := repl.ReplaceFunc(t.raw, func(_ string, v any) (any, error) {
		s := caddy.ToString(v)
		if s == "" {
			return "", nil
		}
		present = true
		return t.parts.escapeValue(maskIP(s, v4, v6)), nil
	})
	if !present {
		return ""
	}
	return id
}

// escapeValue percent-encodes the bytes of s that the key escapes.
func (p *keyParts) escapeValue(s string) string {
	n := 0
	for i := 0; i < len(s); i++ {
		if p.escape[s[i]] {
			n++
		}
	}
	if n == 0 {
		return s
	}
	const hex = "0123456789ABCDEF"
	b := make([]byte, 0, len(s)+2*n)
	for i := 0; i < len(s); i++ {
		c := s[i]
		if p.escape[c] {
			b = append(b, '%', hex[c>>4], hex[c&0x0f])
			continue
		}
		b = append(b, c)
	}
	return string(b)
}

// eval evaluates the template for request r, whose replacer is repl.
func (t *template) eval(r *http.Request, repl *caddy.Replacer) string {
	switch {
	case t.literal:
		return t.raw
	case t.direct == directHeader:
		switch vals := r.Header[t.field]; len(vals) {
		case 0:
			return ""
		case 1:
			return vals[0]
		default:
			return strings.Join(vals, ",")
		}
	case t.direct == directVar:
		return caddy.ToString(caddyhttp.GetVar(r.Context(), t.field))
	case t.direct == directRemoteHost:
		if r.TLS != nil && !r.TLS.HandshakeComplete {
			return "" // QUIC early data: the address may be spoofed
		}
		host, _, err := net.SplitHostPort(r.RemoteAddr)
		if err != nil {
			return r.RemoteAddr // a unix socket path
		}
		return host
	case repl == nil:
		return ""
	case t.single != "":
		v, _ := repl.Get(t.single)
		return caddy.ToString(v)
	default:
		return repl.ReplaceAll(t.raw, "")
	}
}

// resolveOrigin replaces runtime placeholders ({env.REDIS_URL}) in the
// addresses and secrets. Errors name the field, never its value.
func resolveOrigin(cfg origin.Config) (origin.Config, error) {
	repl := caddy.NewReplacer()
	resolve := func(field string, s string) (string, error) {
		if !strings.Contains(s, "{") {
			return s, nil
		}
		v, err := repl.ReplaceOrErr(s, true, true)
		if err != nil {
			return "", fmt.Errorf("%s: a placeholder did not resolve (unknown or empty)", field)
		}
		return v, nil
	}
	var err error
	resolveAll := func(field string, in []string) []string {
		out := make([]string, len(in))
		for i, s := range in {
			if err == nil {
				out[i], err = resolve(field, s)
			}
		}
		return out
	}
	cfg.Redis = resolveAll("redis", cfg.Redis)
	if cfg.Cluster != nil {
		c := *cfg.Cluster
		c.Addrs = resolveAll("redis_cluster", c.Addrs)
		cfg.Cluster = &c
	}
	if cfg.Sentinel != nil {
		s := *cfg.Sentinel
		s.Addrs = resolveAll("redis_sentinel", s.Addrs)
		if err == nil {
			s.SentinelPassword, err = resolve("redis_sentinel password", s.SentinelPassword)
		}
		cfg.Sentinel = &s
	}
	if err == nil {
		cfg.TLSCAFile, err = resolve("tls_ca_file", cfg.TLSCAFile)
	}
	return cfg, err
}
