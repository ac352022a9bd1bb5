package engine

import (
	"strconv"
	"sync"
	"testing"
	"time"
)

// TestEngine_NewKeysCountedExactlyWhileTablesGrow decides 60,000 keys
// (8,000 under the race detector) from four goroutines at once, each key
// once per goroutine, while the janitor passes over the zone without
// pause: the zone's table grows thirteen times (ten) beside the decisions
// and the passes (see grow), and every key ends with one entry holding
// exactly four units.
func TestEngine_NewKeysCountedExactlyWhileTablesGrow(t *testing.T) {
	e, _ := newTestEngine(t, manual(Config{}))
	z := e.Zone("zone", time.Hour)
	keys, workers := 60_000, 4
	if raceEnabled {
		keys = 8_000 // the detector slows every step many times over
	}
	var wg sync.WaitGroup
	stop := make(chan struct{})
	go func() {
		for {
			select {
			case <-stop:
				return
			default:
				e.Sweep()
			}
		}
	}()
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := range keys {
				id := "k" + strconv.Itoa((k*7+w*13)%keys)
				l := lim(id, time.Hour, 1<<40, 1)
				l.Zone = z
				e.Decide(bg, l)
			}
		}()
	}
	wg.Wait()
	close(stop)
	for k := range keys {
		id := "k" + strconv.Itoa(k)
		l := lim(id, time.Hour, 1<<40, 0)
		l.Zone = z
		d := e.Decide(bg, l)
		if used := (1 << 40) - d.Remaining; used != int64(workers) {
			t.Fatalf("%s: %d units counted, want %d", id, used, int64(workers))
		}
	}
	if n := e.live.Load(); n != int64(keys) {
		t.Fatalf("%d live entries for %d keys", n, keys)
	}
}
