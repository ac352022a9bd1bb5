package origin

import (
	"context"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// clockNode is one process of a region on a real Redis whose clock is off
// real time by skew: its engine and its origin read the same clock, as a
// Caddy process's do (the root wires Options.Now to the engine's clock).
type clockNode struct {
	e *engine.Engine
	o *Redis
}

func newClockNode(t *testing.T, srv *redistest.Server, id string, skew time.Duration) *clockNode {
	t.Helper()
	now := func() time.Time { return time.Now().Add(skew) }
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: id, Now: now})
	e := engine.New(engine.Config{Now: now, Manual: true, ReadTimeout: 2 * time.Second})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = e.Close(ctx)
	})
	e.SetOrigin(o)
	return &clockNode{e: e, o: o}
}

// beat runs one heartbeat and hands its measurement of Redis's clock to
// the engine, as the root's watch of the region's processes does
// (redisBackend.useClock).
func (n *clockNode) beat(t *testing.T) {
	t.Helper()
	if _, err := n.o.Heartbeat(ctxT(t), time.Minute); err != nil {
		t.Fatal(err)
	}
	if d, ok := n.o.ClockOffset(); ok {
		n.e.SetClockOffset(d)
	}
}

func (n *clockNode) admit(t *testing.T, l engine.Limit, tries int) (admitted int, last engine.Decision) {
	t.Helper()
	for range tries {
		last = n.e.Decide(context.Background(), l)
		if last.Allowed {
			admitted++
		}
	}
	for _, tier := range []engine.Tier{engine.Fast, engine.Slow} {
		if _, err := n.e.ReplayOnce(context.Background(), tier); err != nil {
			t.Fatal(err)
		}
	}
	return admitted, last
}

// TestClock_ANodeBehindTheRegionCountsInItsWindow: a node whose clock runs
// a few seconds behind the others' (and Redis's) counted, in the first
// seconds of every window, in the window before, a cell the others no
// longer add to: a key the others had just filled to its limit was
// admitted the limit again there (20 of a limit of 10 within a second,
// with the node 2–3 s behind). Each node now decides on Redis's clock as
// its heartbeats measure it, so both count in one cell.
func TestClock_ANodeBehindTheRegionCountsInItsWindow(t *testing.T) {
	srv := redistest.Start(t)
	window, ok := testclock.FreshWindow(time.Now(), 20*time.Second, 80*time.Second, 15*time.Second)
	if !ok {
		t.Skip("no window length leaves 15 s")
	}
	elapsed := time.Duration(time.Now().UnixMilli()%window.Milliseconds()) * time.Millisecond
	skew := -(elapsed + 2*time.Second) // in the window before, by 2 s or more
	a := newClockNode(t, srv, "a", 0)
	b := newClockNode(t, srv, "b", skew)
	a.beat(t)
	b.beat(t)
	if d, _ := b.o.ClockOffset(); (d + skew).Abs() > clockSampleMaxRTT {
		t.Fatalf("b measured Redis's clock %v off its own, want about %v", d, -skew)
	}
	const limit = 10
	l := engine.Limit{Key: engine.Key{Namespace: "api", Identifier: "skewed", Window: window}, Limit: limit, Cost: 1}
	gotA, da := a.admit(t, l, limit)
	gotB, db := b.admit(t, l, limit)
	if gotA+gotB > limit {
		t.Errorf("the region admitted %d + %d of a limit of %d with b's clock %v off", gotA, gotB, limit, skew)
	}
	if gotA != limit {
		t.Errorf("a admitted %d of %d on a new key", gotA, limit)
	}
	// The headers agree too: the window ends at the same moment for both.
	if d := (da.Reset - db.Reset).Abs(); d > time.Second {
		t.Errorf("a's window ends in %v, b's in %v", da.Reset, db.Reset)
	}
	if db.Allowed || db.RetryAfter <= 0 || db.RetryAfter > window {
		t.Errorf("b's last decision %+v: want a denial with a Retry-After within the window", db)
	}
}

