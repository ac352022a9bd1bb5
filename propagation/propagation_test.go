package propagation

import (
	"testing"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
)

func TestDenialGossip_BurstAtADeniedAtB(t *testing.T) {
	s := newSetup(t)
	a, b := s.region("a"), s.region("b")
	if n := a.decide("burst", 10, 15); n != 10 {
		t.Fatalf("A admitted %d of 15, want 10", n)
	}
	a.p.FlushOnce(bg)
	if st := a.p.Stats(); st.DenialsEmitted != 1 {
		t.Fatalf("A emitted %d denial rows, want 1", st.DenialsEmitted)
	}
	var cur, prev, lim, exp int64
	var origin []byte
	db := mysqltest.Open(t, s.dsn)
	err := db.QueryRow(`SELECT count_cur, count_prev, limit_units, expires_ms, origin_region FROM ratelimit_blocklist
		WHERE namespace = ? AND identifier = ? AND window_ms = ? AND sequence = ?`,
		[]byte("z"), []byte("burst"), window.Milliseconds(), seq0).Scan(&cur, &prev, &lim, &exp, &origin)
	if err != nil {
		t.Fatal(err)
	}
	if cur != 10 || prev != 0 || lim != 10 || exp != (seq0+2)*window.Milliseconds() || string(origin) != "a" {
		t.Fatalf("row: cur %d prev %d limit %d expires %d region %q", cur, prev, lim, exp, origin)
	}
	b.p.FlushOnce(bg)
	if n := b.decide("burst", 10, 1); n != 0 {
		t.Fatal("B admitted the key A denied, after reading A's denial row")
	}
	if c := b.cell(t, "burst", seq0); c.Global != 10 || c.Regional != 0 {
		t.Fatalf("B's cell = %+v, want the 10 of region a as global", c)
	}
	// B denied on imported counts only: below half the limit regionally,
	// so no row of B's echoes A's.
	b.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_blocklist", ""); n != 1 {
		t.Fatalf("%d blocklist rows, want A's one (no echo from B)", n)
	}
	// A's count reached B through both tables in one flush; whichever B
	// read first raised the import, the other was no news.
	if st := b.p.Stats(); st.DenialsEmitted != 0 || st.DenialsFiltered != 1 || st.DenialsApplied+st.CountsApplied != 1 {
		t.Fatalf("B stats: %+v", st)
	}
}

func TestIdentifierSecret_BurstAtADeniedAtB(t *testing.T) {
	s := newSetup(t)
	mapped := func(c *Config) { c.MapID = hmacOf }
	a, b := s.region("a", mapped), s.region("b", mapped)
	a.decide("api-key-1", 10, 12)
	a.p.FlushOnce(bg)
	if n := countRows(t, s.dsn, "ratelimit_blocklist", "WHERE identifier = ?", []byte(hmacOf("api-key-1"))); n != 1 {
		t.Fatal("the row does not hold the identifier's HMAC")
	}
	if n := countRows(t, s.dsn, "ratelimit_blocklist", "WHERE identifier = ?", []byte("api-key-1")); n != 0 {
		t.Fatal("a row holds the raw identifier")
	}
	// B has never seen the key: the import waits for its entry.
	b.p.FlushOnce(bg)
	if b.eng.HasEntry(key("api-key-1")) {
		t.Fatal("B made an entry from an HMAC it cannot invert")
	}
	if n := b.decide("api-key-1", 10, 1); n != 0 {
		t.Fatal("B's first request for the key passed; the waiting import was not applied at entry creation")
	}
	// A key B already holds is found through the index.
	b.decide("api-key-2", 10, 1)
	a.decide("api-key-2", 10, 12)
	a.p.FlushOnce(bg)
	b.p.FlushOnce(bg)
	if c := b.cell(t, "api-key-2", seq0); c.Global != 10 {
		t.Fatalf("B's indexed cell global = %d, want 10", c.Global)
	}
}
