package ratelimit

import (
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
)

func TestZones_ConflictingDefinitionsInOneConfig(t *testing.T) {
	useClock(t, 0)
	app := new(App)
	provisionTest(t, app, &Handler{Zones: []*Zone{zoneOf("shared", 5, time.Minute)}})
	// Same key and window, other limit: fine, and counts are shared.
	provisionTest(t, app, &Handler{Zones: []*Zone{zoneOf("shared", 50, time.Minute)}})

	bad := &Handler{Zones: []*Zone{zoneOf("shared", 5, time.Hour)}, logger: zap.NewNop()}
	err := bad.provision(app)
	if cerr := bad.Cleanup(); cerr != nil {
		t.Fatal(cerr)
	}
	if err == nil {
		t.Fatal("a zone redefined with another window was accepted")
	}
	for _, want := range []string{`zone "shared"`, "window 1m0s", "window 1h0m0s", "ratelimit handler #1", "ratelimit handler #3"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}

	// Another config (a reload) may redefine the zone.
	provisionTest(t, new(App), &Handler{Zones: []*Zone{zoneOf("shared", 5, time.Hour)}})
}
