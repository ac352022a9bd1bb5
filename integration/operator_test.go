package integration

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// The control plane as an operator meets it, on real Caddy processes: the
// answers of the admin API's routes, the README's promises about them.

// adminCall is one admin request's status and body.
func adminCall(t *testing.T, admin int, method, path, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, fmt.Sprintf("http://localhost:%d%s", admin, path), bytes.NewBufferString(body))
	if err != nil {
		t.Fatal(err)
	}
	// A connection of its own: a reload replaces the admin server, which
	// closes its idle connections, and a PUT or DELETE sent on one as it
	// goes is not sent again.
	req.Close = true
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// operatorSite is a zone limited to 3 whose identifier is the X-Key
// header, with a Caddyfile override of "vip" to 7.
const operatorSite = `	ratelimit {
		zone per_key {
			key      {http.request.header.X-Key}
			limit    3
			window   10m
			override vip 7
		}
		headers off
	}
	respond "ok"`

// TestOperator_AChangeWithRedisDownIsStoredNowhere: the region's Redis is
// down (the process is gone: the node's connection to it is refused). A
// runtime override's change then never reached Redis, and the README
// promises a 503 saying it is stored nowhere; the answer said the region
// "may hold the change", which sends an operator looking for a change
// that cannot exist. A region reset answers the same.
func TestOperator_AChangeWithRedisDownIsStoredNowhere(t *testing.T) {
	srv := redisAndCaddy(t, "starts Caddy and Redis")
	n := startNode(t, fmt.Sprintf("\t\tregion eu-west-1\n\t\tredis %s\n\t\tfast_tick 10ms", srv.URL()), operatorSite)
	path := "/ratelimit/overrides?zone=per_key&identifier=key-alice"
	if s, b := adminCall(t, n.admin, http.MethodPut, path, `{"limit": 5}`); s != http.StatusOK {
		t.Fatalf("PUT with Redis up: %d %s", s, b)
	}
	srv.Stop()
	for _, c := range []struct{ method, path, body string }{
		{http.MethodPut, path, `{"limit": 50}`},
		{http.MethodDelete, path, ""},
		{http.MethodPut, "/ratelimit/overrides?zone=per_key&identifier=key-bob", `{"limit": 50}`},
	} {
		s, b := adminCall(t, n.admin, c.method, c.path, c.body)
		t.Logf("%s %s with Redis down: %d %s", c.method, c.path, s, strings.TrimSpace(b))
		if s != http.StatusServiceUnavailable {
			t.Fatalf("%s with Redis down: %d %s, want 503", c.method, s, b)
		}
		if !strings.Contains(b, "did not take the change") || strings.Contains(b, "may hold") {
			t.Fatalf("%s with Redis refusing connections answered %q: the change never reached Redis, and the answer must say it is stored nowhere", c.method, b)
		}
	}
	// Nothing changed on the node.
	s, b := adminCall(t, n.admin, http.MethodGet, path, "")
	if s != http.StatusOK || !strings.Contains(b, `"limit":5,`) {
		t.Fatalf("the override after the refused changes: %d %s, want the limit of 5", s, b)
	}
	if s, b := adminCall(t, n.admin, http.MethodGet, "/ratelimit/overrides?zone=per_key&identifier=key-bob", ""); s != http.StatusNotFound {
		t.Fatalf("key-bob after its refused change: %d %s, want 404", s, b)
	}
	s, b = adminCall(t, n.admin, http.MethodDelete, "/ratelimit/counters?zone=per_key&identifier=key-alice&scope=region", "")
	if s != http.StatusServiceUnavailable || strings.Contains(b, "may hold") {
		t.Fatalf("a region reset with Redis down: %d %s, want a 503 that says it is stored nowhere", s, b)
	}
}

