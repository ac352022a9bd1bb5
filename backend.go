package ratelimit

import (
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// A backend is what an app adds to the process's engine: the region's
// Redis (the origin, redis.go) or MySQL between regions (the cross-region
// layer, mysql.go). The app holds a list of them and knows nothing else of
// either; the state hands the engine from one config's backends to the
// next one's (state.go). Adding a backend is its own files and a line in
// backendKinds.
//
// Lifecycle of one config's backend across reloads: the app's Provision
// builds it without dialling (`caddy validate` provisions configs it never
// runs); Start starts its work and the state makes it the engine's (use);
// the engine uses the backends of the newest config started and not
// stopped, so a reload swaps them around the same counters, a reload
// without one leaves the engine without that kind, and a new config that
// fails to start hands the engine back; Stop writes what it holds if it is
// still the engine's (flush) and hears that it is let go (letGo); Cleanup
// closes it.
type backend interface {
	// start begins the backend's own work (loops, watches) when its app
	// starts.
	start()
	// use makes the backend the engine's.
	use(st *state)
	// flush writes what the engine holds for the backend, while it is still
	// the engine's, before another config's takes over or the process stops.
	flush(st *state)
	// letGo runs when the backend's app stops, once the engine has been
	// handed on (to another config's backend of this kind, or none);
	// flushed tells whether flush ran first.
	letGo(st *state, flushed bool)
	// close releases what provisioning took; the app is cleaned up.
	close()
}

// backendKind is what the app knows of one kind of backend.
type backendKind struct {
	// name is the kind's section in the status document.
	name string
	// lines are the kind's lines of the global option (options.go).
	lines []optionLine
	// checkLines is the end-of-block check of the kind's lines: the block's
	// lines together (one needs another), reported at d.
	checkLines func(a *App, d *caddyfile.Dispenser) error
	// validate checks the app's settings of the kind (JSON configs too).
	validate func(a *App) error
	// configureEngine applies the kind's settings that size a new engine
	// (fixed for the life of the process).
	configureEngine func(a *App, cfg *engine.Config)
	// provision builds the app's backend of the kind, without any I/O; nil
	// when the app configures none.
	provision func(a *App) (backend, error)
	// unuse leaves the engine without a backend of the kind.
	unuse func(st *state)
	// status is the kind's section of the status document: nil (JSON null)
	// when the engine uses none.
	status func(st *state) any
	// collectors export the kind's metrics.
	collectors []prometheus.Collector
}

// backendKinds are the kinds of backend, in the order they are provisioned
// and started: the cross-region layer reads what the origin's settings
// say (a node without Redis is its own region there).
var backendKinds = []*backendKind{&redisKind, &mysqlKind}

// backend returns a's backend of kind k, or nil (for a nil a too).
func (a *App) backend(k *backendKind) backend {
	if a == nil {
		return nil
	}
	for i, kk := range backendKinds {
		if kk == k && i < len(a.backends) {
			return a.backends[i]
		}
	}
	return nil
}

// eachBackend calls f with each of a's backends.
func (a *App) eachBackend(f func(b backend)) {
	for _, b := range a.backends {
		if b != nil {
			f(b)
		}
	}
}
