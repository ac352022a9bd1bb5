package sim

import (
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
)

// TestTables_EveryRowIsARunnableConfig: every README table lists runs that
// validate, under labels that tell them apart; the tables are named in
// order, and an unknown name is refused with the known ones.
func TestTables_EveryRowIsARunnableConfig(t *testing.T) {
	names := TableNames()
	if len(names) != len(tables) || !slices.IsSorted(names) {
		t.Fatalf("table names %v", names)
	}
	for _, name := range names {
		rows := tables[name].rows()
		if len(rows) == 0 {
			t.Errorf("table %s has no rows", name)
		}
		seen := map[string]bool{}
		for _, r := range rows {
			if seen[r.label] {
				t.Errorf("table %s: two rows labelled %q", name, r.label)
			}
			seen[r.label] = true
			if err := r.cfg.Defaults().Validate(); err != nil {
				t.Errorf("table %s, row %q: %v", name, r.label, err)
			}
		}
	}
	err := PrintTable(io.Discard, "nope", 1)
	if err == nil || !strings.Contains(err.Error(), "regions") {
		t.Fatalf("an unknown table: %v, want an error listing the tables", err)
	}
}

// TestRecommended_FloorFallsAsRegionsGrow: the recommended publish_floor
// is about one region's share of even traffic, for 10, 50 and 200 regions.
func TestRecommended_FloorFallsAsRegionsGrow(t *testing.T) {
	for _, tc := range []struct {
		regions int
		floor   float64
	}{{2, 0.05}, {10, 0.05}, {11, 0.01}, {50, 0.01}, {51, 0.0025}, {200, 0.0025}} {
		c := Config{Regions: tc.regions}
		Recommended(&c)
		if c.PublishFloor != tc.floor || c.GlobalSync != 2*time.Second {
			t.Errorf("%d regions: publish_floor %g, global_sync %s; want %g and 2s", tc.regions, c.PublishFloor, c.GlobalSync, tc.floor)
		}
	}
}

// TestResult_RowHasEveryColumnOfTheHeader: a table's row has a cell for
// each of the header's columns, the busiest region's statements among
// them.
func TestResult_RowHasEveryColumnOfTheHeader(t *testing.T) {
	r := &Result{Seconds: 10, Decisions: 10, Regions: []RegionResult{
		{MySQL: simmodel.MySQLCost{Statements: 10}},
		{MySQL: simmodel.MySQLCost{Statements: 20, ReplicaStatements: 30}},
	}, Total: RegionResult{Requests: 100}}
	row := r.Row("label")
	header := strings.SplitN(tableHeader, "\n", 2)[0]
	if got, want := strings.Count(row, "|"), strings.Count(header, "|"); got != want {
		t.Fatalf("row %q has %d bars, the header %d", row, got, want)
	}
	if !strings.HasPrefix(row, "| label | 10 |") || !strings.Contains(row, "| 6.0 (5.0) |") {
		t.Fatalf("row %q: want the label, 10 requests/s, and 6.0 statements/s (5.0 in the busiest region)", row)
	}
}
