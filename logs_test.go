package ratelimit

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	logobserver "go.uber.org/zap/zaptest/observer"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/internal/testclock"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// observedApp is an app whose logger records lines at level and above.
func observedApp(level zapcore.Level, ids identities) (*App, *logobserver.ObservedLogs) {
	core, logs := logobserver.New(level)
	return &App{logger: zap.New(core), ids: ids, Region: "r"}, logs
}

// TestObserver_FirstDenialLoggedOnceAtDebug: the first denial of a key in a
// window is one debug line however many requests it denies, with the
// identifier hashed; without debug, nothing.
func TestObserver_FirstDenialLoggedOnceAtDebug(t *testing.T) {
	const secret = "0123456789abcdef0123"
	const id = "sk_live_first_denial_key"
	for _, level := range []zapcore.Level{zapcore.DebugLevel, zapcore.InfoLevel} {
		t.Run(level.String(), func(t *testing.T) {
			useClock(t, 0)
			h := provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("fd", 2, time.Minute)}})
			app, logs := observedApp(level, identities{secret: []byte(secret)})
			st := lookupState()
			st.apps.provision(app)
			t.Cleanup(func() { st.apps.cleanup(app) })
			for range 10 {
				serve(h, map[string]string{"fd": id})
			}
			lines := logs.FilterMessage("first denial of a key in this window").All()
			if level > zapcore.DebugLevel {
				if len(lines) != 0 || logs.Len() != 0 {
					t.Fatalf("%d lines at info level: %v", logs.Len(), logs.All())
				}
				return
			}
			if len(lines) != 1 {
				t.Fatalf("%d first-denial lines for one key in one window, want 1", len(lines))
			}
			f := lines[0].ContextMap()
			if f["identifier_hmac"] != identifierHMAC([]byte(secret), id) || f["zone"] != "fd" || f["limit"] != int64(2) || f["used"] != int64(2) {
				t.Fatalf("fields %v", f)
			}
			for k, v := range f {
				if s, ok := v.(string); ok && strings.Contains(s, id) {
					t.Fatalf("field %s carries the raw identifier", k)
				}
			}
		})
	}
}

// TestObserver_OriginFailureStreak: a streak of failed calls is one warning
// when it reaches failureStreakLog and one info line once calls have
// succeeded for recoveryHold; calls the breaker rejected neither extend
// nor end it.
func TestObserver_OriginFailureStreak(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		o := observer{apps: new(liveApps)}
		app, logs := observedApp(zapcore.DebugLevel, identities{})
		o.apps.provision(app)
		const ep = "redis://streak.example:6379/0"
		call := func(oc origin.Outcome) {
			o.originCall(origin.CallInfo{Endpoint: ep, Op: origin.OpRead, Outcome: oc, Duration: time.Millisecond})
		}
		okBefore := counterValue(t, endpointMetrics(ep).calls[origin.OpRead][origin.OutcomeOK])
		timeoutsBefore := counterValue(t, endpointMetrics(ep).calls[origin.OpRead][origin.OutcomeTimeout])

		for range failureStreakLog - 1 {
			call(origin.OutcomeError)
		}
		call(origin.OutcomeOK) // a short streak ends silently
		time.Sleep(2 * recoveryHold)
		synctest.Wait()
		if logs.Len() != 0 {
			t.Fatalf("%d lines for a streak shorter than %d", logs.Len(), failureStreakLog)
		}
		for range 3 * failureStreakLog {
			call(origin.OutcomeTimeout)
			call(origin.OutcomeRejected)
		}
		warn := logs.FilterLevelExact(zapcore.WarnLevel).All()
		if len(warn) != 1 || warn[0].ContextMap()["endpoint"] != ep {
			t.Fatalf("warnings %v, want one naming the endpoint", warn)
		}
		call(origin.OutcomeOK)
		time.Sleep(recoveryHold / 2)
		call(origin.OutcomeOK)
		synctest.Wait()
		if n := logs.FilterLevelExact(zapcore.InfoLevel).Len(); n != 0 {
			t.Fatalf("%d recovery lines %s after the first success, want none before %s", n, recoveryHold/2, recoveryHold)
		}
		time.Sleep(recoveryHold / 2)
		synctest.Wait()
		info := logs.FilterLevelExact(zapcore.InfoLevel).All()
		if len(info) != 1 || info[0].ContextMap()["failed_calls"] != int64(3*failureStreakLog) || info[0].ContextMap()["failure_runs"] != int64(1) {
			t.Fatalf("recovery lines %v, want one with failed_calls %d and failure_runs 1", info, 3*failureStreakLog)
		}
		if got := counterValue(t, endpointMetrics(ep).calls[origin.OpRead][origin.OutcomeTimeout]) - timeoutsBefore; got != 3*failureStreakLog {
			t.Fatalf("timeouts counted %v, want %d", got, 3*failureStreakLog)
		}
		if got := counterValue(t, endpointMetrics(ep).calls[origin.OpRead][origin.OutcomeOK]) - okBefore; got != 3 {
			t.Fatalf("ok calls counted %v, want 3", got)
		}
	})
}

