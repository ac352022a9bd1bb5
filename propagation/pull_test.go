package propagation

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
)

// ageRows moves every row's change time back by ms, as if it had been
// written that long ago.
func ageRows(t *testing.T, dsn string, ms int64) {
	t.Helper()
	db := mysqltest.Open(t, dsn)
	for _, tbl := range []string{"ratelimit_global_counts", "ratelimit_blocklist"} {
		if _, err := db.Exec(`UPDATE `+tbl+` SET updated_ms = updated_ms - ?`, ms); err != nil {
			t.Fatal(err)
		}
	}
}

// serverRowsRead is what the server says it read, in rows, since it
// started: Rows_read (MariaDB) or Innodb_rows_read (MySQL).
func serverRowsRead(t *testing.T, dsn string) int64 {
	t.Helper()
	db := mysqltest.Open(t, dsn)
	var name string
	var n int64
	err := db.QueryRow(`SHOW GLOBAL STATUS WHERE Variable_name IN ('Rows_read', 'Innodb_rows_read')`).Scan(&name, &n)
	if err != nil {
		t.Fatalf("the server's rows read: %v", err)
	}
	return n
}

// TestPull_ASteadyTableCostsNothing: after its first, whole, read, a pull
// reads only the rows whose counts rose since the newest change it saw
// (less the margin): a table nobody writes costs a pull no row, and one
// count that rises costs one.
func TestPull_ASteadyTableCostsNothing(t *testing.T) {
	s := newSetup(t)
	a, b := s.region("a"), s.region("b")
	for i := range 50 {
		a.decide(fmt.Sprintf("k%02d", i), 100, 60)
	}
	a.p.FlushOnce(bg)
	ageRows(t, s.dsn, 3*changeMargin.Milliseconds())
	b.p.FlushOnce(bg)
	st := b.p.Stats()
	if st.CountRowsRead != 50 || st.WholeReads != int64(tables) {
		t.Fatalf("first pull read %d count rows in %d whole reads, want the 50 rows of a whole read of each table", st.CountRowsRead, st.WholeReads)
	}
	// Once the margin has passed since the newest row was seen, pulls
	// start strictly after it.
	s.clk.Add(changeMargin)
	examined := serverRowsRead(t, s.dsn)
	for range 3 {
		b.p.FlushOnce(bg)
	}
	// Nor does the server look at a row for them: the rows of the newest
	// change time are behind the cursor, not filtered one by one.
	if n := serverRowsRead(t, s.dsn) - examined; n >= 50 {
		t.Fatalf("three pulls of a steady table made the server read %d rows, want fewer than the table's 50", n)
	}
	if got := b.p.Stats(); got.CountRowsRead != 50 || got.ChangeReads != 3*int64(tables) {
		t.Fatalf("three pulls of a steady table read %d rows more (%d pulls of changes), want none",
			got.CountRowsRead-50, got.ChangeReads)
	}
	a.decide("k07", 100, 5)
	a.p.FlushOnce(bg)
	b.p.FlushOnce(bg)
	if got := b.p.Stats(); got.CountRowsRead != 51 {
		t.Fatalf("a pull after one count rose read %d rows, want that one", got.CountRowsRead-50)
	}
	if c := b.cell(t, "k07", seq0); c.Global != 65 {
		t.Fatalf("b's cell = %+v, want a's 65 as global", c)
	}
}

// TestPull_ChangeTimeMovesOnlyWhenACountRises: a repeated or lower write
// (a new holder publishing again, a retry) leaves the row's change time,
// so pulls do not read it again.
func TestPull_ChangeTimeMovesOnlyWhenACountRises(t *testing.T) {
	s := newSetup(t)
	a := s.region("a")
	store := a.p.store
	row := func(n int64) []*CountRow {
		return []*CountRow{{Namespace: "z", Identifier: "k", WindowMs: 60_000, Sequence: seq0, Region: "a", Count: n, ExpiresMs: expiresMs(seq0, 60_000)}}
	}
	db := mysqltest.Open(t, s.dsn)
	changed := func() int64 {
		var u int64
		if err := db.QueryRow(`SELECT updated_ms FROM ratelimit_global_counts`).Scan(&u); err != nil {
			t.Fatal(err)
		}
		return u
	}
	if err := store.UpsertCounts(bg, row(10)); err != nil {
		t.Fatal(err)
	}
	if u := changed(); u <= 0 {
		t.Fatalf("a new row's change time is %d", u)
	}
	ageRows(t, s.dsn, 10_000)
	first := changed()
	for _, n := range []int64{10, 7} {
		if err := store.UpsertCounts(bg, row(n)); err != nil {
			t.Fatal(err)
		}
		if u := changed(); u != first {
			t.Fatalf("writing %d over 10 moved the change time from %d to %d", n, first, u)
		}
	}
	if err := store.UpsertCounts(bg, row(11)); err != nil {
		t.Fatal(err)
	}
	if u := changed(); u < first+10_000 {
		t.Fatalf("a count that rose left the change time at %d (was %d, aged by 10 s)", u, first)
	}
}

