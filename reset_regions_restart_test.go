package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// TestReset_RedisRestartedEmptyAfterAGlobalResetPublishesItsUnits:
// a region resets a key globally (its row: count 3, base 3), admits 1,
// then its Redis restarts empty; the nodes send their cells again less
// what the reset took off (1), and the region admits 1 more. Its
// published row must say 2 since the reset (count − base). The row only
// grows (GREATEST), and the holder published the region's count alone:
// it stayed at 4 − 3 = 1 until the region's count passed 4, and the
// other regions missed up to the base of what it admitted since
// (propagation.ownMark).
func TestReset_RedisRestartedEmptyAfterAGlobalResetPublishesItsUnits(t *testing.T) {
	resetOverrides(t)
	clearOfAMinuteEdge(t, 40*time.Second)
	srv := redistest.Start(t)
	my := mysqltest.Start(t)
	db, admin, base := regionOnMySQL(t, srv, my, "\t\tmysql_flush 50ms\n\t\tglobal_sync 200ms\n\t\tfast_tick 10ms\n\t\tslow_tick 50ms\n\t\tpublish_floor 0.01\n")
	since := func() (int64, string) {
		var c, v, b int64
		err := db.QueryRow("SELECT count, reset_version, reset_base FROM ratelimit_global_counts WHERE identifier = ?", "file-key").Scan(&c, &v, &b)
		return c - b, fmt.Sprintf("count %d version %d base %d (%v)", c, v, b, err)
	}
	if n := admitted(t, base, "file-key", 3); n != 3 {
		t.Fatalf("admitted %d of 3", n)
	}
	redistest.EventuallyShow(t, 10*time.Second, "the row counts 3", func() (bool, string) {
		_, s := since()
		var c int64
		_ = db.QueryRow("SELECT count FROM ratelimit_global_counts WHERE identifier = ?", "file-key").Scan(&c)
		return c == 3, s
	})
	var doc resetDoc
	adminSend(t, admin, http.MethodDelete, "/ratelimit/counters?zone=ov&identifier=file-key&scope=global", "").decode(t, http.StatusOK, &doc)
	admitted(t, base, "file-key", 1)
	redistest.EventuallyShow(t, 10*time.Second, "the row says 1 since the reset", func() (bool, string) {
		n, s := since()
		return n == 1, s
	})
	srv.Restart()
	redistest.EventuallyShow(t, 10*time.Second, "the node sent its cells again", func() (bool, string) {
		return lookupState().engine.Stats().PendingCells == 0 && lookupState().engine.Stats().Resends > 0, ""
	})
	redistest.EventuallyShow(t, 10*time.Second, "one more admitted after the restart", func() (bool, string) {
		return admitted(t, base, "file-key", 1) == 1, ""
	})
	redistest.EventuallyShow(t, 10*time.Second, "the row says the 2 admitted since the reset", func() (bool, string) {
		n, s := since()
		return n == 2, s
	})
}

// TestReset_AResetTheRegionHeardIsNotMarkedAgainAfterARestart: a global
// reset, made in another region, that this region heard of (its cells
// marked, its record in the region's hash and in the node's book; the
// flake's was made in this region, which TestReset_AResetTheRegionMade…
// covers on its own since), one unit admitted after it, then the
// region's Redis restarts empty and the node sends its cells again less
// what the reset took off (1). The holder's pull brings the reset's row
// back from MySQL after the restart, before the overrides watch has
// written the record back: the region no longer holds it. It was taken
// for a reset the region had not heard of and marked again, which took
// the unit admitted since the reset off a second time (the region counted
// 0, and could admit it again), and left the region's count under the
// reset with no base, so the holder's published row stopped growing (the
// flake of TestReset_RedisRestartedEmptyAfterAGlobalResetPublishesItsUnits,
// one run in a few dozen under load). A real restart loses the region's
// mark too, and the watch, woken as its subscription comes back, writes
// the record back within milliseconds, before the test could call the
// holder's side: the restart is made here by deleting what it loses of
// the key (the cells, the record), so that the holder's side meets what
// the flake's did.
func TestReset_AResetTheRegionHeardIsNotMarkedAgainAfterARestart(t *testing.T) {
	heardAgainAfterARestart(t, "rs-heard", "rs-elsewhere", false)
}

