package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// The Redis backend: the region's origin (package origin), which
// converges the counts of the Caddy processes of one region. Its status
// section and metrics are in redis_status.go.

// redisKind is the Redis backend among the app's backends.
var redisKind = backendKind{
	name:       "origin",
	lines:      redisLines,
	checkLines: checkRedisLines,
	validate: func(a *App) error {
		if a.Origin == nil {
			return nil
		}
		if c := a.Origin; len(c.Redis) == 0 && c.Cluster == nil && c.Sentinel == nil {
			// checkOrigin lets that pass for the Caddyfile's lines before
			// the address (checkRedisLines ends the block): a JSON config's
			// origin of tunables only passed validation and failed when
			// provisioned (FuzzApp_WhatValidatesProvisions).
			return errors.New("origin: no Redis configured: set redis, redis_cluster or redis_sentinel")
		}
		if err := checkOrigin(*a.Origin); err != nil {
			return fmt.Errorf("origin: %w", err)
		}
		return nil
	},
	configureEngine: func(a *App, cfg *engine.Config) {
		if a.Origin != nil {
			a.Origin.ApplyEngine(cfg)
		}
	},
	provision: provisionRedis,
	unuse: func(st *state) {
		st.engine.SetOrigin(nil)
		st.setOrigin(nil)
		overrides.setSource(sourceNode)
	},
	status:     redisStatus,
	collectors: originCollectors,
}

// redisLines are the origin's lines of the global option:
//
//	ratelimit {
//	    redis          <url>              # repeat: partitions
//	    redis_cluster  <addr> [<addr>…]
//	    redis_sentinel <master> <addr> [<addr>…]
//	    sentinel_username <name>          # after redis_sentinel
//	    sentinel_password <password>      # after redis_sentinel
//	    tls_ca_file    <file>
//	    prefix         <prefix>
//	    replay_workers <n>
//	    read_timeout   <duration>
//	    freshness      <duration>
//	    slow_tick      <duration>
//	    fast_tick      <duration>
//	    breaker_interval      <duration>
//	    breaker_timeout       <duration>
//	    breaker_min_requests  <n>
//	    breaker_failure_ratio <ratio>
//	    breaker_slow_call     <duration>
//	}
//
// Each line checks the whole origin config as it stands, so `caddy adapt`
// names the line that made it wrong.
var redisLines = func() []optionLine {
	lines := []optionLine{
		repeating(stringLine("redis", nil, func(a *App, u string) { originOf(a).Redis = append(originOf(a).Redis, u) })),
		argsLine("redis_cluster", 1, func(a *App, addrs []string) error {
			originOf(a).Cluster = &origin.ClusterConfig{Addrs: addrs}
			return nil
		}),
		argsLine("redis_sentinel", 0, func(a *App, args []string) error {
			if len(args) < 2 {
				return errString("redis_sentinel needs a master name and at least one sentinel address")
			}
			originOf(a).Sentinel = &origin.SentinelConfig{Master: args[0], Addrs: args[1:]}
			return nil
		}),
		sentinelLine("sentinel_username", func(s *origin.SentinelConfig, v string) { s.SentinelUsername = v }),
		sentinelLine("sentinel_password", func(s *origin.SentinelConfig, v string) { s.SentinelPassword = v }),
		stringLine("tls_ca_file", nil, func(a *App, v string) { originOf(a).TLSCAFile = v }),
		// An empty prefix, which would be the default one, is refused as
		// any empty value is (oneArg).
		stringLine("prefix", nil, func(a *App, v string) { originOf(a).Prefix = v }),
		intLine("replay_workers", 1, origin.MaxReplayWorkers, func(a *App, n int) { originOf(a).ReplayWorkers = n }),
		intLine("breaker_min_requests", 1, origin.MaxBreakerMinRequests, func(a *App, n int) { originOf(a).Breaker.MinRequests = n }),
		ratioLine("breaker_failure_ratio", func(a *App, r float64) { originOf(a).Breaker.FailureRatio = r }),
	}
	for _, d := range []struct {
		name string
		set  func(c *origin.Config, v origin.Duration)
	}{
		{"read_timeout", func(c *origin.Config, v origin.Duration) { c.ReadTimeout = v }},
		{"freshness", func(c *origin.Config, v origin.Duration) { c.Freshness = v }},
		{"slow_tick", func(c *origin.Config, v origin.Duration) { c.SlowTick = v }},
		{"fast_tick", func(c *origin.Config, v origin.Duration) { c.FastTick = v }},
		{"breaker_interval", func(c *origin.Config, v origin.Duration) { c.Breaker.Interval = v }},
		{"breaker_timeout", func(c *origin.Config, v origin.Duration) { c.Breaker.Timeout = v }},
		{"breaker_slow_call", func(c *origin.Config, v origin.Duration) { c.Breaker.SlowCall = v }},
	} {
		set := d.set
		lines = append(lines, durationLine(d.name, minDuration, func(a *App, v time.Duration) { set(originOf(a), origin.Duration(v)) }))
	}
	for i := range lines {
		lines[i] = checked(lines[i], func(a *App) error { return caddyfileBreakerNames(checkOrigin(*a.Origin)) })
	}
	return lines
}()

