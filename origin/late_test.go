package origin

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
)

// lateSteps are the writes of TestFlush_ALateWriteReachesProcessesThatSettled:
// process b has the previous cell's final totals and leaves it out of its
// writes (NoPrev), until a of its region, back from a while without Redis,
// writes its units of that cell late.
var lateSteps = []struct {
	who         string
	seq         int64 // relative to the current cell
	own         int64
	noPrev      bool
	late        bool
	wantCur     int64
	wantPrev    int64 // what the answer carries of the cell before
	description string
}{
	{"b", 0, 2, false, false, 2, 0, "b reads the previous cell with its write"},
	{"b", 0, 3, true, false, 3, 0, "b has settled it: its writes leave it out"},
	{"a", -1, 4, true, true, 4, 0, "a's units of the previous cell arrive late"},
	{"b", 0, 5, true, false, 5, 4, "b's next write carries the late units"},
	{"b", 0, 5, true, false, 5, 4, "and so does every write after it"},
	{"a", 0, 1, true, true, 6, 4, "a late write into the current cell marks the next one"},
	{"b", 1, 2, true, false, 2, 6, "whose writes then carry the current cell"},
	{"b", 2, 7, true, false, 7, 0, "a cell no late write marked: left out again"},
	{"a", 2, 1, true, true, 8, 0, "a late write marks a cell nothing wrote yet"},
}

// TestFlush_ALateWriteReachesProcessesThatSettled: a write of a process
// that the others' settled view of the previous cell misses (engine.Delta
// Late) marks the next cell, and every write to a marked cell, whatever its
// NoPrev, answers with the previous cell's totals, on a Redis, a Redis
// Cluster (the marked cell and the one the script derives share a slot),
// and the simulator's model of Redis, which must agree with both.
func TestFlush_ALateWriteReachesProcessesThatSettled(t *testing.T) {
	seq := nowSeq()
	k := key("late:{x}")
	run := func(t *testing.T, flush func(who string, b []engine.Delta) error) {
		t.Helper()
		for i, s := range lateSteps {
			b := []engine.Delta{{Key: k, Sequence: seq + s.seq, Own: s.own, Delta: 1, NoPrev: s.noPrev, Late: s.late}}
			if err := flush(s.who, b); err != nil || !b[0].Done {
				t.Fatalf("step %d (%s): %v, done %v", i, s.description, err, b[0].Done)
			}
			if got := b[0].Totals; got.Cur != s.wantCur || got.Prev != s.wantPrev {
				t.Fatalf("step %d (%s): totals %+v, want the cell's %d and the previous cell's %d",
					i, s.description, got, s.wantCur, s.wantPrev)
			}
		}
	}
	onRedis := func(t *testing.T, cfg Config, c redis.UniversalClient) {
		a := newOrigin(t, cfg, Options{NodeID: "a"})
		b := newOrigin(t, cfg, Options{NodeID: "b"})
		run(t, func(who string, batch []engine.Delta) error {
			if who == "a" {
				return a.Flush(ctxT(t), batch)
			}
			return b.Flush(ctxT(t), batch)
		})
		// A cell a mark made expires with the late cell that marked it,
		// until a write of its own gives it the cell's expiry.
		ctx := ctxT(t)
		for _, w := range []struct {
			seq     int64
			marked  bool
			expires int64 // the sequence whose expiry it has
		}{{seq - 1, false, seq - 1}, {seq, true, seq}, {seq + 1, true, seq + 1}, {seq + 2, false, seq + 2}, {seq + 3, true, seq + 2}} {
			h := cellKey(DefaultPrefix, k, w.seq)
			v, err := c.HGet(ctx, h, "l").Result()
			if (!w.marked && err != redis.Nil) || (w.marked && v != "1") {
				t.Fatalf("cell %d's mark: %q (%v), want marked %v", w.seq-seq, v, err, w.marked)
			}
			at, err := c.PExpireTime(ctx, h).Result()
			if want := expireAt(k, w.expires).UnixMilli(); err != nil || at.Milliseconds() != want {
				t.Fatalf("cell %d expires at %d (%v), want %d", w.seq-seq, at.Milliseconds(), err, want)
			}
		}
	}
	t.Run("redis", func(t *testing.T) {
		srv := redistest.Start(t)
		onRedis(t, Config{Redis: []string{srv.URL()}}, srv.Client())
	})
	t.Run("cluster", func(t *testing.T) {
		cl := redistest.StartCluster(t, 3)
		c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs()})
		t.Cleanup(func() { _ = c.Close() })
		onRedis(t, Config{Cluster: &ClusterConfig{Addrs: cl.Addrs()}}, c)
	})
	t.Run("model", func(t *testing.T) {
		m := simmodel.NewRedis(func() int64 { return 0 }, 1, simmodel.Link{}, simmodel.DefaultTimeouts)
		a, b := m.Origin("a"), m.Origin("b")
		run(t, func(who string, batch []engine.Delta) error {
			if who == "a" {
				return a.Flush(context.Background(), batch)
			}
			return b.Flush(context.Background(), batch)
		})
	})
}
