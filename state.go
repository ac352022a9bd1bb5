package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// The process's one engine, shared by every config through the pool, and
// the registry of the configs' apps around it.

// pool holds the process's state: one engine whatever the configs.
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
	// origin is the origin the engine uses now (redis.go).
	origin originInUse
	// sized is the config the engine was made with: what sizes it for the
	// life of the process (sizeChanges).
	sized engine.Config
	// startedMs is when the engine was made (Unix ms), on the process's
	// clock (engine.ProcessClock, without the offset to the region's): a
	// reset made before it has none of its units to take off
	// (resetTakesHeld). startedAt is the same reading as a time, with the
	// monotonic clock's reading that time.Now gives it.
	startedMs int64
	startedAt time.Time
	// regionStartMs is when the engine was made on the region's clock
	// (Unix ms), fixed by the first heartbeat that measured it
	// (takeRegionClock); 0 until then. regionOf is the placement of the
	// Redis whose clock that is (origin.Redis.Placement): another region's
	// Redis, after a reload, fixes it again on its own clock.
	regionStartMs atomic.Int64
	regionMu      sync.Mutex
	regionOf      string
	// rowsAs is the name the engine's rows in MySQL are written under
	// (App.rowRegion), set when the first config's cross-region layer
	// starts: a reload may not change it (provisionMySQL).
	// originForm is how the identifiers of the origin last in use reach
	// its keys (identities.form: the identifier_secret's mark, "" for none):
	// a reload that changes it moves every key, as other servers do
	// (redisBackend.use).
	originForm atomic.Pointer[string]
	// publishedTo is where the cross-region layer last started publishing
	// the engine's cells: its DSN and identifier form (mysqlBackend.dest).
	publishedTo atomic.Pointer[string]
	rowsAs      atomic.Pointer[string]
	// dryRuns holds each zone's dry-run log line state (dryRunLog) by
	// zone name, for the engine's life: the zone's, not a handler's.
	dryRuns sync.Map // string → *dryRunLog
}

// dryRunLog returns the dry-run log line state of the zone named zone.
func (s *state) dryRunLog(zone string) *dryRunLog {
	if d, ok := s.dryRuns.Load(zone); ok {
		return d.(*dryRunLog)
	}
	d, _ := s.dryRuns.LoadOrStore(zone, new(dryRunLog))
	return d.(*dryRunLog)
}

// began records when the engine was made.
func (s *state) began() {
	s.startedAt = s.engine.ProcessClock()()
	s.startedMs = s.startedAt.UnixMilli()
}

// takeRegionClock makes the engine decide on the region's clock: its
// process's clock plus d, as a heartbeat measured it. It returns the
// offset the engine used before.
//
// The first measurement also fixes when the engine began on the region's
// clock: the region's time now less the time since. Later changes of the
// offset are steps of this process's wall clock (NTP stepping a clock
// that booted off, a resumed VM), which move the offset but not when the
// engine began: taken as the start on this process's clock plus the
// offset in use, a node whose clock booted an hour ahead and was stepped
// back took its start for an hour later than it was, and ignored the
// region resets made in that hour, and a node whose clock stepped forward
// took it for earlier, and dropped units admitted after a reset made
// before it began (TestReset_AfterTheNodesClockSteppedIsJudgedOnTheRegionsClock).
// The time since is the monotonic clock's where Config.Now is time.Now,
// so a step between the start and the first heartbeat (Redis unreachable
// at start, or a reload to the Redis of another place) does not move it
// either. placement names the Redis measured (origin.Redis.Placement).
func (s *state) takeRegionClock(d time.Duration, placement string) (old time.Duration) {
	s.regionMu.Lock()
	if s.regionStartMs.Load() == 0 || s.regionOf != placement {
		now := s.engine.ProcessClock()()
		s.regionStartMs.Store(now.Add(d).UnixMilli() - now.Sub(s.startedAt).Milliseconds())
		s.regionOf = placement
	}
	s.regionMu.Unlock()
	old = s.engine.ClockOffset()
	if d != old {
		s.engine.SetClockOffset(d)
	}
	return old
}

// startedRegionMs is when the engine was made, on the region's clock as
// well as it is known: before a heartbeat measured it, on this process's
// clock moved by the offset in use (0, or the last origin's).
func (s *state) startedRegionMs() int64 {
	if ms := s.regionStartMs.Load(); ms != 0 {
		return ms
	}
	return s.startedMs + s.engine.ClockOffset().Milliseconds()
}

