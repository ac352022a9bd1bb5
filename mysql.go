package ratelimit

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// The MySQL backend: the cross-region layer (package propagation). Its
// status section, GET /ratelimit/blocklist and its metrics are in
// mysql_status.go.
//
// Its loops start with the app (it succeeds with MySQL down: the schema is
// migrated in the background); the engine keeps every imported count and
// every "last published" mark in its cells, so a reload swaps the layer
// around the same counts. The region a process writes under cannot change
// without a restart: its earlier rows would look like another region's,
// and its own units would count twice.

// mysqlKind is the MySQL backend among the app's backends.
var mysqlKind = backendKind{
	name:            "propagation",
	lines:           mysqlLines,
	checkLines:      checkMySQLLines,
	validate:        validateMySQL,
	configureEngine: func(*App, *engine.Config) {},
	provision:       provisionMySQL,
	unuse: func(st *state) {
		st.engine.SetGlobal(nil)
		currentProp.Store(nil)
	},
	status:     func(*state) any { return propagationStatusDoc() },
	collectors: propagationCollectors,
}

// mysqlLines are the cross-region lines of the global option:
//
//	ratelimit {
//	    region         <name>            # required with mysql
//	    mysql          <dsn>             # e.g. {env.MYSQL_DSN}
//	    mysql_read     <dsn>             # a replica pulls read from
//	    blocklist_sync <duration>        # default 10s
//	    global_sync    <duration>        # default 5s
//	    mysql_flush    <duration>        # default 1s
//	    mysql_batch    <n>               # default 500
//	    mysql_timeout  <duration>        # default 1s
//	    mysql_migrate  on|off            # default on
//	    min_window     <duration>        # default 1m
//	    publish_floor  <ratio>           # default 0.2
//	    denial_gossip  on|off            # default on
//	}
//
// Intervals are at least propagation.MinInterval, and at most
// propagation.MaxInterval (mysql_timeout propagation.MaxTimeout).
var mysqlLines = []optionLine{
	stringLine("mysql", func(v string) error { return checkDSNLine(v, "mysql") }, func(a *App, v string) { mysqlOf(a).DSN = v }),
	stringLine("mysql_read", func(v string) error { return checkDSNLine(v, "mysql_read") }, func(a *App, v string) { mysqlOf(a).ReadDSN = v }),
	durationLineIn("blocklist_sync", propagation.MinInterval, propagation.MaxInterval, func(a *App, v time.Duration) { mysqlOf(a).BlocklistSync = caddy.Duration(v) }),
	durationLineIn("global_sync", propagation.MinInterval, propagation.MaxInterval, func(a *App, v time.Duration) { mysqlOf(a).GlobalSync = caddy.Duration(v) }),
	durationLineIn("mysql_flush", propagation.MinInterval, propagation.MaxInterval, func(a *App, v time.Duration) { mysqlOf(a).Flush = caddy.Duration(v) }),
	durationLineIn("mysql_timeout", propagation.MinInterval, propagation.MaxTimeout, func(a *App, v time.Duration) { mysqlOf(a).Timeout = caddy.Duration(v) }),
	durationLine("min_window", propagation.MinInterval, func(a *App, v time.Duration) { mysqlOf(a).MinWindow = caddy.Duration(v) }),
	intLine("mysql_batch", 1, propagation.MaxBatch, func(a *App, n int) { mysqlOf(a).Batch = n }),
	ratioLine("publish_floor", func(a *App, r float64) { mysqlOf(a).PublishFloor = r }),
	switchLine("mysql_migrate", func(a *App, on bool) { mysqlOf(a).Migrate = &on }),
	switchLine("denial_gossip", func(a *App, on bool) { mysqlOf(a).DenialGossip = &on }),
}

// checkDSNLine checks a mysql or mysql_read line's DSN: a literal one is
// parsed here, so that `caddy adapt` names the line (as it does a Redis
// URL's); one holding a placeholder ({env.MYSQL_DSN}) waits for
// provisioning, where it is resolved.
func checkDSNLine(v, line string) error {
	if v == "" {
		return errString(line + ": the DSN is empty")
	}
	dsn, ok := literal(v)
	if !ok {
		return loadable(line, v)
	}
	return propagation.CheckDSN(dsn, line)
}

// mysqlOf returns the app's MySQL settings, made on the first line: a
// tunable line may come before the mysql line.
func mysqlOf(a *App) *MySQLConfig {
	if a.MySQL == nil {
		a.MySQL = new(MySQLConfig)
	}
	return a.MySQL
}

