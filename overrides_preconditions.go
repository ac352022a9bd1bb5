package ratelimit

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"

	"github.com/edgelimit/caddy-ratelimit/origin"
)

// Conditional requests of one override (RFC 9110, section 13): its ETag
// names the change the node holds of it, and If-Match / If-None-Match
// make a change of it conditional on that, so that two operators who
// read the same override and change it at once do not both win, the
// last write silently undoing the first.
//
// The check is against this node's book first, made with the change under
// the book's admin lock (overrideBook.changing): two requests to one node
// never both pass on one override, and a change the node can refuse is
// refused without a round trip. With Redis, the region's Redis checks it
// again in the same step as the write (regionCondition,
// origin.PutOverrideIf): a change made on another node of the region that
// has not reached this one yet is seen there, and of two nodes that
// change an override at once under one entity tag, one takes. Without
// Redis (local-only, MySQL alone) the node's book is all there is; across
// regions no check is made at the request, and the later version wins.

// etagOf is r's entity tag, quoted: its version, unique to a change of
// the key in its region (the region's Redis stamps a change that would
// tie past the one held), and its region, which breaks a tie between two
// regions as after does. A region name is letters, digits, '_', '-' and
// '.', all allowed in an entity tag.
func etagOf(r overrideRec) string {
	tag := strconv.FormatInt(r.Version, 10)
	if r.Region != "" {
		tag += "." + r.Region
	}
	return `"` + tag + `"`
}

// condition is one of If-Match and If-None-Match, parsed.
type condition struct {
	given bool
	any   bool // "*"
	tags  []entityTag
}

// entityTag is one entity tag of a condition: its opaque tag, quotes
// included, and whether it was weak (W/).
type entityTag struct {
	opaque string
	weak   bool
}

// preconditions are a request's If-Match and If-None-Match.
type preconditions struct{ match, noneMatch condition }

// given reports whether the request has either.
func (p preconditions) given() bool { return p.match.given || p.noneMatch.given }

// parsePreconditions reads If-Match and If-None-Match; a malformed one is
// a 400 naming the header.
func parsePreconditions(h http.Header) (preconditions, error) {
	var p preconditions
	var err error
	if p.match, err = parseCondition(h, "If-Match"); err != nil {
		return p, err
	}
	p.noneMatch, err = parseCondition(h, "If-None-Match")
	return p, err
}

// parseCondition parses a header's "*" or list of entity tags
// (`"x"`, `W/"x"`), its lines joined as one list.
func parseCondition(h http.Header, name string) (condition, error) {
	lines, ok := h[name]
	if !ok {
		return condition{}, nil
	}
	c := condition{given: true}
	s := strings.Join(lines, ",")
	bad := func(why string) error {
		return badRequest(fmt.Sprintf(`%s is malformed (%s): give "*" or one or more entity tags, such as "1764300000123456.eu-west-1", quotes included, as the ETag header shows them`, name, why))
	}
	for {
		s = strings.TrimLeft(s, " \t,")
		if s == "" {
			break
		}
		if s[0] == '*' {
			c.any = true
			if s = strings.TrimLeft(s[1:], " \t"); s != "" && s[0] != ',' {
				return c, bad(`"*" is followed by more than a comma`)
			}
			continue
		}
		var t entityTag
		if rest, ok := strings.CutPrefix(s, "W/"); ok {
			t.weak, s = true, rest
		}
		if s == "" || s[0] != '"' {
			return c, bad("an entity tag is not in double quotes")
		}
		end := strings.IndexByte(s[1:], '"')
		if end < 0 {
			return c, bad("an entity tag has no closing quote")
		}
		t.opaque, s = s[:end+2], s[end+2:]
		for i := 1; i < len(t.opaque)-1; i++ {
			if b := t.opaque[i]; b < 0x21 || b == 0x7f {
				return c, bad("an entity tag holds a space or a control character")
			}
		}
		if s = strings.TrimLeft(s, " \t"); s != "" && s[0] != ',' {
			return c, bad("entity tags are not separated by commas")
		}
		c.tags = append(c.tags, t)
	}
	switch {
	case c.any && len(c.tags) > 0:
		return c, bad(`"*" is given with entity tags`)
	case !c.any && len(c.tags) == 0:
		return c, bad("it is empty")
	}
	return c, nil
}