// acquireState returns the process's state, creating its engine if this is
// the first user; every call must be matched by releaseState. The app of
// the first config sizes the engine (settings fixed for the life of the
// process: the entry cap, and each backend's, such as replay_workers).
func acquireState(a *App) (*state, error) {
	v, _, err := pool.LoadOrNew(poolKey, func() (caddy.Destructor, error) {
		st := new(state)
		cfg := newEngineConfig()
		if a != nil {
			a.configureEngine(&cfg)
		}
		st.obs.apps = &st.apps
		st.obs.observeEngine(&cfg)
		st.sized = cfg
		st.engine = engine.New(cfg)
		st.began()
		overrides.clock.use(st.engine)
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

// sizeChanges returns the settings a would size the engine with that
// differ from those it was made with (the entry cap and the replay
// workers), each as the engine's value and the config's: they wait for
// the process to start again, which the app logs.
func (s *state) sizeChanges(a *App) []zap.Field {
	want := newEngineConfig()
	a.configureEngine(&want)
	hasEntries, hasWorkers := engineSizes(s.sized)
	wantEntries, wantWorkers := engineSizes(want)
	var f []zap.Field
	if wantEntries != hasEntries {
		f = append(f, zap.Int("max_entries", hasEntries), zap.Int("config_max_entries", wantEntries))
	}
	if wantWorkers != hasWorkers {
		f = append(f, zap.Int("replay_workers", hasWorkers), zap.Int("config_replay_workers", wantWorkers))
	}
	return f
}

// engineSizes are the entry cap and the replay workers an engine made
// with cfg has, the engine's defaults in place of those cfg leaves out: a
// config without Redis sets no replay_workers, and its engine has the
// default all the same, as does one that writes max_entries 1000000.
func engineSizes(cfg engine.Config) (maxEntries, replayWorkers int) {
	maxEntries, replayWorkers = cfg.MaxEntries, cfg.ReplayWorkers
	if maxEntries <= 0 {
		maxEntries = engine.DefaultMaxEntries
	}
	if replayWorkers <= 0 {
		replayWorkers = engine.DefaultReplayWorkers
	}
	return maxEntries, replayWorkers
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
	overrides.clock.drop(s.engine)
	// The windows still counting, and the evictions since the last
	// warning, are reported as they stand, and their timers stopped.
	s.dryRuns.Range(func(_, d any) bool {
		d.(*dryRunLog).close()
		return true
	})
	s.obs.evictionsDue(nil)
	if err := s.engine.Close(ctx); err != nil {
		return fmt.Errorf("closing ratelimit engine: %w", err)
	}
	return nil
}

// lookupState returns the pooled state without taking a reference, or nil
// when no loaded config uses the limiter.
func lookupState() *state {
	var st *state
	pool.Range(func(_, v any) bool {
		st, _ = v.(*state)
		return st == nil
	})
	return st
}

// runningState returns the pooled state, or a 503 when no loaded config
// uses the limiter.
func runningState() (*state, error) {
	st := lookupState()
	if st == nil {
		return nil, caddy.APIError{
			HTTPStatus: http.StatusServiceUnavailable,
			Err:        errString("the rate limiter is not running: no loaded config uses it (a config that is loading is not in use until it has loaded)"),
		}
	}
	return st, nil
}

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
	// changed is closed, and made again, when started changes (runsAlone).
	changed chan struct{}

	cur atomic.Pointer[appView]
}

// appView is what the newest app says about the process.
type appView struct {
	app    *App
	logger *zap.Logger
	region string
	ids    identities
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
	l.startedChanged() // whenAlone's waiters on a end
}

func (l *liveApps) publish() {
	if len(l.provisioned) == 0 {
		l.cur.Store(nil)
		return
	}
	a := l.provisioned[len(l.provisioned)-1]
	l.cur.Store(&appView{app: a, logger: a.logger, region: a.Region, ids: a.ids})
	overrides.setMapping(a.ids.mapper(), a.ids.form())
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

// runsAlone tells whether a is the only started app: a reload to its
// config has completed (the old config stopped once every app of the new
// one had started), where a config started beside the running one may
// still fail to start and be stopped. The channel is closed at the next
// change of the started apps.
func (l *liveApps) runsAlone(a *App) (bool, <-chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.changed == nil {
		l.changed = make(chan struct{})
	}
	return len(l.started) == 1 && l.started[0] == a, l.changed
}

// isStarted tells whether a is started and not stopped, and whether it
// is provisioned and not cleaned up.
func (l *liveApps) isStarted(a *App) (started, provisioned bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Contains(l.started, a), slices.Contains(l.provisioned, a)
}

// startedChanged wakes those waiting in runsAlone (also when an app is
// cleaned up); l.mu is held.
func (l *liveApps) startedChanged() {
	if l.changed != nil {
		close(l.changed)
		l.changed = nil
	}
}

// start records a as the newest started app and makes its backends (or
// none) the engine's.
func (s *state) start(a *App) {
	l := &s.apps
	l.mu.Lock()
	defer l.mu.Unlock()
	l.started = append(l.started, a)
	l.startedChanged()
	s.useBackends(a)
}

// stop forgets a as started. If its backends are the engine's and no
// other app is started (a shutdown), they write what they hold first; then
// the newest remaining started app's backends take over (the running
// config's, when a is a new config that failed to start), and a's
// backends hear that they are let go. Stopping an app that is not started
// does nothing.
//
// The app's Stop leaves the only started app as it is (cleanup false):
// Caddy stops a config's apps in no set order, and the HTTP server may
// still be serving, and counting, when the rate limiter's Stop runs.
// Written and let go then, the units that came after were given up with
// Redis healthy, or counted locally and never sent. Its Cleanup, which
// Caddy runs once every app of the config has stopped, does it.
func (s *state) stop(a *App, cleanup bool) {
	l := &s.apps
	l.mu.Lock()
	defer l.mu.Unlock()
	i := slices.Index(l.started, a)
	if i < 0 || (!cleanup && len(l.started) == 1) {
		return
	}
	// A config stopped while an older one runs on failed to start: what
	// the engine holds goes to the running config's backends, which take
	// the engine back below. Written through the failed config's, it
	// reached servers the node does not use
	// (TestCaddy_AReloadThatFailsToStartWritesNoCountToItsRedis).
	flushed := i == len(l.started)-1 && len(l.started) == 1
	if flushed {
		a.eachBackend(func(b backend) { b.flush(s) })
	}
	l.started = slices.Delete(l.started, i, i+1)
	l.startedChanged()
	var next *App
	if n := len(l.started); n > 0 {
		next = l.started[n-1]
	}
	s.useBackends(next)
	a.eachBackend(func(b backend) { b.letGo(s, flushed) })
}

// useBackends points the engine at a's backends, kind by kind: a kind a
// does not configure (or a nil a) leaves the engine without one.
func (s *state) useBackends(a *App) {
	for _, k := range backendKinds {
		if b := a.backend(k); b != nil {
			b.use(s)
		} else {
			k.unuse(s)
		}
	}
}
