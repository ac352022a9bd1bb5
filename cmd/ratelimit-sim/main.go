package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"runtime/pprof"
	"slices"
	"strings"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/sim"
	"github.com/edgelimit/caddy-ratelimit/propagation"
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

// parse reads a command line (without the command's name) and checks it:
// every flag's value must mean what it says, since a zero or an
// out-of-range value reaching sim.Config would quietly become a default or
// a run of something else. flag's own errors and the usage go to stderr,
// and come back as a printedError.
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
	fs.DurationVar(&c.MinWindow, "min-window", time.Minute, "min_window: a shorter -window stays in its region")
	fs.Float64Var(&c.RedisLoss, "redis-loss", 0, "share of Redis calls lost, 0 to 1")
	fs.StringVar(&o.profile, "cpuprofile", "", "write a CPU profile of the run to this file")
	fs.StringVar(&o.table, "table", "", "print one of the README's tables instead of one run: "+fmt.Sprint(sim.TableNames())+
		"; each row sets its own fleet, traffic and settings, so only -seed and -cpuprofile go with it")
	if err := fs.Parse(args); err != nil {
		return o, printedError{err}
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected argument %q: the command takes flags only, and reads none after an argument", fs.Arg(0))
	}
	// -table= (an empty name) is a table asked for and named wrongly,
	// not a request for one run: it ran the default run, ten minutes of
	// 10 × 10 nodes, without a word.
	tableGiven := false
	fs.Visit(func(f *flag.Flag) { tableGiven = tableGiven || f.Name == "table" })
	if tableGiven {
		return o, checkTable(fs, o.table)
	}
	bad := func(name, want string) error {
		return fmt.Errorf("-%s %s: %s", name, fs.Lookup(name).Value, want)
	}
	const maxMinutes = float64(math.MaxInt64 / int64(time.Minute))
	// The intervals the cross-region layer accepts: a longer one failed
	// the run in package propagation's checks, not naming the flag.
	interval := fmt.Sprintf("want at least %s and at most %s", propagation.MinInterval, propagation.MaxInterval)
	finite := func(f float64) bool { return !math.IsNaN(f) && !math.IsInf(f, 0) }
	switch {
	case c.Regions < 1:
		return o, bad("regions", "want at least 1 region")
	case c.Nodes < 1:
		return o, bad("nodes", "want at least 1 node per region")
	case c.Keys < 1:
		return o, bad("keys", "want at least 1 key")
	case c.Hot == 0:
		return o, bad("hot", "want at least 1 hot key, or a negative number for none")
	case c.Hot > c.Keys:
		return o, bad("hot", fmt.Sprintf("more hot keys than -keys %d", c.Keys))
	case !slices.Contains(sim.Scenarios, sim.Scenario(scenario)):
		return o, fmt.Errorf("-scenario %q: want one of %v", scenario, sim.Scenarios)
	case sim.Scenario(scenario) == sim.Partition && c.Regions < 2:
		// The cut-off region is one of the others: with one region there
		// is none, and the run was a skewed one under partition's name.
		return o, fmt.Errorf("-scenario partition cuts one region off from the others: want at least 2 -regions, not %d", c.Regions)
	case c.Limit < 1:
		return o, bad("limit", "want a positive limit")
	case c.Limit > 1<<53-1:
		// The directive's bound, the largest count a JSON or Lua number
		// holds exactly: the models of Redis count as its scripts do.
		return o, bad("limit", "want at most 9007199254740991 (2^53−1), as the directive")
	case c.Window < time.Millisecond:
		return o, bad("window", "want at least 1ms")
	case !(minutes > 0) || minutes > maxMinutes:
		return o, bad("minutes", fmt.Sprintf("want a positive number of minutes, at most %g", maxMinutes))
	case time.Duration(minutes*float64(time.Minute)) < c.Window:
		return o, bad("minutes", fmt.Sprintf("shorter than -window %s", c.Window))
	case !(c.Load > 0) || !finite(c.Load):
		return o, bad("load", "want a positive multiple of the limit's rate")
	case c.Background == 0 || !finite(c.Background):
		return o, bad("background", "want a positive rate, or a negative one for none")
	case c.CrossRTT <= 0:
		return o, bad("cross-rtt", "want a positive round trip")
	case c.ReplicaLag <= 0:
		return o, bad("replica-lag", "want a positive lag")
	case c.Flush < propagation.MinInterval || c.Flush > propagation.MaxInterval:
		return o, bad("mysql-flush", interval)
	case c.GlobalSync < propagation.MinInterval || c.GlobalSync > propagation.MaxInterval:
		return o, bad("global-sync", interval)
	case c.BlocklistSync < propagation.MinInterval || c.BlocklistSync > propagation.MaxInterval:
		return o, bad("blocklist-sync", interval)
	case c.MinWindow < propagation.MinInterval:
		return o, bad("min-window", fmt.Sprintf("want at least %s", propagation.MinInterval))
	case !(c.PublishFloor > 0 && c.PublishFloor <= 1):
		return o, bad("publish-floor", "want a share of the limit above 0 and at most 1")
	case !(c.RedisLoss >= 0 && c.RedisLoss <= 1):
		return o, bad("redis-loss", "want a probability from 0 to 1")
	}
	c.Duration = time.Duration(minutes * float64(time.Minute))
	c.Scenario = sim.Scenario(scenario)
	return o, tooBig(c)
}

