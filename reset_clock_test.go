package ratelimit

import (
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
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
