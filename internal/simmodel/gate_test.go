package simmodel

import (
	"errors"
	"testing"
)

func TestGate_OpensOnFailuresAndProbesAfterItsTimeout(t *testing.T) {
	clk := &clock{ms: 0}
	g := NewGate(clk.now, 30_000_000_000, 5_000_000_000, 5, 0.5)
	fail := errors.New("down")
	for range 5 {
		_ = g.Do(func() error { return fail })
		clk.ms += 100
	}
	if err := g.Do(func() error { return nil }); !errors.Is(err, ErrGateOpen) {
		t.Fatalf("after five failures: %v, want the gate open", err)
	}
	clk.ms += 5000
	ran := false
	if err := g.Do(func() error { ran = true; return nil }); err != nil || !ran {
		t.Fatalf("the probe after the timeout: %v, ran %v", err, ran)
	}
	if g.Tripped != 1 || g.Refused != 1 {
		t.Fatalf("tripped %d, refused %d", g.Tripped, g.Refused)
	}
}
