package origin

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// MaxReadTimeout bounds read_timeout: every request of a key that must
// read waits up to it when Redis does not answer, and a Redis that takes
// longer is one to decide without.
const MaxReadTimeout = 10 * time.Second

// The longest durations the tunables take. Past them a setting is a
// mistake (an hour typed for a millisecond) rather than a choice, and the
// engine's sums of them (a flush period: a slow tick and two fast ones)
// could overflow.
const (
	// MaxTick bounds slow_tick and fast_tick: a node's units reach the
	// region's other nodes a tick late, and until then they admit that
	// long's traffic of a key unseen.
	MaxTick = time.Minute
	// MaxFreshness bounds freshness: a node decides on a view of the
	// region's counts that old.
	MaxFreshness = time.Minute
	// MaxBreakerInterval bounds breaker_interval, the span over which a
	// closed breaker counts failures.
	MaxBreakerInterval = time.Hour
	// MaxBreakerTimeout bounds breaker_timeout: a Redis that is back is
	// not tried for that long.
	MaxBreakerTimeout = 10 * time.Minute
	// MaxBreakerSlowCall bounds breaker_slow_call: a call is cut at its
	// timeout (a read's at most MaxReadTimeout) before it could be slower.
	MaxBreakerSlowCall = MaxReadTimeout
)

// MinDuration is the shortest duration any setting takes (0 is the
// default): the engine counts in milliseconds, so a shorter tick is a
// loop without pause and a shorter timeout or freshness is 0. The
// Caddyfile parser says the same; this is the check of a JSON config.
const MinDuration = time.Millisecond

// MaxReplayWorkers bounds replay_workers: each is a goroutine that may
// hold a connection of its own, started with the engine, and past a few
// dozen more of them only queue at Redis, which runs one command at a time.
const MaxReplayWorkers = 256

// Defaults of the breaker settings. Each says why.
const (
	// DefaultBreakerInterval is the rolling window over which the breaker
	// counts calls: long enough to hold a meaningful sample at ten replay
	// ticks a second, short enough that successes from before an outage do
	// not mask it.
	DefaultBreakerInterval = 10 * time.Second
	// DefaultBreakerTimeout is how long an open breaker keeps decisions
	// local before one probe tries Redis again: a restarting Redis is back
	// within seconds, and every probe that fails costs a request no latency
	// (the probe is a background read or a replay).
	DefaultBreakerTimeout = 5 * time.Second
	// DefaultBreakerMinRequests is the smallest sample on which the breaker
	// may trip: a handful of timeouts in a quiet second is noise, not an
	// outage.
	DefaultBreakerMinRequests = 20
	// MaxBreakerMinRequests bounds breaker.min_requests: the breaker
	// counts calls in 32 bits, and a larger sample wrapped (2^32 was 0,
	// a breaker that tripped on the first failed call).
	MaxBreakerMinRequests = math.MaxUint32
	// DefaultBreakerFailureRatio trips the breaker when at least half of the
	// sampled calls failed. A ratio, not a count: a busy node making many
	// calls must not trip on the same absolute number of failures that would
	// be an outage for a quiet one.
	DefaultBreakerFailureRatio = 0.5
	// DefaultBreakerSlowCall is the request-path round trip past which a
	// call counts as failed: a regional Redis answers in about a millisecond,
	// and a Redis twenty times slower costs every cold or near-limit request
	// more than the limiter is worth; replay is not judged by it.
	DefaultBreakerSlowCall = 20 * time.Millisecond
)

