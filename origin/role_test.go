package origin

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

func TestRole_LeaseIsHeldByOneNodeAndPassesOn(t *testing.T) {
	srv := redistest.Start(t)
	a := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	b := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "b"})
	const ttl = 300 * time.Millisecond
	if ok, err := lease(t, a, ttl); err != nil || !ok {
		t.Fatalf("a takes the free lease: %v %v", ok, err)
	}
	if h, err := b.Lease(ctxT(t), ttl); err != nil || h != "a" {
		t.Fatalf("b's try names holder %q (%v), want a", h, err)
	}
	if ok, err := lease(t, a, ttl); err != nil || !ok {
		t.Fatalf("a renews: %v %v", ok, err)
	}
	if h, _ := b.LeaseHolder(ctxT(t)); h != "a" {
		t.Fatalf("holder %q, want a", h)
	}
	// a dies without releasing: b takes the role once the lease lapses.
	redistest.Eventually(t, 5*time.Second, "b takes the lapsed lease", func() bool {
		ok, err := lease(t, b, ttl)
		return err == nil && ok
	})
	if ok, _ := lease(t, a, ttl); ok {
		t.Fatal("a took the role back from b")
	}
	if err := b.ReleaseLease(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if ok, err := lease(t, a, ttl); err != nil || !ok {
		t.Fatalf("a takes the released lease at once: %v %v", ok, err)
	}
	if err := b.ReleaseLease(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if h, _ := a.LeaseHolder(ctxT(t)); h != "a" {
		t.Fatalf("a non-holder's release freed the lease: holder %q", h)
	}
}

// TestRole_ANodeOfAnotherRegionTakesNoLease: a node whose region line
// says another name than its Redis's other nodes took the role when it
// was free, and published that region's counts under its own name (an
// audit: eu's 60 units as us's row, and us's nodes, taking the row for
// their own, never counted them). While a node of one region holds the
// lease, a node of another gets *OtherRegionError and no lease; once the
// lease is free (released, or lapsed) either may take it.
func TestRole_ANodeOfAnotherRegionTakesNoLease(t *testing.T) {
	srv := redistest.Start(t)
	eu := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "eu1"})
	us := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "us1"})
	const ttl = 300 * time.Millisecond
	if h, err := eu.LeaseFor(ctxT(t), ttl, "eu", ""); err != nil || h != "eu1" {
		t.Fatalf("eu1 takes the free lease: %q %v", h, err)
	}
	var other *OtherRegionError
	if h, err := us.LeaseFor(ctxT(t), ttl, "us", ""); !errors.As(err, &other) || other.Holder != "eu" || other.Mine != "us" || h != "" {
		t.Fatalf("a node of us while eu holds the lease: %q %v, want an OtherRegionError naming eu", h, err)
	}
	if h, err := eu.LeaseFor(ctxT(t), ttl, "eu", ""); err != nil || h != "eu1" {
		t.Fatalf("eu1 renews: %q %v", h, err)
	}
	if err := eu.ReleaseLease(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if h, err := us.LeaseFor(ctxT(t), ttl, "us", ""); err != nil || h != "us1" {
		t.Fatalf("us1 takes the released lease: %q %v", h, err)
	}
	if _, err := eu.LeaseFor(ctxT(t), ttl, "eu", ""); !errors.As(err, &other) || other.Holder != "us" {
		t.Fatalf("eu1 while us1 holds the lease: %v, want an OtherRegionError naming us", err)
	}
	// us1 dies: its lease lapses, but its region stands for ten leases
	// (all of a region's nodes stopped, the other region's takes no role
	// of it), and then eu1 takes the role.
	start := time.Now()
	redistest.Eventually(t, 10*time.Second, "eu1 takes the role once us's region lapsed", func() bool {
		h, err := eu.LeaseFor(ctxT(t), ttl, "eu", "")
		return err == nil && h == "eu1"
	})
	if took := time.Since(start); took < 5*ttl {
		t.Fatalf("eu1 took the role %s after us1's last renewal, while us's region stood (%s)", took, regionHold*ttl)
	}
	// A node that names no region (a build before regions were checked)
	// sees the holder as before.
	if h, err := us.Lease(ctxT(t), ttl); err != nil || h != "eu1" {
		t.Fatalf("a node without a region: %q %v, want holder eu1", h, err)
	}
}

