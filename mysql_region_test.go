package ratelimit

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/origin"
	"github.com/edgelimit/caddy-ratelimit/propagation"
)

// TestRegionAdapter_OverridesRoundTrip: an override travels from MySQL's
// row to the region's Redis value and back unchanged, removals and
// identifiers that are not UTF-8 included, and a value that is not an
// override (or names a field of its own) is skipped, not guessed at.
func TestRegionAdapter_OverridesRoundTrip(t *testing.T) {
	for _, row := range []propagation.OverrideRow{
		{Namespace: "z", Identifier: "key\x00with\xffbytes", Limit: 7, ExpiresMs: 1_800_000_000_000, Reason: "plan", Region: "eu", Version: 1_700_000_000_000_001},
		{Namespace: "z", Identifier: "gone", Region: "us", Version: 5, Deleted: true, ExpiresMs: 9},
	} {
		rec := recOfRow(&row)
		back, ok := recOfRegion(rec.regionValue())
		if !ok {
			t.Fatalf("%q did not come back", row.Identifier)
		}
		if got := back.row(); got != row {
			t.Fatalf("round trip\n got %+v\nwant %+v", got, row)
		}
		if back.CreatedMs != row.Version/1000 {
			t.Fatalf("created %d from version %d", back.CreatedMs, row.Version)
		}
	}
	good := (&overrideRec{Zone: "z", Identifier: "a", Version: 1}).regionValue()
	for _, bad := range []origin.Override{
		{Field: good.Field, Version: 1, Value: "not json"},
		{Field: "no separator", Version: 1, Value: good.Value},
		{Field: good.Field, Version: 1, Value: `{"zone": "y", "identifier": "b"}`},
	} {
		if _, ok := recOfRegion(bad); ok {
			t.Fatalf("%+v was taken for an override", bad)
		}
	}
}

// TestRegionAdapter_CellsKeepTheirWindow: a cell named as rows name it
// becomes the origin's key and sequence and back.
func TestRegionAdapter_CellsKeepTheirWindow(t *testing.T) {
	c := propagation.Cell{Namespace: "z", Identifier: "k", WindowMs: 90_000, Sequence: 42}
	rc := roleCell(c)
	if rc.Key.Window != 90*time.Second || rc.Sequence != 42 {
		t.Fatalf("role cell %+v", rc)
	}
	if back := layerCell(rc.Key, rc.Sequence); back != c {
		t.Fatalf("back %+v, want %+v", back, c)
	}
}

// TestRegionAdapter_DenialsKeepTheirIdentifierBytes: a denial row left in
// the region's Redis comes back to the holder naming the same identifier,
// bytes that are not UTF-8 included, and is gone from the region once
// written. Through JSON alone each such byte became U+FFFD: the holder
// wrote the denial under another identifier (no other region denied the
// key), and the removal named another field, so the row stayed in the
// region for good, taken again on every flush.
func TestRegionAdapter_DenialsKeepTheirIdentifierBytes(t *testing.T) {
	srv := redistest.Start(t)
	o, err := origin.New(origin.Config{Redis: []string{srv.URL()}}, origin.Options{NodeID: "holder"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = o.Close() })
	r := redisRegion{o: o}
	ctx := context.Background()
	row := propagation.BlocklistRow{Namespace: "z", Identifier: "k\xff\xfe\x00é", WindowMs: 60_000, Sequence: 29_000_000,
		Region: "eu", Limit: 10, CountCur: 11, CountPrev: 3, ExpiresMs: 1_740_000_180_000}
	if err := r.PutDenials(ctx, []propagation.BlocklistRow{row}); err != nil {
		t.Fatal(err)
	}
	got, err := r.TakeDenials(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0] != row {
		t.Fatalf("the holder took %#v, want %#v", got, row)
	}
	if err := r.DenialsWritten(ctx, got); err != nil {
		t.Fatal(err)
	}
	if left, err := r.TakeDenials(ctx); err != nil || len(left) != 0 {
		t.Fatalf("the region still holds %+v (%v) after the row was written", left, err)
	}
}

// TestRegionAdapter_ANodeOfAnotherRegionTakesNoRole: the role's lease in
// the region's Redis carried no region, so a node whose region line named
// another region took the role of the Redis's region when it was free
// and published its counts under its own name. The adapter leases for its
// region now: a node of another one gets no lease, and an error that the
// layer knows (it logs it as such, naming both regions).
func TestRegionAdapter_ANodeOfAnotherRegionTakesNoRole(t *testing.T) {
	srv := redistest.Start(t)
	node := func(id, region string) redisRegion {
		o, err := origin.New(origin.Config{Redis: []string{srv.URL()}}, origin.Options{NodeID: id})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = o.Close() })
		return redisRegion{o: o, region: region}
	}
	eu, us := node("eu1", "eu"), node("us1", "us")
	ctx := context.Background()
	if h, err := eu.Lease(ctx, time.Minute); err != nil || h != "eu1" {
		t.Fatalf("eu1 takes the free lease: %q %v", h, err)
	}
	h, err := us.Lease(ctx, time.Minute)
	var other interface{ OtherRegion() string }
	if !errors.As(err, &other) || other.OtherRegion() != "eu" || h == "us1" {
		t.Fatalf("a node of us on eu's Redis: holder %q, %v; want no lease and an error naming eu", h, err)
	}
}
