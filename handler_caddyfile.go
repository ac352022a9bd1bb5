package ratelimit

// The `ratelimit` directive, line by line: the handler's lines and each
// zone's, one small parser per line.

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	httpcaddyfile.RegisterDirective("ratelimit", parseDirective)
	// Before authentication, like Caddy's other rate limiter: it protects the
	// login from brute force. To key by an authenticated identity, put the
	// directive after the auth directive inside a route.
	httpcaddyfile.RegisterDirectiveOrder("ratelimit", httpcaddyfile.Before, "basic_auth")
}

// parseDirective is what httpcaddyfile.RegisterHandlerDirective would
// register, but for a matcher the directive names that is not defined
// (`ratelimit @api` with no `@api` block): Caddy's error for it names no
// line, and this one does (FuzzCaddyfile_WhatAdaptsValidates).
func parseDirective(h httpcaddyfile.Helper) ([]httpcaddyfile.ConfigValue, error) {
	if !h.Next() {
		return nil, h.ArgErr()
	}
	matchers, err := h.ExtractMatcherSet()
	if err != nil {
		return nil, h.Errf("%v", err)
	}
	handler, err := parseHandlerDirective(h)
	if err != nil {
		return nil, err
	}
	return h.NewRoute(matchers, handler), nil
}

// parseHandlerDirective parses the `ratelimit` directive and checks, across
// every site of the Caddyfile, that a zone name always means the same key
// and window.
func parseHandlerDirective(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	handler := new(Handler)
	zones, err := handler.unmarshal(h.Dispenser)
	if err != nil {
		return nil, err
	}
	if err := checkZonesAcrossSites(h.State, zones); err != nil {
		return nil, err
	}
	return handler, nil
}

// stateZones is the httpcaddyfile.Helper.State key of the zones seen so far.
const stateZones = "ratelimit.zones"

// parsedZone is a zone as parsed, with a dispenser over its own tokens so an
// error can point at its line.
type parsedZone struct {
	zone *Zone
	d    *caddyfile.Dispenser
}

// at returns the zone's "file:line".
func (p parsedZone) at() string {
	p.d.Reset()
	p.d.Next()
	return p.d.File() + ":" + strconv.Itoa(p.d.Line())
}

// errf reports an error at the zone's line.
func (p parsedZone) errf(format string, args ...any) error {
	p.d.Reset()
	p.d.Next()
	return p.d.Errf(format, args...)
}

