package origin

import (
	"sync"
	"testing"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

func TestRedis_OnCallReportsEveryCall(t *testing.T) {
	srv := redistest.Start(t)
	var mu sync.Mutex
	var calls []CallInfo
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{OnCall: func(c CallInfo) {
		mu.Lock()
		calls = append(calls, c)
		mu.Unlock()
	}})
	if _, _, err := readPair(o, ctxT(t), key("x"), 1); err != nil {
		t.Fatal(err)
	}
	b := []engine.Delta{{Key: key("x"), Sequence: 1, Delta: 1, Own: 1}, {Key: key("y"), Sequence: 1, Delta: 1, Own: 1}}
	if err := o.Flush(ctxT(t), b); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(calls) != 2 || calls[0].Op != OpRead || calls[1].Op != OpFlush || calls[1].Cells != 2 ||
		calls[0].Outcome != OutcomeOK || calls[0].Duration <= 0 || calls[0].Endpoint != srv.URL() {
		t.Fatalf("calls = %+v", calls)
	}
}
