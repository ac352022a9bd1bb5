// Package sim is a deterministic discrete-event simulator of the rate
// limiter at edge scale: R regions × N nodes on a simulated clock, each
// node running the project's own engine (package engine) on a model of
// its region's Redis, and its own cross-region layer (package
// propagation) on a model of MySQL (package simmodel), driven through
// their tick methods at simulated times instead of goroutines and wall
// clocks. Traffic comes from seeded generators; every decision is also
// made by one exact central sliding-window counter fed the same requests,
// which measures the distributed decisions' accuracy.
//
// One Config and seed give one Result, the same every time: events are
// ordered by time and then by the order they were scheduled in, every
// random draw comes from generators seeded by Config.Seed, and nothing
// that decides reads the wall clock. (The engine waits for its reads'
// goroutines on the wall clock, up to its read timeout: the simulator
// sets that to an hour and models the real timeout in simulated time, in
// the Redis model; Result.ReadWaitTimeouts would report a wait that ran
// out.)
//
// Files: config.go (the knobs and scenarios), cluster.go (regions, nodes
// and models), traffic.go (request generators), events.go (the event
// queue), run.go (the loop), measure.go (the central counter and what is
// measured), report.go (tables), tables.go (the README's tables),
// harness.go (the scale harness's loads and the traces integration's
// agreement tests record on real processes, which the simulator must
// agree with).
package sim
