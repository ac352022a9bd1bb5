package redistest

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// SentinelMaster is the master name StartSentinel monitors.
const SentinelMaster = "mymaster"

// StartSentinel starts a Redis Sentinel that monitors master under the name
// SentinelMaster, and stops it when the test ends.
func StartSentinel(t testing.TB, master *Server) *Server {
	t.Helper()
	return Start(t, func(s *Server) { s.sentinelOf = master })
}

// StartFastSentinel is StartSentinel with a sentinel that judges the
// master down after downAfter without an answer (StartSentinel's 5 s),
// and so fails over within about that.
func StartFastSentinel(t testing.TB, master *Server, downAfter time.Duration) *Server {
	t.Helper()
	return Start(t, func(s *Server) { s.sentinelOf, s.downAfter = master, downAfter })
}

func (s *Server) writeSentinelConf() error {
	m := s.sentinelOf
	downAfter := 5 * time.Second
	if s.downAfter > 0 {
		downAfter = s.downAfter
	}
	conf := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %s\nlogfile %s\n"+
		"sentinel monitor %s 127.0.0.1 %d 1\nsentinel down-after-milliseconds %s %d\n",
		s.port, s.dir, filepath.Join(s.dir, "redis.log"), SentinelMaster, m.port, SentinelMaster, downAfter.Milliseconds())
	if m.password != "" {
		conf += fmt.Sprintf("sentinel auth-pass %s %s\n", SentinelMaster, m.password)
	}
	if err := os.WriteFile(filepath.Join(s.dir, "sentinel.conf"), []byte(conf), 0o600); err != nil {
		return fmt.Errorf("write sentinel.conf: %w", err)
	}
	return nil
}