// checkZonesAcrossSites is the adapt-time form of the provision-time zone
// check, able to name both places in the Caddyfile.
func checkZonesAcrossSites(st map[string]any, zones []parsedZone) error {
	seen, _ := st[stateZones].(map[string]parsedZone)
	if seen == nil {
		seen = make(map[string]parsedZone)
		st[stateZones] = seen
	}
	for _, p := range zones {
		prev, ok := seen[p.zone.Name]
		if !ok {
			seen[p.zone.Name] = p
			continue
		}
		a, b := prev.zone, p.zone
		a4, a6 := a.prefixes()
		b4, b6 := b.prefixes()
		if a.Key != b.Key || a.Window != b.Window || a4 != b4 || a6 != b6 {
			return p.errf("zone %q redefined with a different key, window or IP prefix than at %s: a zone counts one key over one window everywhere; use another zone name",
				p.zone.Name, prev.at())
		}
	}
	return nil
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	ratelimit [<matcher>] {
//	    zone <name> {
//	        key         <placeholder or text>
//	        limit       <positive integer>
//	        window      <duration, ≥ 1s>
//	        cost        <integer or placeholder> [<default cost>]   # default 1
//	        min_cost    <integer ≥ 0>                               # default 1
//	        max_cost    <integer ≥ min_cost>                        # default 2^53-1
//	        override    <identifier> <limit>                        # repeatable
//	        ipv4_prefix <1-32>                                      # default 32
//	        ipv6_prefix <1-128>                                     # default 64
//	    }
//	    headers        draft|legacy|both|off    # default draft
//	    on_missing_key shared|skip|deny         # default shared
//	    dry_run
//	    retry_jitter   <duration>               # default 0
//	}
//
// The zone block may be repeated, up to 64 times; every zone applies to
// every request the directive matches. A cost placeholder that evaluates
// to an integer is clamped to [min_cost, max_cost]; a constant cost is
// charged as written.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	_, err := h.unmarshal(d)
	return err
}

func (h *Handler) unmarshal(d *caddyfile.Dispenser) ([]parsedZone, error) {
	d.Next() // directive name
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	p := &directiveParse{byName: map[string]parsedZone{}, seen: map[string]bool{}}
	for d.NextBlock(0) {
		sub := d.Val()
		line, ok := handlerLines[sub]
		if !ok {
			return nil, d.Errf("unknown subdirective %q of ratelimit (want zone, headers, on_missing_key, dry_run or retry_jitter)", sub)
		}
		if sub != "zone" {
			if p.seen[sub] {
				return nil, d.Errf("%s given twice", sub)
			}
			p.seen[sub] = true
		}
		if err := line(d, h, p); err != nil {
			return nil, err
		}
	}
	if len(p.zones) == 0 {
		return nil, d.Err("ratelimit needs at least one zone block")
	}
	return p.zones, nil
}

// directiveParse is what the parse of one directive has seen so far.
type directiveParse struct {
	zones  []parsedZone
	byName map[string]parsedZone
	seen   map[string]bool
}

// handlerLines parse the directive's lines; the dispenser is on the line's
// name.
var handlerLines = map[string]func(d *caddyfile.Dispenser, h *Handler, p *directiveParse) error{
	"zone": func(d *caddyfile.Dispenser, h *Handler, p *directiveParse) error {
		zd := d.NewFromNextSegment()
		z, err := unmarshalZone(zd)
		if err != nil {
			return err
		}
		pz := parsedZone{zone: z, d: zd}
		if len(p.zones) == maxZones {
			return pz.errf("zone %q: one ratelimit directive takes at most %d zones", z.Name, maxZones)
		}
		if prev, dup := p.byName[z.Name]; dup {
			return pz.errf("zone %q defined twice in one ratelimit directive (first at %s)", z.Name, prev.at())
		}
		p.byName[z.Name] = pz
		p.zones = append(p.zones, pz)
		h.Zones = append(h.Zones, z)
		return nil
	},
	"headers": func(d *caddyfile.Dispenser, h *Handler, _ *directiveParse) error {
		return checkedArg(d, validateHeaders, func(v string) { h.Headers = v })
	},
	"on_missing_key": func(d *caddyfile.Dispenser, h *Handler, _ *directiveParse) error {
		return checkedArg(d, validateOnMissingKey, func(v string) { h.OnMissingKey = v })
	},
	"dry_run": func(d *caddyfile.Dispenser, h *Handler, _ *directiveParse) error {
		if d.NextArg() {
			return d.ArgErr()
		}
		h.DryRun = true
		return nil
	},
	"retry_jitter": func(d *caddyfile.Dispenser, h *Handler, _ *directiveParse) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		dur, err := caddy.ParseDuration(v)
		if err != nil {
			return d.Errf("malformed retry_jitter %q: %w", v, err)
		}
		if err := validateRetryJitter(dur); err != nil {
			return d.WrapErr(err)
		}
		h.RetryJitter = caddy.Duration(dur)
		return nil
	},
}

// checkedArg reads a line's one argument, which check accepts, into set.
func checkedArg(d *caddyfile.Dispenser, check func(string) error, set func(string)) error {
	v, err := oneArg(d)
	if err != nil {
		return err
	}
	if err := check(v); err != nil {
		return d.WrapErr(err)
	}
	set(v)
	return nil
}

