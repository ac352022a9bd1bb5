package origin

import (
	"context"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
)

func TestReserve_AdmitsExactlyToTheLimitAcrossProcesses(t *testing.T) {
	srv := redistest.Start(t)
	a := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	b := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "b"})
	k, seq := key("frank"), nowSeq()
	own := map[*Redis]int64{}
	var admitted atomic.Int64
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, o := range []*Redis{a, b} {
		for g := 0; g < 4; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; i < 40; i++ {
					mu.Lock()
					r := reservation(k, seq, own[o], 1, 100)
					mu.Unlock()
					if err := o.Reserve(ctxT(t), r); err != nil {
						t.Error(err)
						return
					}
					if r.Admitted {
						admitted.Add(1)
						mu.Lock()
						own[o]++
						mu.Unlock()
					}
				}
			}()
		}
	}
	wg.Wait()
	if n := admitted.Load(); n != 100 {
		t.Fatalf("admitted %d of 320 at a limit of 100", n)
	}
	cur, _, err := readPair(a, ctxT(t), k, seq)
	if err != nil || cur != 100 {
		t.Fatalf("Redis holds %d (%v), want 100", cur, err)
	}
}

func TestReserve_IsIdempotentAndCarriesPendingUnits(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "p"})
	k, seq := key("grace"), nowSeq()
	// 7 units committed locally and not yet replayed ride along with the
	// reservation of one more.
	r := reservation(k, seq, 7, 1, 10)
	if err := o.Reserve(ctxT(t), r); err != nil || !r.Admitted || r.Totals.Cur != 8 || r.Totals.Mine != 8 {
		t.Fatalf("reserve: %+v err=%v; want admitted, 8, 8", r, err)
	}
	// A replay of the same units afterwards (the flush that was already
	// out) is a no-op.
	d := []engine.Delta{{Key: k, Sequence: seq, Delta: 7, Own: 7}}
	if err := o.Flush(ctxT(t), d); err != nil || d[0].Totals.Cur != 8 {
		t.Fatalf("replayed flush: %+v err=%v; want total 8", d[0].Totals, err)
	}
	// Denied: the pending part still lands, the cost does not.
	r = reservation(k, seq, 10, 3, 10)
	if err := o.Reserve(ctxT(t), r); err != nil || r.Admitted || r.Totals.Cur != 10 {
		t.Fatalf("reserve over the limit: %+v err=%v; want denied at 10", r, err)
	}
}

func TestReserve_WeighsThePreviousCellAndImportedCounts(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "p"})
	k, seq := key("heidi"), nowSeq()
	if err := o.Flush(ctxT(t), []engine.Delta{{Key: k, Sequence: seq - 1, Delta: 40, Own: 40}}); err != nil {
		t.Fatal(err)
	}
	w := k.Window.Milliseconds()
	for _, c := range []struct {
		elapsed, imported, importedPrev int64
		want                            bool
	}{
		{elapsed: w / 2, want: true},                     // 20 + 1 ≤ 21
		{elapsed: w / 4, want: false},                    // 30 + 1 > 21
		{elapsed: w / 2, imported: 1, want: false},       // 1 + 20 + 1 > 21
		{elapsed: w / 2, importedPrev: 2, want: false},   // 21 + 1 > 21
		{elapsed: w - 1, importedPrev: 1000, want: true}, // weighs 1040/60000
		// ⌊40 × 30750/60000⌋ = ⌊20.5⌋ = 20: the previous cell's weight is
		// rounded down, as the engine rounds it (exactly, 21.5 + 1 > 21).
		{elapsed: w * 4875 / 10000, want: true},
		{elapsed: w*4875/10000 - 1, importedPrev: 1, want: false}, // ⌊41 × 30751/60000⌋ = 21
	} {
		r := reservation(k, seq, 0, 1, 21)
		r.Elapsed, r.Global, r.GlobalPrev = c.elapsed, c.imported, c.importedPrev
		if err := o.Reserve(ctxT(t), r); err != nil {
			t.Fatal(err)
		}
		if r.Admitted != c.want {
			t.Fatalf("%+v: admitted %v, want %v", c, r.Admitted, c.want)
		}
		if r.Totals.Prev != 40 {
			t.Fatalf("previous total %d, want 40", r.Totals.Prev)
		}
		if r.Admitted { // give the unit back for the next case
			if err := srv.Client().Del(ctxT(t), cellKey(DefaultPrefix, k, seq)).Err(); err != nil {
				t.Fatal(err)
			}
		}
	}
}

