package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// zoneRegistry tracks where each zone is defined. Zone names are global to
// the process, so within one config every definition of a zone must agree
// on what is counted (key, IP prefixes) and for how long (window); limits,
// costs and overrides may differ. Definitions of different configs do not
// conflict: a reload may redefine a zone, and the old config goes away.
type zoneRegistry struct {
	mu   sync.Mutex
	defs map[string][]zoneDef
}

// zoneDef is one handler's definition of a zone.
type zoneDef struct {
	app     *App // the config it belongs to
	handler *Handler
	ordinal int
	key     string
	window  time.Duration
	v4, v6  int
}

func (d zoneDef) sameCounting(o zoneDef) bool {
	return d.key == o.key && d.window == o.window && d.v4 == o.v4 && d.v6 == o.v6
}

func (d zoneDef) String() string {
	return fmt.Sprintf("key %q window %s ipv4_prefix %d ipv6_prefix %d (ratelimit handler #%d)",
		d.key, d.window, d.v4, d.v6, d.ordinal)
}

// register records every zone of h as defined in app's config, or records
// none and reports the first conflict.
func (r *zoneRegistry) register(app *App, h *Handler) error {
	ordinal := app.nextHandler()
	defs := make([]zoneDef, len(h.zones))
	for i := range h.zones {
		z := &h.zones[i]
		defs[i] = zoneDef{app: app, handler: h, ordinal: ordinal, key: z.key.raw, window: z.window, v4: z.v4, v6: z.v6}
	}

	r.mu.Lock()
	defer r.mu.Unlock()
	if r.defs == nil {
		r.defs = make(map[string][]zoneDef)
	}
	var errs []error
	for i := range h.zones {
		name := h.zones[i].name
		for _, prev := range r.defs[name] {
			if prev.app == app && !prev.sameCounting(defs[i]) {
				errs = append(errs, fmt.Errorf("zone %q is defined with %s and with %s: a zone counts one key over one window everywhere; use another zone name",
					name, prev, defs[i]))
				break
			}
		}
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	for i := range h.zones {
		name := h.zones[i].name
		r.defs[name] = append(r.defs[name], defs[i])
	}
	return nil
}

// unregister forgets every definition made by h.
func (r *zoneRegistry) unregister(h *Handler) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for name, defs := range r.defs {
		defs = slices.DeleteFunc(defs, func(d zoneDef) bool { return d.handler == h })
		if len(defs) == 0 {
			delete(r.defs, name)
		} else {
			r.defs[name] = defs
		}
	}
}

// definitions returns the live definitions of the zone, those of newest
// first (the config that speaks for the process), then the rest in
// provisioning order.
func (r *zoneRegistry) definitions(name string, newest *App) []zoneDef {
	r.mu.Lock()
	defs := slices.Clone(r.defs[name])
	r.mu.Unlock()
	slices.SortStableFunc(defs, func(a, b zoneDef) int {
		switch {
		case a.app == newest && b.app != newest:
			return -1
		case b.app == newest && a.app != newest:
			return 1
		}
		return 0
	})
	return defs
}

// statuses lists every defined zone once per key and window, by name.
func (r *zoneRegistry) statuses() []zoneStatus {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := []zoneStatus{}
	for name, defs := range r.defs {
		for _, d := range defs {
			zs := zoneStatus{Name: name, Key: d.key, WindowMs: d.window.Milliseconds()}
			if !slices.Contains(out, zs) {
				out = append(out, zs)
			}
		}
	}
	slices.SortFunc(out, func(a, b zoneStatus) int {
		if c := strings.Compare(a.Name, b.Name); c != 0 {
			return c
		}
		if c := strings.Compare(a.Key, b.Key); c != 0 {
			return c
		}
		return int(a.WindowMs - b.WindowMs)
	})
	return out
}

// defWindows are the distinct windows of defs, in order.
func defWindows(defs []zoneDef) []time.Duration {
	var ws []time.Duration
	for _, d := range defs {
		if !slices.Contains(ws, d.window) {
			ws = append(ws, d.window)
		}
	}
	return ws
}

// limitFor is the limit d's handler applies in zone name to the
// identifier id, normalized as the engine keeps it (a long one hashed): a
// runtime override first.
func (d zoneDef) limitFor(name, id string) int64 {
	if l, ok := normalizedRuntimeLimit(context.Background(), name, id); ok {
		return l
	}
	for i := range d.handler.zones {
		z := &d.handler.zones[i]
		if z.name != name {
			continue
		}
		if l, ok := fileOverride(z.overrides, id); ok {
			return l
		}
		return z.limit
	}
	return 0
}

// fileOverride is the Caddyfile override of the normalized identifier id.
// The overrides are keyed by the identifier as written, which the handler
// compares before normalizing; a hashed id (longer than any raw one kept)
// is matched by the hash of each long override, never by a key that is
// the hash's text. Admin path only: configs hold few long overrides.
func fileOverride(overrides map[string]int64, id string) (int64, bool) {
	if len(id) <= engine.MaxIdentifierLen {
		l, ok := overrides[id]
		return l, ok
	}
	for k, l := range overrides {
		if len(k) > engine.MaxIdentifierLen && engine.NormalizeIdentifier(k) == id {
			return l, true
		}
	}
	return 0, false
}
