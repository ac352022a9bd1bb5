package ratelimit

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/mysqltest"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// TestPrivacy_PasswordAndIdentifiersStayInside runs Caddy in-process with a
// private Redis that requires a password, given through {env.…} as the
// README recommends, and an identifier_secret: the password appears
// nowhere (status, /config/, metrics, logs), even while Redis is down and
// the breaker logs; identifiers leave the process only as their HMAC
// (admin output, the limiter's own log lines, Redis keys).
func TestPrivacy_PasswordAndIdentifiersStayInside(t *testing.T) {
	const (
		password = "pw-Zq8vN3xK-private"
		secret   = "identifier-secret-0123456789"
		id       = "sk_live_alice_private_key"
	)
	srv := redistest.Start(t, redistest.WithPassword(password))
	t.Setenv("RL_PRIVACY_REDIS_URL", srv.URL())
	t.Setenv("RL_PRIVACY_SECRET", secret)
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	hmac := identifierHMAC([]byte(secret), id)
	endpoint := fmt.Sprintf("redis://127.0.0.1:%d/0", srv.Port())

	tester, admin, base := startCaddy(t, func(admin, port int) string {
		return caddyConfig(admin, port, fmt.Sprintf(`	log {
		output file %s
		format json
		level DEBUG
	}
	ratelimit {
		redis {env.RL_PRIVACY_REDIS_URL}
		identifier_secret {env.RL_PRIVACY_SECRET}
		prefix privacy
		breaker_timeout 1m
	}`, logFile), `
	ratelimit {
		zone privacy {
			key    {http.request.header.X-Key}
			limit  3
			window 1h
		}
	}
	respond "ok"
`)
	})
	noPassword := func(where string, b []byte) {
		t.Helper()
		if bytes.Contains(b, []byte(password)) {
			t.Fatalf("%s contains the Redis password:\n%s", where, b)
		}
	}

	for i, want := range []int{200, 200, 200, 429} {
		if got := get(t, tester, base+"/", "X-Key", id).status; got != want {
			t.Fatalf("request %d: %d, want %d", i+1, got, want)
		}
	}

	// The admin output: addresses without the password, identifiers as
	// their HMAC.
	status := adminDo(t, admin, "GET", "/ratelimit/status")
	noPassword("status", status.body)
	var doc statusDoc
	status.decode(t, 200, &doc)
	if doc.Identifiers != "hmac" || doc.Origin == nil || len(doc.Origin.Endpoints) != 1 || doc.Origin.Endpoints[0].Address != endpoint {
		t.Fatalf("status: %s", status.body)
	}
	var key keyDoc
	r := adminDo(t, admin, "GET", "/ratelimit/counters?zone=privacy&identifier="+id)
	r.decode(t, 200, &key)
	if key.Identifier != hmac || key.Effective != 3 || bytes.Contains(r.body, []byte(id)) {
		t.Fatalf("counters: %s", r.body)
	}

	// The config the admin API serves holds the placeholders only.
	cfg := adminDo(t, admin, "GET", "/config/")
	noPassword("/config/", cfg.body)
	for _, s := range []string{secret, id} {
		if bytes.Contains(cfg.body, []byte(s)) {
			t.Fatalf("/config/ contains %q", s)
		}
	}
	if !bytes.Contains(cfg.body, []byte("{env.RL_PRIVACY_REDIS_URL}")) || !bytes.Contains(cfg.body, []byte("{env.RL_PRIVACY_SECRET}")) {
		t.Fatalf("/config/ lost the placeholders: %s", cfg.body)
	}

	// Redis holds the HMAC, never the identifier. The flush is
	// asynchronous: wait for it.
	rdb := srv.Client()
	redistest.Eventually(t, 10*time.Second, "the count reaches Redis", func() bool {
		keys, err := rdb.Keys(context.Background(), "privacy:*").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range keys {
			if strings.Contains(k, id) {
				t.Fatalf("Redis key %q holds the raw identifier", k)
			}
		}
		return len(keys) > 0 && strings.Contains(strings.Join(keys, " "), hmac)
	})

	// Redis goes away: new keys' reads fail until the breaker opens, and
	// the failures are logged.
	srv.Stop()
	n := 0
	redistest.Eventually(t, 30*time.Second, "the breaker opens", func() bool {
		n++
		get(t, tester, base+"/", "X-Key", fmt.Sprintf("other-%d", n))
		var d statusDoc
		adminDo(t, admin, "GET", "/ratelimit/status").decode(t, 200, &d)
		return d.Origin != nil && len(d.Origin.Endpoints) == 1 && d.Origin.Endpoints[0].Breaker == "open"
	})
	metrics := adminDo(t, admin, "GET", "/metrics").body
	noPassword("/metrics", metrics)
	if series := fmt.Sprintf(`caddy_ratelimit_origin_breaker_state{breaker="ratelimit_origin",endpoint=%q,state="open"} 1`, endpoint); !bytes.Contains(metrics, []byte(series)) {
		t.Fatalf("/metrics lacks %s", series)
	}
	noPassword("status with Redis down", adminDo(t, admin, "GET", "/ratelimit/status").body)

	// The breaker's line is written on a goroutine of its own.
	var lines []map[string]any
	redistest.Eventually(t, 10*time.Second, "the breaker's line is logged", func() bool {
		lines = readLog(t, logFile)
		return findLine(lines, "redis circuit breaker open: decisions use local counts") != nil
	})
	raw, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	noPassword("the log", raw)
	if l := findLine(lines, "redis circuit breaker open: decisions use local counts"); l["endpoint"] != endpoint || l["level"] != "warn" {
		t.Fatalf("breaker line %v", l)
	}
	if l := findLine(lines, "redis calls failing: decisions use local counts until they recover"); l == nil || l["endpoint"] != endpoint {
		t.Fatalf("failure streak line %v", l)
	}
	if l := findLine(lines, "first denial of a key in this window"); l == nil || l["identifier_hmac"] != hmac || l["zone"] != "privacy" {
		t.Fatalf("first denial line %v", l)
	}
	// The limiter's own loggers never write the identifier. (Caddy's own
	// loggers may: at debug level http.log.error logs a denied request
	// with its headers, and admin.api logs request URIs; see the README.)
	for _, l := range lines {
		name, _ := l["logger"].(string)
		if name != "ratelimit" && name != "http.handlers.ratelimit" {
			continue
		}
		b, _ := json.Marshal(l)
		if bytes.Contains(b, []byte(id)) {
			t.Fatalf("log line of %s carries the identifier: %s", name, b)
		}
		if l["level"] == "info" && l["msg"] != "redis circuit breaker half-open: probing" && l["msg"] != "redis circuit breaker closed: redis answers again" && l["msg"] != "redis calls succeed again" {
			t.Errorf("unexpected info line: %s", b)
		}
	}
}

