package ratelimit

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

func init() {
	caddy.RegisterModule(new(Handler))
}

// ErrRateLimited is wrapped by the error a denied request returns, so error
// routes and tests can recognise a rate limit denial with errors.Is.
var ErrRateLimited = errors.New("rate limit exceeded")

// ErrMissingKey is wrapped by the error a request returns when a zone's key
// is empty and on_missing_key is deny.
var ErrMissingKey = errors.New("rate limit key missing")

// Empty-key policies (Handler.OnMissingKey).
const (
	missingShared = "shared"
	missingSkip   = "skip"
	missingDeny   = "deny"
)

// Zone defaults and bounds.
const (
	defaultIPv4Prefix = 32
	defaultIPv6Prefix = 64
	// minWindow keeps windows in whole seconds: the draft header's w and t
	// parameters are integer seconds, and a sub-second window would make
	// every request a window rollover.
	minWindow = time.Second
	// maxZoneName bounds zone names: they travel in headers, origin keys and
	// metric labels.
	maxZoneName = 64
	// stackZones is how many zones a request decides without a heap
	// allocation for its limits and decisions; handlers with more zones
	// allocate per request.
	stackZones = 8
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

// Handler limits the rate of requests. Each request is decided against all
// of the handler's zones at once, all or nothing: it passes only when every
// zone admits it, and a denied request charges no zone. A denied request
// ends in a 429 error through Caddy's error flow (so `handle_errors` can
// shape the body), with Retry-After and the rate limit headers set.
//
// Zone names are global to the process: the same zone in several handlers or
// sites shares one count per identifier. Two separate ratelimit handlers on
// one request are two separate decisions.
type Handler struct {
	// Zones are the limits this handler enforces, in the order their header
	// members are written. At least one, at most 64.
	Zones []*Zone `json:"zones,omitempty"`

	// Headers selects the rate limit headers written on every response,
	// allowed or denied: "draft" (default;
	// draft-ietf-httpapi-ratelimit-headers-10 `RateLimit-Policy` and
	// `RateLimit`), "legacy" (`X-RateLimit-Limit`, `X-RateLimit-Remaining`,
	// `X-RateLimit-Reset` of the most restrictive zone), "both" or "off".
	// Retry-After is written on denials in every mode.
	Headers string `json:"headers,omitempty"`

	// OnMissingKey decides what happens to a request whose key evaluates to
	// the empty string (e.g. the header it names is missing): "shared"
	// (default; all such requests share one bucket per zone), "skip" (the
	// zone does not apply to the request) or "deny" (429 without counting).
	OnMissingKey string `json:"on_missing_key,omitempty"`

	// DryRun never denies: requests that would have been denied are served,
	// counted as served, and logged. Headers show the real state. Default
	// false.
	DryRun bool `json:"dry_run,omitempty"`

	// RetryJitter adds a uniformly random delay between zero and this
	// duration to Retry-After, so clients denied together do not return
	// together. It only ever adds. Default 0 (exact Retry-After).
	RetryJitter caddy.Duration `json:"retry_jitter,omitempty"`

	zones     []zone
	draft     bool
	legacy    bool
	onMissing string
	// policyAll is the RateLimit-Policy value when every zone applies with
	// its own limit, which is nearly every request.
	policyAll string

	state  *state
	engine *engine.Engine
	logger *zap.Logger
	// ids is how the config's app shows identifiers, for the dry-run log.
	ids identities
}

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

// CaddyModule returns the Caddy module information.
func (*Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.ratelimit",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision compiles the zones, takes a reference to the process's engine
// and registers the zones' definitions.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	if err := registerMetrics(ctx.GetMetricsRegistry()); err != nil {
		return err
	}
	appAny, err := ctx.App("ratelimit")
	if err != nil {
		return fmt.Errorf("loading ratelimit app: %w", err)
	}
	app, ok := appAny.(*App)
	if !ok {
		return fmt.Errorf("ratelimit app has unexpected type %T", appAny)
	}
	return h.provision(app)
}

// provision is Provision after the app lookup, so tests can provision a
// handler without a running config.
func (h *Handler) provision(app *App) error {
	if err := h.Validate(); err != nil {
		return err
	}
	h.compile()
	st, err := acquireState(nil)
	if err != nil {
		return err
	}
	h.state, h.engine = st, st.engine
	h.ids = app.ids
	for i := range h.zones {
		z := &h.zones[i]
		z.handle = st.engine.Zone(z.name, z.window)
		z.metrics = newZoneMetrics(z.name)
		z.dryRun = new(dryRunLog)
	}
	return st.zones.register(app, h)
}

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
		z.key = newTemplate(zc.Key)
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
		z.v4, z.v6 = zc.IPv4Prefix, zc.IPv6Prefix
		if z.v4 == 0 {
			z.v4 = defaultIPv4Prefix
		}
		if z.v6 == 0 {
			z.v6 = defaultIPv6Prefix
		}
		// Zone names are restricted to token characters, so quoting them as a
		// structured-field string needs no escaping.
		windowSecs := strconv.FormatInt(int64(z.window/time.Second), 10)
		z.policyQ = `"` + z.name + `";q=`
		z.policyW = ";w=" + windowSecs
		z.policy = z.policyQ + strconv.FormatInt(z.limit, 10) + z.policyW
		z.remainingR = `"` + z.name + `";r=`
		z.denied = fmt.Errorf("%w: zone %s", ErrRateLimited, z.name)
		z.missing = fmt.Errorf("%w: zone %s", ErrMissingKey, z.name)
		policies[i] = z.policy
	}
	h.policyAll = strings.Join(policies, ", ")
}

