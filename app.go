package ratelimit

import (
	"fmt"
	"sync"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

func init() {
	caddy.RegisterModule(new(App))
}

// App is the `ratelimit` app: process-wide settings of the rate limiter
// (the Caddyfile's global `ratelimit` option). Without it the limiter runs
// local-only with every default; handlers load it on demand.
//
// The engine itself does not belong to any one config: it lives in a
// package-level pool shared by every config the process loads (state.go),
// so a reload keeps every counter.
type App struct {
	// Region names the region this Caddy runs in (letters, digits, '_', '-'
	// and '.'). It labels what the process publishes to other regions.
	// Default empty: a single-region deployment.
	Region string `json:"region,omitempty"`

	// IdentifierSecret, when set, replaces every identifier that leaves
	// the process by its HMAC-SHA256 keyed with this secret (the first 128
	// bits, in hex): in admin API output and logs, and in a backend's keys
	// and rows. At least 16 bytes. Use a runtime placeholder such as
	// `{env.RATELIMIT_SECRET}`, resolved at provisioning: a literal value
	// (or `{$VAR}`, substituted at adapt time) is served by the admin API's
	// /config/ endpoint. Every node sharing a backend needs the same secret;
	// changing it starts the backend's counts over. Default empty: the
	// admin API shows identifiers as they are and logs truncate them.
	IdentifierSecret string `json:"identifier_secret,omitempty"`

	// LogIdentifiers logs identifiers whole (next to their HMAC when
	// IdentifierSecret is set) instead of truncated to their first bytes.
	// Default false: identifiers are often API keys.
	LogIdentifiers bool `json:"log_identifiers,omitempty"`

	// MaxEntries is the hard cap on keys held in memory: past it the
	// coldest, lowest-count keys are evicted (counted and logged). About 240
	// bytes a key. It sizes the engine when the process's first config is
	// loaded; changing it needs a restart. Default 1,000,000.
	MaxEntries int `json:"max_entries,omitempty"`

	// Origin is the regional origin, Redis, that converges the counts of
	// the Caddy processes of one region (redis.go). Addresses and passwords
	// should be runtime placeholders ({env.REDIS_URL}), resolved at
	// provisioning. Default none: local-only.
	Origin *origin.Config `json:"origin,omitempty"`

	// MySQL is the cross-region layer (mysql.go). Default none: the
	// region's counts stay in the region.
	MySQL *MySQLConfig `json:"mysql,omitempty"`

	// backends are the app's backends, one per backendKinds entry (nil
	// where the app configures none).
	backends []backend
	// lineAt is where each line of the global option stood
	// ("file:line"), for errors that concern several lines.
	lineAt map[string]string
	// setBefore holds the JSON paths ("a.b") that earlier blocks of the
	// global option set, when this block adds to them.
	setBefore map[string]bool

	ids     identities
	state   *state
	logger  *zap.Logger
	mu      sync.Mutex
	handler int // ordinal of the last handler registered, for messages
}

// CaddyModule returns the Caddy module information.
func (*App) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "ratelimit",
		New: func() caddy.Module { return new(App) },
	}
}

// Provision takes a reference to the process's engine and builds the
// backends. It starts no I/O: `caddy validate` provisions and cleans up
// configs it never runs.
func (a *App) Provision(ctx caddy.Context) error {
	a.logger = ctx.Logger()
	if err := a.Validate(); err != nil {
		return err
	}
	ids, err := newIdentities(a.IdentifierSecret, a.LogIdentifiers)
	if err != nil {
		return fmt.Errorf("ratelimit app: %w", err)
	}
	a.ids = ids
	if _, ok := literal(a.IdentifierSecret); a.IdentifierSecret != "" && ok {
		a.logger.Warn("identifier_secret is written in the config, which the admin API serves at /config/: use a runtime placeholder such as {env.RATELIMIT_SECRET}")
	}
	if err := registerMetrics(ctx.GetMetricsRegistry()); err != nil {
		return err
	}
	st, err := acquireState(a)
	if err != nil {
		return err
	}
	a.state = st
	if f := st.sizeChanges(a); len(f) > 0 {
		a.logger.Warn("max_entries and replay_workers size the engine when it is made: the running engine keeps its values until a restart, or a reload to a config without ratelimit, which closes it", f...)
	}
	st.apps.provision(a)
	a.backends = make([]backend, len(backendKinds))
	for i, k := range backendKinds {
		if a.backends[i], err = k.provision(a); err != nil {
			return fmt.Errorf("ratelimit app: %w", err)
		}
	}
	return nil
}

// Validate checks the app's settings.
func (a *App) Validate() error {
	if err := validateRegion(a.Region); err != nil {
		return fmt.Errorf("ratelimit app: %w", err)
	}
	if err := validateSecret(a.IdentifierSecret); err != nil {
		return fmt.Errorf("ratelimit app: %w", err)
	}
	if a.MaxEntries < 0 {
		return fmt.Errorf("ratelimit app: max_entries must be positive, got %d", a.MaxEntries)
	}
	for _, k := range backendKinds {
		if err := k.validate(a); err != nil {
			return fmt.Errorf("ratelimit app: %w", err)
		}
	}
	return nil
}

// configureEngine applies the settings that size a new engine.
func (a *App) configureEngine(cfg *engine.Config) {
	for _, k := range backendKinds {
		k.configureEngine(a, cfg)
	}
	if a.MaxEntries > 0 {
		cfg.MaxEntries = a.MaxEntries
	}
}

// Start starts the backends' work and makes them the engine's. The
// engine's goroutines follow the pool's reference count, not Start and
// Stop, because the old config's Stop runs after the new config's Start.
func (a *App) Start() error {
	a.eachBackend(func(b backend) { b.start() })
	a.state.start(a)
	if testHookStarted != nil {
		testHookStarted(a)
	}
	return nil
}

// testHookStarted, set by tests, runs when an app has started.
var testHookStarted func(a *App)

// Stop hands the engine to the newest config still started, after the
// backends wrote what they hold if they were the engine's; the last
// config's do that in Cleanup (see state.stop).
func (a *App) Stop() error {
	a.state.stop(a, false)
	return nil
}

// Cleanup releases the app's reference to the engine and closes the
// backends.
func (a *App) Cleanup() error {
	if a.state == nil {
		return nil
	}
	a.state.stop(a, true)
	a.state.apps.cleanup(a)
	a.state = nil
	err := releaseState()
	a.eachBackend(func(b backend) { b.close() })
	return err
}

// nextHandler numbers the handlers of one config in provisioning order, so
// a zone conflict can say which handlers disagree.
func (a *App) nextHandler() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.handler++
	return a.handler
}

// Interface guards.
var (
	_ caddy.App          = (*App)(nil)
	_ caddy.Provisioner  = (*App)(nil)
	_ caddy.Validator    = (*App)(nil)
	_ caddy.CleanerUpper = (*App)(nil)
	_ caddy.Destructor   = (*state)(nil)
)
