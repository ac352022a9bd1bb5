package propagation

import "testing"

// TestStats_ShowWhatWaitsAndWhatWasRead: the snapshot shows the overrides
// waiting to be written, then those written and read back, and the
// replica's lag as unknown without a replica.
func TestStats_ShowWhatWaitsAndWhatWasRead(t *testing.T) {
	s := newSetup(t)
	a := s.region("a")
	a.p.PutOverride(OverrideRow{Namespace: "z", Identifier: "k", Limit: 5, Region: "a", Version: 1})
	if st := a.p.Stats(); st.PendingOverrides != 1 || st.OverridesWritten != 0 {
		t.Fatalf("before a flush: %d pending, %d written", st.PendingOverrides, st.OverridesWritten)
	}
	a.p.FlushOnce(bg)
	st := a.p.Stats()
	if st.PendingOverrides != 0 || st.OverridesWritten != 1 || st.OverrideRowsRead != 1 {
		t.Fatalf("after a flush: %d pending, %d written, %d read; want 0, 1, 1", st.PendingOverrides, st.OverridesWritten, st.OverrideRowsRead)
	}
	if st.ReplicaLag != -1 || st.Role != "own-region" || st.Region != "a" {
		t.Fatalf("lag %s, role %q, region %q; want unknown, own-region, a", st.ReplicaLag, st.Role, st.Region)
	}
}
