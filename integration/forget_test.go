package integration

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// TestTwoCaddyProcesses_ForgetThenReadmit is the review's measurement with
// real processes: two nodes on one Redis, limit 100 per window, one
// key: 50 requests to A, DELETE /ratelimit/counters of the key on A, then
// 300 requests alternating A and B with a second DELETE on A half-way.
// Before per-incarnation records it admitted 139; the forgotten key's new
// cell stayed below A's old total in Redis and B never saw its units.
func TestTwoCaddyProcesses_ForgetThenReadmit(t *testing.T) {
	site, global := keyOnTwoNodes(t, 2)
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
	send := sender(t, client, &admitted)
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
	nearTheLimit(t, admitted, 350, "around two forgets on one node")
}

// TestTwoCaddyProcesses_RestartBothAtHalfTheLimit is a deploy mid-window:
// two nodes on one Redis take a key to 50 of its 100, both stop (their
// units replayed on the way out), and two new processes take over,
// alternating requests as fast as a client sends them. Both meet the key
// at half its limit at once, which the engine's
// TestNearLimit_PaceMeasuredWhileReservingIsNotTheLocalPace pins on a
// fake clock (109 of 100 before a key's own unreplayed units counted
// twice near the limit); this is the same with real processes and time.
func TestTwoCaddyProcesses_RestartBothAtHalfTheLimit(t *testing.T) {
	site, global := keyOnTwoNodes(t, 4)
	a, b := startNode(t, global, site), startNode(t, global, site)
	client := &http.Client{Timeout: 5 * time.Second}
	admitted := 0
	send := sender(t, client, &admitted)
	for i := 0; i < 50; i++ {
		send([]*node{a, b}[i%2])
	}
	a.stop()
	b.stop()
	if admitted != 50 {
		t.Fatalf("admitted %d of the first 50, below the limit of 100", admitted)
	}
	a, b = startNode(t, global, site), startNode(t, global, site)
	for i := 0; i < 150; i++ {
		send([]*node{a, b}[i%2])
	}
	nearTheLimit(t, admitted, 200, "around a restart of both nodes")
}

// keyOnTwoNodes starts a private Redis and returns the site of a zone z
// (key X-Key, limit 100) and the global options that put nodes on that
// Redis, with a window length whose current window leaves room for starts
// node starts and the requests, so all of them fall in one window. It
// skips the test in short mode.
func keyOnTwoNodes(t *testing.T, starts int) (site, global string) {
	t.Helper()
	srv := redisAndCaddy(t, "builds Caddy and runs Caddy processes")
	need := time.Duration(starts)*nodeStartTimeout + 15*time.Second
	window, fits := testclock.FreshWindow(time.Now(), need+10*time.Second, need+120*time.Second, need)
	if !fits {
		t.Fatalf("no window length in [%v, %v] leaves room for the test", need+10*time.Second, need+120*time.Second)
	}
	site = fmt.Sprintf(`	ratelimit {
		zone z {
			key    {http.request.header.X-Key}
			limit  100
			window %ds
		}
		headers off
	}
	respond "ok"`, int64(window/time.Second))
	return site, "\t\tredis " + srv.URL()
}

// sender returns a function that sends one request for key k to a node
// and counts the admitted ones in admitted; any status but 200 and 429
// fails the test.
func sender(t *testing.T, client *http.Client, admitted *int) func(*node) {
	return func(n *node) {
		switch code := sendKey(client, n.url("/"), "k"); code {
		case http.StatusOK:
			*admitted++
		case http.StatusTooManyRequests:
		default:
			t.Fatalf("status %d", code)
		}
	}
}

// nearTheLimit checks that admitted, of sent requests for one key, is the
// limit of 100, or at most 3 more (units another node admitted in the
// instant before its replay).
func nearTheLimit(t *testing.T, admitted, sent int, around string) {
	t.Helper()
	t.Logf("admitted %d of %d for a limit of 100, %s", admitted, sent, around)
	if admitted > 103 {
		t.Fatalf("admitted %d for a limit of 100 %s", admitted, around)
	}
	if admitted < 100 {
		t.Fatalf("admitted %d, fewer than the limit of 100", admitted)
	}
}
