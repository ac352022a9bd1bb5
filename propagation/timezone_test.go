package propagation

import (
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
)

// TestTimeZone_ADatabaseInAnotherZoneStampsUnixTime: the server's zone is
// +05:00 (as --default-time-zone=+05:00 sets it; the DSN does not say).
// The layer's sessions run in UTC, and the change stamps are Unix time
// whatever the zone: a stamp five hours off would put every row ahead of
// the clock check, or behind every cursor. Checked, found right.
func TestTimeZone_ADatabaseInAnotherZoneStampsUnixTime(t *testing.T) {
	srv := mysqltest.Start(t)
	dsn := srv.NewDatabase(t)
	root := mysqltest.Open(t, srv.DSN(""))
	if _, err := root.Exec("SET GLOBAL time_zone = '+05:00'"); err != nil {
		t.Fatal(err)
	}
	s := newSetup(t)
	s.dsn = dsn
	a, b := s.region("a"), s.region("b")
	before := time.Now().UnixMilli()
	a.decide("k", 100, 60)
	a.p.FlushOnce(bg)
	after := time.Now().UnixMilli()
	var stamp int64
	if err := mysqltest.Open(t, dsn).QueryRow("SELECT updated_ms FROM ratelimit_global_counts").Scan(&stamp); err != nil {
		t.Fatal(err)
	}
	if stamp < before-5000 || stamp > after+5000 {
		t.Fatalf("updated_ms %d is %s from this machine's clock", stamp, time.Duration(stamp-before)*time.Millisecond)
	}
	b.p.GlobalSyncOnce(bg) // reads the database's clock
	b.p.FlushOnce(bg)
	a.decide("k", 100, 10)
	a.p.FlushOnce(bg)
	b.p.FlushOnce(bg)
	if got := b.cell(t, "k", seq0).Global; got != 70 {
		t.Fatalf("b imports %d, want a's 70", got)
	}
	if st := b.p.Stats(); st.ClockSteps != 0 {
		t.Fatalf("the zone taken for a clock step: %+v", st)
	}
}
