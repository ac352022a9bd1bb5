package propagation

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
)

// memRegion is a region's shared state in memory, standing in for the
// origin's role API (whose own tests run on a real Redis): the layer's
// own interface, implemented for the layer's tests. The lease lapses on
// the tests' clock.
type memRegion struct {
	mu       sync.Mutex
	clk      *clock
	holder   string
	until    int64
	reg      map[Cell]RegionCell
	queue    []Cell
	denials  map[Cell]BlocklistRow
	totals   map[Cell]RegionTotal // the region's totals, as the test sets them
	imported map[Cell]int64
	parts    map[Cell]map[string]ImportPart // the newest part of each region
	// resetHere are the cells the region reset: an import without parts
	// wants them, as origin's does.
	resetHere map[Cell]bool
}

func newMemRegion(clk *clock) *memRegion {
	return &memRegion{clk: clk, reg: map[Cell]RegionCell{}, denials: map[Cell]BlocklistRow{},
		totals: map[Cell]RegionTotal{}, imported: map[Cell]int64{}, parts: map[Cell]map[string]ImportPart{},
		resetHere: map[Cell]bool{}}
}

// memNode is one node's handle on a memRegion.
type memNode struct {
	*memRegion
	id string
}

func (n memNode) NodeID() string { return n.id }

func (n memNode) Lease(_ context.Context, ttl time.Duration) (string, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	now := n.clk.ms.Load()
	if n.holder == "" || n.holder == n.id || now >= n.until {
		n.holder, n.until = n.id, now+ttl.Milliseconds()
	}
	return n.holder, nil
}

func (n memNode) ReleaseLease(context.Context) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.holder == n.id {
		n.holder = ""
	}
	return nil
}

func (n memNode) Register(_ context.Context, cells []RegionCell) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, c := range cells {
		if n.reg[c.Cell] != c {
			n.reg[c.Cell] = c
			n.queue = append(n.queue, c.Cell)
		}
	}
	return nil
}

func (n memNode) TakeRegistered(_ context.Context, all bool, now int64) ([]RegionCell, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []RegionCell
	if all {
		for _, c := range n.reg {
			out = append(out, c)
		}
	} else {
		for _, c := range n.queue {
			out = append(out, n.reg[c])
		}
	}
	n.queue = nil
	return out, nil
}

func (n memNode) PutDenials(_ context.Context, rows []BlocklistRow) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, r := range rows {
		n.denials[r.cell()] = r
	}
	return nil
}

func (n memNode) TakeDenials(context.Context) ([]BlocklistRow, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []BlocklistRow
	for _, r := range n.denials {
		out = append(out, r)
	}
	return out, nil
}

func (n memNode) DenialsWritten(_ context.Context, rows []BlocklistRow) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, r := range rows {
		if n.denials[r.cell()] == r {
			delete(n.denials, r.cell())
		}
	}
	return nil
}

func (n memNode) Totals(_ context.Context, cells []Cell) ([]RegionTotal, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	out := make([]RegionTotal, len(cells))
	for i, c := range cells {
		out[i] = n.totals[c]
	}
	return out, nil
}

func (n memNode) Import(_ context.Context, ims []RegionImport) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	for i, im := range ims {
		if im.Parts == nil && n.resetHere[im.Cell] {
			ims[i].WantsParts = true
			continue
		}
		n.imported[im.Cell] = max(n.imported[im.Cell], im.Count)
		if n.parts[im.Cell] == nil {
			n.parts[im.Cell] = map[string]ImportPart{}
		}
		for _, p := range im.Parts {
			n.parts[im.Cell][p.Region] = p
		}
	}
	return nil
}

func (r *memRegion) setTotal(id string, n int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.totals[Cell{"z", id, window.Milliseconds(), seq0}] = RegionTotal{Count: n}
}

func (r *memRegion) importedOf(id string) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.imported[Cell{"z", id, window.Milliseconds(), seq0}]
}

