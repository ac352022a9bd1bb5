package origin

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

func TestFlush_ExpiresTwoWindowsAfterTheCellEnds(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}, Prefix: "rl"}, Options{})
	for _, w := range []time.Duration{time.Second, time.Minute, time.Hour} {
		k := engine.Key{Namespace: "z", Identifier: "id", Window: w}
		seq := time.Now().UnixMilli() / w.Milliseconds()
		if err := o.Flush(ctxT(t), []engine.Delta{{Key: k, Sequence: seq, Delta: 1, Own: 1}}); err != nil {
			t.Fatalf("Flush: %v", err)
		}
		name := cellKey("rl", k, seq)
		at, err := srv.Client().Do(ctxT(t), "PEXPIRETIME", name).Int64()
		if err != nil {
			t.Fatalf("PEXPIRETIME %s: %v", name, err)
		}
		if want := (seq + 3) * w.Milliseconds(); at != want {
			t.Fatalf("window %s: key expires at %d, want %d (end of cell + 2 windows)", w, at, want)
		}
	}
}

// TestFlush_ReaddsOwnTotalsAfterRestartEmpty has two processes count in
// one cell, kills Redis, starts it again empty on the same port, and has
// both flush again: the cell ends up with each process's own total exactly
// once, nothing lost and nothing doubled.
func TestFlush_ReaddsOwnTotalsAfterRestartEmpty(t *testing.T) {
	srv := redistest.Start(t)
	a := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	b := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "b"})
	k, seq := key("bob"), nowSeq()

	// own tracks what each process's engine has committed to the cell.
	own := map[*Redis]int64{}
	// flush replays delta from p until it is Done, as the engine does with
	// items left not Done; a failed attempt that was applied behind our
	// back would show up as a doubled total below.
	flush := func(p *Redis, delta int64) engine.Delta {
		t.Helper()
		var d engine.Delta
		redistest.Eventually(t, 10*time.Second, "flush succeeds", func() bool {
			batch := []engine.Delta{{Key: k, Sequence: seq, Delta: delta, Own: own[p] + delta}}
			_ = p.Flush(ctxT(t), batch)
			d = batch[0]
			return d.Done
		})
		own[p] += delta
		return d
	}

	flush(a, 5)
	if d := flush(b, 3); d.Totals.Cur != 8 {
		t.Fatalf("before the restart: total %d, want 8", d.Totals.Cur)
	}

	srv.Restart()

	if d := flush(a, 2); d.Totals.Cur != 7 {
		t.Fatalf("a after the restart: total %d, want 7 (its 5 re-added once + 2)", d.Totals.Cur)
	}
	if d := flush(b, 1); d.Totals.Cur != 11 {
		t.Fatalf("b after the restart: total %d, want 11 (a's 7 + b's 3 re-added once + 1)", d.Totals.Cur)
	}
	c := srv.Client()
	if got, err := cellTotal(ctxT(t), c, DefaultPrefix, k, seq); err != nil || got != 11 {
		t.Fatalf("Redis holds %d (%v), want 11", got, err)
	}
	if got, err := c.HGetAll(ctxT(t), cellKey(DefaultPrefix, k, seq)).Result(); err != nil ||
		got["a.0"] != "7" || got["b.0"] != "4" || got["t"] != "11" || got["n"] != "2" || len(got) != 4 {
		t.Fatalf("cell %v (%v), want a=7 b=4, total 11, 2 records", got, err)
	}

	// Nothing doubles afterwards: the next deltas just add.
	flush(a, 1)
	if d := flush(b, 1); d.Totals.Cur != 13 {
		t.Fatalf("after recovery: total %d, want 13", d.Totals.Cur)
	}
	at, err := c.Do(ctxT(t), "PEXPIRETIME", cellKey(DefaultPrefix, k, seq)).Int64()
	if err != nil || at != (seq+3)*time.Minute.Milliseconds() {
		t.Fatalf("the cell made again after the restart expires at %d (%v), want the end of the cell + 2 windows", at, err)
	}
}

