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