// matches reports whether the condition's list holds etag: compared
// strongly for If-Match (a weak tag never matches), weakly for
// If-None-Match (RFC 9110, 8.8.3.2).
func (c condition) matches(etag string, weak bool) bool {
	return slices.ContainsFunc(c.tags, func(t entityTag) bool { return t.opaque == etag && (weak || !t.weak) })
}

// check evaluates p against the override the node holds, cur when live
// is set: nil when the request may go on, else the error to answer, a
// 412, or for a GET a 304 when If-None-Match matches (notModified).
func (p preconditions) check(cur overrideRec, live bool, method string) error {
	return p.checkHeld(cur, live, method, "this node")
}

// checkHeld is check against what holder ("this node", "the region")
// holds, named so in a 412.
func (p preconditions) checkHeld(cur overrideRec, live bool, method, holder string) error {
	etag := etagOf(cur)
	switch {
	case p.match.given && !live:
		return caddy.APIError{HTTPStatus: http.StatusPreconditionFailed,
			Err: fmt.Errorf("If-Match: %s holds no live override of this identifier; nothing was changed", holder)}
	case p.match.given && !p.match.any && !p.match.matches(etag, false):
		return caddy.APIError{HTTPStatus: http.StatusPreconditionFailed,
			Err: fmt.Errorf("If-Match: %s holds the override as %s, which the header does not name (it changed since it was read?); nothing was changed: read it again with GET", holder, etag)}
	case p.noneMatch.given && live && (p.noneMatch.any || p.noneMatch.matches(etag, true)):
		if method == http.MethodGet {
			return errNotModified
		}
		if p.noneMatch.any {
			return caddy.APIError{HTTPStatus: http.StatusPreconditionFailed,
				Err: fmt.Errorf("If-None-Match: * asks that there be no live override of this identifier, and %s holds one, as %s; nothing was changed", holder, etag)}
		}
		return caddy.APIError{HTTPStatus: http.StatusPreconditionFailed,
			Err: fmt.Errorf("If-None-Match: %s holds the override as %s, which the header names; nothing was changed", holder, etag)}
	}
	return nil
}

// regionCondition is a change's preconditions as the region's Redis
// checks them against what it holds of field (origin.PutOverrideIf),
// with the meaning check gives them: If-Match compares strongly (a weak
// tag counts for nothing), If-None-Match weakly. method is the change's,
// for the 412 that names what the region holds.
type regionCondition struct {
	pre    preconditions
	field  string
	method string
}

// origin is c as the region's Redis takes it, expiry judged at nowMs on
// the region's clock.
func (c *regionCondition) origin(nowMs int64) origin.OverrideCondition {
	tags := func(k condition, weak bool) origin.OverrideTags {
		t := origin.OverrideTags{Given: k.given, Any: k.any}
		for _, e := range k.tags {
			if weak || !e.weak {
				t.Tags = append(t.Tags, e.opaque)
			}
		}
		return t
	}
	return origin.OverrideCondition{Field: c.field, NowMs: nowMs, Match: tags(c.pre.match, false), NoneMatch: tags(c.pre.noneMatch, true)}
}

// failed is the 412 of a change whose precondition the region's Redis
// found false, saying what the region held: held (holds false when
// nothing), judged live at nowMs as the script judged it.
func (c *regionCondition) failed(held origin.Override, holds bool, nowMs int64) error {
	rec, ok := recOfRegion(held)
	live := holds && ok && rec.live(nowMs)
	if err := c.pre.checkHeld(rec, live, c.method, "the region"); err != nil {
		return err
	}
	// The script and checkHeld judge alike; should they not, the 412
	// still says whose check failed.
	return caddy.APIError{HTTPStatus: http.StatusPreconditionFailed,
		Err: errors.New("the region's Redis found the precondition false; nothing was changed: read the override again with GET")}
}

// errNotModified answers a GET whose If-None-Match names the override
// held: a 304 has no body.
var errNotModified = errors.New("not modified")
