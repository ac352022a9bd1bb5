package ratelimit

import (
	"testing"
	"time"
)

// Defects a review found by running Caddy as a new user would, each pinned
// here through in-process Caddy on the engine's fake clock (the engine's own
// tests pin them in isolation).

// steadyRoutes is one zone, limit 3 per 2 s, keyed by X-Key.
const steadyRoutes = `
	handle /steady {
		ratelimit {
			zone e2e_steady {
				key    {http.request.header.X-Key}
				limit  3
				window 2s
			}
		}
		respond "ok"
	}
	handle /step {
		ratelimit {
			zone e2e_step {
				key    {http.request.header.X-Key}
				limit  100
				window 1m
			}
		}
		respond "ok"
	}`

// TestCaddy_SteadyLoadAdmitsTheLimitEveryWindow: limit 3 per 2 s, one key,
// 15 requests a second for 20 s. The review measured 22 admitted (after
// the first window, 2 a window: limit 3 behaved as limit 2); about 30 are
// due. The previous window's weight is rounded down now.
func TestCaddy_SteadyLoadAdmitsTheLimitEveryWindow(t *testing.T) {
	clk := useClock(t, 0)
	tester, _, base := startCaddy(t, func(admin, port int) string { return e2eConfig(admin, port, steadyRoutes) })
	admitted := 0
	for i := 0; i < 300; i++ { // 20 s at one request every 66.7 ms
		if r := get(t, tester, base+"/steady", "X-Key", "steady"); r.status == 200 {
			admitted++
		} else if r.status != 429 {
			t.Fatalf("status %d", r.status)
		}
		clk.Advance(time.Second / 15)
	}
	if admitted < 28 || admitted > 31 {
		t.Fatalf("admitted %d in 10 windows of limit 3 under steady load, want 28–31", admitted)
	}
}

// TestCaddy_ClockStepForwardAndBack: the wall clock steps an hour forward
// (an NTP step, a resumed VM) and back; a key touched during the step must
// not stay frozen in its cell from the future (the review's repro admitted
// 9 of 300 afterwards for a limit of 100).
func TestCaddy_ClockStepForwardAndBack(t *testing.T) {
	clk := useClock(t, 10*time.Second)
	tester, _, base := startCaddy(t, func(admin, port int) string { return e2eConfig(admin, port, steadyRoutes) })
	start := clk.Now()
	clk.Set(start.Add(time.Hour))
	for i := 0; i < 5; i++ {
		get(t, tester, base+"/step", "X-Key", "stepped").expect(t, 200, "ok")
	}
	clk.Set(start.Add(time.Second))
	admitted := 0
	for i := 0; i < 300; i++ {
		if get(t, tester, base+"/step", "X-Key", "stepped").status == 200 {
			admitted++
		}
	}
	if admitted != 100 {
		t.Fatalf("admitted %d of 300 after the clock came back, want the whole limit of 100", admitted)
	}
}