// TestReset_AResetTheRegionMadeIsNotMarkedAgainByAHolderStartedSince: the
// same for a reset made in this region, but the holder's process started
// after it, and its book
// loaded from the region's Redis once that had lost the record: the
// process never heard of it from the region, and took it for news. The
// reset's record names the region that made it, this one, which marked its
// cells when it made it, so the nodes' cells sent again are less what it
// took off (as they are in a region that heard it from MySQL: those
// cannot be told from a region that never marked, and are marked again).
func TestReset_AResetTheRegionMadeIsNotMarkedAgainByAHolderStartedSince(t *testing.T) {
	heardAgainAfterARestart(t, "rs-fresh", "rs-fresh", true)
}

// heardAgainAfterARestart marks and records in region a global reset
// that region madeIn made, admits a unit after it, loses the key in the
// region's Redis as a restart would, and has the holder hear the reset
// from MySQL again: with fresh, by a process whose book never held it.
func heardAgainAfterARestart(t *testing.T, region, madeIn string, fresh bool) {
	st, rb, srv := regionOnRedis(t, region)
	redistest.EventuallyShow(t, 10*time.Second, "the book loaded from the region", func() (bool, string) {
		return overrides.source() == rb.Placement(), overrides.source()
	})
	clearOfAMinuteEdge(t, 40*time.Second)
	ctx := context.Background()
	k := engine.Key{Namespace: "ov", Identifier: "heard", Window: time.Minute}
	now := time.Now()
	seq := now.UnixMilli() / time.Minute.Milliseconds()
	flush := func(inc uint32, own int64) {
		t.Helper()
		if err := rb.Flush(ctx, []engine.Delta{{Key: k, Sequence: seq, Own: own, Incarnation: inc}}); err != nil {
			t.Fatal(err)
		}
	}
	cur := func() int64 {
		t.Helper()
		p, err := rb.Peek(ctx, k, seq)
		if err != nil {
			t.Fatal(err)
		}
		return p.Cur
	}
	flush(1, 3)
	rec := overrideRec{Zone: "ov", Identifier: "heard", Reset: true, Global: true, Region: madeIn,
		CreatedMs: now.UnixMilli(), Version: now.UnixMicro(), ExpiresMs: now.Add(2 * time.Minute).UnixMilli()}
	if took, err := storeReset(ctx, st, rb, &rec); err != nil || took != 1 {
		t.Fatalf("the reset: %d took (%v)", took, err)
	}
	overrides.merge([]overrideRec{rec}) // as the admin API's reset records it
	flush(2, 1)                         // admitted after the reset
	if n := cur(); n != 1 {
		t.Fatalf("the region counts %d after the reset and one unit, want 1", n)
	}
	loseKey(t, srv, "heard", rec.field())
	flush(2, 1) // the node's cells sent again, less what the reset took off
	if _, held, err := rb.HeldOverride(ctx, rec.field()); err != nil || held {
		t.Fatalf("the region holds the reset's record after losing it (%v)", err)
	}
	if fresh {
		overrides.mu.Lock()
		delete(overrides.recs, overrideKey{rec.bookZone(), rec.Identifier})
		overrides.mu.Unlock()
	}
	if err := (redisRegion{o: rb, st: st, region: region}).ApplyOverrides(ctx, []propagation.OverrideRow{rec.row()}); err != nil {
		t.Fatal(err)
	}
	if n := cur(); n != 1 {
		t.Errorf("the region counts %d after the holder heard the reset again, want the 1 unit admitted since it", n)
	}
	if _, ok, err := rb.HeldOverride(ctx, rec.field()); err != nil || !ok {
		t.Errorf("the region holds no record of the reset after the holder heard it again (%v)", err)
	}
}

// loseKey deletes from the region's Redis what a restart loses of the
// identifier id: every key naming it, and its field in the overrides hash.
func loseKey(t *testing.T, srv *redistest.Server, id, field string) {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer c.Close()
	ctx := context.Background()
	keys, err := c.Keys(ctx, "*"+id+"*").Result()
	if err != nil || len(keys) == 0 {
		t.Fatalf("no key of %q in the region (%v)", id, err)
	}
	hashes, err := c.Keys(ctx, "*:{overrides}").Result()
	if err != nil || len(hashes) != 1 {
		t.Fatalf("overrides hashes %v (%v), want one", hashes, err)
	}
	if err := c.Del(ctx, keys...).Err(); err != nil {
		t.Fatal(err)
	}
	if n, err := c.HDel(ctx, hashes[0], field).Result(); err != nil || n != 1 {
		t.Fatalf("the reset's record: %d deleted (%v)", n, err)
	}
}

