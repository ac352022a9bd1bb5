package ratelimit

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/origin"
	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// publishedPart is what a region's holder publishes of a cell (its
// CellTotals, with the version a region that marks resets says at least),
// as another region's holder imports it.
func publishedPart(t *testing.T, o *origin.Redis, region string, k engine.Key, seq int64) origin.ImportPart {
	t.Helper()
	ts, err := o.CellTotals(context.Background(), []origin.RoleCell{{Key: k, Sequence: seq}})
	if err != nil {
		t.Fatal(err)
	}
	return origin.ImportPart{Region: region, Count: ts[0].Count, ResetVersion: max(ts[0].ResetVersion, propagation.MarksResets), ResetBase: ts[0].ResetBase}
}

// TestReset_AGlobalResetHeardAfterARegionResetStillMarksTheRegion: region
// A resets a key globally; before the reset's row reaches region B
// (MySQL holds it back, or the next pull is a second away), an operator
// of B resets the key for B alone. The region reset is the newer record
// of the key's one name in B's hash, and B's holder took the global
// reset for one it held already: it never marked B's cells under the
// global reset's version. B then published no mark of that reset, and A,
// which counts nothing of a region that marks resets until its mark
// arrives, left out every unit B admitted for the rest of the window;
// B, its import of A taken off as of its own reset rather than A's,
// left out A's units since A's (each region counted 2 and 4, its own,
// where 6 were admitted since the reset).
//
// A region reset has a name of its own now (regionResetMark); one by a
// build before it still shares the global reset's name, and the holder
// marks the cells under the global reset's version all the same.
func TestReset_AGlobalResetHeardAfterARegionResetStillMarksTheRegion(t *testing.T) {
	t.Run("by this build", func(t *testing.T) {
		globalAfterRegionReset(t, func(admin int, _ *origin.Redis) {
			var doc resetDoc
			adminSend(t, admin, http.MethodDelete, "/ratelimit/counters?zone=ov&identifier=mixed&scope=region", "").decode(t, http.StatusOK, &doc)
		})
	})
	t.Run("by a build before its own name", func(t *testing.T) {
		globalAfterRegionReset(t, func(_ int, rb *origin.Redis) {
			ctx := context.Background()
			now := time.Now()
			k := engine.Key{Namespace: "ov", Identifier: "mixed", Window: time.Minute}
			if err := rb.ResetCells(ctx, k, now.UnixMilli()/time.Minute.Milliseconds(), 0); err != nil {
				t.Fatal(err)
			}
			rec := overrideRec{Zone: "ov", Identifier: "mixed", Reset: true, Region: "rs-b",
				CreatedMs: now.UnixMilli(), Version: now.UnixMicro(), ExpiresMs: now.Add(2 * time.Minute).UnixMilli()}
			v := rec.regionValue()
			v.Field = resetMark + "ov\x00mixed" // the global reset's name, as such a build wrote it
			if _, err := rb.PutOverrides(ctx, []origin.Override{v}, false); err != nil {
				t.Fatal(err)
			}
		})
	})
}

