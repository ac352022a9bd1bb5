package ratelimit

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/dunglas/httpsfv"
)

func TestHandler_DraftHeadersThenDenialWithExactRetryAfter(t *testing.T) {
	clk := useClock(t, 15*time.Second)
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("demo", 3, time.Minute)}})
	id := map[string]string{"demo": "alice"}

	for i := 1; i <= 3; i++ {
		r := serve(h, id)
		wantStatus(t, r, http.StatusOK)
		wantHeader(t, r, "RateLimit-Policy", `"demo";q=3;w=60`)
		wantHeader(t, r, "RateLimit", fmt.Sprintf(`"demo";r=%d;t=45`, 3-i))
		wantHeader(t, r, "Retry-After", "")
		wantHeader(t, r, "X-RateLimit-Limit", "")
	}
	r := serve(h, id)
	wantStatus(t, r, http.StatusTooManyRequests)
	if !errors.Is(r.err, ErrRateLimited) {
		t.Fatalf("error %v does not wrap ErrRateLimited", r.err)
	}
	if strings.Contains(r.err.Error(), "alice") {
		t.Fatalf("error message %q exposes the identifier", r.err)
	}
	wantHeader(t, r, "RateLimit-Policy", `"demo";q=3;w=60`)
	wantHeader(t, r, "RateLimit", `"demo";r=0;t=45`)
	// 3 counted in this window; the next request fits once the window has
	// rolled over and the 3 weigh ⌊3 × (1 − p)⌋ ≤ 2: 1 ms into the next
	// window, so 45 s + 1 ms from now, 46 s rounded up.
	wantHeader(t, r, "Retry-After", "46")

	clk.Advance(45 * time.Second) // the next window's first millisecond: 3 weigh 3
	wantStatus(t, serve(h, id), http.StatusTooManyRequests)
	clk.Advance(time.Second)
	r = serve(h, id)
	wantStatus(t, r, http.StatusOK)
	wantHeader(t, r, "RateLimit", `"demo";r=0;t=59`)

	// Another identifier has its own count.
	wantStatus(t, serve(h, map[string]string{"demo": "bob"}), http.StatusOK)
}

func TestHandler_HeaderModes(t *testing.T) {
	useClock(t, 10*time.Second)
	zones := func() []*Zone { return []*Zone{zoneOf("a", 5, time.Minute), zoneOf("b", 3, time.Hour)} }
	hBoth := provisionTest(t, nil, &Handler{Zones: zones(), Headers: "both"})
	hLegacy := provisionTest(t, nil, &Handler{Zones: zones(), Headers: "legacy"})
	hOff := provisionTest(t, nil, &Handler{Zones: zones(), Headers: "off"})
	id := map[string]string{"a": "k", "b": "k"}

	r := serve(hBoth, id)
	wantStatus(t, r, http.StatusOK)
	wantHeader(t, r, "RateLimit-Policy", `"a";q=5;w=60, "b";q=3;w=3600`)
	wantHeader(t, r, "RateLimit", `"a";r=4;t=50, "b";r=2;t=3590`)
	// The most restrictive zone is b (2 remaining).
	wantHeader(t, r, "X-RateLimit-Limit", "3")
	wantHeader(t, r, "X-RateLimit-Remaining", "2")
	wantHeader(t, r, "X-RateLimit-Reset", "3590")

	r = serve(hLegacy, id) // same zones: the counts are shared
	wantHeader(t, r, "RateLimit-Policy", "")
	wantHeader(t, r, "RateLimit", "")
	wantHeader(t, r, "X-RateLimit-Remaining", "1")

	r = serve(hOff, id)
	wantStatus(t, r, http.StatusOK)
	for _, k := range []string{"RateLimit-Policy", "RateLimit", "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"} {
		wantHeader(t, r, k, "")
	}
	r = serve(hOff, id)
	wantStatus(t, r, http.StatusTooManyRequests)
	// b: 3 units weigh ⌊3 × (1 − p)⌋ ≤ 2 from 1 ms into the next window.
	wantHeader(t, r, "Retry-After", strconv.Itoa(3590+1)) // written in every mode

	r = serve(hBoth, id)
	wantStatus(t, r, http.StatusTooManyRequests)
	wantHeader(t, r, "RateLimit", `"a";r=2;t=50, "b";r=0;t=3590`)
	wantHeader(t, r, "X-RateLimit-Remaining", "0")
}

func TestHandler_RetryAfterIsLargestOverDenyingZones(t *testing.T) {
	useClock(t, 30*time.Second)
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("minute", 1, time.Minute), zoneOf("hour", 1, time.Hour)}})
	id := map[string]string{"minute": "k", "hour": "k"}
	wantStatus(t, serve(h, id), http.StatusOK)
	r := serve(h, id)
	wantStatus(t, r, http.StatusTooManyRequests)
	// minute: the single unit stays in the window until it ends (30 s) and
	// then weighs ⌊1 × (1 − p)⌋ = 0 from 1 ms into the next one: 31 s;
	// hour: 3570 s + 1 ms, 3571 s rounded up.
	wantHeader(t, r, "Retry-After", strconv.Itoa(3570+1))
}

