package ratelimit

import (
	"bytes"
	"runtime"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// engineGoroutines counts the goroutines running code of the engine package.
func engineGoroutines() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	count := 0
	for _, g := range bytes.Split(buf, []byte("\n\n")) {
		if bytes.Contains(g, []byte("caddy-ratelimit/engine.")) {
			count++
		}
	}
	return count
}

// waitNoEngineGoroutines waits until every engine goroutine has returned; a
// closed engine's goroutines have been told to stop, so only their last
// instructions remain.
func waitNoEngineGoroutines(t *testing.T) {
	t.Helper()
	redistest.Eventually(t, 5*time.Second, "every engine goroutine returns", func() bool {
		return engineGoroutines() == 0
	})
}
