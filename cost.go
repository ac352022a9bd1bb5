package ratelimit

// Cost: what one request is charged in a zone. A constant cost is charged
// as written. A cost placeholder usually evaluates to something a client
// can influence, so it is never trusted: a non-negative integer is clamped
// to the zone's [min_cost, max_cost] (min_cost is 1 unless the operator
// says otherwise, so 0 is no free pass), and anything else is charged the
// default cost. Both are counted.

import (
	"errors"
	"math"
	"net/http"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// Cost defaults.
const (
	// defaultCost is a zone's cost without a cost line, and the default
	// cost of a placeholder that is not a non-negative integer.
	defaultCost = 1
	// defaultMinCost is what a placeholder cost below it is charged: a
	// client that controls the placeholder must not make its requests
	// free by sending 0. A zone that means to charge nothing writes the
	// constant `cost 0`, or min_cost 0.
	defaultMinCost = 1
	// defaultMaxCost is the largest count (see maxUnits): a cost above it
	// would not be exact in the origin's scripts.
	defaultMaxCost = maxUnits
)

// The values of clamped_costs_total's bound label.
const (
	boundMin = "min"
	boundMax = "max"
)

// costClamp is what costOf says of a placeholder cost it moved into the
// zone's bounds; the zero value says it did not.
type costClamp struct {
	// bound is boundMin or boundMax, or empty when nothing was clamped.
	bound string
	// requested is the integer the placeholder evaluated to;
	// math.MaxInt64 for any integer past int64.
	requested int64
}

// costOf evaluates the zone's cost for one request. It counts an invalid
// or clamped placeholder cost; the caller logs a clamp (it knows the
// identifier).
func (z *zone) costOf(r *http.Request, repl *caddy.Replacer) (int64, costClamp) {
	if z.cost.literal {
		return z.staticCost, costClamp{}
	}
	s := z.cost.eval(r, repl)
	n, err := strconv.ParseInt(s, 10, 64)
	switch {
	case err == nil && n >= 0:
		// ParseInt takes a sign and leading zeros: "-0", "+0" and "00" are
		// 0, which min_cost raises like any other small cost.
	case n == math.MaxInt64 && errors.Is(err, strconv.ErrRange) && isUnsignedInteger(s):
		// Digits past int64: the largest cost, never the default, so a
		// huge cost is no way to pay less. (ParseInt reports the range
		// before the syntax: "99999999999999999999x" is out of range too,
		// and is no integer.)
	default:
		z.metrics.invalidCost.Inc()
		return z.defaultCost, costClamp{}
	}
	switch {
	case n < z.minCost:
		z.metrics.clampedMin.Inc()
		return z.minCost, costClamp{bound: boundMin, requested: n}
	case n > z.maxCost:
		z.metrics.clampedMax.Inc()
		return z.maxCost, costClamp{bound: boundMax, requested: n}
	}
	return n, costClamp{}
}

// isUnsignedInteger reports whether s is decimal digits with an optional
// leading '+', as ParseInt reads a non-negative integer.
func isUnsignedInteger(s string) bool {
	s = strings.TrimPrefix(s, "+")
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// costClamped logs, at debug level, a placeholder cost that costOf moved
// into the zone's bounds. The identifier appears as the app's settings
// show it (as in the dry run's lines), never raw by default: it is often
// an API key.
func (h *Handler) costClamped(z *zone, id string, cost int64, c costClamp) {
	ce := h.logger.Check(zapcore.DebugLevel, "cost placeholder out of bounds: charged the bound")
	if ce == nil {
		return
	}
	ce.Write(append(h.ids.logFields(engine.NormalizeIdentifier(id)),
		zap.String("zone", z.name),
		zap.String("bound", c.bound),
		zap.Int64("requested", c.requested),
		zap.Int64("cost", cost),
	)...)
}

// defaultCost returns the cost charged for a placeholder that is not a
// non-negative integer.
func (z *Zone) defaultCost() int64 {
	if z.DefaultCost == 0 {
		return defaultCost
	}
	return z.DefaultCost
}

// costBounds returns the bounds a placeholder cost is clamped to.
func (z *Zone) costBounds() (lo, hi int64) {
	lo, hi = defaultMinCost, defaultMaxCost
	if z.MinCost != nil {
		lo = *z.MinCost
	}
	if z.MaxCost != nil {
		hi = *z.MaxCost
	}
	return lo, hi
}
