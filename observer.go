package ratelimit

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// failureStreakLog is the number of consecutive failed calls to one origin
// endpoint after which one warning is logged: a single timeout is noise
// that the metrics show, a run of them is an outage the log should name.
// The recovery is logged once too, so a streak costs two lines.
const failureStreakLog = 5

// observer reports what the process-wide engine and origin do: it holds the
// settings of the newest config (logger, region, identifier treatment),
// installs the engine's hooks, and turns origin calls and breaker changes
// into metrics and log lines. It lives in the pooled state, so it outlives
// every config, like the engine.
type observer struct {
	mu sync.Mutex
	// apps are the provisioned apps not yet cleaned up, oldest first. The
	// newest speaks for the process: a reload provisions the new config
	// before cleaning up the old one, and a failed reload cleans up its own
	// app, which leaves the running config's app the newest again.
	apps []*App
	cur  atomic.Pointer[appView]

	origin atomic.Pointer[originBox]
	// streaks counts consecutive failed calls per endpoint address.
	streaks sync.Map // string → *atomic.Int64
}

// appView is what the newest app says about the process.
type appView struct {
	app    *App
	logger *zap.Logger
	region string
	ids    identities
}

// originView is what the status and the metrics read of the regional
// origin; *origin.Redis implements it.
type originView interface {
	Stats() origin.Stats
}

// originBox lets an interface sit in an atomic.Pointer.
type originBox struct{ v originView }

// attach makes a the newest app.
func (o *observer) attach(a *App) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.apps = append(o.apps, a)
	o.publish()
}

// detach forgets a; the newest remaining app speaks for the process.
func (o *observer) detach(a *App) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.apps = slices.DeleteFunc(o.apps, func(x *App) bool { return x == a })
	o.publish()
}

func (o *observer) publish() {
	if len(o.apps) == 0 {
		o.cur.Store(nil)
		return
	}
	a := o.apps[len(o.apps)-1]
	o.cur.Store(&appView{app: a, logger: a.logger, region: a.Region, ids: a.ids})
}

// view returns the newest app's settings, or the defaults (Caddy's default
// logger, identifiers truncated in logs) when no app is provisioned, e.g.
// between a handler's provisioning and its app's in tests.
func (o *observer) view() *appView {
	if v := o.cur.Load(); v != nil {
		return v
	}
	return &appView{logger: caddy.Log().Named("ratelimit")}
}

// setOrigin publishes the origin the engine uses now (nil: none), so the
// status and the metrics can read it. Whoever calls engine.SetOrigin calls
// this with the same origin.
func (o *observer) setOrigin(v originView) {
	if v == nil {
		o.origin.Store(nil)
		return
	}
	o.origin.Store(&originBox{v})
}

// currentOrigin returns the published origin, or nil.
func (o *observer) currentOrigin() originView {
	if b := o.origin.Load(); b != nil {
		return b.v
	}
	return nil
}

// observeEngine installs the engine hooks; cfg is the config of the engine
// the pool is about to create.
func (o *observer) observeEngine(cfg *engine.Config) {
	cfg.OnFirstDenial = o.firstDenial
	cfg.OnEvict = o.evicted
}

// firstDenial logs, at debug level, the first denial of a key in a window:
// one line per key and window however many requests it denies. It runs on
// the request path, so with debug off it costs a level check.
func (o *observer) firstDenial(d engine.Denial) {
	v := o.view()
	c := v.logger.Check(zapcore.DebugLevel, "first denial of a key in this window")
	if c == nil {
		return
	}
	fields := append(v.ids.logFields(d.Identifier),
		zap.String("zone", d.Namespace),
		zap.Duration("window", d.Window),
		zap.Int64("sequence", d.Sequence),
		zap.Int64("limit", d.Limit.Limit),
		zap.Int64("used", d.Used),
		zap.Int64("cost", d.Cost),
	)
	c.Write(fields...)
}

