package ratelimit

// Logs: what the process-wide engine and origin report through the newest
// config's logger (first denials, evictions, origin failure streaks,
// breaker changes), and go-redis's own lines. The dry run's lines are in
// dryrun.go, beside the rest of it.

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// failureStreakLog is the number of consecutive failed calls to one origin
// endpoint after which one warning is logged: a single timeout is noise
// that the metrics show, a run of them is an outage the log should name.
// The recovery is logged once too, so an outage costs two lines.
const failureStreakLog = 5

// recoveryHold is how long every call to an endpoint must succeed, after
// its warning, before the recovery is logged. An endpoint whose calls
// fail and succeed by turns (a Redis Cluster with one master down, whose
// other masters answer) logged a warning and a recovery several times a
// second until the Cluster failed over; now its outage is one warning,
// and one recovery line once calls have succeeded for this long, which
// counts the runs of failures the outage had.
const recoveryHold = time.Second

// observer reports what the process-wide engine and origin do: it
// installs the engine's hooks and turns origin calls and breaker changes
// into metrics and log lines, with the newest config's logger and
// identifier treatment. It lives in the pooled state, so it outlives every
// config, like the engine.
type observer struct {
	// apps is the state's registry: its newest app's logger and identifier
	// treatment are what the hooks use.
	apps *liveApps
	// streaks holds each endpoint address's failure streak.
	streaks sync.Map // string → *streakLog
	// evictions bounds the eviction warning (see evicted).
	evictions evictionLog
}

// evictLogEvery is the least time between two eviction warnings. The
// engine evicts down to 90 % of max_entries, so a flood of new
// identifiers runs an eviction every tenth of the cap in new keys: at a
// cap of 1,000 that was a warning every hundred requests, a log flood
// the flood's sender chose. evictions_total counts every key.
const evictLogEvery = time.Minute

// evictionLog holds what the eviction runs since the last warning
// evicted.
type evictionLog struct {
	mu         sync.Mutex
	last       time.Time // of the last warning; zero: none yet
	keys, runs int64     // since it
	// due logs them once the minute since the last warning passed, when
	// no run comes then to log them (evictionsDue); nil: none pending.
	// gen numbers the timers, so that one stopped too late logs nothing.
	due *time.Timer
	gen uint64
	// now is the clock (time.Now), and after time.AfterFunc; tests set
	// them.
	now   func() time.Time
	after func(time.Duration, func()) *time.Timer
}

// view returns the newest app's settings.
func (o *observer) view() *appView { return o.apps.view() }

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

// evicted warns that the entry cap forced the engine to forget keys,
// which in local-only mode forgets their counts: at the first eviction
// run, then at most once a minute, with what the runs between evicted:
// at the first run a minute or more after the last warning, or, when
// none comes, once the minute passed (evictionsDue). Until 2026-11-29
// only a run logged them, and the runs of the last minute before a flood
// stopped went unreported (TestObserver_EvictionsWarnOnceAMinute).
func (o *observer) evicted(n int) {
	l := &o.evictions
	l.mu.Lock()
	t := l.clock()
	l.keys += int64(n)
	l.runs++
	if since := t.Sub(l.last); !l.last.IsZero() && since < evictLogEvery && since >= 0 {
		if l.due == nil {
			after := time.AfterFunc
			if l.after != nil {
				after = l.after
			}
			gen := l.gen
			l.due = after(evictLogEvery-since, func() { o.evictionsDue(&gen) })
		}
		l.mu.Unlock()
		return
	}
	keys, runs := l.take(t)
	l.mu.Unlock()
	o.view().logger.Warn("live entries reached the cap: evicted the coldest keys",
		zap.Int("evicted", n), zap.Int64("evicted_since_last_line", keys), zap.Int64("runs_since_last_line", runs))
}

