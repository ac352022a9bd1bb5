package ratelimit

import (
	"context"
	"fmt"
	"maps"
	"math"
	"net"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

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
// putAhead stores rec in the region as a node whose clock runs a minute
// ahead made it, and returns it as stored.
func putAhead(t *testing.T, other *origin.Redis, rec overrideRec) overrideRec {
	t.Helper()
	ahead := time.Now().Add(time.Minute)
	rec.CreatedMs, rec.Version = ahead.UnixMilli(), ahead.UnixMicro()
	if rec.Reset {
		rec.ExpiresMs = ahead.Add(2 * time.Minute).UnixMilli()
	}
	if _, err := other.PutOverrides(context.Background(), []origin.Override{rec.regionValue()}, false); err != nil {
		t.Fatal(err)
	}
	return rec
}

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

// TestOverrides_RedisRestartedEmptyGetsTheRegionsOverridesBack is the
// audit's case: the region's Redis restarted empty, and a node started
// after it loaded no overrides and applied the Caddyfile's limits while
// the nodes that ran before applied the overrides from their books. The
// node that ran before writes back what it holds, removals included,
// with their versions: a node that missed a removal, writing back the
// override it removed before or after it, brings nothing back.
func TestOverrides_RedisRestartedEmptyGetsTheRegionsOverridesBack(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion ov-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t\tslow_tick 50ms\n\t}", srv.URL())
	_, admin, base := startCaddy(t, overrideConfig(global))
	set := func(id, body string) {
		t.Helper()
		adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier="+id, body).decode(t, http.StatusOK, new(overrideDoc))
	}
	set("kept", `{"limit": 6, "reason": "plan upgrade"}`)
	set("gone", `{"limit": 6}`)
	before, _ := overrides.get("ov", "gone") // what a node that misses the removal holds
	adminSend(t, admin, http.MethodDelete, "/ratelimit/overrides?zone=ov&identifier=gone", "").decode(t, http.StatusOK, new(overrideDoc))
	kept, _ := overrides.get("ov", "kept")
	gone, _ := overrides.get("ov", "gone")
	if kept.Limit != 6 || !gone.Deleted || gone.Version <= before.Version {
		t.Fatalf("the book holds %+v and %+v", kept, gone)
	}
	stale, _ := otherNode(t, srv)
	staleWrite := func() int {
		t.Helper()
		n, err := stale.PutOverrides(context.Background(), []origin.Override{before.regionValue()}, false)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}

	srv.Restart()
	start := time.Now()
	staleWrite()                  // most likely before this node's write-back; either order must end the same
	fresh, _ := otherNode(t, srv) // a node started after the restart
	redistest.EventuallyShow(t, 5*time.Second, "the region holds the newest of each override again", func() (bool, string) {
		got := regionRecs(t, fresh)
		return got["kept"] == kept && got["gone"] == gone && len(got) == 2, fmt.Sprintf("%+v", got)
	})
	t.Logf("the overrides were back in the region within %s of Redis answering again", time.Since(start))
	if n := staleWrite(); n != 0 {
		t.Fatalf("the removed override, written back by a node that missed the removal, took %d, want 0", n)
	}

	// A process that starts now loads them before its first decision.
	overrides.mu.Lock()
	overrides.recs = map[overrideKey]overrideRec{}
	overrides.set.Store(nil)
	overrides.mu.Unlock()
	var recs []overrideRec
	for _, r := range regionRecs(t, fresh) {
		recs = append(recs, r)
	}
	overrides.merge(recs)
	if n := admitted(t, base, "kept", 7); n != 6 {
		t.Fatalf("a node started after the restart admitted %d of 7 with override 6", n)
	}
	if n := admitted(t, base, "gone", 3); n != 2 {
		t.Fatalf("a node started after the restart admitted %d of 3 of the removed override's key, want the zone's 2", n)
	}
}

// regionRecs reads the region's overrides through o, by identifier.
func regionRecs(t *testing.T, o *origin.Redis) map[string]overrideRec {
	t.Helper()
	_, all, err := o.Overrides(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]overrideRec{}
	for _, ov := range all {
		if r, ok := recOfRegion(ov); ok {
			out[r.Identifier] = r
		}
	}
	return out
}

