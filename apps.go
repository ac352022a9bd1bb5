package ratelimit

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/origin"
)

// liveApps is the one registry of the `ratelimit` apps of the loaded
// configs. It lives in the pooled state, beside the engine, and keeps the
// apps in the two orders that matter:
//
//   - provisioned (and not cleaned up), oldest first: the newest speaks for
//     the process (logger, region, identifiers). A reload provisions the
//     new config before cleaning up the old one, and a failed reload cleans
//     up its own app, which leaves the running config's app the newest
//     again.
//   - started (and not stopped), oldest first: the newest one's backends
//     are the engine's. The old config's Stop runs after the new config's
//     Start, and a new config that fails to start is stopped, which hands
//     the engine back to the config that keeps running.
type liveApps struct {
	mu          sync.Mutex
	provisioned []*App
	started     []*App

	cur atomic.Pointer[appView]
	// origin is what the status and the metrics read of the origin the
	// engine uses now; nil when it is local-only.
	origin atomic.Pointer[originView]
}

// appView is what the newest app says about the process.
type appView struct {
	app    *App
	logger *zap.Logger
	region string
	ids    identities
}

// originView is what the status and the metrics read of the regional
// origin; *origin.Redis implements it.
type originView interface {
	Stats() origin.Stats
}

// provision records a as the newest provisioned app.
func (l *liveApps) provision(a *App) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.provisioned = append(l.provisioned, a)
	l.publish()
}

// cleanup forgets a; the newest remaining app speaks for the process.
func (l *liveApps) cleanup(a *App) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.provisioned = slices.DeleteFunc(l.provisioned, func(x *App) bool { return x == a })
	l.publish()
}

func (l *liveApps) publish() {
	if len(l.provisioned) == 0 {
		l.cur.Store(nil)
		return
	}
	a := l.provisioned[len(l.provisioned)-1]
	l.cur.Store(&appView{app: a, logger: a.logger, region: a.Region, ids: a.ids})
}

// view returns the newest app's settings, or the defaults (Caddy's default
// logger, identifiers truncated in logs) when no app is provisioned, e.g.
// between a handler's provisioning and its app's in tests.
func (l *liveApps) view() *appView {
	if v := l.cur.Load(); v != nil {
		return v
	}
	return &appView{logger: caddy.Log().Named("ratelimit")}
}

// start records a as the newest started app and makes its backends (or
// none) the engine's.
func (s *state) start(a *App) {
	l := &s.apps
	l.mu.Lock()
	defer l.mu.Unlock()
	l.started = append(l.started, a)
	s.useBackends(a)
}

// stop forgets a as started. If its backends are the engine's (no newer
// config took over: a shutdown, or a failed reload), pending counts are
// flushed through them first; then the newest remaining started app's
// backends take over. Stopping an app that is not started does nothing.
func (s *state) stop(a *App) {
	l := &s.apps
	l.mu.Lock()
	defer l.mu.Unlock()
	i := slices.Index(l.started, a)
	if i < 0 {
		return
	}
	last := i == len(l.started)-1
	if last {
		s.flushBackends(a)
	}
	l.started = slices.Delete(l.started, i, i+1)
	var next *App
	if n := len(l.started); n > 0 {
		next = l.started[n-1]
	}
	s.useBackends(next)
	s.letOriginGo(a, last)
}

// letOriginGo handles what is left for a's origin when a stops and the
// engine has no origin any more (a reload without Redis, or shutdown):
// units admitted before that and not replayed yet go out through a's
// origin, still open until a is cleaned up (a newer config took the
// engine away from it without a flush), and those it could not take are
// given up, counted and logged, rather than left pending for an origin
// that may never come.
func (s *state) letOriginGo(a *App, flushed bool) {
	if a.origin == nil || s.engine.Origin() != nil {
		return
	}
	if !flushed {
		ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
		if err := s.engine.FlushTo(ctx, a.engineOrigin()); err != nil {
			a.logger.Warn("flushing rate limit counts to the origin the new config no longer uses", zap.Error(err))
		}
		cancel()
	}
	if lost := s.engine.DropUnsent(); lost > 0 {
		a.logger.Warn("rate limit units admitted here could not be written to Redis before it was let go: the region never counts them",
			zap.Int64("units", lost))
	}
}

// useBackends points the engine at a's backends (local-only when a is nil
// or has none). One call per backend.
func (s *state) useBackends(a *App) {
	s.useOrigin(a)
	s.usePropagation(a) // cross-region layer (mysql.go)
}

// flushBackends pushes pending counts through a's backends before another
// config's (or none) take over.
func (s *state) flushBackends(a *App) {
	a.flushOrigin()
	a.flushPropagation() // cross-region layer (mysql.go)
}

// setOrigin publishes the origin the engine uses now (nil: none), so the
// status and the metrics can read it. Whoever calls engine.SetOrigin calls
// this with the same origin.
func (l *liveApps) setOrigin(v originView) {
	if v == nil {
		l.origin.Store(nil)
		return
	}
	l.origin.Store(&v)
}

// currentOrigin returns the published origin, or nil.
func (l *liveApps) currentOrigin() originView {
	if p := l.origin.Load(); p != nil {
		return *p
	}
	return nil
}