// TestOperator_AListingsPrefixThatIsNotUTF8 (README, "Admin API"): "a
// listing's prefix that is not valid UTF-8 comes back with prefix_hex".
// The listing of the counters did; that of the runtime overrides showed
// U+FFFD alone, so that prefixes a\x80 and a\x81 read alike.
func TestOperator_AListingsPrefixThatIsNotUTF8(t *testing.T) {
	srv := redisAndCaddy(t, "starts Caddy and Redis")
	n := startNode(t, fmt.Sprintf("\t\tregion eu-west-1\n\t\tredis %s\n\t\tfast_tick 10ms", srv.URL()), operatorSite)
	if s, b := adminCall(t, n.admin, http.MethodPut, "/ratelimit/overrides?zone=per_key&identifier=a%80z", `{"limit": 6}`); s != http.StatusOK {
		t.Fatalf("PUT: %d %s", s, b)
	}
	for _, route := range []string{"counters", "overrides"} {
		var doc struct {
			Prefix    string `json:"prefix"`
			PrefixHex string `json:"prefix_hex"`
		}
		s, b := adminCall(t, n.admin, http.MethodGet, "/ratelimit/"+route+"?zone=per_key&prefix=a%80", "")
		if s != http.StatusOK {
			t.Fatalf("GET %s: %d %s", route, s, b)
		}
		if err := json.Unmarshal([]byte(b), &doc); err != nil {
			t.Fatal(err)
		}
		if doc.PrefixHex != "6180" {
			t.Errorf("the %s listing of prefix a\\x80 answered %s: want prefix_hex 6180", route, b)
		}
	}
}

// overrideOn reads the runtime override's limit on a node, -1 without one.
func overrideOn(t *testing.T, admin int, zone, id string) int64 {
	t.Helper()
	s, b := adminCall(t, admin, http.MethodGet, "/ratelimit/overrides?zone="+zone+"&identifier="+urlQueryEscape(id), "")
	switch s {
	case http.StatusNotFound:
		return -1
	case http.StatusOK:
		var doc struct {
			Limit int64 `json:"limit"`
		}
		if err := json.Unmarshal([]byte(b), &doc); err != nil {
			t.Fatal(err)
		}
		return doc.Limit
	}
	t.Fatalf("GET override: %d %s", s, b)
	return 0
}

