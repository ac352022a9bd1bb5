//go:build soak

package integration

import (
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The long forms of the multi-region scenarios, run by `make soak`: the
// default intervals (mysql_flush 1s, global_sync 5s, blocklist_sync 10s),
// the default one-minute window, several minutes of load. They print a
// table; SOAK_MINUTES sets the load's length (default 4).

const (
	soakFlush, soakGlobal, soakBlocklist = time.Second, 5 * time.Second, 10 * time.Second
)

func soakMinutes(t *testing.T) int {
	t.Helper()
	s := os.Getenv("SOAK_MINUTES")
	if s == "" {
		return 4
	}
	v, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil || v < 1 {
		t.Fatalf("SOAK_MINUTES=%q: want a positive whole number of minutes", s)
	}
	return v
}

// soakCluster is a cluster with the default intervals.
func soakCluster(t *testing.T, regions, nodes int, limit int64) *cluster {
	return startCluster(t, clusterSpec{regions: regions, nodes: nodes, limit: limit, window: time.Minute,
		flush: soakFlush, globalSync: soakGlobal, blocklistSync: soakBlocklist})
}

// TestSoak_EvenTraffic offers twice the limit, spread evenly over 2
// regions × 2 nodes, for several minutes, and checks each fixed window's
// admissions against limit + rate × 1.2 × (mysql_flush + global_sync).
func TestSoak_EvenTraffic(t *testing.T) {
	const limit = 3000
	rate := 2 * limit / 60 // twice the limit per one-minute window

	// Read before any server starts: a bad SOAK_MINUTES stops here.
	dur := time.Duration(soakMinutes(t)) * time.Minute
	c := soakCluster(t, 2, 2, limit)
	key := freshKey("soak-even")
	nodes := c.all()
	var mu sync.Mutex
	perWindow := map[int64][3]int64{} // window start → admitted, denied, other
	var wg sync.WaitGroup
	start := time.Now()
	interval := time.Second / time.Duration(rate)
	var sent atomic.Int64
	for i := 0; time.Since(start) < dur; i++ {
		time.Sleep(time.Until(start.Add(time.Duration(i) * interval)))
		n := nodes[i%len(nodes)]
		wg.Add(1)
		sent.Add(1)
		go func() {
			defer wg.Done()
			code := sendKey(loadClient, n.url("/"), key)
			w := time.Now().UnixMilli() / 60_000 * 60_000
			mu.Lock()
			v := perWindow[w]
			switch code {
			case http.StatusOK:
				v[0]++
			case http.StatusTooManyRequests:
				v[1]++
			default:
				v[2]++
			}
			perWindow[w] = v
			mu.Unlock()
		}()
	}
	wg.Wait()
	bound := limit + int64(float64(rate)*1.2*(soakFlush+soakGlobal).Seconds())
	fmt.Printf("\nsoak: 2 regions × 2 nodes, limit %d per 1m, %d req/s spread evenly, %s, defaults (flush %s, global_sync %s)\n",
		limit, rate, dur, soakFlush, soakGlobal)
	fmt.Printf("| window (UTC) | admitted | denied | other | bound |\n| --- | --- | --- | --- | --- |\n")
	var keys []int64
	for w := range perWindow {
		keys = append(keys, w)
	}
	sortInt64(keys)
	for _, w := range keys {
		v := perWindow[w]
		fmt.Printf("| %s | %d | %d | %d | %d |\n", time.UnixMilli(w).UTC().Format("15:04"), v[0], v[1], v[2], bound)
		if v[2] != 0 {
			t.Errorf("window %s: %d responses neither 200 nor 429", time.UnixMilli(w).UTC().Format("15:04"), v[2])
		}
		if v[0] > bound {
			t.Errorf("window %s: admitted %d > bound %d", time.UnixMilli(w).UTC().Format("15:04"), v[0], bound)
		}
	}
}

// TestSoak_BurstDeniedAtB measures, with the default intervals, how long a
// burst at A takes to be denied at B, a few times over.
func TestSoak_BurstDeniedAtB(t *testing.T) {
	c := soakCluster(t, 2, 1, 100)
	bound := time.Duration(1.2*float64(soakFlush+soakBlocklist)) + 250*time.Millisecond
	fmt.Printf("\nsoak: burst at A denied at B, defaults (flush %s, blocklist_sync %s), bound %s\n| run | latency |\n| --- | --- |\n",
		soakFlush, soakBlocklist, bound)
	for i := 0; i < 5; i++ {
		lat := denyLatency(t, c, freshKey("soak-burst"))
		fmt.Printf("| %d | %s |\n", i+1, lat.Round(time.Millisecond))
		if lat > bound {
			t.Errorf("run %d: %s > %s", i+1, lat, bound)
		}
	}
}

func sortInt64(s []int64) {
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
}