// TestObserver_AnEndpointFailingByTurnsIsOneOutage: calls to one endpoint
// that fail and succeed by turns (a Redis Cluster with one master down,
// its other masters answering, an audit saw it for some 20 s) logged a
// warning and a recovery several times a second. Now it is one warning,
// and one recovery line once calls have succeeded for recoveryHold, which
// counts the runs of failures; a later outage warns again.
func TestObserver_AnEndpointFailingByTurnsIsOneOutage(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		o := observer{apps: new(liveApps)}
		app, logs := observedApp(zapcore.DebugLevel, identities{})
		o.apps.provision(app)
		const ep = "redis://by-turns.example:6379/0"
		call := func(oc origin.Outcome) {
			o.originCall(origin.CallInfo{Endpoint: ep, Op: origin.OpFlush, Outcome: oc, Duration: time.Millisecond})
		}
		const flaps = 20
		for range failureStreakLog {
			call(origin.OutcomeError)
		}
		for range flaps {
			call(origin.OutcomeOK)
			time.Sleep(recoveryHold / 4)
			for range failureStreakLog {
				call(origin.OutcomeTimeout)
			}
			time.Sleep(recoveryHold / 4)
		}
		synctest.Wait()
		warnings := logs.FilterMessage("redis calls failing: decisions use local counts until they recover").Len()
		recoveries := logs.FilterMessage("redis calls succeed again").Len()
		if warnings != 1 || recoveries != 0 {
			t.Fatalf("%d warnings and %d recovery lines over %d runs of failures %s apart, want 1 and 0", warnings, recoveries, flaps+1, recoveryHold/2)
		}
		call(origin.OutcomeOK)
		time.Sleep(recoveryHold)
		synctest.Wait()
		info := logs.FilterMessage("redis calls succeed again").All()
		if len(info) != 1 {
			t.Fatalf("%d recovery lines %s after the last failure, want 1", len(info), recoveryHold)
		}
		if f := info[0].ContextMap(); f["failed_calls"] != int64((flaps+1)*failureStreakLog) || f["failure_runs"] != int64(flaps+1) {
			t.Fatalf("recovery line %v, want failed_calls %d and failure_runs %d", f, (flaps+1)*failureStreakLog, flaps+1)
		}
		for range failureStreakLog {
			call(origin.OutcomeError)
		}
		if n := logs.FilterMessage("redis calls failing: decisions use local counts until they recover").Len(); n != 2 {
			t.Fatalf("%d warnings after a new outage, want 2", n)
		}
	})
}