// watchedRegion is a node's watch of a region's overrides on a Redis of
// its own, called one look at a time, with its book loaded: an override
// kept, a removal whose override a stale node still holds, an override
// changed since a stale node read it, a reset of the region, and an
// override that lapses within writeBackMargin. It returns the watch, the
// records the book and the region hold, and the stale node's older copies.
func watchedRegion(t *testing.T) (*redistest.Server, *regionWatch, map[string]overrideRec, []overrideRec) {
	t.Helper()
	resetOverrides(t)
	srv := redistest.Start(t)
	node, _ := otherNode(t, srv)
	now := time.Now()
	ver := now.UnixMicro()
	rec := func(id string, v, limit int64) overrideRec {
		return overrideRec{Zone: "ov", Identifier: id, Limit: limit, Region: "ov-test", CreatedMs: v / 1000, Version: v}
	}
	gone, changed, reset, lapsing := rec("gone", ver-30, 0), rec("changed", ver-50, 4), rec("cust", ver-70, 0), rec("lapsing", ver-60, 8)
	gone.Deleted, gone.ExpiresMs = true, now.Add(tombstoneLife).UnixMilli()
	reset.Reset, reset.ExpiresMs = true, now.Add(time.Hour).UnixMilli()
	lapsing.ExpiresMs = now.Add(writeBackMargin / 2).UnixMilli()
	held := []overrideRec{rec("kept", ver-10, 6), gone, changed, reset, lapsing}
	stale := []overrideRec{rec("gone", ver-31, 6), rec("changed", ver-51, 9)}
	ovs := make([]origin.Override, len(held))
	for i, r := range held {
		ovs[i] = r.regionValue()
	}
	if _, err := node.PutOverrides(context.Background(), ovs, false); err != nil {
		t.Fatal(err)
	}
	w := &regionWatch{o: node, log: zap.NewNop(), readTimeout: time.Second, global: func() bool { return false }}
	if err := w.start(now); err != nil {
		t.Fatal(err)
	}
	w.look(now)
	if w.mark == "" {
		t.Fatal("the first look left the region without a mark")
	}
	want := map[string]overrideRec{}
	for _, r := range held[:4] {
		if got, _ := overrides.get(r.bookZone(), r.Identifier); got != r {
			t.Fatalf("the book holds %+v, want %+v", got, r)
		}
		want[r.Identifier] = r
	}
	return srv, w, want, stale
}

