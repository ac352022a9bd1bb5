package origin

import (
	"testing"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// TestScripts_ReloadedAfterScriptFlush: a Redis that lost its scripts (a
// restart, a failover, SCRIPT FLUSH) gets them loaded again by the next
// read, flush or reservation, which then succeeds once: nothing is lost
// and nothing counts twice.
func TestScripts_ReloadedAfterScriptFlush(t *testing.T) {
	srv := redistest.Start(t)
	o := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "p"})
	seq := nowSeq()
	ks := []engine.Key{key("ivan"), key("judy")}
	flushScripts := func() {
		t.Helper()
		if err := srv.Client().ScriptFlush(ctxT(t)).Err(); err != nil {
			t.Fatal(err)
		}
	}
	for round := int64(1); round <= 3; round++ {
		flushScripts()
		for _, k := range ks {
			if _, err := o.Read(ctxT(t), k, seq, 0); err != nil {
				t.Fatalf("round %d: read after SCRIPT FLUSH: %v", round, err)
			}
		}
		flushScripts()
		batch := []engine.Delta{{Key: ks[0], Sequence: seq, Delta: 1, Own: round}, {Key: ks[1], Sequence: seq, Delta: 1, Own: round}}
		if err := o.Flush(ctxT(t), batch); err != nil || !batch[0].Done || !batch[1].Done {
			t.Fatalf("round %d: flush after SCRIPT FLUSH: %v (%+v)", round, err, batch)
		}
		flushScripts()
		r := reservation(ks[0], seq, round, 1, 1000)
		if err := o.Reserve(ctxT(t), r); err != nil || !r.Admitted {
			t.Fatalf("round %d: reservation after SCRIPT FLUSH: %v admitted=%v", round, err, r.Admitted)
		}
		if err := o.Flush(ctxT(t), []engine.Delta{{Key: ks[0], Sequence: seq, Own: round + 1}}); err != nil {
			t.Fatal(err)
		}
		for i, want := range []int64{round + 1, round} {
			cur, _, err := readPair(o, ctxT(t), ks[i], seq)
			if err != nil || cur != want {
				t.Fatalf("round %d: %s holds %d (%v), want %d", round, ks[i].Identifier, cur, err, want)
			}
		}
	}
}