// checkMySQLLines is the end-of-block check of the global option: the
// cross-region tunables need a mysql line, and mysql needs a region.
func checkMySQLLines(a *App, d *caddyfile.Dispenser) error {
	if a.MySQL == nil {
		return nil
	}
	if a.MySQL.DSN == "" {
		// Name the first cross-region line given, as the Redis check
		// does: the dispenser stands on the block's closing brace here.
		for _, l := range mysqlLines {
			if at, ok := a.lineAt[l.name]; ok {
				return fmt.Errorf("cross-region settings without a mysql line (%s at %s)", l.name, at)
			}
		}
		return fmt.Errorf("cross-region settings without a mysql line, at %s:%d", d.File(), d.Line())
	}
	at := a.lineAt["mysql"]
	if at == "" {
		at = d.File() + ":" + strconv.Itoa(d.Line())
	}
	if a.Region == "" {
		return fmt.Errorf("region is required with mysql (every row names the region that counted it), at %s", at)
	}
	return nil
}

// MySQLConfig is the `mysql` part of the app: the cross-region layer.
type MySQLConfig struct {
	// DSN is a go-sql-driver/mysql DSN
	// (user:password@tcp(host:port)/database?tls=true). Use a runtime
	// placeholder such as {env.MYSQL_DSN}, resolved at provisioning, so
	// the password never sits in the config the admin API serves.
	DSN string `json:"dsn,omitempty"`
	// ReadDSN, if set, is where pulls read: a replica near the region
	// (writes and cleanup go to DSN). A runtime placeholder as for DSN.
	ReadDSN string `json:"read_dsn,omitempty"`
	// BlocklistSync paces the safety net of denial gossip: every tenth
	// sync reads every active denial row (default 10s).
	BlocklistSync caddy.Duration `json:"blocklist_sync,omitempty"`
	// GlobalSync is how often cells below half their limit are published;
	// every tenth sync reads every active published count (default 5s).
	GlobalSync caddy.Duration `json:"global_sync,omitempty"`
	// Flush is the write interval, the interval at which cells at half
	// their limit or more are published, and at which what changed in
	// both tables is pulled (default 1s).
	Flush caddy.Duration `json:"flush,omitempty"`
	// Batch bounds the rows of one write (default 500).
	Batch int `json:"batch,omitempty"`
	// Timeout bounds every query (default 1s).
	Timeout caddy.Duration `json:"timeout,omitempty"`
	// Migrate creates the tables at start when missing (default true; set
	// false where the schema is managed, e.g. PlanetScale).
	Migrate *bool `json:"migrate,omitempty"`
	// MinWindow: windows shorter than this stay regional (default 1m).
	MinWindow caddy.Duration `json:"min_window,omitempty"`
	// PublishFloor is the share of its limit at which a cell's count is
	// published (default 0.2).
	PublishFloor float64 `json:"publish_floor,omitempty"`
	// DenialGossip writes and reads denial rows (default true).
	DenialGossip *bool `json:"denial_gossip,omitempty"`
}

// propagationConfig turns the JSON settings into the propagator's, DSN
// still unresolved.
func (m *MySQLConfig) propagationConfig() propagation.Config {
	return propagation.Config{
		DSN:            m.DSN,
		ReadDSN:        m.ReadDSN,
		BlocklistSync:  time.Duration(m.BlocklistSync),
		GlobalSync:     time.Duration(m.GlobalSync),
		Flush:          time.Duration(m.Flush),
		Batch:          m.Batch,
		Timeout:        time.Duration(m.Timeout),
		NoMigrate:      m.Migrate != nil && !*m.Migrate,
		MinWindow:      time.Duration(m.MinWindow),
		PublishFloor:   m.PublishFloor,
		NoDenialGossip: m.DenialGossip != nil && !*m.DenialGossip,
	}
}

// validateMySQL checks the settings, with placeholders unresolved.
func validateMySQL(a *App) error {
	if a.MySQL == nil {
		return nil
	}
	if a.Region == "" {
		return errors.New("region is required with mysql: every row names the region that counted it")
	}
	cfg := a.MySQL.propagationConfig().WithDefaults()
	cfg.Region = a.Region
	if cfg.DSN == "" {
		return errors.New("mysql: the DSN is empty")
	}
	return cfg.Validate()
}

// nodeName names this process in rows when it has no regional origin: a
// Redis-less node is its own region for the cross-region layer, so that
// several such nodes of one region count each other. Random per process:
// a restarted process's earlier rows are real units, counted as another
// node's.
var nodeName = sync.OnceValue(func() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
})

