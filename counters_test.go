package ratelimit

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

type fakeSnap struct {
	hits, misses, queued int64
	at                   time.Time
	up                   bool
}

var fakeStats = statSet[fakeSnap]{labels: []string{"endpoint"}, stats: []stat[fakeSnap]{
	{json: "up", metric: "test_up", gauge: true, value: func(s *fakeSnap) any { return s.up }, help: "Up."},
	{json: "lookups.hits", metric: "test_lookups_total", label: [2]string{"result", "hit"}, value: func(s *fakeSnap) any { return s.hits }, help: "Lookups."},
	{json: "lookups.misses", metric: "test_lookups_total", label: [2]string{"result", "miss"}, value: func(s *fakeSnap) any { return s.misses }},
	{json: "queued", value: func(s *fakeSnap) any { return s.queued }},
	{json: "last", metric: "test_last_timestamp_seconds", gauge: true, value: func(s *fakeSnap) any { return s.at }, help: "Last."},
}}

func TestCounters_SectionKeepsOrderAndNests(t *testing.T) {
	s := fakeSnap{hits: 3, misses: 1, queued: 7, up: true}
	b, err := json.Marshal(fakeStats.section(&s))
	if err != nil {
		t.Fatal(err)
	}
	want := `{"up":true,"lookups":{"hits":3,"misses":1},"queued":7,"last":null}`
	if string(b) != want {
		t.Fatalf("section %s, want %s", b, want)
	}
	s.at = time.UnixMilli(1_700_000_000_123).In(time.FixedZone("x", 3600))
	b, _ = json.Marshal(fakeStats.section(&s))
	if want := `{"up":true,"lookups":{"hits":3,"misses":1},"queued":7,"last":"2023-11-14T22:13:20.123Z"}`; string(b) != want {
		t.Fatalf("section %s, want %s (times in UTC)", b, want)
	}
}

// collected returns the value of each series fakeStats sends, by metric
// and label values.
func collected(t *testing.T, s *fakeSnap, base []float64) map[string]float64 {
	t.Helper()
	ch := make(chan prometheus.Metric, 16)
	fakeStats.collect(ch, s, base, "e1")
	close(ch)
	out := map[string]float64{}
	for m := range ch {
		var pb dto.Metric
		if err := m.Write(&pb); err != nil {
			t.Fatal(err)
		}
		key := m.Desc().String()
		for _, l := range pb.GetLabel() {
			key += " " + l.GetName() + "=" + l.GetValue()
		}
		out[key] = pb.GetCounter().GetValue() + pb.GetGauge().GetValue()
	}
	return out
}

func TestCounters_CollectAddsRetiredCountersOnly(t *testing.T) {
	s := fakeSnap{hits: 3, misses: 1, up: true, at: time.Unix(100, 0)}
	base := fakeStats.retire(&fakeSnap{hits: 10, misses: 20, up: true, at: time.Unix(50, 0)}, nil)
	got := collected(t, &s, base)
	var counters, gauges float64
	for k, v := range got {
		switch {
		case strings.Contains(k, "test_lookups_total"):
			counters += v
		default:
			gauges += v
		}
	}
	// hits 3+10, misses 1+20; gauges up (1) and last (100 s) as they are.
	if counters != 34 || gauges != 101 || len(got) != 4 {
		t.Fatalf("collected %v: counters %v, gauges %v", got, counters, gauges)
	}
	// Without a snapshot, only the retired counters go out.
	if got := collected(t, nil, base); len(got) != 2 {
		t.Fatalf("without a snapshot: %v, want the two counters", got)
	}
}

func TestCounters_OneDescriptorPerMetric(t *testing.T) {
	descs := fakeStats.descs()
	if len(descs) != 3 {
		t.Fatalf("%d descriptors, want 3 (up, lookups, last)", len(descs))
	}
	for _, d := range descs {
		if s := d.String(); strings.Contains(s, "test_lookups_total") && !strings.Contains(s, `variableLabels: {endpoint,result}`) {
			t.Fatalf("lookups descriptor %s, want labels endpoint and result", s)
		}
	}
}