func TestHandler_NoRetryAfterWhenCostExceedsLimit(t *testing.T) {
	useClock(t, 0)
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{
		{Name: "big", Key: "{test.k}", Limit: 5, Window: caddy.Duration(time.Minute), Cost: "{test.cost}"},
		zoneOf("other", 1, time.Minute),
	}})
	wantStatus(t, serve(h, map[string]string{"k": "a", "cost": "1", "other": "o"}), http.StatusOK)
	// other denies with a finite wait, big can never admit cost 6.
	r := serve(h, map[string]string{"k": "a", "cost": "6", "other": "o"})
	wantStatus(t, r, http.StatusTooManyRequests)
	wantHeader(t, r, "Retry-After", "")
	// other alone denying: Retry-After is back.
	r = serve(h, map[string]string{"k": "a", "cost": "1", "other": "o"})
	wantStatus(t, r, http.StatusTooManyRequests)
	if r.get("Retry-After") == "" {
		t.Fatal("Retry-After missing when every denying zone can admit later")
	}
}

func TestHandler_RetryJitterOnlyAdds(t *testing.T) {
	useClock(t, 0)
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("j", 1, time.Minute)}, RetryJitter: caddy.Duration(10 * time.Second)})
	wantStatus(t, serve(h, map[string]string{"j": "k"}), http.StatusOK)
	seen := map[int]bool{}
	for range 200 {
		r := serve(h, map[string]string{"j": "k"})
		n, err := strconv.Atoi(r.get("Retry-After"))
		if err != nil {
			t.Fatal(err)
		}
		// Exact value: the unit weighs ⌊1 × (1 − p)⌋ = 0 from 1 ms into the
		// next window, 60 s + 1 ms, 61 s rounded up.
		if n < 61 || n > 71 {
			t.Fatalf("Retry-After %d outside [61, 71]", n)
		}
		seen[n] = true
	}
	if len(seen) < 3 {
		t.Fatalf("jitter produced only %v", seen)
	}
}

// A handler decides every zone on whichever frame its zone count takes
// (two or fewer, up to eight, more on the heap): the headers carry every
// zone, at the longest zone names, and a denial by the last zone charges
// none of the others.
func TestHandler_EveryZoneCountDecidesEveryZone(t *testing.T) {
	useClock(t, 10*time.Second)
	for _, n := range []int{1, fewZones, fewZones + 1, stackZones, stackZones + 1, 20} {
		var zs []*Zone
		id := map[string]string{}
		for i := range n {
			// Zones are global to the process by name: each handler's
			// are its own.
			name := fmt.Sprintf("%02d-%02d", n, i) + strings.Repeat("z", maxZoneName-5)
			limit := int64(1000 + i)
			if i == n-1 {
				limit = 1
			}
			zs = append(zs, zoneOf(name, limit, time.Hour))
			id[name] = "k"
		}
		h := provisionTest(t, nil, &Handler{Zones: zs, Headers: "both"})
		rateLimit := func(lastRemaining int64) string {
			var members []string
			for i, z := range zs {
				r := z.Limit - 1
				if i == n-1 {
					r = lastRemaining
				}
				members = append(members, fmt.Sprintf(`%q;r=%d;t=3590`, z.Name, r))
			}
			return strings.Join(members, ", ")
		}
		r := serve(h, id)
		wantStatus(t, r, http.StatusOK)
		wantHeader(t, r, "RateLimit", rateLimit(0))
		wantHeader(t, r, "X-RateLimit-Limit", "1")
		wantHeader(t, r, "X-RateLimit-Remaining", "0")
		if got := strings.Count(r.get("RateLimit-Policy"), ";q="); got != n {
			t.Fatalf("%d zones: RateLimit-Policy has %d members: %q", n, got, r.get("RateLimit-Policy"))
		}
		r = serve(h, id)
		wantStatus(t, r, http.StatusTooManyRequests)
		wantHeader(t, r, "RateLimit", rateLimit(0)) // the other zones kept their count: nothing charged
	}
}

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

// RFC 9651 integers have at most 15 digits: a limit up to 2^53-1 is
// written as maxSFInt, in the policy and the remaining alike, which
// httpsfv parses.
func TestHandler_DraftHeadersAreStructuredFieldsForTheLargestLimits(t *testing.T) {
	useClock(t, 10*time.Second)
	big := zoneOf("big", maxUnits, 2*time.Second)
	small := zoneOf("small", 10, time.Minute)
	small.Overrides = map[string]int64{"alice": maxUnits}
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{big, small}, Headers: "both"})

	for _, id := range []string{"alice", "bob"} {
		r := serve(h, map[string]string{"big": id, "small": id})
		wantStatus(t, r, http.StatusOK)
		for _, k := range []string{"RateLimit-Policy", "RateLimit"} {
			if _, err := httpsfv.UnmarshalList(r.header.Values(k)); err != nil {
				t.Fatalf("%s: %s %q is no structured-field list: %v", id, k, r.get(k), err)
			}
		}
		q := "10"
		if id == "alice" {
			q = "99999999999999"
		}
		wantHeader(t, r, "RateLimit-Policy", `"big";q=99999999999999;w=2, "small";q=`+q+`;w=60`)
		r9 := "9"
		if id == "alice" {
			r9 = "99999999999999"
		}
		wantHeader(t, r, "RateLimit", `"big";r=99999999999999;t=2, "small";r=`+r9+`;t=50`)
		// The legacy headers are plain integers, written in full: alice's
		// zones tie, and the first is reported.
		legacy := "10"
		if id == "alice" {
			legacy = "9007199254740991"
		}
		wantHeader(t, r, "X-RateLimit-Limit", legacy)
	}
}
