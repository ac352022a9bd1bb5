package ratelimit

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("ratelimit", parseHandlerDirective)
	// Before authentication, like Caddy's other rate limiter: it protects the
	// login from brute force. To key by an authenticated identity, put the
	// directive after the auth directive inside a route.
	httpcaddyfile.RegisterDirectiveOrder("ratelimit", httpcaddyfile.Before, "basic_auth")
	httpcaddyfile.RegisterGlobalOption("ratelimit", parseGlobalOption)
	for name, parse := range originSubdirectives {
		appSubdirectives[name] = parse
	}
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
		if a.Key != b.Key || a.Window != b.Window || a.IPv4Prefix != b.IPv4Prefix || a.IPv6Prefix != b.IPv6Prefix {
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
	var zones []parsedZone
	byName := map[string]parsedZone{}
	seen := map[string]bool{}
	for d.NextBlock(0) {
		sub := d.Val()
		if sub != "zone" {
			if seen[sub] {
				return nil, d.Errf("%s given twice", sub)
			}
			seen[sub] = true
		}
		switch sub {
		case "zone":
			zd := d.NewFromNextSegment()
			z, err := unmarshalZone(zd)
			if err != nil {
				return nil, err
			}
			p := parsedZone{zone: z, d: zd}
			if len(zones) == maxZones {
				return nil, p.errf("zone %q: one ratelimit directive takes at most %d zones", z.Name, maxZones)
			}
			if prev, dup := byName[z.Name]; dup {
				return nil, p.errf("zone %q defined twice in one ratelimit directive (first at %s)", z.Name, prev.at())
			}
			byName[z.Name] = p
			zones = append(zones, p)
			h.Zones = append(h.Zones, z)
		case "headers":
			v, err := oneArg(d)
			if err != nil {
				return nil, err
			}
			if err := validateHeaders(v); err != nil {
				return nil, d.WrapErr(err)
			}
			h.Headers = v
		case "on_missing_key":
			v, err := oneArg(d)
			if err != nil {
				return nil, err
			}
			if err := validateOnMissingKey(v); err != nil {
				return nil, d.WrapErr(err)
			}
			h.OnMissingKey = v
		case "dry_run":
			if d.NextArg() {
				return nil, d.ArgErr()
			}
			h.DryRun = true
		case "retry_jitter":
			v, err := oneArg(d)
			if err != nil {
				return nil, err
			}
			dur, err := caddy.ParseDuration(v)
			if err != nil {
				return nil, d.Errf("malformed retry_jitter %q: %w", v, err)
			}
			if dur < 0 {
				return nil, d.Errf("retry_jitter %s is negative", dur)
			}
			h.RetryJitter = caddy.Duration(dur)
		default:
			return nil, d.Errf("unknown subdirective %q of ratelimit (want zone, headers, on_missing_key, dry_run or retry_jitter)", sub)
		}
	}
	if len(zones) == 0 {
		return nil, d.Err("ratelimit needs at least one zone block")
	}
	return zones, nil
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
		if err := unmarshalZoneLine(d, z, sub); err != nil {
			return nil, err
		}
	}
	// Required settings are checked at the zone's line.
	d.Reset()
	d.Next()
	switch {
	case z.Key == "":
		return nil, d.Errf("zone %q: missing key", z.Name)
	case z.Limit == 0:
		return nil, d.Errf("zone %q: missing limit", z.Name)
	case z.Window == 0:
		return nil, d.Errf("zone %q: missing window", z.Name)
	}
	if err := z.validateCostBounds("default cost"); err != nil {
		for d.Line() < costLine && d.Next() {
		}
		return nil, d.Errf("zone %q: %w", z.Name, err)
	}
	return z, nil
}

