package ratelimit

import (
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
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

// TestZones_TheLimitShownOfAZoneOfTwoLimitsIsTheLowest: a zone defined in
// two sites with different limits showed, in the counters route, the
// limit of the first handler that registered it, and Caddy provisions its
// servers in a map's order: an audit saw 5 six times and 10 twice over
// eight reloads of one config. The lowest of them is shown now, whatever
// the order.
func TestZones_TheLimitShownOfAZoneOfTwoLimitsIsTheLowest(t *testing.T) {
	useClock(t, 0)
	resetOverrides(t)
	app := new(App)
	loose := provisionTest(t, app, &Handler{Zones: []*Zone{zoneOf("two_sites", 10, time.Minute)}})
	strict := provisionTest(t, app, &Handler{Zones: []*Zone{zoneOf("two_sites", 5, time.Minute)}})
	ks := engine.KeyState{Key: engine.Key{Namespace: "two_sites", Identifier: "k", Window: time.Minute}, Effective: 3}
	for _, defs := range [][]zoneDef{
		{{handler: loose, window: time.Minute}, {handler: strict, window: time.Minute}},
		{{handler: strict, window: time.Minute}, {handler: loose, window: time.Minute}},
	} {
		if doc := keyDocOf(ks, defs, identities{}); doc.Limit != 5 || doc.Remaining != 2 {
			t.Errorf("handlers in the order %d, %d: limit %d, remaining %d; want the lowest, 5, and 2",
				defs[0].handler.zones[0].limit, defs[1].handler.zones[0].limit, doc.Limit, doc.Remaining)
		}
	}
}