// TestOverrides_WriteBackKeepsTheNewestOfEachField: after Redis restarted
// empty, a node that missed a removal and a change writes back its older
// copies first; the node's write-back still leaves the newest version of
// each field (the removal stays a removal), resets come back with the
// overrides, a record about to lapse does not, and the stale copies
// written again take nothing.
func TestOverrides_WriteBackKeepsTheNewestOfEachField(t *testing.T) {
	srv, w, want, stale := watchedRegion(t)
	other, _ := otherNode(t, srv)
	staleWrite := func() int {
		t.Helper()
		ovs := make([]origin.Override, len(stale))
		for i, r := range stale {
			ovs[i] = r.regionValue()
		}
		n, err := other.PutOverrides(context.Background(), ovs, false)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	srv.Restart()
	if n := staleWrite(); n != len(stale) {
		t.Fatalf("the stale copies took %d fields of the empty region, want %d", n, len(stale))
	}
	w.look(time.Now())
	if got := regionRecs(t, other); !maps.Equal(got, want) {
		t.Fatalf("after the write-back the region holds\n%+v\nwant\n%+v", got, want)
	}
	if n := staleWrite(); n != 0 {
		t.Fatalf("the stale copies written again took %d fields, want none", n)
	}
	for id, r := range want {
		if got, _ := overrides.get(r.bookZone(), id); got != r {
			t.Fatalf("the book holds %+v, want %+v", got, r)
		}
	}
}

// TestOverrides_WriteBackWhenTheHashAloneIsGone: the hash of overrides
// evicted or deleted while the change counter stayed is written back too.
func TestOverrides_WriteBackWhenTheHashAloneIsGone(t *testing.T) {
	srv, w, want, _ := watchedRegion(t)
	admin := srv.Client()
	if err := admin.Del(context.Background(), origin.DefaultPrefix+":{overrides}").Err(); err != nil {
		t.Fatal(err)
	}
	w.look(time.Now())
	if got := regionRecs(t, w.o); !maps.Equal(got, want) {
		t.Fatalf("after the write-back the region holds\n%+v\nwant\n%+v", got, want)
	}
	if _, mark, err := w.o.OverridesState(context.Background()); err != nil || mark == "" || mark != w.mark {
		t.Fatalf("after the write-back the region's mark is %q (%v), the watch's %q: want one, the same", mark, err, w.mark)
	}
}

// TestOverrides_AStaleBookIsNotWrittenBack: a node that last read the
// region more than tombstoneLife ago may hold an override whose removal
// lapsed since; it writes nothing back, and loads what the region holds.
func TestOverrides_AStaleBookIsNotWrittenBack(t *testing.T) {
	srv, w, _, _ := watchedRegion(t)
	now := time.Now()
	w.synced = now.Add(-tombstoneLife - time.Minute)
	srv.Restart()
	w.look(now)
	if got := regionRecs(t, w.o); len(got) != 0 {
		t.Fatalf("a stale node wrote back %+v", got)
	}
	if w.seen != 0 || !w.synced.Equal(now) {
		t.Fatalf("the watch is as of counter %d, read at %s: want the empty region's, now", w.seen, w.synced)
	}
}

// TestOverrides_AFailedReloadDoesNotHoldUpDecisions: a reload that adds
// Redis and then fails (a handler's zone refused) provisioned the first
// load of the overrides, which only a started config ends: every decision
// then waited for it, up to two seconds, and the next config with Redis
// found its own first load used up and did not wait for it. The load is
// given up with the config.
func TestOverrides_AFailedReloadDoesNotHoldUpDecisions(t *testing.T) {
	resetOverrides(t)
	_, admin, base := startCaddy(t, overrideConfig(""))
	if n := admitted(t, base, "k", 1); n != 1 {
		t.Fatalf("admitted %d of 1", n)
	}
	bad := fmt.Sprintf(`{"admin": {"listen": "localhost:%d"},
 "apps": {"ratelimit": {"origin": {"redis": ["redis://127.0.0.1:1"]}},
  "http": {"servers": {"s": {"listen": [":%d"], "routes": [{"handle": [
   {"handler": "ratelimit", "zones": [{"name": "ov", "key": "{http.request.header.X-Key}", "limit": 0, "window": "1m"}]}]}]}}}}}`,
		admin, portOf(t, base))
	req, err := http.NewRequest(http.MethodPost, fmt.Sprintf("http://localhost:%d/load", admin), strings.NewReader(bad))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Close = true // a kept connection may reach an admin server a load replaced
	status, _, body := roundTrip(t, http.DefaultClient, req)
	if status < 400 || !strings.Contains(string(body), "limit must be positive") {
		t.Fatalf("the bad config answered %d %s, want its error", status, body)
	}
	overrides.mu.Lock()
	loading, once := overrides.loading.Load(), overrides.once
	overrides.mu.Unlock()
	if loading || once {
		t.Fatalf("after the failed reload the first load is loading=%v, begun=%v; want neither", loading, once)
	}
	if n := admitted(t, base, "k", 1); n != 1 {
		t.Fatalf("after the failed reload the old config admitted %d of 1", n)
	}
}

// TestOverrides_ANodeJoiningTheRegionTakesItsOverrides: a node reloaded
// without Redis keeps its overrides and changes them on its own (scope
// node); reloaded with the region's Redis again, it applies the region's
// overrides, not its own: it once kept both, applying a removal and an
// override no other node of the region knew of, for good.
func TestOverrides_ANodeJoiningTheRegionTakesItsOverrides(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	withRedis := overrideConfig(fmt.Sprintf("\tratelimit {\n\t\tredis %s\n\t}", srv.URL()))
	tester, admin, base := startCaddy(t, withRedis)
	port := portOf(t, base)
	var doc overrideDoc
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=kept", `{"limit": 3}`).decode(t, http.StatusOK, &doc)
	if doc.Scope != scopeRegion {
		t.Fatalf("with Redis the override went to %q", doc.Scope)
	}

	tester.InitServer(overrideConfig("")(admin, port), "caddyfile") // counting alone
	adminDo(t, admin, http.MethodDelete, "/ratelimit/overrides?zone=ov&identifier=kept").decode(t, http.StatusOK, &doc)
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=mine", `{"limit": 1}`).decode(t, http.StatusOK, &doc)
	if doc.Scope != scopeNode {
		t.Fatalf("without Redis the override went to %q", doc.Scope)
	}

	tester.InitServer(withRedis(admin, port), "caddyfile") // back in the region
	redistest.EventuallyShow(t, 5*time.Second, "the node applies the region's overrides", func() (bool, string) {
		var list overrideListDoc
		adminDo(t, admin, http.MethodGet, "/ratelimit/overrides?zone=ov").decode(t, http.StatusOK, &list)
		var got []string
		for _, o := range list.Overrides {
			got = append(got, fmt.Sprintf("%s=%d", o.Identifier, o.Limit))
		}
		return len(got) == 1 && got[0] == "kept=3", fmt.Sprint(got)
	})
	if n := admitted(t, base, "mine", 3); n != 2 {
		t.Fatalf("the node's own override of 1 still applies: admitted %d of 3 at the zone's limit 2", n)
	}
}

// TestOverrides_ANodeReloadedToAnotherPrefixJoinsThatRegion: a reload
// that changes only the prefix moves the node to another region's keys
// on the same Redis, as a reload to another Redis does. The node kept the
// overrides of the prefix it left, which the new prefix's region does not
// hold: it applied them alone, and a node started on the new prefix did
// not (the book's source named the servers, not the prefix).
func TestOverrides_ANodeReloadedToAnotherPrefixJoinsThatRegion(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	on := func(prefix string) func(admin, port int) string {
		return overrideConfig(fmt.Sprintf("\tratelimit {\n\t\tredis %s\n\t\tprefix %s\n\t}", srv.URL(), prefix))
	}
	tester, admin, base := startCaddy(t, on("pa"))
	port := portOf(t, base)
	var doc overrideDoc
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=kept", `{"limit": 3}`).decode(t, http.StatusOK, &doc)
	if n := admitted(t, base, "kept", 4); n != 3 {
		t.Fatalf("under its override of 3 the key admitted %d of 4", n)
	}

	applies := func(what string, want func([]overrideDoc) bool) {
		t.Helper()
		redistest.EventuallyShow(t, 5*time.Second, "the node applies "+what, func() (bool, string) {
			var list overrideListDoc
			adminDo(t, admin, http.MethodGet, "/ratelimit/overrides?zone=ov").decode(t, http.StatusOK, &list)
			return want(list.Overrides), fmt.Sprint(list.Overrides)
		})
	}
	tester.InitServer(on("pb")(admin, port), "caddyfile")
	applies("the overrides of pb's region, none", func(l []overrideDoc) bool { return len(l) == 0 })
	if n := admitted(t, base, "kept-fresh", 3); n != 2 {
		t.Fatalf("a fresh key admitted %d of 3 at the zone's limit 2", n)
	}
	// Back on pa, its override applies again.
	tester.InitServer(on("pa")(admin, port), "caddyfile")
	applies("pa's override again", func(l []overrideDoc) bool { return len(l) == 1 && l[0].Limit == 3 })
}

// TestOverrides_AChangeWinsOverAFutureVersion: the region holds an
// override whose version is ahead of this node's clock (made on a node
// whose clock runs fast). An operator's change here comes after it, and
// takes: stamped past the version it replaces, in Redis and on every node.
// Before the fix the region kept the old override, every node applied it,
// and the PUT answered 200 with the new limit.
func TestOverrides_AChangeWinsOverAFutureVersion(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion ov-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t}", srv.URL())
	other, _ := otherNode(t, srv)
	fast := putAhead(t, other, overrideRec{Zone: "ov", Identifier: "sk1", Limit: 3, Region: "ov-test"})
	_, admin, base := startCaddy(t, overrideConfig(global))
	var doc overrideDoc
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=sk1", `{"limit": 7}`).decode(t, http.StatusOK, &doc)
	if doc.Limit != 7 {
		t.Fatalf("answer %+v", doc)
	}
	_, all, err := other.Overrides(context.Background())
	if err != nil || len(all) != 1 {
		t.Fatalf("the region holds %+v (%v)", all, err)
	}
	if rec, ok := recOfRegion(all[0]); !ok || rec.Limit != 7 || rec.Version <= fast.Version {
		t.Fatalf("the region holds %+v, want limit 7 stamped after version %d", rec, fast.Version)
	}
	if n := admitted(t, base, "sk1", 8); n != 7 {
		t.Fatalf("admitted %d of 8 under the new limit 7", n)
	}
}

