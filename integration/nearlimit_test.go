package integration

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// metric returns the sum of every series of name in the node's /metrics
// whose labels contain every one of match.
func (n *node) metric(t *testing.T, name string, match ...string) float64 {
	t.Helper()
	resp, err := http.Get(fmt.Sprintf("http://localhost:%d/metrics", n.admin))
	if err != nil {
		t.Fatalf("scrape: %v", err)
	}
	defer resp.Body.Close()
	sum := 0.0
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name) || slices.ContainsFunc(match, func(m string) bool { return !strings.Contains(line, m) }) {
			continue
		}
		rest := line[len(name):]
		if rest[0] != ' ' && rest[0] != '{' {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			t.Fatalf("metric line %q: %v", line, err)
		}
		sum += v
	}
	return sum
}

// keyedSite is a site block with one zone keyed by the X-Key header, no
// rate limit headers, and "ok" for a request it admits.
func keyedSite(zone string, limit int, window time.Duration) string {
	return fmt.Sprintf(`	ratelimit {
		zone %s {
			key    {http.request.header.X-Key}
			limit  %d
			window %dms
		}
		headers off
	}
	respond "ok"`, zone, limit, window.Milliseconds())
}

// TestTwoCaddyProcesses_ExactNearASmallLimit is the scenario that showed two
// nodes over-admitting by 18 %: one key, limit 100 per 20 s or so, 300 requests
// alternated between two Caddy processes on one Redis by one client at
// about 1,000 a second. Ten runs, each on a fresh key: every run admits at
// most 102. (Faster, the bound grows with U, the units the other node admits
// in one replay interval: limit + max(0, U − limit/10); see the README.)
// The request path's round trips, counted by the engines and read from
// /metrics, are the cold read of each node plus the admissions decided at
// Redis.
func TestTwoCaddyProcesses_ExactNearASmallLimit(t *testing.T) {
	srv := redisAndCaddy(t, "builds Caddy and runs two processes")
	// The runs take a few seconds: a window that begins now holds them all.
	window, fits := testclock.FreshWindow(time.Now(), 20*time.Second, 120*time.Second, 2*nodeStartTimeout+15*time.Second)
	if !fits {
		t.Fatal("no window length in [20s, 120s] leaves room for the test")
	}
	windowEnd := time.UnixMilli((time.Now().UnixMilli()/window.Milliseconds() + 1) * window.Milliseconds())
	site := keyedSite("small", 100, window)
	// The scenario is the decisions of a Redis that answers: a read or a
	// reservation that times out (50 ms by default) or is slow (20 ms)
	// decides locally by design, which on a machine loaded by other tests
	// (a clean clone's CI run once admitted 104 with 6 decisions at Redis)
	// measures the machine. Generous bounds keep every call answered.
	global := "\t\tredis " + srv.URL() + "\n\t\tread_timeout 2s\n\t\tbreaker_slow_call 2s"
	nodes := []*node{startNode(t, global, site), startNode(t, global, site)}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}, Timeout: 5 * time.Second}
	for _, n := range nodes {
		sendKey(client, n.url("/"), "warm-up")
	}

	for run := 0; run < 10; run++ {
		key := fmt.Sprintf("run-%d", run)
		var syncBefore, resBefore [2]float64
		for i, n := range nodes {
			syncBefore[i] = n.metric(t, "caddy_ratelimit_sync_reads_total", "")
			resBefore[i] = n.metric(t, "caddy_ratelimit_reservations_total", "")
		}
		admitted := 0
		// About 1,000 requests a second, as the scenario was measured: one
		// client paced at one request a millisecond (a ticker drops the
		// ticks a slow request overran, so it never bursts to catch up).
		pace := time.NewTicker(time.Millisecond)
		for i := 0; i < 300; i++ {
			<-pace.C
			switch code := sendKey(client, nodes[i%2].url("/"), key); code {
			case http.StatusOK:
				admitted++
			case http.StatusTooManyRequests:
			default:
				t.Fatalf("run %d: status %d", run, code)
			}
		}
		pace.Stop()
		if time.Now().After(windowEnd) {
			t.Fatalf("run %d crossed the window's end; the scenario outlasted its window", run)
		}
		var reservations float64
		for i, n := range nodes {
			if d := n.metric(t, "caddy_ratelimit_sync_reads_total", "") - syncBefore[i]; d != 1 {
				t.Errorf("run %d: node %d waited for %v reads; want the cold one", run, i, d)
			}
			reservations += n.metric(t, "caddy_ratelimit_reservations_total", "") - resBefore[i]
		}
		// Since the nodes started, not this run's alone.
		calls := fmt.Sprintf("errors %v, %v slow calls, breakers open %v",
			nodes[0].metric(t, "caddy_ratelimit_reservations_total", `result="error"`)+nodes[1].metric(t, "caddy_ratelimit_reservations_total", `result="error"`),
			nodes[0].metric(t, "caddy_ratelimit_origin_slow_calls_total", "")+nodes[1].metric(t, "caddy_ratelimit_origin_slow_calls_total", ""),
			nodes[0].metric(t, "caddy_ratelimit_origin_breaker_state", `state="open"`)+nodes[1].metric(t, "caddy_ratelimit_origin_breaker_state", `state="open"`))
		t.Logf("run %d: %d of 300 admitted at a limit of 100; %v decisions made at Redis (%s)", run, admitted, reservations, calls)
		if admitted > 102 {
			for i, n := range nodes {
				if resp, err := http.Get(fmt.Sprintf("http://localhost:%d/ratelimit/status", n.admin)); err == nil {
					b, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					t.Logf("node %d status: %s", i, b)
				}
				resp, err := http.Get(fmt.Sprintf("http://localhost:%d/ratelimit/counters?zone=small&identifier=%s", n.admin, key))
				if err == nil {
					b, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					t.Logf("node %d: %s", i, b)
				}
			}
			keys, _ := srv.Client().Keys(context.Background(), "*"+key+"*").Result()
			for _, k := range keys {
				h, _ := srv.Client().HGetAll(context.Background(), k).Result()
				t.Logf("%s = %v", k, h)
			}
		}
		if admitted > 102 || admitted < 95 {
			t.Errorf("run %d: admitted %d at a limit of 100, want 95–102 (%v decisions at Redis; %s)", run, admitted, reservations, calls)
		}
		// The last tenth and the denials that a stale view let through to
		// Redis: never one per request.
		if reservations > 150 {
			t.Errorf("run %d: %v reservations for 300 requests", run, reservations)
		}
	}
}

