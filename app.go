package ratelimit

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/origin"
	"github.com/edgelimit/caddy-ratelimit/propagation"
)

func init() {
	caddy.RegisterModule(new(App))
}

// App is the `ratelimit` app: process-wide settings of the rate limiter
// (the Caddyfile's global `ratelimit` option). Without it the limiter runs
// local-only with every default; handlers load it on demand.
//
// The engine itself does not belong to any one config: it lives in a
// package-level pool shared by every config the process loads, so a reload
// keeps every counter.
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
	// the Caddy processes of one region. Addresses and passwords should be
	// runtime placeholders ({env.REDIS_URL}), resolved at provisioning.
	// Default none: local-only.
	Origin *origin.Config `json:"origin,omitempty"`

	// MySQL is the cross-region layer (see mysql.go). Default none: the
	// region's counts stay in the region.
	MySQL *MySQLConfig `json:"mysql,omitempty"`

	prop    *propagation.Propagator // cross-region layer (mysql.go)
	mysqlAt string                  // Caddyfile position of the mysql line
	origin  *origin.Redis
	timing  engine.Timing
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

// Provision takes a reference to the process's engine. It starts no I/O:
// `caddy validate` provisions and cleans up configs it never runs.
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
	if a.IdentifierSecret != "" && !strings.Contains(a.IdentifierSecret, "{") {
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
	st.apps.provision(a)
	if err := a.provisionOrigin(); err != nil {
		return err
	}
	return a.provisionPropagation() // cross-region layer (mysql.go)
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
	if a.Origin != nil {
		if err := checkOrigin(*a.Origin); err != nil {
			return fmt.Errorf("ratelimit app: origin: %w", err)
		}
	}
	return a.validateMySQL() // cross-region layer (mysql.go)
}

// Start makes this config's origin (or none) the engine's. The engine's
// goroutines follow the pool's reference count, not Start and Stop, because
// the old config's Stop runs after the new config's Start.
func (a *App) Start() error {
	a.startOrigin()
	a.startPropagation() // cross-region layer (mysql.go)
	a.state.start(a)
	return nil
}

// Stop detaches this config's origin, flushing pending counts through it
// when no newer config has taken over.
func (a *App) Stop() error {
	a.state.stop(a)
	a.stopPropagation() // cross-region layer (mysql.go)
	return nil
}

// Cleanup releases the app's reference to the engine.
func (a *App) Cleanup() error {
	if a.state == nil {
		return nil
	}
	a.state.stop(a)
	a.state.apps.cleanup(a)
	a.closePropagation() // cross-region layer (mysql.go)
	a.state = nil
	err := releaseState()
	a.closeOrigin()
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

// The process's one engine, shared by every config through the pool.
var pool = caddy.NewUsagePool()

// poolKey is the pool key of the process's state; there is only one.
const poolKey = "ratelimit.state"

// closeTimeout bounds how long the last user of the engine waits for
// pending deltas to be flushed: long enough for a few origin round trips,
// short enough not to hold up a shutdown.
const closeTimeout = 5 * time.Second

// newEngineConfig returns the configuration of a new engine; tests replace
// it to inject a clock.
var newEngineConfig = func() engine.Config { return engine.Config{} }

// state is what the pool holds: the engine and the zone definitions of the
// configs that use it.
type state struct {
	engine *engine.Engine
	zones  zoneRegistry
	apps   liveApps
	obs    observer
}

// acquireState returns the process's state, creating its engine if this is
// the first user; every call must be matched by releaseState. The app of
// the first config passes its origin settings, which size the engine's
// replay workers (fixed for the life of the process).
func acquireState(a *App) (*state, error) {
	v, _, err := pool.LoadOrNew(poolKey, func() (caddy.Destructor, error) {
		st := new(state)
		cfg := newEngineConfig()
		if a != nil && a.Origin != nil {
			a.Origin.ApplyEngine(&cfg)
		}
		if a != nil && a.MaxEntries > 0 {
			cfg.MaxEntries = a.MaxEntries
		}
		st.obs.apps = &st.apps
		st.obs.observeEngine(&cfg)
		st.engine = engine.New(cfg)
		return st, nil
	})
	if err != nil {
		return nil, fmt.Errorf("ratelimit engine: %w", err)
	}
	st, ok := v.(*state)
	if !ok {
		return nil, fmt.Errorf("ratelimit engine: pool holds %T", v)
	}
	return st, nil
}

// releaseState drops one reference; the last one closes the engine.
func releaseState() error {
	if _, err := pool.Delete(poolKey); err != nil {
		return fmt.Errorf("ratelimit engine: %w", err)
	}
	return nil
}

// Destruct closes the engine when its last user is gone: pending deltas are
// flushed within closeTimeout and every background goroutine stops.
func (s *state) Destruct() error {
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	if err := s.engine.Close(ctx); err != nil {
		return fmt.Errorf("closing ratelimit engine: %w", err)
	}
	return nil
}

// Interface guards.
var (
	_ caddy.App          = (*App)(nil)
	_ caddy.Provisioner  = (*App)(nil)
	_ caddy.Validator    = (*App)(nil)
	_ caddy.CleanerUpper = (*App)(nil)
	_ caddy.Destructor   = (*state)(nil)
)
