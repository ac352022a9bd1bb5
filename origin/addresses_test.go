package origin

import (
	"fmt"
	"strings"
	"testing"
)

// TestConfig_ValidateAddresses is TestConfig_Validate's cases of where
// Redis is: the kinds, URLs, seeds and sentinels.
func TestConfig_ValidateAddresses(t *testing.T) {
	checkValidate(t, []validateCase{
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
	})
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
