package redistest

import (
	"context"
	"testing"
	"time"
)

// TestServer_ServesRestartsEmptyAndCounts: a private server answers, is
// empty after Restart on the same port, and INFO commandstats counts what
// it was sent.
func TestServer_ServesRestartsEmptyAndCounts(t *testing.T) {
	s := Start(t)
	ctx := context.Background()
	c := s.Client()
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	stats, err := s.CommandStats(ctx)
	if err != nil || stats["set"] != 1 {
		t.Fatalf("commandstats %v (%v), want one set", stats, err)
	}
	port := s.Port()
	s.Restart()
	if s.Port() != port {
		t.Fatalf("restarted on port %d, was %d", s.Port(), port)
	}
	Eventually(t, 5*time.Second, "the restarted server answers", func() bool { return c.Ping(ctx).Err() == nil })
	if n, err := c.Exists(ctx, "k").Result(); err != nil || n != 0 {
		t.Fatalf("after a restart the key exists: %d %v", n, err)
	}
}

// TestParseCommandStats reads the calls of each command and refuses a
// malformed count.
func TestParseCommandStats(t *testing.T) {
	got, err := ParseCommandStats("# Commandstats\r\ncmdstat_evalsha:calls=12,usec=30,usec_per_call=2.5\r\ncmdstat_get:calls=3,usec=1\r\n")
	if err != nil || got["evalsha"] != 12 || got["get"] != 3 || len(got) != 2 {
		t.Fatalf("parsed %v, %v", got, err)
	}
	if _, err := ParseCommandStats("cmdstat_get:calls=x"); err == nil {
		t.Fatal("a malformed count was accepted")
	}
}