func TestReserve_HugeValuesSaturateAndNeverPassFree(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "p"})
	k, seq := key("ivan"), nowSeq()
	r := reservation(k, seq, engine.MaxCount, 0, engine.MaxCount)
	if err := o.Reserve(ctxT(t), r); err != nil || r.Totals.Cur != engine.MaxCount {
		t.Fatalf("own at the ceiling: %+v err=%v", r.Totals, err)
	}
	r = reservation(k, seq, engine.MaxCount, engine.MaxCount, engine.MaxCount)
	if err := o.Reserve(ctxT(t), r); err != nil || r.Admitted || r.Totals.Cur != engine.MaxCount {
		t.Fatalf("a huge cost at the ceiling: %+v err=%v; want denied, saturated", r, err)
	}
	got, err := cellTotal(ctxT(t), srv.Client(), DefaultPrefix, k, seq)
	if err != nil || got != engine.MaxCount {
		t.Fatalf("Redis holds %d (%v), want %d", got, err, engine.MaxCount)
	}
	for _, bad := range []*engine.Reservation{
		reservation(k, seq, 0, math.MaxInt64, 10),
		reservation(k, seq, 0, -1, 10),
		reservation(k, seq, math.MaxInt64, 1, 10),
	} {
		if err := o.Reserve(ctxT(t), bad); err == nil || bad.Admitted {
			t.Fatalf("out-of-range reservation %+v accepted", bad)
		}
	}
}

// BenchmarkReserve is one reservation round trip against a real Redis.
func BenchmarkReserve(b *testing.B) {
	srv := redistest.Start(b)
	o := newOrigin(b, Config{Redis: []string{srv.URL()}}, Options{NodeID: "bench"})
	k, seq := key("bench"), nowSeq()
	ctx := context.Background()
	own := int64(0)
	b.ReportAllocs()
	for b.Loop() {
		r := reservation(k, seq, own, 1, engine.MaxCount)
		if err := o.Reserve(ctx, r); err != nil || !r.Admitted {
			b.Fatalf("reserve: %v admitted=%v", err, r.Admitted)
		}
		own++
	}
}

// TestReserve_JoinedCostsAreDecidedInOrder: one call decides the costs of
// the requests that joined it after its own, each against the count the
// ones before it left, and charges exactly those it admits.
func TestReserve_JoinedCostsAreDecidedInOrder(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	k, seq := key("grace"), nowSeq()
	// Another process holds 6 units of a limit of 10.
	if err := setCellTotal(ctxT(t), srv.Client(), DefaultPrefix, k, seq, 6); err != nil {
		t.Fatal(err)
	}
	r := reservation(k, seq, 0, 1, 10)
	r.Joined = []int64{2, 2, 1, 0}
	if err := o.Reserve(ctxT(t), r); err != nil {
		t.Fatal(err)
	}
	// 6 + 1 = 7, + 2 = 9, + 2 would be 11 (refused), + 1 = 10, + 0 = 10.
	want := []bool{true, false, true, true}
	if !r.Admitted || len(r.JoinedAdmitted) != len(want) {
		t.Fatalf("admitted %v, joined %v", r.Admitted, r.JoinedAdmitted)
	}
	for i := range want {
		if r.JoinedAdmitted[i] != want[i] {
			t.Fatalf("joined verdicts %v, want %v", r.JoinedAdmitted, want)
		}
	}
	if r.Totals.Cur != 10 || r.Totals.Mine != 4 {
		t.Fatalf("totals %+v, want the cell at 10 with 4 units of this process", r.Totals)
	}
	cur, _, err := readPair(o, ctxT(t), k, seq)
	if err != nil || cur != 10 {
		t.Fatalf("Redis holds %d (%v), want 10", cur, err)
	}
	// A joined cost out of range is refused before anything is sent.
	bad := reservation(k, seq, 4, 1, 10)
	bad.Joined = []int64{-1}
	if err := o.Reserve(ctxT(t), bad); err == nil {
		t.Fatal("a negative joined cost was sent")
	}
}

