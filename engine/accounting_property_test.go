package engine

import (
	"context"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// TestProperty_EveryUnitIsSentOrCountedAsLost drives two manual engines,
// two processes sharing one origin, through random sequences of what a
// gateway's life holds for its counts: requests of keys that come and
// go, a clock that moves on by less or more than a window (and steps
// back), an origin that fails and recovers, reloads without it and back,
// replay queues of a cell or three, the janitor's sweeps and evictions
// past a cap of eight keys, forgets and resends. At the end the origin is
// back and the engines close: every unit they admitted reached the origin
// or was counted as lost (Stats.LostUnits), none vanished. Each of the
// accounting races fixed on 2026-11-28 (TestReplay_AFastMarkAsTheSlowReplay…,
// TestResend_GivesAnOriginRestartedEmptyTheUnitsOfAnEvictedKeyBack,
// TestSweep_AFailedWriteOfAPreviousCell…,
// TestRead_APreviousCellTheOriginReplaces…) lost units this way.
// RATELIMIT_ACCOUNTING_RUNS sets the number of sequences (default 300).
func TestProperty_EveryUnitIsSentOrCountedAsLost(t *testing.T) {
	runs := 300
	if v, err := strconv.Atoi(os.Getenv("RATELIMIT_ACCOUNTING_RUNS")); err == nil && v > 0 {
		runs = v
	}
	base := rand.Uint64()
	for run := range runs {
		seed := base + uint64(run)
		if err := accountingRun(seed); err != "" {
			t.Fatalf("seed %d: %s", seed, err)
		}
	}
}

// accountingRun runs one random sequence and returns what went wrong, or
// "". Two processes share the origin, each with its own cap and queues.
func accountingRun(seed uint64) string {
	r := rand.New(rand.NewPCG(seed, 0))
	clk := testclock.New(time.UnixMilli(epoch))
	store := newMemOrigin()
	type process struct {
		e        *Engine
		o        *memOrigin
		attached bool
	}
	var ps [2]process
	for i := range ps {
		e := New(manual(Config{Now: clk.Now, MaxEntries: 8}))
		e.queueLen = 1 + r.IntN(3)
		o := store.peer("n" + strconv.Itoa(i))
		e.SetOrigin(o)
		ps[i] = process{e, o, true}
	}
	var admitted int64
	key := func() Key { return Key{"zone", "k-" + strconv.Itoa(r.IntN(12)), time.Second} }
	for range 400 {
		p := &ps[r.IntN(len(ps))]
		e := p.e
		switch op := r.IntN(100); {
		case op < 50:
			k := key()
			cost := int64(1 + r.IntN(2))
			if d := e.Decide(bg, Limit{Key: k, Limit: 5, Cost: cost}); d.Allowed {
				admitted += cost
			}
		case op < 60:
			clk.Advance(time.Duration(r.IntN(2500)) * time.Millisecond)
		case op < 62:
			clk.Advance(-time.Duration(r.IntN(1500)) * time.Millisecond)
		case op < 67:
			store.down.Store(!store.down.Load())
		case op < 71:
			if p.attached {
				e.SetOrigin(nil)
			} else {
				e.SetOrigin(p.o)
			}
			p.attached = !p.attached
		case op < 79:
			_, _ = e.ReplayOnce(bg, Tier(r.IntN(2)))
		case op < 85:
			e.Sweep()
		case op < 90:
			e.Evict()
		case op < 95:
			e.Forget(key())
		default:
			e.Resend()
		}
	}
	store.down.Store(false)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var lost int64
	for _, p := range ps {
		if !p.attached {
			p.e.SetOrigin(p.o)
		}
		if err := p.e.Close(ctx); err != nil {
			return "close: " + err.Error()
		}
		lost += p.e.Stats().LostUnits
	}
	store.mu.Lock()
	var sent int64
	for _, v := range store.totals {
		sent += v
	}
	store.mu.Unlock()
	if sent+lost != admitted {
		return strconv.FormatInt(admitted, 10) + " units admitted, " + strconv.FormatInt(sent, 10) +
			" sent and " + strconv.FormatInt(lost, 10) + " counted as lost"
	}
	return ""
}
