package ratelimit

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestCaddy_READMEErrorBodySaysWhenToComeBack runs the error route of the
// README's Placeholders example ("an error body that says when to come
// back") as written there, over the example's zone (limit 100 a minute):
// a client that comes back after the seconds the body names must pass,
// and the number must be the response's Retry-After. The example named
// {http.ratelimit.reset}, the end of the fixed window: the 100 units
// counted in it still weigh 100 at the first moment of the next one, so a
// client denied 15 s into the window was told "retry in 45 s" (Retry-After
// 46) and was denied again at 45 s.
func TestCaddy_READMEErrorBodySaysWhenToComeBack(t *testing.T) {
	_, section := readmeSection(t, "Placeholders")
	_, rest, ok := strings.Cut(section, "\thandle_errors 429 {")
	if !ok {
		t.Fatal("the Placeholders section has no handle_errors 429 route")
	}
	errorRoute, _, _ := strings.Cut(rest, "\n\t}")
	clk := useClock(t, 15*time.Second)
	routes := fmt.Sprintf(`
	handle /come-back {
		ratelimit {
			zone per_key {
				key    {http.request.header.X-API-Key}
				limit  100
				window 1m
			}
		}
		respond "ok"
	}
	handle_errors 429 {%s
	}`, errorRoute)
	tester, _, base := startCaddy(t, func(admin, port int) string { return e2eConfig(admin, port, routes) })
	for i := 0; i < 100; i++ {
		get(t, tester, base+"/come-back", "X-API-Key", "k").expect(t, 200, "ok")
	}
	r := get(t, tester, base+"/come-back", "X-API-Key", "k")
	if r.status != 429 {
		t.Fatalf("the 101st request: status %d, want 429", r.status)
	}
	m := regexp.MustCompile(`retry in (\d+) s`).FindStringSubmatch(r.body)
	if m == nil {
		t.Fatalf("error body %q names no wait", r.body)
	}
	if ra := r.header.Get("Retry-After"); m[1] != ra {
		t.Errorf("error body %q says retry in %s s, Retry-After says %s", r.body, m[1], ra)
	}
	n, _ := strconv.Atoi(m[1])
	clk.Advance(time.Duration(n) * time.Second)
	if r := get(t, tester, base+"/come-back", "X-API-Key", "k"); r.status != 200 {
		t.Errorf("came back after the %d s the error body named: status %d %q", n, r.status, r.body)
	}
}
