package propagation

import (
	"errors"
	"fmt"
	"time"
)

// Defaults of Config. Each says why.
const (
	// DefaultBlocklistSync paces the safety net of denial gossip: every
	// tenth sync reads the whole blocklist (every flush reads what
	// changed).
	DefaultBlocklistSync = 10 * time.Second
	// DefaultGlobalSync is how often cells below half their limit are
	// published (often enough that a one-minute window sees about twelve
	// updates); every tenth sync reads all published counts whole.
	DefaultGlobalSync = 5 * time.Second
	// DefaultFlush is the write interval, the interval at which cells at
	// half their limit or more are published, and at which both tables'
	// changes are pulled.
	DefaultFlush = time.Second
	// DefaultBatch bounds the rows of one write, per table and flush:
	// MySQL's write load is at most one batch per region and flush,
	// whatever the traffic and however many nodes the region has.
	DefaultBatch = 500
	// DefaultTimeout bounds every query: MySQL is off the request path, but
	// a hung server must not stall the loops.
	DefaultTimeout = time.Second
	// DefaultMinWindow keeps windows shorter than a minute regional: the
	// flush and sync pipeline takes seconds, so rows would arrive after a
	// short window has rotated and only add load.
	DefaultMinWindow = time.Minute
	// DefaultPublishFloor publishes a cell once its region has used a fifth
	// of the limit: below that no spread of regions can together exceed
	// the limit by much before the next sync, and idle keys cost no rows.
	DefaultPublishFloor = 0.2
	// MinInterval is the shortest interval accepted: tests use tens of
	// milliseconds; shorter would be a busy loop against the database.
	MinInterval = 10 * time.Millisecond
	// MaxInterval is the longest sync or flush interval accepted: the
	// other regions see a region's counts (and its blocklist) that late,
	// each admitting its own traffic meanwhile as if the others had none.
	MaxInterval = time.Hour
	// MaxTimeout bounds mysql_timeout: the flush and the sync hold their
	// turn for that long when MySQL does not answer.
	MaxTimeout = time.Minute
)

// Breaker configures the write breaker (see the origin's breaker settings:
// the same lines of the global option apply to both).
type Breaker struct {
	// Interval is the rolling window over which writes are counted.
	Interval time.Duration
	// Timeout is how long the breaker stays open before a probe.
	Timeout time.Duration
	// MinRequests is the smallest sample on which the breaker may trip.
	MinRequests int
	// FailureRatio trips the breaker at this share of failed writes.
	FailureRatio float64
}

// Breaker defaults: a write happens a few times per flush, far fewer
// calls than Redis sees, so the sample is smaller than the origin's.
const (
	defaultBreakerInterval     = 30 * time.Second
	defaultBreakerTimeout      = 5 * time.Second
	defaultBreakerMinRequests  = 5
	defaultBreakerFailureRatio = 0.5
)