// readLog parses a JSON log file, one object per line.
func readLog(t *testing.T, path string) []map[string]any {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []map[string]any
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err == nil {
			out = append(out, m)
		}
	}
	return out
}

func findLine(lines []map[string]any, msg string) map[string]any {
	for _, l := range lines {
		if l["msg"] == msg {
			return l
		}
	}
	return nil
}

// TestPrivacy_OverridesSetWithoutTheSecretAreNotListedUnderIt: an override
// set before identifier_secret was added (or pulled from a region without
// one) is stored with the raw identifier and no form. Under the secret it
// never matches (requests are looked up by HMAC), and the listing must not
// show it: that would put the raw identifier in the admin output. An
// override of no form that is an HMAC (a build before forms, under the
// secret) still applies and is listed.
func TestPrivacy_OverridesSetWithoutTheSecretAreNotListedUnderIt(t *testing.T) {
	resetOverrides(t)
	const (
		secret = "0123456789abcdef0123"
		id     = "sk_live_SECRETMARKER123"
	)
	tester, admin, base := startCaddy(t, overrideConfig(""))
	port := portOf(t, base)
	var doc overrideDoc
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier="+id, `{"limit": 9}`).decode(t, http.StatusOK, &doc)
	if doc.Identifier != id {
		t.Fatalf("without a secret the override is named %q", doc.Identifier)
	}

	tester.InitServer(overrideConfig("\tratelimit {\n\t\tidentifier_secret "+secret+"\n\t}")(admin, port), "caddyfile")
	old := overrideRec{Zone: "ov", Identifier: identifierHMAC([]byte(secret), "carol"), Limit: 0,
		CreatedMs: time.Now().UnixMilli(), Version: time.Now().UnixMicro()}
	overrides.merge([]overrideRec{old})
	for _, q := range []string{"", "&prefix=sk_"} {
		r := adminDo(t, admin, http.MethodGet, "/ratelimit/overrides?zone=ov"+q)
		if r.status != http.StatusOK || strings.Contains(string(r.body), id) {
			t.Fatalf("under the secret the listing%s shows the raw identifier: %d %s", q, r.status, r.body)
		}
	}
	var list overrideListDoc
	adminDo(t, admin, http.MethodGet, "/ratelimit/overrides?zone=ov").decode(t, http.StatusOK, &list)
	if len(list.Overrides) != 1 || list.Overrides[0].Identifier != old.Identifier {
		t.Fatalf("under the secret the listing is %+v, want carol's HMAC only", list.Overrides)
	}
	if n := overrides.active(); n != 1 {
		t.Fatalf("%d overrides active under the secret, want 1 (the raw one cannot match)", n)
	}
	if n := admitted(t, base, id, 3); n != 2 {
		t.Fatalf("under the secret the raw override applied: admitted %d of 3, want the zone's 2", n)
	}
}