// TestOperator_BadInputChangesNothing: every malformed change of the
// control plane is a 4xx with a JSON error, and leaves the override it
// aimed at, in every region, as it was (README: "Nothing is stored
// then"). Checked on a cluster of two regions × two nodes, each change
// sent to a node of region A, the result read on a node of region B after
// a good change sent later has arrived there (the bad ones, had they been
// stored, would have arrived before it).
func TestOperator_BadInputChangesNothing(t *testing.T) {
	c := startCluster(t, clusterSpec{regions: 2, nodes: 2, limit: 3, window: pickWindow(2 * time.Minute)})
	a, b := c.regions[0][0], c.regions[1][1]
	key := freshKey("bad-input")
	path := "/ratelimit/overrides?zone=global&identifier=" + urlQueryEscape(key)
	if s, body := adminCall(t, a.admin, http.MethodPut, path, `{"limit": 5, "reason": "baseline"}`); s != http.StatusOK {
		t.Fatalf("PUT: %d %s", s, body)
	}
	past := time.Now().Add(-time.Minute).UTC().Format(time.RFC3339)
	bad := []struct {
		method, path, body string
		want               int
	}{
		{http.MethodPut, "/ratelimit/overrides?zone=nope&identifier=" + urlQueryEscape(key), `{"limit": 9}`, http.StatusNotFound},
		{http.MethodPut, "/ratelimit/overrides?zone=global", `{"limit": 9}`, http.StatusBadRequest},
		{http.MethodPut, "/ratelimit/overrides?zone=global&identifier=", `{"limit": 9}`, http.StatusBadRequest},
		{http.MethodPut, path + "&identifier=other", `{"limit": 9}`, http.StatusBadRequest},
		{http.MethodPut, path + "&scope=global", `{"limit": 9}`, http.StatusBadRequest},
		{http.MethodPut, path, `{"limit": -1}`, http.StatusBadRequest},
		{http.MethodPut, path, `{"limit": 9007199254740992}`, http.StatusBadRequest},
		{http.MethodPut, path, `{"limit": 1e30}`, http.StatusBadRequest},
		{http.MethodPut, path, `{"limit": "9"}`, http.StatusBadRequest},
		{http.MethodPut, path, `{"limit": 9.5}`, http.StatusBadRequest},
		{http.MethodPut, path, `{"limit": null}`, http.StatusBadRequest},
		{http.MethodPut, path, `{}`, http.StatusBadRequest},
		{http.MethodPut, path, ``, http.StatusBadRequest},
		{http.MethodPut, path, `limit=9`, http.StatusBadRequest},
		{http.MethodPut, path, `{"limit": 9, "expires": "` + past + `"}`, http.StatusBadRequest},
		{http.MethodPut, path, `{"limit": 9, "expires": "tomorrow"}`, http.StatusBadRequest},
		{http.MethodPut, path, `{"limit": 9, "expires": 1795833940}`, http.StatusBadRequest},
		{http.MethodPut, path, `{"limit": 9, "plan": "gold"}`, http.StatusBadRequest},
		{http.MethodPut, path, `{"limit": 9, "limit": 10}`, http.StatusBadRequest},
		{http.MethodPut, path, `{"LIMIT": 9}`, http.StatusBadRequest},
		{http.MethodPut, path, `{"limit": 9} {"limit": 10}`, http.StatusBadRequest},
		{http.MethodPut, path, `{"limit": 9, "reason": "` + strings.Repeat("r", 513) + `"}`, http.StatusBadRequest},
		{http.MethodPut, path, `{"limit": 9, "reason": "` + strings.Repeat("r", 70<<10) + `"}`, http.StatusBadRequest},
		{http.MethodPut, path, "{\"limit\": 9, \"reason\": \"\xff\"}", http.StatusBadRequest},
		{http.MethodPost, path, `{"limit": 9}`, http.StatusMethodNotAllowed},
		{http.MethodPatch, path, `{"limit": 9}`, http.StatusMethodNotAllowed},
		{http.MethodDelete, "/ratelimit/overrides?zone=global", "", http.StatusBadRequest},
		{http.MethodDelete, "/ratelimit/overrides?zone=nope&identifier=" + urlQueryEscape(key), "", http.StatusNotFound},
		{http.MethodDelete, "/ratelimit/counters?zone=global&identifier=" + urlQueryEscape(key) + "&scope=everywhere", "", http.StatusBadRequest},
		{http.MethodDelete, "/ratelimit/counters?zone=global&identifier=" + urlQueryEscape(key) + "&scope=", "", http.StatusBadRequest},
		{http.MethodGet, "/ratelimit/counters?zone=global&identifier=" + urlQueryEscape(key) + "&scope=global", "", http.StatusBadRequest},
		{http.MethodPut, "/ratelimit/counters?zone=global&identifier=" + urlQueryEscape(key), "", http.StatusMethodNotAllowed},
		{http.MethodGet, "/ratelimit/overrides?zone=global&max=0", "", http.StatusBadRequest},
		{http.MethodGet, "/ratelimit/overrides?zone=global&max=10001", "", http.StatusBadRequest},
		{http.MethodGet, "/ratelimit/overrides?zone=global&prefix=x&identifier=x", "", http.StatusBadRequest},
		{http.MethodGet, "/ratelimit/overrides?zone=global&identifier=%zz", "", http.StatusBadRequest},
	}
	for _, x := range bad {
		s, body := adminCall(t, a.admin, x.method, x.path, x.body)
		var doc struct {
			Error string `json:"error"`
		}
		if s != x.want || json.Unmarshal([]byte(body), &doc) != nil || doc.Error == "" {
			t.Errorf("%s %.80s %.60q: %d %.200s, want %d with a JSON error", x.method, x.path, x.body, s, body, x.want)
		}
		if strings.Contains(doc.Error, key) {
			t.Errorf("%s %.80s: the error names the identifier: %s", x.method, x.path, doc.Error)
		}
	}
	// A good change after the bad ones: once region B holds it, it would
	// hold any bad one that had been stored before it.
	marker := freshKey("marker")
	if s, body := adminCall(t, a.admin, http.MethodPut, "/ratelimit/overrides?zone=global&identifier="+urlQueryEscape(marker), `{"limit": 1}`); s != http.StatusOK {
		t.Fatalf("PUT marker: %d %s", s, body)
	}
	redistest.Eventually(t, 10*time.Second, "the marker in region B", func() bool { return overrideOn(t, b.admin, "global", marker) == 1 })
	for _, n := range c.all() {
		if got := overrideOn(t, n.admin, "global", key); got != 5 {
			t.Errorf("node of %s holds the override at %d after the bad changes, want 5", n.region, got)
		}
	}
}

// reloadFile loads n's Caddyfile again through POST /load, as an
// operator's `caddy reload` does.
func (n *regionNode) reloadFile(t *testing.T) {
	t.Helper()
	cfg, err := os.ReadFile(n.file)
	if err != nil {
		t.Fatal(err)
	}
	n.config = string(cfg)
	if s, b := n.reload(t); s != http.StatusOK {
		t.Fatalf("reload of a node of %s: %d %s", n.region, s, b)
	}
}