// globalAfterRegionReset is the scenario; regionReset makes B's reset of
// the region alone, through B's node's admin port or its Redis.
func globalAfterRegionReset(t *testing.T, regionReset func(admin int, rb *origin.Redis)) {
	resetOverrides(t)
	clearOfAMinuteEdge(t, 30*time.Second)
	// A's reset, made a second before B's, lies in the minute the test
	// counts in.
	redistest.Eventually(t, 5*time.Second, "two seconds into the minute", func() bool {
		return time.Now().UnixMilli()%time.Minute.Milliseconds() >= 2000
	})
	srvB := redistest.Start(t)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion rs-b\n\t\tredis %s\n\t}", srvB.URL())
	_, admin, _ := startCaddy(t, overrideConfig(global))
	st := lookupState()
	rb := st.overridesRedis()
	nodeB, _ := otherNode(t, srvB) // a node of B that counts the key
	srvA := redistest.Start(t)
	rA, err := origin.New(origin.Config{Redis: []string{srvA.URL()}}, origin.Options{NodeID: "a1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rA.Close() })
	ctx := context.Background()
	k := engine.Key{Namespace: "ov", Identifier: "mixed", Window: time.Minute}
	seq := time.Now().UnixMilli() / time.Minute.Milliseconds()
	flush := func(o *origin.Redis, own int64) {
		t.Helper()
		if err := o.Flush(ctx, []engine.Delta{{Key: k, Sequence: seq, Own: own, Incarnation: 1}}); err != nil {
			t.Fatal(err)
		}
	}
	// Before any reset: A counted 5, of which B imported the 3 A had
	// published; B counted 3.
	flush(rA, 5)
	flush(nodeB, 3)
	if err := rb.Import(ctx, []origin.RoleImport{{Key: k, Sequence: seq, Count: 3}}); err != nil {
		t.Fatal(err)
	}
	// A's global reset, a second ago, as resetKey makes it in A.
	made := time.Now().Add(-time.Second)
	recA := overrideRec{Zone: "ov", Identifier: "mixed", Reset: true, Global: true, Region: "rs-a",
		CreatedMs: made.UnixMilli(), Version: made.UnixMicro(), ExpiresMs: made.Add(2 * time.Minute).UnixMilli()}
	if err := rA.ResetCells(ctx, k, seq, recA.Version); err != nil {
		t.Fatal(err)
	}
	// B's operator resets the key for B alone, then B's holder reads A's
	// reset from MySQL.
	regionReset(admin, rb)
	if err := (redisRegion{o: rb, st: st}).ApplyOverrides(ctx, []propagation.OverrideRow{recA.row()}); err != nil {
		t.Fatal(err)
	}
	// After both: A admits 2, B 4. Each holder imports what the other
	// published.
	flush(rA, 7)
	flush(nodeB, 7)
	partA, partB := publishedPart(t, rA, "rs-a", k, seq), publishedPart(t, rb, "rs-b", k, seq)
	if err := rb.Import(ctx, []origin.RoleImport{{Key: k, Sequence: seq, Count: partA.Count, Parts: []origin.ImportPart{partA}}}); err != nil {
		t.Fatal(err)
	}
	if err := rA.Import(ctx, []origin.RoleImport{{Key: k, Sequence: seq, Count: partB.Count, Parts: []origin.ImportPart{partB}}}); err != nil {
		t.Fatal(err)
	}
	for _, r := range []struct {
		name string
		o    *origin.Redis
	}{{"A", rA}, {"B", rb}} {
		p, err := r.o.Peek(ctx, k, seq)
		if err != nil {
			t.Fatal(err)
		}
		if got := p.Cur + p.Global; got != 6 {
			t.Errorf("region %s counts %d of the key (%d its own, %d imported), want the 6 admitted since the global reset (2 in A, 4 in B)", r.name, got, p.Cur, p.Global)
		}
	}
}

// TestReset_ARegionResetRightAfterAGlobalOneLeavesItToTravel: an operator
// resets a key globally, then for the region (a second thought, or a
// script doing both) before the role's holder took the global reset for
// MySQL. The holder takes the key's name from its queue and reads what
// the region holds under it then: once the region reset, which stays in
// the region, so the global reset reached no other region, though its
// answer was 200 (no row in ratelimit_overrides, 15 s and five flushes
// later).
func TestReset_ARegionResetRightAfterAGlobalOneLeavesItToTravel(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	my := mysqltest.Start(t)
	db, admin, _ := regionOnMySQL(t, srv, my, "\t\tmysql_flush 3s\n\t\tglobal_sync 3s\n")
	redistest.Eventually(t, 20*time.Second, "the schema migrated", func() bool { return rowCount(t, db, "ratelimit_overrides") == 0 })
	var doc resetDoc
	adminSend(t, admin, http.MethodDelete, "/ratelimit/counters?zone=ov&identifier=both&scope=global", "").decode(t, http.StatusOK, &doc)
	adminSend(t, admin, http.MethodDelete, "/ratelimit/counters?zone=ov&identifier=both&scope=region", "").decode(t, http.StatusOK, &doc)
	redistest.Eventually(t, 15*time.Second, "the global reset's row in ratelimit_overrides", func() bool {
		var n int
		err := db.QueryRow("SELECT COUNT(*) FROM ratelimit_overrides WHERE namespace = ? AND identifier = ?", resetMark+"ov", "both").Scan(&n)
		return err == nil && n == 1
	})
}

// TestReset_RedisRestartedEmptyInAGlobalResetsLastMinuteKeepsItsRecord:
// a region marked another region's global reset (of a one-minute window:
// it lives two minutes), and its Redis restarts empty in the reset's last
// minute. The nodes wrote back every record they held but those lapsing
// within a minute: the reset was not written back. The role's next
// holder (the lease went with the restart) reads MySQL whole, finds a
// reset the region does not hold, and marks the cells again: the units
// counted since the reset in its window, which the previous cell weighs
// in the current one, were taken off (2 counted, 0 left).
func TestReset_RedisRestartedEmptyInAGlobalResetsLastMinuteKeepsItsRecord(t *testing.T) {
	resetOverrides(t)
	// The reset, made 65 s ago, lies in the previous minute.
	redistest.Eventually(t, 10*time.Second, "six seconds into the minute", func() bool {
		return time.Now().UnixMilli()%time.Minute.Milliseconds() >= 6000
	})
	srv := redistest.Start(t)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion rs-b\n\t\tredis %s\n\t\tfast_tick 10ms\n\t\tslow_tick 50ms\n\t}", srv.URL())
	_, admin, _ := startCaddy(t, overrideConfig(global))
	st := lookupState()
	rb := st.overridesRedis()
	ctx := context.Background()
	made := time.Now().Add(-65 * time.Second)
	k := engine.Key{Namespace: "ov", Identifier: "lastminute", Window: time.Minute}
	seq := made.UnixMilli() / time.Minute.Milliseconds()
	rec := overrideRec{Zone: "ov", Identifier: "lastminute", Reset: true, Global: true, Region: "rs-a",
		CreatedMs: made.UnixMilli(), Version: made.UnixMicro(), ExpiresMs: made.Add(2 * time.Minute).UnixMilli()}
	row := rec.row()
	if err := (redisRegion{o: rb, st: st}).ApplyOverrides(ctx, []propagation.OverrideRow{row}); err != nil {
		t.Fatal(err)
	}
	// An override that lives on shows when the node wrote its book back.
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=kept", `{"limit": 6}`).decode(t, http.StatusOK, new(overrideDoc))
	redistest.Eventually(t, 5*time.Second, "the node heard of the reset", func() bool {
		overrides.mu.Lock()
		defer overrides.mu.Unlock()
		_, ok := overrides.recs[overrideKey{rec.bookZone(), rec.Identifier}]
		return ok
	})
	srv.Restart()
	other, _ := otherNode(t, srv)
	redistest.EventuallyShow(t, 5*time.Second, "the node wrote its book back", func() (bool, string) {
		got := regionRecs(t, other)
		return got["kept"].Limit == 6, fmt.Sprintf("%+v", got)
	})
	// A node admitted 2 of the key after the reset, in its window, and
	// sends them again to the restarted Redis.
	if err := other.Flush(ctx, []engine.Delta{{Key: k, Sequence: seq, Own: 2, Incarnation: 1}}); err != nil {
		t.Fatal(err)
	}
	// The role's new holder reads MySQL whole.
	if err := (redisRegion{o: rb, st: st}).ApplyOverrides(ctx, []propagation.OverrideRow{row}); err != nil {
		t.Fatal(err)
	}
	if p, err := rb.Peek(ctx, k, seq); err != nil || p.Cur != 2 {
		t.Fatalf("the reset's window counts %+v (%v), want the 2 units admitted after the reset", p, err)
	}
}