// countingStore counts the statements a process sends MySQL, fails its
// writes on demand (a holder that dies between taking and writing), and
// slows or stalls every statement on demand: slow delays each (a slow
// MySQL), hang holds each until its context ends (a MySQL that accepts
// and answers nothing). With leaseEnd set it keeps by how much the
// latest statement's deadline passed the holder's lease as it stood.
type countingStore struct {
	Store
	statements atomic.Int64
	failWrites atomic.Bool
	hang       atomic.Bool
	slow       time.Duration
	leaseEnd   func() time.Time
	pastLease  atomic.Int64 // ns
	// before, if set, runs before each statement.
	before func()
}

var errDown = errors.New("the holder died before this write")

// stall slows or holds a statement, as set.
func (s *countingStore) stall(ctx context.Context) error {
	if s.before != nil {
		s.before()
	}
	if d, ok := ctx.Deadline(); ok && s.leaseEnd != nil {
		if past := d.Sub(s.leaseEnd()); past > 0 {
			s.pastLease.Store(max(s.pastLease.Load(), int64(past)))
		}
	}
	if s.slow > 0 {
		select {
		case <-time.After(s.slow): // the scenario: MySQL answers this late
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if !s.hang.Load() {
		return nil
	}
	<-ctx.Done()
	return ctx.Err()
}

func (s *countingStore) UpsertDenials(ctx context.Context, rows []*BlocklistRow) error {
	s.statements.Add(1)
	if err := s.stall(ctx); err != nil {
		return err
	}
	if s.failWrites.Load() {
		return errDown
	}
	return s.Store.UpsertDenials(ctx, rows)
}

func (s *countingStore) UpsertCounts(ctx context.Context, rows []*CountRow) error {
	s.statements.Add(1)
	if err := s.stall(ctx); err != nil {
		return err
	}
	if s.failWrites.Load() {
		return errDown
	}
	return s.Store.UpsertCounts(ctx, rows)
}

func (s *countingStore) ReadDenials(ctx context.Context, r Read) ([]BlocklistRow, error) {
	s.statements.Add(1)
	if err := s.stall(ctx); err != nil {
		return nil, err
	}
	return s.Store.ReadDenials(ctx, r)
}

func (s *countingStore) ReadCounts(ctx context.Context, r Read) ([]CountRow, error) {
	s.statements.Add(1)
	if err := s.stall(ctx); err != nil {
		return nil, err
	}
	return s.Store.ReadCounts(ctx, r)
}

func (s *countingStore) UpsertOverrides(ctx context.Context, rows []*OverrideRow) error {
	s.statements.Add(1)
	if err := s.stall(ctx); err != nil {
		return err
	}
	if s.failWrites.Load() {
		return errDown
	}
	return s.Store.(OverrideStore).UpsertOverrides(ctx, rows)
}

func (s *countingStore) ReadOverrides(ctx context.Context, r Read) ([]OverrideRow, error) {
	s.statements.Add(1)
	if err := s.stall(ctx); err != nil {
		return nil, err
	}
	return s.Store.(OverrideStore).ReadOverrides(ctx, r)
}

// A countingStore carries overrides as the store it wraps does: one that
// lacked a method of OverrideStore was no OverrideStore, and the
// propagators on it silently carried none.
var _ OverrideStore = (*countingStore)(nil)

func (s *countingStore) MarkResetCounts(ctx context.Context, region, namespace, identifier string, ver int64) (int64, error) {
	s.statements.Add(1)
	if err := s.stall(ctx); err != nil {
		return 0, err
	}
	if s.failWrites.Load() {
		return 0, errDown
	}
	return s.Store.(OverrideStore).MarkResetCounts(ctx, region, namespace, identifier, ver)
}

func (s *countingStore) DeleteExpired(ctx context.Context, t Table, now int64, chunk int) (int64, error) {
	s.statements.Add(1)
	if err := s.stall(ctx); err != nil {
		return 0, err
	}
	return s.Store.DeleteExpired(ctx, t, now, chunk)
}

// regionNode is a node of a region with Redis (mem), its store counted.
type regionNode struct {
	*region
	store *countingStore
}

func (s *setup) regionNode(name, id string, mem *memRegion) *regionNode {
	s.t.Helper()
	return s.regionNodeWith(name, memNode{mem, id})
}

// regionNodeOn is a node n1 of mem whose handle carries overrides too.
func (s *setup) regionNodeOn(name string, mem *memRegion, reg *resetRegion) *regionNode {
	s.t.Helper()
	reg.memNode = memNode{mem, "n1"}
	return s.regionNodeWith(name, reg)
}

// regionNodeWith is a node of a region reached through reg.
func (s *setup) regionNodeWith(name string, reg Region, mod ...func(*Config)) *regionNode {
	s.t.Helper()
	eng := engine.New(engine.Config{Now: s.clk.Now, Manual: true})
	eng.Zone("z", window)
	cfg := Config{DSN: s.dsn, Region: name, Batch: 100, Timeout: 5 * time.Second}
	for _, m := range mod {
		m(&cfg)
	}
	cfg = cfg.WithDefaults()
	sql, _, err := openStore(cfg, zap.NewNop())
	if err != nil {
		s.t.Fatal(err)
	}
	store := &countingStore{Store: sql}
	p := s.start(eng, cfg, Options{Now: s.clk.Now, Region: reg, Store: store})
	store.statements.Store(0)
	return &regionNode{region: &region{eng: eng, p: p}, store: store}
}

// TestRole_OneNodeTalksToMySQLForItsRegion: of a region's three nodes one
// holds the role; it publishes the region's total of a cell the others
// registered, writes the denial row another left, and hands what another
// region counted to the region; the other two send MySQL nothing.
func TestRole_OneNodeTalksToMySQLForItsRegion(t *testing.T) {
	s := newSetup(t)
	mem := newMemRegion(s.clk)
	nodes := []*regionNode{s.regionNode("a", "n1", mem), s.regionNode("a", "n2", mem), s.regionNode("a", "n3", mem)}
	b := s.region("b")
	nodes[1].decide("k", 100, 30)
	nodes[2].decide("k", 100, 30)
	mem.setTotal("k", 60) // what the region's Redis would hold
	nodes[2].decide("burst", 10, 11)
	b.decide("k", 100, 55)
	b.p.FlushOnce(bg)
	for _, n := range nodes {
		n.p.FlushOnce(bg)
		n.p.GlobalSyncOnce(bg) // k, at 30 % in each node's view, is published at the sync
	}
	for _, n := range nodes {
		n.p.FlushOnce(bg)
	}
	holders := 0
	for i, n := range nodes {
		st := n.p.Stats()
		if st.Role == "holder" {
			holders++
			continue
		}
		if st.Role != "member" || st.Holder != "n1" || n.store.statements.Load() != 0 {
			t.Fatalf("node %d: role %q, holder %q, %d statements; want a member of n1's role that sends MySQL nothing",
				i+1, st.Role, st.Holder, n.store.statements.Load())
		}
	}
	if holders != 1 || nodes[0].p.Stats().Role != "holder" {
		t.Fatalf("%d holders, want n1 alone", holders)
	}
	db := mysqltest.Open(t, s.dsn)
	var count int64
	if err := db.QueryRow(`SELECT count FROM ratelimit_global_counts WHERE region = 'a' AND identifier = 'k'`).Scan(&count); err != nil || count != 60 {
		t.Fatalf("region a's row of k: %d (%v), want the region's 60", count, err)
	}
	if n := countRows(t, s.dsn, "ratelimit_blocklist", "WHERE origin_region = 'a'"); n != 1 {
		t.Fatalf("%d denial rows of region a, want n3's one", n)
	}
	if got := mem.importedOf("k"); got != 55 {
		t.Fatalf("the region holds %d imported for k, want b's 55", got)
	}
}

// TestRole_TheNextHolderWritesWhatTheDeadOneTook: the holder takes a
// registration and a denial row, and dies before writing them. Once its
// lease lapses, another node takes the role and writes both: nothing
// taken is lost.
func TestRole_TheNextHolderWritesWhatTheDeadOneTook(t *testing.T) {
	s := newSetup(t)
	mem := newMemRegion(s.clk)
	n1, n2 := s.regionNode("a", "n1", mem), s.regionNode("a", "n2", mem)
	n1.p.FlushOnce(bg) // n1 holds the role
	n2.decide("k", 100, 60)
	n2.decide("burst", 10, 11)
	mem.setTotal("k", 60)
	n2.p.FlushOnce(bg) // registers k, leaves the denial row
	n1.store.failWrites.Store(true)
	n1.p.FlushOnce(bg) // takes both, writes neither: it dies here
	if n := countRows(t, s.dsn, "ratelimit_global_counts", "") + countRows(t, s.dsn, "ratelimit_blocklist", ""); n != 0 {
		t.Fatalf("%d rows written by a holder whose writes fail", n)
	}
	n2.p.FlushOnce(bg)
	if st := n2.p.Stats(); st.Role != "member" {
		t.Fatalf("n2 took the role while n1's lease runs: %+v", st.Role)
	}
	s.clk.Add(n1.p.leaseTTL())
	n2.p.FlushOnce(bg)
	if st := n2.p.Stats(); st.Role != "holder" || st.RoleTaken != 1 {
		t.Fatalf("n2 after n1's lease lapsed: role %q, taken %d", st.Role, st.RoleTaken)
	}
	if n := countRows(t, s.dsn, "ratelimit_global_counts", "WHERE identifier = 'k' AND count = 60"); n != 1 {
		t.Fatal("the new holder did not publish the cell the dead one took")
	}
	if n := countRows(t, s.dsn, "ratelimit_blocklist", "WHERE identifier = 'burst'"); n != 1 {
		t.Fatal("the new holder did not write the denial row the dead one took")
	}
}

// timedNode is a memNode that keeps when its last lease call began, and
// counts them.
type timedNode struct {
	memNode
	asked  atomic.Int64 // Unix ns
	leases atomic.Int64
}

func (n *timedNode) Lease(ctx context.Context, ttl time.Duration) (string, error) {
	n.asked.Store(time.Now().UnixNano())
	n.leases.Add(1)
	return n.memNode.Lease(ctx, ttl)
}

// leaseNode is a node of a region on real time's lease bookkeeping:
// flushes every 20 ms, queries bounded by 300 ms, so the lease (3 ×
// mysql_flush + mysql_timeout) is 360 ms and two stalled queries outlast
// it. Its store reports any statement whose deadline passed the lease as
// last renewed. It holds k at its limit, the region's total with it: a
// count worth publishing.
func (s *setup) leaseNode() (*regionNode, *timedNode) {
	node := &timedNode{memNode: memNode{newMemRegion(s.clk), "n1"}}
	n := s.regionNodeWith("a", node, func(c *Config) {
		c.Flush = 20 * time.Millisecond
		c.Timeout = 300 * time.Millisecond
	})
	lease := n.p.leaseTTL()
	if lease >= 2*n.p.cfg.Timeout {
		s.t.Fatalf("lease %v: the test needs two queries' timeouts to outlast it", lease)
	}
	n.store.leaseEnd = func() time.Time { return time.Unix(0, node.asked.Load()).Add(lease) }
	n.decide("k", s.limit, int(s.limit))
	node.setTotal("k", s.limit)
	return n, node
}

// TestRole_AStalledFlushNeverRunsPastItsLease: MySQL accepts the holder's
// statements and answers none. Each waits mysql_timeout, and a flush has
// several, so the flush once outlasted the lease it renewed at its start:
// another node took the role, and both talked to MySQL for the region
// until the first flush returned. Now no statement may run past the
// holder's lease as it stands when the statement starts.
func TestRole_AStalledFlushNeverRunsPastItsLease(t *testing.T) {
	s := newSetup(t)
	n1, node := s.leaseNode()
	n1.store.hang.Store(true)
	n1.p.FlushOnce(bg)
	if got := n1.store.statements.Load(); got < 2 {
		t.Fatalf("the flush sent %d statements, want several to stall", got)
	}
	if n1.p.role.Load() != roleHolder {
		t.Fatal("n1 did not take the role")
	}
	if past := time.Duration(n1.store.pastLease.Load()); past > 0 {
		t.Fatalf("a statement of the stalled flush could run %v past the holder's lease (%v, renewed %d times)",
			past, n1.p.leaseTTL(), node.leases.Load()-1)
	}
	if r := n1.p.Stats().LeaseRenewals; r == 0 {
		t.Fatal("the stalled flush never renewed its lease: it cannot have kept it")
	}
}

// TestRole_ASlowFlushKeepsItsLeaseAndFinishes: MySQL answers each
// statement 150 ms late, so a flush of several takes longer than the lease.
// The holder renews the lease as it goes, keeps the role, and every
// statement succeeds: a flush is never cut short by its own lease while
// the region's Redis renews it (a whole read of many pages on a slow
// MySQL would otherwise never finish).
func TestRole_ASlowFlushKeepsItsLeaseAndFinishes(t *testing.T) {
	s := newSetup(t)
	n1, _ := s.leaseNode()
	n1.store.slow = 150 * time.Millisecond
	start := time.Now()
	n1.p.FlushOnce(bg)
	took := time.Since(start)
	st := n1.p.Stats()
	if took <= n1.p.leaseTTL() {
		t.Fatalf("the flush took %v, within the lease (%v): the scenario needs it longer", took, n1.p.leaseTTL())
	}
	if st.ReadErrors != 0 || st.WriteErrors != 0 || st.RoleLost != 0 {
		t.Fatalf("a slow flush failed: %d read errors, %d write errors, role lost %d times", st.ReadErrors, st.WriteErrors, st.RoleLost)
	}
	if st.CountsPublished != 1 || st.LeaseRenewals == 0 {
		t.Fatalf("published %d counts with %d renewals, want the count published and the lease renewed", st.CountsPublished, st.LeaseRenewals)
	}
	if past := time.Duration(n1.store.pastLease.Load()); past > 0 {
		t.Fatalf("a statement could run %v past the holder's lease", past)
	}
}

// TestRole_AFlushStopsWhenItsRoleIsGone: during a slow flush the
// holder's lease lapses and another node takes the role. The renewal
// before the next statement finds it gone: the flush sends MySQL nothing
// more, and what it leaves undone counts as no error of MySQL's (the
// breaker stays closed, nothing is counted dropped).
func TestRole_AFlushStopsWhenItsRoleIsGone(t *testing.T) {
	s := newSetup(t)
	n1, node := s.leaseNode()
	n1.store.slow = 150 * time.Millisecond
	var sent atomic.Int64
	n1.store.before = func() {
		if sent.Add(1) == 1 { // n1 holds the role: its lease lapses, n2 takes it
			s.clk.Add(n1.p.leaseTTL() + time.Millisecond)
			if h, _ := (memNode{node.memRegion, "n2"}).Lease(bg, n1.p.leaseTTL()); h != "n2" {
				t.Errorf("n2 could not take the lapsed role: %q holds it", h)
			}
		}
	}
	n1.p.FlushOnce(bg)
	st := n1.p.Stats()
	if got := sent.Load(); got != 1 {
		t.Fatalf("n1 sent MySQL %d statements, want only the one before it lost the role", got)
	}
	if st.Role != "member" || st.Holder != "n2" || st.RoleLost != 1 {
		t.Fatalf("role %q, holder %q, lost %d times: want member of n2's role, lost once", st.Role, st.Holder, st.RoleLost)
	}
	if st.ReadErrors+st.WriteErrors+st.DroppedBatches+st.RegionErrors != 0 || st.Breaker != "closed" {
		t.Fatalf("the lost role counted as failures: %d read, %d write, %d dropped, %d region errors, breaker %s",
			st.ReadErrors, st.WriteErrors, st.DroppedBatches, st.RegionErrors, st.Breaker)
	}
}

// TestRole_ARegionsOwnRowsNeverComeBackAsForeign: the holder reads its own
// region's rows (its own writes) and imports nothing from them.
func TestRole_ARegionsOwnRowsNeverComeBackAsForeign(t *testing.T) {
	s := newSetup(t)
	mem := newMemRegion(s.clk)
	n1 := s.regionNode("a", "n1", mem)
	n1.decide("k", 100, 60)
	mem.setTotal("k", 60)
	for range 3 {
		n1.p.FlushOnce(bg)
	}
	n1.p.readWholeNext()
	n1.p.FlushOnce(bg)
	if got := mem.importedOf("k"); got != 0 {
		t.Fatalf("the region imported %d of its own units", got)
	}
	if st := n1.p.Stats(); st.CountRowsRead == 0 || st.Imports != 0 {
		t.Fatalf("read %d rows, imported %d cells; want its own row read and nothing imported", st.CountRowsRead, st.Imports)
	}
}

// TestRole_AHolderThatTakesTheRoleAgainHandsItsImportsOver: the region's
// Redis restarted empty (its imports gone, the lease with them), and the
// same node took the role again. It sent the region only the imports that
// changed since, so the region's nodes weighed none of what the other
// regions had counted before, for the rest of the window; now a holder
// that takes the role hands the region every import it holds.
func TestRole_AHolderThatTakesTheRoleAgainHandsItsImportsOver(t *testing.T) {
	s, mem, n := holderOfBsCount(t)
	if got := mem.importedOf("k"); got != 55 {
		t.Fatalf("the region holds %d imported for k, want b's 55", got)
	}
	mem.mu.Lock() // Redis restarted empty, between two of n1's flushes
	mem.holder, mem.until, mem.imported = "", 0, map[Cell]int64{}
	mem.mu.Unlock()
	n.p.RegionLost() // the root's restart watch
	n.p.FlushOnce(bg)
	if got := mem.importedOf("k"); got != 55 {
		t.Fatalf("after the region lost its imports, the region holds %d for k, want b's 55", got)
	}
	// The same when the holder lost the role and takes it again.
	mem.mu.Lock()
	mem.holder, mem.until, mem.imported = "n2", s.clk.ms.Load()+1, map[Cell]int64{}
	mem.mu.Unlock()
	n.p.FlushOnce(bg)
	s.clk.ms.Add(10)
	n.p.FlushOnce(bg)
	if st := n.p.Stats(); st.Role != "holder" {
		t.Fatalf("n1 is %q, want the holder again", st.Role)
	}
	if got := mem.importedOf("k"); got != 55 {
		t.Fatalf("after n1 took the role again, the region holds %d for k, want b's 55", got)
	}
}

// TestRole_ARegionThatLostItsRegistryGetsItsCellsAgain: the region's Redis
// restarted empty, and its registry of cells to publish with it. Each node
// remembered what it had registered and registered again only a cell that
// turned hot or changed limit, so a holder that took the role later (it
// reads the registry whole) published none of the others for the rest of
// their window: another region stayed at what it had read before the
// restart. Now every node registers its cells again.
func TestRole_ARegionThatLostItsRegistryGetsItsCellsAgain(t *testing.T) {
	s := newSetup(t)
	mem := newMemRegion(s.clk)
	n := s.regionNode("a", "n1", mem)
	n.decide("k", 100, 30) // worth publishing (a fifth of the limit), not hot
	n.p.FlushOnce(bg)
	registered := func() int {
		mem.mu.Lock()
		defer mem.mu.Unlock()
		return len(mem.reg)
	}
	if got := registered(); got != 1 {
		t.Fatalf("the region's registry holds %d cells, want k's", got)
	}
	mem.mu.Lock() // Redis restarted empty
	mem.holder, mem.until, mem.reg, mem.queue = "", 0, map[Cell]RegionCell{}, nil
	mem.mu.Unlock()
	n.p.RegionLost() // the root's restart watch
	n.p.FlushOnce(bg)
	if got := registered(); got != 1 {
		t.Fatalf("after the region lost its registry it holds %d cells, want k registered again", got)
	}
}

// TestRole_AFormerHolderShowsNoSplitByRegion: only the holder pulls the
// published rows, so only its split of a cell's global count by region
// (ForeignCounts, the admin API's global_by_region) is current. A node
// whose role passed to another kept showing the split it last pulled
// beside a global count that moved on; now it shows none, as any member.
func TestRole_AFormerHolderShowsNoSplitByRegion(t *testing.T) {
	s, mem, n := holderOfBsCount(t)
	if got := n.p.ForeignCounts(key("k"), seq0); got["b"] != 55 {
		t.Fatalf("the holder's split = %v, want b's 55", got)
	}
	mem.mu.Lock() // another node took the role
	mem.holder, mem.until = "n2", s.clk.ms.Load()+60_000
	mem.mu.Unlock()
	n.p.FlushOnce(bg)
	if st := n.p.Stats(); st.Role != "member" {
		t.Fatalf("n1 is %q, want a member", st.Role)
	}
	if got := n.p.ForeignCounts(key("k"), seq0); got != nil {
		t.Fatalf("a former holder's split = %v, want none (it no longer pulls the rows)", got)
	}
}

// holderOfBsCount is a region a whose one node, n1, holds the role and
// has pulled region b's 55 of key k.
func holderOfBsCount(t *testing.T) (*setup, *memRegion, *regionNode) {
	t.Helper()
	s := newSetup(t)
	mem := newMemRegion(s.clk)
	n := s.regionNode("a", "n1", mem)
	b := s.region("b")
	b.decide("k", 100, 55)
	b.p.FlushOnce(bg)
	b.p.GlobalSyncOnce(bg)
	n.p.FlushOnce(bg)
	return s, mem, n
}

// failingTake is a region whose next take of the queued registrations
// empties the queue and then fails, as a read that fails after the pops
// that went before it in the same take.
type failingTake struct {
	memNode
	fail atomic.Bool
}

func (r *failingTake) TakeRegistered(ctx context.Context, all bool, now int64) ([]RegionCell, error) {
	out, err := r.memNode.TakeRegistered(ctx, all, now)
	if !all && r.fail.CompareAndSwap(true, false) {
		return nil, errors.New("the registrations' read failed after the pops")
	}
	return out, err
}

// TestRole_ATakeThatFailedIsFollowedByAWholeOne: a registration popped
// from the queue by a take that then failed is read by the next take,
// which reads every registration; otherwise the cell waited for the
// next whole read (ten syncs) before it was published.
func TestRole_ATakeThatFailedIsFollowedByAWholeOne(t *testing.T) {
	s := newSetup(t)
	mem := newMemRegion(s.clk)
	reg := &failingTake{memNode: memNode{mem, "n1"}}
	n := s.regionNodeWith("a", reg)
	n.p.FlushOnce(bg) // takes the role, and every registration: none yet
	n.decide("k", 100, 60)
	mem.setTotal("k", 60)
	reg.fail.Store(true)
	n.p.FlushOnce(bg)
	if reg.fail.Load() {
		t.Fatal("the flush took no queued registrations")
	}
	if got := countRows(t, s.dsn, "ratelimit_global_counts", "WHERE region = 'a'"); got != 0 {
		t.Fatalf("%d rows of region a after the failed take, want none", got)
	}
	n.p.FlushOnce(bg)
	if got := countRows(t, s.dsn, "ratelimit_global_counts", "WHERE region = 'a' AND identifier = 'k' AND count = 60"); got != 1 {
		t.Fatalf("%d rows of region a's k at 60 after the next flush, want 1", got)
	}
}

// TestRole_ACellBelowTheFloorIsPublishedOnceAnotherRegionCountsIt: a
// region's nodes register a cell to publish once it reaches publish_floor,
// or once their own view of it holds other regions' counts. A key a region
// counted below the floor and then left idle was never read again by its
// nodes, so their view never held the other regions' counts, and its units
// stayed unseen elsewhere for the rest of the window: region a admitted 19
// of 100 and went quiet, and region b then admitted 100 more (an audit on
// two regions). The holder, which imports the other regions' counts of the
// cell, now publishes the region's count of it at the next global sync,
// however low.
func TestRole_ACellBelowTheFloorIsPublishedOnceAnotherRegionCountsIt(t *testing.T) {
	s := newSetup(t)
	mem := newMemRegion(s.clk)
	n := s.regionNode("a", "n1", mem)
	b := s.region("b")
	n.decide("k", 100, 10) // a tenth of the limit, below the floor of a fifth
	mem.setTotal("k", 10)  // what the region's Redis would hold
	for range 2 {
		n.p.GlobalSyncOnce(bg)
		n.p.FlushOnce(bg)
	}
	if rows := countRows(t, s.dsn, "ratelimit_global_counts", "WHERE region = 'a'"); rows != 0 {
		t.Fatalf("%d rows of region a below the floor, want none: idle keys cost no rows", rows)
	}
	if got := b.decide("k", 100, 60); got != 60 {
		t.Fatalf("b admitted %d of its first 60", got)
	}
	b.decide("b-only", 100, 60) // a counts none of it: a publishes no row of it
	b.p.GlobalSyncOnce(bg)
	b.p.FlushOnce(bg) // b's 60 published
	n.p.FlushOnce(bg) // a imports them
	n.p.GlobalSyncOnce(bg)
	n.p.FlushOnce(bg) // a's 10 published at the sync
	b.p.FlushOnce(bg) // b imports them
	if got := b.cell(t, "k", seq0).Global; got != 10 {
		t.Fatalf("b holds %d of a's units, want its 10", got)
	}
	if got := b.decide("k", 100, 40); got != 30 {
		t.Fatalf("b admitted %d more, want the 30 a central count leaves", got)
	}
	if rows := countRows(t, s.dsn, "ratelimit_global_counts", "WHERE region = 'a'"); rows != 1 {
		t.Fatalf("%d rows of region a, want k's alone", rows)
	}
}

// TestRole_AMemberKeepsNoConnectionToMySQL: a member runs no statement
// once the migration check at its start is done, and the connection that
// check opened stayed open for its five-minute lifetime: one per node of
// every region after each start or reload, past MySQL's max_connections
// on an edge deployment (an audit saw it idle in SHOW PROCESSLIST). It
// closes once idle for connMaxIdle now.
func TestRole_AMemberKeepsNoConnectionToMySQL(t *testing.T) {
	defer func(d time.Duration) { connMaxIdle = d }(connMaxIdle)
	connMaxIdle = 200 * time.Millisecond
	s := newSetup(t)
	mem := newMemRegion(s.clk)
	mem.holder, mem.until = "n0", s.clk.ms.Load()+time.Hour.Milliseconds() // another node holds the role
	eng, cfg, sql := s.engineAndStore("a")
	p := s.start(eng, cfg, Options{Now: s.clk.Now, Region: memNode{mem, "n1"}, Store: sql})
	if got := sql.write.Stats().OpenConnections; got == 0 {
		t.Fatal("the migration check left no connection: the test sees nothing close")
	}
	p.FlushOnce(bg)
	if st := p.Stats(); st.Role != "member" {
		t.Fatalf("n1 is %q, want a member", st.Role)
	}
	deadline := time.Now().Add(10 * time.Second)
	for sql.write.Stats().OpenConnections > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("a member still holds %d connections to MySQL after 10 s idle", sql.write.Stats().OpenConnections)
		}
		time.Sleep(50 * time.Millisecond) // database/sql closes idle connections on its own timer
	}
}