// TestFlush_OverlappingFlushesOfACellCountOnce has one process flush a
// cell twice at once, the later flush landing first. Each write carries the
// own total, so the later one brings the earlier one's units along and
// the earlier one, landing last, is a no-op: every unit counts once.
func TestFlush_OverlappingFlushesOfACellCountOnce(t *testing.T) {
	srv := redistest.Start(t)
	// Two origins under one node ID are one process's old and new origin
	// around a config reload, or simply two flushes of one origin.
	early := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "p"})
	late := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "p"})
	k, seq := key("erin"), nowSeq()

	entered, release := blockPipelines(early)
	first := []engine.Delta{{Key: k, Sequence: seq, Delta: 4, Own: 4}}
	done := make(chan error)
	go func() { done <- early.Flush(ctxT(t), first) }()
	<-entered

	second := []engine.Delta{{Key: k, Sequence: seq, Delta: 3, Own: 7}}
	if err := late.Flush(ctxT(t), second); err != nil || !second[0].Done || second[0].Totals.Cur != 7 {
		t.Fatalf("later flush: Done=%v Total=%d err=%v; want true, 7", second[0].Done, second[0].Totals.Cur, err)
	}
	close(release)
	if err := <-done; err != nil || !first[0].Done || first[0].Totals.Cur != 7 {
		t.Fatalf("earlier flush: Done=%v Total=%d err=%v; want true, 7 (a no-op)", first[0].Done, first[0].Totals.Cur, err)
	}
	// The same write again (a lost reply replayed) changes nothing.
	again := []engine.Delta{{Key: k, Sequence: seq, Delta: 3, Own: 7}}
	if err := late.Flush(ctxT(t), again); err != nil || again[0].Totals.Cur != 7 || again[0].Totals.Mine != 7 {
		t.Fatalf("replayed flush: totals %+v err=%v; want 7 and 7", again[0].Totals, err)
	}

	// A real shortfall (Redis lost 2 of this process's units) is repaired.
	if err := srv.Client().HSet(ctxT(t), cellKey(DefaultPrefix, k, seq), "p.0", 5).Err(); err != nil {
		t.Fatal(err)
	}
	third := []engine.Delta{{Key: k, Sequence: seq, Delta: 1, Own: 8}}
	if err := late.Flush(ctxT(t), third); err != nil || third[0].Totals.Cur != 10 {
		t.Fatalf("flush after a loss of 2: Total=%d err=%v; want 7+1+2 = 10", third[0].Totals.Cur, err)
	}
}

// TestPartitions_OneDeadPartitionFailsOnlyItsItems flushes across two
// partitions, one stopped: the live one's items are Done, the dead one's
// are not, and the error names the dead endpoint.
func TestPartitions_OneDeadPartitionFailsOnlyItsItems(t *testing.T) {
	live, dead := redistest.Start(t), redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{live.URL(), dead.URL()}}, Options{})
	dead.Stop()
	seq := nowSeq()
	var batch []engine.Delta
	for i := 0; i < 40; i++ {
		batch = append(batch, engine.Delta{Key: key(fmt.Sprintf("k%d", i)), Sequence: seq, Delta: 1, Own: 1})
	}
	err := o.Flush(ctxT(t), batch)
	if err == nil || !strings.Contains(err.Error(), dead.Addr()) || strings.Contains(err.Error(), live.Addr()) {
		t.Fatalf("Flush error %v: want one naming %s only", err, dead.Addr())
	}
	done, notDone := 0, 0
	for _, d := range batch {
		onLive := o.route(d.Key).address == o.endpoints[0].address
		if d.Done != onLive {
			t.Fatalf("%s: Done=%v but on live partition=%v", d.Key.Identifier, d.Done, onLive)
		}
		if d.Done {
			done++
		} else {
			notDone++
		}
	}
	if done == 0 || notDone == 0 {
		t.Fatalf("all %d keys on one partition; the test proves nothing", len(batch))
	}
}

