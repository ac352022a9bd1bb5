// Command ratelimit-sim simulates the rate limiter at edge scale, regions
// × nodes on a simulated clock, running the project's own engine and
// cross-region layer on models of Redis and MySQL (internal/sim), and
// prints what it measured: accuracy against one exact central counter,
// and what it cost Redis and MySQL, per region and in total.
//
//	go run ./cmd/ratelimit-sim -regions 50 -nodes 10 -keys 100000 -minutes 10 -seed 1 -scenario even
//	go run ./cmd/ratelimit-sim -table regions     # one of the README's tables
//
// One seed gives one output.
package main