func unmarshalZoneLine(d *caddyfile.Dispenser, z *Zone, sub string) error {
	switch sub {
	case "key":
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		z.Key = v
	case "limit":
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return d.Errf("zone %q: limit %q is not an integer", z.Name, v)
		}
		if err := validateLimit(n); err != nil {
			return d.Errf("zone %q: %w", z.Name, err)
		}
		z.Limit = n
	case "window":
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
	case "cost":
		args := d.RemainingArgs()
		if len(args) < 1 || len(args) > 2 {
			return d.ArgErr()
		}
		if err := validateCost(args[0]); err != nil {
			return d.Errf("zone %q: %w", z.Name, err)
		}
		z.Cost = caddyhttp.WeakString(args[0])
		if len(args) == 2 {
			n, err := strconv.ParseInt(args[1], 10, 64)
			if err != nil || n < 1 {
				return d.Errf("zone %q: default cost %q must be a positive integer", z.Name, args[1])
			}
			if err := validateUnits("default cost", n); err != nil {
				return d.Errf("zone %q: %w", z.Name, err)
			}
			z.DefaultCost = n
		}
	case "min_cost", "max_cost":
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		n, err := strconv.ParseInt(v, 10, 64)
		switch {
		case errors.Is(err, strconv.ErrRange) && n > 0:
			return d.Errf("zone %q: %s %s is above the largest count, %d (2^53-1)", z.Name, sub, v, int64(maxUnits))
		case errors.Is(err, strconv.ErrRange):
			return d.Errf("zone %q: %s %s is negative", z.Name, sub, v)
		case err != nil:
			return d.Errf("zone %q: %s %q is not an integer", z.Name, sub, v)
		}
		if err := validateCostBound(sub, n); err != nil {
			return d.Errf("zone %q: %w", z.Name, err)
		}
		if sub == "min_cost" {
			z.MinCost = &n
		} else {
			z.MaxCost = &n
		}
	case "override":
		args := d.RemainingArgs()
		if len(args) != 2 {
			return d.ArgErr()
		}
		n, err := strconv.ParseInt(args[1], 10, 64)
		if err != nil {
			return d.Errf("zone %q: override limit %q is not an integer", z.Name, args[1])
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
	case "ipv4_prefix", "ipv6_prefix":
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		max := 32
		if sub == "ipv6_prefix" {
			max = 128
		}
		bits, err := strconv.Atoi(v)
		if err != nil {
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
	default:
		return d.Errf("zone %q: unknown subdirective %q (want key, limit, window, cost, min_cost, max_cost, override, ipv4_prefix or ipv6_prefix)", z.Name, sub)
	}
	return nil
}

// oneArg returns the single argument of the current line.
func oneArg(d *caddyfile.Dispenser) (string, error) {
	if !d.NextArg() {
		return "", d.ArgErr()
	}
	v := d.Val()
	if d.NextArg() {
		return "", d.ArgErr()
	}
	return v, nil
}

// parseGlobalOption parses the global `ratelimit` option into the
// `ratelimit` app. Given twice, the second block adds to the first.
func parseGlobalOption(d *caddyfile.Dispenser, existing any) (any, error) {
	app := new(App)
	if prev, ok := existing.(httpcaddyfile.App); ok && len(prev.Value) > 0 {
		if err := json.Unmarshal(prev.Value, app); err != nil {
			return nil, fmt.Errorf("ratelimit global option: %w", err)
		}
	}
	if err := app.UnmarshalCaddyfile(d); err != nil {
		return nil, err
	}
	return httpcaddyfile.App{Name: "ratelimit", Value: caddyconfig.JSON(app, nil)}, nil
}

// appSubdirectives parse the lines of the global `ratelimit` block, one
// function per subdirective; the dispenser is on the subdirective's name.
// Backends add their own (`redis …`, `mysql …`) here.
var appSubdirectives = map[string]func(d *caddyfile.Dispenser, a *App) error{
	"region":            checkedArg(validateRegion, func(a *App, v string) { a.Region = v }),
	"identifier_secret": checkedArg(validateSecret, func(a *App, v string) { a.IdentifierSecret = v }),
	"max_entries": func(d *caddyfile.Dispenser, a *App) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			return d.Errf("max_entries: want a positive integer, got %q", v)
		}
		a.MaxEntries = n
		return nil
	},
	"log_identifiers": func(d *caddyfile.Dispenser, a *App) error {
		if d.NextArg() {
			return d.ArgErr()
		}
		a.LogIdentifiers = true
		return nil
	},
}

// checkedArg parses an app line of one argument, which check accepts and
// set stores.
func checkedArg(check func(string) error, set func(*App, string)) func(*caddyfile.Dispenser, *App) error {
	return func(d *caddyfile.Dispenser, a *App) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		if err := check(v); err != nil {
			return d.WrapErr(err)
		}
		set(a, v)
		return nil
	}
}

// UnmarshalCaddyfile sets up the app from the global option's tokens.
// Syntax:
//
//	ratelimit {
//	    region            <name>
//	    identifier_secret <secret, e.g. {env.RATELIMIT_SECRET}>
//	    log_identifiers
//	    max_entries       <n>
//	    redis …           # and the other origin lines: originSubdirectives
//	}
func (a *App) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // option name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		parse, ok := appSubdirectives[d.Val()]
		if !ok {
			return d.Errf("unknown subdirective %q of the ratelimit global option", d.Val())
		}
		if err := parse(d, a); err != nil {
			return err
		}
	}
	return a.checkMySQLLines(d) // cross-region layer (mysql.go)
}

// Interface guards.
var (
	_ caddyfile.Unmarshaler = (*Handler)(nil)
	_ caddyfile.Unmarshaler = (*App)(nil)
)