// sentinelLine is a line of the sentinels' own credentials, which the
// URLs of redis_sentinel do not carry (theirs are the master's): until
// 2026-11-29 only the JSON config could set them (an audit).
func sentinelLine(name string, set func(*origin.SentinelConfig, string)) optionLine {
	return optionLine{name: name, parse: func(d *caddyfile.Dispenser, a *App) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		if a.Origin == nil || a.Origin.Sentinel == nil {
			return d.Errf("%s needs a redis_sentinel line before it", name)
		}
		set(a.Origin.Sentinel, v)
		return nil
	}}
}

// caddyfileBreakerNames is err with the breaker settings named as the
// Caddyfile's lines (breaker_interval), not as the origin's JSON fields
// (breaker.interval), which the origin's checks name.
func caddyfileBreakerNames(err error) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	if rest, ok := strings.CutPrefix(msg, "breaker."); ok {
		return errors.New("breaker_" + rest)
	}
	return err
}

// checkRedisLines is the end of the block's check of the origin's lines
// (each line checks the whole origin config where it stands): tunables
// need an address to tune, and without one they would pass `caddy adapt`
// and fail only when the config is provisioned, with no line to point at.
func checkRedisLines(a *App, d *caddyfile.Dispenser) error {
	c := a.Origin
	if c == nil || len(c.Redis) > 0 || c.Cluster != nil || c.Sentinel != nil {
		return nil
	}
	for _, l := range redisLines {
		if at, ok := a.lineAt[l.name]; ok {
			return fmt.Errorf("Redis settings without a redis, redis_cluster or redis_sentinel line (%s at %s)", l.name, at)
		}
	}
	return d.Err("Redis settings without a redis, redis_cluster or redis_sentinel line")
}

// originOf returns the app's origin settings, made on the first line.
func originOf(a *App) *origin.Config {
	if a.Origin == nil {
		a.Origin = new(origin.Config)
	}
	return a.Origin
}

// redisBackend is one config's origin.
type redisBackend struct {
	a      *App
	origin *origin.Redis
	// engineOrigin is origin as the engine sees it: identifiers mapped to
	// their HMACs under identifier_secret.
	engineOrigin engine.Origin
	// timing is the config's read timeout, freshness and ticks, which the
	// engine follows while the origin is its.
	timing engine.Timing
	// stopOverrides ends the watch of the region's runtime overrides;
	// watchEnded is closed when it has.
	stopOverrides, watchEnded chan struct{}
	// watchState is the state the watch began on (close reads whether
	// that state still uses a Redis once the watch has ended).
	watchState *state
	// ownsLoad: provisioning began the process's first load of the
	// overrides, which the watch ends once started; started: it did.
	ownsLoad, started bool
	// heard is when the watch of the overrides last had every change of
	// the region (Unix ns; regionWatch.synced), for the origin's
	// breakers (origin.Options.HeardRegion).
	heard *atomic.Int64
}