// TestFlush_ManyCellsGoInChunksAndFailAlone flushes more cells than one
// script call carries, with hostile identifiers and one cell Redis refuses:
// every other cell is applied once with its own totals, in order.
func TestFlush_ManyCellsGoInChunksAndFailAlone(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "p"})
	seq := nowSeq()
	const n = 2*manyChunk + 22
	const bad = manyChunk + 5
	batch := make([]engine.Delta, n)
	for i := range batch {
		id := fmt.Sprintf("u %d:{x}%%\n\x00\xff", i)
		batch[i] = engine.Delta{Key: key(id), Sequence: seq, Delta: int64(i + 1), Own: int64(i + 1)}
		// Each previous cell holds its own count, and each cell 1000 units
		// of another process.
		if err := setCellTotal(ctxT(t), srv.Client(), DefaultPrefix, batch[i].Key, seq-1, 7*i); err != nil {
			t.Fatal(err)
		}
		if err := setCellTotal(ctxT(t), srv.Client(), DefaultPrefix, batch[i].Key, seq, 1000); err != nil {
			t.Fatal(err)
		}
	}
	if err := srv.Client().Set(ctxT(t), cellKey(DefaultPrefix, batch[bad].Key, seq), "not a number", 0).Err(); err != nil {
		t.Fatal(err)
	}
	for round := 0; round < 2; round++ { // the second flush is a replay: a no-op
		flushRefusingOne(t, o, batch, bad)
		for i, d := range batch {
			if i == bad {
				continue
			}
			want := engine.Totals{Cur: 1000 + int64(i+1), Prev: int64(7 * i), Mine: int64(i + 1), Shared: false, Processes: 1}
			if !d.Done || d.Totals != want {
				t.Fatalf("round %d, cell %d: done=%v totals %+v, want %+v", round, i, d.Done, d.Totals, want)
			}
		}
	}
	if st := o.Stats().Endpoints[0]; st.ReplayBreaker != BreakerClosed {
		t.Fatalf("a refused cell opened the replay breaker: %+v", st)
	}
}

// BenchmarkFlush is one replay batch of 256 distinct cells against a real
// Redis, the shape of a slow tick with many keys each touched once: the
// Caddy-side cost of replay per cell (ns/cell, allocs/op over 256), and
// Redis's own CPU per cell (redis-cpu-µs/cell, INFO cpu).
func BenchmarkFlush(b *testing.B) { benchmarkFlush(b, false) }

// BenchmarkFlushNoPrev is BenchmarkFlush once the process has the previous
// cells' final totals (a flush period into a window, so most warm writes):
// the writes leave the previous cells out.
func BenchmarkFlushNoPrev(b *testing.B) { benchmarkFlush(b, true) }

func benchmarkFlush(b *testing.B, noPrev bool) {
	srv := redistest.Start(b)
	o := newOrigin(b, Config{Redis: []string{srv.URL()}}, Options{NodeID: "bench"})
	const cells = 256
	seq := nowSeq()
	batch := make([]engine.Delta, cells)
	ks := make([]engine.Key, cells)
	for i := range ks {
		ks[i] = key("user-" + strconv.Itoa(1_000_000+i))
	}
	ctx := context.Background()
	own := int64(0)
	b.ReportAllocs()
	cpu0, redis0 := cpuTime(b), redisCPU(b, srv)
	for b.Loop() {
		own++
		for i := range batch {
			batch[i] = engine.Delta{Key: ks[i], Sequence: seq, Delta: 1, Own: own, NoPrev: noPrev}
		}
		if err := o.Flush(ctx, batch); err != nil {
			b.Fatal(err)
		}
		if !batch[cells-1].Done || batch[cells-1].Totals.Mine != own {
			b.Fatalf("last item: done=%v totals=%+v, want mine=%d", batch[cells-1].Done, batch[cells-1].Totals, own)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*cells), "ns/cell")
	// This process's CPU time alone: Redis runs the scripts in its own.
	b.ReportMetric(float64((cpuTime(b)-cpu0).Nanoseconds())/float64(b.N*cells), "cpu-ns/cell")
	b.ReportMetric((redisCPU(b, srv)-redis0).Seconds()*1e6/float64(b.N*cells), "redis-cpu-µs/cell")
}