// Config is the regional origin's configuration: where Redis is, how keys
// are named, how the breaker behaves, and the engine's tunables that only
// matter when an origin is configured. It is the JSON shape of the
// `ratelimit` global option's Redis settings; exactly one of Redis, Cluster
// and Sentinel must be set.
//
// Passwords belong in the URLs (or SentinelPassword) and should come from
// runtime placeholders such as {env.REDIS_URL}, resolved by the caller before
// New: a {$VAR} substituted at adapt time would put the password into the
// JSON config that the admin API serves. Nothing in this package prints a
// password: errors, String and Stats show addresses only.
type Config struct {
	// Redis lists standalone servers as redis:// or rediss:// URLs
	// (redis://[user:password@]host[:port][/db]). Several URLs are
	// partitions: each (namespace, identifier) is placed on one of them by
	// rendezvous hashing of its address (host:port/db), so every process of
	// a region must list the same addresses; the order does not matter, and
	// adding or removing one partition moves only the keys it gains or loses.
	Redis []string `json:"redis,omitempty"`
	// Cluster is a Redis Cluster.
	Cluster *ClusterConfig `json:"redis_cluster,omitempty"`
	// Sentinel is a master monitored by Redis Sentinel.
	Sentinel *SentinelConfig `json:"redis_sentinel,omitempty"`

	// TLSCAFile is a PEM file of the certificate authorities that sign the
	// servers' certificates, for rediss:// addresses (default: the system's
	// roots).
	TLSCAFile string `json:"tls_ca_file,omitempty"`

	// Prefix starts every key (default "ratelimit"). It may not contain
	// braces, spaces or control characters.
	Prefix string `json:"prefix,omitempty"`

	// ReplayWorkers is the number of concurrent flushes of the fast tier
	// (default 8, at most MaxReplayWorkers); the slow tier flushes one
	// batch at a time.
	ReplayWorkers int `json:"replay_workers,omitempty"`
	// ReadTimeout bounds every synchronous origin read on the request path
	// (default 50ms).
	ReadTimeout Duration `json:"read_timeout,omitempty"`
	// Freshness is how long a read or replay keeps a cell fresh (default 1s).
	Freshness Duration `json:"freshness,omitempty"`
	// SlowTick is the replay interval of keys below half their limit
	// (default 100ms).
	SlowTick Duration `json:"slow_tick,omitempty"`
	// FastTick is the replay interval of keys at half their limit or more
	// (default 10ms).
	FastTick Duration `json:"fast_tick,omitempty"`

	// Breaker configures the circuit breaker of each endpoint.
	Breaker BreakerConfig `json:"breaker,omitempty"`
}

// ClusterConfig names a Redis Cluster by some of its nodes.
type ClusterConfig struct {
	// Addrs are seed nodes, as host:port or as redis:// / rediss:// URLs.
	// Credentials and TLS come from the URLs; every URL must agree on them,
	// and bare host:port seeds use the same.
	Addrs []string `json:"addrs,omitempty"`
}

// SentinelConfig names a master monitored by Redis Sentinel.
type SentinelConfig struct {
	// Master is the master's name as the sentinels know it.
	Master string `json:"master,omitempty"`
	// Addrs are the sentinels, as host:port or as redis:// / rediss://
	// URLs. Credentials, TLS and the database number in the URLs are those
	// of the master (and its replicas); every URL must agree on them.
	Addrs []string `json:"addrs,omitempty"`
	// SentinelUsername and SentinelPassword authenticate to the sentinels
	// themselves, when they require it.
	SentinelUsername string `json:"sentinel_username,omitempty"`
	SentinelPassword string `json:"sentinel_password,omitempty"`
}

// BreakerConfig configures the circuit breaker of each endpoint.
type BreakerConfig struct {
	// Interval is the rolling window over which calls are counted
	// (default 10s).
	Interval Duration `json:"interval,omitempty"`
	// Timeout is how long the breaker stays open before a probe (default
	// 5s).
	Timeout Duration `json:"timeout,omitempty"`
	// MinRequests is the smallest number of completed calls in the window on
	// which the breaker may trip (default 20).
	MinRequests int `json:"min_requests,omitempty"`
	// FailureRatio trips the breaker when at least this share of the
	// completed calls in the window failed, in (0, 1] (default 0.5).
	FailureRatio float64 `json:"failure_ratio,omitempty"`
	// SlowCall is the round trip past which a request-path call (a read or
	// a reservation) counts as failed for its breaker (default 20ms).
	// Replay's breaker counts errors only.
	SlowCall Duration `json:"slow_call,omitempty"`
}

// Duration is a time.Duration that reads from JSON either as a Go duration
// string ("50ms") or as an integer of nanoseconds, as caddy.Duration does.
type Duration time.Duration

// UnmarshalJSON implements json.Unmarshaler.
func (d *Duration) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return fmt.Errorf("duration: %w", err)
		}
		v, err := time.ParseDuration(s)
		if err != nil {
			return fmt.Errorf("duration: %w", err)
		}
		*d = Duration(v)
		return nil
	}
	var n int64
	if err := json.Unmarshal(b, &n); err != nil {
		return fmt.Errorf("duration: %w", err)
	}
	*d = Duration(n)
	return nil
}

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	if c.Prefix == "" {
		c.Prefix = DefaultPrefix
	}
	if c.ReplayWorkers == 0 {
		c.ReplayWorkers = engine.DefaultReplayWorkers
	}
	if c.ReadTimeout == 0 {
		c.ReadTimeout = Duration(engine.DefaultReadTimeout)
	}
	if c.Freshness == 0 {
		c.Freshness = Duration(engine.DefaultFreshness)
	}
	if c.SlowTick == 0 {
		c.SlowTick = Duration(engine.DefaultSlowTick)
	}
	if c.FastTick == 0 {
		c.FastTick = Duration(engine.DefaultFastTick)
	}
	if c.Breaker.Interval == 0 {
		c.Breaker.Interval = Duration(DefaultBreakerInterval)
	}
	if c.Breaker.Timeout == 0 {
		c.Breaker.Timeout = Duration(DefaultBreakerTimeout)
	}
	if c.Breaker.MinRequests == 0 {
		c.Breaker.MinRequests = DefaultBreakerMinRequests
	}
	if c.Breaker.FailureRatio == 0 {
		c.Breaker.FailureRatio = DefaultBreakerFailureRatio
	}
	if c.Breaker.SlowCall == 0 {
		c.Breaker.SlowCall = Duration(DefaultBreakerSlowCall)
	}
	return c
}

