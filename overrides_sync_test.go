package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// TestOverrides_RegionScopeReachesTheOtherNodesThroughRedis: with Redis,
// a PUT is stored in the region (scope region); a change another node
// left in the region reaches this one within a few fast ticks, and a
// process that starts applies the region's overrides from its first
// decision.
func TestOverrides_RegionScopeReachesTheOtherNodesThroughRedis(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion ov-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t}", srv.URL())
	// Another node's change, in the region before this process starts.
	other, put := otherNode(t, srv)
	put("early", 0)
	_, admin, base := startCaddy(t, overrideConfig(global))
	if n := admitted(t, base, "early", 1); n != 0 {
		t.Fatalf("the region's limit-0 override set before start admitted %d on the first request", n)
	}
	var doc overrideDoc
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=mine", `{"limit": 7}`).decode(t, http.StatusOK, &doc)
	if doc.Scope != scopeRegion {
		t.Fatalf("scope %q, want region", doc.Scope)
	}
	_, all, err := other.Overrides(context.Background())
	if err != nil || len(all) != 2 {
		t.Fatalf("the region holds %+v (%v), want early and mine", all, err)
	}
	put("late", 0)
	start := time.Now()
	redistest.Eventually(t, 5*time.Second, "another node's change applied here", func() bool { return admitted(t, base, "late", 1) == 0 })
	t.Logf("another node's change applied here within %s", time.Since(start))
}

// TestOverrides_AChangeArrivesOnItsNoticeAndAnIdleNodeRarelyAsks: a node
// subscribed to the region's notices reads the change counter once a slow
// tick rather than each fast tick (before: a GET each 10 ms, a hundred a
// second per node whatever the traffic), and a change another node makes
// reaches it on its notice, well before that slow tick; once Redis drops
// the subscription, the node subscribes again and hears the next change.
func TestOverrides_AChangeArrivesOnItsNoticeAndAnIdleNodeRarelyAsks(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion ov-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t\tslow_tick 1m\n\t}", srv.URL())
	_, putLimit := otherNode(t, srv)
	put := func(id string) { t.Helper(); putLimit(id, 0) }
	_, adminPort, base := startCaddy(t, overrideConfig(global))
	admin := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	t.Cleanup(func() { _ = admin.Close() })
	ctx := context.Background()
	subscribed := func() bool {
		chans, err := admin.PubSubChannels(ctx, "*overrides*").Result()
		return err == nil && len(chans) > 0
	}
	gets := func() int64 {
		t.Helper()
		info, err := admin.Info(ctx, "commandstats").Result()
		if err != nil {
			t.Fatal(err)
		}
		for line := range strings.Lines(info) {
			if rest, ok := strings.CutPrefix(line, "cmdstat_get:calls="); ok {
				n, _ := strconv.ParseInt(rest[:strings.IndexByte(rest, ',')], 10, 64)
				return n
			}
		}
		return 0
	}
	redistest.Eventually(t, 5*time.Second, "the node subscribed to the notices", subscribed)
	var status struct {
		Origin struct {
			OverrideNotices bool `json:"override_notices"`
		} `json:"origin"`
	}
	redistest.Eventually(t, 5*time.Second, "the status says subscribed", func() bool {
		adminSend(t, adminPort, http.MethodGet, "/ratelimit/status", "").decode(t, http.StatusOK, &status)
		return status.Origin.OverrideNotices
	})
	// A rate over a second of idling, not a synchronisation: a node that
	// polled each fast tick would send about 100 GETs here.
	before := gets()
	time.Sleep(time.Second)
	if n := gets() - before; n > 20 {
		t.Fatalf("an idle subscribed node sent %d GETs in a second, want its slow tick's few", n)
	}

	put("noticed")
	start := time.Now()
	redistest.Eventually(t, 5*time.Second, "another node's change applied on its notice", func() bool { return admitted(t, base, "noticed", 1) == 0 })
	t.Logf("another node's change applied here within %s (slow tick 1m)", time.Since(start))

	if err := admin.Do(ctx, "CLIENT", "KILL", "TYPE", "pubsub").Err(); err != nil {
		t.Fatal(err)
	}
	redistest.Eventually(t, 5*time.Second, "the node subscribed again", subscribed)
	put("after")
	redistest.Eventually(t, 5*time.Second, "a change after the subscription came back", func() bool { return admitted(t, base, "after", 1) == 0 })
}

// otherNode is another node of region ov-test on srv, and a function that
// stores, as that node, an override of zone ov's identifier id.
func otherNode(t *testing.T, srv *redistest.Server) (*origin.Redis, func(id string, limit int64)) {
	other, err := origin.New(origin.Config{Redis: []string{srv.URL()}}, origin.Options{NodeID: "other"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Close() })
	return other, func(id string, limit int64) {
		t.Helper()
		rec := overrideRec{Zone: "ov", Identifier: id, Limit: limit, Region: "ov-test", CreatedMs: time.Now().UnixMilli(), Version: time.Now().UnixMicro()}
		if _, err := other.PutOverrides(context.Background(), []origin.Override{rec.regionValue()}, false); err != nil {
			t.Fatal(err)
		}
	}
}