// TestOverrides_A503IsAChangeStoredNowhere: the admin API answers 503 to
// a change "the region's Redis did not take ... stored nowhere" (README).
// A change whose answer from Redis is slow (a saturated Redis, a slow
// link: the reply comes after the call's second) was taken all the same:
// the region holds it and its other nodes apply it. The answer must then
// not be a 503 that says it is stored nowhere.
func TestOverrides_A503IsAChangeStoredNowhere(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	proxy := redistest.StartDelayProxy(t, srv.Addr(), 0)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion ov-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t}", proxy.URL())
	other, _ := otherNode(t, srv)
	_, admin, base := startCaddy(t, overrideConfig(global))
	// A first change loads the script into Redis: the slow one below is
	// one round trip (EVALSHA), which Redis runs at once.
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=warm", `{"limit": 5}`).decode(t, http.StatusOK, &overrideDoc{})

	proxy.SetDelay(1500 * time.Millisecond)
	go func() {
		// Redis's reply to the change is on its way back, held by the
		// proxy; later replies come at once.
		time.Sleep(300 * time.Millisecond)
		proxy.SetDelay(0)
	}()
	r := adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=blocked", `{"limit": 0, "reason": "abuse"}`)
	_, all, err := other.Overrides(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	held := false
	for _, o := range all {
		if rec, ok := recOfRegion(o); ok && rec.Identifier == "blocked" {
			held = true
		}
	}
	t.Logf("answer %d %s; the region holds the change: %v", r.status, r.body, held)
	if r.status == http.StatusServiceUnavailable && held {
		t.Fatalf("the change answered 503 (%s), yet the region holds it and every other node applies it", r.body)
	}
	if r.status == http.StatusOK && !held {
		t.Fatalf("the change answered 200, yet the region does not hold it")
	}
	if held {
		redistest.Eventually(t, 5*time.Second, "the change applied here too", func() bool { return admitted(t, base, "blocked", 1) == 0 })
	}
}