// TestOperator_GlobalResetThenAReloadAndARestart: two regions × two
// nodes, a key at its limit everywhere. A global reset on a node of A,
// then at once a reload of a node of B and a restart of a node of A (a
// new process of region A in place of the old one): every node, the
// reloaded and the new one included, starts the key over, and the
// fleet, sent requests one at a time further apart than the cross-region
// bound, admits the limit again and no more; every node then counts the
// limit, no more.
func TestOperator_GlobalResetThenAReloadAndARestart(t *testing.T) {
	const limit = 4
	c := startCluster(t, clusterSpec{regions: 2, nodes: 2, limit: limit, window: pickWindow(3 * time.Minute)})
	key := freshKey("reset-reload")
	c.dumpOnFailure(key)
	for _, n := range c.all() {
		for i := 0; i < limit; i++ {
			sendKey(loadClient, n.url("/"), key)
		}
	}
	reachAll(t, c.all(), key, http.StatusTooManyRequests, "the key denied everywhere")
	replayed(t, c.all())
	if s, b := adminCall(t, c.regions[0][0].admin, http.MethodDelete, "/ratelimit/counters?zone=global&scope=global&identifier="+urlQueryEscape(key), ""); s != http.StatusOK {
		t.Fatalf("DELETE scope=global: %d %s", s, b)
	}
	c.regions[1][1].reloadFile(t)
	c.regions[0][1].stop()
	c.regions[0][1] = c.startNode(0)
	c.regions[0][1].waitReady(t)
	nodes := c.all()
	redistest.EventuallyShow(t, 10*time.Second, "every node counts nothing of the key", func() (bool, string) {
		for i, n := range nodes {
			if kc, ok := n.counters(key); ok && kc.Effective != 0 {
				return false, fmt.Sprintf("node %d (%s): %+v", i, n.region, kc)
			}
		}
		return true, ""
	})
	bound := time.Duration(1.2 * float64(testFlush+testGlobalSync))
	admitted := 0
	var answers []string
	for i := 0; i < 3*limit; i++ {
		n := nodes[i%len(nodes)]
		s := sendKey(loadClient, n.url("/"), key)
		answers = append(answers, fmt.Sprintf("%s:%d", n.region, s))
		if s == http.StatusOK {
			admitted++
			// What a node admitted reaches every node of both regions
			// within the bound; wait until every node counts it, as
			// the key's next requests would have if they came later.
			want := int64(admitted)
			redistest.EventuallyShow(t, 10*bound, "every node counts what the fleet admitted since the reset", func() (bool, string) {
				for i, n := range nodes {
					if kc, ok := n.counters(key); !ok || kc.Effective != want {
						return false, fmt.Sprintf("%d admitted; node %d (%s): %+v (%v)", want, i, n.region, kc, ok)
					}
				}
				return true, ""
			})
		}
	}
	t.Logf("after the reset: %v", answers)
	if admitted != limit {
		t.Fatalf("after the global reset, a reload and a restart the fleet admitted %d, want the limit of %d: %v", admitted, limit, answers)
	}
	redistest.EventuallyShow(t, 10*time.Second, "every node counts the limit", func() (bool, string) {
		for i, n := range nodes {
			if kc, ok := n.counters(key); !ok || kc.Effective != limit {
				return false, fmt.Sprintf("node %d (%s): %+v (%v)", i, n.region, kc, ok)
			}
		}
		return true, ""
	})
}

// readmeExample is one `$ curl …` line of the README's admin API section
// and the answer the README shows for it.
type readmeExample struct {
	command, answer string
}