// Config configures a Propagator.
type Config struct {
	// DSN is a go-sql-driver/mysql DSN with placeholders already resolved.
	// It is never printed: errors and Stats show the address only.
	DSN string
	// ReadDSN, if set, is where pulls read (mysql_read: a replica in the
	// region); writes and cleanup go to DSN.
	ReadDSN string
	// Region is the identity rows are written under: the region's name,
	// or, for a process without the region's Redis (its own region), the
	// region and a per-process node name ("eu-1/3f9a…"), so that
	// Redis-less nodes count each other.
	Region string
	// BlocklistSync, GlobalSync and Flush are the loop intervals (defaults
	// above, each at least MinInterval).
	BlocklistSync, GlobalSync, Flush time.Duration
	// Batch bounds rows per write (default 500).
	Batch int
	// Timeout bounds every query (default 1s).
	Timeout time.Duration
	// NoMigrate leaves the schema alone (mysql_migrate off, for managed
	// schemas); by default Start creates the tables when missing.
	NoMigrate bool
	// MinWindow: shorter windows stay regional (default 1m).
	MinWindow time.Duration
	// PublishFloor is the share of its limit at which a cell is published
	// (default 0.2).
	PublishFloor float64
	// NoDenialGossip turns denial rows off (published counts stay).
	NoDenialGossip bool
	// Breaker configures the write breaker.
	Breaker Breaker
	// MapID, if set, replaces identifiers on their way into rows (an HMAC
	// under identifier_secret); rows then never hold a raw identifier, and
	// receivers find entries through an index built at entry creation.
	MapID func(string) string
	// OwnID, if set, reports whether a row's identifier is one MapID could
	// have made (an HMAC's shape): a row of another identifier form (a
	// region without identifier_secret) names keys no entry here has, and
	// would put its raw identifier into the region's Redis. Such rows are
	// skipped, and the first of each region logged.
	OwnID func(string) bool
	// Republish makes the first whole push publish every cell worth
	// publishing, those the engine marks as published included: they
	// went to another database, or under other identifiers (a reload that
	// changed the DSN or identifier_secret of a process that is its own
	// region; a region's holder publishes every cell when it takes the
	// role, as a reload's new propagator does).
	Republish bool
	// Windows, if set, returns the windows a zone (a row's namespace)
	// counts over here, none for a zone this config does not define. A
	// foreign row of a zone defined here over another window counts
	// nowhere here: the holder logs it (windowMismatch).
	Windows func(namespace string) []time.Duration
}

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	set := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	set(&c.BlocklistSync, DefaultBlocklistSync)
	set(&c.GlobalSync, DefaultGlobalSync)
	set(&c.Flush, DefaultFlush)
	set(&c.Timeout, DefaultTimeout)
	set(&c.MinWindow, DefaultMinWindow)
	if c.Batch == 0 {
		c.Batch = DefaultBatch
	}
	if c.PublishFloor == 0 {
		c.PublishFloor = DefaultPublishFloor
	}
	set(&c.Breaker.Interval, defaultBreakerInterval)
	set(&c.Breaker.Timeout, defaultBreakerTimeout)
	if c.Breaker.MinRequests == 0 {
		c.Breaker.MinRequests = defaultBreakerMinRequests
	}
	if c.Breaker.FailureRatio == 0 {
		c.Breaker.FailureRatio = defaultBreakerFailureRatio
	}
	return c
}

// Validate checks the settings (after defaults). Errors never quote the
// DSN.
func (c Config) Validate() error {
	if c.DSN == "" {
		return errors.New("mysql: the DSN is empty")
	}
	if c.Region == "" {
		return errors.New("region is required with mysql: rows are labelled by region")
	}
	if len(c.Region) > MaxRegionLen {
		return fmt.Errorf("region is longer than %d bytes", MaxRegionLen)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
		max  time.Duration
	}{
		{"blocklist_sync", c.BlocklistSync, MaxInterval}, {"global_sync", c.GlobalSync, MaxInterval},
		{"mysql_flush", c.Flush, MaxInterval}, {"mysql_timeout", c.Timeout, MaxTimeout},
	} {
		if d.v < MinInterval {
			return fmt.Errorf("%s %s is shorter than %s", d.name, d.v, MinInterval)
		}
		if d.v > d.max {
			return fmt.Errorf("%s %s is longer than %s", d.name, d.v, d.max)
		}
	}
	if c.MinWindow < 0 {
		return fmt.Errorf("min_window %s is negative", c.MinWindow)
	}
	if c.Batch < 1 || c.Batch > MaxBatch {
		return fmt.Errorf("mysql_batch %d is outside 1 to %d", c.Batch, MaxBatch)
	}
	if c.PublishFloor <= 0 || c.PublishFloor > 1 {
		return fmt.Errorf("publish_floor %g is outside (0, 1]", c.PublishFloor)
	}
	return nil
}

// MaxBatch bounds mysql_batch: a statement of 10,000 rows of seven
// placeholders stays under MySQL's 65,535 placeholders per statement.
const MaxBatch = 5000

// MaxRegionLen is the widest region identity a row holds (a region name of
// up to 64 bytes, a slash and a node name).
const MaxRegionLen = 96