// TestReset_AGlobalResetWhileMySQLIsDownTravelsWhenItIsBack: a global
// reset made while MySQL is stopped, or frozen, is taken by the region
// (200, at once: the admin call makes no MySQL statement) and reaches
// ratelimit_overrides once MySQL answers again.
func TestReset_AGlobalResetWhileMySQLIsDownTravelsWhenItIsBack(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	my := mysqltest.Start(t)
	db, admin, _ := regionOnMySQL(t, srv, my, "\t\tmysql_flush 50ms\n\t\tglobal_sync 200ms\n\t\tmysql_timeout 200ms\n")
	redistest.Eventually(t, 20*time.Second, "the schema migrated", func() bool { return rowCount(t, db, "ratelimit_overrides") == 0 })
	row := func(id string) bool {
		var n int
		err := db.QueryRow("SELECT COUNT(*) FROM ratelimit_overrides WHERE namespace = ? AND identifier = ?", resetMark+"ov", id).Scan(&n)
		return err == nil && n == 1
	}
	for _, c := range []struct {
		name       string
		down, back func()
	}{
		{"stopped", my.Stop, func() {
			if err := my.Restart(); err != nil {
				t.Fatal(err)
			}
		}},
		{"frozen", my.Pause, my.Resume},
	} {
		c.down()
		start := time.Now()
		var doc resetDoc
		adminSend(t, admin, http.MethodDelete, "/ratelimit/counters?zone=ov&identifier="+c.name+"&scope=global", "").decode(t, http.StatusOK, &doc)
		if took := time.Since(start); took > time.Second {
			t.Errorf("MySQL %s: the reset took %s", c.name, took)
		}
		c.back()
		redistest.Eventually(t, 30*time.Second, "the reset's row once MySQL "+c.name+" answers again", func() bool { return row(c.name) })
	}
}

