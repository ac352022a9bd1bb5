package propagation_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// clockStore is a store that reads the clock its writes stamp updated_ms
// with: the database's, or the model primary's.
type clockStore interface {
	propagation.Store
	propagation.ClockStore
}

// storeStep is one statement, sent to both stores.
type storeStep struct {
	what     string
	counts   []propagation.CountRow
	denials  []propagation.BlocklistRow
	deleteAt int64 // DeleteExpired of the counts at this time, chunk 100
	deleted  int64 // the rows it deletes
}

// The expiries the rows carry and reads filter on (Unix ms, long past on
// both clocks, so a deletion goes by the time it is given).
const (
	expSoon  = 1_000_000
	expLater = 2_000_000
	expLast  = 3_000_000
)

func crow(id, region string, count, ver, base, exp int64) propagation.CountRow {
	return propagation.CountRow{Namespace: "z", Identifier: id, WindowMs: 60_000, Sequence: 7, Region: region,
		Count: count, ResetVersion: ver, ResetBase: base, ExpiresMs: exp}
}

func drow(id, region string, limit, cur, prev, exp int64) propagation.BlocklistRow {
	return propagation.BlocklistRow{Namespace: "z", Identifier: id, WindowMs: 60_000, Sequence: 7, Region: region,
		Limit: limit, CountCur: cur, CountPrev: prev, ExpiresMs: exp}
}

// storeSteps: counts that rise, fall back and repeat; an expiry raised
// alone; a region's global reset marked (publish.go publishes
// MarksResets for a cell never reset, a reset's version once one is);
// denial rows whose limit changes without a count rising; and the
// cleanup.
var storeSteps = []storeStep{
	{what: "first rows", counts: []propagation.CountRow{
		crow("a", "r1", 5, propagation.MarksResets, 0, expSoon), crow("a", "r2", 7, propagation.MarksResets, 0, expLater),
		crow("b", "r1", 3, propagation.MarksResets, 0, expLater), crow("c", "r2", 2, propagation.MarksResets, 0, expSoon),
		crow("d", "r1", 1, propagation.MarksResets, 0, expSoon-1)}},
	{what: "a lower count, a higher one, an expiry raised alone", counts: []propagation.CountRow{
		crow("a", "r1", 3, propagation.MarksResets, 0, expSoon), crow("b", "r1", 4, propagation.MarksResets, 0, expLater),
		crow("c", "r2", 2, propagation.MarksResets, 0, expLast)}},
	{what: "a global reset marked on c, its count unchanged", counts: []propagation.CountRow{
		crow("c", "r2", 2, 5000, 2, expLast)}},
	{what: "the same reset with a lower base, and an older one", counts: []propagation.CountRow{
		crow("c", "r2", 2, 5000, 1, expLast), crow("b", "r1", 4, propagation.MarksResets, 0, expLater)}},
	{what: "denial rows", denials: []propagation.BlocklistRow{
		drow("x", "r1", 10, 5, 0, expSoon), drow("y", "r2", 10, 2, 1, expLater)}},
	{what: "a denial's previous count rises, another's limit alone changes", denials: []propagation.BlocklistRow{
		drow("x", "r1", 12, 4, 3, expSoon), drow("y", "r2", 20, 2, 1, expLater)}},
	{what: "the cleanup of the rows expired at expSoon", deleteAt: expSoon, deleted: 2},
}