func TestObserver_BreakerTransitions(t *testing.T) {
	o := observer{apps: new(liveApps)}
	app, logs := observedApp(zapcore.DebugLevel, identities{})
	o.apps.provision(app)
	const ep = "redis://breaker.example:6379/0"
	before := counterValue(t, breakerTransitionsTotal.WithLabelValues(ep, origin.BreakerName, string(origin.BreakerOpen)))
	o.breakerChanged(ep, origin.BreakerName, origin.BreakerClosed, origin.BreakerOpen)
	o.breakerChanged(ep, origin.BreakerName, origin.BreakerOpen, origin.BreakerHalfOpen)
	o.breakerChanged(ep, origin.BreakerName, origin.BreakerHalfOpen, origin.BreakerClosed)
	want := []zapcore.Level{zapcore.WarnLevel, zapcore.InfoLevel, zapcore.InfoLevel}
	all := logs.All()
	if len(all) != len(want) {
		t.Fatalf("%d lines, want one per transition", len(all))
	}
	for i, e := range all {
		if e.Level != want[i] || e.ContextMap()["endpoint"] != ep {
			t.Errorf("line %d: %s %q %v", i, e.Level, e.Message, e.ContextMap())
		}
	}
	if got := counterValue(t, breakerTransitionsTotal.WithLabelValues(ep, origin.BreakerName, string(origin.BreakerOpen))) - before; got != 1 {
		t.Fatalf("open transitions +%v, want +1", got)
	}
}

// TestLogs_READMEListsEveryMessage: every message the module logs (a
// literal in a call of Debug, Info, Warn or Error in its packages) is in
// the README's Logs section; a message built from a literal and a value
// is found by its literal. Most of the cross-region layer's lines, the
// replay breaker's and the shutdown flush's were missing from it.
func TestLogs_READMEListsEveryMessage(t *testing.T) {
	_, section := readmeSection(t, "Logs")
	call := regexp.MustCompile(`\.(?:Debug|Info|Warn|Error)\(\s*"((?:[^"\\]|\\.)*)"`)
	n := 0
	for _, dir := range []string{".", "engine", "origin", "propagation"} {
		files, err := filepath.Glob(filepath.Join(dir, "*.go"))
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") {
				continue
			}
			src, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range call.FindAllStringSubmatch(string(src), -1) {
				n++
				msg := strings.TrimSpace(m[1])
				if !strings.Contains(section, "`"+msg) {
					t.Errorf("%s logs %q, which the README's Logs section does not list", f, msg)
				}
			}
		}
	}
	if n < 20 {
		t.Fatalf("found only %d log calls: the pattern no longer matches them", n)
	}
}

// observedOrigin is an origin on url whose calls an observer of a
// provisioned app sees, and that app's logs.
func observedOrigin(t *testing.T, url string) (*origin.Redis, *logobserver.ObservedLogs) {
	t.Helper()
	o := observer{apps: new(liveApps)}
	app, logs := observedApp(zapcore.DebugLevel, identities{})
	o.apps.provision(app)
	r, err := origin.New(origin.Config{Redis: []string{url}}, o.originOptions())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r, logs
}

// TestObserver_AFailingRedisSaysWhy: a Redis that answers every write
// with an error (here READONLY: the configured server was made a replica)
// must say which in the log line of the failing streak and in the
// status, or the operator sees "redis calls failing", outcome "error",
// and has to guess among a dead server, a wrong password, a replica and
// a full memory.
func TestObserver_AFailingRedisSaysWhy(t *testing.T) {
	srv, other := redistest.Start(t), redistest.Start(t)
	r, logs := observedOrigin(t, srv.URL())
	ctx := context.Background()
	if err := srv.Client().Do(ctx, "REPLICAOF", "127.0.0.1", other.Port()).Err(); err != nil {
		t.Fatal(err)
	}
	k := engine.Key{Namespace: "api", Identifier: "why", Window: time.Minute}
	for range failureStreakLog {
		_ = r.Flush(ctx, []engine.Delta{{Key: k, Sequence: 1, Delta: 1, Own: 1}})
	}
	lines := logs.FilterMessage("redis calls failing: decisions use local counts until they recover").All()
	if len(lines) != 1 {
		t.Fatalf("%d streak lines, want 1: %v", len(lines), logs.All())
	}
	if why, _ := lines[0].ContextMap()["error"].(string); !strings.Contains(why, "READONLY") {
		t.Fatalf("the streak line does not say why: %v", lines[0].ContextMap())
	}
	st := r.Stats().Endpoints[0]
	if !strings.Contains(st.LastError, "READONLY") || st.LastErrorAt.IsZero() {
		t.Fatalf("the status does not say why: last error %q at %v", st.LastError, st.LastErrorAt)
	}
}

