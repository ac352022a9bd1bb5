package origin

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// hashTag is what Redis Cluster hashes: the bytes between the first "{" and
// the first "}" after it (the whole key when there is none, or it is empty).
func hashTag(key string) string {
	open := strings.IndexByte(key, '{')
	if open < 0 {
		return key
	}
	end := strings.IndexByte(key[open+1:], '}')
	if end <= 0 {
		return key
	}
	return key[open+1 : open+1+end]
}

func TestCellKey_Format(t *testing.T) {
	for _, tc := range []struct {
		name string
		key  engine.Key
		seq  int64
		want string
	}{
		{"plain", engine.Key{Namespace: "api", Identifier: "1.2.3.4", Window: time.Minute}, 28000000,
			"ratelimit:{api:1.2.3.4}:60000:28000000:c"},
		{"separators", engine.Key{Namespace: "a:b", Identifier: "{x}:y", Window: time.Second}, 7,
			"ratelimit:{a%3Ab:%7Bx%7D%3Ay}:1000:7:c"},
		{"percent", engine.Key{Namespace: "z", Identifier: "100%", Window: time.Second}, 1,
			"ratelimit:{z:100%25}:1000:1:c"},
		{"control and space", engine.Key{Namespace: "z", Identifier: "a b\r\n\x00\x7f", Window: time.Second}, 1,
			"ratelimit:{z:a%20b%0D%0A%00%7F}:1000:1:c"},
		{"non-ASCII and invalid UTF-8", engine.Key{Namespace: "z", Identifier: "é\xff", Window: time.Second}, 1,
			"ratelimit:{z:%C3%A9%FF}:1000:1:c"},
		{"empty identifier", engine.Key{Namespace: "z", Identifier: "", Window: time.Second}, -1,
			"ratelimit:{z:}:1000:-1:c"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := cellKey(DefaultPrefix, tc.key, tc.seq); got != tc.want {
				t.Fatalf("cellKey = %q, want %q", got, tc.want)
			}
			cur, prev := cellKeys(DefaultPrefix, tc.key, tc.seq)
			if cur != tc.want {
				t.Fatalf("cellKeys cur = %q, want %q", cur, tc.want)
			}
			if want := cellKey(DefaultPrefix, tc.key, tc.seq-1); prev != want {
				t.Fatalf("cellKeys prev = %q, want %q", prev, want)
			}
			if hashTag(cur) != hashTag(prev) {
				t.Fatalf("hash tags differ: %q vs %q", cur, prev)
			}
		})
	}
}

// TestCellKey_HostileIdentifiersNeverCollide encodes identifiers built to
// collide with each other or to break out of the hash tag and checks that
// every key is distinct, parses back, and keeps its tag.
func TestCellKey_HostileIdentifiersNeverCollide(t *testing.T) {
	big := strings.Repeat("x", 64<<10)
	ids := []string{
		"", ":", "::", "{", "}", "{}", "}{", "a:b", "a%3Ab", "a%3ab", "%", "%25", "%%",
		"\n", "\r\n", "a\nb", "\x00", "\xff", "\xc3\x28", "é", "e\u0301",
		"x}:60000:1", "}:1000:5:{", "ratelimit:{a:b}:1000:1", big, big + ":", big + "{",
		strings.Repeat("{", 1000), strings.Repeat("%7B", 1000),
	}
	namespaces := []string{"api", "api:", "api:x", "", "{api}"}
	seen := make(map[string]string)
	for _, ns := range namespaces {
		for _, id := range ids {
			for _, w := range []time.Duration{time.Second, time.Minute} {
				k := engine.Key{Namespace: ns, Identifier: id, Window: w}
				s := cellKey(DefaultPrefix, k, 42)
				desc := strconv.Quote(ns) + "/" + strconv.Quote(trunc(id)) + "/" + w.String()
				if other, dup := seen[s]; dup {
					t.Fatalf("%s and %s share key %q", desc, other, trunc(s))
				}
				seen[s] = desc
				got, seq, ok := parseCellKey(DefaultPrefix, s)
				if !ok || got.Namespace != ns || got.Identifier != id || got.Window.Milliseconds() != w.Milliseconds() || seq != 42 {
					t.Fatalf("%s: key %q does not parse back", desc, trunc(s))
				}
				if tag, want := hashTag(s), string(escape(nil, ns))+":"+string(escape(nil, id)); tag != want {
					t.Fatalf("%s: hash tag %q escapes its braces", desc, trunc(tag))
				}
			}
		}
	}
}