// TestRole_ANodeWritingToAnotherDatabaseTakesNoLease: a node of the region
// whose mysql line names another server or database than the holder's
// took the role when it was free and wrote the region's counts there,
// where the other regions, reading the first database, never saw them
// (an audit: a node on a second MariaDB took the role as the holder
// stopped, and another region admitted more after a burst of the
// limit). While a node writing to one database holds the lease, a node
// writing to another gets *OtherDatabaseError and no lease; a node of
// the same database, or one that names none (a build before this
// check), sees the holder; once the holder released the lease, either
// may take it.
func TestRole_ANodeWritingToAnotherDatabaseTakesNoLease(t *testing.T) {
	srv := redistest.Start(t)
	a1 := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a1"})
	a2 := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a2"})
	a3 := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a3"})
	const ttl = time.Minute
	first, second := "tcp(127.0.0.1:3306)/rl", "tcp(127.0.0.1:3307)/rl"
	if h, err := a1.LeaseFor(ctxT(t), ttl, "a", first); err != nil || h != "a1" {
		t.Fatalf("a1 takes the free lease: %q %v", h, err)
	}
	var other *OtherDatabaseError
	if h, err := a3.LeaseFor(ctxT(t), ttl, "a", second); !errors.As(err, &other) || other.Holder != first || other.Mine != second || h != "" {
		t.Fatalf("a node writing to %s while a1 holds the lease for %s: %q %v, want an OtherDatabaseError", second, first, h, err)
	}
	if h, err := a2.LeaseFor(ctxT(t), ttl, "a", first); err != nil || h != "a1" {
		t.Fatalf("a node of the same database: %q %v, want holder a1", h, err)
	}
	if h, err := a2.LeaseFor(ctxT(t), ttl, "a", ""); err != nil || h != "a1" {
		t.Fatalf("a node that names no database: %q %v, want holder a1", h, err)
	}
	if err := a1.ReleaseLease(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if h, err := a3.LeaseFor(ctxT(t), ttl, "a", second); err != nil || h != "a3" {
		t.Fatalf("a3 takes the released lease: %q %v", h, err)
	}
	if _, err := a1.LeaseFor(ctxT(t), ttl, "a", first); !errors.As(err, &other) || other.Holder != second {
		t.Fatalf("a1 while a3 holds the lease: %v, want an OtherDatabaseError naming %s", err, second)
	}
}

// lease tries o's lease and reports whether o holds it.
func lease(t *testing.T, o *Redis, ttl time.Duration) (bool, error) {
	h, err := o.Lease(ctxT(t), ttl)
	return h == o.NodeID(), err
}

func TestRole_RegistrationsAreQueuedOnceAndKeptForTheNextHolder(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "n"})
	now := time.Now().UnixMilli()
	cell := func(id string, limit, expires int64) RoleCell {
		return RoleCell{Key: engine.Key{Namespace: "z", Identifier: id, Window: time.Minute}, Sequence: 7, Limit: limit, Expires: expires}
	}
	if err := o.Register(ctxT(t), []RoleCell{cell("a:b{c}", 10, now+60_000), cell("old", 10, now-1)}); err != nil {
		t.Fatal(err)
	}
	if err := o.Register(ctxT(t), []RoleCell{cell("a:b{c}", 10, now+60_000)}); err != nil { // again: a no-op
		t.Fatal(err)
	}
	got, err := o.TakeRegistered(ctxT(t), false, now)
	if err != nil || len(got) != 1 || got[0] != cell("a:b{c}", 10, now+60_000) {
		t.Fatalf("queued registrations %+v (%v), want the live one once", got, err)
	}
	if got, _ := o.TakeRegistered(ctxT(t), false, now); len(got) != 0 {
		t.Fatalf("taken twice: %+v", got)
	}
	// The cell turning hot queues it again, hot.
	hot := cell("a:b{c}", 10, now+60_000)
	hot.Hot = true
	if err := o.Register(ctxT(t), []RoleCell{hot}); err != nil {
		t.Fatal(err)
	}
	if got, _ := o.TakeRegistered(ctxT(t), false, now); len(got) != 1 || got[0] != hot {
		t.Fatalf("after turning hot: %+v, want %+v", got, hot)
	}
	// A new limit queues the cell again; a new holder sees every live one.
	if err := o.Register(ctxT(t), []RoleCell{cell("a:b{c}", 20, now+60_000), cell("b", 5, now+60_000)}); err != nil {
		t.Fatal(err)
	}
	all, err := o.TakeRegistered(ctxT(t), true, now)
	slices.SortFunc(all, func(x, y RoleCell) int { return len(x.Key.Identifier) - len(y.Key.Identifier) })
	if err != nil || len(all) != 2 || all[0] != cell("b", 5, now+60_000) || all[1] != cell("a:b{c}", 20, now+60_000) {
		t.Fatalf("every registration %+v (%v)", all, err)
	}
	if n, _ := srv.Client().HLen(ctxT(t), o.shardKey("reg", shardOf(cellKey(o.prefix, cell("old", 0, 0).Key, 7)))).Result(); n != 0 {
		t.Fatalf("the expired registration is still held (%d fields in its shard)", n)
	}
}

