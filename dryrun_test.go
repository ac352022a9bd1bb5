package ratelimit

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	logobserver "go.uber.org/zap/zaptest/observer"
)

// TestHandler_DryRunLogsOncePerWindowAtInfo: each would-be denial is a debug
// line, and the zone says so at info level once per window.
func TestHandler_DryRunLogsOncePerWindowAtInfo(t *testing.T) {
	useClock(t, 0)
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
	// One line per real hour window; a test that straddles the hour sees two.
	info := logs.FilterLevelExact(zapcore.InfoLevel).All()
	var total int64
	for _, e := range info {
		total += e.ContextMap()["would_be_denied"].(int64)
	}
	if len(info) < 1 || len(info) > 2 || total > 10 {
		t.Fatalf("%d info lines reporting %d would-be denials", len(info), total)
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
	if lines := logs.All(); len(lines) != 1 || lines[0].ContextMap()["would_be_denied"] != int64(1) {
		t.Fatalf("within one window the zone logged %d lines (%v), want one reporting 1", len(lines), lines)
	}
	clk.Advance(time.Hour)
	wantStatus(t, serve(reloaded, id), http.StatusOK)
	lines := logs.All()
	if len(lines) != 2 {
		t.Fatalf("after the window turned the zone logged %d lines, want 2", len(lines))
	}
	if got := lines[1].ContextMap()["would_be_denied"]; got != int64(5) {
		t.Fatalf("the next window's line reports %v would-be denials since the last line, want 5 (1 + 3 before the window turned, 1 after)", got)
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
