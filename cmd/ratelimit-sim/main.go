package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/sim"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// options is what a command line asks for: one run of cfg, or the table
// named table (with cfg's seed); profile names the CPU profile's file.
type options struct {
	cfg     sim.Config
	table   string
	profile string
}

// parse reads a command line (without the command's name); flag's own
// errors and the usage go to stderr.
func parse(args []string, stderr io.Writer) (options, error) {
	var o options
	c := &o.cfg
	var minutes float64
	var scenario string
	fs := flag.NewFlagSet("ratelimit-sim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&c.Regions, "regions", 10, "regions")
	fs.IntVar(&c.Nodes, "nodes", 10, "nodes per region")
	fs.IntVar(&c.Keys, "keys", 10_000, "distinct keys: the hot keys and the background keys")
	fs.IntVar(&c.Hot, "hot", 20, "hot keys, whose admitted count per window is measured (negative: none)")
	fs.Float64Var(&minutes, "minutes", 10, "simulated minutes")
	fs.Uint64Var(&c.Seed, "seed", 1, "the seed: one seed, one output")
	fs.StringVar(&scenario, "scenario", "even", fmt.Sprintf("traffic and fault: %v", sim.Scenarios))
	fs.Int64Var(&c.Limit, "limit", 1000, "every key's limit per window")
	fs.DurationVar(&c.Window, "window", time.Minute, "the window")
	fs.Float64Var(&c.Load, "load", 2, "hot keys' offered rate, × the limit's rate")
	fs.Float64Var(&c.Background, "background", 1000, "background requests a second, all regions (negative: none)")
	fs.DurationVar(&c.CrossRTT, "cross-rtt", 250*time.Millisecond, "round trip to the primary from the farthest region (the nearest: 0.28 ×)")
	fs.DurationVar(&c.ReplicaLag, "replica-lag", time.Second, "the replicas' median lag (p99: 3 ×)")
	fs.BoolVar(&c.NoReplicas, "no-replicas", false, "every region reads from the primary")
	fs.DurationVar(&c.Flush, "mysql-flush", time.Second, "mysql_flush")
	fs.DurationVar(&c.GlobalSync, "global-sync", 5*time.Second, "global_sync")
	fs.DurationVar(&c.BlocklistSync, "blocklist-sync", 10*time.Second, "blocklist_sync")
	fs.Float64Var(&c.PublishFloor, "publish-floor", 0.2, "publish_floor")
	fs.Float64Var(&c.RedisLoss, "redis-loss", 0, "share of Redis calls lost")
	fs.StringVar(&o.profile, "cpuprofile", "", "write a CPU profile of the run to this file")
	fs.StringVar(&o.table, "table", "", "print one of the README's tables instead of one run: "+fmt.Sprint(sim.TableNames()))
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	c.Duration = time.Duration(minutes * float64(time.Minute))
	c.Scenario = sim.Scenario(scenario)
	return o, nil
}

// run runs the command line args, printing the run or the table to
// stdout and errors to stderr, and returns the exit status: 2 for an
// error, as flag's own.
func run(args []string, stdout, stderr io.Writer) int {
	o, err := parse(args, stderr)
	switch {
	case errors.Is(err, flag.ErrHelp):
		return 0
	case err != nil:
		return 2
	}
	fail := func(err error) int {
		fmt.Fprintln(stderr, "ratelimit-sim:", err)
		return 2
	}
	if o.profile != "" {
		f, err := os.Create(o.profile)
		if err != nil {
			return fail(err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return fail(err)
		}
		defer pprof.StopCPUProfile()
	}
	if o.table != "" {
		if err := sim.PrintTable(stdout, o.table, o.cfg.Seed); err != nil {
			return fail(err)
		}
		return 0
	}
	res, err := sim.Run(o.cfg)
	if err != nil {
		return fail(err)
	}
	res.Print(stdout)
	if hp := os.Getenv("SIM_HEAPPROFILE"); hp != "" {
		// A profile for the developer's eyes only: one that cannot be
		// written is no reason to fail the run it follows.
		if f, err := os.Create(hp); err == nil {
			_ = pprof.WriteHeapProfile(f)
			f.Close()
		}
	}
	return 0
}