// TestTwoCaddyProcesses_AViewBehindTheRegion is an audit's case: node A
// meets a key alone (two requests, its answers showing no other
// process), node B takes the key to its limit of 100 over the next 300
// ms, and then a burst comes to A. A's view of the key was fresh for a
// second, and A admitted 97 to 98 more before its own replay brought the
// region's count back. In a region of several processes a view older than
// two slow ticks is now read first: A admits nothing more, as one central
// count would.
func TestTwoCaddyProcesses_AViewBehindTheRegion(t *testing.T) {
	srv := redisAndCaddy(t, "builds Caddy and runs two processes")
	window, fits := testclock.FreshWindow(time.Now(), 30*time.Second, 120*time.Second, 2*nodeStartTimeout+20*time.Second)
	if !fits {
		t.Fatal("no window length in [30s, 120s] leaves room for the test")
	}
	site := keyedSite("behind", 100, window)
	global := "\t\tredis " + srv.URL()
	a, b := startNode(t, global, site), startNode(t, global, site)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 32}, Timeout: 5 * time.Second}
	for _, n := range []*node{a, b} {
		redistest.Eventually(t, 10*time.Second, "each node counts both processes", func() bool {
			return n.metric(t, "caddy_ratelimit_origin_processes", "") == 2
		})
	}
	for run := range 3 {
		key := fmt.Sprintf("behind-%d", run)
		for range 2 { // 250 ms apart: the key grows up in A
			if code := sendKey(client, a.url("/"), key); code != http.StatusOK {
				t.Fatalf("run %d: A's request: status %d", run, code)
			}
			time.Sleep(250 * time.Millisecond) // the scenario's pace, not a wait for a condition
		}
		seen := time.Now()
		pace := time.NewTicker(3 * time.Millisecond)
		for i := range 98 {
			<-pace.C
			if code := sendKey(client, b.url("/"), key); code != http.StatusOK {
				t.Fatalf("run %d: B's request %d: status %d below the limit", run, i, code)
			}
		}
		pace.Stop()
		redistest.Eventually(t, 5*time.Second, "B's units written to Redis", func() bool {
			return b.metric(t, "caddy_ratelimit_replay_pending_cells", "") == 0
		})
		time.Sleep(time.Until(seen.Add(400 * time.Millisecond))) // A's view at least 400 ms old
		var admitted atomic.Int64
		var wg sync.WaitGroup
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range 5 {
					if sendKey(client, a.url("/"), key) == http.StatusOK {
						admitted.Add(1)
					}
				}
			}()
		}
		wg.Wait()
		if n := admitted.Load(); n != 0 {
			t.Errorf("run %d: A admitted %d of a burst of 40 with the region at its limit of 100 (B's 98 written 300 ms after A's last answer)", run, n)
		}
	}
}