// TestOverrides_AChangeRacingAReloadTakes: an operator's change is on its
// way to the region's Redis (its reply held back) when a reload makes the
// origin again and closes the old one under the call. Redis answered all
// along: the change must take (200), be held by the region and apply
// here, and a region reset racing a reload likewise. Before, the closed
// client failed the call and its read back: a 503 saying the region may
// hold the change (1 change in 60 sent during 15 reloads, by hand).
func TestOverrides_AChangeRacingAReloadTakes(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	proxy := redistest.StartDelayProxy(t, srv.Addr(), 0)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion ov-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t}", proxy.URL())
	other, _ := otherNode(t, srv)
	_, admin, _ := startCaddy(t, overrideConfig(global))
	// A first change loads the scripts, so each call below is one round trip.
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=warm", `{"limit": 5}`).decode(t, http.StatusOK, &overrideDoc{})
	adminSend(t, admin, http.MethodDelete, "/ratelimit/counters?zone=ov&identifier=warm&scope=region", "").decode(t, http.StatusOK, &resetDoc{})

	holds := func(id string, reset bool) bool {
		_, all, err := other.Overrides(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range all {
			if rec, ok := recOfRegion(o); ok && rec.Identifier == id && rec.Reset == reset {
				return true
			}
		}
		return false
	}
	// race sends the change with each of Redis's replies held for delay
	// (within the call's second: a reset makes three round trips).
	race := func(method, path, id string, reset bool, delay time.Duration) adminReply {
		t.Helper()
		before := lookupState().overridesRedis()
		proxy.SetDelay(delay)
		answer := make(chan adminReply, 1)
		go func() { answer <- adminSend(t, admin, method, path, `{"limit": 0}`) }()
		// Redis took the write; its reply is held by the proxy.
		redistest.Eventually(t, 5*time.Second, "the write in Redis", func() bool { return holds(id, reset) })
		proxy.SetDelay(0)
		if err := loadCaddyfile(t, admin, overrideConfig(global)); err != nil {
			t.Fatal(err)
		}
		if lookupState().overridesRedis() == before {
			t.Fatal("the reload kept the origin: the test races nothing")
		}
		return <-answer
	}

	r := race(http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=blocked", "blocked", false, 700*time.Millisecond)
	if r.status != http.StatusOK {
		t.Fatalf("a change racing a reload answered %d %s, though the region took it", r.status, r.body)
	}
	if got, ok := overrides.get("ov", "blocked"); !ok || got.Limit != 0 {
		t.Fatalf("the change is not applied here: %+v %v", got, ok)
	}
	r = race(http.MethodDelete, "/ratelimit/counters?zone=ov&identifier=reset-me&scope=region", "reset-me", true, 250*time.Millisecond)
	if r.status != http.StatusOK {
		t.Fatalf("a region reset racing a reload answered %d %s, though the region took it", r.status, r.body)
	}
}

// TestOverrides_AWriteToARedisThatIsDownWasNeverSent: the origin's error
// for a write to a Redis that refuses connections is one neverSent takes
// for a write that never left the node (the answer is then the 503 of a
// change stored nowhere), and a write cut by a paused Redis (its reply
// came too late: Redis may run it) is not.
func TestOverrides_AWriteToARedisThatIsDownWasNeverSent(t *testing.T) {
	srv := redistest.Start(t)
	o, _ := otherNode(t, srv)
	rec := overrideRec{Zone: "ov", Identifier: "down", Limit: 1, Region: "ov-test", CreatedMs: time.Now().UnixMilli(), Version: time.Now().UnixMicro()}
	put := func(timeout time.Duration) error {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		_, err := o.PutOverrides(ctx, []origin.Override{rec.regionValue()}, false)
		return err
	}
	if err := put(time.Second); err != nil {
		t.Fatal(err)
	}
	srv.Pause()
	err := put(200 * time.Millisecond)
	srv.Resume()
	if err == nil || neverSent(err) {
		t.Fatalf("a write to a paused Redis: %v; neverSent %v, want an error it does not take for never sent", err, neverSent(err))
	}
	srv.Stop()
	err = put(time.Second)
	if err == nil || !neverSent(err) {
		t.Fatalf("a write to a Redis that is down: %v; neverSent %v, want true", err, neverSent(err))
	}
	if got := storeFailed(err, err); got != errOverrideStore {
		t.Fatalf("storeFailed of a write never sent, read back failing too: %v, want errOverrideStore", got)
	}
}

// TestOverrides_ANodeCutOffWhileAChangeLapsedDropsWhatItReplaced: a node
// holds an override (a block) when another node replaces it with one that
// expires soon (a short reprieve), and the node does not hear of the
// change: its Redis does not answer it until after the reprieve lapsed,
// and meanwhile another node loads the region (a load dropped a lapsed
// change from it). Back in touch, the node must stop applying the block
// the change replaced, as every other node does (the zone's limit
// applies), not apply it for good.
func TestOverrides_ANodeCutOffWhileAChangeLapsedDropsWhatItReplaced(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	proxy := redistest.StartDelayProxy(t, srv.Addr(), 0)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion ov-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t\tslow_tick 50ms\n\t}", proxy.URL())
	other, _ := otherNode(t, srv)
	_, _, base := startCaddy(t, overrideConfig(global))
	ctx := context.Background()
	put := func(id string, limit int64, expires time.Duration) overrideRec {
		t.Helper()
		now := time.Now()
		rec := overrideRec{Zone: "ov", Identifier: id, Limit: limit, Region: "ov-test", CreatedMs: now.UnixMilli(), Version: now.UnixMicro()}
		if expires > 0 {
			rec.ExpiresMs = now.Add(expires).UnixMilli()
		}
		if n, err := other.PutOverrides(ctx, []origin.Override{rec.regionValue()}, false); err != nil || n != 1 {
			t.Fatalf("the other node's change took %d: %v", n, err)
		}
		return rec
	}
	applied := func(id string, limit int64) func() bool {
		return func() bool { got, ok := runtimeLimit(ctx, "ov", id); return ok && got == limit }
	}

	put("cut", 0, 0)
	redistest.Eventually(t, 5*time.Second, "the block applied here", applied("cut", 0))
	if n := admitted(t, base, "cut", 1); n != 0 {
		t.Fatalf("the blocked key admitted %d", n)
	}

	proxy.SetDelay(3 * time.Second) // every reply to this node comes after its calls gave up
	reprieve := put("cut", 100, 300*time.Millisecond)
	// Another node loads the region once the reprieve lapsed (it dropped
	// it from the region then).
	redistest.Eventually(t, 5*time.Second, "the reprieve lapsed", func() bool { return time.Now().UnixMilli() > reprieve.ExpiresMs })
	if _, err := loadRegionOverrides(ctx, other, func() int64 { return time.Now().UnixMilli() }, func([]overrideRec) {}); err != nil {
		t.Fatal(err)
	}
	if got, ok := overrides.get("ov", "cut"); !ok || got.Version >= reprieve.Version {
		t.Fatalf("this node heard of the reprieve while cut off (%+v, %v): the test cuts nothing", got, ok)
	}
	proxy.SetDelay(0)

	// A later change that arrives here shows the node read the region again.
	put("marker", 7, 0)
	redistest.Eventually(t, 10*time.Second, "the node back in touch with the region", applied("marker", 7))
	if got, ok := runtimeLimit(ctx, "ov", "cut"); ok {
		rec, _ := overrides.get("ov", "cut")
		t.Fatalf("the node still applies limit %d to the key (%+v), which the region's nodes count at the zone's limit: the change that replaced it lapsed while the node was cut off", got, rec)
	}
	if n := admitted(t, base, "cut", 1); n != 1 {
		t.Fatalf("the key admitted %d of 1 under the zone's limit of 2", n)
	}
}

