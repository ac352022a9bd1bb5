package origin

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// flushScripts empties srv's script cache and its command counters, as a
// Redis restarted with the keys kept (or SCRIPT FLUSH) would leave it.
func flushScripts(t *testing.T, srv *redistest.Server) {
	t.Helper()
	ctx := ctxT(t)
	if err := srv.Client().ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if err := srv.Client().ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}
}

// scriptCalls returns srv's EVALSHA, EVAL and SCRIPT LOAD calls since its
// counters were reset.
func scriptCalls(t *testing.T, srv *redistest.Server) (evalsha, eval, load int64) {
	t.Helper()
	cs, err := srv.CommandStats(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	return cs["evalsha"], cs["eval"], cs["script|load"]
}

// checkSentTheSource fails unless the calls since flushScripts recovered
// from the lost scripts by sending their source: every EVALSHA that
// answered NOSCRIPT sent once more as EVAL (calls of them), no SCRIPT
// LOAD.
func checkSentTheSource(t *testing.T, srv *redistest.Server, calls int64) {
	t.Helper()
	evalsha, eval, load := scriptCalls(t, srv)
	if evalsha != calls || eval != calls || load != 0 {
		t.Fatalf("after SCRIPT FLUSH: %d EVALSHA, %d EVAL, %d SCRIPT LOAD; want %d, %d, 0 (each call that answered NOSCRIPT sent once with its source)",
			evalsha, eval, load, calls, calls)
	}
}

// TestRole_ScriptsFlushedBetweenCallsAreSentWithTheirSourceOnce: the
// role's pipelined scripts (Register, DenialsWritten, Import) on a Redis
// that lost its scripts between two calls. The second call succeeds, has
// its effect once, and sends each call that answered NOSCRIPT again with
// the script's source (EVAL), never SCRIPT LOAD then the same EVALSHA:
// that load may reach another server than the one that answers (see
// TestRole_AnAddressThatMovesToTheNewMasterIsFollowed).
func TestRole_ScriptsFlushedBetweenCallsAreSentWithTheirSourceOnce(t *testing.T) {
	now := time.Now().UnixMilli()
	cell := func(id string) RoleCell {
		return RoleCell{Key: engine.Key{Namespace: "z", Identifier: id, Window: time.Minute}, Sequence: 7, Limit: 10, Expires: now + 60_000}
	}
	t.Run("register", func(t *testing.T) {
		srv := redistest.Start(t)
		o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "n"})
		if err := o.Register(ctxT(t), []RoleCell{cell("a")}); err != nil {
			t.Fatal(err)
		}
		if _, err := o.TakeRegistered(ctxT(t), false, now); err != nil {
			t.Fatal(err)
		}
		flushScripts(t, srv)
		if err := o.Register(ctxT(t), []RoleCell{cell("b")}); err != nil {
			t.Fatalf("register after SCRIPT FLUSH: %v", err)
		}
		checkSentTheSource(t, srv, 1)
		got, err := o.TakeRegistered(ctxT(t), false, now)
		if err != nil || len(got) != 1 || got[0] != cell("b") {
			t.Fatalf("queued registrations %+v (%v), want b once", got, err)
		}
	})
	t.Run("denials written", func(t *testing.T) {
		srv := redistest.Start(t)
		o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "n"})
		d := func(id string) RoleDenial { return RoleDenial{Key: cell(id).Key, Sequence: 7, Row: "row-" + id} }
		if err := o.PutDenials(ctxT(t), []RoleDenial{d("a"), d("b")}); err != nil {
			t.Fatal(err)
		}
		if err := o.DenialsWritten(ctxT(t), []RoleDenial{d("a")}); err != nil {
			t.Fatal(err)
		}
		flushScripts(t, srv)
		if err := o.DenialsWritten(ctxT(t), []RoleDenial{d("b")}); err != nil {
			t.Fatalf("denials written after SCRIPT FLUSH: %v", err)
		}
		checkSentTheSource(t, srv, 1)
		if got, err := o.TakeDenials(ctxT(t)); err != nil || len(got) != 0 {
			t.Fatalf("denials still held %+v (%v), want none", got, err)
		}
	})
	t.Run("import", func(t *testing.T) {
		srv := redistest.Start(t)
		o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "h"})
		k, seq := key("imported"), nowSeq()
		if err := o.Import(ctxT(t), []RoleImport{{Key: k, Sequence: seq, Count: 40}}); err != nil {
			t.Fatal(err)
		}
		flushScripts(t, srv)
		// A second region's part arrives: the sum moves from 40 to 55.
		if err := o.Import(ctxT(t), []RoleImport{{Key: k, Sequence: seq, Count: 55}, {Key: k, Sequence: seq - 1, Count: 9}}); err != nil {
			t.Fatalf("import after SCRIPT FLUSH: %v", err)
		}
		checkSentTheSource(t, srv, 1)
		tot, err := o.Read(ctxT(t), k, seq, 1)
		if err != nil || tot.Global != 55 || tot.GlobalPrev != 9 {
			t.Fatalf("read %+v (%v), want the imports 55 and 9", tot, err)
		}
	})
}