// unmarshalZone parses one `zone <name> { … }` segment.
func unmarshalZone(d *caddyfile.Dispenser) (*Zone, error) {
	d.Next() // "zone"
	if !d.NextArg() {
		return nil, d.Errf("zone needs a name")
	}
	z := &Zone{Name: d.Val()}
	if err := validateZoneName(z.Name); err != nil {
		return nil, d.WrapErr(err)
	}
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	seen := map[string]bool{}
	// costLine is the line of the last cost, min_cost or max_cost: where a
	// contradiction between them becomes true, reading down.
	costLine := 0
	for d.NextBlock(0) {
		sub := d.Val()
		line, ok := zoneLines[sub]
		if !ok {
			return nil, d.Errf("zone %q: unknown subdirective %q (want key, limit, window, cost, min_cost, max_cost, override, ipv4_prefix or ipv6_prefix)", z.Name, sub)
		}
		if sub != "override" {
			if seen[sub] {
				return nil, d.Errf("zone %q: %s given twice", z.Name, sub)
			}
			seen[sub] = true
		}
		switch sub {
		case "cost", "min_cost", "max_cost":
			costLine = d.Line()
		}
		if err := line(d, z, sub); err != nil {
			return nil, err
		}
	}
	return z, checkZoneBlock(d, z, costLine)
}

// checkZoneBlock checks what a zone needs of its lines together: the
// required ones, at the zone's line, and the cost bounds, at the last cost
// line.
func checkZoneBlock(d *caddyfile.Dispenser, z *Zone, costLine int) error {
	d.Reset()
	d.Next()
	switch {
	case z.Key == "":
		return d.Errf("zone %q: missing key", z.Name)
	case z.Limit == 0:
		return d.Errf("zone %q: missing limit", z.Name)
	case z.Window == 0:
		return d.Errf("zone %q: missing window", z.Name)
	}
	if err := z.validateCostBounds("default cost"); err != nil {
		for d.Line() < costLine && d.Next() {
		}
		return d.Errf("zone %q: %w", z.Name, err)
	}
	// Overrides of addresses are checked against the prefixes, and those
	// of a composite key against the key, which may come after them: each
	// at its own line.
	v4, v6 := z.prefixes()
	for d.Next() {
		if d.Val() != "override" || !d.NextArg() {
			continue
		}
		if err := validateOverrideForKey(d.Val(), z.Key, v4, v6); err != nil {
			return d.Errf("zone %q: %w", z.Name, err)
		}
	}
	return nil
}

// zoneLines parse a zone's lines; the dispenser is on the line's name.
var zoneLines = map[string]func(d *caddyfile.Dispenser, z *Zone, sub string) error{
	"key": func(d *caddyfile.Dispenser, z *Zone, _ string) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		if err := validatePlaceholders("key", v); err != nil {
			return d.Errf("zone %q: %w", z.Name, err)
		}
		if _, err := keyGlue(v); err != nil {
			return d.Errf("zone %q: %w", z.Name, err)
		}
		z.Key = v
		return nil
	},
	"limit": func(d *caddyfile.Dispenser, z *Zone, _ string) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		n, err := parseCount("limit", v)
		if err != nil {
			return d.Errf("zone %q: %w", z.Name, err)
		}
		if err := validateLimit(n); err != nil {
			return d.Errf("zone %q: %w", z.Name, err)
		}
		z.Limit = n
		return nil
	},
	"window": func(d *caddyfile.Dispenser, z *Zone, _ string) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		dur, err := caddy.ParseDuration(v)
		if err != nil {
			return d.Errf("zone %q: malformed window %q: %w", z.Name, v, err)
		}
		if err := validateWindow(dur); err != nil {
			return d.Errf("zone %q: %w", z.Name, err)
		}
		z.Window = caddy.Duration(dur)
		return nil
	},
	"cost":        zoneCostLine,
	"min_cost":    zoneCostBoundLine,
	"max_cost":    zoneCostBoundLine,
	"override":    zoneOverrideLine,
	"ipv4_prefix": zonePrefixLine,
	"ipv6_prefix": zonePrefixLine,
}