// rowRegion is the identity this app's rows are written under: a node
// without Redis is its own region for this layer.
func (a *App) rowRegion() string {
	if a.Origin == nil {
		return a.Region + "/" + nodeName()
	}
	return a.Region
}

// processRegion is the region this process has written rows under; a
// reload may not change it.
var processRegion struct {
	sync.Mutex
	region string
}

// mysqlBackend is one config's cross-region layer.
type mysqlBackend struct {
	a    *App
	prop *propagation.Propagator
	// ownsLoad, started: as redisBackend's, for a process that is its own
	// region (its overrides come from MySQL).
	ownsLoad, started bool
	// dest is where its rows go and under which identifiers: the DSN and
	// the identifier form (state.publishedTo).
	dest string
}

// provisionMySQL resolves the DSN and builds the propagator without any
// I/O.
func provisionMySQL(a *App) (backend, error) {
	if a.MySQL == nil {
		return nil, nil
	}
	processRegion.Lock()
	prev := processRegion.region
	processRegion.Unlock()
	if prev != "" && prev != a.Region {
		return nil, fmt.Errorf("region changed from %q to %q: restart Caddy to change it (rows this process wrote as %q would count as another region's)",
			prev, a.Region, prev)
	}
	// Without Redis a node writes its rows as its own region
	// (region/node), with Redis as the region: a reload that adds or
	// removes Redis would leave the rows this engine wrote under the other
	// name, and the units they carry, still in its cells or the region's
	// Redis, would come back as another region's and count twice.
	if prev := a.state.rowsAs.Load(); prev != nil && *prev != a.rowRegion() {
		was, now := "with Redis", "without Redis"
		if a.Origin != nil {
			was, now = now, was
		}
		return nil, fmt.Errorf("this process writes its rows in MySQL as %q (%s) and this config would write them as %q (%s): restart Caddy to add or remove Redis where mysql is set (the units its rows carry would count twice, as another region's)",
			*prev, was, a.rowRegion(), now)
	}
	cfg := a.MySQL.propagationConfig()
	dsn, err := resolveDSN("mysql", cfg.DSN)
	if err != nil {
		return nil, err
	}
	cfg.DSN = dsn
	if cfg.ReadDSN != "" {
		if cfg.ReadDSN, err = resolveDSN("mysql_read", cfg.ReadDSN); err != nil {
			return nil, err
		}
	}
	cfg.Region = a.rowRegion()
	cfg.MapID = a.ids.mapper()
	if a.ids.hashed() {
		cfg.OwnID = isHMAC
	}
	// A reload to another database, or to another identifier_secret (the
	// rows' identifiers are HMACs under it), publishes every cell again:
	// the engine marks those it published, which the new rows lack.
	dest := cfg.DSN + "\x00" + a.ids.form()
	if prev := a.state.publishedTo.Load(); prev != nil && *prev != dest {
		cfg.Republish = true
	}
	cfg.Windows = func(ns string) []time.Duration { return defWindows(a.state.zones.definitions(ns, a)) }
	if o := a.Origin; o != nil {
		// The breaker lines given apply here too; those not given keep
		// the write breaker's own defaults (it sees far fewer calls than
		// Redis's breakers).
		b := o.Breaker
		cfg.Breaker = propagation.Breaker{
			Interval: time.Duration(b.Interval), Timeout: time.Duration(b.Timeout),
			MinRequests: b.MinRequests, FailureRatio: b.FailureRatio,
		}
	}
	opts := propagation.Options{
		Logger:          a.logger.Named("propagation"),
		OnBreakerChange: observePropagationBreaker,
		// The engine's clock: with Redis, the region's (Redis's), which
		// the cells it publishes and imports are counted on.
		Now: a.state.engine.Now,
		// A global reset's row names its key's cells by zone and
		// identifier, as count rows do (an HMAC under its form).
		ResetCells: func(row propagation.OverrideRow) (string, string, bool) {
			zone, reset, regionOnly, _ := fromBookZone(row.Namespace)
			return zone, row.Identifier, reset && !regionOnly && !row.Deleted
		},
	}
	// With Redis, the region's nodes share one MySQL client: the holder
	// of the role the region's Redis leases.
	// (The origin is provisioned first: backendKinds.)
	a.eachBackend(func(b backend) {
		if rb, ok := b.(*redisBackend); ok {
			opts.Region = redisRegion{o: rb.origin, st: a.state, region: a.Region, database: propagation.DatabaseOf(cfg.DSN)}
			opts.RoleHeld = &processRole
		}
	})
	// Without Redis the process is its own region: runtime overrides come
	// from MySQL to it directly, and it loads them before deciding.
	owns := false
	if opts.Region == nil {
		mysqlOverrideHooks(&opts)
		owns = overrides.beginLoad()
	}
	p, err := propagation.New(cfg, a.state.engine, opts)
	if err != nil {
		if owns {
			overrides.abortLoad()
		}
		return nil, err
	}
	return &mysqlBackend{a: a, prop: p, ownsLoad: owns, dest: dest}, nil
}