// TestFlush_StoredCountsOfAnyFormComeBackAsCounts: the write script
// returns the numbers Redis holds as they are when they are plain decimal
// counts, without formatting them again. A field someone wrote in another
// form (spaces, an exponent, a sign, too many digits) comes back as the
// count Lua reads in it, clamped to 0..MaxCount, and one that is no number
// refuses its cell alone: the reply never carries a stored string that
// would shift or spoil the cells after it.
func TestFlush_StoredCountsOfAnyFormComeBackAsCounts(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "p"})
	seq := nowSeq()
	c := srv.Client()
	for _, tc := range []struct {
		stored string
		want   int64 // -1: the cell is refused
	}{
		{"12", 12}, {" 12", 12}, {"12 3 4", -1}, {"1e3", 1000}, {"-5", 0}, {"0x10", 16},
		{"99999999999999999999", engine.MaxCount}, {"abc", -1}, {"", -1},
	} {
		k := key("stored " + tc.stored)
		// The previous cell's total, and the current cell's total beside
		// this process's record, which the write leaves as it is.
		if err := setCellTotal(ctxT(t), c, DefaultPrefix, k, seq-1, tc.stored); err != nil {
			t.Fatal(err)
		}
		if err := c.HSet(ctxT(t), cellKey(DefaultPrefix, k, seq), "t", tc.stored, "p.0", "5", "n", "1").Err(); err != nil {
			t.Fatal(err)
		}
		batch := []engine.Delta{
			{Key: k, Sequence: seq, Own: 5},
			{Key: key("after " + tc.stored), Sequence: seq, Delta: 3, Own: 3},
		}
		err := o.Flush(ctxT(t), batch)
		if tc.want < 0 {
			if err == nil || batch[0].Done {
				t.Fatalf("stored %q: done=%v totals %+v, err %v; want the cell refused", tc.stored, batch[0].Done, batch[0].Totals, err)
			}
		} else {
			want := engine.Totals{Cur: tc.want, Prev: tc.want, Mine: 5, Processes: 1}
			if err != nil || !batch[0].Done || batch[0].Totals != want {
				t.Fatalf("stored %q: done=%v totals %+v, err %v; want %+v", tc.stored, batch[0].Done, batch[0].Totals, err, want)
			}
		}
		if want := (engine.Totals{Cur: 3, Mine: 3, Processes: 1}); !batch[1].Done || batch[1].Totals != want {
			t.Fatalf("stored %q: the next cell done=%v totals %+v, want %+v", tc.stored, batch[1].Done, batch[1].Totals, want)
		}
	}
}

// blockPipelines makes o's next pipeline wait until release is closed,
// after its flush has registered as in flight; entered is closed when it
// waits.
func blockPipelines(o *Redis) (entered, release chan struct{}) {
	entered, release = make(chan struct{}), make(chan struct{})
	var once sync.Once
	o.endpoints[0].client.AddHook(pipelineHook(func(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
		return func(ctx context.Context, cmds []redis.Cmder) error {
			once.Do(func() {
				close(entered)
				<-release
			})
			return next(ctx, cmds)
		}
	}))
	return entered, release
}

// pipelineHook is a go-redis hook of pipelines only.
type pipelineHook func(redis.ProcessPipelineHook) redis.ProcessPipelineHook

