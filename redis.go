package ratelimit

import (
	"context"
	"fmt"
	"sync"
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
// start hands the engine back to the config that keeps running.

// attached lists the started apps in start order; the last one's origin is
// the engine's.
var attached struct {
	sync.Mutex
	apps []*App
}

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

// startOrigin makes this config's origin (or none) the engine's.
func (a *App) startOrigin() {
	attached.Lock()
	defer attached.Unlock()
	attached.apps = append(attached.apps, a)
	a.state.useOrigin(a)
}

// stopOrigin detaches this config. If its origin is the one in use (no
// newer config took over: a shutdown, or a failed reload), pending deltas
// are flushed through it first.
func (a *App) stopOrigin() {
	attached.Lock()
	defer attached.Unlock()
	i := indexOf(attached.apps, a)
	if i < 0 {
		return
	}
	if i == len(attached.apps)-1 && a.origin != nil {
		ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
		if err := a.state.engine.Flush(ctx); err != nil {
			a.logger.Warn("flushing rate limit counts to the origin on stop", zap.Error(err))
		}
		cancel()
	}
	attached.apps = append(attached.apps[:i], attached.apps[i+1:]...)
	var next *App
	if n := len(attached.apps); n > 0 {
		next = attached.apps[n-1]
	}
	a.state.useOrigin(next)
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

func indexOf(apps []*App, a *App) int {
	for i, x := range apps {
		if x == a {
			return i
		}
	}
	return -1
}

// useOrigin points the engine at a's origin (local-only when a is nil or
// has none), with a's timing, and publishes it to the status and metrics.
func (s *state) useOrigin(a *App) {
	if a == nil || a.origin == nil {
		s.engine.SetOrigin(nil)
		s.obs.setOrigin(nil)
		return
	}
	s.engine.SetTiming(a.timing)
	var o engine.Origin = a.origin
	if m := a.ids.mapper(); m != nil {
		o = &mappedOrigin{Origin: a.origin, mapID: m}
	}
	s.engine.SetOrigin(o)
	s.obs.setOrigin(a.origin)
}