// provisionRedis resolves the origin settings and builds the origin
// without dialling.
func provisionRedis(a *App) (backend, error) {
	if a.Origin == nil {
		return nil, nil
	}
	cfg, err := resolveOrigin(*a.Origin)
	if err != nil {
		return nil, err
	}
	routeRedisLog(&a.state.apps)
	opts := a.state.obs.originOptions()
	// The heartbeats measure Redis's clock against the one the engine
	// reads, so that the offset they find is the engine's.
	opts.Now = a.state.engine.ProcessClock()
	opts.Build = buildName()
	// The breakers the restart watch hears Redis through close once the
	// watch of the overrides has read the region since they opened: the
	// resets made meanwhile take the held units off before they are
	// written.
	heard := new(atomic.Int64)
	opts.HeardRegion = func() time.Time { return time.Unix(0, heard.Load()) }
	o, err := origin.New(cfg, opts)
	if err != nil {
		return nil, err
	}
	b := &redisBackend{a: a, origin: o, engineOrigin: o, heard: heard}
	if m := a.ids.mapper(); m != nil {
		b.engineOrigin = &mappedOrigin{Origin: o, mapID: m}
	}
	var ec engine.Config
	cfg.ApplyEngine(&ec)
	b.timing = engine.Timing{ReadTimeout: ec.ReadTimeout, Freshness: ec.Freshness, SlowTick: ec.SlowTick, FastTick: ec.FastTick}
	b.ownsLoad = overrides.beginLoad()
	return b, nil
}

// processesInterval is how often a node renews its record among the
// region's processes in Redis and reads how many there are (see
// origin.WatchProcesses).
const processesInterval = time.Second

// leaveTimeout bounds the exiting process's removal of its record.
const leaveTimeout = 250 * time.Millisecond

// start watches the region's runtime overrides (overrides_sync.go) and
// sets the origin watching its servers for a restart: Redis
// restarted empty lost every process's units, and the engine sends its
// cells' totals again (engine.Resend) while this origin is the one in use.
// Checked every slow tick, so within a flush period. It also records this
// node among the region's processes in Redis every processesInterval and
// tells the engine how many there are (engine.SetProcesses).
func (b *redisBackend) start() {
	b.started = true
	startedOrigin(b.origin)
	b.stopOverrides, b.watchEnded = make(chan struct{}), make(chan struct{})
	st := b.a.state
	b.watchState = st
	// The channel as it is now: close clears the field, and a config that
	// failed to start may be cleaned up before the goroutine runs.
	stop, ended := b.stopOverrides, b.watchEnded
	go func() {
		defer close(ended)
		b.watchOverrides(st, stop)
	}()
	lost := false // the watch calls both on its one goroutine
	builds := &buildsWatch{o: b.origin, log: b.a.logger}
	b.origin.WatchProcesses(processesInterval, func(n int64) {
		if n > 0 {
			builds.beat()
		}
		if st.currentOrigin() == originView(b.origin) {
			st.engine.SetProcesses(n)
			b.useClock(st)
		}
		if n > 0 && lost {
			lost = false
			b.a.logger.Info("counting the region's processes in Redis again", zap.Int64("processes", n))
		}
	}, func(err error) {
		lost = true
		b.a.logger.Warn("could not count the region's processes in Redis: keys that several processes meet at once are decided as before until it can", zap.Error(err))
	})
	b.origin.WatchRestarts(b.timing.SlowTick, func() {
		// Once the config runs alone (whenAlone): a config started beside
		// the running one may yet fail to start, and the first check of
		// servers the node never used finds no mark there. A restart seen
		// by an old config's watch is seen by the next config's of the same
		// servers too, which took its watch (use: TakeWatchFrom).
		st.whenAlone(b.a, func() {
			// The origin in use, or one of the same servers that took this
			// one's watch and is not in use yet (use: TakeWatchFrom comes
			// first); only one of a placement's watches tells at a time.
			if cur, _ := st.currentOrigin().(*origin.Redis); cur == b.origin || cur != nil && cur.Placement() == b.origin.Placement() {
				n := st.engine.Resend()
				b.a.logger.Warn("Redis restarted empty: sending every live key's count to it again", zap.Int("cells", n))
				if p := currentProp.Load(); p != nil {
					p.RegionLost() // and the other regions' counts, when this node holds the role
				}
			}
		})
	})
}

// clockWarnAt is the offset between this node's clock and Redis's from
// which taking Redis's clock is logged as a warning, not at info level:
// NTP keeps healthy clocks within milliseconds.
const clockWarnAt = time.Second