func TestRole_DenialsStayUntilWrittenAndANewerOneIsKept(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "n"})
	k := engine.Key{Namespace: "z", Identifier: "burst", Window: time.Minute}
	first := RoleDenial{Key: k, Sequence: 3, Row: "row-1"}
	if err := o.PutDenials(ctxT(t), []RoleDenial{first}); err != nil {
		t.Fatal(err)
	}
	got, err := o.TakeDenials(ctxT(t))
	if err != nil || len(got) != 1 || got[0] != first {
		t.Fatalf("denials %+v (%v)", got, err)
	}
	// A newer denial of the cell lands while the holder writes the first.
	newer := RoleDenial{Key: k, Sequence: 3, Row: "row-2"}
	if err := o.PutDenials(ctxT(t), []RoleDenial{newer}); err != nil {
		t.Fatal(err)
	}
	if err := o.DenialsWritten(ctxT(t), got); err != nil {
		t.Fatal(err)
	}
	if got, _ := o.TakeDenials(ctxT(t)); len(got) != 1 || got[0] != newer {
		t.Fatalf("after writing the first: %+v, want the newer kept", got)
	}
	if err := o.DenialsWritten(ctxT(t), []RoleDenial{newer}); err != nil {
		t.Fatal(err)
	}
	if got, _ := o.TakeDenials(ctxT(t)); len(got) != 0 {
		t.Fatalf("written denials still held: %+v", got)
	}
}

// TestRole_ImportsReachEveryNodesRoundTrips: the holder raises a cell's
// imported count; every node's read (a cold one included) and write
// return it beside the region's total, and it never lowers.
func TestRole_ImportsReachEveryNodesRoundTrips(t *testing.T) {
	srv := redistest.Start(t)
	holder := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "h"})
	node := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "n"})
	k, seq := key("imported"), nowSeq()
	if err := holder.Import(ctxT(t), []RoleImport{{Key: k, Sequence: seq, Count: 40}, {Key: k, Sequence: seq - 1, Count: 9}}); err != nil {
		t.Fatal(err)
	}
	tot, err := node.Read(ctxT(t), k, seq, 1)
	if err != nil || tot.Global != 40 || tot.GlobalPrev != 9 || tot.Cur != 0 {
		t.Fatalf("cold read %+v (%v), want the imports 40 and 9", tot, err)
	}
	at, err := srv.Client().Do(ctxT(t), "PEXPIRETIME", cellKey(DefaultPrefix, k, seq)).Int64()
	if err != nil || at != expireAt(k, seq).UnixMilli() {
		t.Fatalf("an imported cell expires at %d (%v), want %d", at, err, expireAt(k, seq).UnixMilli())
	}
	if err := holder.Import(ctxT(t), []RoleImport{{Key: k, Sequence: seq, Count: 30}}); err != nil { // never lowers
		t.Fatal(err)
	}
	b := []engine.Delta{{Key: k, Sequence: seq, Incarnation: 1, Delta: 5, Own: 5}}
	if err := node.Flush(ctxT(t), b); err != nil || b[0].Totals.Global != 40 || b[0].Totals.Cur != 5 {
		t.Fatalf("write %+v (%v), want total 5 beside the import 40", b[0].Totals, err)
	}
	totals, err := holder.CellTotals(ctxT(t), []RoleCell{{Key: k, Sequence: seq}, {Key: key("none"), Sequence: seq}})
	if err != nil || !slices.Equal(totals, []CellTotal{{Count: 5}, {}}) {
		t.Fatalf("totals %v (%v), want the region's 5 (never the import) and 0", totals, err)
	}
}