// TestPull_WholeReadEveryTenthSync: the safety net reads a table whole
// every wholeEvery syncs, and only then: at the global sync the published
// counts and the overrides, at the blocklist sync the denial rows.
func TestPull_WholeReadEveryTenthSync(t *testing.T) {
	s := newSetup(t)
	b := s.region("b")
	b.p.FlushOnce(bg)
	for i := 1; i <= 2*wholeEvery; i++ {
		b.p.GlobalSyncOnce(bg)
		b.p.BlocklistSyncOnce(bg)
		b.p.FlushOnce(bg)
		if got, want := b.p.Stats().WholeReads, int64(tables)*int64(1+i/wholeEvery); got != want {
			t.Fatalf("after %d syncs: %d whole reads, want %d", i, got, want)
		}
	}
}

// oldSchema is the schema of the version before updated_ms.
var oldSchema = []string{
	`CREATE TABLE ratelimit_blocklist (
  namespace VARBINARY(64) NOT NULL, identifier VARBINARY(128) NOT NULL, window_ms BIGINT NOT NULL,
  sequence BIGINT NOT NULL, origin_region VARBINARY(96) NOT NULL, limit_units BIGINT NOT NULL,
  count_cur BIGINT NOT NULL, count_prev BIGINT NOT NULL, expires_ms BIGINT NOT NULL,
  PRIMARY KEY (namespace, identifier, window_ms, sequence, origin_region),
  KEY ratelimit_blocklist_expires (expires_ms)) ENGINE=InnoDB`,
	`CREATE TABLE ratelimit_global_counts (
  namespace VARBINARY(64) NOT NULL, identifier VARBINARY(128) NOT NULL, window_ms BIGINT NOT NULL,
  sequence BIGINT NOT NULL, region VARBINARY(96) NOT NULL, count BIGINT NOT NULL, expires_ms BIGINT NOT NULL,
  PRIMARY KEY (namespace, identifier, window_ms, sequence, region),
  KEY ratelimit_global_counts_expires (expires_ms)) ENGINE=InnoDB`,
}

// TestMigrate_UpgradesOlderTablesInPlace: tables of the version before
// the change column, with rows in them, are upgraded in place by many
// nodes migrating at once; the rows stay, and a process reads them (its
// first pull is whole) and the changes written after.
func TestMigrate_UpgradesOlderTablesInPlace(t *testing.T) {
	s := newSetup(t)
	db := mysqltest.Open(t, s.dsn)
	for _, q := range oldSchema {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	exp := expiresMs(seq0, 60_000)
	if _, err := db.Exec(`INSERT INTO ratelimit_global_counts VALUES ('z', 'old', 60000, ?, 'a', 40, ?)`, seq0, exp); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pool, err := sql.Open("mysql", s.dsn)
			if err != nil {
				errs <- err
				return
			}
			defer pool.Close()
			errs <- Migrate(context.Background(), pool)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("a node's migration: %v", err)
		}
	}
	var keys int
	if err := db.QueryRow(`SELECT COUNT(*) FROM information_schema.statistics WHERE table_schema = DATABASE()
		AND index_name IN ('ratelimit_blocklist_updated', 'ratelimit_global_counts_updated')`).Scan(&keys); err != nil || keys != 2 {
		t.Fatalf("%d change-time keys (%v), want one per table", keys, err)
	}
	var resets int
	if err := db.QueryRow(`SELECT COUNT(*) FROM information_schema.columns WHERE table_schema = DATABASE()
		AND table_name = 'ratelimit_global_counts' AND column_name IN ('reset_version', 'reset_base')`).Scan(&resets); err != nil || resets != 2 {
		t.Fatalf("%d reset columns in the counts table (%v), want reset_version and reset_base", resets, err)
	}
	a, b := s.region("a"), s.region("b")
	b.decide("old", 100, 1)
	b.p.FlushOnce(bg)
	if c := b.cell(t, "old", seq0); c.Global != 40 {
		t.Fatalf("b's cell of the row written before the upgrade = %+v, want 40 global", c)
	}
	a.decide("new", 100, 60)
	a.p.FlushOnce(bg)
	b.p.FlushOnce(bg)
	if c := b.cell(t, "new", seq0); c.Global != 60 {
		t.Fatalf("b's cell of a row written after the upgrade = %+v, want 60 global", c)
	}
}