// TestOverrides_AChangeOfANodeWithoutRedisOutlivesAReloadWhileMySQLHangs:
// a node without Redis keeps its runtime override changes in memory until
// it writes them to MySQL. A change made while MySQL hung (200 at once)
// and a reload before MySQL answered again: the old config's layer tried
// once as it stopped, failed, and dropped the change, which never reached
// MySQL (an audit: 40 s after MySQL was back no row, and the other regions
// never had it; the node itself kept enforcing it). The next config's
// layer takes the changes the old one could not write.
func TestOverrides_AChangeOfANodeWithoutRedisOutlivesAReloadWhileMySQLHangs(t *testing.T) {
	resetOverrides(t)
	my := mysqltest.Start(t)
	dsn := my.NewDatabase(t)
	t.Setenv("RATELIMIT_TEST_MYSQL_DSN", dsn)
	global := "\tratelimit {\n\t\tregion test-a\n\t\tmysql {env.RATELIMIT_TEST_MYSQL_DSN}\n\t\tmysql_flush 50ms\n\t\tglobal_sync 200ms\n\t\tmysql_timeout 200ms\n\t}"
	_, admin, _ := startCaddy(t, overrideConfig(global))
	db := mysqltest.Open(t, dsn)
	redistest.Eventually(t, 20*time.Second, "the schema migrated", func() bool { return rowCount(t, db, "ratelimit_overrides") == 0 })
	my.Pause()
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=kept", `{"limit": 1}`).decode(t, http.StatusOK, &overrideDoc{})
	if err := loadCaddyfile(t, admin, overrideConfig(global)); err != nil {
		t.Fatal(err)
	}
	my.Resume()
	redistest.Eventually(t, 30*time.Second, "the change's row once MySQL answers again", func() bool {
		var n int
		err := db.QueryRow("SELECT COUNT(*) FROM ratelimit_overrides WHERE namespace = ? AND identifier = ? AND limit_units = 1", "ov", "kept").Scan(&n)
		return err == nil && n == 1
	})
}

// regionOnMySQL starts a Caddy of region test-a on srv and a new database
// of my, timing the lines its ratelimit block adds, and returns the
// database, the admin address and the site's.
func regionOnMySQL(t *testing.T, srv *redistest.Server, my *mysqltest.Server, timing string) (*sql.DB, int, string) {
	t.Helper()
	dsn := my.NewDatabase(t)
	t.Setenv("RATELIMIT_TEST_MYSQL_DSN", dsn)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion test-a\n\t\tredis %s\n\t\tmysql {env.RATELIMIT_TEST_MYSQL_DSN}\n%s\t}", srv.URL(), timing)
	_, admin, base := startCaddy(t, overrideConfig(global))
	return mysqltest.Open(t, dsn), admin, base
}

