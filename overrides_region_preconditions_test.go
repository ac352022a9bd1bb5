package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// Preconditions checked by the region's Redis (overrides_preconditions.go,
// origin.PutOverrideIf). Two Caddy processes racing on one Redis are in
// integration/ (TestOperator_TwoNodesConditionalChangesAtOnceOneWins).

// overridePath is the admin path of the override the tests here change.
const overridePath = "/ratelimit/overrides?zone=ov&identifier=k"

// nodeWithOverride starts a node (slowWatchedNode) on a private Redis
// and puts an override of limit 1 through it: the Redis, the node's
// admin port and the override as the PUT answered it.
func nodeWithOverride(t *testing.T) (*redistest.Server, int, overrideDoc) {
	t.Helper()
	resetOverrides(t)
	loadedVersion.Store(-1)
	srv := redistest.Start(t)
	admin := slowWatchedNode(t, srv)
	var read overrideDoc
	adminSend(t, admin, http.MethodPut, overridePath, `{"limit": 1}`).decode(t, http.StatusOK, &read)
	// The PUT's notice makes the watch load the region again: a change
	// planted before that load would be heard through it.
	c := srv.Client()
	defer c.Close()
	v, err := c.Get(context.Background(), origin.DefaultPrefix+":{overrides}:v").Int64()
	if err != nil {
		t.Fatal(err)
	}
	redistest.Eventually(t, 5*time.Second, "the node loaded its own change", func() bool { return loadedVersion.Load() >= v })
	return srv, admin, read
}

// slowWatchedNode starts this process as a node of region ov-test on srv
// that hears another node's change only on the change's notice or its
// slow tick of a minute: a change written to the region's hash without a
// notice stays unseen here for the test's length.
func slowWatchedNode(t *testing.T, srv *redistest.Server) int {
	t.Helper()
	global := fmt.Sprintf("\tratelimit {\n\t\tregion ov-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t\tslow_tick 1m\n\t}", srv.URL())
	_, admin, _ := startCaddy(t, overrideConfig(global))
	redistest.Eventually(t, 5*time.Second, "the node subscribed to the notices", func() bool {
		st := lookupState()
		rb := st.overridesRedis()
		return rb != nil && rb.OverrideNotices()
	})
	return admin
}

// changeUnheard writes rec into the region's hash as another node's
// change that this node has not heard of yet: the hash alone, no notice,
// no counter moved (a notice lost, or one on its way).
func changeUnheard(t *testing.T, srv *redistest.Server, rec overrideRec) {
	t.Helper()
	v := rec.regionValue()
	c := srv.Client()
	defer c.Close()
	if err := c.HSet(context.Background(), origin.DefaultPrefix+":{overrides}", v.Field, fmt.Sprintf("%d %s", v.Version, v.Value)).Err(); err != nil {
		t.Fatal(err)
	}
}