// TestPrivacy_BlocklistShowsNoRawIdentifierUnderTheSecret: denial rows
// written without identifier_secret (by another region, or by this one
// before the secret was added) hold raw identifiers. Under the secret
// they never match a key here, and GET /ratelimit/blocklist must not show
// them: only rows whose identifier is an HMAC.
func TestPrivacy_BlocklistShowsNoRawIdentifierUnderTheSecret(t *testing.T) {
	const (
		secret = "identifier-secret-0123456789"
		id     = "sk_live_SECRETMARKER123"
	)
	srv := mysqltest.Start(t)
	dsn := srv.NewDatabase(t)
	t.Setenv("RATELIMIT_PRIVACY_MYSQL_DSN", dsn)
	t.Setenv("RATELIMIT_PRIVACY_SECRET", secret)
	_, admin, _ := startCaddy(t, mysqlConfig(`	ratelimit {
		region  test-a
		identifier_secret {env.RATELIMIT_PRIVACY_SECRET}
		mysql   {env.RATELIMIT_PRIVACY_MYSQL_DSN}
		mysql_flush 20ms
		global_sync 50ms
		blocklist_sync 50ms
		min_window 1s
	}`))
	db := mysqltest.Open(t, dsn)
	redistest.Eventually(t, 20*time.Second, "schema migrated", func() bool {
		var n int
		err := db.QueryRow(`SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name LIKE 'ratelimit_%'`).Scan(&n)
		return err == nil && n == 3
	})
	hmac := identifierHMAC([]byte(secret), "carol")
	now := time.Now().UnixMilli()
	for _, rid := range []string{id, hmac} {
		if _, err := db.Exec(`INSERT INTO ratelimit_blocklist (namespace, identifier, window_ms, sequence, origin_region, limit_units, count_cur, count_prev, expires_ms, updated_ms)
			VALUES ('e2e_mysql', ?, 60000, ?, 'test-b', 5, 6, 0, ?, ROUND(UNIX_TIMESTAMP(NOW(3)) * 1000))`, rid, now/60000, now+120000); err != nil {
			t.Fatal(err)
		}
	}
	var r adminReply
	redistest.Eventually(t, 20*time.Second, "the HMAC's row is applied", func() bool {
		r = adminDo(t, admin, http.MethodGet, "/ratelimit/blocklist")
		return r.status == http.StatusOK && bytes.Contains(r.body, []byte(hmac))
	})
	if bytes.Contains(r.body, []byte(id)) {
		t.Fatalf("under the secret the blocklist shows the raw identifier: %s", r.body)
	}
}
