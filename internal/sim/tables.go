package sim

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"time"
)

// The README's tables: each is a list of runs, one row each. `go run
// ./cmd/ratelimit-sim -table <name>` prints one; `make sim` prints them
// all.

// row is one run of a table.
type row struct {
	label string
	cfg   Config
}

// table is a titled list of runs.
type table struct {
	title string
	rows  func() []row
}

// base is the tables' fleet and traffic, before each row changes it.
func base() Config {
	return Config{Regions: 10, Nodes: 10, Keys: 100_000, Hot: 20, Load: 2, Background: 1000, Duration: 10 * time.Minute}
}

var tables = map[string]table{
	"regions": {"Accuracy and cost as regions grow: 2, 10, 50 and 200 regions × 10 nodes, even and skewed traffic, defaults", func() []row {
		var out []row
		for _, sc := range []Scenario{Even, Skewed} {
			for _, r := range []int{2, 10, 50, 200} {
				c := base()
				c.Regions, c.Scenario = r, sc
				out = append(out, row{fmt.Sprintf("%d × 10, %s", r, sc), c})
			}
		}
		return out
	}},
	"nodes": {"As nodes per region grow: 1, 10 and 50 nodes × 10 regions", func() []row {
		var out []row
		for _, sc := range []Scenario{Even, Skewed} {
			for _, n := range []int{1, 10, 50} {
				c := base()
				c.Nodes, c.Scenario = n, sc
				out = append(out, row{fmt.Sprintf("10 × %d, %s", n, sc), c})
			}
		}
		return out
	}},
	"sensitivity": {"Sensitivity: 10 regions × 10 nodes, skewed traffic (accuracy) and bursts (propagation), one setting changed per row", func() []row {
		var out []row
		type change struct {
			label string
			set   func(*Config)
		}
		changes := []change{
			{"defaults (cross-region round trip ≤ 250 ms, replica lag 1 s, mysql_flush 1 s, global_sync 5 s)", func(*Config) {}},
			{"cross-region round trip 50 ms", func(c *Config) { c.CrossRTT = 50 * time.Millisecond }},
			{"cross-region round trip 150 ms", func(c *Config) { c.CrossRTT = 150 * time.Millisecond }},
			{"cross-region round trip 300 ms", func(c *Config) { c.CrossRTT = 300 * time.Millisecond }},
			{"replica lag 0.1 s", func(c *Config) { c.ReplicaLag = 100 * time.Millisecond }},
			{"replica lag 5 s", func(c *Config) { c.ReplicaLag = 5 * time.Second }},
			{"mysql_flush 500 ms", func(c *Config) { c.Flush = 500 * time.Millisecond }},
			{"mysql_flush 2 s", func(c *Config) { c.Flush = 2 * time.Second }},
			{"global_sync 2.5 s", func(c *Config) { c.GlobalSync = 2500 * time.Millisecond }},
			{"global_sync 10 s", func(c *Config) { c.GlobalSync = 10 * time.Second }},
			{"publish_floor 0.05", func(c *Config) { c.PublishFloor = 0.05 }},
		}
		for _, sc := range []Scenario{Skewed, Burst} {
			for _, ch := range changes {
				c := base()
				c.Scenario, c.Duration = sc, 5*time.Minute
				ch.set(&c)
				out = append(out, row{fmt.Sprintf("%s, %s", sc, ch.label), c})
			}
		}
		return out
	}},
	"failure": {"Failure: 10 regions × 10 nodes, skewed traffic; MySQL's primary down 60 s, one region's Redis down 30 s and back empty, one region cut off 60 s (each from minute 3:20)", func() []row {
		var out []row
		for _, sc := range []Scenario{Skewed, MySQLDown, RedisDown, Partition} {
			c := base()
			c.Scenario = sc
			out = append(out, row{string(sc), c})
		}
		return out
	}},
	"recommended": {"The recommended settings at 10, 50 and 200 regions × 10 nodes, even and skewed traffic", func() []row {
		var out []row
		for _, sc := range []Scenario{Even, Skewed} {
			for _, r := range []int{10, 50, 200} {
				c := base()
				c.Regions, c.Scenario = r, sc
				Recommended(&c)
				out = append(out, row{fmt.Sprintf("%d × 10, %s, publish_floor %g, global_sync %s", r, sc, c.PublishFloor, c.GlobalSync), c})
			}
		}
		return out
	}},
	"bars": {"The issue's bars: 50 regions × 10 and × 1 nodes, 100,000 keys, even traffic at 1 × the limit's rate, 10 minutes", func() []row {
		var out []row
		for _, n := range []int{10, 1} {
			c := base()
			c.Regions, c.Nodes, c.Load = 50, n, 1
			out = append(out, row{fmt.Sprintf("50 × %d, even, load 1", n), c})
		}
		return out
	}},
}