// TestOverrides_AStaleNodesIfMatchMeetsTheRegionsChange: another node of
// the region changed the override, and this node has not heard of it: its
// book still holds the ETag the operator read. A PUT or DELETE with
// If-Match of that old ETag is a 412 naming the region's ETag, and
// nothing is stored; If-None-Match: * on a key only the region holds is
// a 412 too. Before, the node's book passed each and the change took,
// undoing the other node's.
func TestOverrides_AStaleNodesIfMatchMeetsTheRegionsChange(t *testing.T) {
	srv, admin, read := nodeWithOverride(t)

	now := time.Now()
	var theirs overrideRec
	for i, method := range []string{http.MethodPut, http.MethodDelete} {
		theirs = overrideRec{Zone: "ov", Identifier: "k", Limit: int64(9 + i), Region: "ov-test", CreatedMs: now.UnixMilli(), Version: now.Add(time.Minute).UnixMicro() + int64(1000*(i+1))}
		changeUnheard(t, srv, theirs)
		if got, _ := overrides.get("ov", "k"); got.Version >= theirs.Version {
			t.Fatalf("the node heard the change already (%s): the test races nothing", etagOf(got))
		}
		r := adminIf(t, admin, method, overridePath, `{"limit": 50}`, "If-Match", read.ETag)
		r.wantSays(t, http.StatusPreconditionFailed, "If-Match: the region holds the override as "+etagOf(theirs))
		read.ETag = etagOf(theirs) // the 412 brought it into the book: a GET now shows it
	}
	held := regionRecs(t, lookupState().overridesRedis())
	if len(held) != 1 {
		t.Fatalf("the region holds %+v, want the other node's change alone", held)
	}
	for _, rec := range held {
		if rec.Limit != theirs.Limit || rec.Version != theirs.Version {
			t.Fatalf("the region holds %+v, want the other node's limit %d", rec, theirs.Limit)
		}
	}
	// The 412 brought the region's change into the book.
	wantOverride(t, admin, overridePath, theirs.Limit, etagOf(theirs))

	// A key this node has never heard of, created on another node.
	other := overrideRec{Zone: "ov", Identifier: "fresh", Limit: 3, Region: "ov-test", CreatedMs: now.UnixMilli(), Version: now.UnixMicro()}
	changeUnheard(t, srv, other)
	r := adminIf(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=fresh", `{"limit": 50}`, "If-None-Match", "*")
	r.wantSays(t, http.StatusPreconditionFailed, "If-None-Match: * asks that there be no live override of this identifier, and the region holds one, as "+etagOf(other))
}

// TestOverrides_AConditionalChangeWithRedisDownChangesNothing: with the
// region's Redis down, a conditional change cannot be checked against
// what the region holds: a 503 that says so, nothing changed on the node.
// An unconditional change answers as before (a 503 saying the region's
// Redis did not take it). Before, the conditional one answered the
// unconditional one's 503, which does not say its precondition went
// unchecked.
func TestOverrides_AConditionalChangeWithRedisDownChangesNothing(t *testing.T) {
	srv, admin, read := nodeWithOverride(t)
	srv.Stop()

	for _, c := range []struct{ method, header, value string }{
		{http.MethodPut, "If-Match", read.ETag},
		{http.MethodDelete, "If-Match", read.ETag},
		{http.MethodPut, "If-Match", "*"},
		{http.MethodPut, "If-None-Match", `"1.elsewhere"`},
	} {
		r := adminIf(t, admin, c.method, overridePath, `{"limit": 50}`, c.header, c.value)
		t.Logf("%s %s: %s with Redis down: %d %s", c.method, c.header, c.value, r.status, strings.TrimSpace(string(r.body)))
		r.wantSays(t, http.StatusServiceUnavailable, "could not check the precondition")
	}
	r := adminSend(t, admin, http.MethodPut, overridePath, `{"limit": 50}`)
	r.wantSays(t, http.StatusServiceUnavailable, "did not take the change")
	wantOverride(t, admin, overridePath, 1, read.ETag)
}

// TestAdmin_AKeyThisNodeDoesNotHoldWithRedisDownIsNoSure404: with the
// region's Redis down, a GET of the counters of a key this node holds
// none of, and a removal of an override this node holds none of, said
// 404 "none" (an audit), though the region may count the key and hold
// the override: a 503 that says the region did not answer, and nothing
// changed.
func TestAdmin_AKeyThisNodeDoesNotHoldWithRedisDownIsNoSure404(t *testing.T) {
	srv, admin, _ := nodeWithOverride(t)
	const counters, override = "/ratelimit/counters?zone=ov&identifier=elsewhere", "/ratelimit/overrides?zone=ov&identifier=elsewhere"
	// With Redis up, the region holds none either: 404s.
	adminSend(t, admin, http.MethodGet, counters, "").wantSays(t, http.StatusNotFound, "no counters")
	adminSend(t, admin, http.MethodDelete, override, "").wantSays(t, http.StatusNotFound, "no runtime override")
	srv.Stop()
	adminSend(t, admin, http.MethodGet, counters, "").wantSays(t, http.StatusServiceUnavailable, "the region's Redis did not answer")
	adminSend(t, admin, http.MethodDelete, override, "").wantSays(t, http.StatusServiceUnavailable, "the region's Redis did not answer")
}
