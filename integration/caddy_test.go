package integration

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// caddyBinary builds cmd/caddy once per test binary (without the race
// detector: it is the system under load, not under test for races here).
var caddyBinary = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "ratelimit-caddy-")
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "caddy")
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	cmd := exec.Command(goBin, "build", "-o", bin, "./cmd/caddy")
	cmd.Dir = ".."
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/caddy: %v\n%s", err, out)
	}
	return bin, nil
})

// nodeStartTimeout bounds how long a built Caddy takes to serve: about a
// second on an idle machine, much more on a loaded one.
const nodeStartTimeout = 30 * time.Second

// node is one Caddy process.
type node struct {
	t     *testing.T
	cmd   *exec.Cmd
	log   *logBuffer
	admin int
	port  int
	// config is the Caddyfile it runs.
	config string
}

// extraEnv is added to the environment of the Caddy processes started next
// (startNodeEnv sets it).
var extraEnv []string

// startNode starts Caddy on a config whose site block is site and whose
// global ratelimit option is global, and waits until it serves.
func startNode(t *testing.T, global, site string) *node {
	t.Helper()
	bin, err := caddyBinary()
	if err != nil {
		t.Fatal(err)
	}
	n := &node{t: t, log: new(logBuffer), admin: redistest.MustFreePort(t), port: redistest.MustFreePort(t)}
	dir := t.TempDir()
	cfg := fmt.Sprintf(`{
	admin localhost:%d
	http_port %d
	auto_https off
	persist_config off
	skip_install_trust
	grace_period 1s
	ratelimit {
%s
	}
}

http://127.0.0.1:%d {
	bind 127.0.0.1
%s
}
`, n.admin, n.port, global, n.port, site)
	n.config = cfg
	file := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(file, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	n.cmd = exec.Command(bin, "run", "--config", file)
	n.cmd.Env = append(os.Environ(), "HOME="+dir, "XDG_DATA_HOME="+dir, "XDG_CONFIG_HOME="+dir)
	n.cmd.Env = append(n.cmd.Env, extraEnv...)
	n.cmd.Stdout, n.cmd.Stderr = n.log, n.log
	if err := n.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.stop)
	deadline := time.Now().Add(nodeStartTimeout)
	for {
		resp, err := http.Get(n.url("/healthz-probe"))
		if err == nil {
			resp.Body.Close()
			return n
		}
		if time.Now().After(deadline) {
			t.Fatalf("caddy did not serve within %s: %v\n%s", nodeStartTimeout, err, n.log.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// logBuffer is a Caddy process's output, which a test may read while the
// process writes it.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func (n *node) url(path string) string { return fmt.Sprintf("http://127.0.0.1:%d%s", n.port, path) }

// reload loads n's Caddyfile again through the admin API, as an operator's
// reload does (forced: the config is the same), and returns the status
// and body.
func (n *node) reload(t *testing.T) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, fmt.Sprintf("http://127.0.0.1:%d/load", n.admin), strings.NewReader(n.config))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "text/caddyfile")
	req.Header.Set("Cache-Control", "must-revalidate")
	req.Close = true // as adminCall's
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// signalAndWait sends sig to n's process and waits for it to exit, killing
// it after within; it reports whether it exited on its own.
func (n *node) signalAndWait(sig os.Signal, within time.Duration) bool {
	_ = n.cmd.Process.Signal(sig)
	done := make(chan struct{})
	go func() { _ = n.cmd.Wait(); close(done) }()
	select {
	case <-done:
		return true
	case <-time.After(within):
		_ = n.cmd.Process.Kill()
		<-done
		return false
	}
}

func (n *node) stop() {
	if n.cmd.Process == nil || n.cmd.ProcessState != nil {
		return
	}
	n.signalAndWait(os.Interrupt, 10*time.Second)
	if n.t.Failed() {
		n.t.Logf("caddy on :%d log tail:\n%s", n.port, tail(n.log.String(), 2000))
	}
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[len(s)-n:]
}

// redisAndCaddy is the set-up of a test that runs Caddy processes on one
// Redis: it skips in short mode (why says what the test runs), starts a
// private Redis (a missing redis-server fails under CI) and builds Caddy.
func redisAndCaddy(t *testing.T, why string) *redistest.Server {
	t.Helper()
	if testing.Short() {
		t.Skip(why)
	}
	requireBinary(t, "redis-server")
	srv := redistest.Start(t)
	if _, err := caddyBinary(); err != nil {
		t.Fatal(err)
	}
	return srv
}

// requireBinary fails under CI and skips elsewhere when a binary is
// missing.
func requireBinary(t *testing.T, name string) {
	t.Helper()
	if _, err := exec.LookPath(name); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s not found on PATH (required when CI=true)", name)
		}
		t.Skipf("%s not found on PATH", name)
	}
}
