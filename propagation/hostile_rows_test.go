package propagation

import (
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
)

// TestHostileRows_NeverStopTheLayer: rows no region of this build writes
// (another tool's, a corrupt restore, a bug elsewhere) are read by every
// region. None may stop a pull, panic or lower a count: a window of
// 2^62 ms once became a zero-length window (its nanoseconds overflow),
// and the import divided by it and panicked in the flush, killing the
// process of every region that read the row.
func TestHostileRows_NeverStopTheLayer(t *testing.T) {
	s := newSetup(t)
	a, b := s.region("a"), s.region("b")
	a.decide("k", 100, 60)
	a.p.FlushOnce(bg)
	db := mysqltest.Open(t, s.dsn)
	far := int64(math.MaxInt64)
	type row struct {
		ns, id     string
		w, seq     int64
		region     string
		count, exp int64
	}
	w := window.Milliseconds()
	rows := []row{
		{"z", "k", 1 << 62, 1, "x1", 5, far},
		{"z", "k", math.MaxInt64, 0, "x2", 5, far},
		{"z", "k", 1 << 52, 0, "x3", 5, far},
		{"z", "k", w, -5, "x4", 5, far},
		{"z", "k", w, math.MaxInt64, "x5", 5, far},
		{"z", "k", w, seq0, "x6", -7, far},
		{"z", "k", w, seq0, "", 3, far},
		{"z", "\x00\xff" + strings.Repeat("\xfe", 126), w, seq0, "x7\x00", 5, far},
		{"", "", w, seq0, "x8", 5, far},
		{"nozone", "k", w, seq0, "x9", 5, far},
	}
	for i, r := range rows {
		_, err := db.Exec(`INSERT INTO ratelimit_global_counts
  (namespace, identifier, window_ms, sequence, region, count, expires_ms, updated_ms)
  VALUES (?, ?, ?, ?, ?, ?, ?, ROUND(UNIX_TIMESTAMP(NOW(3)) * 1000))`,
			[]byte(r.ns), []byte(r.id), r.w, r.seq, []byte(r.region), r.count, r.exp)
		if err != nil {
			t.Fatalf("row %d: %v", i, err)
		}
		_, err = db.Exec(`INSERT INTO ratelimit_blocklist
  (namespace, identifier, window_ms, sequence, origin_region, limit_units, count_cur, count_prev, expires_ms, updated_ms)
  VALUES (?, ?, ?, ?, ?, 10, ?, ?, ?, ROUND(UNIX_TIMESTAMP(NOW(3)) * 1000))`,
			[]byte(r.ns), []byte(r.id), r.w, r.seq, []byte(r.region), r.count, r.count, r.exp)
		if err != nil {
			t.Fatalf("denial row %d: %v", i, err)
		}
	}
	for _, r := range []*region{a, b} {
		func() {
			defer func() {
				if v := recover(); v != nil {
					t.Fatalf("region %s panicked on the rows: %v", r.p.Region(), v)
				}
			}()
			r.p.FlushOnce(bg)
			r.p.GlobalSyncOnce(bg)
			r.p.CleanupOnce(bg)
			r.p.FlushOnce(bg)
		}()
	}
	// a's 60 still reaches b; the x6 row (its count below zero) and the
	// others of the cell add what they say, nothing less.
	c := b.cell(t, "k", seq0)
	if c.Global < 60 {
		t.Fatalf("b imports %d of k, below a's 60: %s", c.Global, fmt.Sprint(c))
	}
}
