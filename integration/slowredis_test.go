package integration

import (
	"fmt"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// TestSlowRedis_StopsCostingLatencyWithinFiveSeconds puts Redis behind a
// proxy that delays every reply by 30 ms. Every request for a new key would
// wait for a cold read; the request path's breaker counts each slow call as
// a failure and opens, after which decisions are local: within 5 s the
// median request is under 10 ms. Replay's breaker, which judges errors
// only, stays closed and the counts still reach Redis.
func TestSlowRedis_StopsCostingLatencyWithinFiveSeconds(t *testing.T) {
	if testing.Short() {
		t.Skip("builds Caddy")
	}
	requireBinary(t, "redis-server")
	srv := redistest.Start(t)
	proxy := redistest.StartDelayProxy(t, srv.Addr(), 30*time.Millisecond)
	site := `	ratelimit {
		zone slow {
			key    {http.request.header.X-Key}
			limit  1000
			window 1m
		}
	}
	respond "ok"`
	n := startNode(t, "\t\tredis "+proxy.URL(), site)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16}, Timeout: 5 * time.Second}

	start := time.Now()
	var late []time.Duration // requests in the fifth second
	var mu sync.Mutex
	var wg sync.WaitGroup
	var seq atomic.Int64
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Since(start) < 5*time.Second {
				key := fmt.Sprintf("cold-%d", seq.Add(1))
				t0 := time.Now()
				if code := sendKey(client, n.url("/"), key); code != http.StatusOK {
					t.Errorf("status %d", code)
					return
				}
				if d := time.Since(t0); time.Since(start) > 4*time.Second {
					mu.Lock()
					late = append(late, d)
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	if len(late) < 20 {
		t.Fatalf("only %d requests in the fifth second", len(late))
	}
	slices.Sort(late)
	med := late[len(late)/2]
	t.Logf("%d requests in the fifth second: median %s, p90 %s", len(late), med, late[len(late)*9/10])
	if med >= 10*time.Millisecond {
		t.Fatalf("median request %s in the fifth second with a 30 ms Redis; want under 10 ms", med)
	}
	if open := n.metric(t, "caddy_ratelimit_origin_breaker_state", `breaker="ratelimit_origin",`, `state="open"`); open != 1 {
		t.Fatalf("the request path's breaker is not open")
	}
	if open := n.metric(t, "caddy_ratelimit_origin_breaker_state", `breaker="ratelimit_origin_replay",`, `state="open"`); open != 0 {
		t.Fatalf("replay's breaker opened on a slow but working Redis")
	}
	// Replay still delivers: Redis sees the counts of the cold keys.
	redistest.Eventually(t, 10*time.Second, "replayed counts reach Redis", func() bool {
		keys, err := srv.Client().Keys(t.Context(), "ratelimit:{slow:cold-1}:*").Result()
		return err == nil && len(keys) > 0
	})
}

// TestRollover_ColdHerdOnOneCoreKeepsHealthyBreakersClosed runs Caddy on
// one core (GOMAXPROCS=1) and drives thousands of distinct keys across a
// window border, where every active key's new cell is cold at once. A
// healthy Redis must not look slow to the request path's breaker because
// of our own queueing: both breakers stay closed throughout.
func TestRollover_ColdHerdOnOneCoreKeepsHealthyBreakersClosed(t *testing.T) {
	if testing.Short() {
		t.Skip("builds Caddy")
	}
	requireBinary(t, "redis-server")
	srv := redistest.Start(t)
	site := `	ratelimit {
		zone herd {
			key    {http.request.header.X-Key}
			limit  1000
			window 1s
		}
	}
	respond "ok"`
	n := startNodeEnv(t, "\t\tredis "+srv.URL(), site, "GOMAXPROCS=1")
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64, MaxConnsPerHost: 64}, Timeout: 5 * time.Second}

	const keys = 3000
	start := time.Now()
	var wg sync.WaitGroup
	var failed atomic.Int64
	work := make(chan int)
	for w := 0; w < 64; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := range work {
				if code := sendKey(client, n.url("/"), fmt.Sprintf("user-%d", k)); code != http.StatusOK {
					failed.Add(1)
				}
			}
		}()
	}
	// Every key, over and over, for three 1 s windows: three rollovers of
	// a herd of cold cells.
	for time.Since(start) < 3*time.Second {
		for k := 0; k < keys; k++ {
			work <- k
		}
	}
	close(work)
	wg.Wait()
	if failed.Load() != 0 {
		t.Fatalf("%d requests failed", failed.Load())
	}
	reads := n.metric(t, "caddy_ratelimit_origin_calls_total", `op="read"`)
	transitions := n.metric(t, "caddy_ratelimit_origin_breaker_transitions_total", "")
	slow := n.metric(t, "caddy_ratelimit_origin_slow_calls_total", "")
	t.Logf("%v origin reads over three rollovers; %v slow calls; %v breaker transitions", reads, slow, transitions)
	if transitions != 0 {
		t.Fatalf("a healthy Redis tripped a breaker %v times during cold herds on one core", transitions)
	}
}

// startNodeEnv is startNode with extra environment variables for Caddy.
func startNodeEnv(t *testing.T, global, site string, env ...string) *node {
	t.Helper()
	old := extraEnv
	extraEnv = env
	defer func() { extraEnv = old }()
	return startNode(t, global, site)
}
