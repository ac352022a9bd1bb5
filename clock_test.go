package ratelimit

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// TestClock_ANodeBehindRedisDecidesOnRedisClock: this node's clock runs
// 30 s behind its region's Redis (a failed NTP). The heartbeats measure
// Redis's clock against the clock the engine reads, and the engine adds
// the difference: the node counts in the region's window, not one of its
// own (see origin's TestClock_ tests for what a node off the others
// admitted). The origin must measure against the engine's clock, not
// another: measured against the real one while the engine read a clock of
// its own, the offset came out 0 and the engine stayed 30 s behind.
func TestClock_ANodeBehindRedisDecidesOnRedisClock(t *testing.T) {
	resetOverrides(t)
	const behind = 30 * time.Second
	if n, ok := pool.References(poolKey); ok {
		t.Fatalf("engine pool still has %d users from an earlier test", n)
	}
	useEngineClock(t, func() time.Time { return time.Now().Add(-behind) })
	srv := redistest.Start(t)
	other, _ := otherNode(t, srv)
	clearOfAMinuteEdge(t, 12*time.Second)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion ck-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t}", srv.URL())
	_, _, base := startCaddy(t, overrideConfig(global))
	st := lookupState()
	redistest.EventuallyShow(t, 10*time.Second, "the engine takes Redis's clock", func() (bool, string) {
		d := st.engine.ClockOffset()
		return (d - behind).Abs() < 200*time.Millisecond, d.String()
	})
	if skew := time.Since(st.engine.Now()).Abs(); skew > time.Second {
		t.Fatalf("the engine's clock is %s off the region's", skew)
	}
	if n := admitted(t, base, "ck", 1); n != 1 {
		t.Fatalf("admitted %d of 1", n)
	}
	seq := time.Now().UnixMilli() / time.Minute.Milliseconds()
	k := engine.Key{Namespace: "ov", Identifier: "ck", Window: time.Minute}
	redistest.EventuallyShow(t, 10*time.Second, "the unit in the region's window", func() (bool, string) {
		p, err := other.Peek(context.Background(), k, seq)
		return err == nil && p.Cur == 1, fmt.Sprintf("%+v (%v)", p, err)
	})
}