// processRole is whether this process holds its region's cross-region
// role, whichever config's layer took it: a reload's new layer takes the
// role the process holds, which is no role change (propagation.Options).
var processRole atomic.Bool

// resolveDSN replaces runtime placeholders in the DSN. Errors never quote
// it.
func resolveDSN(line, dsn string) (string, error) {
	if !strings.Contains(dsn, "{") {
		return dsn, nil
	}
	v, err := caddy.NewReplacer().ReplaceOrErr(dsn, true, true)
	if err != nil {
		return "", fmt.Errorf("%s: a placeholder in the DSN did not resolve (unknown or empty)", line)
	}
	return v, nil
}

// start starts the propagator's loops; the state makes it the engine's
// (use).
func (b *mysqlBackend) start() {
	b.started = true
	processRegion.Lock()
	processRegion.region = b.a.Region
	processRegion.Unlock()
	rows := b.a.rowRegion()
	b.a.state.rowsAs.CompareAndSwap(nil, &rows) // provisioning checked it against one set before
	b.a.state.publishedTo.Store(&b.dest)
	b.prop.Start()
	if !b.prop.HasRegion() {
		// Its own pointer: close may clear b.prop while it loads.
		go b.loadMySQLOverrides(b.prop)
	}
}

// use makes the propagator the engine's cross-region layer.
func (b *mysqlBackend) use(st *state) {
	st.engine.SetGlobal(b.prop)
	currentProp.Store(b.prop)
}

// flush writes what the propagator holds (denial rows, every count that
// grew: see FlushAll) before the process stops.
func (b *mysqlBackend) flush(*state) {
	if !b.prop.Ready() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	b.prop.FlushAll(ctx)
}

// letGo stops the propagator's loops once the state has handed the engine
// to another config's layer (or none).
func (b *mysqlBackend) letGo(*state, bool) { b.close() }

// close stops the loops and closes the connections, once; the
// propagator's counters join the retired totals the metrics add up.
func (b *mysqlBackend) close() {
	if b.ownsLoad && !b.started {
		overrides.abortLoad()
	}
	if b.prop == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	b.prop.Stop(ctx)
	b.handOverrides()
	if cur := currentProp.Load(); cur == nil || !cur.HasRegion() {
		processRole.Store(false) // its role went with the last layer that had one
	}
	retireProp(b.prop.Stats())
	b.prop = nil
}

// handOverrides gives the runtime override changes the stopped layer
// could not write (MySQL did not answer its last flush) to the layer in
// use, when that writes to the same database: a reload once dropped
// them, and for a node without Redis they were nowhere else (the node
// kept enforcing a change no other region ever had). Without such a
// layer (the process stops, or the new config writes elsewhere) they are
// lost, and the log says which.
func (b *mysqlBackend) handOverrides() {
	left := b.prop.PendingOverrides()
	if len(left) == 0 {
		return
	}
	if cur := currentProp.Load(); cur != nil && cur != b.prop && cur.Addr() == b.prop.Addr() {
		for _, r := range left {
			cur.PutOverride(r)
		}
		b.a.logger.Info("handed the runtime override changes not yet written to MySQL to the new configuration's layer",
			zap.Int("changes", len(left)), zap.String("database", b.prop.Addr()))
		return
	}
	zones := map[string]bool{}
	for _, r := range left {
		zone, _, _, _ := fromBookZone(r.Namespace)
		zones[zone] = true
	}
	b.a.logger.Error("runtime override changes never written to MySQL are lost as the layer stops (MySQL did not answer): make them again once it does",
		zap.Int("changes", len(left)), zap.Strings("zones", slices.Sorted(maps.Keys(zones))), zap.String("database", b.prop.Addr()))
}

// Interface guards.
var _ backend = (*mysqlBackend)(nil)
