// Package redistest starts private redis-server processes for tests: on free
// loopback ports, in temporary directories, without persistence, killed when
// the test ends. Tests never touch a shared Redis.
//
// When redis-server is not on PATH the test is skipped, unless the
// environment variable CI is "true", where a missing server fails it.
package redistest

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/freeport"

	"github.com/redis/go-redis/v9"
)

// Timeouts of the helper. Each says why.
const (
	// startTimeout is how long a fresh redis-server may take to answer
	// PING: it starts in milliseconds, but the test machine is shared and
	// may be busy compiling.
	startTimeout = 20 * time.Second
	// clusterTimeout bounds the creation of a cluster until every node
	// reports cluster_state:ok; gossip between three local nodes settles
	// in about a second.
	clusterTimeout = 60 * time.Second
	// startAttempts retries a start whose port another process took
	// between our probe and the server's bind.
	startAttempts = 5
	// pollInterval is how often a condition is re-checked while waiting.
	pollInterval = 10 * time.Millisecond
)

// Server is one private redis-server.
type Server struct {
	t        testing.TB
	bin      string
	dir      string
	port     int
	password string
	extra    []string

	// tlsConfig is set by WithTLS: the server then listens for TLS only.
	tlsConfig *tls.Config
	// sentinelOf is set for a sentinel (StartSentinel).
	sentinelOf *Server
	// downAfter is a sentinel's down-after-milliseconds (StartFastSentinel).
	downAfter time.Duration

	mu   sync.Mutex
	cmd  *exec.Cmd
	exit chan struct{}
}

// Option configures Start.
type Option func(*Server)

// WithPassword sets requirepass.
func WithPassword(pw string) Option { return func(s *Server) { s.password = pw } }

// WithArgs adds redis-server arguments, as "--name", "value" pairs.
func WithArgs(args ...string) Option {
	return func(s *Server) { s.extra = append(s.extra, args...) }
}

// WithTLS makes the server listen for TLS only, with a fresh self-signed
// certificate for 127.0.0.1 (see CAFile and ClientTLS).
func WithTLS() Option {
	return func(s *Server) { s.tlsConfig = &tls.Config{MinVersion: tls.VersionTLS12} }
}

// writeCert writes a self-signed certificate for 127.0.0.1 and its key to
// dir, and makes cfg trust it.
func writeCert(dir string, cfg *tls.Config) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("generate key: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "redistest"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return fmt.Errorf("create certificate: %w", err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return fmt.Errorf("marshal key: %w", err)
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	if err := os.WriteFile(filepath.Join(dir, "tls.crt"), certPEM, 0o600); err != nil {
		return fmt.Errorf("write certificate: %w", err)
	}
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
	if err := os.WriteFile(filepath.Join(dir, "tls.key"), keyPEM, 0o600); err != nil {
		return fmt.Errorf("write key: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return fmt.Errorf("parse certificate: %w", err)
	}
	cfg.RootCAs = x509.NewCertPool()
	cfg.RootCAs.AddCert(cert)
	return nil
}

// Binary returns the path of redis-server, or skips (fails when CI=true)
// the test if it is not installed.
func Binary(t testing.TB) string {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("redis-server not found on PATH (required when CI=true): %v", err)
		}
		t.Skipf("redis-server not found on PATH: %v", err)
	}
	return bin
}

// Start starts a redis-server on a free loopback port and stops it when the
// test ends.
func Start(t testing.TB, opts ...Option) *Server {
	t.Helper()
	s := &Server{t: t, bin: Binary(t), dir: t.TempDir()}
	for _, o := range opts {
		o(s)
	}
	if s.tlsConfig != nil {
		if err := writeCert(s.dir, s.tlsConfig); err != nil {
			t.Fatalf("redistest: %v", err)
		}
	}
	var err error
	for attempt := 0; attempt < startAttempts; attempt++ {
		if s.port, err = FreePort(); err != nil {
			t.Fatalf("redistest: %v", err)
		}
		if s.sentinelOf != nil {
			if err := s.writeSentinelConf(); err != nil {
				t.Fatalf("redistest: %v", err)
			}
		}
		if err = s.launch(); err == nil {
			t.Cleanup(s.Stop)
			return s
		}
	}
	t.Fatalf("redistest: start redis-server: %v", err)
	return nil
}

// FreePort returns a free loopback TCP port that stays this process's
// (internal/freeport).
func FreePort() (int, error) { return freeport.Port() }

// MustFreePort is FreePort for a test: it fails t instead of returning an
// error.
func MustFreePort(t testing.TB) int {
	t.Helper()
	port, err := FreePort()
	if err != nil {
		t.Fatal(err)
	}
	return port
}

// Addr is host:port.
func (s *Server) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

// Port is the server's port.
func (s *Server) Port() int { return s.port }

// URL is a redis:// URL of the server (rediss:// with WithTLS), with its
// password if it has one.
func (s *Server) URL() string {
	scheme := "redis://"
	if s.tlsConfig != nil {
		scheme = "rediss://"
	}
	if s.password != "" {
		return scheme + ":" + s.password + "@" + s.Addr() + "/0"
	}
	return scheme + s.Addr() + "/0"
}

// ClientTLS is the TLS configuration a client needs to reach a WithTLS
// server (it trusts the server's certificate); nil without TLS.
func (s *Server) ClientTLS() *tls.Config { return s.tlsConfig }

// CAFile is the PEM file of the certificate a WithTLS server presents,
// which is its own CA.
func (s *Server) CAFile() string { return filepath.Join(s.dir, "tls.crt") }

