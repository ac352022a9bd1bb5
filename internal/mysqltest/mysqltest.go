// Package mysqltest starts private mariadbd processes for tests: on free
// loopback ports, in temporary data directories, killed when the test (or
// the test binary, see Main) ends. Tests never touch a shared database:
// each asks the server for a database of its own (NewDatabase).
//
// When mariadbd is not installed the test is skipped, unless the
// environment variable CI is "true", where a missing server fails it.
package mysqltest

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/edgelimit/caddy-ratelimit/internal/freeport"
)

// Timeouts of the helper. Each says why.
const (
	// startTimeout is how long a fresh mariadbd may take to accept a
	// query: about a second on an idle machine, much more while the shared
	// machine compiles.
	startTimeout = 60 * time.Second
	// startAttempts retries a start whose port another process took
	// between our probe and the server's bind.
	startAttempts = 5
	// pollInterval is how often readiness is re-checked.
	pollInterval = 20 * time.Millisecond
)

// searchPath is where the MariaDB binaries live on Debian: mariadbd is in
// /usr/sbin, which is not on every user's PATH.
var searchPath = []string{"/usr/sbin", "/usr/local/sbin", "/usr/bin", "/usr/local/bin"}

// lookPath finds a binary on PATH or in searchPath.
func lookPath(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, dir := range searchPath {
		p := filepath.Join(dir, name)
		if st, err := os.Stat(p); err == nil && !st.IsDir() && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found on PATH or in %s", name, strings.Join(searchPath, ", "))
}

// Available reports whether mariadbd and mariadb-install-db are installed.
func Available() error {
	for _, b := range []string{"mariadbd", "mariadb-install-db"} {
		if _, err := lookPath(b); err != nil {
			return err
		}
	}
	return nil
}

// Require skips the test when MariaDB is not installed, or fails it when
// CI is "true".
func Require(t testing.TB) {
	t.Helper()
	if err := Available(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("mysqltest: %v (required when CI=true; install mariadb-server)", err)
		}
		t.Skipf("mysqltest: %v", err)
	}
}

// Server is one private mariadbd.
type Server struct {
	dir  string
	port int
	// role is the server's part in replication (replication.go): none
	// (grant tables skipped, no binary log), a primary or a replica.
	role role

	mu   sync.Mutex
	cmd  *exec.Cmd
	exit chan struct{}
	log  *bytes.Buffer

	dbs atomic.Int64
}

// Start starts a mariadbd for the test and stops it when the test ends.
func Start(t testing.TB) *Server {
	t.Helper()
	Require(t)
	s, err := StartProcess(t.TempDir())
	if err != nil {
		t.Fatalf("mysqltest: %v", err)
	}
	t.Cleanup(s.Stop)
	return s
}

// StartProcess starts a mariadbd with its data in dir (created empty if
// needed); the caller must Stop it. For a server shared by a whole test
// binary, started from TestMain.
func StartProcess(dir string) (*Server, error) {
	return startProcess(dir, standalone)
}

func startProcess(dir string, r role) (*Server, error) {
	if err := Available(); err != nil {
		return nil, err
	}
	s := &Server{dir: dir, role: r}
	if err := s.install(); err != nil {
		return nil, err
	}
	var err error
	for attempt := 0; attempt < startAttempts; attempt++ {
		if s.port, err = freeport.Port(); err != nil {
			return nil, err
		}
		if err = s.launch(); err == nil {
			return s, nil
		}
	}
	return nil, fmt.Errorf("start mariadbd: %w", err)
}

// tmpDir is the server's temporary directory.
func (s *Server) tmpDir() string { return filepath.Join(s.dir, "tmp") }

// install creates the system tables in the data directory.
func (s *Server) install() error {
	bin, err := lookPath("mariadb-install-db")
	if err != nil {
		return err
	}
	data := filepath.Join(s.dir, "data")
	for _, d := range []string{data, s.tmpDir()} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return fmt.Errorf("mysqltest: %w", err)
		}
	}
	// A temporary directory of its own: bootstraps of several test binaries
	// at once in the shared /tmp have been seen to lose each other's
	// temporary tables.
	cmd := exec.Command(bin, "--no-defaults", "--user=root", "--datadir="+data,
		"--auth-root-authentication-method=normal", "--skip-test-db", "--tmpdir="+s.tmpDir())
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("mariadb-install-db: %w\n%s", err, out)
	}
	return nil
}

