package ratelimit

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
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
	// zone does not apply to the request) or "deny" (429 without counting;
	// under DryRun the request is served, and the other zones count it).
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
		z.dryRun = st.dryRunLog(z.name)
	}
	return st.zones.register(app, h)
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
//
// The decision runs in serveFew, serveSome or serveMany, whose frame holds
// the zones' limits and decisions, sized for the handler's zones, and is
// gone before the rest of the route runs or a denial's 429 is written:
// the response, a proxied request's deep path and the 429 run with a few
// words of this handler beneath them (a 429 written from serve's frame,
// 1.1 KB deeper, grew the stack under net/http's copy of the headers: 2 %
// of Caddy's CPU in the load test's deny row). The decision's own path
// stays shallow too: a connection's
// goroutine whose stack a collection has shrunk grows it again, copying
// it, when a request runs past its size; with 1.2 KB of zones for eight on
// every handler's frame, a loaded Caddy spent 1 to 2 % of its CPU copying
// stacks under this handler's header formatting.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	var pass bool
	var why error
	switch n := len(h.zones); {
	case n <= fewZones:
		pass, why = h.serveFew(w, r)
	case n <= stackZones:
		pass, why = h.serveSome(w, r)
	default:
		pass, why = h.serveMany(w, r)
	}
	if !pass {
		return deny(w, r, why)
	}
	return next.ServeHTTP(w, r)
}

// serveFew serves a handler of at most fewZones zones with their limits
// and decisions on its frame, serveSome one of at most stackZones, and
// serveMany one of more on the heap.
//
//go:noinline
func (h *Handler) serveFew(w http.ResponseWriter, r *http.Request) (bool, error) {
	var s struct {
		lims [fewZones]engine.Limit
		decs [fewZones]engine.Decision
		zi   [fewZones]int
	}
	return h.serve(w, r, s.lims[:0], s.decs[:], s.zi[:0])
}

//go:noinline
func (h *Handler) serveSome(w http.ResponseWriter, r *http.Request) (bool, error) {
	var s struct {
		lims [stackZones]engine.Limit
		decs [stackZones]engine.Decision
		zi   [stackZones]int
	}
	return h.serve(w, r, s.lims[:0], s.decs[:], s.zi[:0])
}

//go:noinline
func (h *Handler) serveMany(w http.ResponseWriter, r *http.Request) (bool, error) {
	n := len(h.zones)
	return h.serve(w, r, make([]engine.Limit, 0, n), make([]engine.Decision, n), make([]int, 0, n))
}

// serve decides the request and reports whether it passes on to the rest
// of the route; when it does not, why is the denial's error, which
// ServeHTTP answers with a 429 (see deny) once this frame is gone. lims
// and zi are empty with room for every zone, decs as long as the zones.
func (h *Handler) serve(w http.ResponseWriter, r *http.Request, lims []engine.Limit, decs []engine.Decision, zi []int) (pass bool, why error) {
	// The request's replacer, looked up once: Caddy's request context is
	// many values deep.
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	lims, zi, ownLimits, missing := h.limits(r, repl, lims, zi)
	switch {
	case missing >= 0 && !h.DryRun:
		if hdr := w.Header(); earlierHeaders(hdr, r, repl) {
			dropEarlierHeaders(hdr)
		}
		h.setMissing(r, repl, missing, decisionDenied)
		return false, h.zones[missing].missing
	case len(lims) == 0 && missing >= 0:
		h.dryRunMissing(missing)
		h.setMissing(r, repl, missing, decisionDryRunDenied)
		return true, nil
	case len(lims) == 0:
		h.setOutcome(r, repl, decisionSkipped, nil, nil, nil, -1)
		return true, nil
	}
	decs = decs[:len(lims)]
	allowed := h.decide(r, lims, decs)
	h.countDecisions(decs, zi, allowed)
	hdr := w.Header()
	if earlierHeaders(hdr, r, repl) {
		dropEarlierHeaders(hdr)
	}
	retry := int64(-1) // Retry-After in seconds, on a denial that can pass later
	if !allowed && !h.DryRun {
		if secs, ok := h.retryAfter(decs); ok {
			retry = secs
		}
	}
	h.writeHeaders(hdr, lims, decs, zi, ownLimits && len(zi) == len(h.zones), retry)
	switch {
	case h.DryRun && missing >= 0:
		// The missing key is what an enforcing handler would have denied
		// the request for, before counting anything.
		h.dryRunDenied(lims, decs, zi)
		h.dryRunMissing(missing)
		h.setMissing(r, repl, missing, decisionDryRunDenied)
		return true, nil
	case h.DryRun:
		h.dryRunDenied(lims, decs, zi) // would-be denials are logged; the request was charged
		decision, all := decisionAllowed, allAllowed(decs)
		if !all {
			decision = decisionDryRunDenied
		}
		h.setOutcome(r, repl, decision, lims, decs, zi, spokenZone(decs, all))
		return true, nil
	case allowed:
		h.setOutcome(r, repl, decisionAllowed, lims, decs, zi, spokenZone(decs, true))
		return true, nil
	}
	h.setOutcome(r, repl, decisionDenied, lims, decs, zi, spokenZone(decs, false))
	return false, h.deniedBy(decs, zi)
}