func (s *Server) args() []string {
	if s.sentinelOf != nil {
		return []string{filepath.Join(s.dir, "sentinel.conf"), "--sentinel"}
	}
	port := []string{"--port", strconv.Itoa(s.port)}
	if s.tlsConfig != nil {
		port = []string{
			"--port", "0",
			"--tls-port", strconv.Itoa(s.port),
			"--tls-cert-file", s.CAFile(),
			"--tls-key-file", filepath.Join(s.dir, "tls.key"),
			"--tls-ca-cert-file", s.CAFile(),
			"--tls-auth-clients", "no",
		}
	}
	args := append(port,
		"--bind", "127.0.0.1",
		"--dir", s.dir,
		"--save", "",
		"--appendonly", "no",
		"--daemonize", "no",
		"--logfile", filepath.Join(s.dir, "redis.log"),
	)
	if s.password != "" {
		args = append(args, "--requirepass", s.password)
	}
	return append(args, s.extra...)
}

// launch starts the process and waits until it answers PING.
func (s *Server) launch() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	cmd := exec.Command(s.bin, s.args()...)
	cmd.Dir = s.dir
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("exec %s: %w", s.bin, err)
	}
	exit := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exit)
	}()
	s.cmd, s.exit = cmd, exit

	c := s.newClient()
	defer c.Close()
	deadline := time.Now().Add(startTimeout)
	for {
		select {
		case <-exit:
			return fmt.Errorf("redis-server on port %d exited at start: %s", s.port, s.logTail())
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			s.killLocked()
			return fmt.Errorf("redis-server on port %d did not answer PING within %s: %v; log: %s", s.port, startTimeout, err, s.logTail())
		}
		time.Sleep(pollInterval)
	}
}

func (s *Server) logTail() string {
	b, _ := os.ReadFile(filepath.Join(s.dir, "redis.log"))
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

// Stop kills the server (SIGKILL: a crash, nothing is saved) and waits for
// it to exit. Stopping a stopped server does nothing.
func (s *Server) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.killLocked()
}

func (s *Server) killLocked() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGCONT) // a paused server must die too
	_ = s.cmd.Process.Kill()
	<-s.exit
	s.cmd = nil
}

// Restart starts the server again on the same port, empty: the temporary
// directory is wiped first. It fails the test if the port cannot be bound.
func (s *Server) Restart() {
	s.t.Helper()
	s.Stop()
	entries, _ := os.ReadDir(s.dir)
	for _, e := range entries {
		if e.Name() != "redis.log" {
			_ = os.RemoveAll(filepath.Join(s.dir, e.Name()))
		}
	}
	var err error
	deadline := time.Now().Add(startTimeout)
	for {
		if err = s.launch(); err == nil {
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("redistest: restart on port %d: %v", s.port, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Pause stops the process (SIGSTOP) without closing its sockets: a hung
// Redis, whose calls time out instead of failing fast. Resume undoes it.
func (s *Server) Pause() { s.signal(syscall.SIGSTOP) }

// Resume continues a paused server.
func (s *Server) Resume() { s.signal(syscall.SIGCONT) }

func (s *Server) signal(sig syscall.Signal) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd != nil {
		_ = s.cmd.Process.Signal(sig)
	}
}

// Client returns a plain client for assertions, closed when the test ends.
func (s *Server) Client() *redis.Client {
	c := s.newClient()
	s.t.Cleanup(func() { _ = c.Close() })
	return c
}

func (s *Server) newClient() *redis.Client {
	return redis.NewClient(&redis.Options{
		Addr: s.Addr(), Password: s.password, TLSConfig: s.tlsConfig,
		MaxRetries: -1, DialTimeout: time.Second,
	})
}

// CommandStats returns the calls per command ("incrby", "mget", …) from
// INFO commandstats.
func (s *Server) CommandStats(ctx context.Context) (map[string]int64, error) {
	c := s.newClient()
	defer c.Close()
	info, err := c.Info(ctx, "commandstats").Result()
	if err != nil {
		return nil, fmt.Errorf("INFO commandstats on %s: %w", s.Addr(), err)
	}
	return ParseCommandStats(info)
}

// ParseCommandStats parses the text of INFO commandstats.
func ParseCommandStats(info string) (map[string]int64, error) {
	out := make(map[string]int64)
	sc := bufio.NewScanner(strings.NewReader(info))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		name, rest, ok := strings.Cut(line, ":")
		if !ok || !strings.HasPrefix(name, "cmdstat_") {
			continue
		}
		for _, f := range strings.Split(rest, ",") {
			k, v, _ := strings.Cut(f, "=")
			if k == "calls" {
				n, err := strconv.ParseInt(v, 10, 64)
				if err != nil {
					return nil, fmt.Errorf("commandstats line %q: %w", line, err)
				}
				out[strings.TrimPrefix(name, "cmdstat_")] = n
			}
		}
	}
	return out, sc.Err()
}

// waitFor polls check until it succeeds or ctx ends.
func waitFor(ctx context.Context, check func() error) error {
	for {
		err := check()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (last: %v)", ctx.Err(), err)
		case <-time.After(pollInterval):
		}
	}
}

// EventuallyShow is Eventually for a condition that also describes what
// it saw: a failure gives the last description, so that a condition
// missed under load says by how much.
func EventuallyShow(t testing.TB, timeout time.Duration, msg string, cond func() (bool, string)) {
	t.Helper()
	var last string
	Eventually(t, timeout, msg+" (the states it saw are logged above)", func() bool {
		ok, seen := cond()
		if !ok && seen != last {
			last = seen
			t.Logf("%s: not yet: %s", msg, seen)
		}
		return ok
	})
}

// Eventually polls cond until it returns true or timeout passes, then fails
// the test with msg. It is the way to wait for a condition without sleeping
// a guessed time.
func Eventually(t testing.TB, timeout time.Duration, msg string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("condition not met within %s: %s", timeout, msg)
		}
		time.Sleep(pollInterval)
	}
}
