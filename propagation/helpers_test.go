package propagation

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
)

// One mariadbd for the whole test binary; every test has its own database.
var shared mysqltest.Shared

func TestMain(m *testing.M) { os.Exit(mysqltest.Main(m, &shared)) }

var bg = context.Background()

// clock is a fake clock shared by a test's engines and propagators.
type clock struct{ ms atomic.Int64 }

func (c *clock) Now() time.Time { return time.UnixMilli(c.ms.Load()) }

func (c *clock) Add(d time.Duration) { c.ms.Add(d.Milliseconds()) }

// epoch is aligned to every window the tests use.
const epoch = int64(1_700_000_000) / 3600 * 3600 * 1000

const window = time.Minute

var seq0 = epoch / window.Milliseconds()

// region is one region's node: an engine and its propagator.
type region struct {
	eng *engine.Engine
	p   *Propagator
}

type setup struct {
	t     *testing.T
	dsn   string
	clk   *clock
	limit int64
}

func newSetup(t *testing.T) *setup {
	t.Helper()
	srv := shared.Get(t)
	s := &setup{t: t, dsn: srv.NewDatabase(t), clk: new(clock), limit: 10}
	s.clk.ms.Store(epoch + 10_000)
	return s
}

// region starts a region's node on the test's database; mod adjusts the
// config.
func (s *setup) region(name string, mod ...func(*Config)) *region {
	s.t.Helper()
	return s.regionOn(s.clk, name, mod...)
}

// regionOn is region on a clock of its own.
func (s *setup) regionOn(clk *clock, name string, mod ...func(*Config)) *region {
	s.t.Helper()
	eng := engine.New(engine.Config{Now: clk.Now, Manual: true})
	eng.Zone("z", window)
	cfg := Config{
		DSN: s.dsn, Region: name, Batch: 100, Timeout: 5 * time.Second,
	}
	for _, m := range mod {
		m(&cfg)
	}
	return &region{eng: eng, p: s.start(eng, cfg, Options{Now: clk.Now, Logger: zap.NewNop()})}
}

// engineAndStore is a region's engine (manual, zone z), config (the
// defaults) and MySQL store on the test's database, for a propagator the
// test starts with options of its own.
func (s *setup) engineAndStore(region string) (*engine.Engine, Config, *sqlStore) {
	s.t.Helper()
	eng := engine.New(engine.Config{Now: s.clk.Now, Manual: true})
	eng.Zone("z", window)
	cfg := Config{DSN: s.dsn, Region: region, Batch: 100, Timeout: 5 * time.Second}.WithDefaults()
	sql, _, err := openStore(cfg, zap.NewNop())
	if err != nil {
		s.t.Fatal(err)
	}
	return eng, cfg, sql
}

// start makes the propagator of eng, migrates, attaches it, and stops both
// when the test ends.
func (s *setup) start(eng *engine.Engine, cfg Config, opts Options) *Propagator {
	s.t.Helper()
	p, err := New(cfg, eng, opts)
	if err != nil {
		s.t.Fatal(err)
	}
	if err := p.MigrateOnce(bg); err != nil {
		s.t.Fatal(err)
	}
	eng.SetGlobal(p)
	s.t.Cleanup(func() {
		p.Stop(bg)
		_ = eng.Close(bg)
	})
	return p
}

func (r *region) decide(id string, limit int64, n int) (admitted int) {
	for i := 0; i < n; i++ {
		if r.eng.Decide(bg, engine.Limit{Key: key(id), Limit: limit, Cost: 1}).Allowed {
			admitted++
		}
	}
	return admitted
}

func key(id string) engine.Key { return engine.Key{Namespace: "z", Identifier: id, Window: window} }

func (r *region) cell(t *testing.T, id string, seq int64) engine.CellState {
	t.Helper()
	ks, ok := r.eng.Inspect(key(id))
	if !ok {
		t.Fatalf("no entry for %q", id)
	}
	for _, c := range ks.Cells {
		if c.Sequence == seq {
			return c
		}
	}
	t.Fatalf("no cell %d for %q: %+v", seq, id, ks.Cells)
	return engine.CellState{}
}

func countRows(t *testing.T, dsn, table, where string, args ...any) int {
	t.Helper()
	db := mysqltest.Open(t, dsn)
	var n int
	if err := db.QueryRow("SELECT COUNT(*) FROM "+table+" "+where, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// hmacOf stands in for identifier_secret's HMAC.
func hmacOf(id string) string {
	sum := sha256.Sum256([]byte("secret:" + id))
	return hex.EncodeToString(sum[:16])
}