// The bounds of one run: the simulator holds every node's engine and
// every key's name in memory (200 regions × 10 nodes of 100,000 keys took
// 12 GB), decides about 10,000 requests a second of wall clock, and runs
// every node's loops, traffic or not, about 40,000 simulated seconds of
// one node a second of wall clock, so a run past them would die of an
// allocation or not end.
const (
	maxNodes       = 20_000
	maxKeys        = 10_000_000
	maxRequests    = 1e9
	maxNodeSeconds = 1e9
)

// tooBig reports a run beyond any machine: a fleet, a keyspace or a
// number of requests past the bounds.
func tooBig(c *sim.Config) error {
	if c.Regions > maxNodes/c.Nodes {
		return fmt.Errorf("-regions %d × -nodes %d: want at most %d nodes in all (each runs its own engine in memory)", c.Regions, c.Nodes, maxNodes)
	}
	if c.Keys > maxKeys {
		return fmt.Errorf("-keys %d: want at most %d keys", c.Keys, maxKeys)
	}
	// The hot keys' rate: Load × the limit's (ten times that when abusive;
	// a burst is ten times the limit's), and the background's.
	hot := c.Load
	switch c.Scenario {
	case sim.Abuse:
		hot *= 10
	case sim.Burst:
		hot = 10
	}
	perSecond := max(c.Background, 0)
	if c.Hot > 0 {
		perSecond += float64(c.Hot) * hot * float64(c.Limit) / c.Window.Seconds()
	}
	if n := perSecond * c.Duration.Seconds(); !(n <= maxRequests) {
		return fmt.Errorf("about %.3g requests (%.3g a second for %s): want at most %g; lower -load, -limit, -background, -hot or -minutes, or lengthen -window",
			n, perSecond, c.Duration, maxRequests)
	}
	// Every node ticks through the whole run whatever its traffic: a
	// long run of no requests (-hot -1 -background -1 -minutes 1e8) was
	// let through, for about 40 hours of wall clock at one node, and at
	// 20,000 nodes far longer.
	nodes := float64(c.Regions * c.Nodes)
	if n := nodes * c.Duration.Seconds(); !(n <= maxNodeSeconds) {
		return fmt.Errorf("-minutes %g × %g nodes: about %.3g seconds of one node's loops, want at most %g; lower -minutes, -regions or -nodes",
			c.Duration.Minutes(), nodes, n, float64(maxNodeSeconds))
	}
	return nil
}

// checkTable checks a command line that asks for a table: a known name,
// and no flag but -seed and -cpuprofile beside it, since the table's rows
// set everything else themselves (a -regions beside -table regions could
// only be ignored or contradict the table).
func checkTable(fs *flag.FlagSet, name string) error {
	if !slices.Contains(sim.TableNames(), name) {
		return fmt.Errorf("-table %q: want one of %v", name, sim.TableNames())
	}
	var extra []string
	fs.Visit(func(f *flag.Flag) {
		if !slices.Contains([]string{"table", "seed", "cpuprofile"}, f.Name) {
			extra = append(extra, "-"+f.Name)
		}
	})
	if len(extra) > 0 {
		return fmt.Errorf("-table %s sets each row's fleet, traffic and settings itself: %s would not apply (only -seed and -cpuprofile go with -table)", name, strings.Join(extra, ", "))
	}
	return nil
}

// printedError is an error flag's parser has already printed, with the
// usage.
type printedError struct{ error }

func (e printedError) Unwrap() error { return e.error }

// run runs the command line args, printing the run or the table to
// stdout and errors to stderr, and returns the exit status: 2 for an
// error, as flag's own.
func run(args []string, stdout, stderr io.Writer) int {
	fail := func(err error) int {
		fmt.Fprintln(stderr, "ratelimit-sim:", err)
		return 2
	}
	o, err := parse(args, stderr)
	var printed printedError
	switch {
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, &printed):
		return 2
	case err != nil:
		return fail(err)
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
