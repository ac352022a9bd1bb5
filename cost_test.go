package ratelimit

import (
	"math"
	"math/big"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	logobserver "go.uber.org/zap/zaptest/observer"
)

// costZone compiles zc alone, with its counters, so costOf can be called
// without an engine.
func costZone(t *testing.T, zc *Zone) *zone {
	t.Helper()
	h := &Handler{Zones: []*Zone{zc}}
	if err := h.Validate(); err != nil {
		t.Fatalf("Validate: %v", err)
	}
	h.compile()
	z := &h.zones[0]
	z.metrics = newZoneMetrics(z.name)
	return z
}

func int64p(n int64) *int64 { return &n }

// costCounts reads the counters costOf moves, for one zone.
type costCounts struct{ invalid, min, max float64 }

func readCostCounts(t *testing.T, zone string) costCounts {
	t.Helper()
	return costCounts{
		invalid: counterValue(t, invalidCostsTotal.WithLabelValues(zone)),
		min:     counterValue(t, clampedCostsTotal.WithLabelValues(zone, boundMin)),
		max:     counterValue(t, clampedCostsTotal.WithLabelValues(zone, boundMax)),
	}
}

// costOfValue is z.costOf for a request whose {test.cost} is v.
func costOfValue(z *zone, v string) (int64, costClamp) {
	r := requestWith(map[string]string{"cost": v})
	return z.costOf(r, r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer))
}

// TestCostOf_PlaceholderIsClampedOrChargedTheDefault: a placeholder that
// evaluates to a non-negative integer (any spelling ParseInt takes) is
// clamped to [min_cost, max_cost], past int64 included; anything else is
// charged the default cost. Each clamp and each invalid cost is counted
// once, in its own series.
func TestCostOf_PlaceholderIsClampedOrChargedTheDefault(t *testing.T) {
	const huge = "99999999999999999999999"
	for _, bounds := range []struct {
		name             string
		minCost, maxCost *int64
		lo, hi           int64
	}{
		{"cost_defaults", nil, nil, 1, maxUnits},
		{"cost_bounded", int64p(2), int64p(50), 2, 50},
		{"cost_free_floor", int64p(0), nil, 0, maxUnits},
	} {
		t.Run(bounds.name, func(t *testing.T) {
			const dflt = 3
			z := costZone(t, &Zone{Name: bounds.name, Key: "k", Limit: 10, Window: caddy.Duration(time.Minute),
				Cost: "{test.cost}", DefaultCost: dflt, MinCost: bounds.minCost, MaxCost: bounds.maxCost})
			clampLo := func(n int64) (int64, string) {
				if n < bounds.lo {
					return bounds.lo, boundMin
				}
				return n, ""
			}
			for _, tc := range []struct {
				in        string
				cost      int64
				bound     string // "" (in bounds), boundMin, boundMax, or "invalid"
				requested int64
			}{
				{"0", 0, "", 0},
				{"00", 0, "", 0},
				{"+0", 0, "", 0},
				{"-0", 0, "", 0},
				{"1", 1, "", 1},
				{"2", 2, "", 2},
				{"50", 50, "", 50},
				{"51", 51, "", 51},
				{"9007199254740991", maxUnits, "", maxUnits},
				{"9007199254740992", 1 << 53, "", 1 << 53},
				{"9223372036854775807", math.MaxInt64, "", math.MaxInt64},
				{huge, math.MaxInt64, "", math.MaxInt64}, // past int64: the largest cost
				{"+" + huge, math.MaxInt64, "", math.MaxInt64},
				{huge + "x", dflt, "invalid", 0}, // ParseInt says out of range, not syntax
				{huge + ".5", dflt, "invalid", 0},
				{" 0", dflt, "invalid", 0},
				{"0 ", dflt, "invalid", 0},
				{"-1", dflt, "invalid", 0},
				{"-" + huge, dflt, "invalid", 0},
				{"1.5", dflt, "invalid", 0},
				{"1e3", dflt, "invalid", 0},
				{"abc", dflt, "invalid", 0},
				{"0x10", dflt, "invalid", 0},
				{"", dflt, "invalid", 0},
			} {
				// The table holds what the placeholder asked for; the
				// bounds decide what is charged.
				want, bound := tc.cost, tc.bound
				if bound == "" {
					want, bound = clampLo(tc.cost)
					if want > bounds.hi {
						want, bound = bounds.hi, boundMax
					}
				}
				before := readCostCounts(t, bounds.name)
				got, clamp := costOfValue(z, tc.in)
				after := readCostCounts(t, bounds.name)
				if got != want {
					t.Errorf("cost %q: charged %d, want %d", tc.in, got, want)
				}
				wantCounts := costCounts{}
				switch bound {
				case "invalid":
					wantCounts.invalid = 1
				case boundMin:
					wantCounts.min = 1
				case boundMax:
					wantCounts.max = 1
				}
				if d := (costCounts{after.invalid - before.invalid, after.min - before.min, after.max - before.max}); d != wantCounts {
					t.Errorf("cost %q: counters moved by %+v, want %+v", tc.in, d, wantCounts)
				}
				switch {
				case bound == boundMin || bound == boundMax:
					if clamp.bound != bound || clamp.requested != tc.requested {
						t.Errorf("cost %q: clamp %+v, want bound %s, requested %d", tc.in, clamp, bound, tc.requested)
					}
				case clamp != costClamp{}:
					t.Errorf("cost %q: clamp %+v, want none", tc.in, clamp)
				}
			}
		})
	}
}

