package ratelimit

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
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

func init() {
	for name, parse := range originSubdirectives {
		appSubdirectives[name] = parse
	}
}

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
	redisLog.logger.Store(a.logger)
	redisLog.once.Do(func() {
		origin.SetLogger(func(format string, args ...any) {
			redisLog.logger.Load().Debug("redis client: " + fmt.Sprintf(format, args...))
		})
	})
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

// redisLog routes go-redis's own log lines (dial failures) to the newest
// config's logger, at debug: the breaker's state changes say the same at
// info. go-redis has one process-wide logger, set once; the logger it
// writes to is swapped atomically on every provisioning.
var redisLog struct {
	once   sync.Once
	logger atomic.Pointer[zap.Logger]
}

// resolveOrigin replaces runtime placeholders ({env.REDIS_URL}) in the
// addresses and secrets. Errors name the field, never its value.
func resolveOrigin(cfg origin.Config) (origin.Config, error) {
	repl := caddy.NewReplacer()
	resolve := func(field string, s string) (string, error) {
		if !strings.Contains(s, "{") {
			return s, nil
		}
		v, err := repl.ReplaceOrErr(s, true, true)
		if err != nil {
			return "", fmt.Errorf("%s: a placeholder did not resolve (unknown or empty)", field)
		}
		return v, nil
	}
	var err error
	resolveAll := func(field string, in []string) []string {
		out := make([]string, len(in))
		for i, s := range in {
			if err == nil {
				out[i], err = resolve(field, s)
			}
		}
		return out
	}
	cfg.Redis = resolveAll("redis", cfg.Redis)
	if cfg.Cluster != nil {
		c := *cfg.Cluster
		c.Addrs = resolveAll("redis_cluster", c.Addrs)
		cfg.Cluster = &c
	}
	if cfg.Sentinel != nil {
		s := *cfg.Sentinel
		s.Addrs = resolveAll("redis_sentinel", s.Addrs)
		if err == nil {
			s.SentinelPassword, err = resolve("redis_sentinel password", s.SentinelPassword)
		}
		cfg.Sentinel = &s
	}
	if err == nil {
		cfg.TLSCAFile, err = resolve("tls_ca_file", cfg.TLSCAFile)
	}
	return cfg, err
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

// mappedOrigin replaces identifiers by their HMAC on their way to the
// origin (identifier_secret), so Redis keys never hold a raw identifier.
type mappedOrigin struct {
	engine.Origin
	mapID func(string) string
}

func (m *mappedOrigin) Read(ctx context.Context, key engine.Key, seq int64) (int64, int64, error) {
	key.Identifier = m.mapID(key.Identifier)
	return m.Origin.Read(ctx, key, seq)
}

func (m *mappedOrigin) Flush(ctx context.Context, batch []engine.Delta) error {
	raw := make([]string, len(batch))
	for i := range batch {
		raw[i] = batch[i].Key.Identifier
		batch[i].Key.Identifier = m.mapID(raw[i])
	}
	err := m.Origin.Flush(ctx, batch)
	for i := range batch {
		batch[i].Key.Identifier = raw[i]
	}
	return err
}

// originSubdirectives parse the origin lines of the global option:
//
//	ratelimit {
//	    redis          <url>              # repeat: partitions
//	    redis_cluster  <addr> [<addr>…]
//	    redis_sentinel <master> <addr> [<addr>…]
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
//	}
//
// Each line is checked where it stands, so `caddy adapt` names its line.
var originSubdirectives = map[string]func(d *caddyfile.Dispenser, a *App) error{
	"redis": func(d *caddyfile.Dispenser, a *App) error {
		u, err := oneArg(d)
		if err != nil {
			return err
		}
		return a.setOrigin(d, func(c *origin.Config) { c.Redis = append(c.Redis, u) })
	},
	"redis_cluster": func(d *caddyfile.Dispenser, a *App) error {
		addrs := d.RemainingArgs()
		if len(addrs) == 0 {
			return d.ArgErr()
		}
		return a.setOrigin(d, func(c *origin.Config) { c.Cluster = &origin.ClusterConfig{Addrs: addrs} })
	},
	"redis_sentinel": func(d *caddyfile.Dispenser, a *App) error {
		args := d.RemainingArgs()
		if len(args) < 2 {
			return d.Errf("redis_sentinel needs a master name and at least one sentinel address")
		}
		return a.setOrigin(d, func(c *origin.Config) {
			c.Sentinel = &origin.SentinelConfig{Master: args[0], Addrs: args[1:]}
		})
	},
	"tls_ca_file":           stringOption(func(c *origin.Config, v string) { c.TLSCAFile = v }),
	"prefix":                stringOption(func(c *origin.Config, v string) { c.Prefix = v }),
	"replay_workers":        intOption(func(c *origin.Config, n int) { c.ReplayWorkers = n }),
	"breaker_min_requests":  intOption(func(c *origin.Config, n int) { c.Breaker.MinRequests = n }),
	"read_timeout":          durationOption(func(c *origin.Config, v origin.Duration) { c.ReadTimeout = v }),
	"freshness":             durationOption(func(c *origin.Config, v origin.Duration) { c.Freshness = v }),
	"slow_tick":             durationOption(func(c *origin.Config, v origin.Duration) { c.SlowTick = v }),
	"fast_tick":             durationOption(func(c *origin.Config, v origin.Duration) { c.FastTick = v }),
	"breaker_interval":      durationOption(func(c *origin.Config, v origin.Duration) { c.Breaker.Interval = v }),
	"breaker_timeout":       durationOption(func(c *origin.Config, v origin.Duration) { c.Breaker.Timeout = v }),
	"breaker_failure_ratio": ratioOption(func(c *origin.Config, r float64) { c.Breaker.FailureRatio = r }),
}

// setOrigin applies one line to the app's origin settings and checks the
// result, so the error carries this line.
func (a *App) setOrigin(d *caddyfile.Dispenser, set func(*origin.Config)) error {
	if a.Origin == nil {
		a.Origin = new(origin.Config)
	}
	set(a.Origin)
	if err := checkOrigin(*a.Origin); err != nil {
		return d.Errf("%v", err)
	}
	return nil
}

func stringOption(set func(*origin.Config, string)) func(*caddyfile.Dispenser, *App) error {
	return func(d *caddyfile.Dispenser, a *App) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		return a.setOrigin(d, func(c *origin.Config) { set(c, v) })
	}
}

