package integration

import (
	"fmt"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"
)

// TestFrozenRedis_ASharedKeyNearItsLimitCostsNoLatency: two Caddy
// processes share a key at 85 % of its limit, then Redis stops answering
// (SIGSTOP: it accepts connections and answers nothing). The request
// path's breaker opens within a second, and from then on decisions are
// local and cost no latency. A key near its limit is decided at Redis
// (a reservation), and a reservation first waits for the replay's write
// of the cell in flight: on a frozen Redis there always is one (the
// replay's breaker judges errors only, its writes wait out their own
// timeout, and the fast tick sends the cell again), so every request for
// the key waited the whole read_timeout (50 ms) before deciding locally,
// for as long as Redis stayed frozen (median 51.6 ms, p90 53 ms, with the
// breaker open, before the fix; now about 1 ms).
func TestFrozenRedis_ASharedKeyNearItsLimitCostsNoLatency(t *testing.T) {
	srv := redisAndCaddy(t, "runs two Caddy processes on Redis")
	global := "\t\tredis " + srv.URL()
	const limit = 1000
	site := keyedSite("z", limit, 10*time.Minute)
	nodes := []*node{startNode(t, global, site), startNode(t, global, site)}
	key := fmt.Sprintf("frozen-near-%d", time.Now().UnixNano())
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16}, Timeout: 5 * time.Second}
	// send offers rate requests a second for d, alternating between the
	// nodes, and returns the latencies of those sent after skip.
	send := func(rate int, d, skip time.Duration) []time.Duration {
		var mu sync.Mutex
		var lat []time.Duration
		var wg sync.WaitGroup
		start := time.Now()
		for i := 0; i < int(float64(rate)*d.Seconds()); i++ {
			time.Sleep(time.Until(start.Add(time.Duration(i) * time.Second / time.Duration(rate))))
			n := nodes[i%2]
			wg.Add(1)
			go func() {
				defer wg.Done()
				t0 := time.Now()
				if code := sendKey(client, n.url("/"), key); code != http.StatusOK {
					t.Errorf("status %d under the limit", code)
				}
				if el := time.Since(t0); time.Since(start) > skip {
					mu.Lock()
					lat = append(lat, el)
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		slices.Sort(lat)
		return lat
	}
	// 850 units, both nodes: the key is shared and at 85 % of its limit.
	send(200, 4250*time.Millisecond, 0)
	srv.Pause()
	t.Cleanup(srv.Resume)
	// 240 more while Redis is frozen (each node's local view stays under
	// the limit). The request path's breaker opens once 20 calls have
	// failed, each a read timeout, one call in flight per key: within 3 s.
	lat := send(40, 6*time.Second, 3*time.Second)
	srv.Resume()
	if len(lat) < 50 {
		t.Fatalf("only %d requests after the freeze's third second", len(lat))
	}
	med, p90 := lat[len(lat)/2], lat[len(lat)*9/10]
	open := nodes[0].metric(t, "caddy_ratelimit_origin_breaker_state", `breaker="ratelimit_origin",`, `state="open"`)
	t.Logf("Redis frozen, a shared key at 85-97 %% of its limit: %d requests after 3 s, median %s, p90 %s; request path's breaker open: %v",
		len(lat), med, p90, open)
	if open != 1 {
		t.Fatalf("the request path's breaker is not open with Redis frozen")
	}
	if med >= 10*time.Millisecond {
		t.Fatalf("median request %s with Redis frozen and the request path's breaker open; want under 10 ms (no added latency)", med)
	}
}
