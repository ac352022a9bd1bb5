package simmodel

import (
	"errors"
	"testing"

	"github.com/edgelimit/caddy-ratelimit/propagation"
)

func countRow(id string, seq, n int64) *propagation.CountRow {
	return &propagation.CountRow{Namespace: "z", Identifier: id, WindowMs: 60_000, Sequence: seq, Region: "r1", Count: n, ExpiresMs: 1 << 50}
}

func newTestMySQL(clk *clock, replicaLag float64) *MySQL {
	return NewMySQL(clk.now, 1, 1000, []*MySQLRegion{
		{ToPrimary: Link{Latency: Dist{Median: 2}}},
		{ToPrimary: Link{Latency: Dist{Median: 100}}, Replica: replicaLag > 0, Local: Link{Latency: Dist{Median: 1}}, Lag: Dist{Median: replicaLag}},
	})
}

func TestMySQL_CountsOnlyRiseAndStampTheirChange(t *testing.T) {
	clk := &clock{ms: 1000}
	m := newTestMySQL(clk, 0)
	s := m.Client(0, nil)
	for _, n := range []int64{5, 3} {
		if err := s.UpsertCounts(bg, []*propagation.CountRow{countRow("a", 1, n)}); err != nil {
			t.Fatal(err)
		}
		clk.ms += 10
	}
	rows, err := s.ReadCounts(bg, propagation.Read{Now: 0, Limit: 10})
	if err != nil || len(rows) != 1 || rows[0].Count != 5 || rows[0].UpdatedMs != 1000 {
		t.Fatalf("rows %+v (%v): want one of count 5 changed at 1000", rows, err)
	}
	if c := m.Cost(0); c.Statements != 3 || c.RowsWritten != 2 || c.RowsRead != 1 {
		t.Fatalf("cost %+v", c)
	}
}

func TestMySQL_ChangesPageInChangeOrder(t *testing.T) {
	clk := &clock{ms: 1000}
	m := newTestMySQL(clk, 0)
	s := m.Client(0, nil)
	_ = s.UpsertCounts(bg, []*propagation.CountRow{countRow("c", 1, 1), countRow("a", 1, 1)})
	clk.ms = 2000
	_ = s.UpsertCounts(bg, []*propagation.CountRow{countRow("b", 1, 1), countRow("c", 1, 2)})
	clk.ms = 3000
	var got []string
	r := propagation.Read{Changed: true, Since: 500, Limit: 2}
	for {
		rows, err := s.ReadCounts(bg, r)
		if err != nil {
			t.Fatal(err)
		}
		for _, row := range rows {
			got = append(got, row.Identifier)
		}
		if len(rows) < r.Limit {
			break
		}
		last := rows[len(rows)-1]
		r.After = &propagation.RowKey{Namespace: last.Namespace, Identifier: last.Identifier, WindowMs: last.WindowMs, Sequence: last.Sequence, Region: last.Region, UpdatedMs: last.UpdatedMs}
	}
	if want := "a b c"; join(got) != want {
		t.Fatalf("pages read %v, want %s (c's change at 2000 moved it after a)", got, want)
	}
}

func join(s []string) string {
	out := ""
	for i, x := range s {
		if i > 0 {
			out += " "
		}
		out += x
	}
	return out
}

func TestMySQL_ReplicaReadsLateAndWritesArriveHalfARoundTripLater(t *testing.T) {
	clk := &clock{ms: 1000}
	m := newTestMySQL(clk, 500)
	tick := &Tick{}
	tick.Begin(clk.ms)
	far := m.Client(1, tick) // 100 ms round trip; reads from its replica
	if err := far.UpsertCounts(bg, []*propagation.CountRow{countRow("a", 1, 1)}); err != nil {
		t.Fatal(err)
	}
	primary := m.Client(0, nil)
	read := func(s propagation.Store) int {
		rows, err := s.ReadCounts(bg, propagation.Read{Limit: 10})
		if err != nil {
			t.Fatal(err)
		}
		return len(rows)
	}
	clk.ms = 1049
	if n := read(primary); n != 0 {
		t.Fatal("the write reached the primary before half its round trip")
	}
	clk.ms = 1050
	if n := read(primary); n != 1 {
		t.Fatal("the write did not reach the primary after half its round trip")
	}
	clk.ms = 1400
	if n := read(far); n != 0 {
		t.Fatal("the replica showed a write younger than its lag")
	}
	clk.ms = 1600
	if n := read(far); n != 1 {
		t.Fatal("the replica did not show a write older than its lag")
	}
}

func TestMySQL_PrimaryDownRefusesWrites(t *testing.T) {
	clk := &clock{ms: 1000}
	m := newTestMySQL(clk, 0)
	m.SetPrimaryDown(Span{From: 0, To: 2000})
	if err := m.Client(0, nil).UpsertCounts(bg, []*propagation.CountRow{countRow("a", 1, 1)}); !errors.Is(err, ErrDown) {
		t.Fatalf("write to a primary that is down: %v", err)
	}
	clk.ms = 2000
	if err := m.Client(0, nil).UpsertCounts(bg, []*propagation.CountRow{countRow("a", 1, 1)}); err != nil {
		t.Fatalf("write after the outage: %v", err)
	}
}

func TestMySQL_CleanupDeletesInExpiryOrder(t *testing.T) {
	clk := &clock{ms: 1000}
	m := newTestMySQL(clk, 0)
	s := m.Client(0, nil)
	rows := []*propagation.CountRow{countRow("a", 1, 1), countRow("b", 1, 1), countRow("c", 1, 1)}
	rows[0].ExpiresMs, rows[1].ExpiresMs, rows[2].ExpiresMs = 300, 100, 5000
	_ = s.UpsertCounts(bg, rows)
	clk.ms = 1010
	n, err := s.DeleteExpired(bg, propagation.Counts, 1000, 1)
	if err != nil || n != 1 || m.Count(propagation.Cell{Namespace: "z", Identifier: "b", WindowMs: 60_000, Sequence: 1}, "r1") != 0 {
		t.Fatalf("deleted %d (%v): want b first", n, err)
	}
	if m.Rows(propagation.Counts) != 2 {
		t.Fatalf("%d rows left, want 2", m.Rows(propagation.Counts))
	}
}

func TestGate_OpensOnFailuresAndProbesAfterItsTimeout(t *testing.T) {
	clk := &clock{ms: 0}
	g := NewGate(clk.now, 30_000_000_000, 5_000_000_000, 5, 0.5)
	fail := errors.New("down")
	for range 5 {
		_ = g.Do(func() error { return fail })
		clk.ms += 100
	}
	if err := g.Do(func() error { return nil }); !errors.Is(err, ErrGateOpen) {
		t.Fatalf("after five failures: %v, want the gate open", err)
	}
	clk.ms += 5000
	ran := false
	if err := g.Do(func() error { ran = true; return nil }); err != nil || !ran {
		t.Fatalf("the probe after the timeout: %v, ran %v", err, ran)
	}
	if g.Tripped != 1 || g.Refused != 1 {
		t.Fatalf("tripped %d, refused %d", g.Tripped, g.Refused)
	}
}