// TestReserve_ARequestWhoseClientLeftIsNoRedisFailure: a client that
// disconnects while its request waits for the key's first read from Redis.
// The request is still decided, and near the limit of a shared key that is
// a reservation: sent under the request's cancelled context, it failed
// before it left, and the client's leaving was counted as a failed Redis
// call (outcome error, the engine's reservation errors) and set the engine
// failing, which changes how every key decides until Redis next answers.
// The reservation now runs within the decision's deadline whether or not
// the client is still there: the requests that joined it are decided by it
// too. The clock stands still: on the wall clock the cell grew up (see
// engine's cell.heard) when the client took more than two fast ticks to
// leave, as on a loaded CI machine, and the next request was decided
// locally, its unit not yet at Redis; and the window could turn between
// the decisions and the check of Redis.
func TestReserve_ARequestWhoseClientLeftIsNoRedisFailure(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.StartDelayProxy(t, srv.Addr(), 0)
	var failed atomic.Int64
	clk := testclock.New(time.UnixMilli(windowStart(time.Minute) + 1000))
	o := newOrigin(t, Config{Redis: []string{proxy.URL()}}, Options{NodeID: "left", Now: clk.Now, OnCall: func(c CallInfo) {
		if (c.Op == OpReserve || c.Op == OpRead) && c.Outcome != OutcomeOK {
			failed.Add(1)
		}
	}})
	// A read timeout far above the proxy's delay, so that only the
	// client's leaving ends the wait.
	e := engine.New(engine.Config{Now: clk.Now, Manual: true, ReadTimeout: 5 * time.Second, Freshness: time.Hour})
	e.SetOrigin(o)
	e.SetProcesses(2) // a young cell near a limit of 10 is decided at Redis
	closeAtCleanup(t, e, 5*time.Second)
	l := engine.Limit{Key: key("left"), Zone: e.Zone("api", time.Minute), Limit: 10, Cost: 1}
	commands := func() int64 {
		s, err := srv.CommandStats(ctxT(t))
		if err != nil {
			t.Fatal(err)
		}
		var n int64
		for _, c := range s {
			n += c
		}
		return n
	}
	before := commands()

	proxy.SetDelay(300 * time.Millisecond)
	ctx, leave := context.WithCancel(context.Background())
	defer leave()
	decided := make(chan engine.Decision)
	go func() { decided <- e.Decide(ctx, l) }()
	redistest.Eventually(t, 5*time.Second, "the key's read reached Redis", func() bool { return commands() > before })
	leave() // the client disconnects while the read's reply is on its way
	d := <-decided
	proxy.SetDelay(0)

	if !d.Allowed {
		t.Fatalf("the request whose client left: %+v, want allowed", d)
	}
	if n := failed.Load(); n != 0 {
		t.Fatalf("%d origin calls counted as failed, want 0", n)
	}
	if s := e.Stats(); s.ReservationErrors != 0 || s.ReservationsAdmitted != 1 {
		t.Fatalf("engine: %d reservations admitted, %d reservation errors; want 1, 0", s.ReservationsAdmitted, s.ReservationErrors)
	}
	if d := e.Decide(ctxT(t), l); !d.Allowed {
		t.Fatalf("the next request: %+v, want allowed", d)
	}
	if cur, _, err := readPair(o, ctxT(t), l.Key, clk.UnixMilli()/time.Minute.Milliseconds()); err != nil || cur != 2 {
		t.Fatalf("Redis holds %d (%v), want 2", cur, err)
	}
}

// TestReserve_AClusterRunsAReservationOnce: a reservation whose reply is
// lost after Redis ran it (here the node is stopped past the socket's
// timeout, within the call's deadline; a connection closed under the reply
// is another way) is not sent again. go-redis's Cluster client sends such
// a command again, to the same node and then another, whatever MaxRetries
// says, and each run of the script charges its cost: the region counted
// the request twice.
func TestReserve_AClusterRunsAReservationOnce(t *testing.T) {
	cl := redistest.StartCluster(t, 3)
	o := newOrigin(t, Config{Cluster: &ClusterConfig{Addrs: cl.Addrs()}}, Options{NodeID: "p"})
	k, seq := key("once"), nowSeq()
	if r := reservation(k, seq, 0, 1, 10); o.Reserve(ctxT(t), r) != nil || !r.Admitted {
		t.Fatalf("first reservation: %+v", r)
	}
	replyLost(t, cl, o, cellKey(DefaultPrefix, k, seq), func(ctx context.Context) {
		o.Reserve(ctx, reservation(k, seq, 1, 1, 10))
	})
	// Redis ran the script of the lost reply, and charged it: one unit
	// more, never two.
	cur, _, err := readPair(o, ctxT(t), k, seq)
	if err != nil || cur > 2 {
		t.Fatalf("Redis holds %d (%v) after two reservations of one unit, one of them answered late; want at most 2", cur, err)
	}
}
