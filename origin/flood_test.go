package origin

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

// TestFlood_EveryKeyWrittenExpiresAndStaysSmall floods a real Redis,
// through an engine, with hostile identifiers: huge, binary, laden with
// the key's separators and braces, and near-collisions of one another.
// Each key is taken past its limit, so that it is read, written, and
// decided at Redis (strict mode). Every key the flood leaves in Redis has
// an expiry, its name stays short whatever the identifier, no two
// identifiers share a key, and the flood costs Redis a bounded number of
// commands per request.
func TestFlood_EveryKeyWrittenExpiresAndStaysSmall(t *testing.T) {
	srv := redistest.Start(t)
	// On a clock that stays inside one window: a write sent a tick
	// after its cell's window ended also marks the next cell (a late
	// write), so a flood that a window edge cut, under load, left more
	// cells than identifiers (2148 for 1800 once in a run of every
	// package at once).
	clk := testclock.New(time.UnixMilli(windowStart(time.Minute) + 1000))
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "flood", Now: clk.Now})
	e := engine.New(engine.Config{Now: clk.Now, Manual: true, ReadTimeout: 2 * time.Second})
	e.SetOrigin(o)
	closeAtCleanup(t, e, 5*time.Second)
	rdb := srv.Client()
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()

	huge := strings.Repeat("x", 1<<16)
	var ids []string
	for i := range 300 {
		n := strconv.Itoa(i)
		ids = append(ids,
			huge+n,                               // hashed
			"\x00\xff\x01"+n,                     // binary
			"a:b}{c:"+n,                          // separators and braces
			"a:b}{c"+n,                           // one colon less
			"{api:"+n+"}:60000:1:c",              // shaped like a key
			"#"+strings.Repeat("0", 64-len(n))+n, // shaped like a hash
		)
	}
	// Script calls are the module's commands (their own commands count
	// apart in INFO): a cold key's read, a batch's write, a reservation.
	scriptCalls := func() int64 {
		info, err := rdb.Info(ctx, "commandstats").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(info, "\r\n") {
			if v, ok := strings.CutPrefix(l, "cmdstat_evalsha:calls="); ok {
				n, _ := strconv.ParseInt(v[:strings.IndexByte(v, ',')], 10, 64)
				return n
			}
		}
		return 0
	}
	before := scriptCalls()
	requests := 0
	for _, id := range ids {
		l := engine.Limit{Key: engine.Key{Namespace: "api", Identifier: id, Window: time.Minute}, Limit: 2, Cost: 1}
		for range 3 {
			e.Decide(ctx, l)
			requests++
		}
	}
	for _, tier := range []engine.Tier{engine.Fast, engine.Slow} {
		if _, err := e.ReplayOnce(ctx, tier); err != nil {
			t.Fatal(err)
		}
	}
	// A read per new key (the first of its three requests), then writes
	// in batches: one script call per cold key and a few more.
	if n := scriptCalls() - before; n > int64(len(ids)+len(ids)/10) {
		t.Fatalf("%d script calls for %d requests on %d new keys", n, requests, len(ids))
	}

	cells := 0
	iter := rdb.Scan(ctx, 0, "*", 1000).Iterator()
	for iter.Next(ctx) {
		k := iter.Val()
		if len(k) > 200 {
			t.Errorf("key of %d bytes: %.80q…", len(k), k)
		}
		ttl, err := rdb.PTTL(ctx, k).Result()
		if err != nil {
			t.Fatal(err)
		}
		if ttl < 0 {
			t.Errorf("key %.80q has no expiry (PTTL %v)", k, ttl)
		}
		if strings.HasSuffix(k, ":c") {
			cells++
		}
	}
	if err := iter.Err(); err != nil {
		t.Fatal(err)
	}
	if cells != len(ids) {
		t.Fatalf("%d cells in Redis for %d identifiers: some share a key", cells, len(ids))
	}
}