// TestRole_AnAddressThatMovesToTheNewMasterIsFollowed: the failover of
// TestFailover_AnAddressThatMovesToTheNewMasterIsFollowed, for the role's
// pipelined scripts. The pool's connections stay with the old master, now
// a replica whose script cache its full resync emptied, while the
// connections dialled anew reach the new master. Registrations must
// reach the new master by themselves.
func TestRole_AnAddressThatMovesToTheNewMasterIsFollowed(t *testing.T) {
	oldMaster, replica := startReplicated(t)
	ctx := context.Background()
	name := redistest.StartDelayProxy(t, oldMaster.Addr(), 0)
	o := newOrigin(t, Config{Redis: []string{name.URL()}}, Options{NodeID: "dns"})
	now := time.Now().UnixMilli()
	cell := func(id string) RoleCell {
		return RoleCell{Key: engine.Key{Namespace: "z", Identifier: id, Window: time.Minute}, Sequence: 7, Limit: 10, Expires: now + 60_000}
	}
	onNewMaster := func() int64 {
		n := int64(0)
		for s := range roleShards {
			m, _ := replica.Client().HLen(ctx, o.shardKey("reg", s)).Result()
			n += m
		}
		return n
	}
	// Several shards, so the pipeline carries several calls.
	var before []RoleCell
	for i := range 8 {
		before = append(before, cell(fmt.Sprint("before-", i)))
	}
	if err := o.Register(ctxT(t), before); err != nil {
		t.Fatalf("register before the failover: %v", err)
	}
	redistest.Eventually(t, 10*time.Second, "the replica holds the registrations", func() bool { return onNewMaster() == int64(len(before)) })
	failOver(t, oldMaster, replica, name)
	var after []RoleCell
	for i := range 8 {
		after = append(after, cell(fmt.Sprint("after-", i)))
	}
	redistest.EventuallyShow(t, 10*time.Second, "the registrations reach the new master", func() (bool, string) {
		err := o.Register(ctxT(t), after)
		n := onNewMaster()
		return err == nil && n == int64(len(before)+len(after)), fmt.Sprintf("register: %v; the new master holds %d registrations of %d", err, n, len(before)+len(after))
	})
}

