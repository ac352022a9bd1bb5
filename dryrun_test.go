package ratelimit

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	logobserver "go.uber.org/zap/zaptest/observer"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// TestHandler_DryRunLogsOncePerWindowAtInfo: each would-be denial is a debug
// line, and the zone says so at info level once per window.
func TestHandler_DryRunLogsOncePerWindowAtInfo(t *testing.T) {
	clk := useClock(t, 0)
	core, logs := logobserver.New(zapcore.DebugLevel)
	h := &Handler{Zones: []*Zone{zoneOf("dry_log", 1, time.Hour)}, DryRun: true}
	provisionTest(t, nil, h)
	h.logger = zap.New(core)
	const id = "sk_live_dry_run_identifier"
	for range 11 {
		wantStatus(t, serve(h, map[string]string{"dry_log": id}), 200)
	}
	debug := logs.FilterLevelExact(zapcore.DebugLevel).All()
	if len(debug) != 10 {
		t.Fatalf("%d debug lines for 10 would-be denials", len(debug))
	}
	if f := debug[0].ContextMap(); f["zone"] != "dry_log" || f["identifier_truncated"] != "sk_liv…" {
		t.Fatalf("debug fields %v", f)
	}
	// The window's line comes once it ended: here at the next window's
	// first would-be denial.
	if info := logs.FilterLevelExact(zapcore.InfoLevel).Len(); info != 0 {
		t.Fatalf("%d info lines within the window, want none until it ended", info)
	}
	clk.Advance(time.Hour)
	wantStatus(t, serve(h, map[string]string{"dry_log": id}), 200)
	wantStatus(t, serve(h, map[string]string{"dry_log": id}), 200)
	info := logs.FilterLevelExact(zapcore.InfoLevel).All()
	if len(info) != 1 || info[0].ContextMap()["would_be_denied"] != int64(10) {
		t.Fatalf("info lines %v once the window ended, want one reporting 10", info)
	}
}

func TestHandler_DryRunServesCountsAndShowsRealState(t *testing.T) {
	useClock(t, 0)
	dry := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("dry", 2, time.Minute)}, DryRun: true})
	enforcing := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("dry", 100, time.Minute)}})
	id := map[string]string{"dry": "k"}

	wouldDeny := decisionsTotal.WithLabelValues("dry", resultDryRunDenied)
	before := counterValue(t, wouldDeny)
	for i := range 5 {
		r := serve(dry, id)
		wantStatus(t, r, http.StatusOK)
		wantHeader(t, r, "RateLimit", fmt.Sprintf(`"dry";r=%d;t=60`, max(0, 1-i)))
		wantHeader(t, r, "Retry-After", "")
	}
	if got := counterValue(t, wouldDeny) - before; got != 3 {
		t.Fatalf("dry-run denials counted %v, want 3", got)
	}
	// All five were counted as served.
	r := serve(enforcing, id)
	wantHeader(t, r, "RateLimit", `"dry";r=94;t=60`)
}

// TestHandler_DryRunLogsOncePerZoneAndWindowAcrossHandlers: the info line
// is the zone's, however many handlers count it: a reload's handler of the
// zone (or another site's) kept a count and a window of its own, so a
// reload within a window logged the zone a second time, and the would-be
// denials the old handler had counted since its line were never reported.
// The window is the engine's, on its clock, as the decisions' are.
func TestHandler_DryRunLogsOncePerZoneAndWindowAcrossHandlers(t *testing.T) {
	clk := useClock(t, 0)
	core, logs := logobserver.New(zapcore.InfoLevel)
	handler := func() *Handler {
		h := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("dry_once", 1, time.Hour)}, DryRun: true})
		h.logger = zap.New(core)
		return h
	}
	id := map[string]string{"dry_once": "k"}
	running := handler()
	for range 3 { // two would-be denials: the window's line
		wantStatus(t, serve(running, id), http.StatusOK)
	}
	reloaded := handler()
	for range 3 { // three more in the same window
		wantStatus(t, serve(reloaded, id), http.StatusOK)
	}
	if lines := logs.All(); len(lines) != 0 {
		t.Fatalf("within one window the zone logged %d lines (%v), want none until it ended", len(lines), lines)
	}
	clk.Advance(time.Hour)
	wantStatus(t, serve(reloaded, id), http.StatusOK)
	lines := logs.All()
	if len(lines) != 1 {
		t.Fatalf("after the window turned the zone logged %d lines, want 1", len(lines))
	}
	if got := lines[0].ContextMap()["would_be_denied"]; got != int64(5) {
		t.Fatalf("the ended window's line reports %v would-be denials, want 5 (2 through the first handler, 3 through the second)", got)
	}
}