func (pipelineHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (pipelineHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (h pipelineHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return h(next)
}

// TestFlush_NoPrevLeavesThePreviousCellOut: a write that says it has the
// previous cell's final totals (engine.Delta.NoPrev) gets none back, and
// Redis runs one command less for it; one without reads it as before.
func TestFlush_NoPrevLeavesThePreviousCellOut(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "p"})
	k, seq := key("fern"), nowSeq()
	if err := o.Flush(ctxT(t), []engine.Delta{{Key: k, Sequence: seq - 1, Delta: 9, Own: 9}}); err != nil {
		t.Fatal(err)
	}
	commands := func() int64 {
		info, err := srv.Client().Info(ctxT(t), "stats").Result()
		if err != nil {
			t.Fatal(err)
		}
		_, rest, _ := strings.Cut(info, "total_commands_processed:")
		n, _ := strconv.ParseInt(strings.TrimSpace(strings.SplitN(rest, "\n", 2)[0]), 10, 64)
		return n
	}
	if err := o.Flush(ctxT(t), []engine.Delta{{Key: k, Sequence: seq, Delta: 1, Own: 1}}); err != nil {
		t.Fatal(err) // the cell exists: the writes below are warm
	}
	with := []engine.Delta{{Key: k, Sequence: seq, Delta: 1, Own: 2}}
	before := commands()
	if err := o.Flush(ctxT(t), with); err != nil || with[0].Totals.Prev != 9 {
		t.Fatalf("a write with the previous cell: totals %+v, err %v; want its 9", with[0].Totals, err)
	}
	withCost := commands() - before
	without := []engine.Delta{{Key: k, Sequence: seq, Delta: 1, Own: 3, NoPrev: true}}
	before = commands()
	if err := o.Flush(ctxT(t), without); err != nil || without[0].Totals.Prev != 0 || without[0].Totals.Cur != 3 {
		t.Fatalf("a write without: totals %+v, err %v; want the cell's 3 and no previous cell", without[0].Totals, err)
	}
	if got := commands() - before; got != withCost-1 {
		t.Fatalf("a write without the previous cell cost %d commands, with it %d: want one less", got, withCost)
	}
}

// BenchmarkFlushNewCells is a replay batch of 256 cells Redis has never
// seen, each with its previous cell read, the shape of one-off keys (a
// fresh process, per-IP limits): redis-cpu-µs/cell is Redis's own CPU per
// cell (INFO cpu), what caps how many new keys a second one Redis takes.
func BenchmarkFlushNewCells(b *testing.B) {
	srv := redistest.Start(b)
	o := newOrigin(b, Config{Redis: []string{srv.URL()}}, Options{NodeID: "bench"})
	const cells = 256
	seq := nowSeq()
	batch := make([]engine.Delta, cells)
	ctx := context.Background()
	n := 0
	cpu0 := redisCPU(b, srv)
	for b.Loop() {
		for i := range batch {
			n++
			batch[i] = engine.Delta{Key: key("ip-" + strconv.Itoa(n)), Sequence: seq, Delta: 1, Own: 1}
		}
		if err := o.Flush(ctx, batch); err != nil {
			b.Fatal(err)
		}
		if d := batch[cells-1]; !d.Done || d.Totals.Cur != 1 || d.Totals.Mine != 1 {
			b.Fatalf("last item: done=%v totals=%+v, want a new cell of 1", d.Done, d.Totals)
		}
	}
	b.ReportMetric((redisCPU(b, srv)-cpu0).Seconds()*1e6/float64(b.N*cells), "redis-cpu-µs/cell")
}

