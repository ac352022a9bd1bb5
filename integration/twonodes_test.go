package integration

import (
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// TestTwoCaddyProcesses_ShareOneRedis is the regional scenario with real
// processes: two Caddy nodes share one Redis, one key with a limit of
// 10,000 per window, and 2,000 requests a second are offered evenly to both
// for 9.8 s, all inside one window. Together they must admit at most 5 over
// the limit.
func TestTwoCaddyProcesses_ShareOneRedis(t *testing.T) {
	if testing.Short() {
		t.Skip("builds Caddy and runs two processes under load for 10 s")
	}
	requireBinary(t, "redis-server")
	srv := redistest.Start(t)
	const limit = 10_000
	// All traffic inside one fixed window, so the sliding window's
	// previous-cell weighting plays no part in the count. The nodes share
	// no clock with the test, so instead of sleeping to a window border the
	// window's length is chosen now: one whose current window just began
	// and leaves room for both nodes to start (up to 30 s each) and for
	// the load.
	if _, err := caddyBinary(); err != nil { // before the clock starts
		t.Fatal(err)
	}
	window, fits := testclock.FreshWindow(time.Now(), 100*time.Second, 160*time.Second, 2*nodeStartTimeout+loadDuration+10*time.Second)
	if !fits {
		t.Fatal("no window length in [100s, 160s] leaves room for the test")
	}
	site := fmt.Sprintf(`	ratelimit {
		zone shared {
			key    {http.request.header.X-Key}
			limit  %d
			window %ds
		}
		headers off
	}
	respond "ok"`, limit, int64(window/time.Second))
	global := "\t\tredis " + srv.URL()
	nodes := []*node{startNode(t, global, site), startNode(t, global, site)}

	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256, MaxConnsPerHost: 256}, Timeout: 5 * time.Second}
	// Warm both nodes' connections on another key.
	for _, n := range nodes {
		for i := 0; i < 20; i++ {
			sendKey(client, n.url("/"), "warm-up")
		}
	}

	start := time.Now()
	end := start.Add(loadDuration)
	if windowEnd := time.UnixMilli((start.UnixMilli()/window.Milliseconds() + 1) * window.Milliseconds()); end.After(windowEnd) {
		t.Fatalf("the load would end at %v, past the window's end at %v", end, windowEnd)
	}

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
				switch sendKey(client, n.url("/"), "the-key") {
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

// loadDuration is how long the load runs: 2,000 requests a second for it
// offer about twice the limit.
const loadDuration = 9800 * time.Millisecond