// TestPull_ALateCommitWithinTheMarginIsRead: a row whose change time is
// older than the newest one a pull saw (its transaction committed later)
// is still read, while the newest row is younger than the margin.
func TestPull_ALateCommitWithinTheMarginIsRead(t *testing.T) {
	s := newSetup(t)
	a, b := s.region("a"), s.region("b")
	a.decide("first", 100, 60)
	a.p.FlushOnce(bg)
	b.p.FlushOnce(bg)
	db := mysqltest.Open(t, s.dsn)
	if _, err := db.Exec(`INSERT INTO ratelimit_global_counts (namespace, identifier, window_ms, sequence, region, count, expires_ms, updated_ms)
		SELECT 'z', 'late', window_ms, sequence, 'c', 30, expires_ms, updated_ms - 1000 FROM ratelimit_global_counts WHERE identifier = 'first'`); err != nil {
		t.Fatal(err)
	}
	b.decide("late", 100, 1)
	b.p.FlushOnce(bg)
	if c := b.cell(t, "late", seq0); c.Global != 30 {
		t.Fatalf("b's cell of the late row = %+v, want its 30 as global", c)
	}
}

func TestImport_LargerOfTwoTablesPerRegion(t *testing.T) {
	s := newSetup(t)
	s.limit = 20
	a, b := s.region("a"), s.region("b")
	a.decide("k", 20, 12) // published at 60 %
	a.p.FlushOnce(bg)
	a.decide("k", 20, 10) // denied at 20 after 8 more: a row with 20
	a.p.FlushOnce(bg)
	b.p.GlobalSyncOnce(bg)
	b.p.BlocklistSyncOnce(bg)
	b.p.FlushOnce(bg)
	if c := b.cell(t, "k", seq0); c.Global != 20 {
		t.Fatalf("B's global = %d, want 20: region a's units counted once (the larger row)", c.Global)
	}
	if got := b.p.ForeignCounts(key("k"), seq0); len(got) != 1 || got["a"] != 20 {
		t.Fatalf("foreign counts = %v", got)
	}
}

func TestImport_OwnRegionRaisesRegionalOnly(t *testing.T) {
	s := newSetup(t)
	s.limit = 100
	a1, a2 := s.region("a"), s.region("a")
	a1.decide("k", 100, 60)
	a1.p.FlushOnce(bg)
	a2.decide("k", 100, 1)
	a2.p.FlushOnce(bg)
	if c := a2.cell(t, "k", seq0); c.Regional != 60 || c.Global != 0 {
		t.Fatalf("a2's cell = %+v, want regional raised to 60 and no global", c)
	}
}

func TestImport_PreviousCellFromDenialRow(t *testing.T) {
	s := newSetup(t)
	a, b := s.region("a"), s.region("b")
	a.decide("k", 10, 8)
	s.clk.Add(window) // next window: 8 weigh as the previous cell
	a.decide("k", 10, 10)
	a.p.FlushOnce(bg)
	b.p.FlushOnce(bg)
	if c := b.cell(t, "k", seq0); c.Global != 8 {
		t.Fatalf("B's previous cell global = %d, want count_prev 8", c.Global)
	}
	if c := b.cell(t, "k", seq0+1); c.Global == 0 {
		t.Fatal("B's current cell got nothing from count_cur")
	}
}

