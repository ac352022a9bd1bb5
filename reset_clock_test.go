package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// TestReset_HeardLateIsJudgedOnTheRegionsClock: resets are made on the
// region's clock (Redis's: resetKey stamps them with engine.Now), so the
// node that hears of one late must judge its lapse and whether it was
// made before the engine began on that clock too, not on its own. A node
// 30 s behind its Redis took a reset made 10 s before its engine began
// for one made after (dropping units all admitted after it); a node 30 s
// ahead took a live reset of a 10 s window (it lives 20 s) for one that
// had lapsed (keeping units the reset took off, which then counted
// again).
func TestReset_HeardLateIsJudgedOnTheRegionsClock(t *testing.T) {
	for _, tc := range []struct {
		name   string
		offset time.Duration // Redis's clock less this node's
		made   time.Duration // the reset's time on Redis's clock, from the engine's start
		life   time.Duration
		want   bool
	}{
		{"behind: a reset before the start", 30 * time.Second, -10 * time.Second, 20 * time.Second, false},
		{"behind: a reset after the start", 30 * time.Second, time.Second, 20 * time.Second, true},
		{"ahead: a live reset", -30 * time.Second, time.Second, 20 * time.Second, true},
		{"ahead: a reset before the start", -30 * time.Second, -time.Second, 20 * time.Second, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := &state{engine: engine.New(engine.Config{})}
			t.Cleanup(func() { _ = st.engine.Close(t.Context()) })
			st.startedMs = time.Now().UnixMilli()
			st.engine.SetClockOffset(tc.offset)
			made := time.UnixMilli(st.startedMs).Add(tc.offset + tc.made)
			rec := overrideRec{Zone: "z", Identifier: "k", Reset: true, CreatedMs: made.UnixMilli(),
				Version: made.UnixMicro(), ExpiresMs: made.Add(tc.life).UnixMilli()}
			if got := resetTakesHeld(st, rec); got != tc.want {
				t.Errorf("resetTakesHeld = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestOverrides_ALoadJudgesLapseOnTheRegionsClock: a region reset is
// stamped on the region's clock (Redis's) and lives two of its zone's
// windows, 20 s for a 10 s window. A node whose own clock runs 30 s ahead
// of its Redis judged the records it loaded on its own clock: it took the
// reset for lapsed as soon as it read it and dropped it from the region,
// whose other nodes then never heard of it (their unreplayed units of the
// reset's cells counted again after the marks).
func TestOverrides_ALoadJudgesLapseOnTheRegionsClock(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	node, _ := otherNode(t, srv)
	// This node's engine, on Redis's clock: 30 s behind this node's.
	e := engine.New(engine.Config{})
	t.Cleanup(func() { _ = e.Close(context.Background()) })
	e.SetClockOffset(-30 * time.Second)
	made := e.Now()
	rec := overrideRec{Zone: "ov", Identifier: "lapse", Reset: true, Region: "ov-test",
		CreatedMs: made.UnixMilli(), Version: made.UnixMicro(), ExpiresMs: made.Add(20 * time.Second).UnixMilli()}
	if _, err := node.PutOverrides(context.Background(), []origin.Override{rec.regionValue()}, false); err != nil {
		t.Fatal(err)
	}
	w := &regionWatch{o: node, log: zap.NewNop(), readTimeout: time.Second, global: func() bool { return false }, regionNow: e.Now}
	if err := w.start(time.Now()); err != nil {
		t.Fatal(err)
	}
	if _, ok := overrides.get(rec.bookZone(), rec.Identifier); !ok {
		t.Error("the book let go of a live reset")
	}
	if v, ok, err := node.OverrideVersion(context.Background(), rec.field()); err != nil || !ok || v != rec.Version {
		t.Fatalf("the region holds version %d of the live reset (held %v, %v), want %d", v, ok, err, rec.Version)
	}
}

// TestReset_ARetryAfterAReloadKeepsUnitsWrittenSinceTheMarks: a region
// reset whose record Redis took, its reply cut by a reload (which closes
// the old config's client), is made again on the new client. The retry
// marked the cells again, at their totals then: the units another node
// wrote after the first marks, admitted after the reset, were taken off
// too, and the region admitted them again.
func TestReset_ARetryAfterAReloadKeepsUnitsWrittenSinceTheMarks(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	proxy := redistest.StartDelayProxy(t, srv.Addr(), 0)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion rr-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t}", proxy.URL())
	other, _ := otherNode(t, srv)
	ctx := context.Background()
	_, admin, _ := startCaddy(t, overrideConfig(global))
	// A first reset loads the scripts, so each call below is one round trip.
	adminSend(t, admin, http.MethodDelete, "/ratelimit/counters?zone=ov&identifier=warm&scope=region", "").decode(t, http.StatusOK, &resetDoc{})
	clearOfAMinuteEdge(t, 20*time.Second)
	k := engine.Key{Namespace: "ov", Identifier: "retried", Window: time.Minute}
	seq := time.Now().UnixMilli() / time.Minute.Milliseconds()
	otherWrites := func(own int64) {
		t.Helper()
		if err := other.Flush(ctx, []engine.Delta{{Key: k, Sequence: seq, Own: own, Incarnation: 1}}); err != nil {
			t.Fatal(err)
		}
	}
	otherWrites(2) // before the reset
	holds := func() bool {
		_, all, err := other.Overrides(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range all {
			if rec, ok := recOfRegion(o); ok && rec.Identifier == k.Identifier && rec.Reset {
				return true
			}
		}
		return false
	}
	before := lookupState().overridesRedis()
	proxy.SetDelay(250 * time.Millisecond)
	answer := make(chan adminReply, 1)
	go func() {
		answer <- adminSend(t, admin, http.MethodDelete, "/ratelimit/counters?zone=ov&identifier=retried&scope=region", "")
	}()
	// Marks and record in Redis; the record's reply held by the proxy.
	redistest.Eventually(t, 5*time.Second, "the reset's record in Redis", holds)
	otherWrites(3) // one unit admitted after the reset
	proxy.SetDelay(0)
	if err := loadCaddyfile(t, admin, overrideConfig(global)); err != nil {
		t.Fatal(err)
	}
	if lookupState().overridesRedis() == before {
		t.Fatal("the reload kept the origin: the test races nothing")
	}
	if r := <-answer; r.status != http.StatusOK {
		t.Fatalf("the reset answered %d %s", r.status, r.body)
	}
	p, err := other.Peek(ctx, k, seq)
	if err != nil {
		t.Fatal(err)
	}
	if p.Cur != 1 {
		t.Fatalf("the region counts %+v after the reset, want the 1 unit written after its marks", p)
	}
}

// TestReset_AfterTheNodesClockSteppedIsJudgedOnTheRegionsClock: the
// engine's start, against which a reset heard late is judged, is a moment
// on the region's clock, fixed once a heartbeat first measured it; a
// later step of this node's wall clock (NTP stepping a clock that booted
// an hour off, a resumed VM) moves the offset the engine adds, not when
// the engine began. The start was this node's clock at the engine's
// creation plus the offset in use now: a node whose clock booted an hour
// ahead and was stepped back 10 min later took its start for an hour
// later than it was, and ignored every region reset made in that hour (it
// kept the units the reset took off and went on denying the key); a node
// whose clock stepped an hour forward took its start for an hour earlier,
// and dropped units all admitted after a reset made before it began (the
// region admitted them again).
func TestReset_AfterTheNodesClockSteppedIsJudgedOnTheRegionsClock(t *testing.T) {
	region := time.Date(2026, 11, 28, 2, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name          string
		atStart, step time.Duration // this node's clock less the region's at the engine's start; its step 10 min later
		made          time.Duration // the reset's time on the region's clock, from the engine's start
		want          bool
	}{
		{"booted ahead, stepped back: a reset after the start", time.Hour, -time.Hour, 11 * time.Minute, true},
		{"stepped forward: a reset before the start", 0, time.Hour, -5 * time.Minute, false},
		{"stepped forward: a reset after the start", 0, time.Hour, 11 * time.Minute, true},
		{"stepped back: a reset before the start", 0, -time.Hour, -5 * time.Minute, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := testclock.New(region.Add(tc.atStart))
			st := &state{engine: engine.New(engine.Config{Now: clk.Now})}
			t.Cleanup(func() { _ = st.engine.Close(t.Context()) })
			st.began()
			st.takeRegionClock(-tc.atStart, "r") // the first heartbeat
			clk.Advance(10 * time.Minute)
			clk.Advance(tc.step)
			st.takeRegionClock(-tc.atStart-tc.step, "r") // the heartbeat after the step
			if skew := st.engine.Now().Sub(region.Add(10 * time.Minute)); skew != 0 {
				t.Fatalf("the engine's clock is %s off the region's", skew)
			}
			made := region.Add(tc.made)
			rec := overrideRec{Zone: "z", Identifier: "k", Reset: true, CreatedMs: made.UnixMilli(),
				Version: made.UnixMicro(), ExpiresMs: region.Add(time.Hour).UnixMilli()}
			if got := resetTakesHeld(st, rec); got != tc.want {
				t.Errorf("resetTakesHeld = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestReset_AReloadToAnotherRedisJudgesTheStartOnItsClock: the engine's
// start is fixed on the clock of the Redis that measured it; a reload to
// the servers of another place, whose clock is 30 s ahead, fixes it again
// on theirs, where its resets are stamped.
func TestReset_AReloadToAnotherRedisJudgesTheStartOnItsClock(t *testing.T) {
	start := time.Date(2026, 11, 28, 2, 0, 0, 0, time.UTC)
	clk := testclock.New(start)
	st := &state{engine: engine.New(engine.Config{Now: clk.Now})}
	t.Cleanup(func() { _ = st.engine.Close(t.Context()) })
	st.began()
	st.takeRegionClock(0, "a")
	clk.Advance(time.Minute)
	st.takeRegionClock(30*time.Second, "b") // the reload's Redis
	made := start.Add(20 * time.Second)     // 10 s before the start on b's clock
	rec := overrideRec{Zone: "z", Identifier: "k", Reset: true, CreatedMs: made.UnixMilli(),
		Version: made.UnixMicro(), ExpiresMs: start.Add(time.Hour).UnixMilli()}
	if resetTakesHeld(st, rec) {
		t.Error("a reset made before the engine began, on the new Redis's clock, takes the units held")
	}
}