// TestObserver_ARedisThatRefusesScriptsSaysSo: a Redis with EVAL and
// EVALSHA renamed away (rename-command in its redis.conf; a proxy that
// does not pass scripts answers alike) serves none of the limiter's
// calls. The watch's first read of it (as the node starts) logs an
// error that says so, and the failing streak's line says it too, not
// Redis's bare "unknown command 'evalsha'" with the keys it echoes.
func TestObserver_ARedisThatRefusesScriptsSaysSo(t *testing.T) {
	srv := redistest.Start(t, redistest.WithArgs("--rename-command", "EVALSHA", "", "--rename-command", "EVAL", ""))
	r, logs := observedOrigin(t, srv.URL())
	const refused = "Redis refuses Lua scripts (EVAL/EVALSHA disabled or renamed, or not permitted): the rate limiter runs every call as a script, so decisions use local counts only until the server allows EVAL and EVALSHA"
	r.WatchRestarts(20*time.Millisecond, func() {})
	redistest.Eventually(t, 5*time.Second, "the refusal logged", func() bool { return logs.FilterMessage(refused).Len() > 0 })
	if l := logs.FilterMessage(refused).All()[0]; l.Level != zapcore.ErrorLevel || l.ContextMap()["endpoint"] != srv.URL() {
		t.Fatalf("the refusal's line: %v %v", l.Level, l.ContextMap())
	}
	ctx := context.Background()
	k := engine.Key{Namespace: "api", Identifier: "hidden-tenant", Window: time.Minute}
	for range failureStreakLog {
		_ = r.Flush(ctx, []engine.Delta{{Key: k, Sequence: 1, Delta: 1, Own: 1}})
	}
	lines := logs.FilterMessage("redis calls failing: decisions use local counts until they recover").All()
	if len(lines) != 1 {
		t.Fatalf("%d streak lines, want 1: %v", len(lines), logs.All())
	}
	why, _ := lines[0].ContextMap()["error"].(string)
	if !strings.Contains(why, "refuses Lua scripts") || strings.Contains(why, "hidden-tenant") {
		t.Fatalf("the streak line's error %q: want it to say the server refuses scripts, without the key", why)
	}
}

// TestLogs_TheRedisClientsLinesGoToTheRunningConfig: go-redis has one
// logger for the process, which each config with Redis pointed at its own
// as it was provisioned. A reload that failed after that left it on the
// failed config's logger (its log settings, its writers closed with it),
// while the running config's kept Redis. They go to the logger the state's
// newest app speaks with, which is the running config's again once the
// failed one is cleaned up.
func TestLogs_TheRedisClientsLinesGoToTheRunningConfig(t *testing.T) {
	st := heldState(t)
	running, runningLogs := observedApp(zapcore.DebugLevel, identities{})
	failed, failedLogs := observedApp(zapcore.DebugLevel, identities{})
	for _, a := range []*App{running, failed} { // as App.Provision and provisionRedis do
		a.state = st
		st.apps.provision(a)
		routeRedisLog(&st.apps)
	}
	t.Cleanup(func() { st.apps.cleanup(running) })
	st.apps.cleanup(failed) // the reload failed

	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: 100 * time.Millisecond})
	defer c.Close()
	// go-redis says it rounds the expiry up to a millisecond (and then
	// cannot connect).
	_ = c.Set(context.Background(), "k", "v", time.Microsecond).Err()
	if n := failedLogs.FilterMessageSnippet("redis client: ").Len(); n != 0 {
		t.Errorf("the failed config's logger got %d lines of the Redis client", n)
	}
	if n := runningLogs.FilterMessageSnippet("redis client: specified duration").Len(); n != 1 {
		t.Errorf("the running config's logger got %d of the Redis client's line, want 1: %v", n, runningLogs.All())
	}
}

