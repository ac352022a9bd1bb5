package origin

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

func TestConfig_Validate(t *testing.T) {
	checkValidate(t, []validateCase{
		{"one partition", Config{Redis: []string{"redis://127.0.0.1:6379"}}, ""},
		{"prefix with brace", Config{Redis: []string{"redis://a"}, Prefix: "rl{x}"}, "prefix"},
		{"prefix with space", Config{Redis: []string{"redis://a"}, Prefix: "r l"}, "prefix"},
		{"negative workers", Config{Redis: []string{"redis://a"}, ReplayWorkers: -1}, "replay_workers"},
		{"negative timeout", Config{Redis: []string{"redis://a"}, ReadTimeout: -1}, "read_timeout"},
		{"fast tick above slow", Config{Redis: []string{"redis://a"}, FastTick: Duration(time.Second)}, "fast_tick"},
		{"ratio above one", Config{Redis: []string{"redis://a"}, Breaker: BreakerConfig{FailureRatio: 1.5}}, "failure_ratio"},
		{"tls_ca_file without rediss", Config{Redis: []string{"redis://a"}, TLSCAFile: "/ca.pem"}, "tls_ca_file"},
		{"negative min requests", Config{Redis: []string{"redis://a"}, Breaker: BreakerConfig{MinRequests: -1}}, "min_requests"},
		// The breaker counts calls in 32 bits: 2^32 was a sample of 0, a
		// breaker that tripped on the first failed call.
		{"min requests past 32 bits", Config{Redis: []string{"redis://a"}, Breaker: BreakerConfig{MinRequests: 1 << 32}}, "min_requests"},
		{"min requests at 32 bits", Config{Redis: []string{"redis://a"}, Breaker: BreakerConfig{MinRequests: 1<<32 - 1}}, ""},
	})
}

func TestConfig_JSONAndDefaults(t *testing.T) {
	var c Config
	js := `{"redis":["redis://a:1"],"read_timeout":"20ms","freshness":2000000000,"replay_workers":4,
		"breaker":{"timeout":"3s","min_requests":10}}`
	if err := json.Unmarshal([]byte(js), &c); err != nil {
		t.Fatalf("Unmarshal: %v", err)
	}
	if err := json.Unmarshal([]byte(`{"read_timeout":"soon"}`), &Config{}); err == nil {
		t.Fatal("a malformed duration was accepted")
	}
	var ec engine.Config
	c.ApplyEngine(&ec)
	if ec.ReadTimeout != 20*time.Millisecond || ec.Freshness != 2*time.Second || ec.ReplayWorkers != 4 ||
		ec.SlowTick != engine.DefaultSlowTick || ec.FastTick != engine.DefaultFastTick {
		t.Fatalf("ApplyEngine: %+v", ec)
	}
	d := c.WithDefaults()
	if d.Prefix != DefaultPrefix || time.Duration(d.Breaker.Timeout) != 3*time.Second || d.Breaker.MinRequests != 10 ||
		time.Duration(d.Breaker.Interval) != DefaultBreakerInterval || d.Breaker.FailureRatio != DefaultBreakerFailureRatio {
		t.Fatalf("WithDefaults: %+v", d)
	}
}

// TestConfig_DurationsUnderAMillisecondAreRejected: the Caddyfile takes no
// duration under 1ms (the engine counts in milliseconds), but a JSON config
// skips its parser, and Validate took any positive duration: a fast_tick of
// 1ns was a replay loop firing without pause, and a request near its limit
// re-read Redis every time (the tick, in whole milliseconds, was 0).
func TestConfig_DurationsUnderAMillisecondAreRejected(t *testing.T) {
	a := []string{"redis://a"}
	const ns = Duration(time.Millisecond - 1)
	checkValidate(t, []validateCase{
		{"read_timeout", Config{Redis: a, ReadTimeout: ns}, "read_timeout"},
		{"freshness", Config{Redis: a, Freshness: ns}, "freshness"},
		{"slow_tick", Config{Redis: a, SlowTick: ns, FastTick: ns}, "slow_tick"},
		{"fast_tick", Config{Redis: a, FastTick: 1}, "fast_tick"},
		{"breaker.interval", Config{Redis: a, Breaker: BreakerConfig{Interval: 1}}, "breaker.interval"},
		{"breaker.timeout", Config{Redis: a, Breaker: BreakerConfig{Timeout: 1}}, "breaker.timeout"},
		{"breaker.slow_call", Config{Redis: a, Breaker: BreakerConfig{SlowCall: 1}}, "breaker.slow_call"},
		{"one millisecond", Config{Redis: a, FastTick: Duration(time.Millisecond), Freshness: Duration(time.Millisecond)}, ""},
	})
}

// TestConfig_DurationsPastTheirBoundAreRejected: no tunable had an upper
// bound but read_timeout: `slow_tick 1000000h` passed `caddy adapt`, and
// a node so configured never sent its units to the region (nor could the
// engine's sum of its ticks be trusted not to overflow). Each bound is
// taken; a nanosecond past it is refused, naming the setting.
func TestConfig_DurationsPastTheirBoundAreRejected(t *testing.T) {
	a := []string{"redis://a"}
	past := func(d time.Duration) Duration { return Duration(d + 1) }
	checkValidate(t, []validateCase{
		{"read_timeout", Config{Redis: a, ReadTimeout: past(MaxReadTimeout)}, "read_timeout: at most"},
		{"freshness", Config{Redis: a, Freshness: past(MaxFreshness)}, "freshness: at most"},
		{"slow_tick", Config{Redis: a, SlowTick: past(MaxTick)}, "slow_tick: at most"},
		{"fast_tick", Config{Redis: a, SlowTick: past(MaxTick), FastTick: past(MaxTick)}, "at most"},
		{"breaker.interval", Config{Redis: a, Breaker: BreakerConfig{Interval: past(MaxBreakerInterval)}}, "breaker.interval: at most"},
		{"breaker.timeout", Config{Redis: a, Breaker: BreakerConfig{Timeout: past(MaxBreakerTimeout)}}, "breaker.timeout: at most"},
		{"breaker.slow_call", Config{Redis: a, Breaker: BreakerConfig{SlowCall: past(MaxBreakerSlowCall)}}, "breaker.slow_call: at most"},
		{"a million hours", Config{Redis: a, SlowTick: Duration(1000000 * time.Hour)}, "slow_tick: at most"},
		{"every bound itself", Config{Redis: a, ReadTimeout: Duration(MaxReadTimeout), Freshness: Duration(MaxFreshness),
			SlowTick: Duration(MaxTick), FastTick: Duration(MaxTick), Breaker: BreakerConfig{Interval: Duration(MaxBreakerInterval),
				Timeout: Duration(MaxBreakerTimeout), SlowCall: Duration(MaxBreakerSlowCall)}}, ""},
	})
}