// readmeAdminExamples reads the console blocks of the README's "Admin
// API" section.
func readmeAdminExamples(t *testing.T) []readmeExample {
	t.Helper()
	b, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	start, end := strings.Index(s, "### Admin API"), strings.Index(s, "### Metrics")
	if start < 0 || end < start {
		t.Fatal("README.md has no Admin API section before Metrics")
	}
	var out []readmeExample
	var cur *readmeExample
	in, cont := false, false
	for _, line := range strings.Split(s[start:end], "\n") {
		switch {
		case strings.HasPrefix(line, "```console"):
			in = true
			continue
		case strings.HasPrefix(line, "```"):
			in, cur = false, nil
			continue
		case !in:
			continue
		}
		switch {
		case cont && cur != nil:
			cur.command += " " + strings.TrimSuffix(strings.TrimSpace(line), `\`)
			cont = strings.HasSuffix(line, `\`)
		case strings.HasPrefix(line, "$ "):
			out = append(out, readmeExample{command: strings.TrimSuffix(strings.TrimPrefix(line, "$ "), `\`)})
			cur = &out[len(out)-1]
			cont = strings.HasSuffix(line, `\`)
		case cur != nil:
			cur.answer += line + "\n"
		}
	}
	return out
}

// jsonNames are the object member names of a JSON text (or the README's
// abbreviated JSON, with "…"), in a set.
func jsonNames(s string) map[string]bool {
	names := map[string]bool{}
	for _, part := range strings.Split(s, `":`)[:max(0, strings.Count(s, `":`))] {
		if i := strings.LastIndex(part, `"`); i >= 0 {
			names[part[i+1:]] = true
		}
	}
	return names
}

// readmeTime is an RFC 3339 time in a README example.
var readmeTime = regexp.MustCompile(`\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ`)

// TestOperator_TheREADMEsAdminExamplesRunAsWritten runs every curl line of
// the README's "Admin API" section, as written but for the admin address,
// against a Caddy process set up as the examples are (zone per_key on the
// X-API-Key header, limit 5, a minute, region eu-west-1 with Redis and
// MySQL, key-alice sent past its limit), and compares each answer with the
// one the README shows: the same names (a superset where the README
// abbreviates with "…", or shows the cross-region section as null), an
// error where it shows one. The node's Redis user is the README's (its
// ACL SETUSER line): after the examples, an operator's FLUSHALL, the
// region's builds read and a count written, Redis's ACL LOG must be
// empty.
func TestOperator_TheREADMEsAdminExamplesRunAsWritten(t *testing.T) {
	requireBinary(t, "curl") // the README's examples are curl lines
	srv := redisAndCaddy(t, "starts Caddy, Redis and MariaDB")
	userURL := readmeRedisUser(t, srv)
	dsn := sharedMySQL.Get(t).NewDatabase(t)
	n := startNode(t, fmt.Sprintf("\t\tregion eu-west-1\n\t\tredis %s\n\t\tfast_tick 10ms\n\t\tmysql %s\n\t\tmysql_flush 100ms\n\t\tglobal_sync 200ms",
		userURL, dsn), `	ratelimit {
		zone per_key {
			key    {http.request.header.X-API-Key}
			limit  5
			window 1m
		}
	}
	respond "ok"`)
	rn := &regionNode{node: n, region: "eu-west-1"}
	rn.waitReady(t)
	for _, id := range []string{"key-alice", "key-alice", "key-alice", "key-alice", "key-alice", "key-alice", "key-bob"} {
		req, _ := http.NewRequest(http.MethodGet, n.url("/"), nil)
		req.Header.Set("X-API-Key", id)
		resp, err := loadClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	examples := readmeAdminExamples(t)
	if len(examples) < 8 {
		t.Fatalf("found %d examples in the README's Admin API section", len(examples))
	}
	for _, ex := range examples {
		cmd := strings.ReplaceAll(ex.command, "localhost:2019", fmt.Sprintf("localhost:%d", n.admin))
		// An expiry the calendar has passed since the README was written
		// moves a month ahead (one in the past is a 400, rightly).
		cmd = readmeTime.ReplaceAllStringFunc(cmd, func(ts string) string {
			if at, err := time.Parse(time.RFC3339, ts); err == nil && at.Before(time.Now()) {
				return time.Now().AddDate(0, 1, 0).UTC().Format(time.RFC3339)
			}
			return ts
		})
		out, err := exec.Command("sh", "-c", cmd).Output()
		if err != nil {
			t.Errorf("%s: %v", ex.command, err)
			continue
		}
		got := string(out)
		var v any
		if err := json.Unmarshal(out, &v); err != nil {
			t.Errorf("%s answered %q: not JSON", ex.command, got)
			continue
		}
		want, have := jsonNames(ex.answer), jsonNames(got)
		for name := range want {
			if !have[name] {
				t.Errorf("%s: the README shows %q, the answer has none:\n%s", ex.command, name, got)
			}
		}
		abbreviated := strings.Contains(ex.answer, "…") || strings.Contains(ex.answer, `"propagation": null`)
		for name := range have {
			if !want[name] && !abbreviated {
				t.Errorf("%s: the answer has %q, which the README does not show:\n%s", ex.command, name, got)
			}
		}
		if strings.Contains(ex.answer, `"error"`) != strings.Contains(got, `"error"`) {
			t.Errorf("%s: the README shows %s, the answer is %s", ex.command, ex.answer, got)
		}
		t.Logf("%s\n%s", ex.command, got)
	}
	// An operator's FLUSHALL: the restart watch sets its mark again and
	// the node writes back its overrides and counts, as the user too.
	ctx := t.Context()
	if err := srv.Client().FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	redistest.Eventually(t, 10*time.Second, "the restart mark set again", func() bool {
		n, err := srv.Client().Exists(ctx, "ratelimit:{mark}").Result()
		return err == nil && n == 1
	})
	redistest.EventuallyShow(t, 10*time.Second, "the builds read and the role held", func() (bool, string) {
		var st struct {
			Origin struct {
				Builds []struct {
					Processes int64 `json:"processes"`
				} `json:"builds"`
			} `json:"origin"`
			Propagation struct {
				Role string `json:"role"`
			} `json:"propagation"`
		}
		err := rn.adminGet("/ratelimit/status", &st)
		return err == nil && len(st.Origin.Builds) == 1 && st.Propagation.Role == "holder", fmt.Sprintf("%+v %v", st, err)
	})
	req, _ := http.NewRequest(http.MethodGet, n.url("/"), nil)
	req.Header.Set("X-API-Key", "key-carol") // a count after the flush
	resp, err := loadClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	redistest.Eventually(t, 10*time.Second, "key-carol's count in Redis", func() bool {
		keys, err := srv.Client().Keys(ctx, "ratelimit:{per_key:key-carol}:*").Result()
		return err == nil && len(keys) > 0
	})
}

// readmeRedisUser makes, in srv, the Redis user of the README's "The
// Redis user" (its ACL SETUSER line as written, the password aside), and
// returns srv's URL with that user.
func readmeRedisUser(t *testing.T, srv *redistest.Server) string {
	t.Helper()
	b, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	var line string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "ACL SETUSER ratelimit ") {
			line = l
		}
	}
	if line == "" {
		t.Fatal("README.md has no ACL SETUSER ratelimit line")
	}
	var args []any
	for _, f := range strings.Fields(line) {
		args = append(args, strings.Replace(f, ">CHANGE-ME", ">readme-pw", 1))
	}
	if err := srv.Client().Do(t.Context(), args...).Err(); err != nil {
		t.Fatalf("%s: %v", line, err)
	}
	if err := srv.Client().Do(t.Context(), "ACL", "LOG", "RESET").Err(); err != nil {
		t.Fatal(err)
	}
	// At the end, whatever failed first: what Redis refused the user.
	t.Cleanup(func() {
		denied, err := srv.Client().Do(context.Background(), "ACL", "LOG").Slice()
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range denied {
			t.Errorf("Redis refused the README's user: %v", e)
		}
	})
	return strings.Replace(srv.URL(), "redis://", "redis://ratelimit:readme-pw@", 1)
}