// evicted logs one warning per eviction run: the entry cap forced the
// engine to forget keys, which in local-only mode forgets their counts.
func (o *observer) evicted(n int) {
	o.view().logger.Warn("live entries reached the cap: evicted the coldest keys",
		zap.Int("evicted", n))
}

// originOptions returns the hooks the regional origin must be created
// with, so its calls and breaker changes reach the metrics and the log.
func (o *observer) originOptions() origin.Options {
	return origin.Options{
		OnCall:        o.originCall,
		OnStateChange: o.breakerChanged,
	}
}

// originCall records one origin call and logs the start and the end of a
// streak of failures. Calls the breaker rejected did no I/O: they neither
// extend nor end a streak.
func (o *observer) originCall(ci origin.CallInfo) {
	observeOriginCall(ci)
	if ci.Outcome == origin.OutcomeRejected {
		return
	}
	s := o.streak(ci.Endpoint)
	if ci.Outcome == origin.OutcomeOK {
		if n := s.Swap(0); n >= failureStreakLog {
			o.view().logger.Info("redis calls succeed again",
				zap.String("endpoint", ci.Endpoint),
				zap.Int64("failed_calls", n))
		}
		return
	}
	if s.Add(1) == failureStreakLog {
		o.view().logger.Warn("redis calls failing: decisions use local counts until they recover",
			zap.String("endpoint", ci.Endpoint),
			zap.Stringer("op", ci.Op),
			zap.Stringer("outcome", ci.Outcome),
			zap.Int("consecutive_failures", failureStreakLog))
	}
}

func (o *observer) streak(endpoint string) *atomic.Int64 {
	if s, ok := o.streaks.Load(endpoint); ok {
		return s.(*atomic.Int64)
	}
	s, _ := o.streaks.LoadOrStore(endpoint, new(atomic.Int64))
	return s.(*atomic.Int64)
}

// breakerChanged logs a breaker transition and counts it. An open breaker
// is a warning (decisions are local-only for that endpoint); half-open and
// closed are the recovery.
func (o *observer) breakerChanged(endpoint string, from, to origin.BreakerState) {
	observeBreakerChange(endpoint, to)
	fields := []zap.Field{
		zap.String("endpoint", endpoint),
		zap.String("from", string(from)),
		zap.String("to", string(to)),
	}
	log := o.view().logger
	switch to {
	case origin.BreakerOpen:
		log.Warn("redis circuit breaker open: decisions use local counts", fields...)
	case origin.BreakerHalfOpen:
		log.Info("redis circuit breaker half-open: probing", fields...)
	default:
		log.Info("redis circuit breaker closed: redis answers again", fields...)
	}
}

// dryRunLog limits a dry-run zone's info line to one per window.
type dryRunLog struct {
	// seq is the window sequence of the last line; count the would-be
	// denials since.
	seq, count atomic.Int64
}

// note counts a would-be denial and logs at info level on the first one of
// each window, with the number since the previous line.
func (d *dryRunLog) note(log *zap.Logger, zone string, window time.Duration) {
	d.count.Add(1)
	seq := time.Now().UnixMilli() / window.Milliseconds()
	old := d.seq.Load()
	if old == seq || !d.seq.CompareAndSwap(old, seq) {
		return
	}
	log.Info("dry run: requests would have been rate limited",
		zap.String("zone", zone),
		zap.Int64("would_be_denied", d.count.Swap(0)),
		zap.Duration("window", window))
}

// redisLog routes go-redis's own log lines (dial failures) to the newest
// config's logger, at debug: the breaker's state changes say the same at
// info. go-redis has one process-wide logger, set once; the logger it
// writes to is swapped atomically on every provisioning.
var redisLog struct {
	once   sync.Once
	logger atomic.Pointer[zap.Logger]
}

// routeRedisLog makes logger the one go-redis writes to (see redisLog).
func routeRedisLog(logger *zap.Logger) {
	redisLog.logger.Store(logger)
	redisLog.once.Do(func() {
		origin.SetLogger(func(format string, args ...any) {
			redisLog.logger.Load().Debug("redis client: " + fmt.Sprintf(format, args...))
		})
	})
}
