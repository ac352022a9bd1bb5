package origin

import (
	"fmt"
	"sync"
	"testing"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// TestOverrides_ACheckedPutJudgesWhatTheRegionHolds: PutOverrideIf takes a
// change only when what the region holds meets the condition, with the
// node's meaning (overrides_preconditions.go): If-Match names a live
// override's "version.region", "*" any live one; If-None-Match "*" wants
// no live one; a removal or a lapsed override is not live. It writes as
// PutOverrides does (a value an older build reads and writes alike),
// bumps the counter only when it took, and returns what was held.
func TestOverrides_ACheckedPutJudgesWhatTheRegionHolds(t *testing.T) {
	srv := redistest.Start(t)
	a := newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"})
	ctx := ctxT(t)
	rc := srv.Client()
	const f = "ov\x00k"
	// Written by an older build: PutOverrides, no condition.
	if _, err := a.PutOverrides(ctx, []Override{{Field: f, Version: 100, Value: `{"limit":1,"region":"eu","created_ms":1,"version":100}`}}, false); err != nil {
		t.Fatal(err)
	}
	tags := func(ts ...string) OverrideTags { return OverrideTags{Given: true, Tags: ts} }
	star := OverrideTags{Given: true, Any: true}
	for i, c := range []struct {
		match, none OverrideTags
		now         int64
		took        bool
	}{
		{match: tags(`"99.eu"`), took: false},
		{match: tags(`"100"`), took: false}, // the region is part of the tag
		{none: star, took: false},
		{none: tags(`"100.eu"`), took: false},
		{match: tags(`"1.x"`, `"100.eu"`), took: true},
	} {
		v := int64(200 + i)
		got, err := a.PutOverrideIf(ctx, Override{Field: f, Version: v, Value: fmt.Sprintf(`{"limit":%d,"region":"eu","created_ms":1,"version":%d}`, v, v)},
			OverrideCondition{Field: f, NowMs: 1000, Match: c.match, NoneMatch: c.none}, false)
		if err != nil || got.Took != c.took || got.Failed == c.took || !got.Holds || got.Held.Version != 100 {
			t.Fatalf("case %d: %+v %v, want took %v, held version 100", i, got, err, c.took)
		}
	}
	// The change took as 204.eu; an older build's read sees it as its own.
	_, all, err := a.Overrides(ctx)
	if err != nil || len(all) != 1 || all[0].Version != 204 {
		t.Fatalf("the region holds %+v (%v), want version 204", all, err)
	}
	// A removal, and an override lapsed at now, are not live.
	for _, held := range []string{`{"limit":0,"region":"eu","deleted":true,"expires_ms":99999,"version":300}`, `{"limit":1,"region":"eu","expires_ms":1000,"version":300}`} {
		rc.HSet(ctx, a.overridesKey(), f, "300 "+held)
		got, err := a.PutOverrideIf(ctx, Override{Field: f, Version: 400, Value: `{"limit":5,"region":"eu"}`},
			OverrideCondition{Field: f, NowMs: 1000, Match: star}, false)
		if err != nil || !got.Failed {
			t.Fatalf("If-Match: * over %s: %+v %v, want failed", held, got, err)
		}
		got, err = a.PutOverrideIf(ctx, Override{Field: f, Version: 300 + int64(len(held)), Value: `{"limit":5,"region":"eu"}`},
			OverrideCondition{Field: f, NowMs: 1000, NoneMatch: star}, false)
		if err != nil || !got.Took {
			t.Fatalf("If-None-Match: * over %s: %+v %v, want took", held, got, err)
		}
		rc.HSet(ctx, a.overridesKey(), f, "300 "+held)
	}
	// A field the region never held: If-Match fails, If-None-Match: * takes.
	got, err := a.PutOverrideIf(ctx, Override{Field: "ov\x00new", Version: 1, Value: `{"limit":5}`}, OverrideCondition{Field: "ov\x00new", Match: star}, false)
	if err != nil || !got.Failed || got.Holds {
		t.Fatalf("If-Match: * on nothing: %+v %v", got, err)
	}
}

// TestOverrides_TwoNodesCheckedPutsAtOnceOneTakes: two nodes (two clients
// of one Redis) write one field at once under the same If-Match; 20 times
// over, exactly one takes and the other fails its condition.
func TestOverrides_TwoNodesCheckedPutsAtOnceOneTakes(t *testing.T) {
	srv := redistest.Start(t)
	nodes := []*Redis{newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "a"}), newOrigin(t, Config{Redis: []string{srv.URL()}}, Options{NodeID: "b"})}
	ctx := ctxT(t)
	const f = "ov\x00race"
	for round := range 20 {
		base := int64(1000 * (round + 1))
		if _, err := nodes[0].PutOverrides(ctx, []Override{{Field: f, Version: base, Value: `{"limit":1,"region":"eu"}`}}, false); err != nil {
			t.Fatal(err)
		}
		cond := OverrideCondition{Field: f, Match: OverrideTags{Given: true, Tags: []string{fmt.Sprintf(`"%d.eu"`, base)}}}
		got := make([]Checked, 2)
		errs := make([]error, 2)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i, n := range nodes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				got[i], errs[i] = n.PutOverrideIf(ctx, Override{Field: f, Version: base + 1 + int64(i), Value: `{"limit":2,"region":"eu"}`}, cond, false)
			}()
		}
		close(start)
		wg.Wait()
		if errs[0] != nil || errs[1] != nil || got[0].Took == got[1].Took || got[0].Failed == got[1].Failed {
			t.Fatalf("round %d: %+v %v, want one took and one failed", round, got, errs)
		}
	}
}
