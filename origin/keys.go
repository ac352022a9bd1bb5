package origin

import (
	"strconv"
	"strings"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// DefaultPrefix starts every key this module writes, so an operator can tell
// them apart from other data in a shared Redis (SCAN MATCH ratelimit:*).
const DefaultPrefix = "ratelimit"

// cellKey returns the Redis key of the cell (key, seq), a hash:
//
//	<prefix>:{<ns>:<id>}:<window_ms>:<sequence>:c
//
// The braces are a Cluster hash tag: Redis Cluster hashes only what lies
// between the first "{" and the first "}" after it, so every cell of one
// (namespace, identifier) lands in the same slot and a script reads the
// current and previous cells in one call. The prefix may not contain a
// brace (Config.Validate), and escape removes every brace and colon from the
// namespace and identifier, so the tag is always exactly "<ns>:<id>" and the
// key parses back to its parts (parseCellKey): two different cells never
// share a key. The suffix keeps these hashes apart from the keys of
// earlier versions, a counter and a ":own" hash per cell.
func cellKey(prefix string, key engine.Key, seq int64) string {
	b := make([]byte, 0, len(prefix)+len(key.Namespace)+len(key.Identifier)+48)
	return string(appendCell(appendStem(b, prefix, key), seq))
}

// cellKeys returns the keys of the cell at seq and of the one before it,
// sharing the work of escaping the tag.
func cellKeys(prefix string, key engine.Key, seq int64) (cur, prev string) {
	b := appendStem(make([]byte, 0, len(prefix)+len(key.Namespace)+len(key.Identifier)+48), prefix, key)
	n := len(b)
	cur = string(appendCell(b, seq))
	prev = string(appendCell(b[:n], seq-1))
	return cur, prev
}

// cellFlags tell what a call about a cell names beside the cell itself.
type cellFlags uint8

const (
	// withPrev: the previous cell too, whose totals the answer carries.
	withPrev cellFlags = 1 << iota
	// markNext: the next cell, which a late write marks (see cellsLua).
	markNext
)

// appendCellKeys appends the keys a call about the cell (key, seq) names:
// the cell's, then the previous cell's when f has withPrev and the next
// cell's when it has markNext. It returns where each ends in b; a key left
// out ends where the one before it does.
func appendCellKeys(b []byte, prefix string, key engine.Key, seq int64, f cellFlags) ([]byte, [3]int) {
	from := len(b)
	b = appendStem(b, prefix, key)
	stem := len(b)
	var ends [3]int
	b = appendCell(b, seq)
	ends[0] = len(b)
	if f&withPrev != 0 {
		b = appendCell(append(b, b[from:stem]...), seq-1)
	}
	ends[1] = len(b)
	if f&markNext != 0 {
		b = appendCell(append(b, b[from:stem]...), seq+1)
	}
	ends[2] = len(b)
	return b, ends
}

// appendCell appends a cell key's end: "<sequence>:c".
func appendCell(b []byte, seq int64) []byte {
	return append(strconv.AppendInt(b, seq, 10), cellSuffix...)
}

// cellSuffix ends every cell key.
const cellSuffix = ":c"

// appendStem appends what every cell key of key begins with:
// "<prefix>:{<ns>:<id>}:<window_ms>:".
func appendStem(b []byte, prefix string, key engine.Key) []byte {
	b = appendTag(append(append(b, prefix...), ':'), key)
	b = append(b, ':')
	b = strconv.AppendInt(b, windowMs(key.Window), 10)
	return append(b, ':')
}

// parseCellKey parses a cell key back into its cell: the inverse of
// cellKey for the prefix, and ok false for any other string.
func parseCellKey(prefix, s string) (key engine.Key, seq int64, ok bool) {
	rest, found := strings.CutPrefix(s, prefix+":{")
	if !found {
		return key, 0, false
	}
	rest, found = strings.CutSuffix(rest, cellSuffix)
	if !found {
		return key, 0, false
	}
	tag, tail, found := strings.Cut(rest, "}:")
	if !found {
		return key, 0, false
	}
	ns, id, found := strings.Cut(tag, ":")
	if !found {
		return key, 0, false
	}
	w, sq, found := strings.Cut(tail, ":")
	if !found {
		return key, 0, false
	}
	wms, err1 := strconv.ParseInt(w, 10, 64)
	seq, err2 := strconv.ParseInt(sq, 10, 64)
	nsRaw, ok1 := unescape(ns)
	idRaw, ok2 := unescape(id)
	if err1 != nil || err2 != nil || !ok1 || !ok2 || wms < 1 {
		return key, 0, false
	}
	return engine.Key{Namespace: nsRaw, Identifier: idRaw, Window: time.Duration(wms) * time.Millisecond}, seq, true
}

// unescape is the inverse of escape; ok is false for what escape never
// writes (a malformed escape, a byte it would have escaped).
func unescape(s string) (string, bool) {
	b := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		if s[i] != '%' {
			if needsEscape(s[i]) {
				return "", false
			}
			b = append(b, s[i])
			continue
		}
		if i+2 >= len(s) {
			return "", false
		}
		hi, lo := strings.IndexByte(hexDigits, s[i+1]), strings.IndexByte(hexDigits, s[i+2])
		if hi < 0 || lo < 0 {
			return "", false
		}
		b = append(b, byte(hi<<4|lo))
		i += 2
	}
	return string(b), true
}

// appendTag appends the hash tag "{<ns>:<id>}" with both parts escaped.
func appendTag(b []byte, key engine.Key) []byte {
	b = append(b, '{')
	b = escape(b, key.Namespace)
	b = append(b, ':')
	b = escape(b, key.Identifier)
	return append(b, '}')
}

// expireAt is when the cell (key, seq) may leave Redis: the end of the cell
// plus two windows. Past its own end the cell is still weighted as the
// previous cell for one window, and one more window of slack covers clock
// skew between nodes and a replay that arrives late; so a cell never
// expires while it is still weighted. The expiry is set in the script
// that makes the cell, so a cell never exists without one.
func expireAt(key engine.Key, seq int64) time.Time {
	return time.UnixMilli((seq + 3) * windowMs(key.Window))
}

// windowMs is the window at the millisecond precision the engine uses for
// sequences; the engine guarantees at least one millisecond.
func windowMs(w time.Duration) int64 { return w.Milliseconds() }

const hexDigits = "0123456789ABCDEF"

// escape appends s percent-encoded: '%', the key's separators ':', '{' and
// '}', ASCII control bytes, space, DEL and every byte ≥ 0x80 become %XX (upper
// case). Every other byte stands for itself. Because '%' itself is encoded,
// the encoding decodes back unambiguously, so it is injective over any byte
// string (valid UTF-8 or not), and its output never contains a separator.
// Printable identifiers (API keys, IP prefixes, tenant names) stay readable
// in redis-cli.
func escape(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if needsEscape(c) {
			b = append(b, '%', hexDigits[c>>4], hexDigits[c&0x0f])
			continue
		}
		b = append(b, c)
	}
	return b
}

func needsEscape(c byte) bool {
	switch {
	case c <= ' ', c >= 0x7f:
		return true
	case c == '%', c == ':', c == '{', c == '}':
		return true
	}
	return false
}
