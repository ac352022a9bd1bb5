package ratelimit

import (
	"net/http"
	"testing"
	"time"
)

// TestHandler_RetryAfterAfterAClockStepBack: limit 1 a minute, counted 1 s
// into a window; the clock steps back 11 s, into the window before, and
// the key keeps counting in its newer cell. The client denied there must
// be told a Retry-After after which it passes: the unit weighs until 1 ms
// into the window after the newer one, 70.001 s on, so 71 s; and t, the
// end of the newer cell's window, 70 s on. Before: Retry-After 61 and t=60,
// and the client that came back after 61 s was denied again.
func TestHandler_RetryAfterAfterAClockStepBack(t *testing.T) {
	clk := useClock(t, 61*time.Second)
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("back", 1, time.Minute)}})
	id := map[string]string{"back": "k"}
	wantStatus(t, serve(h, id), http.StatusOK)
	clk.Advance(-11 * time.Second)
	r := serve(h, id)
	wantStatus(t, r, http.StatusTooManyRequests)
	wantHeader(t, r, "RateLimit", `"back";r=0;t=70`)
	wantHeader(t, r, "Retry-After", "71")
	clk.Advance(70 * time.Second)
	wantStatus(t, serve(h, id), http.StatusTooManyRequests)
	clk.Advance(time.Second)
	wantStatus(t, serve(h, id), http.StatusOK)
}
