package ratelimit

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// TestOverrides_ALapsedRowReadWholeFromMySQLDoesNotApply: an override
// that lapsed stays in ratelimit_overrides until the cleanup deletes it;
// a whole read of the table (and the first load of a process) hands it
// on with the live ones, and the book must not apply it again, nor list
// it, nor keep it past its lapse.
func TestOverrides_ALapsedRowReadWholeFromMySQLDoesNotApply(t *testing.T) {
	srv := mysqltest.Start(t)
	dsn := srv.NewDatabase(t)
	eng := engine.New(engine.Config{Manual: true})
	eng.Zone("lapsed_mysql", time.Minute)
	var opts propagation.Options
	opts.Logger = zap.NewNop()
	mysqlOverrideHooks(&opts)
	p, err := propagation.New(propagation.Config{DSN: dsn, Region: "a", Batch: 100, Timeout: 5 * time.Second}, eng, opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := p.MigrateOnce(ctx); err != nil {
		t.Fatal(err)
	}
	eng.SetGlobal(p)
	t.Cleanup(func() {
		p.Stop(ctx)
		_ = eng.Close(ctx)
	})

	now := time.Now()
	live := overrideRec{Zone: "lapsed_mysql", Identifier: "live", Limit: 50, Region: "a",
		CreatedMs: now.UnixMilli(), Version: now.UnixMicro(), ExpiresMs: now.Add(time.Hour).UnixMilli()}
	lapsed := overrideRec{Zone: "lapsed_mysql", Identifier: "lapsed", Limit: 0, Region: "a",
		CreatedMs: now.Add(-time.Hour).UnixMilli(), Version: now.UnixMicro(), ExpiresMs: now.Add(-time.Second).UnixMilli()}
	p.PutOverride(live.row())
	p.PutOverride(lapsed.row())
	p.FlushOnce(ctx) // written, then read whole: the hook hands both to the book

	rows, err := p.LoadOverrides(ctx) // what a process that starts loads
	if err != nil || len(rows) != 2 {
		t.Fatalf("MySQL holds %d overrides (%v), want the live and the lapsed one: the cleanup has not run", len(rows), err)
	}
	if r, ok := overrides.get("lapsed_mysql", "lapsed"); ok {
		t.Fatalf("the lapsed override read from MySQL is back in the book: %+v", r)
	}
	if r, ok := overrides.get("lapsed_mysql", "live"); !ok || r.Limit != 50 {
		t.Fatalf("the live override did not arrive: %+v, %v", r, ok)
	}
	for _, r := range overrides.live("lapsed_mysql", "") {
		if r.Identifier == "lapsed" {
			t.Fatalf("the lapsed override is listed: %+v", r)
		}
	}
	if s := overrides.set.Load(); s != nil {
		if _, ok := s.zones["lapsed_mysql"]["lapsed"]; ok {
			t.Fatal("the lapsed override is in the request path's set")
		}
	}
}