// TestFlush_RecordCountChangesOnlyWithANewRecord: a cell's record count
// (n, which tells a process the cell is shared) grows by one for each new
// process or incarnation that writes it, and a warm write, which leaves
// n out of its HSET, never changes it.
func TestFlush_RecordCountChangesOnlyWithANewRecord(t *testing.T) {
	srv := redistest.Start(t)
	url := srv.URL()
	p := newOrigin(t, Config{Redis: []string{url}}, Options{NodeID: "p"})
	q := newOrigin(t, Config{Redis: []string{url}}, Options{NodeID: "q"})
	k, seq := key("shared"), nowSeq()
	write := func(o *Redis, inc uint32, own int64, wantN string, wantShared bool) {
		t.Helper()
		batch := []engine.Delta{{Key: k, Sequence: seq, Delta: 1, Own: own, Incarnation: inc}}
		if err := o.Flush(ctxT(t), batch); err != nil || !batch[0].Done {
			t.Fatalf("flush: done=%v, err %v", batch[0].Done, err)
		}
		if batch[0].Totals.Shared != wantShared {
			t.Fatalf("totals %+v: shared %v, want %v", batch[0].Totals, batch[0].Totals.Shared, wantShared)
		}
		n, err := srv.Client().HGet(ctxT(t), cellKey(DefaultPrefix, k, seq), "n").Result()
		if err != nil || n != wantN {
			t.Fatalf("n = %q (%v), want %q", n, err, wantN)
		}
	}
	write(p, 0, 1, "1", false)
	write(p, 0, 2, "1", false)
	write(q, 0, 1, "2", true)
	write(p, 0, 3, "2", true)
	write(p, 0, 4, "2", true)
	write(p, 1, 1, "3", true) // p's next incarnation: a record of its own
	write(q, 0, 2, "3", true)
	if tot, err := cellTotal(ctxT(t), srv.Client(), DefaultPrefix, k, seq); err != nil || tot != 7 {
		t.Fatalf("t = %d (%v), want 7: every unit once", tot, err)
	}
}

// TestFlush_ChunkMixesCellsWithAndWithoutThePreviousCell: in one call, a
// cell that leaves its previous cell out names one key and one that reads
// it names two; each cell is written to its own key and gets its own
// previous cell's total, in any mix.
func TestFlush_ChunkMixesCellsWithAndWithoutThePreviousCell(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "p"})
	seq := nowSeq()
	batch := make([]engine.Delta, 12)
	for i := range batch {
		k := key("mix-" + strconv.Itoa(i))
		if err := setCellTotal(ctxT(t), srv.Client(), DefaultPrefix, k, seq-1, 100+i); err != nil {
			t.Fatal(err)
		}
		batch[i] = engine.Delta{Key: k, Sequence: seq, Delta: int64(i + 1), Own: int64(i + 1), NoPrev: i%3 != 0 && i != 11}
	}
	if err := o.Flush(ctxT(t), batch); err != nil {
		t.Fatal(err)
	}
	for i, d := range batch {
		want := engine.Totals{Cur: int64(i + 1), Mine: int64(i + 1), Processes: 1}
		if !d.NoPrev {
			want.Prev = int64(100 + i)
		}
		if !d.Done || d.Totals != want {
			t.Fatalf("cell %d (no previous cell: %v): done=%v totals %+v, want %+v", i, d.NoPrev, d.Done, d.Totals, want)
		}
		if got, err := cellTotal(ctxT(t), srv.Client(), DefaultPrefix, d.Key, seq); err != nil || got != int64(i+1) {
			t.Fatalf("cell %d in Redis: %d (%v), want %d", i, got, err, i+1)
		}
		if got, err := cellTotal(ctxT(t), srv.Client(), DefaultPrefix, d.Key, seq-1); err != nil || got != int64(100+i) {
			t.Fatalf("previous cell %d in Redis: %d (%v), want %d untouched", i, got, err, 100+i)
		}
	}
}