// TestClock_RedisAheadOfTheNodesKeepsTheirCells: a cell's expiry in Redis
// is an absolute time computed from its window (its end plus two windows),
// so a Redis whose clock ran ahead of the region's nodes by more than two
// windows deleted every cell as it was written (PEXPIREAT in the past),
// and by more than one the previous cell while it still weighed: no node
// saw another's units (here both nodes' clocks are 7 s behind the real
// time Redis keeps, with 2 s windows; the cell read back 0 of 5). Deciding
// on Redis's clock puts the windows, and so the expiries, on Redis's
// timeline.
func TestClock_RedisAheadOfTheNodesKeepsTheirCells(t *testing.T) {
	srv := redistest.Start(t)
	const window = 2 * time.Second
	skew := -7 * time.Second
	a := newClockNode(t, srv, "a", skew)
	b := newClockNode(t, srv, "b", skew)
	a.beat(t)
	b.beat(t)
	k := engine.Key{Namespace: "api", Identifier: "ahead", Window: window}
	seq := a.e.Now().UnixMilli() / window.Milliseconds()
	got, _ := a.admit(t, engine.Limit{Key: k, Limit: 100, Cost: 1}, 5)
	if got != 5 {
		t.Fatalf("a admitted %d of 5", got)
	}
	tot, err := b.o.Read(ctxT(t), k, seq, 0)
	if err != nil {
		t.Fatal(err)
	}
	if tot.Cur < 5 {
		t.Errorf("b reads %d units in a's cell, which holds 5 (Redis's clock %v ahead of the nodes')", tot.Cur, -skew)
	}
	ttl, err := srv.Client().PTTL(ctxT(t), cellKey(b.o.prefix, k, seq)).Result()
	if err != nil {
		t.Fatal(err)
	}
	if ttl < window {
		t.Errorf("the cell expires in %v, before its window and the next have passed", ttl)
	}
}

// TestClock_HealthyClocksKeepTheirOwn: measurements within clockDeadband
// of the offset in use change nothing, so clocks NTP keeps a few ms apart
// decide on their own (offset 0) and a round trip's jitter never steps
// the engine's clock; a slow heartbeat's reading is not used.
func TestClock_HealthyClocksKeepTheirOwn(t *testing.T) {
	var r Redis
	base := time.UnixMilli(1_800_000_000_000)
	steps := []struct {
		redis   time.Duration // Redis's time less sent
		rtt     time.Duration
		want    time.Duration
		wantSet bool
	}{
		{redis: 5 * time.Millisecond, rtt: 2 * time.Millisecond, want: 0, wantSet: true},
		{redis: 40 * time.Millisecond, rtt: 2 * time.Millisecond, want: 0, wantSet: true},
		{redis: 3 * time.Second, rtt: 500 * time.Millisecond, want: 0, wantSet: true}, // slow: not used once one is known
		{redis: 3 * time.Second, rtt: 2 * time.Millisecond, want: 3*time.Second - time.Millisecond, wantSet: true},
		{redis: 3*time.Second + 30*time.Millisecond, rtt: 2 * time.Millisecond, want: 3*time.Second - time.Millisecond, wantSet: true},
		{redis: -10 * time.Second, rtt: 2 * time.Millisecond, want: -10*time.Second - time.Millisecond, wantSet: true},
	}
	if _, ok := r.ClockOffset(); ok {
		t.Fatal("an offset before any measurement")
	}
	for i, s := range steps {
		r.observeClock(base.Add(s.redis).UnixMilli(), base, base.Add(s.rtt))
		d, ok := r.ClockOffset()
		if d != s.want || ok != s.wantSet {
			t.Errorf("step %d (Redis %v ahead, round trip %v): offset %v %v, want %v %v", i, s.redis, s.rtt, d, ok, s.want, s.wantSet)
		}
	}
}

// TestClock_ASlowFirstReadingOfAClockFarOffIsUsed: while no offset is
// known, a heartbeat slower than clockSampleMaxRTT (a busy start, the
// dial in the call) still gives the offset when the clocks are further
// apart than it can be wrong; one that cannot tell a healthy clock from
// one off by its own uncertainty is not used.
func TestClock_ASlowFirstReadingOfAClockFarOffIsUsed(t *testing.T) {
	base := time.UnixMilli(1_800_000_000_000)
	for _, c := range []struct {
		name    string
		redis   time.Duration // Redis's time less sent
		rtt     time.Duration
		want    time.Duration
		wantSet bool
	}{
		{"the node 5 s ahead, a 300 ms first heartbeat", -5 * time.Second, 300 * time.Millisecond, -5*time.Second - 150*time.Millisecond, true},
		{"Redis 5 s ahead, a 900 ms first heartbeat", 5 * time.Second, 900 * time.Millisecond, 5*time.Second - 450*time.Millisecond, true},
		{"healthy clocks, a 300 ms first heartbeat", 150 * time.Millisecond, 300 * time.Millisecond, 0, false},
		{"180 ms apart, a 300 ms first heartbeat: within what it can be wrong", 330 * time.Millisecond, 300 * time.Millisecond, 0, false},
	} {
		var r Redis
		r.observeClock(base.Add(c.redis).UnixMilli(), base, base.Add(c.rtt))
		if d, ok := r.ClockOffset(); d != c.want || ok != c.wantSet {
			t.Errorf("%s: offset %v %v, want %v %v", c.name, d, ok, c.want, c.wantSet)
		}
	}
}