// zoneCostLine parses `cost <integer or placeholder> [<default cost>]`.
func zoneCostLine(d *caddyfile.Dispenser, z *Zone, _ string) error {
	args := d.RemainingArgs()
	if len(args) < 1 || len(args) > 2 {
		return d.ArgErr()
	}
	if slices.Contains(args, "") {
		return errEmptyArg(d, "cost")
	}
	if err := validateCost(args[0]); err != nil {
		return d.Errf("zone %q: %w", z.Name, err)
	}
	z.Cost = caddyhttp.WeakString(args[0])
	if len(args) == 2 {
		if !strings.ContainsAny(args[0], "{}") {
			return d.Errf("zone %q: a default cost is for a cost placeholder; cost %s is a constant, charged as written", z.Name, args[0])
		}
		n, err := parseCount("default cost", args[1])
		switch {
		case err != nil:
			return d.Errf("zone %q: %w", z.Name, err)
		case n < 1:
			return d.Errf("zone %q: default cost %q must be a positive integer", z.Name, args[1])
		}
		if err := validateUnits("default cost", n); err != nil {
			return d.Errf("zone %q: %w", z.Name, err)
		}
		z.DefaultCost = n
	}
	return nil
}

// zoneCostBoundLine parses `min_cost <n>` and `max_cost <n>`.
func zoneCostBoundLine(d *caddyfile.Dispenser, z *Zone, sub string) error {
	v, err := oneArg(d)
	if err != nil {
		return err
	}
	n, err := parseCount(sub, v)
	if err != nil {
		return d.Errf("zone %q: %w", z.Name, err)
	}
	if err := validateCostBound(sub, n); err != nil {
		return d.Errf("zone %q: %w", z.Name, err)
	}
	if sub == "min_cost" {
		z.MinCost = &n
	} else {
		z.MaxCost = &n
	}
	return nil
}

// parseCount reads a limit or cost (what says which) written as a decimal
// integer, saying why when it is not one: one past int64 either way is a
// number too large or negative, not a word.
func parseCount(what, v string) (int64, error) {
	n, err := strconv.ParseInt(v, 10, 64)
	switch {
	case errors.Is(err, strconv.ErrRange) && n > 0:
		return 0, fmt.Errorf("%s %s is above the largest count, %d (2^53-1)", what, v, int64(maxUnits))
	case errors.Is(err, strconv.ErrRange):
		return 0, fmt.Errorf("%s %s is negative", what, v)
	case err != nil:
		return 0, fmt.Errorf("%s %q is not an integer", what, v)
	}
	return n, nil
}

// zoneOverrideLine parses `override <identifier> <limit>`.
func zoneOverrideLine(d *caddyfile.Dispenser, z *Zone, _ string) error {
	args := d.RemainingArgs()
	if len(args) != 2 {
		return d.ArgErr()
	}
	n, err := parseCount("limit", args[1])
	if err != nil {
		return d.Errf("zone %q: override %q: %w", z.Name, args[0], err)
	}
	if err := validateOverride(args[0], n); err != nil {
		return d.Errf("zone %q: %w", z.Name, err)
	}
	if _, dup := z.Overrides[args[0]]; dup {
		return d.Errf("zone %q: override %q given twice", z.Name, args[0])
	}
	if z.Overrides == nil {
		z.Overrides = map[string]int64{}
	}
	z.Overrides[args[0]] = n
	return nil
}

// zonePrefixLine parses `ipv4_prefix <1-32>` and `ipv6_prefix <1-128>`.
func zonePrefixLine(d *caddyfile.Dispenser, z *Zone, sub string) error {
	v, err := oneArg(d)
	if err != nil {
		return err
	}
	max := 32
	if sub == "ipv6_prefix" {
		max = 128
	}
	bits, err := strconv.Atoi(v)
	switch {
	case errors.Is(err, strconv.ErrRange):
		return d.Errf("zone %q: %s must be between 1 and %d, got %s", z.Name, sub, max, v)
	case err != nil:
		return d.Errf("zone %q: %s %q is not an integer", z.Name, sub, v)
	}
	if err := validateIPPrefix(sub, bits, max); err != nil {
		return d.Errf("zone %q: %w", z.Name, err)
	}
	if sub == "ipv4_prefix" {
		z.IPv4Prefix = bits
	} else {
		z.IPv6Prefix = bits
	}
	return nil
}

// Interface guards.
var _ caddyfile.Unmarshaler = (*Handler)(nil)