// BenchmarkImport is the holder's import of 64 cells a call against a
// real Redis: the sum of that many foreign regions' counts, and (_parts)
// every region's part as well, as for a cell some region reset, whose
// cost grows with the regions. redis-cpu-µs/cell is the Redis server's CPU
// time per cell (INFO cpu), what the holder's flush costs the region's
// Redis.
func BenchmarkImport(b *testing.B) {
	for _, bc := range []struct {
		regions int
		parts   bool
	}{{2, false}, {200, false}, {2, true}, {20, true}, {200, true}} {
		regions, parts := bc.regions, bc.parts
		name := strconv.Itoa(regions) + "regions"
		if parts {
			name += "_parts"
		}
		b.Run(name, func(b *testing.B) {
			srv := redistest.Start(b)
			o := newOrigin(b, Config{Redis: []string{srv.URL()}}, Options{NodeID: "bench"})
			const cells = 64
			seq := nowSeq()
			ims := make([]RoleImport, cells)
			for i := range ims {
				ims[i] = RoleImport{Key: key("imported-" + strconv.Itoa(i)), Sequence: seq}
				if parts {
					ims[i].Parts = make([]ImportPart, regions)
				}
			}
			ctx := context.Background()
			n := int64(0)
			cpu0 := redisCPU(b, srv)
			for b.Loop() {
				n++
				for i := range ims {
					ims[i].Count = n * int64(regions)
					for r := range ims[i].Parts {
						ims[i].Parts[r] = ImportPart{Region: "region-" + strconv.Itoa(r), Count: n, ResetVersion: 1}
					}
				}
				if err := o.Import(ctx, ims); err != nil {
					b.Fatal(err)
				}
			}
			cpu := redisCPU(b, srv) - cpu0
			if tot, err := o.Read(ctx, ims[0].Key, seq, 0); err != nil || tot.Global != n*int64(regions) {
				b.Fatalf("the cell imports %d (%v), want %d", tot.Global, err, n*int64(regions))
			}
			b.ReportMetric(cpu.Seconds()*1e6/float64(b.N*cells), "redis-cpu-µs/cell")
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N*cells), "µs/cell")
		})
	}
}

// redisCPU is the Redis server's CPU time so far (INFO cpu, user + system).
func redisCPU(b *testing.B, srv *redistest.Server) time.Duration {
	b.Helper()
	info, err := srv.Client().Info(context.Background(), "cpu").Result()
	if err != nil {
		b.Fatal(err)
	}
	var total float64
	for _, line := range strings.Split(info, "\n") {
		for _, f := range []string{"used_cpu_user:", "used_cpu_sys:"} {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), f); ok {
				x, err := strconv.ParseFloat(v, 64)
				if err != nil {
					b.Fatal(err)
				}
				total += x
			}
		}
	}
	return time.Duration(total * float64(time.Second))
}

