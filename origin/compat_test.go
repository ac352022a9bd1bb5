package origin

import (
	"fmt"
	"os"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// TestFlush_OldAndNewScriptsShareACell: during a rolling deploy, processes
// of the build before a change of the write script and of this one write
// the same cells on one Redis, each with its own script (loaded by its own
// SHA). The earlier script is kept as it was released
// (testdata/cells_2e0b310.lua) and sent the arguments a flush sends. Each
// process must count its units once, register once, get the same totals
// for the cell, and find a replay of its own a no-op, whichever script
// wrote last.
func TestFlush_OldAndNewScriptsShareACell(t *testing.T) {
	text, err := os.ReadFile("testdata/cells_2e0b310.lua")
	if err != nil {
		t.Fatal(err)
	}
	old := redis.NewScript(string(text))
	srv := redistest.Start(t)
	c := srv.Client()
	newer := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "new"})
	older := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "old"})
	seq := nowSeq()
	ks := []engine.Key{key("deploy-a"), key("deploy-b{x}\n")}
	for i, k := range ks {
		if err := setCellTotal(ctxT(t), c, DefaultPrefix, k, seq-1, 40+i); err != nil {
			t.Fatal(err)
		}
	}
	if err := old.Load(ctxT(t), c).Err(); err != nil {
		t.Fatal(err)
	}
	// oldWrite is a flush of every cell by a process of the earlier build.
	oldWrite := func(own int64) []engine.Totals {
		t.Helper()
		args := older.endpoints[0].manyArgs(old, "", len(ks), func(i int) (engine.Key, int64, cellFlags) {
			return ks[i], seq, withPrev
		}, func(b []byte, i int) []byte {
			return fmt.Appendf(b, "0 %d %d", own, expireAt(ks[i], seq).UnixMilli())
		})
		reply, err := c.Do(ctxT(t), args...).Text()
		if err != nil {
			t.Fatalf("the earlier script: %v", err)
		}
		got := make([]engine.Totals, len(ks))
		if refused := parseMany(reply, len(ks), func(i int, tot engine.Totals) { got[i] = tot }); refused > 0 {
			t.Fatalf("the earlier script refused %d cells: %q", refused, reply)
		}
		return got
	}
	newWrite := func(own int64) []engine.Totals {
		t.Helper()
		batch := make([]engine.Delta, len(ks))
		for i, k := range ks {
			batch[i] = engine.Delta{Key: k, Sequence: seq, Own: own}
		}
		if err := newer.Flush(ctxT(t), batch); err != nil {
			t.Fatal(err)
		}
		got := make([]engine.Totals, len(ks))
		for i, d := range batch {
			if !d.Done {
				t.Fatalf("cell %d not done", i)
			}
			got[i] = d.Totals
		}
		return got
	}
	for _, step := range []struct {
		who       string
		own       int64
		cur, mine int64
		shared    bool
	}{
		{"new", 3, 3, 3, false},
		{"old", 5, 8, 5, true},
		{"new", 4, 9, 4, true},
		{"old", 5, 9, 5, true}, // a replay: nothing to add
		{"old", 7, 11, 7, true},
		{"new", 4, 11, 4, true}, // a replay after the other script wrote
		{"new", 6, 13, 6, true},
	} {
		write := newWrite
		if step.who == "old" {
			write = oldWrite
		}
		for i, got := range write(step.own) {
			want := engine.Totals{Cur: step.cur, Prev: int64(40 + i), Mine: step.mine, Shared: step.shared, Processes: 1}
			if step.shared {
				want.Processes = 2
			}
			if got != want {
				t.Fatalf("%s writes %d, cell %d: %+v, want %+v", step.who, step.own, i, got, want)
			}
		}
	}
	for _, k := range ks {
		v, err := c.HMGet(ctxT(t), cellKey(DefaultPrefix, k, seq), "t", "n", "new.0", "old.0").Result()
		if err != nil || fmt.Sprint(v) != "[13 2 6 7]" {
			t.Fatalf("cell %q in Redis: t, n and the records %v (%v), want [13 2 6 7]", k.Identifier, v, err)
		}
	}
}