// TestObserver_EvictionsWarnOnceAMinute: a flood of new identifiers
// against a small max_entries runs an eviction every tenth of the cap in
// new keys, and each run was a warning (at a cap of 1,000, one every
// hundred requests: a log flood its sender chose). The first run warns;
// the runs of the next minute are counted into the first line after it.
func TestObserver_EvictionsWarnOnceAMinute(t *testing.T) {
	o := observer{apps: new(liveApps)}
	app, logs := observedApp(zapcore.DebugLevel, identities{})
	o.apps.provision(app)
	clk := testclock.New(time.Unix(1_700_000_000, 0))
	o.evictions.now = clk.Now
	for range 50 {
		o.evicted(100)
		clk.Advance(time.Second)
	}
	lines := logs.FilterMessage("live entries reached the cap: evicted the coldest keys").All()
	if len(lines) != 1 {
		t.Fatalf("%d warnings for 50 eviction runs in 50 s, want 1", len(lines))
	}
	clk.Advance(evictLogEvery)
	o.evicted(7)
	lines = logs.FilterMessage("live entries reached the cap: evicted the coldest keys").All()
	if len(lines) != 2 {
		t.Fatalf("%d warnings after a minute more, want 2", len(lines))
	}
	f := lines[1].ContextMap()
	if f["evicted"] != int64(7) || f["evicted_since_last_line"] != int64(49*100+7) || f["runs_since_last_line"] != int64(50) {
		t.Fatalf("second warning %v, want evicted 7, evicted_since_last_line %d, runs_since_last_line 50", f, 49*100+7)
	}
}

// TestObserver_EvictionsAfterTheLastLineAreLoggedOnceTheMinutePasses: the
// runs after a warning were logged only by a run a minute or more after
// it, so those of the last minute before a flood stopped were never
// reported. A line comes once the minute passed (one timer, however many
// runs), and none when a run logged them first.
func TestObserver_EvictionsAfterTheLastLineAreLoggedOnceTheMinutePasses(t *testing.T) {
	o := observer{apps: new(liveApps)}
	app, logs := observedApp(zapcore.DebugLevel, identities{})
	o.apps.provision(app)
	clk := testclock.New(time.Unix(1_700_000_000, 0))
	o.evictions.now = clk.Now
	var armed []time.Duration
	var due []func()
	o.evictions.after = func(d time.Duration, f func()) *time.Timer {
		armed, due = append(armed, d), append(due, f)
		return time.AfterFunc(time.Hour, func() {})
	}
	const msg = "live entries reached the cap: evicted the coldest keys"
	o.evicted(100) // the first run's line
	for range 10 {
		clk.Advance(time.Second)
		o.evicted(30)
	}
	if n := logs.FilterMessage(msg).Len(); n != 1 {
		t.Fatalf("%d warnings for 11 runs in 10 s, want 1", n)
	}
	if !slices.Equal(armed, []time.Duration{evictLogEvery - time.Second}) {
		t.Fatalf("timers armed %v, want one for the minute's end", armed)
	}
	clk.Advance(evictLogEvery)
	due[0]()
	lines := logs.FilterMessage(msg).All()
	if len(lines) != 2 {
		t.Fatalf("%d warnings once the minute passed, want 2", len(lines))
	}
	if f := lines[1].ContextMap(); f["evicted"] != int64(0) || f["evicted_since_last_line"] != int64(300) || f["runs_since_last_line"] != int64(10) {
		t.Fatalf("deferred warning %v, want evicted 0, evicted_since_last_line 300, runs_since_last_line 10", f)
	}
	// A run within the minute arms the next; a run after it logs, and the
	// timer, late, logs nothing more.
	clk.Advance(time.Second)
	o.evicted(5)
	clk.Advance(evictLogEvery)
	o.evicted(6)
	if len(due) != 2 {
		t.Fatalf("%d timers armed, want 2", len(due))
	}
	due[1]()
	lines = logs.FilterMessage(msg).All()
	if len(lines) != 3 || lines[2].ContextMap()["evicted_since_last_line"] != int64(11) {
		t.Fatalf("warnings %v, want a third reporting 11 and no more", lines)
	}
}
