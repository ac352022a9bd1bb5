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
	files, err := filepath.Glob("testdata/*.caddyfiletest")
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("no golden files")
	}
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			data, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			src, want, ok := strings.Cut(string(data), "\n----------\n")
			if !ok {
				t.Fatalf("%s: no ---------- separator", file)
			}
			want = strings.TrimSpace(want)
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
				if err := os.WriteFile(file, []byte(src+"\n----------\n"+got+"\n"), 0o644); err != nil {
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
