package redistest

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// SentinelMaster is the master name StartSentinel monitors.
const SentinelMaster = "mymaster"

// StartSentinel starts a Redis Sentinel that monitors master under the name
// SentinelMaster, and stops it when the test ends.
func StartSentinel(t testing.TB, master *Server) *Server {
	t.Helper()
	return Start(t, func(s *Server) { s.sentinelOf = master })
}

func (s *Server) writeSentinelConf() error {
	m := s.sentinelOf
	conf := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %s\nlogfile %s\n"+
		"sentinel monitor %s 127.0.0.1 %d 1\nsentinel down-after-milliseconds %s 5000\n",
		s.port, s.dir, filepath.Join(s.dir, "redis.log"), SentinelMaster, m.port, SentinelMaster)
	if m.password != "" {
		conf += fmt.Sprintf("sentinel auth-pass %s %s\n", SentinelMaster, m.password)
	}
	if err := os.WriteFile(filepath.Join(s.dir, "sentinel.conf"), []byte(conf), 0o600); err != nil {
		return fmt.Errorf("write sentinel.conf: %w", err)
	}
	return nil
}
