package ratelimit

import (
	"context"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// The regional origin (Redis) of the `ratelimit` app.
//
// Lifecycle across reloads: Provision builds the origin without dialling
// (`caddy validate` provisions configs it never runs); Start attaches it to
// the process's engine; Stop flushes pending deltas if this config's origin
// is still the one in use and detaches it; Cleanup closes it. The engine
// uses the origin of the most recently started config that has not
// stopped, so a reload swaps the origin around the same counters, a reload
// without Redis makes the engine local-only, and a new config that fails to
// start hands the engine back to the config that keeps running (see
// liveApps for the orders).

// provisionOrigin resolves the origin settings and builds the origin.
func (a *App) provisionOrigin() error {
	if a.Origin == nil {
		return nil
	}
	cfg, err := resolveOrigin(*a.Origin)
	if err != nil {
		return fmt.Errorf("ratelimit app: %w", err)
	}
	routeRedisLog(a.logger)
	o, err := origin.New(cfg, a.state.obs.originOptions())
	if err != nil {
		return fmt.Errorf("ratelimit app: %w", err)
	}
	a.origin = o
	d := cfg.WithDefaults()
	a.timing = engine.Timing{
		ReadTimeout: time.Duration(d.ReadTimeout),
		Freshness:   time.Duration(d.Freshness),
		SlowTick:    time.Duration(d.SlowTick),
		FastTick:    time.Duration(d.FastTick),
	}
	return nil
}

// flushOrigin pushes the engine's pending deltas through a's origin, which
// is the engine's until a stops.
func (a *App) flushOrigin() {
	if a.origin == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	if err := a.state.engine.Flush(ctx); err != nil {
		a.logger.Warn("flushing rate limit counts to the origin on stop", zap.Error(err))
	}
}

// closeOrigin closes this config's origin; Stop has detached it.
func (a *App) closeOrigin() {
	if a.origin == nil {
		return
	}
	if err := a.origin.Close(); err != nil {
		a.logger.Warn("closing the rate limit origin", zap.Error(err))
	}
	a.origin = nil
}

// useOrigin points the engine at a's origin (local-only when a is nil or
// has none), with a's timing, and publishes it to the status and metrics.
func (s *state) useOrigin(a *App) {
	if a == nil || a.origin == nil {
		s.engine.SetOrigin(nil)
		s.apps.setOrigin(nil)
		return
	}
	s.engine.SetTiming(a.timing)
	s.engine.SetOrigin(a.engineOrigin())
	s.apps.setOrigin(a.origin)
}

// engineOrigin is a's origin as the engine sees it: identifiers mapped to
// their HMACs under identifier_secret.
func (a *App) engineOrigin() engine.Origin {
	if m := a.ids.mapper(); m != nil {
		return &mappedOrigin{Origin: a.origin, mapID: m}
	}
	return a.origin
}

// startOrigin sets a's origin watching its servers for a restart: Redis
// restarted empty lost every process's units, and the engine sends its
// live cells' totals again (engine.Resend) while a's origin is the one
// in use. Checked every slow tick, so within a flush period.
func (a *App) startOrigin() {
	if a.origin == nil {
		return
	}
	st := a.state
	a.origin.WatchRestarts(a.timing.SlowTick, func() {
		if st.apps.currentOrigin() == originView(a.origin) {
			n := st.engine.Resend()
			a.logger.Warn("Redis restarted empty: sending every live key's count to it again", zap.Int("cells", n))
		}
	})
}