func TestPull_PeriodicReadsEveryPage(t *testing.T) {
	s := newSetup(t)
	b := s.region("b")
	db := mysqltest.Open(t, s.dsn)
	const n = 2*pageSize + 17
	exp := (seq0 + 2) * window.Milliseconds()
	for start := 0; start < n; start += 500 {
		var q strings.Builder
		var args []any
		q.WriteString(`INSERT INTO ratelimit_global_counts (namespace, identifier, window_ms, sequence, region, count, expires_ms) VALUES `)
		for i := start; i < min(n, start+500); i++ {
			if i > start {
				q.WriteString(",")
			}
			q.WriteString("(?, ?, ?, ?, 'a', 3, ?)")
			args = append(args, []byte("z"), []byte(fmt.Sprintf("id-%05d", i)), window.Milliseconds(), seq0, exp)
		}
		if _, err := db.Exec(q.String(), args...); err != nil {
			t.Fatal(err)
		}
	}
	b.p.FlushOnce(bg) // a process's first pull reads the table whole
	if st := b.p.Stats(); st.CountsApplied != n || st.Imports != n {
		t.Fatalf("applied %d rows into %d cells, want %d: a page was skipped", st.CountsApplied, st.Imports, n)
	}
	if c := b.cell(t, fmt.Sprintf("id-%05d", n-1), seq0); c.Global != 3 {
		t.Fatalf("last row's cell = %+v", c)
	}
}

func TestPull_PressureTargetsTheBusiestCellsEveryFlush(t *testing.T) {
	s := newSetup(t)
	s.limit = 100
	a, b := s.region("a"), s.region("b")
	a.decide("hot", 100, 40)
	a.p.GlobalSyncOnce(bg)
	a.p.FlushOnce(bg) // published at 40 % on the full push
	b.decide("hot", 100, 55)
	// No periodic sync on B: its flush alone pulls the key it is pressed on.
	b.p.FlushOnce(bg)
	if c := b.cell(t, "hot", seq0); c.Global != 40 {
		t.Fatalf("B's global = %d after its flush, want A's 40 from the targeted pull", c.Global)
	}
	if st := b.p.Stats(); st.LastPull.IsZero() {
		t.Fatal("targeted pull not recorded")
	}
}

// TestImport_ForAWindowAheadIsAppliedWhenItBeginsHere: region a's clock
// runs a little ahead, into the next window, and publishes a count there.
// Region b pulls it before that window begins on b's clock. The engine
// holds no cell ahead of its clock and dropped the import, which the layer
// had already recorded: no later pull brought it back, and b never
// weighed a's units. The import waits until the window begins here.
func TestImport_ForAWindowAheadIsAppliedWhenItBeginsHere(t *testing.T) {
	s := newSetup(t)
	ahead := new(clock)
	ahead.ms.Store(s.clk.ms.Load() + window.Milliseconds()) // the next window
	a, b := s.regionOn(ahead, "a"), s.region("b")
	if n := a.decide("early", 100, 60); n != 60 {
		t.Fatalf("a admitted %d of 60", n)
	}
	a.p.FlushOnce(bg)
	b.decide("early", 100, 1) // b holds the key, in its current window
	b.p.FlushOnce(bg)
	if c := b.cell(t, "early", seq0); c.Global != 0 {
		t.Fatalf("b imported a's count of the next window into its current one: %+v", c)
	}
	s.clk.ms.Add(window.Milliseconds()) // the window begins at b
	b.p.FlushOnce(bg)
	if c := b.cell(t, "early", seq0+1); c.Global != 60 {
		t.Fatalf("b's cell of the window a counted in = %+v, want a's 60 as global", c)
	}
}