// allAllowed reports whether every limit allowed.
func allAllowed(decs []engine.Decision) bool {
	for k := range decs {
		if !decs[k].Allowed {
			return false
		}
	}
	return true
}

// limits appends to lims the limit of each zone that applies to the
// request, and to zi the zone's index: a runtime override first, then
// the zone's override line, then its limit. ownLimits is false when an
// override changed a zone's limit. missing is the index of a zone whose
// key is empty under on_missing_key deny (the request is denied at once),
// -1 when none; in a dry run, the first such zone, which has no limit in
// lims: the request is served, and the other zones count it. repl is the
// request's replacer (nil without one).
func (h *Handler) limits(r *http.Request, repl *caddy.Replacer, lims []engine.Limit, zi []int) (_ []engine.Limit, _ []int, ownLimits bool, missing int) {
	ownLimits = true
	missing = -1
	first := len(lims)
	for i := range h.zones {
		z := &h.zones[i]
		id := z.key.evalKey(r, repl, z.v4, z.v6)
		if id == "" {
			switch h.onMissing {
			case missingSkip:
				z.metrics.skipped.Inc()
				continue
			case missingDeny:
				z.metrics.missingKey.Inc()
				if !h.DryRun {
					return lims, zi, ownLimits, i
				}
				if missing < 0 {
					missing = i
				}
				continue
			}
		}
		limit, ok := runtimeLimit(r.Context(), z.name, id)
		if !ok && z.overrides != nil {
			limit, ok = z.overrides[id]
		}
		if ok {
			ownLimits = false
		} else {
			limit = z.limit
		}
		lims = append(lims, engine.Limit{
			Key:    engine.Key{Namespace: z.name, Identifier: id, Window: z.window},
			Zone:   z.handle,
			Limit:  limit,
			DryRun: h.DryRun,
		})
		zi = append(zi, i)
	}
	// Costs once every key is known: a request denied for a missing key
	// counts no zone's invalid or clamped cost.
	for k := first; k < len(lims); k++ {
		z := &h.zones[zi[k]]
		cost, clamp := z.costOf(r, repl)
		if clamp.bound != "" {
			h.costClamped(z, lims[k].Key.Identifier, cost, clamp)
		}
		lims[k].Cost = cost
	}
	return lims, zi, ownLimits, missing
}

// decide decides lims all together into decs and reports whether the
// request passes. One decision in 32 is timed: a time.Now pair costs about
// as much as the decision (see latencySampleMask).
func (h *Handler) decide(r *http.Request, lims []engine.Limit, decs []engine.Decision) bool {
	var start time.Time
	timed := rand.Uint32()&latencySampleMask == 0
	if timed {
		start = time.Now()
	}
	var allowed bool
	if len(lims) == 1 {
		decs[0] = h.engine.Decide(r.Context(), lims[0])
		allowed = decs[0].Allowed
	} else {
		allowed = h.engine.DecideMany(r.Context(), lims, decs)
	}
	if timed {
		observeDecision(allowed, time.Since(start))
	}
	return allowed
}

// deniedBy returns the error of the first zone that denied a request (its
// headers, Retry-After among them, are written).
func (h *Handler) deniedBy(decs []engine.Decision, zi []int) error {
	for k := range decs {
		if !decs[k].Allowed {
			return h.zones[zi[k]].denied
		}
	}
	// The batch denied but no limit says why; deny with the first zone
	// rather than let the request through.
	return h.zones[zi[0]].denied
}

// deny ends a denied request with a 429. When the server has error routes
// (`handle_errors`), it goes through Caddy's error flow, so they can shape
// the response. Without them Caddy's error flow would write the same empty
// 429 after encoding the whole request for a debug-level log line, which
// costs more than everything else a denial does: the 429 is written here.
// So it is in an error route (the request carries the error it handles):
// Caddy runs no error route for an error route's error, but logs it at
// error level and writes the first error's status, so a denial there was
// the 404 it limited, never a 429.
func deny(w http.ResponseWriter, r *http.Request, why error) error {
	if srv, ok := r.Context().Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); ok &&
		(srv.Errors == nil || len(srv.Errors.Routes) == 0 || r.Context().Value(caddyhttp.ErrorCtxKey) != nil) {
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
		case decs[k].ChargedAnyway:
			m.chargedAnyway.Inc()
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
