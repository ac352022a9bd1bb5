package ratelimit

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
)

func init() {
	caddy.RegisterModule(new(AdminAPI))
}

// AdminAPI is the admin API extension `admin.api.ratelimit`: the state of
// the process's rate limiter, one key's counters, the keys in strict mode,
// and forgetting a key. Routes:
//
//	GET    /ratelimit/status
//	GET    /ratelimit/counters?zone=Z&identifier=I     (admin_keys.go)
//	GET    /ratelimit/counters?zone=Z[&prefix=P][&max=N]
//	DELETE /ratelimit/counters?zone=Z&identifier=I[&scope=node|region|global] (reset.go)
//	GET    /ratelimit/strict[?zone=Z][&max=N]          (admin_keys.go)
//	PUT    /ratelimit/overrides?zone=Z&identifier=I    (overrides_admin.go)
//	GET    /ratelimit/overrides?zone=Z[&identifier=I | &prefix=P&max=N]
//	DELETE /ratelimit/overrides?zone=Z&identifier=I
//
// It holds no state: Caddy instantiates admin modules with every config
// load, before the apps, and a reload that fails late keeps the old apps
// running behind the new admin routes. Every request finds the engine
// through the package-level pool instead.
type AdminAPI struct{}

// CaddyModule returns the Caddy module information.
func (*AdminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.ratelimit",
		New: func() caddy.Module { return new(AdminAPI) },
	}
}

// Provision registers the limiter's metrics into the config's registry.
// Caddy provisions the admin modules with every config it loads, before
// its apps, and serves /metrics from that config's registry from then on,
// even when the config then fails and the old one keeps running: see
// limiterMetrics.
func (*AdminAPI) Provision(ctx caddy.Context) error {
	return registerMetrics(ctx.GetMetricsRegistry())
}

// Routes returns the routes of the rate limiter's admin API.
func (a *AdminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{
		{Pattern: "/ratelimit/status", Handler: headAsGet(a.handleStatus)},
		{Pattern: "/ratelimit/counters", Handler: headAsGet(a.handleCounters)},
		{Pattern: "/ratelimit/strict", Handler: headAsGet(a.handleStrict)},
		{Pattern: "/ratelimit/overrides", Handler: headAsGet(a.handleOverrides)},
		{Pattern: "/ratelimit/", Handler: caddy.AdminHandlerFunc(handleNoRoute)},
	}
}

// handleNoRoute answers every other path under /ratelimit/ with a JSON
// 404 that lists the routes, as the routes' own errors are: it was the
// admin server's text/plain "404 page not found".
func handleNoRoute(http.ResponseWriter, *http.Request) error {
	return caddy.APIError{HTTPStatus: http.StatusNotFound,
		Err: errors.New("no such route: the rate limiter's are /ratelimit/status, /ratelimit/counters, /ratelimit/strict, /ratelimit/overrides and, with the cross-region layer, /ratelimit/blocklist")}
}

// headAsGet answers HEAD as the route answers GET (RFC 9110, 9.3.2): the
// same status and headers, ETag and Content-Length among them, and no
// body, which the HTTP server leaves out of a HEAD's answer. A monitor
// that checks the status with HEAD got a 405.
func headAsGet(h caddy.AdminHandlerFunc) caddy.AdminHandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) error {
		if r.Method == http.MethodHead {
			r = r.Clone(r.Context())
			r.Method = http.MethodGet
		}
		return h(w, r)
	}
}

// zoneStatus is one zone of GET /ratelimit/status.
type zoneStatus struct {
	Name     string `json:"name"`
	Key      string `json:"key"`
	WindowMs int64  `json:"window_ms"`
}

// handleStatus is GET /ratelimit/status: the region, how identifiers are
// shown ("hmac" under identifier_secret: every identifier in this API's
// output is its HMAC; else "raw"), the zones, the engine's numbers, then
// each backend's section (null where the engine uses none).
func (a *AdminAPI) handleStatus(w http.ResponseWriter, r *http.Request) error {
	if err := allowMethods(w, r, http.MethodGet); err != nil {
		return err
	}
	if _, err := parseQuery(r); err != nil {
		return err
	}
	st, err := runningState()
	if err != nil {
		return err
	}
	v := st.apps.view()
	doc := new(object)
	doc.set("region", v.region)
	ids := "raw"
	if v.ids.hashed() {
		ids = "hmac"
	}
	doc.set("identifiers", ids)
	doc.set("zones", st.zones.statuses())
	s := engineStatsOf(st)
	doc.set("engine", engineStats.section(&s))
	for _, k := range backendKinds {
		doc.set(k.name, k.status(st))
	}
	return writeJSON(w, doc)
}

// allowMethods answers 405, with Allow, to any other method.
func allowMethods(w http.ResponseWriter, r *http.Request, methods ...string) error {
	if slices.Contains(methods, r.Method) {
		return nil
	}
	if slices.Contains(methods, http.MethodGet) {
		methods = slices.Insert(slices.Clone(methods), 1, http.MethodHead) // headAsGet
	}
	w.Header().Set("Allow", strings.Join(methods, ", "))
	return caddy.APIError{
		HTTPStatus: http.StatusMethodNotAllowed,
		Err:        fmt.Errorf("method %s not allowed; use %s", r.Method, strings.Join(methods, " or ")),
	}
}

// parseQuery returns the query's parameters, each given at most once and
// each one of known: a misspelt parameter is an error, not a silently
// broader answer.
func parseQuery(r *http.Request, known ...string) (map[string]string, error) {
	vals, err := url.ParseQuery(r.URL.RawQuery)
	if err != nil {
		return nil, badRequest("malformed query string")
	}
	q := make(map[string]string, len(vals))
	for k, v := range vals {
		if !slices.Contains(known, k) {
			if len(known) == 0 {
				return nil, badRequest(fmt.Sprintf("unknown parameter %q: this route takes none", k))
			}
			return nil, badRequest(fmt.Sprintf("unknown parameter %q (want %s)", k, strings.Join(known, ", ")))
		}
		if len(v) != 1 {
			return nil, badRequest(fmt.Sprintf("parameter %q given %d times", k, len(v)))
		}
		q[k] = v[0]
	}
	return q, nil
}

func badRequest(msg string) error {
	return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: errors.New(msg)}
}

func writeJSON(w http.ResponseWriter, v any) error {
	w.Header().Set("Content-Type", "application/json")
	if err := json.NewEncoder(w).Encode(v); err != nil {
		return caddy.APIError{HTTPStatus: http.StatusInternalServerError, Err: fmt.Errorf("encoding response: %w", err)}
	}
	return nil
}

// timeOrNull is nil for the zero time, so JSON says null, and otherwise
// the time in UTC to the millisecond (RFC 3339), the engine's precision.
func timeOrNull(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	u := t.UTC().Truncate(time.Millisecond)
	return &u
}

// errString is an error of a constant message.
type errString string

func (e errString) Error() string { return string(e) }

// Interface guards.
var (
	_ caddy.AdminRouter = (*AdminAPI)(nil)
	_ caddy.Provisioner = (*AdminAPI)(nil)
)
