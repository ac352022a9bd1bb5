package ratelimit

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// A handler's zones: the JSON config (Zone) and what it is compiled to for
// the request path (zone), with the header fragments built once.

// Zone defaults and bounds.
const (
	defaultIPv4Prefix = 32
	defaultIPv6Prefix = 64
	// minWindow keeps windows in whole seconds: the draft header's w and t
	// parameters are integer seconds, and a sub-second window would make
	// every request a window rollover.
	minWindow = time.Second
	// maxWindow bounds windows at ten years: a cell's expiry is two
	// windows past now, in nanoseconds and in Unix milliseconds, which a
	// window of a few centuries would overflow.
	maxWindow = 3650 * 24 * time.Hour
	// maxRetryJitter bounds retry_jitter: the longest wait plus the
	// jitter stays far inside a time.Duration.
	maxRetryJitter = 24 * time.Hour
	// maxZoneName bounds zone names: they travel in headers, origin keys and
	// metric labels.
	maxZoneName = 64
	// stackZones is how many zones a request decides without a heap
	// allocation for its limits and decisions; handlers with more zones
	// allocate per request. Handlers of at most fewZones zones, most of
	// them, decide on a frame for that many (see Handler.ServeHTTP).
	stackZones = 8
	fewZones   = 2
	// maxZones bounds the zones of one handler: the engine marks the
	// would-be denials of a dry-run batch in a 64-bit mask, which a 65th
	// zone would overflow.
	maxZones = 64
)

// maxUnits is the largest limit or cost a zone accepts: engine.MaxCount,
// 2^53-1, since counts travel as JSON numbers and Lua numbers in the
// origin's scripts, which are float64 and exact only up to 2^53. A constant
// cost, limit or cost bound above it is a config error; a cost placeholder
// that evaluates above it is charged max_cost, at most maxUnits.
const maxUnits = engine.MaxCount

// Zone is one limit: at most Limit units of cost per sliding Window for each
// distinct value of Key.
type Zone struct {
	// Name identifies the zone across the process (and, with an origin,
	// across processes): the same name means the same counters. Letters,
	// digits, '_', '-' and '.', at most 64 bytes. Required.
	Name string `json:"name"`

	// Key is evaluated for each request (placeholders allowed, e.g.
	// `{http.request.header.X-API-Key}` or `{http.vars.client_ip}`) to the
	// identifier that is counted. When it evaluates to an IP address, the
	// address is masked to IPv4Prefix or IPv6Prefix bits. Required.
	Key string `json:"key"`

	// Limit is the number of cost units admitted per window for each
	// identifier. Required, from 1 to 2^53-1.
	Limit int64 `json:"limit"`

	// Window is the length of the sliding window, in whole seconds, at least
	// 1s. Required.
	Window caddy.Duration `json:"window"`

	// Cost is what one request consumes: a non-negative integer, or a
	// placeholder evaluated per request. A constant is charged as written
	// (0 makes a zone that only reads), at most 2^53-1. A placeholder that
	// evaluates to a non-negative integer is clamped to [MinCost, MaxCost]
	// (so 0 is charged MinCost, 1 by default); one that does not is
	// charged DefaultCost. Both are counted. Default 1.
	Cost caddyhttp.WeakString `json:"cost,omitempty"`

	// DefaultCost is charged when a Cost placeholder does not evaluate to a
	// non-negative integer. It must lie within [MinCost, MaxCost]; a config
	// where it does not is rejected. Default 1; never 0, so a bad value is
	// never a free pass.
	DefaultCost int64 `json:"default_cost,omitempty"`

	// MinCost is the least a Cost placeholder is charged: one that
	// evaluates to a smaller non-negative integer (0, "00", "-0") is
	// charged MinCost. From 0 to MaxCost. Default 1, so a client that
	// controls the placeholder cannot make its requests free; 0 lets the
	// placeholder charge nothing. A constant Cost is not clamped, but one
	// outside a bound written in the config is rejected as a contradiction.
	MinCost *int64 `json:"min_cost,omitempty"`

	// MaxCost is the most a Cost placeholder is charged: one that evaluates
	// to a larger integer, however large, is charged MaxCost. From MinCost
	// to 2^53-1. Default 2^53-1, the largest count.
	MaxCost *int64 `json:"max_cost,omitempty"`

	// Overrides maps identifiers to their own limit, replacing Limit for
	// them. Identifiers are compared after IP masking (e.g.
	// "203.0.113.0/24" with ipv4_prefix 24). A limit of 0 blocks the
	// identifier (every request with a positive cost is denied); at most
	// 2^53-1.
	Overrides map[string]int64 `json:"overrides,omitempty"`

	// IPv4Prefix is the prefix length an IPv4 identifier is masked to, 1–32.
	// Default 32 (one bucket per address).
	IPv4Prefix int `json:"ipv4_prefix,omitempty"`

	// IPv6Prefix is the prefix length an IPv6 identifier is masked to,
	// 1–128. Default 64: a client usually holds a whole /64, so one key per
	// /128 would be a free bypass.
	IPv6Prefix int `json:"ipv6_prefix,omitempty"`
}