// limitsEverywhere waits until every node applies want to id, as its
// counters route shows (after a request of the key on each node, so
// that each holds the key).
func limitsEverywhere(t *testing.T, nodes []*regionNode, id string, want int64, what string) {
	t.Helper()
	for _, n := range nodes {
		sendKey(loadClient, n.url("/"), id)
	}
	redistest.EventuallyShow(t, 10*time.Second, what, func() (bool, string) {
		for i, n := range nodes {
			if kc, ok := n.counters(id); !ok || kc.Limit != want {
				return false, fmt.Sprintf("want %d; node %d (%s): %+v (%v)", want, i, n.region, kc, ok)
			}
		}
		return true, ""
	})
}

// TestOperator_PrecedenceAcrossAReloadAndARestart: runtime override >
// Caddyfile override > zone limit, on every node of two regions, kept by
// a node reloaded and by one started in place of another, and what a
// removal leaves (the Caddyfile's override) everywhere.
func TestOperator_PrecedenceAcrossAReloadAndARestart(t *testing.T) {
	c := startCluster(t, clusterSpec{regions: 2, nodes: 2, limit: 2, window: pickWindow(2 * time.Minute),
		zoneExtra: "\t\t\toverride vip 4\n"})
	vip, plain := "vip", freshKey("plain")
	limitsEverywhere(t, c.all(), vip, 4, "the Caddyfile's override everywhere")
	limitsEverywhere(t, c.all(), plain, 2, "the zone's limit everywhere")
	path := "/ratelimit/overrides?zone=global&identifier=vip"
	if s, b := adminCall(t, c.regions[0][0].admin, http.MethodPut, path, `{"limit": 6, "reason": "precedence"}`); s != http.StatusOK {
		t.Fatalf("PUT: %d %s", s, b)
	}
	limitsEverywhere(t, c.all(), vip, 6, "the runtime override over the Caddyfile's everywhere")
	c.regions[1][1].reloadFile(t)
	c.regions[0][1].stop()
	c.regions[0][1] = c.startNode(0)
	c.regions[0][1].waitReady(t)
	limitsEverywhere(t, c.all(), vip, 6, "the runtime override after a reload and a restart")
	limitsEverywhere(t, c.all(), plain, 2, "the zone's limit after a reload and a restart")
	if s, b := adminCall(t, c.regions[1][0].admin, http.MethodDelete, path, ""); s != http.StatusOK {
		t.Fatalf("DELETE on a node of B: %d %s", s, b)
	}
	limitsEverywhere(t, c.all(), vip, 4, "the Caddyfile's override again after the removal")
}