// TestFlush_ChunkRunAgainAfterARefusedCellRegistersAndCountsOnce: a chunk
// of new cells, some first writes and some reads (Own 0), with one cell
// Redis refuses in the middle. The script runs the chunk once under one
// protected call and, when a cell fails, again cell by cell, so the cells
// before the refused one run twice: each must still register this process
// once (n 1, not shared: a second registration would make a lone process
// look like two and send its key to the fast tick and reservations), add
// its units once, and set its expiry.
func TestFlush_ChunkRunAgainAfterARefusedCellRegistersAndCountsOnce(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "p"})
	seq := nowSeq()
	const n, bad = 20, 13
	batch := make([]engine.Delta, n)
	for i := range batch {
		own := int64(0)
		if i%2 == 0 {
			own = int64(i + 1)
		}
		batch[i] = engine.Delta{Key: key("again-" + strconv.Itoa(i)), Sequence: seq, Delta: own, Own: own}
	}
	c := srv.Client()
	if err := c.Set(ctxT(t), cellKey(DefaultPrefix, batch[bad].Key, seq), "a string", 0).Err(); err != nil {
		t.Fatal(err)
	}
	flushRefusingOne(t, o, batch, bad)
	for i, d := range batch {
		if i == bad {
			continue
		}
		want := engine.Totals{Cur: d.Own, Mine: d.Own, Processes: 1}
		if !d.Done || d.Totals != want {
			t.Fatalf("cell %d: done=%v totals %+v, want %+v (one process, its units once)", i, d.Done, d.Totals, want)
		}
		h := cellKey(DefaultPrefix, d.Key, seq)
		v, err := c.HMGet(ctxT(t), h, "n", "t").Result()
		if err != nil || v[0] != "1" || v[1] != strconv.FormatInt(d.Own, 10) {
			t.Fatalf("cell %d in Redis: n, t = %v (%v), want 1, %d", i, v, err, d.Own)
		}
		if ttl, err := c.PTTL(ctxT(t), h).Result(); err != nil || ttl <= 0 {
			t.Fatalf("cell %d: expiry %v (%v), want one set", i, ttl, err)
		}
	}
}

// flushRefusingOne flushes batch, whose cell bad Redis refuses (its key
// holds another type), and fails unless the flush reports that one cell
// and leaves it not done.
func flushRefusingOne(t *testing.T, o *Redis, batch []engine.Delta, bad int) {
	t.Helper()
	err := o.Flush(ctxT(t), batch)
	if err == nil || !strings.Contains(err.Error(), "refused 1 cells") {
		t.Fatalf("flush: %v, want the one refused cell reported", err)
	}
	if batch[bad].Done {
		t.Fatalf("the refused cell is marked done: %+v", batch[bad].Totals)
	}
}

// BenchmarkFlush_ProbeBehindATick: what another client's call waits at
// Redis while this process flushes one slow tick (16 batches of 256 warm
// cells), the batches sent together from eight goroutines (the replay
// loop's slow tier before 842aa88) or one after another (since then).
// Another node's reservation or cold read, on its request path, queues
// behind whatever Redis has read from the flushing connections; a probe
// sends PING on a connection of its own throughout each tick, and the
// benchmark reports the probe's median and longest wait (probe-p50-µs,
// probe-max-µs) and the tick's length (tick-ms).
func BenchmarkFlush_ProbeBehindATick(b *testing.B) {
	for _, tc := range []struct {
		name    string
		workers int
	}{{"together", 8}, {"one_at_a_time", 1}} {
		b.Run(tc.name, func(b *testing.B) {
			srv := redistest.Start(b)
			o := newOrigin(b, Config{Redis: []string{srv.URL()}}, Options{NodeID: "bench"})
			probe := srv.Client()
			const batches, cells = 16, 256
			seq := nowSeq()
			ticks := make([][]engine.Delta, batches)
			for j := range ticks {
				ticks[j] = make([]engine.Delta, cells)
			}
			ks := make([]engine.Key, batches*cells)
			for i := range ks {
				ks[i] = key("user-" + strconv.Itoa(1_000_000+i))
			}
			ctx := context.Background()
			var waits []time.Duration
			var tick time.Duration
			own := int64(0)
			for b.Loop() {
				own++
				for j, batch := range ticks {
					for i := range batch {
						batch[i] = engine.Delta{Key: ks[j*cells+i], Sequence: seq, Delta: 1, Own: own, NoPrev: true}
					}
				}
				done := make(chan struct{})
				probed := make(chan []time.Duration)
				go func() {
					var w []time.Duration
					for {
						select {
						case <-done:
							probed <- w
							return
						default:
						}
						t0 := time.Now()
						if err := probe.Ping(ctx).Err(); err != nil {
							b.Error(err)
						}
						w = append(w, time.Since(t0))
					}
				}()
				start := time.Now()
				next := make(chan []engine.Delta)
				var wg sync.WaitGroup
				for range tc.workers {
					wg.Go(func() {
						for batch := range next {
							if err := o.Flush(ctx, batch); err != nil {
								b.Error(err)
							}
						}
					})
				}
				for _, batch := range ticks {
					next <- batch
				}
				close(next)
				wg.Wait()
				tick += time.Since(start)
				close(done)
				waits = append(waits, <-probed...)
				if last := ticks[batches-1][cells-1]; !last.Done || last.Totals.Mine != own {
					b.Fatalf("last cell: done=%v totals=%+v, want mine=%d", last.Done, last.Totals, own)
				}
			}
			if len(waits) == 0 {
				b.Fatal("the probe made no call")
			}
			slices.Sort(waits)
			b.ReportMetric(float64(waits[len(waits)/2].Microseconds()), "probe-p50-µs")
			b.ReportMetric(float64(waits[len(waits)-1].Microseconds()), "probe-max-µs")
			b.ReportMetric(float64(tick.Milliseconds())/float64(b.N), "tick-ms")
		})
	}
}

