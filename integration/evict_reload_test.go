package integration

import (
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// TestTwoCaddyProcesses_AFloodAcrossReloadsKeepsBusyKeysAtTheirLimit: two
// Caddy processes on one Redis, each with a cap of 16 keys, take a flood
// of one-off keys beside three busy keys, while one of them is reloaded
// again and again: each reload gives the engine, which outlives it, a new
// config's Redis client while the janitor evicts and writes the evicted
// keys' units. No busy key admits past its limit across the two, no unit
// is counted as lost, and once both have replayed, Redis holds exactly
// the units they admitted. Eviction had been tested with real processes
// only without reloads (flood_test.go drives engines, not Caddy).
func TestTwoCaddyProcesses_AFloodAcrossReloadsKeepsBusyKeysAtTheirLimit(t *testing.T) {
	srv := redisAndCaddy(t, "builds Caddy and runs Caddy processes")
	const (
		limit  = 20
		busy   = 3
		flood  = 400 // one-off keys a process
		reload = 8   // reloads of the first process during the flood
	)
	need := 2*nodeStartTimeout + 30*time.Second
	window, fits := testclock.FreshWindow(time.Now(), need+10*time.Second, need+120*time.Second, need)
	if !fits {
		t.Fatalf("no window length in [%v, %v] leaves room for the test", need+10*time.Second, need+120*time.Second)
	}
	site := fmt.Sprintf(`	ratelimit {
		zone z {
			key    {http.request.header.X-Key}
			limit  %d
			window %ds
		}
		on_missing_key skip
		headers off
	}
	respond "ok"`, limit, int64(window/time.Second))
	global := "\t\tredis " + srv.URL() + "\n\t\tmax_entries 16\n\t\tfast_tick 10ms"
	nodes := []*node{startNode(t, global, site), startNode(t, global, site)}
	// A connection per request, with no retry by the client: a reload
	// resets a few connections the old server had accepted (EOF, reset
	// by peer), and a request that gets no answer may or may not have
	// been counted. Those are counted apart, as unknown.
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}

	var mu sync.Mutex
	busyAdmitted, busyUnknown := make([]int64, busy), make([]int64, busy)
	var floodAdmitted, floodUnknown int64
	var wg sync.WaitGroup
	for ni, n := range nodes {
		wg.Go(func() {
			for i := range flood {
				key, h := fmt.Sprintf("flood-%d-%d", ni, i), -1
				if i%4 == 0 {
					h = (i / 4) % busy
					key = fmt.Sprintf("busy-%d", h)
				}
				code := sendKey(client, n.url("/"), key) // 0: no answer
				mu.Lock()
				switch {
				case code == http.StatusOK && h >= 0:
					busyAdmitted[h]++
				case code == http.StatusOK:
					floodAdmitted++
				case code == http.StatusTooManyRequests:
				case code == 0 && h >= 0:
					busyUnknown[h]++
				case code == 0:
					floodUnknown++
				default:
					t.Errorf("node %d, %s: status %d", ni, key, code)
				}
				mu.Unlock()
			}
		})
	}
	reloads := 0
	wg.Go(func() {
		for range reload {
			if code, body := nodes[0].reload(t); code != http.StatusOK {
				t.Errorf("reload: %d %s", code, body)
				return
			}
			reloads++
			time.Sleep(50 * time.Millisecond)
		}
	})
	wg.Wait()
	if t.Failed() {
		return
	}
	var evicted float64
	for _, n := range nodes {
		evicted += n.metric(t, "caddy_ratelimit_evictions_total")
	}
	if evicted == 0 {
		t.Fatalf("no eviction with %d keys a process past a cap of 16", flood)
	}
	var admitted, unknown int64
	for h := range busy {
		admitted += busyAdmitted[h]
		unknown += busyUnknown[h]
	}
	admitted, unknown = admitted+floodAdmitted, unknown+floodUnknown
	if unknown > 2*flood/20 {
		t.Fatalf("%d of %d requests got no answer across the reloads: too few answers to count by", unknown, 2*flood)
	}
	var lost float64
	redistest.EventuallyShow(t, 20*time.Second, "Redis holds every unit admitted", func() (bool, string) {
		pending := 0.0
		lost = 0
		for _, n := range nodes {
			pending += n.metric(t, "caddy_ratelimit_replay_pending_cells")
			lost += n.metric(t, "caddy_ratelimit_replay_lost_units_total")
		}
		got := redisUnits(t, srv, "ratelimit")
		return pending == 0 && got >= admitted && got <= admitted+unknown,
			fmt.Sprintf("Redis holds %d units, %d admitted and %d unknown, %v cells pending, %v units counted as lost", got, admitted, unknown, pending, lost)
	})
	if lost != 0 {
		t.Errorf("%v units counted as lost with Redis up", lost)
	}
	// Redis holds each busy key's units exactly (above), so a busy key
	// that admitted past its limit holds more than the limit there.
	for h := range busy {
		got := redisUnits(t, srv, fmt.Sprintf("ratelimit:{z:busy-%d}", h))
		if got > limit || got < busyAdmitted[h] || got > busyAdmitted[h]+busyUnknown[h] {
			t.Errorf("busy key %d: Redis holds %d units, %d admitted and %d unknown across the two processes, limit %d", h, got, busyAdmitted[h], busyUnknown[h], limit)
		}
	}
	t.Logf("busy keys admitted %v (unknown %v), %d one-off keys (unknown %d); %v evictions, %d reloads", busyAdmitted, busyUnknown, floodAdmitted, floodUnknown, evicted, reloads)
}