// TestRole_TheHolderTakesEveryShardInOneRoundTrip: the registry and the
// denials are sixteen keys each, which the holder reads on every flush;
// read one after another they took sixteen round trips each (about 5 ms
// of a flush's 11 on loopback, more across a network), which the next
// flush and every count it carries waited for. Each take is one pipeline
// now, and the queued registrations' values one more.
func TestRole_TheHolderTakesEveryShardInOneRoundTrip(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.StartDelayProxy(t, srv.Addr(), 0)
	o := newOrigin(t, Config{Redis: []string{proxy.URL()}}, Options{NodeID: "n"})
	now := time.Now().UnixMilli()
	var cells []RoleCell
	var denials []RoleDenial
	shards := map[int]bool{}
	for i := 0; len(shards) < 4; i++ {
		k := engine.Key{Namespace: "z", Identifier: "k" + strconv.Itoa(i), Window: time.Minute}
		cells = append(cells, RoleCell{Key: k, Sequence: 7, Limit: 10, Expires: now + 60_000})
		denials = append(denials, RoleDenial{Key: k, Sequence: 7, Row: "row-" + strconv.Itoa(i)})
		shards[shardOf(cellKey(o.prefix, k, 7))] = true
	}
	if err := o.Register(ctxT(t), cells); err != nil {
		t.Fatal(err)
	}
	if err := o.PutDenials(ctxT(t), denials); err != nil {
		t.Fatal(err)
	}
	for _, step := range []struct {
		name       string
		roundTrips int64
		take       func() (int, error)
	}{
		{"the queued registrations", 2, func() (int, error) { got, err := o.TakeRegistered(ctxT(t), false, now); return len(got), err }},
		{"every registration", 1, func() (int, error) { got, err := o.TakeRegistered(ctxT(t), true, now); return len(got), err }},
		{"the denials", 1, func() (int, error) { got, err := o.TakeDenials(ctxT(t)); return len(got), err }},
	} {
		before := proxy.Sent()
		n, err := step.take()
		if err != nil || n != len(cells) {
			t.Fatalf("%s: %d of %d cells (%v)", step.name, n, len(cells), err)
		}
		if trips := proxy.Sent() - before; trips > step.roundTrips {
			t.Errorf("%s over %d shards took %d round trips, want %d", step.name, len(shards), trips, step.roundTrips)
		}
	}
}

// TestRole_TakesSpanAClustersNodes: the shards' keys lie on different
// masters of a Cluster, and one pipeline of the takes reaches them all.
func TestRole_TakesSpanAClustersNodes(t *testing.T) {
	cl := redistest.StartCluster(t, 3)
	o := newOrigin(t, Config{Cluster: &ClusterConfig{Addrs: cl.Addrs()}}, Options{NodeID: "n"})
	now := time.Now().UnixMilli()
	var cells []RoleCell
	var denials []RoleDenial
	for i := range 40 {
		k := engine.Key{Namespace: "z", Identifier: "k" + strconv.Itoa(i), Window: time.Minute}
		cells = append(cells, RoleCell{Key: k, Sequence: 7, Limit: 10, Expires: now + 60_000})
		denials = append(denials, RoleDenial{Key: k, Sequence: 7, Row: "row-" + strconv.Itoa(i)})
	}
	if err := o.Register(ctxT(t), cells); err != nil {
		t.Fatal(err)
	}
	if err := o.PutDenials(ctxT(t), denials); err != nil {
		t.Fatal(err)
	}
	if got, err := o.TakeRegistered(ctxT(t), false, now); err != nil || len(got) != len(cells) {
		t.Fatalf("queued registrations: %d of %d (%v)", len(got), len(cells), err)
	}
	if got, err := o.TakeRegistered(ctxT(t), false, now); err != nil || len(got) != 0 {
		t.Fatalf("queued registrations taken twice: %d (%v)", len(got), err)
	}
	if got, err := o.TakeRegistered(ctxT(t), true, now); err != nil || len(got) != len(cells) {
		t.Fatalf("every registration: %d of %d (%v)", len(got), len(cells), err)
	}
	if got, err := o.TakeDenials(ctxT(t)); err != nil || len(got) != len(denials) {
		t.Fatalf("denials: %d of %d (%v)", len(got), len(denials), err)
	}
}