// prefixes returns the prefix lengths an address is masked to, the
// defaults where the config gives none: `ipv4_prefix 32` written out and
// left out are one zone.
func (z *Zone) prefixes() (v4, v6 int) {
	v4, v6 = z.IPv4Prefix, z.IPv6Prefix
	if v4 == 0 {
		v4 = defaultIPv4Prefix
	}
	if v6 == 0 {
		v6 = defaultIPv6Prefix
	}
	return v4, v6
}

// zone is a Zone compiled for the request path.
type zone struct {
	name        string
	key         template
	limit       int64
	window      time.Duration
	cost        template
	staticCost  int64 // used when cost has no placeholder
	defaultCost int64
	// minCost and maxCost bound a placeholder cost (see costOf).
	minCost, maxCost int64
	overrides        map[string]int64
	v4, v6           int
	// handle is the engine's zone, resolved at Provision so that a
	// decision costs one lookup by identifier.
	handle *engine.Zone

	// Header fragments, built once: policy is the whole RateLimit-Policy
	// member for the zone's own limit; policyQ and policyW surround an
	// overridden limit; remainingR starts the RateLimit member.
	policy     string
	policyQ    string
	policyW    string
	remainingR string

	denied  error
	missing error

	// metrics are the zone's counters, resolved at Provision.
	metrics zoneMetrics
	// dryRun paces the dry-run info line to one per window.
	dryRun *dryRunLog
}

// compile turns the handler's config into what the request path reads.
func (h *Handler) compile() {
	mode := h.Headers
	if mode == "" {
		mode = headersDraft
	}
	h.draft = mode == headersDraft || mode == headersBoth
	h.legacy = mode == headersLegacy || mode == headersBoth
	h.onMissing = h.OnMissingKey
	if h.onMissing == "" {
		h.onMissing = missingShared
	}

	h.zones = make([]zone, len(h.Zones))
	policies := make([]string, len(h.Zones))
	for i, zc := range h.Zones {
		z := &h.zones[i]
		z.name = zc.Name
		z.key = newKeyTemplate(zc.Key)
		z.limit = zc.Limit
		z.window = time.Duration(zc.Window)
		z.cost = newTemplate(string(zc.Cost))
		z.staticCost = defaultCost
		if z.cost.literal && zc.Cost != "" {
			z.staticCost, _ = strconv.ParseInt(string(zc.Cost), 10, 64) // checked by Validate
		}
		z.defaultCost = zc.defaultCost()
		z.minCost, z.maxCost = zc.costBounds()
		if len(zc.Overrides) > 0 {
			z.overrides = zc.Overrides
		}
		z.v4, z.v6 = zc.prefixes()
		// Zone names are restricted to token characters, so quoting them as a
		// structured-field string needs no escaping.
		windowSecs := strconv.FormatInt(int64(z.window/time.Second), 10)
		z.policyQ = `"` + z.name + `";q=`
		z.policyW = ";w=" + windowSecs
		z.policy = string(appendSFInt([]byte(z.policyQ), z.limit)) + z.policyW
		z.remainingR = `"` + z.name + `";r=`
		z.denied = fmt.Errorf("%w: zone %s", ErrRateLimited, z.name)
		z.missing = fmt.Errorf("%w: zone %s", ErrMissingKey, z.name)
		policies[i] = z.policy
	}
	h.policyAll = strings.Join(policies, ", ")
}
