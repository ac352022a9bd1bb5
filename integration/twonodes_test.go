package integration

import (
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// TestTwoCaddyProcesses_ShareOneRedis is the regional scenario with real
// processes: two Caddy nodes share one Redis, one key with a limit of
// 10,000 per 10 s, and 2,000 requests a second are offered evenly to both
// for one whole window. Together they must admit at most 5 over the limit.
func TestTwoCaddyProcesses_ShareOneRedis(t *testing.T) {
	if testing.Short() {
		t.Skip("builds Caddy and runs two processes for a 10 s window")
	}
	requireBinary(t, "redis-server")
	srv := redistest.Start(t)
	const limit = 10_000
	site := `	ratelimit {
		zone shared {
			key    {http.request.header.X-Key}
			limit  10000
			window 10s
		}
		headers off
	}
	respond "ok"`
	global := "\t\tredis " + srv.URL()
	nodes := []*node{startNode(t, global, site), startNode(t, global, site)}

	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256, MaxConnsPerHost: 256}, Timeout: 5 * time.Second}
	// Warm both nodes' connections on another key.
	for _, n := range nodes {
		for i := 0; i < 20; i++ {
			send(t, client, n.url("/"), "warm-up")
		}
	}

	// All traffic inside one fixed window, so the sliding window's
	// previous-cell weighting plays no part in the count.
	now := time.Now()
	start := now.Truncate(10 * time.Second).Add(10*time.Second + 20*time.Millisecond)
	time.Sleep(time.Until(start))
	end := start.Add(9800 * time.Millisecond)

	var ok, denied, other atomic.Int64
	var wg sync.WaitGroup
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	sem := make(chan struct{}, 256)
	for sent := 0; time.Now().Before(end); {
		<-tick.C
		// 2 requests per millisecond, one to each node, catching up on
		// ticks the scheduler dropped.
		due := int(time.Since(start)/time.Millisecond) * 2
		for ; sent < due; sent++ {
			n := nodes[sent%2]
			sem <- struct{}{}
			wg.Add(1)
			go func() {
				defer func() { <-sem; wg.Done() }()
				switch send(t, client, n.url("/"), "the-key") {
				case http.StatusOK:
					ok.Add(1)
				case http.StatusTooManyRequests:
					denied.Add(1)
				default:
					other.Add(1)
				}
			}()
		}
	}
	wg.Wait()
	total := ok.Load() + denied.Load() + other.Load()
	t.Logf("offered %d in %.1fs: %d admitted, %d denied, %d other", total, time.Since(start).Seconds(), ok.Load(), denied.Load(), other.Load())
	if other.Load() != 0 {
		t.Fatalf("%d requests failed with neither 200 nor 429", other.Load())
	}
	if total < 15_000 {
		t.Fatalf("only %d requests offered; the load generator fell behind", total)
	}
	if ok.Load() > limit+5 {
		t.Fatalf("admitted %d, more than %d + 5", ok.Load(), limit)
	}
	if ok.Load() < limit*95/100 {
		t.Fatalf("admitted %d of a limit of %d with twice the limit offered: the nodes under-admit", ok.Load(), limit)
	}
}

// send makes one GET with the key and returns the status (0 on error).
func send(t *testing.T, c *http.Client, url, key string) int {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Error(err)
		return 0
	}
	req.Header.Set("X-Key", key)
	resp, err := c.Do(req)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}
