package ratelimit

import (
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// The decision of a request, as placeholders the rest of Caddy reads (log
// lines, headers, error routes):
//
//	{http.ratelimit.zone}        the zone that denied, or the most
//	                             constrained one (lowest remaining)
//	{http.ratelimit.limit}       that zone's limit for the request
//	{http.ratelimit.remaining}   its units left after the decision
//	{http.ratelimit.reset}       seconds to the end of its window
//	{http.ratelimit.decision}    allowed, denied, dry_run_denied or skipped
//	{http.ratelimit.identifier}  the zone's identifier as it leaves the
//	                             process: its HMAC under identifier_secret,
//	                             whole with log_identifiers, else truncated
//
// They are one provider of the request's replacer, computed only when
// something reads them: a decided request pays one small allocation for
// them, never a string it does not need.

const placeholderPrefix = "http.ratelimit."

// Decisions as {http.ratelimit.decision} says them.
const (
	decisionAllowed      = "allowed"
	decisionDenied       = "denied"
	decisionDryRunDenied = "dry_run_denied"
	decisionSkipped      = "skipped"
)

// outcome is what the placeholders of one request read. It is at most 128
// bytes, so that the closure of setOutcome holds it by value (one
// allocation, not two).
type outcome struct {
	ids              *identities
	decision         string
	zone             string
	id               string
	limit, remaining int64
	reset            time.Duration
	decided          bool // limit, remaining and reset are known
}

// lookup is the replacer provider.
func (o outcome) lookup(key string) (any, bool) {
	name, ok := strings.CutPrefix(key, placeholderPrefix)
	if !ok {
		return nil, false
	}
	switch name {
	case "decision":
		return o.decision, true
	case "zone":
		return o.zone, true
	case "identifier":
		return o.identifier(), true
	}
	if !o.decided {
		switch name {
		case "limit", "remaining", "reset":
			return "", true
		}
		return nil, false
	}
	switch name {
	case "limit":
		return strconv.FormatInt(o.limit, 10), true
	case "remaining":
		return strconv.FormatInt(o.remaining, 10), true
	case "reset":
		return strconv.FormatInt(ceilSeconds(o.reset), 10), true
	}
	return nil, false
}

// identifier renders the zone's identifier as identifiers leave the
// process: as the engine keeps it (one over 64 bytes hashed), as log lines
// and the admin API show it.
func (o outcome) identifier() string {
	if o.id == "" {
		return ""
	}
	id := engine.NormalizeIdentifier(o.id)
	switch {
	case o.ids.hashed():
		return identifierHMAC(o.ids.secret, id)
	case o.ids.logRaw:
		return id
	}
	return truncateIdentifier(id)
}

// setOutcome makes the decision of a request readable as placeholders of
// its replacer repl (none without one): k is the index (in lims and decs)
// of the zone the placeholders speak of, -1 when every zone was skipped.
func (h *Handler) setOutcome(r *http.Request, repl *caddy.Replacer, decision string, lims []engine.Limit, decs []engine.Decision, zi []int, k int) {
	if repl == nil {
		return
	}
	publish(r, repl, h.outcome(decision, lims, decs, zi, k))
}

// outcomeKeys are the placeholders an outcome answers, each whatever the
// decision was.
var outcomeKeys = [...]string{
	placeholderPrefix + "decision",
	placeholderPrefix + "zone",
	placeholderPrefix + "limit",
	placeholderPrefix + "remaining",
	placeholderPrefix + "reset",
	placeholderPrefix + "identifier",
}

// publish makes o the answer of the request's placeholders. A replacer
// asks its providers in the order they were added, so the provider of an
// earlier decision on the same request (a second directive, or one in an
// error route) would answer before o's: its placeholders said "allowed"
// and named the first directive's zone on a 429 the second had denied,
// under the second's headers. A later decision is written as the
// replacer's static values instead, which are asked before any provider.
func publish(r *http.Request, repl *caddy.Replacer, o outcome) {
	if decidedBefore(r, repl) {
		for _, key := range outcomeKeys {
			v, _ := o.lookup(key)
			repl.Set(key, v)
		}
		return
	}
	// o is never assigned again, so the closure holds its own copy of it:
	// one allocation in all.
	repl.Map(func(key string) (any, bool) { return o.lookup(key) })
}

// decidedVar is the request variable (caddyhttp.SetVar) that marks a
// request some directive has decided, its bytes such that no Caddyfile
// writes them, nor a placeholder reads them.
const decidedVar = "\x00ratelimit decided"

// decidedBefore reports whether a directive decided r before, and records
// that one has. It asks the request's variables, as Caddy's server makes
// them for every request. Asking the replacer for a placeholder of ours
// instead, as it once did, called every provider on a first decision,
// Caddy's HTTP one among them, whose stack frame is large: with the
// collector shrinking the connections' stacks, that call grew one often
// enough to cost 3.4 % of Caddy's CPU in the load test's allow row
// (runtime.newstack under addHTTPVarsToReplacer in its profile, all of
// it). A request without variables (a handler served outside Caddy's
// server) is still asked through its replacer.
func decidedBefore(r *http.Request, repl *caddy.Replacer) bool {
	vars, ok := r.Context().Value(caddyhttp.VarsCtxKey).(map[string]any)
	if earlier := decidedIn(vars, ok, repl); earlier || !ok {
		return earlier
	}
	vars[decidedVar] = true
	return false
}

// decidedIn is decidedBefore's answer from the request's variables (ok:
// it has them) or, without them, its replacer; it records nothing.
func decidedIn(vars map[string]any, ok bool, repl *caddy.Replacer) bool {
	if !ok {
		_, earlier := repl.Get(outcomeKeys[0])
		return earlier
	}
	_, earlier := vars[decidedVar]
	return earlier
}

// decidedEarlier reports whether a directive decided r before, as
// decidedBefore does, without recording anything.
func decidedEarlier(r *http.Request, repl *caddy.Replacer) bool {
	vars, ok := r.Context().Value(caddyhttp.VarsCtxKey).(map[string]any)
	return decidedIn(vars, ok, repl)
}

// outcome is the outcome of a request decided against lims; k as for
// setOutcome.
func (h *Handler) outcome(decision string, lims []engine.Limit, decs []engine.Decision, zi []int, k int) outcome {
	o := outcome{ids: &h.ids, decision: decision}
	if k >= 0 {
		o.zone, o.id, o.limit, o.decided = h.zones[zi[k]].name, lims[k].Identifier, lims[k].Limit, true
		o.remaining, o.reset = decs[k].Remaining, decs[k].Reset
	}
	return o
}

// setMissing makes a denial for a missing key (decisionDenied, or
// decisionDryRunDenied) readable as placeholders: the zone whose key was
// empty, no identifier, no count.
func (h *Handler) setMissing(r *http.Request, repl *caddy.Replacer, zone int, decision string) {
	if repl == nil {
		return
	}
	publish(r, repl, outcome{ids: &h.ids, decision: decision, zone: h.zones[zone].name})
}

// spokenZone is the zone the placeholders speak of: the first that denied
// when the request was denied (or would have been, in a dry run), else the
// most constrained (the lowest remaining; on a tie, the first).
func spokenZone(decs []engine.Decision, allowed bool) int {
	m := 0
	for k := range decs {
		if !allowed && !decs[k].Allowed {
			return k
		}
		if decs[k].Remaining < decs[m].Remaining {
			m = k
		}
	}
	return m
}