// TestPull_ADatabaseClockSteppedBackLosesNoChange: the database fails over
// to a server whose clock is ten minutes behind (here every session of
// regions b and c runs ten minutes behind, as SET timestamp through the
// DSN makes it). Rows changed after the step carry times before the
// newest change b had seen, and its pulls of changes missed them until
// the clock passed that time again: minutes with the others' counts
// arriving only at the whole reads (every tenth global sync). Now a
// global sync reads the database's clock, finds the cursor ahead of it,
// and the next pull reads the table whole and sets the cursor from rows
// no newer than the clock; the changes after that are pulled as ever.
func TestPull_ADatabaseClockSteppedBackLosesNoChange(t *testing.T) {
	s := newSetup(t)
	a := s.region("a")
	dsn := s.dsn
	s.dsn = fmt.Sprintf("%s?timestamp=%d", dsn, time.Now().Add(-10*time.Minute).Unix())
	b, c := s.region("b"), s.region("c")
	s.dsn = dsn
	a.decide("before", 100, 60)
	a.p.FlushOnce(bg) // stamped by the clock before the step
	b.p.FlushOnce(bg) // b's cursor: a's row
	s.clk.Add(changeMargin)
	b.p.FlushOnce(bg) // past the margin: b pulls after a's row
	if got := b.cell(t, "before", seq0); got.Global != 60 {
		t.Fatalf("b's cell of a's key = %+v, want a's 60", got)
	}
	c.decide("after", 100, 70)
	c.p.FlushOnce(bg) // stamped ten minutes before a's row
	b.p.GlobalSyncOnce(bg)
	b.p.FlushOnce(bg)
	if got := b.cell(t, "after", seq0); got.Global != 70 {
		t.Fatalf("a global sync and a flush after c's row, b's cell = %+v, want c's 70", got)
	}
	if st := b.p.Stats(); st.ClockSteps != 1 {
		t.Fatalf("clock steps seen: %d, want 1", st.ClockSteps)
	}
	c.decide("after", 100, 5) // a change after the whole read
	c.p.FlushOnce(bg)
	b.p.FlushOnce(bg)
	if got := b.cell(t, "after", seq0); got.Global != 75 {
		t.Fatalf("a flush after c's count rose, b's cell = %+v, want 75: the cursor stayed ahead of the clock", got)
	}
}

// TestImport_RowsOfAnotherIdentifierFormAreSkipped: a region under
// identifier_secret pulls rows of a region without it (a misconfigured
// rollout). Their raw identifiers name no key here, and a holder put them
// into its region's Redis as they were: now they are skipped, and the
// region's rows of its own form still count.
func TestImport_RowsOfAnotherIdentifierFormAreSkipped(t *testing.T) {
	s := newSetup(t)
	s.limit = 20
	hex32 := func(id string) bool { return len(id) == 32 && strings.Trim(id, "0123456789abcdef") == "" }
	a := s.region("a", func(c *Config) { c.OwnID = hex32 })
	b := s.region("b")
	own := strings.Repeat("ab", 16) // an identifier of a's form
	for _, id := range []string{"k", own} {
		a.decide(id, 20, 1)
		b.decide(id, 20, 12) // published at 60 %
	}
	b.p.FlushOnce(bg)
	b.p.GlobalSyncOnce(bg)
	a.p.GlobalSyncOnce(bg)
	a.p.FlushOnce(bg)
	if c := a.cell(t, "k", seq0); c.Global != 0 {
		t.Fatalf("a imported %d of b's raw identifier, want none", c.Global)
	}
	if c := a.cell(t, own, seq0); c.Global != 12 {
		t.Fatalf("a imported %d of b's row of its own form, want 12", c.Global)
	}
}

// TestImport_APreviousCellPastItsUseIsNotImportedAgain: a denial row
// carries its previous cell's count, which matters until the row's own
// window ends, a window before the row expires. Pruned then, that part
// was made anew by every whole read of the table in the row's last
// window, as news each time: the blocklist listing showed the row ten
// times, denials_applied counted it ten times, and a region with Redis
// queued an import for a window gone (an audit).
func TestImport_APreviousCellPastItsUseIsNotImportedAgain(t *testing.T) {
	s := newSetup(t)
	a, b := s.region("a"), s.region("b")
	a.decide("k", 10, 8)
	s.clk.Add(window)
	a.decide("k", 10, 10) // denied past 10: a denial row with count_prev 8
	a.p.FlushOnce(bg)
	b.p.FlushOnce(bg)
	if got := b.p.ForeignCounts(key("k"), seq0); got["a"] != 8 {
		t.Fatalf("B's previous cell = %v, want a: 8", got)
	}
	applied := b.p.Stats().DenialsApplied
	s.clk.Add(window) // the row's window is over; the row lives one more
	for range 3 {
		b.p.GlobalSyncOnce(bg) // prunes
		for range wholeEvery {
			b.p.BlocklistSyncOnce(bg)
		}
		b.p.FlushOnce(bg) // reads the denial rows whole
	}
	if got := b.p.Stats().DenialsApplied; got != applied {
		t.Fatalf("denials applied went from %d to %d over three whole reads of one row", applied, got)
	}
	if got := b.p.ForeignCounts(key("k"), seq0); len(got) != 0 {
		t.Fatalf("the previous cell, past its use, imported again: %v", got)
	}
}