// TestOperator_FourOperatorsAtOnceEndOnOneChange: four operators change
// one key's override at the same moment, one on each node of two regions.
// Every change is answered 200 (each is a change made after the one it
// found: last writer wins, README "Scope"), and every node of both
// regions, and MySQL, end on one and the same of the four.
func TestOperator_FourOperatorsAtOnceEndOnOneChange(t *testing.T) {
	c := startCluster(t, clusterSpec{regions: 2, nodes: 2, limit: 3, window: pickWindow(2 * time.Minute)})
	nodes := c.all()
	for round := 0; round < 5; round++ {
		key := freshKey(fmt.Sprintf("race-%d", round))
		path := "/ratelimit/overrides?zone=global&identifier=" + urlQueryEscape(key)
		var wg sync.WaitGroup
		status := make([]int, len(nodes))
		for i, n := range nodes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				status[i], _ = adminCall(t, n.admin, http.MethodPut, path, fmt.Sprintf(`{"limit": %d}`, 100*(i+1)))
			}()
		}
		wg.Wait()
		for i, s := range status {
			if s != http.StatusOK {
				t.Fatalf("round %d: the change on node %d answered %d", round, i, s)
			}
		}
		var final int64
		redistest.EventuallyShow(t, 10*time.Second, "every node on one change", func() (bool, string) {
			final = overrideOn(t, nodes[0].admin, "global", key)
			for i, n := range nodes {
				if got := overrideOn(t, n.admin, "global", key); got != final {
					return false, fmt.Sprintf("node 0 holds %d, node %d (%s) %d", final, i, n.region, got)
				}
			}
			return true, ""
		})
		if final < 100 || final > 400 || final%100 != 0 {
			t.Fatalf("round %d: every node holds %d, none of the four changes", round, final)
		}
		db, err := sql.Open("mysql", c.dsn)
		if err != nil {
			t.Fatal(err)
		}
		redistest.Eventually(t, 10*time.Second, "MySQL on the same change", func() bool {
			var limit int64
			err := db.QueryRow("SELECT limit_units FROM ratelimit_overrides WHERE namespace = 'global' AND identifier = ?", key).Scan(&limit)
			return err == nil && limit == final
		})
		db.Close()
		t.Logf("round %d: every node and MySQL hold %d", round, final)
	}
}

