package propagation

import (
	"testing"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
)

// TestOverrides_TableEmptiedByHandIsWrittenBack: an operator empties
// ratelimit_overrides (TRUNCATE, then DELETE FROM) mid-window. The
// regions that hold the overrides write them back after their next whole
// read, newest version first, removals included: a region that starts
// afterwards loads them, and a removed override does not come back.
func TestOverrides_TableEmptiedByHandIsWrittenBack(t *testing.T) {
	for _, empty := range []string{"TRUNCATE TABLE ratelimit_overrides", "DELETE FROM ratelimit_overrides"} {
		t.Run(empty, func(t *testing.T) {
			s := newSetup(t)
			a, b := s.region("a"), s.region("b")
			day := s.clk.Now().UnixMilli() + 86_400_000
			a.p.PutOverride(OverrideRow{Namespace: "z", Identifier: "cust", Limit: 500, Region: "a", Version: 2000})
			a.p.PutOverride(OverrideRow{Namespace: "z", Identifier: "gone", Limit: 7, Region: "a", Version: 2000})
			a.p.FlushOnce(bg)
			b.p.FlushOnce(bg) // b's whole read holds both
			// b makes the newer change of cust and removes gone; a
			// does not pull them before the table is emptied.
			b.p.PutOverride(OverrideRow{Namespace: "z", Identifier: "cust", Limit: 900, Region: "b", Version: 3000})
			b.p.PutOverride(OverrideRow{Namespace: "z", Identifier: "gone", Region: "b", Version: 3000, Deleted: true, ExpiresMs: day})
			b.p.FlushOnce(bg)

			db := mysqltest.Open(t, s.dsn)
			if _, err := db.Exec(empty); err != nil {
				t.Fatal(err)
			}
			// a reads whole first and writes back its older rows; b's
			// newer ones replace them.
			for _, r := range []*region{a, b} {
				r.p.readWholeNext()
				r.p.FlushOnce(bg)
				r.p.FlushOnce(bg)
			}
			c := s.region("c")
			all, err := c.p.LoadOverrides(bg)
			if err != nil {
				t.Fatal(err)
			}
			got := map[string]OverrideRow{}
			for _, o := range all {
				got[o.Identifier] = o
			}
			if o := got["cust"]; o.Limit != 900 || o.Version != 3000 {
				t.Errorf("a region that starts after the table was emptied loads cust as %+v; want b's limit of 900", o)
			}
			if o, ok := got["gone"]; !ok || !o.Deleted {
				t.Errorf("the removal of gone was not written back (%+v, %v): a's older limit could come back", o, ok)
			}
			if n := a.p.Stats().OverrideRowsMissing + b.p.Stats().OverrideRowsMissing; n < 2 {
				t.Errorf("override rows missing counted %d, want at least 2", n)
			}
		})
	}
}