// evictionsDue logs the eviction runs since the last warning, if no run
// logged them since: evicted's timer number *gen, or (nil) the state's
// Destruct at the end. The line has no run of its own: evicted is 0.
func (o *observer) evictionsDue(gen *uint64) {
	l := &o.evictions
	l.mu.Lock()
	if l.runs == 0 || (gen != nil && *gen != l.gen) {
		l.mu.Unlock()
		return
	}
	keys, runs := l.take(l.clock())
	l.mu.Unlock()
	o.view().logger.Warn("live entries reached the cap: evicted the coldest keys",
		zap.Int("evicted", 0), zap.Int64("evicted_since_last_line", keys), zap.Int64("runs_since_last_line", runs))
}

// clock reads the eviction log's clock; l.mu is held.
func (l *evictionLog) clock() time.Time {
	if l.now != nil {
		return l.now()
	}
	return time.Now()
}

// take returns what the runs since the last warning evicted, and starts
// counting afresh from a warning at t; l.mu is held.
func (l *evictionLog) take(t time.Time) (keys, runs int64) {
	keys, runs = l.keys, l.runs
	l.last, l.keys, l.runs = t, 0, 0
	l.gen++
	if l.due != nil {
		l.due.Stop()
		l.due = nil
	}
	return keys, runs
}

// originOptions returns the hooks the regional origin must be created
// with, so its calls and breaker changes reach the metrics and the log.
func (o *observer) originOptions() origin.Options {
	return origin.Options{
		OnCall:           o.originCall,
		OnStateChange:    o.breakerChanged,
		OnEvicting:       o.evicting,
		OnScriptsRefused: o.scriptsRefused,
	}
}

// evicting warns that a Redis server may evict the limiter's counts.
func (o *observer) evicting(address, policy string, maxmemory int64) {
	o.view().logger.Warn("Redis may evict rate limit counts under memory pressure: a count it evicts is admitted again (set maxmemory-policy noeviction, or give the limiter a Redis of its own)",
		zap.String("endpoint", address), zap.String("maxmemory_policy", policy), zap.Int64("maxmemory", maxmemory))
}

// scriptsRefused says, once per server the restart watch reads first (at
// startup) or restarted, that it refuses Lua scripts: the limiter cannot
// use it at all.
func (o *observer) scriptsRefused(address string, err error) {
	o.view().logger.Error("Redis refuses Lua scripts (EVAL/EVALSHA disabled or renamed, or not permitted): the rate limiter runs every call as a script, so decisions use local counts only until the server allows EVAL and EVALSHA",
		zap.String("endpoint", address), zap.Error(err))
}

// streakLog is one endpoint's failures as the log tells them: a warning
// once failureStreakLog calls in a row failed, and one recovery line once
// every call has succeeded for recoveryHold since.
type streakLog struct {
	run    atomic.Int64 // calls failed in a row
	warned atomic.Bool  // a warning stands that no recovery line followed

	mu      sync.Mutex
	failed  int64     // calls failed since the warning, its streak's included
	runs    int64     // runs of failures since the warning (the first included)
	okSince time.Time // since when calls succeed; zero while they fail
	timer   *time.Timer
}

// originCall records one origin call and logs the start and the end of an
// endpoint's failures. Calls the breaker rejected did no I/O: they neither
// extend nor end a streak.
func (o *observer) originCall(ci origin.CallInfo) {
	observeOriginCall(ci)
	if ci.Outcome == origin.OutcomeRejected {
		return
	}
	s := o.streak(ci.Endpoint)
	if ci.Outcome == origin.OutcomeOK {
		s.run.Store(0)
		if s.warned.Load() {
			o.succeeding(ci.Endpoint, s)
		}
		return
	}
	n := s.run.Add(1)
	if s.warned.Load() {
		s.mu.Lock()
		s.failed++
		if !s.okSince.IsZero() {
			s.okSince = time.Time{}
			s.runs++
		}
		s.mu.Unlock()
		return
	}
	if n != failureStreakLog {
		return
	}
	s.mu.Lock()
	if s.warned.Load() {
		s.mu.Unlock()
		return
	}
	s.failed, s.runs, s.okSince = n, 1, time.Time{}
	s.warned.Store(true)
	s.mu.Unlock()
	o.view().logger.Warn("redis calls failing: decisions use local counts until they recover",
		zap.String("endpoint", ci.Endpoint),
		zap.Stringer("op", ci.Op),
		zap.Stringer("outcome", ci.Outcome),
		zap.Int("consecutive_failures", failureStreakLog),
		zap.Error(ci.Err))
}