// TestOperator_AnAddressPrefixThatNeverMatches: the zone counts IPv4
// addresses by /24 and IPv6 ones by /64. A runtime override of a prefix
// written in another form than the handler's (another length, an address
// inside the prefix, upper-case hex, a whole address with /32) can never
// match a request; the Caddyfile's override line rejects each and names
// the form to write, and the PUT took it with a 200, so that an operator
// blocking 203.0.113.0/16 blocked nothing. Each is a 400 now, nothing
// stored, and the forms the handler counts still take.
func TestOperator_AnAddressPrefixThatNeverMatches(t *testing.T) {
	srv := redisAndCaddy(t, "starts Caddy and Redis")
	n := startNode(t, fmt.Sprintf("\t\tregion eu-west-1\n\t\tredis %s\n\t\tfast_tick 10ms", srv.URL()), `	ratelimit {
		zone per_ip {
			key         {http.request.header.X-Client}
			limit       3
			window      10m
			ipv4_prefix 24
			ipv6_prefix 64
		}
		headers off
	}
	respond "ok"`)
	for _, id := range []string{"203.0.113.0/16", "203.0.113.5/24", "2001:DB8:1:2::/64", "2001:db8:1:2::/48", "198.51.100.0/32"} {
		s, b := adminCall(t, n.admin, http.MethodPut, "/ratelimit/overrides?zone=per_ip&identifier="+urlQueryEscape(id), `{"limit": 0}`)
		if s != http.StatusBadRequest {
			t.Errorf("PUT of %s, which no request's identifier equals: %d %s, want 400", id, s, b)
		}
	}
	if s, b := adminCall(t, n.admin, http.MethodGet, "/ratelimit/overrides?zone=per_ip", ""); s != http.StatusOK || !strings.Contains(b, `"overrides":[]`) {
		t.Errorf("the zone's overrides after the refused changes: %d %s, want none", s, b)
	}
	// The forms the handler counts take, and apply.
	for _, c := range []struct{ put, sent string }{
		{"203.0.113.0/24", "203.0.113.77"},
		{"198.51.100.9", "198.51.100.200"},
		{"2001:db8:1:2::/64", "2001:db8:1:2::99"},
		{"2001:DB8:5:6::1", "2001:db8:5:6::2"},
	} {
		if s, b := adminCall(t, n.admin, http.MethodPut, "/ratelimit/overrides?zone=per_ip&identifier="+urlQueryEscape(c.put), `{"limit": 0}`); s != http.StatusOK {
			t.Fatalf("PUT of %s: %d %s", c.put, s, b)
		}
		req, _ := http.NewRequest(http.MethodGet, n.url("/"), nil)
		req.Header.Set("X-Client", c.sent)
		resp, err := loadClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusTooManyRequests {
			t.Errorf("a request from %s under the override of %s (limit 0): %d, want 429", c.sent, c.put, resp.StatusCode)
		}
	}
}

// TestOperator_AResetOfAnAddressPrefixThatNeverMatches: a region or
// global reset of an address prefix in a form the zone never counts
// (another length, an address inside the prefix) reset nothing and
// answered 200 "reset": true, so the operator took the range for reset
// while it stayed denied. It is a 400 now, as the override's PUT is;
// the form the zone counts resets the range.
func TestOperator_AResetOfAnAddressPrefixThatNeverMatches(t *testing.T) {
	srv := redisAndCaddy(t, "starts Caddy and Redis")
	n := startNode(t, fmt.Sprintf("\t\tregion eu-west-1\n\t\tredis %s\n\t\tfast_tick 10ms", srv.URL()), `	ratelimit {
		zone per_ip {
			key         {http.request.header.X-Client}
			limit       2
			window      10m
			ipv4_prefix 24
		}
		headers off
	}
	respond "ok"`)
	send := func() int {
		req, _ := http.NewRequest(http.MethodGet, n.url("/"), nil)
		req.Header.Set("X-Client", "203.0.113.77")
		resp, err := loadClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for send() == http.StatusOK {
	}
	for _, id := range []string{"203.0.113.0/16", "203.0.113.77/24"} {
		s, b := adminCall(t, n.admin, http.MethodDelete, "/ratelimit/counters?zone=per_ip&scope=region&identifier="+urlQueryEscape(id), "")
		if s != http.StatusBadRequest {
			t.Errorf("a region reset of %s, which no request's identifier equals: %d %s, want 400", id, s, b)
		}
	}
	if s := send(); s != http.StatusTooManyRequests {
		t.Fatalf("the range after the refused resets: %d, want 429", s)
	}
	if s, b := adminCall(t, n.admin, http.MethodDelete, "/ratelimit/counters?zone=per_ip&scope=region&identifier=203.0.113.0/24", ""); s != http.StatusOK {
		t.Fatalf("a region reset of 203.0.113.0/24: %d %s", s, b)
	}
	redistest.Eventually(t, 5*time.Second, "the range admitted after its reset", func() bool { return send() == http.StatusOK })
}
