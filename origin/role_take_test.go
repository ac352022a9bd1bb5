package origin

import (
	"strconv"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// TestRole_AQueuedTakeReportsAShardsFailedPop: one pipeline pops every
// shard's queue, and go-redis reports the first command's error of a
// pipeline, redis.Nil for an empty queue. A pop that failed in a later
// shard (a Cluster's node that timed out after it popped, here a
// WRONGTYPE) was read as an empty queue: the take answered nil, and the
// propagation, which reads every registration after a take that failed,
// never learnt that registrations may have been popped unread.
func TestRole_AQueuedTakeReportsAShardsFailedPop(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "n"})
	now := time.Now().UnixMilli()
	// A registration in some shard s > 0, shard 0 left empty (its pop
	// answers redis.Nil, first in the pipeline).
	var c RoleCell
	s := 0
	for i := 0; s == 0; i++ {
		k := engine.Key{Namespace: "z", Identifier: "k" + strconv.Itoa(i), Window: time.Minute}
		c = RoleCell{Key: k, Sequence: 7, Limit: 10, Expires: now + 60_000}
		s = shardOf(cellKey(o.prefix, k, 7))
	}
	if err := o.Register(ctxT(t), []RoleCell{c}); err != nil {
		t.Fatal(err)
	}
	// Another shard's queue answers an error.
	bad := s%(roleShards-1) + 1
	if err := srv.Client().Set(ctxT(t), o.shardKey("reg", bad)+":q", "x", 0).Err(); err != nil {
		t.Fatal(err)
	}
	got, err := o.TakeRegistered(ctxT(t), false, now)
	if err == nil {
		t.Fatalf("a take with shard %d's pop failed answered %d cells and no error", bad, len(got))
	}
}