// TestFlush_OutOfMemoryHoldsUnitsUntilRedisHasRoom: a Redis at its memory
// limit under noeviction refuses every write (OOM) and still answers
// reads. That is not one that is down: a cell it already holds is read
// as before, a new one is refused at once (no added latency), the
// breakers stay closed so that the units go as soon as there is room,
// the units stay pending (not Done), and the error says what may be
// the cause. With room again (a key expired, the limit raised), the
// next flush delivers them.
func TestFlush_OutOfMemoryHoldsUnitsUntilRedisHasRoom(t *testing.T) {
	srv := redistest.Start(t, redistest.WithArgs("--maxmemory-policy", "noeviction"))
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "oom"})
	ctx := context.Background()
	seq := nowSeq()
	warm, fresh := key("held"), key("new")
	if b := []engine.Delta{{Key: warm, Sequence: seq, Delta: 3, Own: 3}}; o.Flush(ctxT(t), b) != nil || !b[0].Done {
		t.Fatal("flush before the memory limit failed")
	}
	// Full: every write refused from now on.
	if err := srv.Client().ConfigSet(ctx, "maxmemory", "1").Err(); err != nil {
		t.Fatal(err)
	}
	for i := range 30 {
		b := []engine.Delta{{Key: warm, Sequence: seq, Delta: 1, Own: int64(4 + i)}, {Key: fresh, Sequence: seq, Delta: 1, Own: int64(1 + i)}}
		err := o.Flush(ctxT(t), b)
		if err == nil || !strings.Contains(err.Error(), "out of memory") || b[0].Done || b[1].Done {
			t.Fatalf("flush %d at the memory limit: %v, done %v %v; want both refused, naming memory", i, err, b[0].Done, b[1].Done)
		}
		start := time.Now()
		if err := requestRead(o, key(fmt.Sprint("cold", i)), seq); err == nil {
			t.Fatalf("a new cell was read (registered) at the memory limit")
		}
		if took := time.Since(start); took > engine.DefaultReadTimeout {
			t.Fatalf("a refused read took %s", took)
		}
		if cur, _, err := readPair(o, ctxT(t), warm, seq); err != nil || cur != 3 {
			t.Fatalf("read of a held cell at the memory limit: %d, %v; want 3", cur, err)
		}
	}
	if st := o.Stats().Endpoints[0]; st.Breaker != BreakerClosed || st.ReplayBreaker != BreakerClosed {
		t.Fatalf("breakers %s/%s at the memory limit; want both closed", st.Breaker, st.ReplayBreaker)
	}
	if err := srv.Client().ConfigSet(ctx, "maxmemory", "0").Err(); err != nil {
		t.Fatal(err)
	}
	b := []engine.Delta{{Key: warm, Sequence: seq, Delta: 1, Own: 33}, {Key: fresh, Sequence: seq, Delta: 1, Own: 30}}
	if err := o.Flush(ctxT(t), b); err != nil || !b[0].Done || !b[1].Done || b[0].Totals.Cur != 33 || b[1].Totals.Cur != 30 {
		t.Fatalf("flush with room again: %v, %+v", err, b)
	}
}
