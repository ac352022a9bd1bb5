package origin

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

func TestConfig_Validate(t *testing.T) {
	for _, tc := range []struct {
		name    string
		cfg     Config
		wantErr string // empty: valid
	}{
		{"one partition", Config{Redis: []string{"redis://127.0.0.1:6379"}}, ""},
		{"tls partitions with credentials and db",
			Config{Redis: []string{"rediss://user:pw@a.example:6380/2", "rediss://b.example?skip_verify=true"}}, ""},
		{"cluster with URL and bare seeds", Config{Cluster: &ClusterConfig{Addrs: []string{"redis://:pw@10.0.0.1:7000", "10.0.0.2:7000"}}}, ""},
		{"sentinel", Config{Sentinel: &SentinelConfig{Master: "mymaster", Addrs: []string{"10.0.0.1:26379"}}}, ""},
		{"ipv6 host", Config{Redis: []string{"redis://[::1]:6379"}}, ""},

		{"nothing", Config{}, "no Redis configured"},
		{"two kinds", Config{Redis: []string{"redis://a"}, Cluster: &ClusterConfig{Addrs: []string{"b:1"}}}, "only one of"},
		{"duplicate partition", Config{Redis: []string{"redis://a:6379/0", "redis://user:pw@a:6379"}}, "already partition #1"},
		{"same server other db is another partition", Config{Redis: []string{"redis://a:6379/0", "redis://a:6379/1"}}, ""},
		{"bad scheme", Config{Redis: []string{"http://a"}}, "unsupported scheme"},
		{"no scheme", Config{Redis: []string{"a:6379"}}, "missing scheme"},
		{"no host", Config{Redis: []string{"redis://:6379"}}, "missing host"},
		{"bad port", Config{Redis: []string{"redis://a:0"}}, "invalid port"},
		{"bad db", Config{Redis: []string{"redis://a/x"}}, "invalid database number"},
		{"unknown parameter", Config{Redis: []string{"redis://a?pool_size=3"}}, `unsupported URL parameter "pool_size"`},
		{"skip_verify without tls", Config{Redis: []string{"redis://a?skip_verify=true"}}, "rediss:// only"},
		{"cluster without addresses", Config{Cluster: &ClusterConfig{}}, "at least one address"},
		{"cluster db", Config{Cluster: &ClusterConfig{Addrs: []string{"redis://a:1/3"}}}, "no databases"},
		{"cluster disagreeing credentials", Config{Cluster: &ClusterConfig{Addrs: []string{"redis://:x@a:1", "redis://:y@b:1"}}}, "must agree"},
		{"cluster duplicate", Config{Cluster: &ClusterConfig{Addrs: []string{"a:1", "redis://a:1"}}}, "listed twice"},
		{"cluster bare without port", Config{Cluster: &ClusterConfig{Addrs: []string{"a"}}}, "not host:port"},
		{"sentinel without master", Config{Sentinel: &SentinelConfig{Addrs: []string{"a:1"}}}, "master name"},
		{"prefix with brace", Config{Redis: []string{"redis://a"}, Prefix: "rl{x}"}, "prefix"},
		{"prefix with space", Config{Redis: []string{"redis://a"}, Prefix: "r l"}, "prefix"},
		{"negative workers", Config{Redis: []string{"redis://a"}, ReplayWorkers: -1}, "replay_workers"},
		{"negative timeout", Config{Redis: []string{"redis://a"}, ReadTimeout: -1}, "read_timeout"},
		{"fast tick above slow", Config{Redis: []string{"redis://a"}, FastTick: Duration(time.Second)}, "fast_tick"},
		{"ratio above one", Config{Redis: []string{"redis://a"}, Breaker: BreakerConfig{FailureRatio: 1.5}}, "failure_ratio"},
		{"tls_ca_file without rediss", Config{Redis: []string{"redis://a"}, TLSCAFile: "/ca.pem"}, "tls_ca_file"},
		{"negative min requests", Config{Redis: []string{"redis://a"}, Breaker: BreakerConfig{MinRequests: -1}}, "min_requests"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate()
			switch {
			case tc.wantErr == "" && err != nil:
				t.Fatalf("Validate: %v", err)
			case tc.wantErr != "" && err == nil:
				t.Fatalf("Validate accepted it; want an error containing %q", tc.wantErr)
			case tc.wantErr != "" && !strings.Contains(err.Error(), tc.wantErr):
				t.Fatalf("Validate: %v; want it to contain %q", err, tc.wantErr)
			}
		})
	}
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

