// Package propagation is the cross-region layer of the rate limiter: MySQL
// (MySQL 8, MariaDB 10.6+, Vitess) as a bus between regions that each have
// their own Redis. Two tables carry regional counts, never verdicts:
//
//   - ratelimit_blocklist, denial gossip: on a cell's first denial in a
//     window, one row per (region, cell) with the region's counts of the
//     cell and of the previous cell.
//   - ratelimit_global_counts, published counts: the region's count of
//     each cell that is busy enough, so traffic spread evenly over many
//     regions (which never denies anywhere) is still counted once, with
//     the newest global reset the region marked on the cell and its count
//     then, which the other regions take off.
//
// One process per region talks to MySQL: the holder of the region's role,
// a lease in the region's Redis (the Region interface). The region's other
// nodes (members) register there the cells worth publishing and leave
// their first denials; the holder publishes the region's totals of those
// cells, pulls what other regions changed and writes it into the region's
// Redis, whose replies carry it to every node. A process without Redis is
// its own region and does both parts itself against its engine.
//
// Operators' runtime overrides travel the same way, in a third table,
// ratelimit_overrides (overrides.go).
//
// A receiver keeps, per cell, the largest count either table gave for each
// foreign region; their sum is the cell's global count, which decisions
// weigh but which is never published again: rows carry regional counts
// only, so nothing echoes.
//
// Where each step is:
//
//	the engine's first denials → queue, entries made             propagation.go, denials.go
//	the role: lease, take over, hand over                        region.go
//	member: register cells, leave denial rows                    member.go
//	holder or own region: publish counts, write denial rows      publish.go, denials.go
//	pulls of what changed (updated_ms cursor), whole reads,      pull.go
//	  imports into the region's Redis or the engine
//	runtime overrides: written, pulled, handed on                overrides.go
//	the loops, flush, syncs, cleanup, the replica's lag          ticks.go
//	MySQL behind Store: pools, upserts, reads, deletes           store.go, rows.go
//	schema and its in-place upgrade                              schema.go
//	settings and defaults, what operators see                    config.go, stats.go
//
// The package imports the engine, never the regional origin: the root
// adapts the origin to Region.
package propagation
