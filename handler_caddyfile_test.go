package ratelimit

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
)

var update = flag.Bool("update", false, "rewrite the expected JSON of testdata/*.caddyfiletest")

// adapt runs the Caddyfile adapter the way `caddy adapt` does, with the file
// named "Caddyfile".
func adapt(t *testing.T, src string) ([]byte, error) {
	t.Helper()
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(src), map[string]any{"filename": "Caddyfile"})
	return out, err
}

// TestCaddyfileAdapt_Golden adapts every testdata/*.caddyfiletest: the part
// before the "----------" line is a Caddyfile, the part after it either the
// exact JSON it adapts to or, if it does not start with '{', a substring of
// the adapt error (which names file and line).
func TestCaddyfileAdapt_Golden(t *testing.T) {
	for _, g := range goldens(t) {
		t.Run(g.name, func(t *testing.T) {
			src, want := g.src, g.want
			out, err := adapt(t, src)

			if !strings.HasPrefix(want, "{") {
				if err == nil {
					t.Fatalf("adapted without error, want error containing %q", want)
				}
				if !strings.Contains(err.Error(), want) {
					t.Fatalf("error %q\ndoes not contain %q", err, want)
				}
				return
			}
			if err != nil {
				t.Fatalf("adapt: %v", err)
			}
			var pretty bytes.Buffer
			if err := json.Indent(&pretty, out, "", "\t"); err != nil {
				t.Fatal(err)
			}
			got := pretty.String()
			if *update {
				if err := os.WriteFile(filepath.Join("testdata", g.name), []byte(src+"\n----------\n"+got+"\n"), 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			if got != want {
				t.Errorf("adapted JSON differs (run go test -run Golden -update to accept)\n--- got\n%s\n--- want\n%s", got, want)
			}
		})
	}
}

// TestCaddyfileExample_Adapts keeps the README's example working: it adapts
// and carries the demo zone.
func TestCaddyfileExample_Adapts(t *testing.T) {
	src, err := os.ReadFile("Caddyfile.example")
	if err != nil {
		t.Fatal(err)
	}
	out, err := adapt(t, string(src))
	if err != nil {
		t.Fatalf("Caddyfile.example: %v", err)
	}
	for _, want := range []string{`"handler":"ratelimit"`, `"name":"demo"`, `"limit":5`, `"window":60000000000`} {
		if !bytes.Contains(out, []byte(want)) {
			t.Errorf("adapted Caddyfile.example lacks %s", want)
		}
	}
}

// TestREADME_CaddyfileBlocksAdapt adapts every caddyfile block of the
// README, as a reader pastes it: a block of directives without a site goes
// into one, and the syntax block (its <placeholders>) is left out. Each
// must adapt, and be formatted as `caddy fmt` writes it, or `caddy adapt`
// warns of the reader's copy.
func TestREADME_CaddyfileBlocksAdapt(t *testing.T) {
	b, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := 0
	for rest := string(b); ; {
		var block string
		var ok bool
		if _, rest, ok = strings.Cut(rest, "\n```caddyfile\n"); !ok {
			break
		}
		if block, rest, ok = strings.Cut(rest, "\n```\n"); !ok {
			t.Fatal("a caddyfile block of the README is not closed")
		}
		blocks++
		if strings.Contains(block, "<name>") {
			continue // the directive's syntax
		}
		src := block + "\n"
		if string(caddyfile.Format([]byte(src))) != src {
			t.Errorf("README block %q is not formatted as caddy fmt writes it:\n%s", firstLine(block), caddyfile.Format([]byte(src)))
		}
		if first := strings.Fields(block)[0]; first != "{" && !strings.ContainsAny(first, ".:") {
			src = ":8080 {\n" + src + "}\n" // directives without their site
		}
		if _, err := adapt(t, src); err != nil {
			t.Errorf("README block %q: %v", firstLine(block), err)
		}
	}
	if blocks < 10 {
		t.Fatalf("found %d caddyfile blocks in the README, want its ten or more", blocks)
	}
}

// firstLine is a block's first line, to name it.
func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}

// TestHandler_JSONShapes loads a handler the way a JSON config does: cost as
// a number or a string, windows as strings.
func TestHandler_JSONShapes(t *testing.T) {
	var h Handler
	err := json.Unmarshal([]byte(`{"zones": [
		{"name": "a", "key": "{http.vars.client_ip}", "limit": 5, "window": "1m", "cost": 3},
		{"name": "b", "key": "k", "limit": 5, "window": 3600000000000, "cost": "{http.request.header.X-Cost}"}
	], "retry_jitter": "2s"}`), &h)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Validate(); err != nil {
		t.Fatal(err)
	}
	h.compile()
	if h.zones[0].staticCost != 3 || !h.zones[0].cost.literal {
		t.Errorf("numeric cost compiled to %+v", h.zones[0].cost)
	}
	if h.zones[1].cost.single != "http.request.header.X-Cost" {
		t.Errorf("placeholder cost compiled to %+v", h.zones[1].cost)
	}
	if h.policyAll != `"a";q=5;w=60, "b";q=5;w=3600` {
		t.Errorf("policy %q", h.policyAll)
	}
}

// TestOptions_AValueSplitAtASpaceIsNotQuoted: a line of one value given
// two (a password with a space, unquoted) fails naming the line, and never
// quotes the token after the first, which is part of the password or the
// secret (Caddy's own argument count error quoted it).
func TestOptions_AValueSplitAtASpaceIsNotQuoted(t *testing.T) {
	for _, line := range []string{
		"redis redis://:hunter2 secret-part@127.0.0.1:6379",
		"mysql root:hunter2 secret-part@tcp(127.0.0.1:3306)/db",
		"mysql_read root:hunter2 secret-part@tcp(127.0.0.1:3306)/db",
		"identifier_secret correct horse secret-part staple",
	} {
		src := "{\n\tratelimit {\n\t\t" + line + "\n\t\tregion r\n\t}\n}\n:8080 {\n\trespond ok\n}\n"
		_, err := adapt(t, src)
		if err == nil {
			t.Fatalf("%q adapted without error", line)
		}
		if strings.Contains(err.Error(), "secret-part") || strings.Contains(err.Error(), "horse") {
			t.Fatalf("error quotes part of the password: %v", err)
		}
		if !strings.Contains(err.Error(), "Caddyfile:3") {
			t.Fatalf("error does not name the line: %v", err)
		}
	}
}

// TestRedisOption_ErrorsNeverQuoteAPassword adapts bad Redis lines that
// carry a password: the error names the line, never the password.
func TestRedisOption_ErrorsNeverQuoteAPassword(t *testing.T) {
	for _, line := range []string{
		"redis redis://:hunter2-secret@127.0.0.1:notaport",
		"redis redis://admin:hunter2-secret@127.0.0.1:6379/notadb",
		"redis redis://:hunter2-secret@127.0.0.1:6379?dial_timeout=1s",
		"redis_cluster redis://:hunter2-secret@127.0.0.1:7000 rediss://:other@127.0.0.1:7001",
	} {
		src := "{\n\tratelimit {\n\t\t" + line + "\n\t}\n}\n:8080 {\n\trespond ok\n}\n"
		failsOnLine3WithoutThePassword(t, line, src)
	}
}

// TestMySQLOption_ALiteralDSNFailsAdapt: a literal DSN the layer could not
// open fails `caddy adapt` naming its line, never quoting the password (it
// passed adapt and failed provisioning with no line); one held in a
// placeholder waits for provisioning, where it is resolved.
func TestMySQLOption_ALiteralDSNFailsAdapt(t *testing.T) {
	for _, line := range []string{
		"mysql root:hunter2-secret@tcp(127.0.0.1:3306)",
		"mysql root:hunter2-secret@tcp(127.0.0.1:3306/db",
		"mysql root:hunter2-secret@tcp(127.0.0.1:3306)/",
		"mysql_read root:hunter2-secret@tcp(127.0.0.1:3306)/db?timeout=soon",
	} {
		src := "{\n\tratelimit {\n\t\t" + line + "\n\t\tregion r\n\t\tmysql_flush 1s\n\t}\n}\n:8080 {\n\trespond ok\n}\n"
		if strings.HasPrefix(line, "mysql_read") {
			src = strings.Replace(src, "mysql_flush 1s", "mysql {env.MYSQL_DSN}", 1)
		}
		failsOnLine3WithoutThePassword(t, line, src)
	}
	if _, err := adapt(t, "{\n\tratelimit {\n\t\tregion r\n\t\tmysql {env.MYSQL_DSN}\n\t\tmysql_read root:pw@tcp(127.0.0.1:3306)/db\n\t}\n}\n"); err != nil {
		t.Fatalf("a placeholder DSN beside a good literal one: %v", err)
	}
}

// failsOnLine3WithoutThePassword fails the test unless src, whose third
// line is line, fails to adapt with an error that names that line and
// does not quote the password "hunter2-secret".
func failsOnLine3WithoutThePassword(t *testing.T, line, src string) {
	t.Helper()
	_, err := adapt(t, src)
	if err == nil {
		t.Fatalf("%q adapted without error", line)
	}
	if strings.Contains(err.Error(), "hunter2-secret") {
		t.Fatalf("error quotes the password: %v", err)
	}
	if !strings.Contains(err.Error(), "Caddyfile:3") {
		t.Fatalf("error does not name the line: %v", err)
	}
}
