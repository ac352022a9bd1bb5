package ratelimit

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// The cross-region layer (MySQL) of the `ratelimit` app.
//
// Lifecycle across reloads, as for the regional origin (apps.go):
// Provision resolves the DSN and builds the propagator without any I/O;
// Start starts its loops (it succeeds with MySQL down: the schema is
// migrated in the background) and the state makes it the engine's
// (useBackends); Stop hands the engine to the newest config still started,
// after a last write if it was the engine's (flushBackends), then stops
// the loops. The engine keeps every imported count and every "last
// published" mark in its cells, so a reload swaps the layer around the
// same counts.
//
// The region a process writes under cannot change without a restart: its
// earlier rows would look like another region's, and its own units would
// count twice.

func init() {
	for name, parse := range mysqlSubdirectives {
		appSubdirectives[name] = parse
	}
}

// MySQLConfig is the `mysql` part of the app: the cross-region layer.
type MySQLConfig struct {
	// DSN is a go-sql-driver/mysql DSN
	// (user:password@tcp(host:port)/database?tls=true). Use a runtime
	// placeholder such as {env.MYSQL_DSN}, resolved at provisioning, so
	// the password never sits in the config the admin API serves.
	DSN string `json:"dsn,omitempty"`
	// BlocklistSync is how often every active denial row is read
	// (default 10s).
	BlocklistSync caddy.Duration `json:"blocklist_sync,omitempty"`
	// GlobalSync is how often every active published count is read, and
	// how often cells below half their limit are published (default 5s).
	GlobalSync caddy.Duration `json:"global_sync,omitempty"`
	// Flush is the write interval, and the interval at which cells at half
	// their limit or more are pushed and pulled (default 1s).
	Flush caddy.Duration `json:"flush,omitempty"`
	// Batch bounds the rows of one write and of one targeted pull (default
	// 100).
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
func (a *App) validateMySQL() error {
	if a.MySQL == nil {
		return nil
	}
	if a.Region == "" {
		return errors.New("ratelimit app: region is required with mysql: every row names the region that counted it")
	}
	cfg := a.MySQL.propagationConfig().WithDefaults()
	cfg.Region = a.Region
	if cfg.DSN == "" {
		return errors.New("ratelimit app: mysql: the DSN is empty")
	}
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("ratelimit app: %w", err)
	}
	return nil
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

// rowRegion is the identity this app's rows are written under.
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

// provisionPropagation resolves the DSN and builds the propagator.
func (a *App) provisionPropagation() error {
	if a.MySQL == nil {
		return nil
	}
	processRegion.Lock()
	prev := processRegion.region
	processRegion.Unlock()
	if prev != "" && prev != a.Region {
		return fmt.Errorf("ratelimit app: region changed from %q to %q: restart Caddy to change it (rows this process wrote as %q would count as another region's)",
			prev, a.Region, prev)
	}
	cfg := a.MySQL.propagationConfig()
	dsn, err := resolveDSN(cfg.DSN)
	if err != nil {
		return fmt.Errorf("ratelimit app: %w", err)
	}
	cfg.DSN = dsn
	cfg.Region = a.rowRegion()
	cfg.MapID = a.ids.mapper()
	st := a.state
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
	p, err := propagation.New(cfg, st.engine, propagation.Options{
		Logger:          a.logger.Named("propagation"),
		OnBreakerChange: observePropagationBreaker,
	})
	if err != nil {
		return fmt.Errorf("ratelimit app: %w", err)
	}
	a.prop = p
	return nil
}

// resolveDSN replaces runtime placeholders in the DSN. Errors never quote
// it.
func resolveDSN(dsn string) (string, error) {
	if !strings.Contains(dsn, "{") {
		return dsn, nil
	}
	v, err := caddy.NewReplacer().ReplaceOrErr(dsn, true, true)
	if err != nil {
		return "", errors.New("mysql: a placeholder in the DSN did not resolve (unknown or empty)")
	}
	return v, nil
}

// startPropagation starts this config's propagator's loops; the state's
// start makes it the engine's (usePropagation).
func (a *App) startPropagation() {
	if a.prop == nil {
		return
	}
	processRegion.Lock()
	processRegion.region = a.Region
	processRegion.Unlock()
	a.prop.Start()
}

// usePropagation makes a's propagator (or none) the engine's cross-region
// layer; called by useBackends with the newest started app.
func (s *state) usePropagation(a *App) {
	if a == nil || a.prop == nil {
		s.engine.SetGlobal(nil)
		currentProp.Store(nil)
		return
	}
	s.engine.SetGlobal(a.prop)
	currentProp.Store(a.prop)
}

// flushPropagation writes what this config's propagator holds (denial
// rows, grown counts) before another config's takes over or the process
// stops.
func (a *App) flushPropagation() {
	if a.prop == nil || !a.prop.Ready() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	a.prop.FlushOnce(ctx)
}

// stopPropagation stops this config's propagator once the state has
// handed the engine to another config's (or none).
func (a *App) stopPropagation() { a.closePropagation() }

// closePropagation stops the propagator's loops and closes its
// connections; its counters join the retired totals the metrics add up.
func (a *App) closePropagation() {
	if a.prop == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	a.prop.Stop(ctx)
	retire(a.prop.Stats())
	a.prop = nil
}

// mysqlSubdirectives parse the cross-region lines of the global option:
//
//	ratelimit {
//	    region         <name>            # required with mysql
//	    mysql          <dsn>             # e.g. {env.MYSQL_DSN}
//	    blocklist_sync <duration>        # default 10s
//	    global_sync    <duration>        # default 5s
//	    mysql_flush    <duration>        # default 1s
//	    mysql_batch    <n>               # default 100
//	    mysql_timeout  <duration>        # default 1s
//	    mysql_migrate  on|off            # default on
//	    min_window     <duration>        # default 1m
//	    publish_floor  <ratio>           # default 0.2
//	    denial_gossip  on|off            # default on
//	}
//
// Durations are at least 10ms. Each line is checked where it stands.
var mysqlSubdirectives = map[string]func(d *caddyfile.Dispenser, a *App) error{
	"mysql": func(d *caddyfile.Dispenser, a *App) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		if v == "" {
			return d.Errf("mysql: the DSN is empty")
		}
		a.mysql().DSN = v
		a.mysqlAt = d.File() + ":" + strconv.Itoa(d.Line())
		return nil
	},
	"blocklist_sync": mysqlDuration(propagation.MinInterval, func(m *MySQLConfig, v caddy.Duration) { m.BlocklistSync = v }),
	"global_sync":    mysqlDuration(propagation.MinInterval, func(m *MySQLConfig, v caddy.Duration) { m.GlobalSync = v }),
	"mysql_flush":    mysqlDuration(propagation.MinInterval, func(m *MySQLConfig, v caddy.Duration) { m.Flush = v }),
	"mysql_timeout":  mysqlDuration(propagation.MinInterval, func(m *MySQLConfig, v caddy.Duration) { m.Timeout = v }),
	"min_window":     mysqlDuration(propagation.MinInterval, func(m *MySQLConfig, v caddy.Duration) { m.MinWindow = v }),
	"mysql_batch": func(d *caddyfile.Dispenser, a *App) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > propagation.MaxBatch {
			return d.Errf("mysql_batch: want an integer from 1 to %d, got %q", propagation.MaxBatch, v)
		}
		a.mysql().Batch = n
		return nil
	},
	"publish_floor": func(d *caddyfile.Dispenser, a *App) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		r, err := strconv.ParseFloat(v, 64)
		if err != nil || !(r > 0 && r <= 1) {
			return d.Errf("publish_floor: want a ratio in (0, 1], got %q", v)
		}
		a.mysql().PublishFloor = r
		return nil
	},
	"mysql_migrate": mysqlSwitch(func(m *MySQLConfig, on bool) { m.Migrate = &on }),
	"denial_gossip": mysqlSwitch(func(m *MySQLConfig, on bool) { m.DenialGossip = &on }),
}