// TestOverrides_ARemovalOfNoneSaysAnotherRegionsChangeMayBeOnItsWay: an
// override set in one region and removed at once through another got a
// bare 404, "no runtime override", and then arrived and applied there
// (an audit). With a cross-region layer the 404 says that one set
// elsewhere travels through MySQL; without one it says what it did.
func TestOverrides_ARemovalOfNoneSaysAnotherRegionsChangeMayBeOnItsWay(t *testing.T) {
	resetOverrides(t)
	my := mysqltest.Start(t)
	t.Setenv("RATELIMIT_TEST_MYSQL_DSN", my.NewDatabase(t))
	global := "\tratelimit {\n\t\tregion test-a\n\t\tmysql {env.RATELIMIT_TEST_MYSQL_DSN}\n\t}"
	_, admin, _ := startCaddy(t, overrideConfig(global))
	adminSend(t, admin, http.MethodDelete, "/ratelimit/overrides?zone=ov&identifier=none", "").
		wantSays(t, http.StatusNotFound, "reaches it through MySQL")
	if err := loadCaddyfile(t, admin, overrideConfig("")); err != nil {
		t.Fatal(err)
	}
	r := adminSend(t, admin, http.MethodDelete, "/ratelimit/overrides?zone=ov&identifier=none", "")
	r.wantSays(t, http.StatusNotFound, "no runtime override")
	if bytes.Contains(r.body, []byte("MySQL")) {
		t.Fatalf("without a cross-region layer the 404 names MySQL: %s", r.body)
	}
}

// TestOverrides_AChangeWaitingForMySQLIsCounted: a global change made
// while MySQL does not answer is answered 200 at once (it applies in the
// region, and travels when MySQL answers), and nothing showed that it had
// not reached MySQL: the holder held it with no count, its status and
// metrics as after a change written. The holder now counts it
// (propagation_pending_overrides, the status's pending_overrides) until it
// is written.
func TestOverrides_AChangeWaitingForMySQLIsCounted(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	my := mysqltest.Start(t)
	db, admin, _ := regionOnMySQL(t, srv, my, "\t\tmysql_flush 50ms\n\t\tglobal_sync 200ms\n\t\tmysql_timeout 200ms\n")
	redistest.Eventually(t, 20*time.Second, "the schema migrated and the role held", func() bool {
		return rowCount(t, db, "ratelimit_overrides") == 0 && metricValue(t, admin, "caddy_ratelimit_propagation_role_held") == 1
	})
	pending := func() float64 { return metricValue(t, admin, "caddy_ratelimit_propagation_pending_overrides") }
	if n := pending(); n != 0 {
		t.Fatalf("%v changes pending before any was made", n)
	}
	my.Pause()
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=waits", `{"limit": 3}`).decode(t, http.StatusOK, &overrideDoc{})
	redistest.Eventually(t, 10*time.Second, "the change counted as waiting for MySQL", func() bool { return pending() == 1 })
	var doc struct {
		Propagation struct {
			PendingOverrides int `json:"pending_overrides"`
		} `json:"propagation"`
	}
	adminDo(t, admin, http.MethodGet, "/ratelimit/status").decode(t, http.StatusOK, &doc)
	if doc.Propagation.PendingOverrides != 1 {
		t.Fatalf("status pending_overrides %d with MySQL paused, want 1", doc.Propagation.PendingOverrides)
	}
	my.Resume()
	redistest.Eventually(t, 30*time.Second, "the change's row and no change pending once MySQL answers", func() bool {
		var n int
		err := db.QueryRow("SELECT COUNT(*) FROM ratelimit_overrides WHERE namespace = ? AND identifier = ? AND limit_units = 3", "ov", "waits").Scan(&n)
		return err == nil && n == 1 && pending() == 0
	})
}
