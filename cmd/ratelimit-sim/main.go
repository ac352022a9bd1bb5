package main

import (
	"flag"
	"fmt"
	"os"
	"runtime/pprof"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/sim"
)

func main() {
	var c sim.Config
	var minutes float64
	var scenario, table string
	flag.IntVar(&c.Regions, "regions", 10, "regions")
	flag.IntVar(&c.Nodes, "nodes", 10, "nodes per region")
	flag.IntVar(&c.Keys, "keys", 10_000, "distinct keys: the hot keys and the background keys")
	flag.IntVar(&c.Hot, "hot", 20, "hot keys, whose admitted count per window is measured (negative: none)")
	flag.Float64Var(&minutes, "minutes", 10, "simulated minutes")
	flag.Uint64Var(&c.Seed, "seed", 1, "the seed: one seed, one output")
	flag.StringVar(&scenario, "scenario", "even", fmt.Sprintf("traffic and fault: %v", sim.Scenarios))
	flag.Int64Var(&c.Limit, "limit", 1000, "every key's limit per window")
	flag.DurationVar(&c.Window, "window", time.Minute, "the window")
	flag.Float64Var(&c.Load, "load", 2, "hot keys' offered rate, × the limit's rate")
	flag.Float64Var(&c.Background, "background", 1000, "background requests a second, all regions (negative: none)")
	flag.DurationVar(&c.CrossRTT, "cross-rtt", 250*time.Millisecond, "round trip to the primary from the farthest region (the nearest: 0.28 ×)")
	flag.DurationVar(&c.ReplicaLag, "replica-lag", time.Second, "the replicas' median lag (p99: 3 ×)")
	flag.BoolVar(&c.NoReplicas, "no-replicas", false, "every region reads from the primary")
	flag.DurationVar(&c.Flush, "mysql-flush", time.Second, "mysql_flush")
	flag.DurationVar(&c.GlobalSync, "global-sync", 5*time.Second, "global_sync")
	flag.DurationVar(&c.BlocklistSync, "blocklist-sync", 10*time.Second, "blocklist_sync")
	flag.Float64Var(&c.PublishFloor, "publish-floor", 0.2, "publish_floor")
	flag.Float64Var(&c.RedisLoss, "redis-loss", 0, "share of Redis calls lost")
	profile := flag.String("cpuprofile", "", "write a CPU profile of the run to this file")
	flag.StringVar(&table, "table", "", "print one of the README's tables instead of one run: "+fmt.Sprint(sim.TableNames()))
	flag.Parse()
	c.Duration = time.Duration(minutes * float64(time.Minute))
	if *profile != "" {
		f, err := os.Create(*profile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "ratelimit-sim:", err)
			os.Exit(2)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintln(os.Stderr, "ratelimit-sim:", err)
			os.Exit(2)
		}
		defer pprof.StopCPUProfile()
	}
	c.Scenario = sim.Scenario(scenario)
	if table != "" {
		if err := sim.PrintTable(os.Stdout, table, c.Seed); err != nil {
			fmt.Fprintln(os.Stderr, "ratelimit-sim:", err)
			os.Exit(2)
		}
		return
	}
	res, err := sim.Run(c)
	if err != nil {
		fmt.Fprintln(os.Stderr, "ratelimit-sim:", err)
		pprof.StopCPUProfile()
		os.Exit(2)
	}
	res.Print(os.Stdout)
	if hp := os.Getenv("SIM_HEAPPROFILE"); hp != "" {
		f, _ := os.Create(hp)
		_ = pprof.WriteHeapProfile(f)
		f.Close()
	}
}