// succeeding notes a success on an endpoint under a warning: the first
// since a failure starts the hold, which recovered ends.
func (o *observer) succeeding(endpoint string, s *streakLog) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.warned.Load() || !s.okSince.IsZero() {
		return
	}
	s.okSince = time.Now()
	if s.timer == nil {
		s.timer = time.AfterFunc(recoveryHold, func() { o.recovered(endpoint, s) })
	} else {
		s.timer.Reset(recoveryHold)
	}
}

// recovered logs the end of an endpoint's failures once its calls have
// succeeded for recoveryHold, or waits for the rest of it.
func (o *observer) recovered(endpoint string, s *streakLog) {
	s.mu.Lock()
	if !s.warned.Load() || s.okSince.IsZero() {
		s.mu.Unlock()
		return
	}
	if left := recoveryHold - time.Since(s.okSince); left > 0 {
		s.timer.Reset(left)
		s.mu.Unlock()
		return
	}
	failed, runs := s.failed, s.runs
	s.warned.Store(false)
	s.mu.Unlock()
	o.view().logger.Info("redis calls succeed again",
		zap.String("endpoint", endpoint),
		zap.Int64("failed_calls", failed),
		zap.Int64("failure_runs", runs))
}

func (o *observer) streak(endpoint string) *streakLog {
	if s, ok := o.streaks.Load(endpoint); ok {
		return s.(*streakLog)
	}
	s, _ := o.streaks.LoadOrStore(endpoint, new(streakLog))
	return s.(*streakLog)
}

// breakerChanged logs a breaker transition and counts it. An open breaker
// is a warning (decisions are local-only for that endpoint); half-open and
// closed are the recovery.
func (o *observer) breakerChanged(endpoint, breaker string, from, to origin.BreakerState) {
	observeBreakerChange(endpoint, breaker, to)
	fields := []zap.Field{
		zap.String("endpoint", endpoint),
		zap.String("breaker", breaker),
		zap.String("from", string(from)),
		zap.String("to", string(to)),
	}
	log := o.view().logger
	switch {
	case to == origin.BreakerOpen && breaker == origin.ReplayBreakerName:
		log.Warn("redis circuit breaker open: replay holds counts until redis answers", fields...)
	case to == origin.BreakerOpen:
		log.Warn("redis circuit breaker open: decisions use local counts", fields...)
	case to == origin.BreakerHalfOpen:
		log.Info("redis circuit breaker half-open: probing", fields...)
	default:
		log.Info("redis circuit breaker closed: redis answers again", fields...)
	}
}

// redisLog routes go-redis's own log lines (dial failures) to the logger
// the newest config speaks with (liveApps.view), at debug: the breaker's
// state changes say the same at info. go-redis has one process-wide
// logger, set once; the registry of apps it reads is swapped atomically
// when an engine is made. It once held the logger of the config provisioned
// last, which a reload that failed after provisioning Redis left in place:
// the running config's Redis client then wrote with the failed config's
// log settings, to writers closed with it.
var redisLog struct {
	once sync.Once
	apps atomic.Pointer[liveApps]
}

// routeRedisLog makes apps' newest app the one go-redis writes with (see
// redisLog).
func routeRedisLog(apps *liveApps) {
	redisLog.apps.Store(apps)
	redisLog.once.Do(func() {
		origin.SetLogger(func(format string, args ...any) {
			redisLog.apps.Load().view().logger.Debug("redis client: " + fmt.Sprintf(format, args...))
		})
	})
}
