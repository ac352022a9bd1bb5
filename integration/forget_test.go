package integration

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// TestTwoCaddyProcesses_ForgetThenReadmit is the review's measurement with
// real processes: two nodes on one Redis, limit 100 per window, one
// key: 50 requests to A, DELETE /ratelimit/counters of the key on A, then
// 300 requests alternating A and B with a second DELETE on A half-way.
// Before per-incarnation records it admitted 139; the forgotten key's new
// cell stayed below A's old total in Redis and B never saw its units.
func TestTwoCaddyProcesses_ForgetThenReadmit(t *testing.T) {
	if testing.Short() {
		t.Skip("builds Caddy and runs two processes")
	}
	requireBinary(t, "redis-server")
	srv := redistest.Start(t)
	if _, err := caddyBinary(); err != nil {
		t.Fatal(err)
	}
	// A window length whose current window leaves room for both starts and
	// the 350 requests (a few seconds), so all of them fall in one window.
	window, fits := testclock.FreshWindow(time.Now(), 80*time.Second, 200*time.Second, 2*nodeStartTimeout+15*time.Second)
	if !fits {
		t.Fatal("no window length in [80s, 200s] leaves room for the test")
	}
	site := fmt.Sprintf(`	ratelimit {
		zone z {
			key    {http.request.header.X-Key}
			limit  100
			window %ds
		}
		headers off
	}
	respond "ok"`, int64(window/time.Second))
	global := "\t\tredis " + srv.URL()
	a, b := startNode(t, global, site), startNode(t, global, site)
	client := &http.Client{Timeout: 5 * time.Second}
	forget := func() {
		req, _ := http.NewRequest(http.MethodDelete, fmt.Sprintf("http://localhost:%d/ratelimit/counters?zone=z&identifier=k", a.admin), nil)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("DELETE on A: %d", resp.StatusCode)
		}
	}
	admitted := 0
	send := func(n *node) {
		switch code := sendKey(client, n.url("/"), "k"); code {
		case http.StatusOK:
			admitted++
		case http.StatusTooManyRequests:
		default:
			t.Fatalf("status %d", code)
		}
	}
	for i := 0; i < 50; i++ {
		send(a)
	}
	forget()
	for i := 0; i < 300; i++ {
		if i == 150 {
			forget()
		}
		send([]*node{a, b}[i%2])
	}
	t.Logf("admitted %d of 350 for a limit of 100", admitted)
	if admitted > 103 {
		t.Fatalf("admitted %d for a limit of 100 around two forgets on one node", admitted)
	}
	if admitted < 100 {
		t.Fatalf("admitted %d, fewer than the limit of 100", admitted)
	}
}
