package ratelimit

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
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
