package ratelimit

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// namesALine is how the Caddyfile adapter names the place of an error.
var namesALine = regexp.MustCompile(`Caddyfile:\d+`)

// ours tells a validation error of this module's handler or app from one
// of another module's (a map whose value is the word ratelimit).
var ours = regexp.MustCompile(`loading module 'ratelimit'|loading ratelimit app module`)

// FuzzCaddyfile_WhatAdaptsValidates: any Caddyfile, the golden files'
// among the seeds. Adapting it never panics; an error of this module names
// the file and the line; and a Caddyfile that adapts also validates (what
// `caddy validate` runs: every module provisioned, nothing started), so a
// bad value never passes `caddy adapt` to fail only when Caddy loads it,
// with no line to point at. The provisioning starts no I/O (App.Provision),
// so addresses of servers that do not exist are fine. A config that reads
// an environment variable is not validated: its values are known only
// when Caddy loads it, and may fail there. `go test -fuzz
// FuzzCaddyfile_WhatAdaptsValidates -run '^$' .` runs the fuzzer; plain
// `go test` runs the seeds and what testdata/fuzz keeps.
func FuzzCaddyfile_WhatAdaptsValidates(f *testing.F) {
	for _, g := range goldens(f) {
		f.Add(g.src)
	}
	// Lines of a zone and of the global option, for the fuzzer to mutate
	// inside a block of this module's (most of a whole file's mutations
	// never reach one).
	for _, line := range []string{
		"cost {http.request.header.X-Cost} 2\nmax_cost 10",
		"override 203.0.113.0/24 5\nipv4_prefix 24\nipv6_prefix 56",
		"region eu-1\nredis redis://127.0.0.1:1\nmysql root:@tcp(127.0.0.1:1)/db",
		"redis_sentinel mymaster 127.0.0.1:1 127.0.0.1:2\nread_timeout 50ms",
		"identifier_secret 0123456789abcdef\nmax_entries 10",
	} {
		f.Add(line)
	}
	f.Fuzz(func(t *testing.T, src string) {
		for _, c := range []string{
			src,
			"{\n\tratelimit {\n" + src + "\n\t}\n}\n\n:8080 {\n\trespond ok\n}\n",
			":8080 {\n\tratelimit {\n\t\tzone z {\n\t\t\tkey {client_ip}\n\t\t\tlimit 5\n\t\t\twindow 1m\n" + src + "\n\t\t}\n\t}\n}\n",
		} {
			adaptsAndValidates(t, c)
		}
	})
}

// adaptsAndValidates is FuzzCaddyfile_WhatAdaptsValidates's check of one
// Caddyfile.
func adaptsAndValidates(t *testing.T, src string) {
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(src), map[string]any{"filename": "Caddyfile"})
	if err != nil {
		if strings.Contains(err.Error(), "tokens for 'ratelimit'") && !namesALine.MatchString(err.Error()) {
			t.Fatalf("adapt failed without naming the line: %v\nCaddyfile:\n%s", err, src)
		}
		return
	}
	if !strings.Contains(string(out), `"ratelimit"`) { // a handler's name or the app's
		return // nothing of this module's: what Caddy validates of the rest is Caddy's
	}
	if strings.Contains(src, "{env.") {
		// A value known only when Caddy loads the config, where it may
		// fail: `redis {env.REDIS_URL} {env.REDIS_URL}` lists one server
		// twice.
		return
	}
	var cfg caddy.Config
	if err := json.Unmarshal(out, &cfg); err != nil {
		t.Fatalf("the adapted config does not decode: %v\n%s", err, out)
	}
	// What a process that ran another config refuses (a region
	// changed, say) is no error of this config's: tests before this one
	// ran such configs.
	if err := caddy.Validate(&cfg); err != nil && ours.MatchString(err.Error()) && !strings.Contains(err.Error(), "restart Caddy to") {
		t.Fatalf("adapted, but fails validation: %v\nCaddyfile:\n%s", err, src)
	}
}

// golden is one testdata/*.caddyfiletest: a Caddyfile, and what follows its
// "----------" line, the exact JSON it adapts to or a part of the error.
type golden struct{ name, src, want string }

// goldens reads every golden file.
func goldens(tb testing.TB) []golden {
	tb.Helper()
	files, err := filepath.Glob("testdata/*.caddyfiletest")
	if err != nil || len(files) == 0 {
		tb.Fatalf("no golden files (%v)", err)
	}
	out := make([]golden, len(files))
	for i, file := range files {
		data, err := os.ReadFile(file)
		if err != nil {
			tb.Fatal(err)
		}
		src, want, ok := strings.Cut(string(data), "\n----------\n")
		if !ok {
			tb.Fatalf("%s: no ---------- separator", file)
		}
		out[i] = golden{filepath.Base(file), src, strings.TrimSpace(want)}
	}
	return out
}
