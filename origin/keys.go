package origin

import (
	"strconv"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// DefaultPrefix starts every key this module writes, so an operator can tell
// them apart from other data in a shared Redis (SCAN MATCH ratelimit:*).
const DefaultPrefix = "ratelimit"

// cellKey returns the Redis key of the cell (key, seq):
//
//	<prefix>:{<ns>:<id>}:<window_ms>:<sequence>
//
// The braces are a Cluster hash tag: Redis Cluster hashes only what lies
// between the first "{" and the first "}" after it, so every cell of one
// (namespace, identifier) lands in the same slot and a read of the current
// and previous cells is one single-slot MGET. The prefix may not contain a
// brace (Config.Validate), and escape removes every brace and colon from the
// namespace and identifier, so the tag is always exactly "<ns>:<id>" and the
// key parses back to its parts: two different cells never share a key.
func cellKey(prefix string, key engine.Key, seq int64) string {
	b := make([]byte, 0, len(prefix)+len(key.Namespace)+len(key.Identifier)+48)
	return string(strconv.AppendInt(appendStem(b, prefix, key), seq, 10))
}

// cellKeys returns the keys of the cell at seq and of the one before it,
// sharing the work of escaping the tag.
func cellKeys(prefix string, key engine.Key, seq int64) (cur, prev string) {
	b := appendStem(make([]byte, 0, len(prefix)+len(key.Namespace)+len(key.Identifier)+48), prefix, key)
	n := len(b)
	cur = string(strconv.AppendInt(b, seq, 10))
	prev = string(strconv.AppendInt(b[:n], seq-1, 10))
	return cur, prev
}

// appendWriteKeys appends the three keys a write of the cell (key, seq)
// names: the cell's key, its contribution hash's key and the previous
// cell's key, and returns where each ends in b.
func appendWriteKeys(b []byte, prefix string, key engine.Key, seq int64) ([]byte, [3]int) {
	from := len(b)
	b = appendStem(b, prefix, key)
	stem := len(b)
	b = strconv.AppendInt(b, seq, 10)
	var ends [3]int
	ends[0] = len(b)
	b = append(append(b, b[from:ends[0]]...), contributionSuffix...)
	ends[1] = len(b)
	b = strconv.AppendInt(append(b, b[from:stem]...), seq-1, 10)
	ends[2] = len(b)
	return b, ends
}

// appendStem appends what every cell key of key begins with:
// "<prefix>:{<ns>:<id>}:<window_ms>:".
func appendStem(b []byte, prefix string, key engine.Key) []byte {
	b = appendTag(append(append(b, prefix...), ':'), key)
	b = append(b, ':')
	b = strconv.AppendInt(b, windowMs(key.Window), 10)
	return append(b, ':')
}

// contributionSuffix ends the key of a cell's contribution hash. A cell key
// ends in an integer, so the two can never be equal.
const contributionSuffix = ":own"

// contributionKey returns the key of the contribution hash of cellKey, which
// holds the own total of each process's incarnation of the cell: the same
// hash tag, so the same slot.
func contributionKey(cellKey string) string { return cellKey + contributionSuffix }

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
// expires while it is still weighted, and a lost PEXPIREAT is repeated by
// the next write (it is idempotent), so no key lives forever.
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
