package ratelimit

import (
	"context"
	"slices"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// fakeBackend records the calls the state makes.
type fakeBackend struct {
	name  string
	calls *[]string
}

func (b *fakeBackend) note(what string) { *b.calls = append(*b.calls, b.name+" "+what) }
func (b *fakeBackend) start()           { b.note("start") }
func (b *fakeBackend) use(*state)       { b.note("use") }
func (b *fakeBackend) flush(*state)     { b.note("flush") }
func (b *fakeBackend) letGo(_ *state, f bool) {
	b.note(map[bool]string{true: "letGo flushed", false: "letGo"}[f])
}
func (b *fakeBackend) close() { b.note("close") }

// TestBackends_TheEngineFollowsTheNewestStartedApp walks one kind of
// backend through a reload, a failed one and a shutdown: the newest app
// started and not stopped has the engine; an app that stops while its
// backend is the engine's flushes it first, but for a new config that
// failed to start, which hands the engine back to the running one's
// unflushed (it wrote to servers the node does not use); every app
// hears it is let go; a kind an app does not configure leaves the engine
// without one.
func TestBackends_TheEngineFollowsTheNewestStartedApp(t *testing.T) {
	var calls []string
	kind := &backendKind{name: "fake", unuse: func(*state) { calls = append(calls, "unuse") },
		checkLines: func(*App, *caddyfile.Dispenser) error { return nil }, validate: func(*App) error { return nil },
		configureEngine: func(*App, *engine.Config) {}, status: func(*state) any { return nil },
		collectors: []prometheus.Collector{}}
	old := backendKinds
	backendKinds = []*backendKind{kind}
	t.Cleanup(func() { backendKinds = old })

	st := &state{engine: engine.New(engine.Config{Manual: true})}
	t.Cleanup(func() { _ = st.engine.Close(context.Background()) })
	app := func(name string, with bool) *App {
		a := &App{state: st, backends: []backend{nil}}
		if with {
			a.backends[0] = &fakeBackend{name: name, calls: &calls}
		}
		return a
	}
	a, b, c, d := app("A", true), app("B", true), app("C", false), app("D", true)
	step := func(what string, f func(), want ...string) {
		t.Helper()
		calls = nil
		f()
		if !slices.Equal(calls, want) {
			t.Fatalf("%s: calls %q, want %q", what, calls, want)
		}
	}
	step("A starts", func() { st.start(a) }, "A use")
	step("reload: B starts", func() { st.start(b) }, "B use")
	step("B failed: stopped", func() { st.stop(b, false) }, "A use", "B letGo")
	step("B again", func() { st.start(b) }, "B use")
	step("the reload ends: A stops", func() { st.stop(a, false) }, "B use", "A letGo")
	step("a reload without the kind", func() { st.start(c) }, "unuse")
	step("B stops", func() { st.stop(b, false) }, "unuse", "B letGo")
	step("C stops, the last", func() { st.stop(c, false) })
	step("C is cleaned up", func() { st.stop(c, true) }, "unuse")
	step("stopping twice does nothing", func() { st.stop(c, true) })
	// The last config's backends write and are let go at its Cleanup,
	// once its HTTP server no longer serves: not at its Stop.
	step("D starts", func() { st.start(d) }, "D use")
	step("D stops, the only config", func() { st.stop(d, false) })
	step("D is cleaned up", func() { st.stop(d, true) }, "D flush", "unuse", "D letGo flushed")
}