// TestScripts_OneCommandCallsRecoverFromAFlushWithTheSourceOnce: every
// script that runs as a command of its own (the lease and its release,
// the heartbeat, overrides put, taken and dropped, a reset's marks, a
// reservation) on a Redis that lost its scripts just before: the call
// succeeds with its effect once, its EVALSHA answered NOSCRIPT (nothing
// ran) and go-redis's Script.Run sent the source (EVAL) once, no SCRIPT
// LOAD. These passed before the role's fix too: they guard that no
// change makes them load scripts apart from the calls.
func TestScripts_OneCommandCallsRecoverFromAFlushWithTheSourceOnce(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "n"})
	c := srv.Client()
	k, seq := key("flushed"), nowSeq()
	ov := Override{Field: "z/a", Version: 3, Value: `{"limit":5}`}
	for _, tc := range []struct {
		name  string
		call  func(ctx context.Context) error
		check func(ctx context.Context) error
	}{
		{"lease", func(ctx context.Context) error {
			_, err := o.Lease(ctx, time.Minute)
			return err
		}, func(ctx context.Context) error {
			if h, err := o.LeaseHolder(ctx); err != nil || h != "n" {
				return fmt.Errorf("holder %q (%v), want n", h, err)
			}
			return nil
		}},
		{"release", o.ReleaseLease, func(ctx context.Context) error {
			if h, err := o.LeaseHolder(ctx); err != nil || h != "" {
				return fmt.Errorf("holder %q (%v), want none", h, err)
			}
			return nil
		}},
		{"heartbeat", func(ctx context.Context) error {
			n, err := o.Heartbeat(ctx, time.Minute)
			if err == nil && n != 1 {
				err = fmt.Errorf("%d processes, want 1", n)
			}
			return err
		}, func(ctx context.Context) error {
			if n, err := c.ZCard(ctx, o.processesKey()).Result(); err != nil || n != 1 {
				return fmt.Errorf("%d records (%v), want 1", n, err)
			}
			return nil
		}},
		{"put overrides", func(ctx context.Context) error {
			n, err := o.PutOverrides(ctx, []Override{ov}, true)
			if err == nil && n != 1 {
				err = fmt.Errorf("%d took, want 1", n)
			}
			return err
		}, func(ctx context.Context) error {
			if n, err := c.LLen(ctx, o.overridesKey()+":q").Result(); err != nil || n != 1 {
				return fmt.Errorf("%d queued (%v), want 1", n, err)
			}
			return nil
		}},
		{"take overrides", func(ctx context.Context) error {
			got, err := o.TakeOverrides(ctx, false)
			if err == nil && (len(got) != 1 || got[0] != ov) {
				err = fmt.Errorf("took %+v, want %+v once", got, ov)
			}
			return err
		}, func(ctx context.Context) error {
			if n, err := c.LLen(ctx, o.overridesKey()+":q").Result(); err != nil || n != 0 {
				return fmt.Errorf("%d still queued (%v), want 0", n, err)
			}
			return nil
		}},
		{"drop overrides", func(ctx context.Context) error { return o.DropOverrides(ctx, []Override{ov}) }, func(ctx context.Context) error {
			if ok, err := c.HExists(ctx, o.overridesKey(), ov.Field).Result(); err != nil || ok {
				return fmt.Errorf("the override is still held (%v)", err)
			}
			return nil
		}},
		{"reserve", func(ctx context.Context) error {
			r := reservation(k, seq, 0, 4, 100)
			err := o.Reserve(ctx, r)
			if err == nil && (!r.Admitted || r.Totals.Cur != 4) {
				err = fmt.Errorf("reservation %+v, want admitted at 4", r)
			}
			return err
		}, func(ctx context.Context) error {
			if n, err := cellTotal(ctx, c, DefaultPrefix, k, seq); err != nil || n != 4 {
				return fmt.Errorf("the cell holds %d (%v), want 4: charged once", n, err)
			}
			return nil
		}},
		{"reset", func(ctx context.Context) error { return o.ResetCells(ctx, k, seq, 0) }, func(ctx context.Context) error {
			tot, err := o.Peek(ctx, k, seq)
			if err != nil || tot.Cur != 0 {
				return fmt.Errorf("the reset cell says %d (%v), want 0", tot.Cur, err)
			}
			if r, err := c.HGet(ctx, cellKey(DefaultPrefix, k, seq), "r").Int64(); err != nil || r != 4 {
				return fmt.Errorf("the reset mark is %d (%v), want 4", r, err)
			}
			return nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			flushScripts(t, srv)
			if err := tc.call(ctxT(t)); err != nil {
				t.Fatalf("after SCRIPT FLUSH: %v", err)
			}
			checkSentTheSource(t, srv, 1)
			if err := tc.check(ctxT(t)); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// scriptless starts a real redis-server with EVAL and EVALSHA renamed
// away, as a redis.conf with rename-command EVALSHA "" and EVAL "" does.
func scriptless(t *testing.T) *redistest.Server {
	return redistest.Start(t, redistest.WithArgs("--rename-command", "EVALSHA", "", "--rename-command", "EVAL", ""))
}

// TestBreaker_ARedisThatRefusesScriptsOpensItAndSaysWhy: a server with
// EVAL and EVALSHA renamed away answers every call with ERR unknown
// command 'evalsha'. That reply said nothing to the breaker (an error of
// one key's, it took it for), so both breakers stayed closed and every
// cold read paid a round trip that always failed, and the status showed
// Redis's bare reply, keys included. Now the whole call counts as failed,
// both breakers open (a read is then refused without I/O), and the
// status, the errors and the restart watch's first read (at startup) say
// that the server refuses scripts and that the module needs them, without
// the keys Redis echoes.
func TestBreaker_ARedisThatRefusesScriptsOpensItAndSaysWhy(t *testing.T) {
	srv := scriptless(t)
	var refused struct {
		sync.Mutex
		addr string
		err  error
	}
	cfg := Config{Redis: []string{srv.URL()}, Breaker: BreakerConfig{Timeout: Duration(time.Minute)}}
	o := newOrigin(t, cfg, Options{NodeID: "noscripts", OnScriptsRefused: func(addr string, err error) {
		refused.Lock()
		refused.addr, refused.err = addr, err
		refused.Unlock()
	}})
	o.WatchRestarts(20*time.Millisecond, func() {})
	redistest.Eventually(t, 5*time.Second, "the watch reports the refused scripts", func() bool {
		refused.Lock()
		defer refused.Unlock()
		return refused.err != nil
	})
	refused.Lock()
	if refused.addr != srv.URL() || !errors.Is(refused.err, ErrScriptsRefused) || !strings.Contains(refused.err.Error(), "unknown command 'eval'") {
		t.Errorf("the watch reported %s: %v; want %s, ErrScriptsRefused with the reply", refused.addr, refused.err, srv.URL())
	}
	refused.Unlock()

	k, seq := key("zelda-secret-id"), nowSeq()
	var readErr, flushErr error
	redistest.EventuallyShow(t, 10*time.Second, "both breakers open on a server that refuses scripts", func() (bool, string) {
		if err := requestRead(o, k, seq); !errors.Is(err, ErrBreakerOpen) {
			readErr = err
		}
		if err := o.Flush(ctxT(t), []engine.Delta{{Key: k, Sequence: seq, Delta: 1, Own: 1}}); !errors.Is(err, ErrBreakerOpen) {
			flushErr = err
		}
		st := o.Stats().Endpoints[0]
		return st.Breaker == BreakerOpen && st.ReplayBreaker == BreakerOpen,
			fmt.Sprintf("breakers %s/%s, last error %q", st.Breaker, st.ReplayBreaker, st.LastError)
	})
	for name, err := range map[string]error{"read": readErr, "flush": flushErr} {
		if !errors.Is(err, ErrScriptsRefused) {
			t.Errorf("a %s's error %v does not wrap ErrScriptsRefused", name, err)
		}
	}
	st := o.Stats().Endpoints[0]
	if !strings.Contains(st.LastError, "refuses Lua scripts (EVAL/EVALSHA disabled or renamed") ||
		!strings.Contains(st.LastError, "unknown command 'evalsha'") || strings.Contains(st.LastError, "zelda") {
		t.Errorf("the status's last error %q: want it to say the server refuses scripts, with its reply and without the key", st.LastError)
	}
	sent := st.RoundTrips
	if err := requestRead(o, k, seq); !errors.Is(err, ErrBreakerOpen) {
		t.Fatalf("a read with the breaker open: %v, want ErrBreakerOpen", err)
	}
	if st := o.Stats().Endpoints[0]; st.RoundTrips != sent {
		t.Fatalf("a read with the breaker open made %d round trips", st.RoundTrips-sent)
	}
	// The role's pipelined scripts say it as well.
	if err := o.Register(ctxT(t), []RoleCell{{Key: k, Sequence: seq, Limit: 1, Expires: time.Now().UnixMilli() + 60_000}}); !errors.Is(err, ErrScriptsRefused) {
		t.Fatalf("register on a server that refuses scripts: %v, want ErrScriptsRefused", err)
	}
}

// TestExplainScripts_OnlyARefusedScriptCommandIsTheServersRefusal: the
// replies that say a server (or a proxy) will not run script commands
// become ErrScriptsRefused and count against the breaker; an error inside
// a script that ran, or a refusal of another command, do not change.
func TestExplainScripts_OnlyARefusedScriptCommandIsTheServersRefusal(t *testing.T) {
	for _, tc := range []struct {
		reply   string
		refused bool
		counts  bool
	}{
		{"ERR unknown command 'evalsha', with args beginning with: 'abc' '2' 'rl:{api}:secret'", true, true},
		{"ERR unknown command `EVALSHA`, with args beginning with: `abc`, ", true, true}, // Redis 5
		{"ERR unknown command 'eval', with args beginning with: 'return 1' '0'", true, true},
		{"NOPERM User limiter has no permissions to run the 'evalsha' command", true, true},
		{"ERR unsupported command 'EVALSHA'", true, true}, // a proxy
		{"ERR unknown command 'hmget', with args beginning with: 'evalsha'", false, false},
		{"ERR user_script:3: Unknown Redis command called from script script: abc, on @user_script:3.", false, false},
		{"ERR Error running script (call to f_abc): @user_script:1: WRONGTYPE", false, false},
		{"READONLY You can't write against a read only replica.", false, true},
		{"ERR Protocol error: unauthenticated multibulk length", false, true},
		{"ERR Protocol error: unauthenticated bulk length", false, true},
	} {
		err := explainScripts(replyError(tc.reply))
		if got := errors.Is(err, ErrScriptsRefused); got != tc.refused {
			t.Errorf("%q: refused %v, want %v (%v)", tc.reply, got, tc.refused, err)
		}
		if got := countsAgainst(err); got != tc.counts {
			t.Errorf("%q: counts against the breaker %v, want %v", tc.reply, got, tc.counts)
		}
		if strings.Contains(err.Error(), "secret") {
			t.Errorf("%q: the error shows the keys: %v", tc.reply, err)
		}
	}
}

// replyError is an error reply as go-redis hands it over: a redis.Error.
type replyError string

func (e replyError) Error() string { return string(e) }
func (replyError) RedisError()     {}

// TestScripts_EveryCallOnAServerThatRefusesScriptsSaysSo: on a server
// with EVAL and EVALSHA renamed away, every call that runs a script (the
// role's, the heartbeat, overrides, resets, reservations) fails with
// ErrScriptsRefused, and no error shows the keys Redis echoes (a reset's
// keys and an override's field name an identifier).
func TestScripts_EveryCallOnAServerThatRefusesScriptsSaysSo(t *testing.T) {
	srv := scriptless(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "n"})
	k, seq := key("secret-tenant"), nowSeq()
	ov := Override{Field: "z/secret-tenant", Version: 1, Value: "{}"}
	for name, call := range map[string]func(ctx context.Context) error{
		"lease":   func(ctx context.Context) error { _, err := o.Lease(ctx, time.Minute); return err },
		"release": o.ReleaseLease,
		"heartbeat": func(ctx context.Context) error {
			_, err := o.Heartbeat(ctx, time.Minute)
			return err
		},
		"put overrides": func(ctx context.Context) error {
			_, err := o.PutOverrides(ctx, []Override{ov}, true)
			return err
		},
		"take overrides": func(ctx context.Context) error {
			_, err := o.TakeOverrides(ctx, false)
			return err
		},
		"drop overrides": func(ctx context.Context) error { return o.DropOverrides(ctx, []Override{ov}) },
		"reset":          func(ctx context.Context) error { return o.ResetCells(ctx, k, seq, 0) },
		"reserve":        func(ctx context.Context) error { return o.Reserve(ctx, reservation(k, seq, 0, 1, 10)) },
		"denials written": func(ctx context.Context) error {
			return o.DenialsWritten(ctx, []RoleDenial{{Key: k, Sequence: seq, Row: "r"}})
		},
		"import": func(ctx context.Context) error {
			return o.Import(ctx, []RoleImport{{Key: k, Sequence: seq, Count: 1}})
		},
	} {
		err := call(ctxT(t))
		if !errors.Is(err, ErrScriptsRefused) || strings.Contains(err.Error(), "secret-tenant") {
			t.Errorf("%s: %v; want ErrScriptsRefused, without the keys", name, err)
		}
	}
}