// TestStoreModel_AgreesWithMySQL: the simulator's model of MySQL
// (internal/simmodel), on which every published figure of MySQL's
// statements, rows and a count's travel between regions rests, answers
// each statement of the store as the real store does on MariaDB: the
// same rows in whole reads and pages, the same rows in reads of what
// changed since a step, and the same rows deleted.
func TestStoreModel_AgreesWithMySQL(t *testing.T) {
	mysqltest.Require(t)
	ctx := context.Background()
	srv := mysqltest.Start(t)
	real, err := propagation.OpenStore(propagation.Config{DSN: srv.NewDatabase(t), Region: "r1", Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { real.Close() })
	if err := real.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	ms := time.Now().UnixMilli()
	m := simmodel.NewMySQL(func() int64 { return ms }, 1, 5000, []*simmodel.MySQLRegion{{}})
	model := m.Client(0, nil).(clockStore)
	stores := []struct {
		name string
		st   clockStore
		// next waits until a write would stamp a time after every row's.
		next func(t *testing.T, last int64)
	}{
		{"mysql", real, func(t *testing.T, last int64) {
			deadline := time.Now().Add(5 * time.Second)
			for {
				now, err := real.Clock(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if now > last {
					return
				}
				if time.Now().After(deadline) {
					t.Fatalf("the database's clock stays at %d", now)
				}
			}
		}},
		{"model", model, func(*testing.T, int64) { ms += 10 }},
	}
	// What each store answered, step by step, to compare.
	answers := make([][]string, len(stores))
	for i, s := range stores {
		var last int64
		for _, step := range storeSteps {
			s.next(t, last)
			since, err := s.st.Clock(ctx)
			if err != nil {
				t.Fatal(err)
			}
			var out []string
			switch {
			case step.counts != nil:
				err = s.st.UpsertCounts(ctx, ptrs(step.counts))
			case step.denials != nil:
				err = s.st.UpsertDenials(ctx, ptrs(step.denials))
			default:
				var n int64
				n, err = s.st.DeleteExpired(ctx, propagation.Counts, step.deleteAt, 100)
				out = append(out, fmt.Sprintf("deleted %d", n))
			}
			if err != nil {
				t.Fatalf("%s, %s: %v", s.name, step.what, err)
			}
			if s.name == "model" {
				ms += 10 // the write lands; the reads come after it
			}
			for _, r := range []struct {
				what string
				read propagation.Read
			}{
				{"whole", propagation.Read{Limit: 100}},
				{"live after expSoon", propagation.Read{Now: expSoon, Limit: 100}},
				{"changed since the step", propagation.Read{Changed: true, Since: since, Limit: 100}},
			} {
				counts, denials, stamp := readAll(t, s.st, r.read)
				last = max(last, stamp)
				out = append(out, r.what+": "+strings.Join(counts, " ")+" | "+strings.Join(denials, " "))
				// The same read in pages of two, resumed after each
				// page's last row, gives the same rows.
				pc, pd := readPaged(t, s.st, r.read)
				if !slices.Equal(pc, counts) || !slices.Equal(pd, denials) {
					t.Errorf("%s, %s, %s: in pages %v | %v, whole %v | %v", s.name, step.what, r.what, pc, pd, counts, denials)
				}
			}
			answers[i] = append(answers[i], out...)
		}
	}
	k := 0
	for _, step := range storeSteps {
		for range 3 + min(step.deleteAt, 1) {
			if a, b := answers[0][k], answers[1][k]; a != b {
				t.Errorf("after %s:\n  mysql %s\n  model %s", step.what, a, b)
			}
			k++
		}
	}
	// The cleanup deleted what was due, in both.
	for i, s := range stores {
		if want := fmt.Sprintf("deleted %d", storeSteps[len(storeSteps)-1].deleted); answers[i][k-4] != want {
			t.Errorf("%s: %s, want %s", s.name, answers[i][k-4], want)
		}
	}
}

func ptrs[R any](rows []R) []*R {
	out := make([]*R, len(rows))
	for i := range rows {
		r := rows[i]
		out[i] = &r
	}
	return out
}

// readAll reads both tables in one page each and renders their rows
// without the change time, which each store stamps on its own clock; it
// returns the latest change time read.
func readAll(t *testing.T, st propagation.Store, r propagation.Read) (counts, denials []string, stamp int64) {
	t.Helper()
	cs, err := st.ReadCounts(context.Background(), r)
	if err != nil {
		t.Fatal(err)
	}
	ds, err := st.ReadDenials(context.Background(), r)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cs {
		counts = append(counts, countText(c))
		stamp = max(stamp, c.UpdatedMs)
	}
	for _, d := range ds {
		denials = append(denials, denialText(d))
		stamp = max(stamp, d.UpdatedMs)
	}
	return counts, denials, stamp
}

// readPaged reads r in pages of two.
func readPaged(t *testing.T, st propagation.Store, r propagation.Read) (counts, denials []string) {
	t.Helper()
	r.Limit = 2
	for p := r; ; {
		cs, err := st.ReadCounts(context.Background(), p)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range cs {
			counts = append(counts, countText(c))
		}
		if len(cs) < p.Limit {
			break
		}
		l := cs[len(cs)-1]
		p.After = &propagation.RowKey{Namespace: l.Namespace, Identifier: l.Identifier, WindowMs: l.WindowMs, Sequence: l.Sequence, Region: l.Region, UpdatedMs: l.UpdatedMs}
	}
	for p := r; ; {
		ds, err := st.ReadDenials(context.Background(), p)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range ds {
			denials = append(denials, denialText(d))
		}
		if len(ds) < p.Limit {
			break
		}
		l := ds[len(ds)-1]
		p.After = &propagation.RowKey{Namespace: l.Namespace, Identifier: l.Identifier, WindowMs: l.WindowMs, Sequence: l.Sequence, Region: l.Region, UpdatedMs: l.UpdatedMs}
	}
	return counts, denials
}

func countText(c propagation.CountRow) string {
	return fmt.Sprintf("%s/%s=%d(v%d,b%d,e%d)", c.Identifier, c.Region, c.Count, c.ResetVersion, c.ResetBase, c.ExpiresMs)
}

func denialText(d propagation.BlocklistRow) string {
	return fmt.Sprintf("%s/%s=%d,%d(l%d,e%d)", d.Identifier, d.Region, d.CountCur, d.CountPrev, d.Limit, d.ExpiresMs)
}
