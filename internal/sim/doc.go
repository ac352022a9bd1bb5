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
// reads the wall clock (the engine's read timeout is the one wall-clock
// bound left; an in-memory read meets it by many orders of magnitude, and
// Result.ReadWaitTimeouts reports any that did not).
//
// Files: config.go (the knobs and scenarios), cluster.go (regions, nodes
// and models), traffic.go (request generators), events.go (the event
// queue), run.go (the loop), measure.go (the central counter and what is
// measured), report.go (tables), tables.go (the README's tables).
package sim