// Recommended sets c's cross-region settings to those the README
// recommends for its number of regions: publish_floor at about one region's
// share of evenly spread traffic, so that no spread of regions can admit
// much past the limit before each publishes; global_sync shorter as the
// floor drops, since cells below half their limit wait for it.
func Recommended(c *Config) {
	switch r := c.Regions; {
	case r <= 10:
		c.PublishFloor, c.GlobalSync = 0.05, 2*time.Second
	case r <= 50:
		c.PublishFloor, c.GlobalSync = 0.01, 2*time.Second
	default:
		c.PublishFloor, c.GlobalSync = 0.0025, 2*time.Second
	}
}

// TableNames lists the tables PrintTable knows.
func TableNames() []string {
	var out []string
	for n := range tables {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

const tableHeader = "| run | requests/s | admitted / limit per window: max / median | false allows | false denies | first denial → its count in every region: p50 / p99 | Redis calls/request | MySQL statements/s: total (busiest region) | rows read/s | rows written/s | units uncounted / unpublished |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"

// PrintTable runs and prints the table name with seed.
func PrintTable(w io.Writer, name string, seed uint64) error {
	t, ok := tables[name]
	if !ok {
		return fmt.Errorf("no table %q: want one of %v", name, TableNames())
	}
	fmt.Fprintf(w, "%s (seed %d)\n\n%s", t.title, seed, tableHeader)
	for _, r := range t.rows() {
		r.cfg.Seed = seed
		res, err := Run(r.cfg)
		if err != nil {
			return fmt.Errorf("%s: %w", r.label, err)
		}
		fmt.Fprintln(w, res.Row(r.label))
	}
	return nil
}

// Row is the run as one row of a table: accuracy and the fleet's cost.
func (r *Result) Row(label string) string {
	var busiest, stmts float64
	for _, rr := range r.Regions {
		s := r.PerSecond(rr.MySQL.Statements + rr.MySQL.ReplicaStatements)
		busiest = max(busiest, s)
		stmts += s
	}
	m := r.Total.MySQL
	cols := []string{
		label,
		fmt.Sprintf("%.0f", r.PerSecond(r.Total.Requests)),
		fmt.Sprintf("%.3f / %.3f", r.WindowMax(), r.WindowMedian()),
		pct(r.FalseAllows, r.Decisions),
		pct(r.FalseDenies, r.Decisions),
		r.BurstText(),
		fmt.Sprintf("%.2f", r.Total.RedisPerRequest()),
		fmt.Sprintf("%.1f (%.1f)", stmts, busiest),
		fmt.Sprintf("%.0f", r.PerSecond(m.RowsRead+m.ReplicaRowsRead)),
		fmt.Sprintf("%.0f", r.PerSecond(m.RowsWritten)),
		fmt.Sprintf("%d / %d", r.Uncounted, r.Unpublished),
	}
	return "| " + strings.Join(cols, " | ") + " |"
}