// TestOverrides_AFarExpiryIsNotForgottenWhileLive: the day a lapsed
// override is kept does not wrap an expiry near the largest time (a row
// written by hand) into the past, where a load would drop it live.
func TestOverrides_AFarExpiryIsNotForgottenWhileLive(t *testing.T) {
	now := time.Now().UnixMilli()
	for _, exp := range []int64{now + 1, 253402300799999, math.MaxInt64 - 1, math.MaxInt64} {
		r := overrideRec{Limit: 1, ExpiresMs: exp}
		if got := r.forgetMs(); got <= now {
			t.Errorf("an override expiring at %d is forgotten at %d, before now (%d)", exp, got, now)
		}
	}
}

// failToStart posts to the admin endpoint, up to tries times, a config
// with the limiter on srv that fails to start (its HTTP server's address
// is taken), after each calling check with the number of reloads so far,
// and returns in how many the limiter had started before the HTTP server
// failed. Caddy starts a config's apps in no set order: the limiter
// starts first in about half of them. It stops at three.
func failToStart(t *testing.T, admin int, srv *redistest.Server, tries int, check func(reloads, started int)) int {
	t.Helper()
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	var starts atomic.Int64
	testHookStarted = func(a *App) {
		if a.Origin != nil && strings.HasPrefix(a.Origin.Prefix, "failed") {
			starts.Add(1)
		}
	}
	defer func() { testHookStarted = nil }()
	started := 0
	for i := 0; i < tries && started < 3; i++ {
		prefix := fmt.Sprintf("failed%d", i)
		bad := fmt.Sprintf(`{"admin": {"listen": "localhost:%d"},
 "apps": {"ratelimit": {"origin": {"redis": [%q], "prefix": %q}},
  "http": {"servers": {"s": {"listen": [%q], "routes": [{"handle": [
   {"handler": "ratelimit", "zones": [{"name": "ov", "key": "{http.request.header.X-Key}", "limit": 2, "window": "1m"}]}]}]}}}}}`,
			admin, srv.URL(), prefix, taken.Addr().String())
		req, err := http.NewRequest(http.MethodPost, fmt.Sprintf("http://localhost:%d/load", admin), strings.NewReader(bad))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		// Each load replaces the admin server: a connection kept from
		// the last one reached the server being shut down, reset (CI).
		req.Close = true
		if status, _, body := roundTrip(t, http.DefaultClient, req); status < 400 || !strings.Contains(string(body), "address already in use") {
			t.Fatalf("the config that cannot listen answered %d %s, want its error", status, body)
		}
		started = int(starts.Load())
		check(i+1, started)
	}
	if started == 0 {
		t.Fatal("in no failed reload did the limiter start before the HTTP server failed")
	}
	return started
}