// ApplyEngine copies the engine tunables of c (after defaults) into ec:
// ReadTimeout, Freshness, SlowTick, FastTick and ReplayWorkers.
func (c Config) ApplyEngine(ec *engine.Config) {
	c = c.WithDefaults()
	ec.ReadTimeout = time.Duration(c.ReadTimeout)
	ec.Freshness = time.Duration(c.Freshness)
	ec.SlowTick = time.Duration(c.SlowTick)
	ec.FastTick = time.Duration(c.FastTick)
	ec.ReplayWorkers = c.ReplayWorkers
}

// Validate reports the first thing wrong with c, naming the field. It does
// no network I/O. Its messages never contain a password.
func (c Config) Validate() error {
	specs, err := c.endpoints()
	if err != nil {
		return err
	}
	if c.TLSCAFile != "" && !slices.ContainsFunc(specs, func(s endpointSpec) bool { return s.tls }) {
		return errors.New("tls_ca_file: set, but no address uses rediss://")
	}
	if err := validatePrefix(c.Prefix); err != nil {
		return err
	}
	if c.ReplayWorkers < 0 || c.ReplayWorkers > MaxReplayWorkers {
		return fmt.Errorf("replay_workers: want an integer from 1 to %d, got %d", MaxReplayWorkers, c.ReplayWorkers)
	}
	for _, f := range []struct {
		name string
		v    Duration
		max  time.Duration
		why  string
	}{
		{"read_timeout", c.ReadTimeout, MaxReadTimeout, "a request waits that long for a Redis that does not answer"},
		{"freshness", c.Freshness, MaxFreshness, "a node would decide on a view of the region's counts that old"},
		{"slow_tick", c.SlowTick, MaxTick, "the region's other nodes would admit that long's traffic of a key unseen"},
		{"fast_tick", c.FastTick, MaxTick, "the region's other nodes would admit that long's traffic of a key unseen"},
		{"breaker.interval", c.Breaker.Interval, MaxBreakerInterval, "the span over which a closed breaker counts failures"},
		{"breaker.timeout", c.Breaker.Timeout, MaxBreakerTimeout, "a Redis that is back would not be tried for that long"},
		{"breaker.slow_call", c.Breaker.SlowCall, MaxBreakerSlowCall, "a call is cut at its timeout before it could be slower"},
	} {
		switch {
		case f.v < 0:
			return fmt.Errorf("%s: must not be negative, got %s", f.name, time.Duration(f.v))
		case f.v > 0 && f.v < Duration(MinDuration):
			return fmt.Errorf("%s: at least %s, got %s", f.name, MinDuration, time.Duration(f.v))
		case time.Duration(f.v) > f.max:
			return fmt.Errorf("%s: at most %s, got %s: %s", f.name, f.max, time.Duration(f.v), f.why)
		}
	}
	d := c.WithDefaults()
	if d.FastTick > d.SlowTick {
		return fmt.Errorf("fast_tick (%s) must not be longer than slow_tick (%s)",
			time.Duration(d.FastTick), time.Duration(d.SlowTick))
	}
	if c.Breaker.MinRequests < 0 {
		return fmt.Errorf("breaker.min_requests: must be positive, got %d", c.Breaker.MinRequests)
	}
	if c.Breaker.MinRequests > MaxBreakerMinRequests {
		return fmt.Errorf("breaker.min_requests: at most %d, got %d", MaxBreakerMinRequests, c.Breaker.MinRequests)
	}
	if r := c.Breaker.FailureRatio; r < 0 || r > 1 {
		return fmt.Errorf("breaker.failure_ratio: must be in (0, 1], got %g", r)
	}
	return nil
}

func validatePrefix(p string) error {
	for i := 0; i < len(p); i++ {
		c := p[i]
		if c == '{' || c == '}' || c <= ' ' || c == 0x7f {
			return fmt.Errorf("prefix: %q may not contain braces, spaces or control characters", p)
		}
	}
	return nil
}
