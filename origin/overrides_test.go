package origin

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// TestOverrides_NewerWinsAndTheCounterMovesOnlyOnAChange: two nodes write
// changes of one override in either order and agree on the newest; a
// stale or repeated write changes nothing, not even the counter.
func TestOverrides_NewerWinsAndTheCounterMovesOnlyOnAChange(t *testing.T) {
	srv := redistest.Start(t)
	a := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	b := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "b"})
	ctx := ctxT(t)
	put := func(o *Redis, ver int64, val string) int {
		t.Helper()
		n, err := o.PutOverrides(ctx, []Override{{Field: "z k", Version: ver, Value: val}}, false)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := put(a, 20, "new value"); n != 1 {
		t.Fatalf("first write took %d, want 1", n)
	}
	v1, _ := b.OverridesVersion(ctx)
	if n := put(b, 10, "older"); n != 0 {
		t.Fatalf("an older version took %d, want 0", n)
	}
	if n := put(b, 20, "new value"); n != 0 {
		t.Fatalf("the same version again took %d, want 0", n)
	}
	if v2, _ := b.OverridesVersion(ctx); v2 != v1 || v1 == 0 {
		t.Fatalf("counter %d then %d: want it moved by the first write only", v1, v2)
	}
	_, all, err := b.Overrides(ctx)
	if err != nil || len(all) != 1 || all[0] != (Override{Field: "z k", Version: 20, Value: "new value"}) {
		t.Fatalf("overrides = %+v (%v), want the version 20 one", all, err)
	}
}

// TestOverrides_HolderTakesQueuedChangesOnce: changes made with queue are
// taken once, as they are now; a new holder's first look takes them all.
func TestOverrides_HolderTakesQueuedChangesOnce(t *testing.T) {
	srv := redistest.Start(t)
	a := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	ctx := ctxT(t)
	if _, err := a.PutOverrides(ctx, []Override{{Field: "z one", Version: 1, Value: "1"}, {Field: "z two", Version: 1, Value: "2"}}, true); err != nil {
		t.Fatal(err)
	}
	if _, err := a.PutOverrides(ctx, []Override{{Field: "z one", Version: 2, Value: "1b"}}, true); err != nil {
		t.Fatal(err)
	}
	if _, err := a.PutOverrides(ctx, []Override{{Field: "z pulled", Version: 1, Value: "p"}}, false); err != nil {
		t.Fatal(err)
	}
	got, err := a.TakeOverrides(ctx, false)
	if err != nil {
		t.Fatal(err)
	}
	var fields []string
	for _, o := range got {
		fields = append(fields, o.Field+"="+o.Value)
	}
	// "z one" was queued twice; both takes see its newest value.
	if want := []string{"z one=1b", "z two=2", "z one=1b"}; !slices.Equal(fields, want) {
		t.Fatalf("taken %v, want %v (the pulled one is not queued)", fields, want)
	}
	if again, _ := a.TakeOverrides(ctx, false); len(again) != 0 {
		t.Fatalf("taken again: %+v", again)
	}
	if all, _ := a.TakeOverrides(ctx, true); len(all) != 3 {
		t.Fatalf("a new holder's look took %d, want all 3", len(all))
	}
	// A lapsed override is dropped only at the version it lapsed at.
	if err := a.DropOverrides(ctx, []Override{{Field: "z one", Version: 1, Value: "1"}, {Field: "z two", Version: 1, Value: "2"}}); err != nil {
		t.Fatal(err)
	}
	if _, all, _ := a.Overrides(ctx); len(all) != 2 {
		t.Fatalf("after dropping: %+v, want z one (newer) and z pulled", all)
	}
}