// Cleanup unregisters the zones and releases the engine; the engine closes
// when its last user is cleaned up. h.engine stays set: a request of the old
// config still running after a reload's grace period decides locally on the
// closed engine instead of crashing.
func (h *Handler) Cleanup() error {
	if h.state == nil {
		return nil
	}
	h.state.zones.unregister(h)
	h.state = nil
	return releaseState()
}

// ServeHTTP decides the request against every zone and either passes it on
// or returns a 429 error.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)

	var (
		limArr  [stackZones]engine.Limit
		decArr  [stackZones]engine.Decision
		zoneArr [stackZones]int
	)
	lims, decs, zi := limArr[:0], decArr[:], zoneArr[:0]
	if len(h.zones) > stackZones {
		lims = make([]engine.Limit, 0, len(h.zones))
		decs = make([]engine.Decision, len(h.zones))
		zi = make([]int, 0, len(h.zones))
	}

	ownLimits := true
	for i := range h.zones {
		z := &h.zones[i]
		id := z.key.eval(r, repl)
		if id == "" {
			switch h.onMissing {
			case missingSkip:
				z.metrics.skipped.Inc()
				continue
			case missingDeny:
				z.metrics.missingKey.Inc()
				return deny(w, r, z.missing)
			}
		} else {
			id = maskIP(id, z.v4, z.v6)
		}
		limit := z.limit
		if z.overrides != nil {
			if l, ok := z.overrides[id]; ok {
				limit = l
				ownLimits = false
			}
		}
		cost, clamp := z.costOf(r, repl)
		if clamp.bound != "" {
			h.costClamped(z, id, cost, clamp)
		}
		lims = append(lims, engine.Limit{
			Key:    engine.Key{Namespace: z.name, Identifier: id, Window: z.window},
			Zone:   z.handle,
			Limit:  limit,
			Cost:   cost,
			DryRun: h.DryRun,
		})
		zi = append(zi, i)
	}
	if len(lims) == 0 {
		return next.ServeHTTP(w, r)
	}
	decs = decs[:len(lims)]

	ctx := r.Context()
	// One decision in 32 is timed: a time.Now pair costs about as much as
	// the decision (see latencySampleMask).
	var start time.Time
	timed := rand.Uint32()&latencySampleMask == 0
	if timed {
		start = time.Now()
	}
	var allowed bool
	if len(lims) == 1 {
		decs[0] = h.engine.Decide(ctx, lims[0])
		allowed = decs[0].Allowed
	} else {
		allowed = h.engine.DecideMany(ctx, lims, decs)
	}
	if timed {
		observeDecision(allowed, time.Since(start))
	}
	h.countDecisions(decs, zi, allowed)

	hdr := w.Header()
	h.writeHeaders(hdr, lims, decs, zi, ownLimits && len(zi) == len(h.zones))

	if h.DryRun {
		// Dry-run limits are charged whatever their verdict; a zone that
		// would have denied says so in its decision.
		for k := range decs {
			if !decs[k].Allowed {
				h.dryRunDenied(lims, decs, zi)
				break
			}
		}
		return next.ServeHTTP(w, r)
	}
	if allowed {
		return next.ServeHTTP(w, r)
	}
	if secs, ok := h.retryAfter(decs); ok {
		hdr[hdrRetryAfter] = []string{strconv.FormatInt(secs, 10)}
	}
	for k := range decs {
		if !decs[k].Allowed {
			return deny(w, r, h.zones[zi[k]].denied)
		}
	}
	// The batch denied but no limit says why; deny with the first zone
	// rather than let the request through.
	return deny(w, r, h.zones[zi[0]].denied)
}

// deny ends a denied request with a 429. When the server has error routes
// (`handle_errors`), it goes through Caddy's error flow, so they can shape
// the response. Without them Caddy's error flow would write the same empty
// 429 after encoding the whole request for a debug-level log line, which
// costs more than everything else a denial does: the 429 is written here.
func deny(w http.ResponseWriter, r *http.Request, why error) error {
	if srv, ok := r.Context().Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); ok && (srv.Errors == nil || len(srv.Errors.Routes) == 0) {
		w.WriteHeader(http.StatusTooManyRequests)
		return nil
	}
	// What caddyhttp.Error builds, without its stack walk: the trace of a
	// rate limit denial is always this handler.
	return caddyhttp.HandlerError{
		Err:        why,
		StatusCode: http.StatusTooManyRequests,
		ID:         nextErrorID(),
		Trace:      "ratelimit.(*Handler).ServeHTTP",
	}
}

// errorIDs numbers denials for {http.error.id}: a random per-process base
// and a counter, unique like Caddy's random IDs and cheaper to make.
var errorIDs struct {
	base uint64
	n    atomic.Uint64
	once sync.Once
}

// nextErrorID returns a 9-character ID, as Caddy's error IDs are.
func nextErrorID() string {
	errorIDs.once.Do(func() { errorIDs.base = rand.Uint64() })
	id := (errorIDs.base + errorIDs.n.Add(1)) % 101559956668416 // 36⁹
	var b [9]byte
	for i := len(b) - 1; i >= 0; i-- {
		b[i] = "0123456789abcdefghijklmnopqrstuvwxyz"[id%36]
		id /= 36
	}
	return string(b[:])
}

// countDecisions counts one decision per decided zone (see the result
// constants in metrics.go).
func (h *Handler) countDecisions(decs []engine.Decision, zi []int, allowed bool) {
	for k := range decs {
		m := &h.zones[zi[k]].metrics
		switch {
		case !decs[k].Allowed && h.DryRun:
			m.dryRunDenied.Inc()
		case !decs[k].Allowed:
			m.denied.Inc()
		case allowed || h.DryRun:
			m.allowed.Inc()
		default:
			m.notCharged.Inc()
		}
	}
}

// Interface guards.
var (
	_ caddy.Module                = (*Handler)(nil)
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