// TestHandler_DryRunLogsEachWindowsOwnNumber: each window's info line
// gives that window's would-be denials, missing keys among them. The line
// came at a window's first would-be denial with the number since the
// previous line: a window of 2 would-be denials and a missing key logged
// 1, the next window's line 3 (2 + 1), and the rest of the last window
// went unreported, the lines' total short of decisions_total's. An idle
// zone's last window is logged at its end.
func TestHandler_DryRunLogsEachWindowsOwnNumber(t *testing.T) {
	clk := useClock(t, 0)
	core, logs := logobserver.New(zapcore.InfoLevel)
	h := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("dry_own", 3, time.Minute)}, DryRun: true, OnMissingKey: "deny"})
	h.logger = zap.New(core)
	id := map[string]string{"dry_own": "k"}
	for range 5 { // 2 would-be denials
		wantStatus(t, serve(h, id), http.StatusOK)
	}
	wantStatus(t, serve(h, nil), http.StatusOK) // and a missing key
	// The next window, near its end: its timer is due in 50 ms.
	clk.Set(windowStart.Add(2*time.Minute - 50*time.Millisecond))
	for range 8 { // 5 would-be denials
		wantStatus(t, serve(h, id), http.StatusOK)
	}
	redistest.EventuallyShow(t, 5*time.Second, "the second window's line, at its end", func() (bool, string) {
		return logs.Len() >= 2, fmt.Sprint(logs.All())
	})
	lines := logs.All()
	if len(lines) != 2 {
		t.Fatalf("%d lines for two windows (%v), want 2", len(lines), lines)
	}
	for i, want := range []struct {
		n     int64
		start time.Time
	}{{3, windowStart}, {5, windowStart.Add(time.Minute)}} {
		f := lines[i].ContextMap()
		if start, _ := f["window_start"].(time.Time); f["would_be_denied"] != want.n || !start.Equal(want.start) {
			t.Fatalf("line %d: %v, want would_be_denied %d for the window from %v", i, f, want.n, want.start)
		}
	}
}

// TestHandler_DryRunServesAMissingKey: under dry_run, a request whose key
// is missing in an `on_missing_key deny` zone is served, as every request
// a dry run would have denied is: the other zones count it, the zone with
// no key counts nothing, and the placeholders and metrics say it would
// have been denied there. It was a 429: dry_run denied.
func TestHandler_DryRunServesAMissingKey(t *testing.T) {
	useClock(t, 0)
	h := provisionTest(t, nil, &Handler{DryRun: true, OnMissingKey: "deny",
		Zones: []*Zone{zoneOf("dry_keyed", 5, time.Minute), zoneOf("dry_other", 10, time.Minute)}})
	missing := decisionsTotal.WithLabelValues("dry_keyed", resultMissingKey)
	before := counterValue(t, missing)

	r := serve(h, map[string]string{"dry_other": "o"})
	wantStatus(t, r, http.StatusOK)
	wantHeader(t, r, "RateLimit", `"dry_other";r=9;t=60`)
	wantHeader(t, r, "Retry-After", "")
	if got := counterValue(t, missing) - before; got != 1 {
		t.Fatalf("missing keys counted %v, want 1", got)
	}
	wantPlaceholders(t, placeholdersOf(t, h, map[string]string{"dry_other": "o"}),
		"zone=dry_keyed limit= remaining= reset= decision=dry_run_denied identifier=")
	// Every zone's key missing: served, nothing counted.
	wantStatus(t, serve(h, nil), http.StatusOK)
	r = serve(h, map[string]string{"dry_keyed": "k", "dry_other": "o"})
	wantHeader(t, r, "RateLimit", `"dry_keyed";r=4;t=60, "dry_other";r=7;t=60`)
}
