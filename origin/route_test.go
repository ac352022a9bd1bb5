package origin

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

func TestRoute_IsStableAndIgnoresOrderAndCredentials(t *testing.T) {
	a, err := New(Config{Redis: []string{"redis://h1:1", "redis://h2:1", "redis://h3:1"}}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := New(Config{Redis: []string{"rediss://:pw@h3:1", "redis://h1:1/0", "redis://user@h2:1"}}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	for i := 0; i < 1000; i++ {
		k := engine.Key{Namespace: "z", Identifier: strings.Repeat("x", i%70) + string(rune('a'+i%26)), Window: time.Second}
		ea, eb := a.route(k), b.route(k)
		if ea.seed != eb.seed {
			t.Fatalf("%q routed to %s by one process and %s by another", k.Identifier, ea.address, eb.address)
		}
		k2 := k
		k2.Window = time.Hour
		if a.route(k2) != ea {
			t.Fatalf("%q: windows of one identifier on different partitions", k.Identifier)
		}
	}
}

// TestPartitions_RouteBothCellsOfAKeyToOneServer spreads keys over three
// partitions: both cells of a key sit on one server, every server gets a
// share, another process listing the partitions in another order agrees,
// and dropping a partition moves only that partition's keys.
func TestPartitions_RouteBothCellsOfAKeyToOneServer(t *testing.T) {
	srvs := []*redistest.Server{redistest.Start(t), redistest.Start(t), redistest.Start(t)}
	urls := []string{srvs[0].URL(), srvs[1].URL(), srvs[2].URL()}
	o := newOrigin(t, Config{Redis: urls}, Options{})
	seq := nowSeq()
	const keys = 300
	var batch []engine.Delta
	for i := 0; i < keys; i++ {
		k := key(fmt.Sprintf("tenant-%d", i))
		batch = append(batch,
			engine.Delta{Key: k, Sequence: seq - 1, Delta: int64(i + 1), Own: int64(i + 1)},
			engine.Delta{Key: k, Sequence: seq, Delta: int64(i + 1000), Own: int64(i + 1000)})
	}
	if err := o.Flush(ctxT(t), batch); err != nil {
		t.Fatalf("Flush: %v", err)
	}
	home := homes(t, srvs, keys, seq)
	share := make([]int, len(srvs))
	for _, s := range home {
		share[s]++
	}
	for s, n := range share {
		if n < keys/6 {
			t.Fatalf("server %d holds %d of %d keys: the hash does not spread (%v)", s, n, keys, share)
		}
	}

	reordered := newOrigin(t, Config{Redis: []string{urls[2], urls[0], urls[1]}}, Options{})
	for i := 0; i < keys; i++ {
		cur, prev, err := readPair(reordered, ctxT(t), key(fmt.Sprintf("tenant-%d", i)), seq)
		if err != nil || cur != int64(i+1000) || prev != int64(i+1) {
			t.Fatalf("tenant-%d through reordered partitions: %d, %d, %v", i, cur, prev, err)
		}
	}

	// Without partition 1, keys homed on 0 and 2 stay where they are.
	fewer := newOrigin(t, Config{Redis: []string{urls[0], urls[2]}}, Options{})
	for i := 0; i < keys; i++ {
		id := fmt.Sprintf("tenant-%d", i)
		if home[id] == 1 {
			continue
		}
		cur, _, err := readPair(fewer, ctxT(t), key(id), seq)
		if err != nil || cur != int64(i+1000) {
			t.Fatalf("%s (on server %d) moved when partition 1 left: %d, %v", id, home[id], cur, err)
		}
	}
}

// homes returns, for each of the keys tenant-0 … tenant-<keys−1>, the
// index of the one server of srvs that holds both its cells at seq and
// seq − 1; a cell elsewhere, or a key on several servers, fails t.
func homes(t *testing.T, srvs []*redistest.Server, keys int, seq int64) map[string]int {
	t.Helper()
	home := make(map[string]int) // identifier → server index
	for i := 0; i < keys; i++ {
		k := key(fmt.Sprintf("tenant-%d", i))
		holders := 0
		for s, srv := range srvs {
			n, err := srv.Client().Exists(ctxT(t), cellKey(DefaultPrefix, k, seq), cellKey(DefaultPrefix, k, seq-1)).Result()
			if err != nil {
				t.Fatal(err)
			}
			switch n {
			case 0:
			case 2:
				holders++
				home[k.Identifier] = s
			default:
				t.Fatalf("%s: server %d holds %d of its 2 cells", k.Identifier, s, n)
			}
		}
		if holders != 1 {
			t.Fatalf("%s: held by %d servers, want 1", k.Identifier, holders)
		}
	}
	return home
}

// TestPartitions_OneStoppedFailsOnlyItsKeysInTheEngine runs an engine on
// two partitions, one stopped. The engine kept one failing flag for the
// whole origin, which every call flipped: a read failing on the dead
// partition made a young cell of the live one decide locally, with no
// share of the last tenth kept for the region's other processes (no
// reservation for 300 requests at a limit of 1,000 in a region of four),
// and an answer of the live partition made a key of the dead one read it
// again at once, each request waiting on a read that fails (5 reads in 5
// decisions) instead of deciding locally until its retry.
func TestPartitions_OneStoppedFailsOnlyItsKeysInTheEngine(t *testing.T) {
	live, dead := redistest.Start(t), redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{live.URL(), dead.URL()}}, Options{})
	dead.Stop()
	onDead := func(k engine.Key) bool { return o.route(k).address == o.endpoints[1].address }
	var deadKeys, liveKeys []engine.Key
	for i := 0; len(deadKeys) < 2 || len(liveKeys) < 6; i++ {
		if k := key(fmt.Sprintf("tenant-%d", i)); onDead(k) {
			deadKeys = append(deadKeys, k)
		} else {
			liveKeys = append(liveKeys, k)
		}
	}
	clk := testclock.New(time.UnixMilli(windowStart(time.Minute)))
	e := engine.New(engine.Config{Now: clk.Now, Manual: true, ReadTimeout: 5 * time.Second})
	closeAtCleanup(t, e, 5*time.Second)
	e.SetOrigin(o)
	e.SetProcesses(4)
	ctx := ctxT(t)

	// A key of the dead partition, between answers of the live one.
	for _, k := range liveKeys[1:] {
		e.Decide(ctx, engine.Limit{Key: deadKeys[0], Limit: 10, Cost: 1})
		e.Decide(ctx, engine.Limit{Key: k, Limit: 10, Cost: 1})
	}
	if got := e.Stats().ReadErrors; got != 1 {
		t.Errorf("a key on a stopped partition read it %d times in 5 decisions within its cold read's retry; want 1", got)
	}

	// A young cell of the live partition, after a failure on the dead one,
	// past any suspect period.
	clk.Advance(2 * time.Second)
	l := engine.Limit{Key: liveKeys[0], Limit: 1000, Cost: 1}
	before := e.Stats().Reservations
	if !e.Decide(ctx, l).Allowed {
		t.Fatal("denied below the limit")
	}
	e.Decide(ctx, engine.Limit{Key: deadKeys[1], Limit: 10, Cost: 1}) // its read fails
	for range 299 {
		if !e.Decide(ctx, l).Allowed {
			t.Fatal("denied below the limit")
		}
	}
	if got := e.Stats().Reservations - before; got < 300/34 {
		t.Errorf("a young cell on the live partition sent %d reservations for 300 requests at a limit of 1,000 in a region of four, the other partition stopped; want one for every 33 units", got)
	}
}