// TestOverrides_AReloadThatFailsToStartKeepsTheNodesOverrides: a reload
// of a local-only node to a config with Redis that fails to start (its
// HTTP server's address is taken) stops the apps it started, the
// limiter's among them, and the running config goes on. The limiter's
// watch of the region's overrides had joined the region as it started,
// replacing the node's book with the region's: the node's own override
// was gone for good (404 at the first such reload, and its key held at
// the zone's limit). The watch now loads the region's overrides once its
// config runs alone.
func TestOverrides_AReloadThatFailsToStartKeepsTheNodesOverrides(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	_, admin, base := startCaddy(t, overrideConfig(""))
	var doc overrideDoc
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=mine", `{"limit": 5}`).decode(t, http.StatusOK, &doc)
	if doc.Scope != scopeNode {
		t.Fatalf("without Redis the override went to %q", doc.Scope)
	}
	failToStart(t, admin, srv, 40, func(reloads, started int) {
		if r := adminDo(t, admin, http.MethodGet, "/ratelimit/overrides?zone=ov&identifier=mine"); r.status != http.StatusOK {
			t.Fatalf("after failed reload %d (the limiter started in %d at least) the node's override is gone: %d %s", reloads, started, r.status, r.body)
		}
	})
	if n := admitted(t, base, "mine", 6); n != 5 {
		t.Fatalf("the key of the node's override of 5 admitted %d of 6", n)
	}
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=later", `{"limit": 3}`).decode(t, http.StatusOK, &doc)
	if doc.Scope != scopeNode {
		t.Fatalf("after the failed reloads a change went to %q, want the node's book", doc.Scope)
	}
}

