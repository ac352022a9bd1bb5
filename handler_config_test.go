package ratelimit

import (
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// TestHandler_CompileFillsDefaultsAndHeaderFragments: what the request
// path reads of the config, made once.
func TestHandler_CompileFillsDefaultsAndHeaderFragments(t *testing.T) {
	h := &Handler{Zones: []*Zone{
		zoneOf("a", 5, time.Minute),
		{Name: "b", Key: "{test.b}", Limit: 9, Window: caddy.Duration(time.Hour), Cost: "3", IPv4Prefix: 24},
	}, Headers: "both"}
	h.compile()
	if !h.draft || !h.legacy || h.onMissing != missingShared {
		t.Fatalf("modes: draft %v legacy %v on_missing_key %q", h.draft, h.legacy, h.onMissing)
	}
	a, b := &h.zones[0], &h.zones[1]
	if a.v4 != 32 || a.v6 != 64 || b.v4 != 24 || b.v6 != 64 {
		t.Fatalf("prefixes a %d/%d b %d/%d, want the defaults 32 and 64 where not given", a.v4, a.v6, b.v4, b.v6)
	}
	if a.staticCost != 1 || b.staticCost != 3 || !b.cost.literal {
		t.Fatalf("costs a %d b %d (literal %v)", a.staticCost, b.staticCost, b.cost.literal)
	}
	if h.policyAll != `"a";q=5;w=60, "b";q=9;w=3600` || b.policyQ != `"b";q=` || b.policyW != ";w=3600" || b.remainingR != `"b";r=` {
		t.Fatalf("fragments: %q %q %q %q", h.policyAll, b.policyQ, b.policyW, b.remainingR)
	}
	h2 := &Handler{Zones: []*Zone{zoneOf("c", 1, time.Second)}}
	h2.compile()
	if !h2.draft || h2.legacy {
		t.Fatal("the default headers are draft only")
	}
}
