package ratelimit

// Response headers: the draft RateLimit-Policy and RateLimit fields, the
// legacy X-RateLimit-* fields, and Retry-After on a denial.

import (
	"github.com/caddyserver/caddy/v2"
	"math/rand/v2"
	"net/http"
	"strconv"
	"time"
	"unsafe"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// Header modes (Handler.Headers).
const (
	headersDraft  = "draft"
	headersLegacy = "legacy"
	headersBoth   = "both"
	headersOff    = "off"
)

// retryAfter is the Retry-After in seconds: the largest wait over the
// denying zones, rounded up, at least 1, plus jitter. ok is false when a
// denying zone can never admit the request.
func (h *Handler) retryAfter(decs []engine.Decision) (secs int64, ok bool) {
	var wait time.Duration
	for k := range decs {
		d := &decs[k]
		if d.Allowed {
			continue
		}
		if d.RetryAfter < 0 {
			return 0, false
		}
		wait = max(wait, d.RetryAfter)
	}
	if h.RetryJitter > 0 {
		wait += rand.N(time.Duration(h.RetryJitter) + 1)
	}
	return max(ceilSeconds(wait), 1), true
}

// ceilSeconds rounds a duration up to whole seconds.
func ceilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64((d + time.Second - 1) / time.Second)
}

// Canonical header keys, so writing them is a plain map assignment.
var (
	hdrPolicy       = http.CanonicalHeaderKey("RateLimit-Policy")
	hdrRateLimit    = http.CanonicalHeaderKey("RateLimit")
	hdrLegacyLimit  = http.CanonicalHeaderKey("X-RateLimit-Limit")
	hdrLegacyRemain = http.CanonicalHeaderKey("X-RateLimit-Remaining")
	hdrLegacyReset  = http.CanonicalHeaderKey("X-RateLimit-Reset")
	hdrRetryAfter   = http.CanonicalHeaderKey("Retry-After")
)

// dropEarlierHeaders removes the rate limit headers an earlier directive
// wrote on the request (see decidedEarlier): the response's headers are
// the last decision's, whatever its header mode. Each directive set only
// its own mode's, so a second directive's 429 carried the first's
// RateLimit (98 units left) beside its own X-RateLimit-Remaining: 0 until
// 2026-11-29 (TestCaddy_HeadersSpeakOfTheLastDirective). An earlier
// decision admitted the request, so it wrote no Retry-After.
func dropEarlierHeaders(hdr http.Header) {
	for _, k := range [...]string{hdrPolicy, hdrRateLimit, hdrLegacyLimit, hdrLegacyRemain, hdrLegacyReset} {
		delete(hdr, k)
	}
}

// earlierHeaders reports whether an earlier directive on r wrote rate
// limit headers to hdr: it wrote RateLimit or X-RateLimit-Limit, whatever
// its mode but off. A first decision finds neither and asks r nothing
// (its context is many values deep).
func earlierHeaders(hdr http.Header, r *http.Request, repl *caddy.Replacer) bool {
	return (hdr[hdrRateLimit] != nil || hdr[hdrLegacyLimit] != nil) && decidedEarlier(r, repl)
}

// writeHeaders sets the configured rate limit headers for the decided
// zones, and Retry-After when retry (seconds) is not negative, whatever
// the header mode. Every dynamic value is appended to one buffer, made as
// large as they can be, whose bytes become one string; its substrings are
// the header values. The buffer and the value slices are one allocation
// per response when the values fit in 256 bytes (one or two zones with
// either kind of headers, three with draft ones), two otherwise; no
// buffer on the stack (see Handler.ServeHTTP). A denial's Retry-After
// shares them: it cost two allocations of its own before.
func (h *Handler) writeHeaders(hdr http.Header, lims []engine.Limit, decs []engine.Decision, zi []int, ownLimits bool, retry int64) {
	if !h.draft && !h.legacy && retry < 0 {
		return
	}
	var vals []string
	var buf []byte
	room := h.headerRoom(zi, ownLimits)
	if retry >= 0 {
		room += maxIntLen
	}
	switch {
	case room <= 64:
		vals, buf = headerBlock[[64]byte]()
	case room <= 256:
		vals, buf = headerBlock[[256]byte]()
	default:
		vals, buf = make([]string, 0, headerValues), make([]byte, 0, room)
	}
	// Offsets into buf: draft policy (only when a limit was overridden or a
	// zone skipped), draft RateLimit, then the three legacy values.
	var policyEnd, rateEnd int
	var legacyEnds [3]int
	if h.draft {
		if !ownLimits {
			buf = h.appendPolicy(buf, lims, zi)
		}
		policyEnd = len(buf)
		buf = h.appendRateLimit(buf, decs, zi)
	}
	rateEnd = len(buf)
	legacyEnds = [3]int{rateEnd, rateEnd, rateEnd}
	if h.legacy {
		buf, legacyEnds = appendLegacy(buf, lims, decs)
	}
	if retry >= 0 {
		buf = strconv.AppendInt(buf, retry, 10)
	}
	// buf is never written again: its bytes are the string's.
	s := unsafe.String(unsafe.SliceData(buf), len(buf))

	set := func(key, v string) {
		vals = append(vals, v)
		hdr[key] = vals[len(vals)-1 : len(vals) : len(vals)]
	}
	if h.draft {
		if ownLimits {
			set(hdrPolicy, h.policyAll)
		} else {
			set(hdrPolicy, s[:policyEnd])
		}
		set(hdrRateLimit, s[policyEnd:rateEnd])
	}
	if h.legacy {
		set(hdrLegacyLimit, s[rateEnd:legacyEnds[0]])
		set(hdrLegacyRemain, s[legacyEnds[0]:legacyEnds[1]])
		set(hdrLegacyReset, s[legacyEnds[1]:legacyEnds[2]])
	}
	if retry >= 0 {
		set(hdrRetryAfter, s[legacyEnds[2]:])
	}
}