// TestOverrides_AReloadThatFailsToStartLeavesNoWatch: the watch of a
// config's runtime overrides read its stop channel when its goroutine
// ran, and a config that failed to start could be cleaned up before
// that, which clears the field: the watch got no channel, looked at the
// closed origin every tick for the life of the process, and the reload
// that failed waited 5 s for it to end. Now every failed reload's watch
// ends, and none waits.
func TestOverrides_AReloadThatFailsToStartLeavesNoWatch(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	_, admin, _ := startCaddy(t, overrideConfig(""))
	began := time.Now()
	failToStart(t, admin, srv, 40, func(reloads, started int) {
		if d := time.Since(began); d > 3*time.Second {
			t.Fatalf("%d failed reloads took %v", reloads, d)
		}
	})
	redistest.EventuallyShow(t, 2*time.Second, "no watch of a failed config's overrides runs", func() (bool, string) {
		n := goroutinesIn("(*redisBackend).watchOverrides")
		return n == 0, fmt.Sprintf("%d run", n)
	})
}

// goroutinesIn counts the goroutines whose stack names fn.
func goroutinesIn(fn string) int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	count := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, fn) {
			count++
		}
	}
	return count
}

// TestOverrides_AZoneARemovedConfigDefinedKeepsItsOverrides is the
// README's promise: a reload that removes a zone keeps its runtime
// overrides, in the process and in the region's Redis, through the
// region's loads meanwhile; the admin API answers 404 for the zone while
// no loaded config defines it, and they apply again when one does.
func TestOverrides_AZoneARemovedConfigDefinedKeepsItsOverrides(t *testing.T) {
	for _, withRedis := range []bool{false, true} {
		t.Run(fmt.Sprintf("redis %v", withRedis), func(t *testing.T) {
			resetOverrides(t)
			global := ""
			var srv *redistest.Server
			if withRedis {
				srv = redistest.Start(t)
				global = fmt.Sprintf("\tratelimit {\n\t\tregion ov-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t}", srv.URL())
			}
			cfg := func(zone string) func(admin, port int) string {
				return func(admin, port int) string {
					return caddyConfig(admin, port, global, `
	handle {
		ratelimit {
			zone `+zone+` {
				key   {http.request.header.X-Key}
				limit 2
				window 1m
			}
		}
		respond "ok"
	}`)
				}
			}
			tester, admin, base := startCaddy(t, cfg("ov"))
			port := portOf(t, base)
			var doc overrideDoc
			adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=vip", `{"limit": 6}`).decode(t, http.StatusOK, &doc)
			tester.InitServer(cfg("other")(admin, port), "caddyfile")
			if t.Failed() {
				t.FailNow()
			}
			if r := adminDo(t, admin, http.MethodGet, "/ratelimit/overrides?zone=ov&identifier=vip"); r.status != http.StatusNotFound {
				t.Fatalf("GET of an override of a zone no config defines: %d %s, want 404", r.status, r.body)
			}
			if withRedis {
				// Another node's change of the zone: the node loads the
				// region's overrides while no config defines it.
				_, put := otherNode(t, srv)
				put("late", 0)
				redistest.Eventually(t, 5*time.Second, "the node loaded the region's change", func() bool {
					overrides.mu.Lock()
					defer overrides.mu.Unlock()
					for k := range overrides.recs {
						if k.id == "late" {
							return true
						}
					}
					return false
				})
			}
			tester.InitServer(cfg("ov")(admin, port), "caddyfile")
			if t.Failed() {
				t.FailNow()
			}
			// The old config's server may still answer a request in the
			// reload's last instant, under zone other.
			awaitNewConfig(t, tester, base+"/", func(r e2eResponse) bool {
				return strings.Contains(r.header.Get("RateLimit-Policy"), `"ov"`)
			}, "X-Key", "probe")
			if n := admitted(t, base, "vip", 7); n != 6 {
				t.Fatalf("with the zone defined again vip admitted %d of 7, want its override's 6", n)
			}
			if withRedis {
				if n := admitted(t, base, "late", 1); n != 0 {
					t.Fatalf("the region's limit-0 override of late admitted %d", n)
				}
			}
		})
	}
}