// TestOverrides_EveryChangeIsAnnouncedAndASubscriptionComesBack: a node
// watching the notices hears that it is subscribed, then each change
// another node makes; when Redis drops the subscription it hears that it
// is not, subscribes again by itself and hears the next change; it stops
// with its context, and with the origin.
func TestOverrides_EveryChangeIsAnnouncedAndASubscriptionComesBack(t *testing.T) {
	srv := redistest.Start(t)
	a := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	b := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "b"})
	ctx := ctxT(t)
	notices := make(chan bool, 100)
	wctx, stop := context.WithCancel(ctx)
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		b.WatchOverrides(wctx, func(live bool) { notices <- live })
	}()
	next := func(want bool, what string) {
		t.Helper()
		select {
		case live := <-notices:
			if live != want {
				t.Fatalf("%s: notice(%v), want notice(%v)", what, live, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: no notice within 5 s", what)
		}
	}
	put := func(ver int64) {
		t.Helper()
		if _, err := a.PutOverrides(ctx, []Override{{Field: "z k", Version: ver, Value: "v"}}, false); err != nil {
			t.Fatal(err)
		}
	}
	next(true, "subscribing")
	if !b.Stats().OverrideNotices {
		t.Fatal("subscribed, and the stats say not")
	}
	put(10)
	next(true, "a change")
	put(5) // older: no change, no notice; the next change is heard next
	put(11)
	next(true, "the change after a stale write")
	if len(notices) != 0 {
		t.Fatalf("%d notices more than the changes", len(notices))
	}

	admin := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer admin.Close()
	if err := admin.Do(ctx, "CLIENT", "KILL", "TYPE", "pubsub").Err(); err != nil {
		t.Fatal(err)
	}
	next(false, "the subscription dropped")
	next(true, "subscribing again")
	put(12)
	next(true, "a change after subscribing again")

	stop()
	select {
	case <-ended:
	case <-time.After(5 * time.Second):
		t.Fatal("WatchOverrides did not end with its context")
	}
	if b.Stats().OverrideNotices {
		t.Fatal("the watch ended, and the stats say subscribed")
	}
	ended = make(chan struct{})
	go func() {
		defer close(ended)
		b.WatchOverrides(ctx, func(bool) {})
	}()
	_ = b.Close()
	select {
	case <-ended:
	case <-time.After(5 * time.Second):
		t.Fatal("WatchOverrides did not end with the origin")
	}
}

// TestOverrides_ANoticeComesThroughSentinel: a client of Sentinels
// subscribes on the master it found, where the change's script publishes.
func TestOverrides_ANoticeComesThroughSentinel(t *testing.T) {
	master := redistest.Start(t, redistest.WithPassword("master-pw"))
	sentinel := redistest.StartSentinel(t, master)
	cfg := Config{Sentinel: &SentinelConfig{
		Master: redistest.SentinelMaster,
		Addrs:  []string{"redis://:master-pw@" + sentinel.Addr()},
	}}
	hearsAChange(t, cfg)
}

// TestOverrides_ANoticeCrossesACluster: through a Redis Cluster client,
// the change's script publishes on the node of the overrides' slot and
// the subscription is the cluster client's; the notice reaches it.
func TestOverrides_ANoticeCrossesACluster(t *testing.T) {
	cl := redistest.StartCluster(t, 3)
	cfg := Config{Cluster: &ClusterConfig{Addrs: cl.Addrs()}}
	hearsAChange(t, cfg)
}

// TestOverrides_AUserWithoutChannelsStillChangesOverrides: Redis 7 gives a
// new ACL user no pub/sub channels unless told; such a user's change is
// stored and reported as stored (its notice is left out), and a node of
// that user hears that it has no subscription, so it keeps reading the
// change counter each fast tick. Once the user is granted the channels,
// the node subscribes by itself and hears the next change.
func TestOverrides_AUserWithoutChannelsStillChangesOverrides(t *testing.T) {
	srv := redistest.Start(t)
	ctx := ctxT(t)
	admin := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer admin.Close()
	if err := admin.Do(ctx, "ACL", "SETUSER", "app", "on", ">app-pw", "~*", "+@all", "resetchannels").Err(); err != nil {
		t.Fatal(err)
	}
	url := "redis://app:app-pw@" + srv.Addr()
	a := newOrigin(t, Config{Redis: []string{url}}, Options{NodeID: "a"})
	b := newOrigin(t, Config{Redis: []string{url}}, Options{NodeID: "b"})
	notices := make(chan bool, 10)
	go b.WatchOverrides(ctx, func(live bool) { notices <- live })
	select {
	case live := <-notices:
		if live {
			t.Fatal("a user without channels was told it is subscribed")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no notice within 5 s")
	}
	if n, err := a.PutOverrides(ctx, []Override{{Field: "z k", Version: 1, Value: "v"}}, false); n != 1 || err != nil {
		t.Fatalf("PutOverrides = %d, %v: the change must be stored and reported stored", n, err)
	}
	if v, err := b.OverridesVersion(ctx); v != 1 || err != nil {
		t.Fatalf("change counter %d, %v, want 1", v, err)
	}

	if err := admin.Do(ctx, "ACL", "SETUSER", "app", "allchannels").Err(); err != nil {
		t.Fatal(err)
	}
	await := func(what string) {
		t.Helper()
		deadline := time.After(10 * time.Second)
		for {
			select {
			case live := <-notices:
				if live {
					return
				}
			case <-deadline:
				t.Fatalf("%s: no notice(true) within 10 s", what)
			}
		}
	}
	await("subscribing once granted the channels")
	if _, err := a.PutOverrides(ctx, []Override{{Field: "z k", Version: 2, Value: "v"}}, false); err != nil {
		t.Fatal(err)
	}
	await("a change once granted the channels")
}

// hearsAChange checks that a node of cfg subscribes to the notices and
// hears a change another node of cfg makes.
func hearsAChange(t *testing.T, cfg Config) {
	t.Helper()
	a := newOrigin(t, cfg, Options{NodeID: "a"})
	b := newOrigin(t, cfg, Options{NodeID: "b"})
	ctx := ctxT(t)
	notices := make(chan bool, 10)
	go b.WatchOverrides(ctx, func(live bool) { notices <- live })
	for i, what := range []string{"subscribing", "a change"} {
		if i == 1 {
			if _, err := a.PutOverrides(ctx, []Override{{Field: "z k", Version: 1, Value: "v"}}, false); err != nil {
				t.Fatal(err)
			}
		}
		select {
		case live := <-notices:
			if !live {
				t.Fatalf("%s: notice(false)", what)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: no notice within 5 s", what)
		}
	}
}

// TestOverrides_AWriteBackKeepsTheNewestAndTheMarkGoesWithTheHash: the
// region's mark is set once and read by every node; a Redis restarted
// empty has none and its counter is back at 0. A write-back of more
// fields than one batch, after a stale node wrote older copies of some
// and a newer one of another, leaves the newest of each and moves the
// counter; written again, it takes nothing and moves nothing. The reads
// of overrides pass over the mark.
func TestOverrides_AWriteBackKeepsTheNewestAndTheMarkGoesWithTheHash(t *testing.T) {
	srv := redistest.Start(t)
	a := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	b := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "b"})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	mark, err := a.MarkOverrides(ctx)
	if err != nil || mark == "" || strings.Contains(mark, " ") {
		t.Fatalf("MarkOverrides = %q, %v: want a word", mark, err)
	}
	if again, err := b.MarkOverrides(ctx); again != mark || err != nil {
		t.Fatalf("a second node's MarkOverrides = %q, %v: want the first mark, %q", again, err, mark)
	}
	held := make([]Override, 2*restoreBatch+1)
	for i := range held {
		held[i] = Override{Field: fmt.Sprintf("z k%d", i), Version: 100, Value: fmt.Sprintf("v%d", i)}
	}
	if n, err := a.PutOverrides(ctx, held, false); n != len(held) || err != nil {
		t.Fatalf("PutOverrides = %d, %v", n, err)
	}
	if v, m, err := b.OverridesState(ctx); v != 1 || m != mark || err != nil {
		t.Fatalf("OverridesState = %d, %q, %v: want 1, %q", v, m, err, mark)
	}
	if _, all, err := b.Overrides(ctx); len(all) != len(held) || err != nil {
		t.Fatalf("Overrides read %d (%v), want the %d overrides without the mark", len(all), err, len(held))
	}

	srv.Restart()
	if v, m, err := b.OverridesState(ctx); v != 0 || m != "" || err != nil {
		t.Fatalf("after the restart OverridesState = %d, %q, %v: want 0 and no mark", v, m, err)
	}
	stale := []Override{{Field: "z k0", Version: 99, Value: "old"}, {Field: "z k1", Version: 99, Value: "old"}, {Field: "z k2", Version: 101, Value: "newer"}}
	if _, err := b.PutOverrides(ctx, stale, false); err != nil {
		t.Fatal(err)
	}
	if n, err := a.RestoreOverrides(ctx, held, false); n != len(held)-1 || err != nil {
		t.Fatalf("RestoreOverrides = %d, %v: want every field but the newer one", n, err)
	}
	_, all, err := b.Overrides(ctx)
	if err != nil || len(all) != len(held) {
		t.Fatalf("the region holds %d overrides (%v), want %d", len(all), err, len(held))
	}
	want := map[string]Override{}
	for _, o := range append(held, stale[2]) {
		want[o.Field] = o
	}
	for _, o := range all {
		if o != want[o.Field] {
			t.Fatalf("the region holds %+v, want %+v", o, want[o.Field])
		}
	}
	v, _ := b.OverridesVersion(ctx)
	if v != 4 {
		t.Fatalf("counter %d after a stale write and a write-back of three batches, want 4", v)
	}
	if n, err := b.RestoreOverrides(ctx, held, false); n != 0 || err != nil {
		t.Fatalf("the same write-back again = %d, %v: want 0", n, err)
	}
	if again, _ := b.OverridesVersion(ctx); again != v {
		t.Fatalf("counter %d after a write-back that changed nothing, want %d", again, v)
	}
	if m, err := a.MarkOverrides(ctx); m == "" || m == mark || err != nil {
		t.Fatalf("the restarted region's mark %q (%v): want a new one, not %q", m, err, mark)
	}
}

// TestOverrides_AClusterTakesTheQueueOnce: the holder's take of the
// region's override changes whose reply is lost after Redis ran it (the
// node stopped past the socket's timeout, within the call's deadline) is
// not sent again. go-redis's Cluster client sent it again, to the same
// node and then another, whatever MaxRetries says: the second run found
// the queue empty and answered it without an error, so the changes the
// first one popped reached MySQL and the other regions never. Now the
// take fails, and the caller takes every override next.
func TestOverrides_AClusterTakesTheQueueOnce(t *testing.T) {
	cl := redistest.StartCluster(t, 3)
	o := newOrigin(t, Config{Cluster: &ClusterConfig{Addrs: cl.Addrs()}}, Options{NodeID: "p"})
	// A take first, so that the node holds the script: a NOSCRIPT
	// reply runs nothing.
	if _, err := o.TakeOverrides(ctxT(t), false); err != nil {
		t.Fatal(err)
	}
	if _, err := o.PutOverrides(ctxT(t), []Override{{Field: "z cust", Version: 1, Value: "500"}}, true); err != nil {
		t.Fatal(err)
	}
	var got []Override
	var err error
	replyLost(t, cl, o, o.overridesKey(), func(ctx context.Context) {
		got, err = o.TakeOverrides(ctx, false)
	})
	if err == nil && len(got) == 0 {
		t.Fatalf("the take answered no change and no error: the change it popped is lost")
	}
	if err != nil {
		// What the caller does after a failed take: every override.
		all, err := o.TakeOverrides(ctxT(t), true)
		if err != nil || len(all) != 1 || all[0].Value != "500" {
			t.Fatalf("every override after the failed take: %+v (%v), want the change", all, err)
		}
	}
}
