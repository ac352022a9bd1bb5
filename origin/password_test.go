package origin

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// TestPassword_NeverInErrorsLogsOrStatus checks every place a URL could
// leak: config errors for malformed URLs, call errors (wrong password, dead
// server), String, Stats (as JSON), breaker notifications and go-redis's
// own log lines.
func TestPassword_NeverInErrorsLogsOrStatus(t *testing.T) {
	const secret = "Sup3rS3cret-pw"
	sink := &logSink{}
	SetLogger(sink.printf)
	t.Cleanup(func() { SetLogger(func(string, ...any) {}) })

	var seen []string
	check := func(where, s string) {
		t.Helper()
		seen = append(seen, s)
		if strings.Contains(s, secret) || strings.Contains(s, "Sup3r") || strings.Contains(s, "S3cret") {
			t.Fatalf("%s leaks the password: %s", where, s)
		}
	}
	checkMalformedURLs(t, secret, check)

	srv := redistest.Start(t, redistest.WithPassword(secret))
	var notes stateLog
	good := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{OnStateChange: notes.hook})
	if _, _, err := readPair(good, ctxT(t), key("x"), 1); err != nil {
		t.Fatalf("read with the right password: %v", err)
	}
	check("String", good.String())
	js, _ := json.Marshal(good.Stats())
	check("Stats", string(js))
	if !strings.Contains(string(js), srv.Addr()) {
		t.Fatalf("Stats should name the address %s: %s", srv.Addr(), js)
	}

	wrong := newOrigin(t, Config{Redis: []string{"redis://:wrong-" + secret + "@" + srv.Addr()}}, Options{})
	_, _, err := readPair(wrong, ctxT(t), key("x"), 1)
	if err == nil {
		t.Fatal("read with a wrong password succeeded")
	}
	check("wrong-password error", err.Error())

	srv.Stop()
	for i := 0; i < 30; i++ {
		if _, _, err := readPair(good, ctxT(t), key("x"), 1); err != nil {
			check("dead-server error", err.Error())
		}
		b := []engine.Delta{{Key: key("x"), Sequence: 1, Delta: 1, Own: 1}}
		if err := good.Flush(ctxT(t), b); err != nil {
			check("dead-server flush error", err.Error())
		}
	}
	redistest.Eventually(t, 5*time.Second, "breaker notification", func() bool {
		return len(notes.endpoints()) > 0
	})
	for _, n := range notes.endpoints() {
		check("OnStateChange endpoint", n)
	}
	if !strings.Contains(sink.String(), srv.Addr()) {
		t.Fatalf("go-redis logged nothing about the dead server; the log check proves nothing: %q", sink.String())
	}
	check("go-redis log", sink.String())
	if len(seen) < 20 {
		t.Fatalf("only %d strings checked", len(seen))
	}
}

// logSink captures go-redis's own log lines.
type logSink struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (l *logSink) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func (l *logSink) printf(format string, v ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	fmt.Fprintf(&l.buf, format+"\n", v...)
}

// checkMalformedURLs has Validate refuse URLs malformed around the
// password secret, as partitions and as Cluster seeds, and hands check
// each error.
func checkMalformedURLs(t *testing.T, secret string, check func(where, s string)) {
	t.Helper()
	for _, bad := range []string{
		"redis://:" + secret + "@127.0.0.1:notaport",
		"redis://user:" + secret + "/x@127.0.0.1:6379",
		"redis://user:" + secret + "@127.0.0.1:6379/x/y",
		"redis://:" + secret + "@127.0.0.1:6379/" + secret,
		"redis://:" + secret + "@127.0.0.1:6379/?password=" + secret,
		"http://:" + secret + "@127.0.0.1:6379",
		"redis://:" + secret + "@127.0.0.1:6379\x7f",
		"user:" + secret + "@127.0.0.1:6379",
	} {
		err := Config{Redis: []string{bad}}.Validate()
		if err == nil {
			t.Fatalf("Validate accepted a malformed URL")
		}
		check("Validate error", err.Error())
		err = Config{Cluster: &ClusterConfig{Addrs: []string{bad}}}.Validate()
		if err == nil {
			t.Fatalf("Validate accepted a malformed cluster address")
		}
		check("Validate error (cluster)", err.Error())
	}
}
