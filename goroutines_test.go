package ratelimit

import (
	"bytes"
	"runtime"
	"testing"
	"time"
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
	deadline := time.Now().Add(5 * time.Second)
	for engineGoroutines() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d engine goroutines still running", engineGoroutines())
		}
		runtime.Gosched()
		time.Sleep(time.Millisecond)
	}
}