func intOption(set func(*origin.Config, int)) func(*caddyfile.Dispenser, *App) error {
	return func(d *caddyfile.Dispenser, a *App) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			return d.Errf("%s: want a positive integer, got %q", d.Val(), v)
		}
		return a.setOrigin(d, func(c *origin.Config) { set(c, n) })
	}
}

func durationOption(set func(*origin.Config, origin.Duration)) func(*caddyfile.Dispenser, *App) error {
	return func(d *caddyfile.Dispenser, a *App) error {
		name := d.Val()
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		dur, err := caddy.ParseDuration(v)
		if err != nil || dur <= 0 {
			return d.Errf("%s: want a positive duration such as 50ms, got %q", name, v)
		}
		return a.setOrigin(d, func(c *origin.Config) { set(c, origin.Duration(dur)) })
	}
}

func ratioOption(set func(*origin.Config, float64)) func(*caddyfile.Dispenser, *App) error {
	return func(d *caddyfile.Dispenser, a *App) error {
		name := d.Val()
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		r, err := strconv.ParseFloat(v, 64)
		if err != nil || r <= 0 || r > 1 {
			return d.Errf("%s: want a ratio in (0, 1], got %q", name, v)
		}
		return a.setOrigin(d, func(c *origin.Config) { set(c, r) })
	}
}