// FuzzKeyEncodingInjective proves the key encoding injective: two cells
// share a key only if they are the same cell, every key parses back to its
// cell, and every cell of one (namespace, identifier) has the same hash tag.
func FuzzKeyEncodingInjective(f *testing.F) {
	f.Add("api", "1.2.3.4", int64(1000), int64(5), "api", "1.2.3.4", int64(1000), int64(6))
	f.Add("a:b", "c", int64(1000), int64(1), "a", "b:c", int64(1000), int64(1))
	f.Add("a", "%3A", int64(1), int64(1), "a", ":", int64(1), int64(1))
	f.Add("x", "}:1000:1", int64(1000), int64(2), "x}", "1000:1", int64(1000), int64(2))
	f.Add("", "\xff\x00\n", int64(60000), int64(-1), "", "\xff\x00\r", int64(60000), int64(-1))
	f.Fuzz(func(t *testing.T, ns1, id1 string, w1, s1 int64, ns2, id2 string, w2, s2 int64) {
		// Windows the engine can produce: 1 ms up to about 35 years.
		w1, w2 = 1+int64(uint64(w1)%(1<<40)), 1+int64(uint64(w2)%(1<<40))
		k1 := engine.Key{Namespace: ns1, Identifier: id1, Window: time.Duration(w1) * time.Millisecond}
		k2 := engine.Key{Namespace: ns2, Identifier: id2, Window: time.Duration(w2) * time.Millisecond}
		a, b := cellKey(DefaultPrefix, k1, s1), cellKey(DefaultPrefix, k2, s2)
		same := ns1 == ns2 && id1 == id2 && w1 == w2 && s1 == s2
		if (a == b) != same {
			t.Fatalf("cells (%q,%q,%d,%d) and (%q,%q,%d,%d): keys equal=%v, cells equal=%v",
				ns1, id1, w1, s1, ns2, id2, w2, s2, a == b, same)
		}
		k, s, ok := parseCellKey(DefaultPrefix, a)
		if !ok || k.Namespace != ns1 || k.Identifier != id1 || k.Window.Milliseconds() != w1 || s != s1 {
			t.Fatalf("key %q parses to (%+v,%d,%v), want (%q,%q,%d,%d)", a, k, s, ok, ns1, id1, w1, s1)
		}
		if (hashTag(a) == hashTag(b)) != (ns1 == ns2 && id1 == id2) {
			t.Fatalf("hash tags of %q and %q: equal=%v, but (ns, id) equal=%v", a, b, hashTag(a) == hashTag(b), ns1 == ns2 && id1 == id2)
		}
		cur, prev := cellKeys(DefaultPrefix, k1, s1)
		if cur != a || prev != cellKey(DefaultPrefix, k1, s1-1) || hashTag(cur) != hashTag(prev) {
			t.Fatalf("cellKeys(%q) = %q, %q", a, cur, prev)
		}
	})
}

// TestRedis_HostileIdentifiersNeverCollide writes a distinct count for each
// hostile identifier into a real Redis and reads every one back.
func TestRedis_HostileIdentifiersNeverCollide(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{})
	big := strings.Repeat("A", 64<<10)
	ids := []string{
		"", ":", "{", "}", "{}", "a:b", "a%3Ab", "%", "%25", "\n", "a\nb", "a\r\nb", "\x00",
		"\xff\xfe", "\xc3\x28", "é", "x}:60000:1", "api:x", big, big + "\n", big + "{",
	}
	seq := nowSeq()
	var batch []engine.Delta
	for i, id := range ids {
		batch = append(batch, engine.Delta{Key: key(id), Sequence: seq, Delta: int64(i + 1), Own: int64(i + 1)})
	}
	// One that would collide with "x" under a naive "ns:id" join.
	batch = append(batch, engine.Delta{
		Key: engine.Key{Namespace: "api:x", Identifier: "", Window: time.Minute}, Sequence: seq, Delta: 100, Own: 100,
	})
	if err := o.Flush(ctxT(t), batch); err != nil {
		t.Fatalf("Flush: %v", err)
	}
	for _, d := range batch {
		if !d.Done || d.Totals.Cur != d.Delta {
			t.Fatalf("%q: Total %d, want %d: another identifier shares its key", trunc(d.Key.Identifier), d.Totals.Cur, d.Delta)
		}
		cur, _, err := readPair(o, ctxT(t), d.Key, seq)
		if err != nil || cur != d.Delta {
			t.Fatalf("%q: Read %d, %v; want %d", trunc(d.Key.Identifier), cur, err, d.Delta)
		}
	}
	// One cell per identifier, none shared.
	if n, err := srv.Client().DBSize(ctxT(t)).Result(); err != nil || n != int64(len(batch)) {
		t.Fatalf("DBSIZE = %d (%v), want %d distinct keys", n, err, len(batch))
	}
}

// trunc shortens s for a failure message.
func trunc(s string) string {
	if len(s) > 40 {
		return s[:40] + "…"
	}
	return s
}