func TestNew_DoesNotDial(t *testing.T) {
	// Nothing listens on port 1; New must succeed anyway (Caddy's validate
	// provisions without a network), and Close must not hang.
	o, err := New(Config{Redis: []string{"redis://127.0.0.1:1"}}, Options{})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if err := o.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
}

func TestRoute_IsStableAndIgnoresOrderAndCredentials(t *testing.T) {
	a, err := New(Config{Redis: []string{"redis://h1:1", "redis://h2:1", "redis://h3:1"}}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := New(Config{Redis: []string{"rediss://:pw@h3:1", "redis://h1:1/0", "redis://user@h2:1"}}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	for i := 0; i < 1000; i++ {
		k := engine.Key{Namespace: "z", Identifier: strings.Repeat("x", i%70) + string(rune('a'+i%26)), Window: time.Second}
		ea, eb := a.route(k), b.route(k)
		if ea.seed != eb.seed {
			t.Fatalf("%q routed to %s by one process and %s by another", k.Identifier, ea.address, eb.address)
		}
		k2 := k
		k2.Window = time.Hour
		if a.route(k2) != ea {
			t.Fatalf("%q: windows of one identifier on different partitions", k.Identifier)
		}
	}
}

func TestString_NamesAddressesNeverCredentials(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{Redis: []string{"redis://u:pw1@a:1/2", "rediss://:pw2@b:3"}}, "redis origin [redis://a:1/2 rediss://b:3/0]"},
		{Config{Cluster: &ClusterConfig{Addrs: []string{"rediss://:pw3@a:1", "b:2"}}}, "redis origin [rediss+cluster://a:1,b:2]"},
		{Config{Sentinel: &SentinelConfig{Master: "m", Addrs: []string{"redis://:pw4@a:1/5"}, SentinelPassword: "pw5"}},
			"redis origin [redis+sentinel://m@a:1/5]"},
	} {
		o, err := New(tc.cfg, Options{})
		if err != nil {
			t.Fatal(err)
		}
		if got := o.String(); got != tc.want || strings.Contains(got, "pw") {
			t.Errorf("String() = %q, want %q", got, tc.want)
		}
		_ = o.Close()
	}
}

func TestConfig_OneServerSpelledTwoWaysIsOnePartition(t *testing.T) {
	for _, pair := range [][2]string{
		{"redis://127.0.0.1:6379", "redis://127.0.0.1:06379"},
		{"redis://cache.example:6379", "redis://CACHE.Example.:6379"},
		{"redis://[::1]:6379", "redis://[0:0:0:0:0:0:0:1]:6379"},
		{"redis://127.0.0.1:6379", "redis://[::ffff:127.0.0.1]:6379"},
		{"redis://10.0.0.1", "redis://10.0.0.1:6379/0"},
	} {
		err := Config{Redis: []string{pair[0], pair[1]}}.Validate()
		if err == nil || !strings.Contains(err.Error(), "already partition #1") {
			t.Errorf("%s and %s: %v, want one partition named twice", pair[0], pair[1], err)
		}
	}
	a, err := New(Config{Redis: []string{"redis://a.example:6379", "redis://b.example:6379"}}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := New(Config{Redis: []string{"redis://B.EXAMPLE:06379", "redis://a.example"}}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	defer b.Close()
	for i := 0; i < 200; i++ {
		k := key(fmt.Sprint("tenant-", i))
		if a.route(k).address != b.route(k).address {
			t.Fatalf("%v placed on %s by one process and %s by another", k, a.route(k).address, b.route(k).address)
		}
	}
}
