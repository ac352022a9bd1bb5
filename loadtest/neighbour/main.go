// Command neighbour keeps one core busy for a share of every period and
// idle for the rest, as a process sharing a core would: a redis-server
// answering flushes, say, but doing nothing for anyone. `make busy` runs it
// on wrk's core (NEIGHBOUR=<percent>) to tell what a variant costs Caddy
// from what sharing the machine costs it: on a virtual machine another
// process's CPU on the load generator's core raises Caddy's CPU per request
// though Caddy does the same work. It runs until it is killed, or for
// -for when that is set.
package main

import (
	"flag"
	"fmt"
	"os"
	"time"
)

func main() {
	share := flag.Float64("share", 15, "percent of the core to keep busy, 0 to 100")
	period := flag.Duration("period", 3*time.Millisecond, "one busy and idle cycle")
	limit := flag.Duration("for", 0, "stop after this long (0: run until killed)")
	flag.Parse()
	if *share < 0 || *share > 100 || *period <= 0 || *limit < 0 {
		fmt.Fprintln(os.Stderr, "neighbour: -share must be within 0..100, -period above 0, -for not negative")
		os.Exit(2)
	}
	busy := time.Duration(float64(*period) * *share / 100)
	start := time.Now()
	for *limit == 0 || time.Since(start) < *limit {
		spin(busy)
		time.Sleep(*period - busy)
	}
}

// spin keeps the core busy for d without a system call in the loop.
func spin(d time.Duration) {
	for t := time.Now(); time.Since(t) < d; {
	}
}