// headerValues is how many header values writeHeaders sets at most: the
// draft policy and RateLimit, the three legacy values and Retry-After.
const headerValues = 6

// headerBlock allocates room for the header values and for B's bytes, a
// byte array, as one object, and returns both empty. The values' strings
// point into the bytes: the object lives as long as the response's header
// map holds any of them.
func headerBlock[B any]() (vals []string, buf []byte) {
	x := new(struct {
		vals [headerValues]string
		b    B
	})
	return x.vals[:0], unsafe.Slice((*byte)(unsafe.Pointer(&x.b)), unsafe.Sizeof(x.b))[:0]
}

// maxIntLen is the longest decimal int64, with its sign.
const maxIntLen = len("-9223372036854775808")

// headerRoom is the most bytes writeHeaders can format for the zones zi.
func (h *Handler) headerRoom(zi []int, ownLimits bool) int {
	n := 0
	for _, i := range zi {
		z := &h.zones[i]
		if h.draft {
			n += len(", ") + len(z.remainingR) + len(";t=") + 2*maxIntLen
			if !ownLimits {
				n += len(", ") + max(len(z.policy), len(z.policyQ)+maxIntLen+len(z.policyW))
			}
		}
	}
	if h.legacy {
		n += 3 * maxIntLen
	}
	return n
}

// appendPolicy appends the draft RateLimit-Policy value of a request whose
// limits are not all the zones' own (an override matched, or a zone was
// skipped).
func (h *Handler) appendPolicy(buf []byte, lims []engine.Limit, zi []int) []byte {
	for k := range lims {
		if k > 0 {
			buf = append(buf, ", "...)
		}
		z := &h.zones[zi[k]]
		if lims[k].Limit == z.limit {
			buf = append(buf, z.policy...)
			continue
		}
		buf = append(buf, z.policyQ...)
		buf = appendSFInt(buf, lims[k].Limit)
		buf = append(buf, z.policyW...)
	}
	return buf
}

// appendRateLimit appends the draft RateLimit value: one member per zone.
func (h *Handler) appendRateLimit(buf []byte, decs []engine.Decision, zi []int) []byte {
	for k := range decs {
		if k > 0 {
			buf = append(buf, ", "...)
		}
		buf = append(buf, h.zones[zi[k]].remainingR...)
		buf = appendSFInt(buf, decs[k].Remaining)
		buf = append(buf, ";t="...)
		buf = appendSFInt(buf, ceilSeconds(decs[k].Reset))
	}
	return buf
}

// maxSFInt is the largest integer the draft headers write. RFC 9651 allows
// 15 digits, and a limit or remaining up to 2^53-1 has 16; this is 14, one
// fewer than the RFC's bound, because github.com/dunglas/httpsfv (v1.1.1,
// a Caddy dependency) rejects a 15-digit integer that anything follows,
// as ";w=60" follows q.
const maxSFInt = 99_999_999_999_999

// appendSFInt appends n as a structured-field integer, maxSFInt when it is
// larger: the header then says "at least this", still parseable. Windows,
// at most 3650 days, never reach it.
func appendSFInt(buf []byte, n int64) []byte {
	return strconv.AppendInt(buf, min(n, maxSFInt), 10)
}

// appendLegacy appends the X-RateLimit-* values of the most restrictive
// zone (the lowest remaining; on a tie, the first) and returns where each
// of the three ends.
func appendLegacy(buf []byte, lims []engine.Limit, decs []engine.Decision) ([]byte, [3]int) {
	m := 0
	for k := 1; k < len(decs); k++ {
		if decs[k].Remaining < decs[m].Remaining {
			m = k
		}
	}
	var ends [3]int
	buf = strconv.AppendInt(buf, lims[m].Limit, 10)
	ends[0] = len(buf)
	buf = strconv.AppendInt(buf, decs[m].Remaining, 10)
	ends[1] = len(buf)
	buf = strconv.AppendInt(buf, ceilSeconds(decs[m].Reset), 10)
	ends[2] = len(buf)
	return buf, ends
}