// TestCostOf_ConstantIsChargedAsWritten: a constant cost is not clamped,
// so `cost 0` stays a zone that only reads, and is never counted.
func TestCostOf_ConstantIsChargedAsWritten(t *testing.T) {
	for _, tc := range []struct {
		name             string
		cost             string
		minCost, maxCost *int64
		want             int64
	}{
		{"const_zero", "0", nil, nil, 0},
		{"const_none", "", nil, nil, 1},
		{"const_large", "9007199254740991", nil, nil, maxUnits},
		{"const_zero_free_floor", "0", int64p(0), int64p(10), 0},
		{"const_within_bounds", "7", int64p(2), int64p(10), 7},
	} {
		t.Run(tc.name, func(t *testing.T) {
			z := costZone(t, &Zone{Name: tc.name, Key: "k", Limit: 10, Window: caddy.Duration(time.Minute),
				Cost: caddyhttp.WeakString(tc.cost), MinCost: tc.minCost, MaxCost: tc.maxCost})
			before := readCostCounts(t, tc.name)
			got, clamp := costOfValue(z, "0")
			if got != tc.want || clamp != (costClamp{}) {
				t.Fatalf("charged %d (clamp %+v), want %d unclamped", got, clamp, tc.want)
			}
			if after := readCostCounts(t, tc.name); after != before {
				t.Fatalf("counters moved from %+v to %+v", before, after)
			}
		})
	}
}

// TestCost_ClampIsLoggedAtDebugWithoutTheIdentifier: each clamp is one
// debug line naming the zone, the bound, what was asked and what was
// charged; the identifier appears as the app's settings show it (here its
// HMAC), never raw. Above debug, nothing is logged.
func TestCost_ClampIsLoggedAtDebugWithoutTheIdentifier(t *testing.T) {
	const secret = "0123456789abcdef0123"
	const id = "sk_live_clamped_cost_key"
	for _, level := range []zapcore.Level{zapcore.DebugLevel, zapcore.InfoLevel} {
		t.Run(level.String(), func(t *testing.T) {
			useClock(t, 0)
			app := &App{ids: identities{secret: []byte(secret)}}
			h := provisionTest(t, app, &Handler{Zones: []*Zone{{Name: "clamp_log", Key: "{test.k}", Limit: 100,
				Window: caddy.Duration(time.Minute), Cost: "{test.cost}", MaxCost: int64p(20)}}})
			core, logs := logobserver.New(level)
			h.logger = zap.New(core)
			for _, cost := range []string{"0", "-0", "5", "21", "abc"} {
				wantStatus(t, serve(h, map[string]string{"k": id, "cost": cost}), http.StatusOK)
			}
			lines := logs.FilterMessage("cost placeholder out of bounds: charged the bound").All()
			if level > zapcore.DebugLevel {
				if logs.Len() != 0 {
					t.Fatalf("%d lines above debug: %v", logs.Len(), logs.All())
				}
				return
			}
			if len(lines) != 3 || logs.Len() != 3 {
				t.Fatalf("%d clamp lines (%d in all) for 3 clamps", len(lines), logs.Len())
			}
			for i, want := range []struct {
				bound           string
				requested, cost int64
			}{{boundMin, 0, 1}, {boundMin, 0, 1}, {boundMax, 21, 20}} {
				f := lines[i].ContextMap()
				if f["zone"] != "clamp_log" || f["bound"] != want.bound || f["requested"] != want.requested || f["cost"] != want.cost ||
					f["identifier_hmac"] != identifierHMAC([]byte(secret), id) {
					t.Fatalf("line %d: fields %v", i, f)
				}
				for k, v := range f {
					if s, ok := v.(string); ok && strings.Contains(s, id) {
						t.Fatalf("field %s carries the raw identifier", k)
					}
				}
			}
		})
	}
}