// originSubdirectives parse the origin lines of the global option:
//
//	ratelimit {
//	    redis          <url>              # repeat: partitions
//	    redis_cluster  <addr> [<addr>…]
//	    redis_sentinel <master> <addr> [<addr>…]
//	    tls_ca_file    <file>
//	    prefix         <prefix>
//	    replay_workers <n>
//	    read_timeout   <duration>
//	    freshness      <duration>
//	    slow_tick      <duration>
//	    fast_tick      <duration>
//	    breaker_interval      <duration>
//	    breaker_timeout       <duration>
//	    breaker_min_requests  <n>
//	    breaker_failure_ratio <ratio>
//	    breaker_slow_call     <duration>
//	}
//
// Each line is checked where it stands, so `caddy adapt` names its line.
var originSubdirectives = map[string]func(d *caddyfile.Dispenser, a *App) error{
	"redis": func(d *caddyfile.Dispenser, a *App) error {
		u, err := oneArg(d)
		if err != nil {
			return err
		}
		return a.setOrigin(d, func(c *origin.Config) { c.Redis = append(c.Redis, u) })
	},
	"redis_cluster": func(d *caddyfile.Dispenser, a *App) error {
		addrs := d.RemainingArgs()
		if len(addrs) == 0 {
			return d.ArgErr()
		}
		return a.setOrigin(d, func(c *origin.Config) { c.Cluster = &origin.ClusterConfig{Addrs: addrs} })
	},
	"redis_sentinel": func(d *caddyfile.Dispenser, a *App) error {
		args := d.RemainingArgs()
		if len(args) < 2 {
			return d.Errf("redis_sentinel needs a master name and at least one sentinel address")
		}
		return a.setOrigin(d, func(c *origin.Config) {
			c.Sentinel = &origin.SentinelConfig{Master: args[0], Addrs: args[1:]}
		})
	},
	"tls_ca_file":           stringOption(func(c *origin.Config, v string) { c.TLSCAFile = v }),
	"prefix":                stringOption(func(c *origin.Config, v string) { c.Prefix = v }),
	"replay_workers":        intOption(func(c *origin.Config, n int) { c.ReplayWorkers = n }),
	"breaker_min_requests":  intOption(func(c *origin.Config, n int) { c.Breaker.MinRequests = n }),
	"read_timeout":          durationOption(func(c *origin.Config, v origin.Duration) { c.ReadTimeout = v }),
	"freshness":             durationOption(func(c *origin.Config, v origin.Duration) { c.Freshness = v }),
	"slow_tick":             durationOption(func(c *origin.Config, v origin.Duration) { c.SlowTick = v }),
	"fast_tick":             durationOption(func(c *origin.Config, v origin.Duration) { c.FastTick = v }),
	"breaker_interval":      durationOption(func(c *origin.Config, v origin.Duration) { c.Breaker.Interval = v }),
	"breaker_timeout":       durationOption(func(c *origin.Config, v origin.Duration) { c.Breaker.Timeout = v }),
	"breaker_failure_ratio": ratioOption(func(c *origin.Config, r float64) { c.Breaker.FailureRatio = r }),
	"breaker_slow_call":     durationOption(func(c *origin.Config, v origin.Duration) { c.Breaker.SlowCall = v }),
}

// setOrigin applies one line to the app's origin settings and checks the
// result, so the error carries this line.
func (a *App) setOrigin(d *caddyfile.Dispenser, set func(*origin.Config)) error {
	if a.Origin == nil {
		a.Origin = new(origin.Config)
	}
	set(a.Origin)
	if err := checkOrigin(*a.Origin); err != nil {
		return d.Errf("%v", err)
	}
	return nil
}

func stringOption(set func(*origin.Config, string)) func(*caddyfile.Dispenser, *App) error {
	return func(d *caddyfile.Dispenser, a *App) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		return a.setOrigin(d, func(c *origin.Config) { set(c, v) })
	}
}

func intOption(set func(*origin.Config, int)) func(*caddyfile.Dispenser, *App) error {
	return func(d *caddyfile.Dispenser, a *App) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			return d.Errf("%s: want a positive integer, got %q", d.Val(), v)
		}
		return a.setOrigin(d, func(c *origin.Config) { set(c, n) })
	}
}

func durationOption(set func(*origin.Config, origin.Duration)) func(*caddyfile.Dispenser, *App) error {
	return func(d *caddyfile.Dispenser, a *App) error {
		name := d.Val()
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		dur, err := caddy.ParseDuration(v)
		if err != nil || dur <= 0 {
			return d.Errf("%s: want a positive duration such as 50ms, got %q", name, v)
		}
		return a.setOrigin(d, func(c *origin.Config) { set(c, origin.Duration(dur)) })
	}
}

func ratioOption(set func(*origin.Config, float64)) func(*caddyfile.Dispenser, *App) error {
	return func(d *caddyfile.Dispenser, a *App) error {
		name := d.Val()
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		r, err := strconv.ParseFloat(v, 64)
		if err != nil || r <= 0 || r > 1 {
			return d.Errf("%s: want a ratio in (0, 1], got %q", name, v)
		}
		return a.setOrigin(d, func(c *origin.Config) { set(c, r) })
	}
}