// useClock makes the engine decide on Redis's clock, as the origin's
// heartbeats measured it (origin.ClockOffset): every node of the region
// then counts in the same windows whatever its own clock says. Before the
// origin's first measurement the engine keeps the offset it has.
func (b *redisBackend) useClock(st *state) {
	d, ok := b.origin.ClockOffset()
	if !ok {
		return
	}
	old := st.takeRegionClock(d, b.origin.Placement())
	if d == old {
		return
	}
	overrides.republish() // what is live changed with the clock
	fields := []zap.Field{zap.Duration("offset", d), zap.Duration("was", old), zap.String("redis", b.origin.String())}
	if d.Abs() >= clockWarnAt {
		b.a.logger.Warn("this node's clock is off Redis's: deciding on Redis's clock, as the region's other nodes do (check NTP)", fields...)
	} else {
		b.a.logger.Info("deciding on Redis's clock", fields...)
	}
}

// use points the engine at the origin, with the config's timing, and
// publishes it to the status and the metrics.
//
// A reload to another placement (other servers, another partition, another
// prefix) hands the new one every cell's total: what the nodes replayed to
// the old servers is not in the new ones, where any node that reads a key
// (one started since, or one whose view lapsed) would have admitted it
// again. Writes are idempotent, so a key the new servers already hold
// from this process counts once. So does a reload that changes
// identifier_secret: every key's name in Redis is its HMAC.
func (b *redisBackend) use(st *state) {
	prev, _ := st.currentOrigin().(*origin.Redis)
	if prev != nil && prev.Placement() == b.origin.Placement() {
		// The same servers: what prev's watch saw is where this one's
		// starts, so that a restart between the two is seen.
		b.origin.TakeWatchFrom(prev)
		b.origin.TakeRegionFrom(prev)
	}
	st.engine.SetTiming(b.timing)
	st.engine.SetProcesses(b.origin.Processes()) // prev's of the same servers (TakeRegionFrom), else 0 until its first heartbeat: not another region's
	b.useClock(st)
	st.engine.SetOrigin(b.engineOrigin)
	st.setOrigin(b.origin)
	form := b.a.ids.form()
	prevForm := st.originForm.Swap(&form)
	switch {
	case prev == nil || prev == b.origin:
	case prev.Placement() != b.origin.Placement():
		from, to := prev.Placement(), b.origin.Placement()
		st.whenAlone(b.a, func() {
			st.engine.ResendAsync(func(n int) {
				b.a.logger.Info("Redis changed in a reload: writing every live key's count to the new servers",
					zap.String("from", from), zap.String("to", to), zap.Int("cells", n))
			})
		})
	case prevForm != nil && *prevForm != form:
		st.whenAlone(b.a, func() {
			st.engine.ResendAsync(func(n int) {
				b.a.logger.Info("identifier_secret changed in a reload: writing every live key's count under its new name in Redis",
					zap.Int("cells", n))
			})
		})
	}
}

// whenAlone runs f once a runs alone (liveApps.runsAlone), and never if
// a stops first: a config started beside the running one may yet fail to
// start, and every key's count written to its servers then, which the
// running config does not use, counted there on top of what that
// region's nodes count (TestCaddy_AReloadThatFailsToStartWritesNoCountToItsRedis).
// The caller may hold the apps' lock: f waits on a goroutine of its own.
// An app not started yet is waited for: a's backends start before the
// state records a as started (App.Start), and the restart watch's first
// check, at once, may find a restart in between. One stopped, or cleaned
// up, is not.
func (s *state) whenAlone(a *App, f func()) {
	go func() {
		seen := false
		for {
			alone, changed := s.apps.runsAlone(a)
			if alone {
				f()
				return
			}
			started, provisioned := s.apps.isStarted(a)
			if !provisioned || seen && !started {
				return
			}
			seen = seen || started
			<-changed
		}
	}()
}

// flush pushes the engine's pending deltas through the origin, the
// engine's until the app stops.
func (b *redisBackend) flush(st *state) {
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	if err := st.engine.Flush(ctx); err != nil {
		b.a.logger.Warn("flushing rate limit counts to the origin on stop", zap.Error(err))
	}
}

