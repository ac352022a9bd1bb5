package ratelimit

// Placeholders. A zone's key and cost are templates, prepared once at
// provisioning and evaluated for every request; the app's backend
// addresses and secrets hold runtime placeholders ({env.REDIS_URL}),
// resolved once at provisioning.

import (
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
}

// directKind names the placeholders that keys use most, read directly.
type directKind uint8

const (
	directNone       directKind = iota
	directHeader                // {http.request.header.NAME}
	directVar                   // {http.vars.NAME}, e.g. {client_ip}
	directRemoteHost            // {http.request.remote.host}
)

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