// FuzzCostOf evaluates arbitrary placeholder values against arbitrary valid
// bounds and default costs, and checks what is charged against a parse of
// its own (math/big): a non-negative integer of any size is charged itself
// clamped to [min_cost, max_cost]; anything else is charged the default
// cost. Either way the charge lies within [min_cost, max_cost], so it is
// never 0 when min_cost is at least 1, and exactly one counter moves when
// the charge is not the value itself.
//
// Run it with: go test -run '^$' -fuzz FuzzCostOf .
func FuzzCostOf(f *testing.F) {
	for _, s := range []string{"0", "00", "+0", "-0", " 0", "1", "-1", "1.5", "abc", "", "9007199254740992",
		"99999999999999999999999", "-99999999999999999999999", "0x1", "1_000", "٣"} {
		f.Add(s, uint64(1), uint64(maxUnits), uint64(1))
	}
	f.Add("0", uint64(0), uint64(0), uint64(0))
	f.Add("7", uint64(5), uint64(6), uint64(5))
	f.Fuzz(func(t *testing.T, s string, a, b, c uint64) {
		// Valid bounds and default from the three numbers: 0 ≤ lo ≤ hi ≤
		// 2^53-1, hi ≥ 1, and a default cost in [max(lo, 1), hi].
		hi := int64(b%maxUnits) + 1
		lo := int64(a % uint64(hi+1))
		dLo := max(lo, 1)
		dflt := dLo + int64(c%uint64(hi-dLo+1))
		z := costZone(t, &Zone{Name: "fuzz_cost", Key: "k", Limit: 10, Window: caddy.Duration(time.Minute),
			Cost: "{test.cost}", DefaultCost: dflt, MinCost: &lo, MaxCost: &hi})

		before := readCostCounts(t, "fuzz_cost")
		got, clamp := costOfValue(z, s)
		after := readCostCounts(t, "fuzz_cost")
		moved := costCounts{after.invalid - before.invalid, after.min - before.min, after.max - before.max}

		if got < lo || got > hi || (lo >= 1 && got == 0) {
			t.Fatalf("%q in [%d, %d] (default %d): charged %d", s, lo, hi, dflt, got)
		}
		n, ok := new(big.Int).SetString(s, 10)
		if !ok || n.Sign() < 0 {
			if got != dflt || moved != (costCounts{invalid: 1}) || clamp != (costClamp{}) {
				t.Fatalf("%q: charged %d (counters %+v, clamp %+v), want the default %d, counted invalid", s, got, moved, clamp, dflt)
			}
			return
		}
		switch {
		case n.Cmp(big.NewInt(lo)) < 0:
			if got != lo || moved != (costCounts{min: 1}) || clamp.bound != boundMin || clamp.requested != n.Int64() {
				t.Fatalf("%q: charged %d (counters %+v, clamp %+v), want min_cost %d", s, got, moved, clamp, lo)
			}
		case n.Cmp(big.NewInt(hi)) > 0:
			if got != hi || moved != (costCounts{max: 1}) || clamp.bound != boundMax {
				t.Fatalf("%q: charged %d (counters %+v, clamp %+v), want max_cost %d", s, got, moved, clamp, hi)
			}
		default:
			if got != n.Int64() || moved != (costCounts{}) || clamp != (costClamp{}) {
				t.Fatalf("%q: charged %d (counters %+v, clamp %+v), want itself", s, got, moved, clamp)
			}
		}
	})
}

// TestCost_ClampAllocatesNothing: a warm request whose cost placeholder is
// clamped allocates no more than any other (with headers off, only the
// {http.ratelimit.*} placeholders' one): the clamp is one atomic add, and
// its debug line is built only when debug is on.
func TestCost_ClampAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector changes allocations")
	}
	useClock(t, 0)
	h := provisionTest(t, nil, &Handler{Headers: "off", Zones: []*Zone{{Name: "clamp_alloc", Key: "{test.k}", Limit: 1 << 50,
		Window: caddy.Duration(time.Hour), Cost: "{test.cost}", MaxCost: int64p(5)}}})
	for _, cost := range []string{"0", "-0", "6"} {
		fresh, rec := freshRequests(t, map[string]string{"k": "203.0.113.7", "cost": cost}), httptest.NewRecorder()
		next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
		serveOne := func() {
			if err := h.ServeHTTP(rec, fresh(), next); err != nil {
				t.Fatal(err)
			}
		}
		serveOne()
		if got := testing.AllocsPerRun(200, serveOne); got != placeholderAllocs {
			t.Errorf("cost %q: %.1f allocations per request, want %d", cost, got, placeholderAllocs)
		}
	}
}