// letGo handles what is left for the origin when the engine has none any
// more (a reload without Redis, or shutdown): units admitted before that
// and not replayed yet go out through this origin, still open until the
// app is cleaned up (a newer config took the engine away from it without a
// flush), and those it could not take are given up, counted and logged,
// rather than left pending for an origin that may never come.
func (b *redisBackend) letGo(st *state, flushed bool) {
	if st.engine.Origin() != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	// The replay's writes still in flight end first: the last flush passes
	// over their cells, and the units those cells took meanwhile (or got
	// back from a write that failed) would wait for a replay that no
	// longer runs. Then every unit left goes out through this origin, once
	// more if a flush at the app's stop (flushed) went before, and what a
	// write of that gives back is among the units given up, never lost
	// unseen.
	st.engine.AwaitWrites(ctx)
	if err := st.engine.FlushTo(ctx, b.engineOrigin); err != nil {
		msg := "flushing rate limit counts to the origin the new config no longer uses"
		if flushed {
			msg = "flushing rate limit counts to the origin on stop"
		}
		b.a.logger.Warn(msg, zap.Error(err))
	}
	st.engine.AwaitWrites(ctx)
	if lost := st.engine.DropUnsent(); lost > 0 {
		b.a.logger.Warn("rate limit units admitted here could not be written to Redis before it was let go: the region never counts them",
			zap.Int64("units", lost))
	}
}

// close closes the origin; the state has detached it.
func (b *redisBackend) close() {
	if b.ownsLoad && !b.started {
		overrides.abortLoad()
	}
	if b.stopOverrides != nil {
		close(b.stopOverrides)
		b.stopOverrides = nil
		// A look under way ends within its read timeout: after the
		// config is gone, it would still write the process's book (its
		// source, the records it read) over the next config's.
		t := time.NewTimer(closeTimeout)
		select {
		case <-b.watchEnded:
		case <-t.C:
			b.a.logger.Warn("the watch of the region's runtime overrides did not end within 5 s of its config's unload")
		}
		t.Stop()
		// A reload to a config without Redis makes the book the node's
		// (unuse) before the old config's watch stops: a load that ended
		// in between recorded this Redis as the book's source again, and
		// the next config with it loaded the region's overrides beside
		// the node's own instead of joining the region, whose other
		// nodes never saw those (TestOverrides_ANodeJoiningTheRegionTakesItsOverrides,
		// now and then). Once the watch has ended, a state that uses no
		// Redis has the node's book.
		if st := b.watchState; st != nil && st.currentOrigin() == nil {
			overrides.setSource(sourceNode)
		}
	}
	retireOrigin(b.origin)
	if b.started && caddy.Exiting() {
		// The process exits: the region counts it no more from now, not
		// five seconds from now (a node restarted in a deploy would be
		// counted twice meanwhile). A reload's next origin goes on under
		// the same node ID, so a reload leaves its record be. Bounded
		// short: a Redis that does not answer must not hold up the exit.
		ctx, cancel := context.WithTimeout(context.Background(), leaveTimeout)
		if err := b.origin.Leave(ctx); err != nil {
			b.a.logger.Debug("leaving the region's processes in Redis: the record lapses in 5 s", zap.Error(err))
		}
		cancel()
	}
	if err := b.origin.Close(); err != nil {
		b.a.logger.Warn("closing the rate limit origin", zap.Error(err))
	}
}

// originView is what the status, the metrics and the counters route read
// of the origin in use; *origin.Redis implements it.
type originView interface {
	Stats() origin.Stats
	// Peek reads what the region holds of a cell, registering nothing.
	Peek(ctx context.Context, key engine.Key, seq int64) (engine.Totals, error)
}

// originInUse is the origin the engine uses now, for the status and the
// metrics: nil when local-only.
type originInUse struct{ v atomic.Pointer[originView] }

// setOrigin publishes the origin the engine uses now (nil: none). Whoever
// calls engine.SetOrigin calls this with the same origin.
func (s *state) setOrigin(v originView) {
	if v == nil {
		s.origin.v.Store(nil)
		return
	}
	s.origin.v.Store(&v)
}

// currentOrigin returns the published origin, or nil.
func (s *state) currentOrigin() originView {
	if p := s.origin.v.Load(); p != nil {
		return *p
	}
	return nil
}

// Interface guards.
var _ backend = (*redisBackend)(nil)
