package origin

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
)

// TestClassify_EveryErrorHasItsOutcome: a refusal without I/O is rejected,
// a deadline is a timeout whatever layer reports it, anything else is an
// error; wrapping changes nothing.
func TestClassify_EveryErrorHasItsOutcome(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want Outcome
	}{
		{nil, OutcomeOK},
		{fmt.Errorf("redis read x: %w", ErrBreakerOpen), OutcomeRejected},
		{fmt.Errorf("redis flush x: %w", ErrClosed), OutcomeRejected},
		{context.DeadlineExceeded, OutcomeTimeout},
		{fmt.Errorf("read tcp: %w", os.ErrDeadlineExceeded), OutcomeTimeout},
		{context.Canceled, OutcomeError},
		{errors.New("connection refused"), OutcomeError},
	} {
		if got := classify(tc.err); got != tc.want {
			t.Errorf("classify(%v) = %s, want %s", tc.err, got, tc.want)
		}
	}
}

// TestStats_OpsAndOutcomesNameTheirLabels: the names are the keys of
// EndpointStats.Calls, which the status JSON and the metrics show.
func TestStats_OpsAndOutcomesNameTheirLabels(t *testing.T) {
	var ops, outcomes []string
	for op := Op(0); op < numOps; op++ {
		ops = append(ops, op.String())
	}
	for o := Outcome(0); o < numOutcomes; o++ {
		outcomes = append(outcomes, o.String())
	}
	if got, want := fmt.Sprint(ops), "[read flush reserve]"; got != want {
		t.Errorf("ops %s, want %s", got, want)
	}
	if got, want := fmt.Sprint(outcomes), "[ok error timeout rejected]"; got != want {
		t.Errorf("outcomes %s, want %s", got, want)
	}
}