// launch starts the process and waits until it answers a query.
func (s *Server) launch() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	bin, err := lookPath("mariadbd")
	if err != nil {
		return err
	}
	data := filepath.Join(s.dir, "data")
	args := append([]string{"--no-defaults", "--user=root", "--datadir=" + data,
		"--socket=" + filepath.Join(s.dir, "sock"), "--port=" + strconv.Itoa(s.port),
		"--bind-address=127.0.0.1",
		"--pid-file=" + filepath.Join(s.dir, "mariadbd.pid"), "--tmpdir=" + s.tmpDir(),
		// Small and quick: a test server needs no large buffers or
		// durable commits.
		"--innodb-buffer-pool-size=32M", "--innodb-log-file-size=16M",
		"--innodb-flush-log-at-trx-commit=0",
		"--max-connections=500"}, s.role.args(s.dir)...)
	cmd := exec.Command(bin, args...)
	log := new(bytes.Buffer)
	cmd.Stdout, cmd.Stderr = log, log
	// The server dies with the test binary, even one killed by a timeout.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("exec %s: %w", bin, err)
	}
	exit := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exit)
	}()
	s.cmd, s.exit, s.log = cmd, exit, log

	db, err := sql.Open("mysql", s.DSN(""))
	if err != nil {
		s.killLocked()
		return fmt.Errorf("open: %w", err)
	}
	defer db.Close()
	deadline := time.Now().Add(startTimeout)
	for {
		select {
		case <-exit:
			return fmt.Errorf("mariadbd on port %d exited at start: %s", s.port, tailOf(log.String()))
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := db.PingContext(ctx)
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			s.killLocked()
			return fmt.Errorf("mariadbd on port %d not ready within %s: %v; log: %s", s.port, startTimeout, err, tailOf(log.String()))
		}
		time.Sleep(pollInterval)
	}
}

func tailOf(s string) string {
	if len(s) > 2000 {
		return s[len(s)-2000:]
	}
	return s
}

// Port is the server's TCP port.
func (s *Server) Port() int { return s.port }

// DSN is a go-sql-driver/mysql DSN for database db ("" for none), as root
// without a password (the server skips grant tables, or, in replication,
// root's password is empty).
func (s *Server) DSN(db string) string {
	return fmt.Sprintf("root:@tcp(127.0.0.1:%d)/%s", s.port, db)
}

// NewDatabase creates a database of its own for the test and returns its
// DSN. Databases are not dropped: the server's data directory goes away
// with it.
func (s *Server) NewDatabase(t testing.TB) string {
	t.Helper()
	name := fmt.Sprintf("t%d_%d", os.Getpid(), s.dbs.Add(1))
	db, err := sql.Open("mysql", s.DSN(""))
	if err != nil {
		t.Fatalf("mysqltest: %v", err)
	}
	defer db.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := db.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatalf("mysqltest: create database: %v", err)
	}
	return s.DSN(name)
}

// Stop kills the server (SIGKILL: a crash) and waits for it to exit.
// Stopping a stopped server does nothing.
func (s *Server) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.killLocked()
}

func (s *Server) killLocked() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGCONT)
	_ = s.cmd.Process.Kill()
	<-s.exit
	s.cmd = nil
}

// Pause stops the process (SIGSTOP) without closing its sockets: a
// server that accepts connections and answers nothing. Resume, Stop and
// the test's end let it go on.
func (s *Server) Pause() { s.signal(syscall.SIGSTOP) }

// Resume continues a paused server (SIGCONT).
func (s *Server) Resume() { s.signal(syscall.SIGCONT) }

func (s *Server) signal(sig syscall.Signal) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd != nil {
		_ = s.cmd.Process.Signal(sig)
	}
}

// Restart starts the stopped (or running) server again on the same port
// with the same data: an outage and its end.
func (s *Server) Restart() error {
	s.Stop()
	deadline := time.Now().Add(startTimeout)
	for {
		err := s.launch()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("mysqltest: restart on port %d: %w", s.port, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// Open returns a plain connection pool to dsn for assertions, closed when
// the test ends.
func Open(t testing.TB, dsn string) *sql.DB {
	t.Helper()
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatalf("mysqltest: %v", err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// Shared is one server for a whole test binary, started on first use by
// Get and stopped by Main.
type Shared struct {
	once sync.Once
	srv  *Server
	err  error
	dir  string
}

// Get returns the shared server, starting it on first use; it skips or
// fails the test as Require does when MariaDB is missing.
func (sh *Shared) Get(t testing.TB) *Server {
	t.Helper()
	Require(t)
	sh.once.Do(func() {
		sh.dir, sh.err = os.MkdirTemp("", "mysqltest-")
		if sh.err == nil {
			sh.srv, sh.err = StartProcess(sh.dir)
		}
	})
	if sh.err != nil {
		t.Fatalf("mysqltest: %v", sh.err)
	}
	return sh.srv
}

// Close stops the shared server, if it was started, and removes its data.
func (sh *Shared) Close() {
	if sh.srv != nil {
		sh.srv.Stop()
	}
	if sh.dir != "" {
		_ = os.RemoveAll(sh.dir)
	}
}

// Main runs a test binary's tests with sh stopped afterwards: call it from
// TestMain as os.Exit(mysqltest.Main(m, &shared)).
func Main(m *testing.M, sh *Shared) int {
	defer sh.Close()
	return m.Run()
}

// Ensure the driver is linked (the package registers itself as "mysql").
var _ = mysql.Config{}