// mysql returns the app's MySQL settings, creating them: a tunable line
// may come before the mysql line.
func (a *App) mysql() *MySQLConfig {
	if a.MySQL == nil {
		a.MySQL = new(MySQLConfig)
	}
	return a.MySQL
}

func mysqlDuration(min time.Duration, set func(*MySQLConfig, caddy.Duration)) func(*caddyfile.Dispenser, *App) error {
	return func(d *caddyfile.Dispenser, a *App) error {
		name := d.Val()
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		dur, err := caddy.ParseDuration(v)
		if err != nil || dur < min {
			return d.Errf("%s: want a duration of at least %s such as 1s, got %q", name, min, v)
		}
		set(a.mysql(), caddy.Duration(dur))
		return nil
	}
}

func mysqlSwitch(set func(*MySQLConfig, bool)) func(*caddyfile.Dispenser, *App) error {
	return func(d *caddyfile.Dispenser, a *App) error {
		name := d.Val()
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		switch v {
		case "on":
			set(a.mysql(), true)
		case "off":
			set(a.mysql(), false)
		default:
			return d.Errf("%s: want on or off, got %q", name, v)
		}
		return nil
	}
}

// checkMySQLLines is the end-of-block check of the global option: the
// cross-region tunables need a mysql line, and mysql needs a region.
func (a *App) checkMySQLLines(d *caddyfile.Dispenser) error {
	if a.MySQL == nil {
		return nil
	}
	at := a.mysqlAt
	if at == "" {
		at = d.File() + ":" + strconv.Itoa(d.Line())
	}
	if a.MySQL.DSN == "" {
		return fmt.Errorf("cross-region settings without a mysql line, at %s", at)
	}
	if a.Region == "" {
		return fmt.Errorf("region is required with mysql (every row names the region that counted it), at %s", at)
	}
	return nil
}