// TestReset_AGlobalResetAfterTheRegionRestartedEmptyTakesItsOldUnitsOff:
// a region publishes 3 units of a key (its row: count 3), then restarts
// whole, its nodes and its Redis, empty: it counts 0 of the key, its row
// still says 3. An operator then resets the key globally. The region
// marked the reset at its count then, and its row only grows
// (GREATEST): the row said 3 since the reset, and every other region went
// on counting the 3 units the reset took off (then the larger of them and
// what the region admitted since) for the rest of the window, denying a
// key the operator had just cleared. The row must say what the region
// admitted since the reset: 0, then the 1 admitted after it. With no unit
// between the restart and the reset the region's Redis holds no cell to
// mark, and nothing was published under the reset at all; with one, the
// cell is marked at 1, below the row's 3.
func TestReset_AGlobalResetAfterTheRegionRestartedEmptyTakesItsOldUnitsOff(t *testing.T) {
	for _, between := range []int{0, 1} {
		t.Run(fmt.Sprintf("%d admitted between", between), func(t *testing.T) {
			resetAfterARestartedRegion(t, between)
		})
	}
}

func resetAfterARestartedRegion(t *testing.T, between int) {
	resetOverrides(t)
	clearOfAMinuteEdge(t, 40*time.Second)
	srv := redistest.Start(t)
	my := mysqltest.Start(t)
	timing := "\t\tmysql_flush 50ms\n\t\tglobal_sync 200ms\n\t\tfast_tick 10ms\n\t\tslow_tick 50ms\n\t\tpublish_floor 0.01\n"
	db, admin, base := regionOnMySQL(t, srv, my, timing)
	var ver int64
	row := func() (since int64, s string) {
		var c, b int64
		err := db.QueryRow("SELECT count, reset_version, reset_base FROM ratelimit_global_counts WHERE identifier = ?", "file-key").Scan(&c, &ver, &b)
		return c - b, fmt.Sprintf("count %d version %d base %d (%v)", c, ver, b, err)
	}
	if n := admitted(t, base, "file-key", 3); n != 3 {
		t.Fatalf("admitted %d of 3", n)
	}
	redistest.EventuallyShow(t, 10*time.Second, "the row counts 3", func() (bool, string) {
		n, s := row()
		return n == 3, s
	})
	before := ver
	// The region restarts whole: a config without the rate limiter lets
	// the node's engine and holder go, the Redis restarts empty, and the
	// config comes back.
	port := redistest.MustFreePort(t)
	if err := loadCaddyfileOn(t, admin, port, func(admin, port int) string {
		return caddyConfig(admin, port, "", "\thandle {\n\t\trespond \"ok\"\n\t}")
	}); err != nil {
		t.Fatal(err)
	}
	srv.Restart()
	global := fmt.Sprintf("\tratelimit {\n\t\tregion test-a\n\t\tredis %s\n\t\tmysql {env.RATELIMIT_TEST_MYSQL_DSN}\n%s\t}", srv.URL(), timing)
	if err := loadCaddyfileOn(t, admin, port, overrideConfig(global)); err != nil {
		t.Fatal(err)
	}
	base = fmt.Sprintf("http://127.0.0.1:%d", port)
	if n := admitted(t, base, "file-key", between); n != between {
		t.Fatalf("admitted %d of %d after the restart", n, between)
	}
	if between > 0 {
		redistest.EventuallyShow(t, 10*time.Second, "the node sent its unit", func() (bool, string) {
			return lookupState().engine.Stats().PendingCells == 0, ""
		})
	}
	var doc resetDoc
	adminSend(t, admin, http.MethodDelete, "/ratelimit/counters?zone=ov&identifier=file-key&scope=global", "").decode(t, http.StatusOK, &doc)
	redistest.EventuallyShow(t, 10*time.Second, "the row says 0 since the reset", func() (bool, string) {
		n, s := row()
		return n == 0 && ver > before, s
	})
	if n := admitted(t, base, "file-key", 1); n != 1 {
		t.Fatalf("admitted %d of 1 after the reset", n)
	}
	redistest.EventuallyShow(t, 10*time.Second, "the row says the 1 admitted since the reset", func() (bool, string) {
		n, s := row()
		return n == 1, s
	})
}
