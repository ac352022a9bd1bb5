// Package propagation is the cross-region layer of the rate limiter: MySQL
// (MySQL 8, MariaDB 10.6+, Vitess) as a bus between regions that each have
// their own Redis. Two tables carry regional counts, never verdicts:
//
//   - ratelimit_blocklist, denial gossip: on a cell's first denial in a
//     window, one row per (region, cell) with the region's counts of the
//     cell and of the previous cell.
//   - ratelimit_global_counts, published counts: every node upserts its
//     region's count of each cell that is busy enough, so traffic spread
//     evenly over many regions (which never denies anywhere) is still
//     counted once.
//
// A receiver keeps, per cell, the largest count either table gave for each
// foreign region, and hands their sum to the engine as the cell's global
// count, which decisions weigh but which is never published again: rows
// carry regional counts only, so nothing echoes.
//
// Where each step is:
//
//	engine first denial → FirstDenial → denial row queued    propagation.go, sync.go
//	mysql_flush tick → rows written (batched, breaker)         sync.go, rows.go
//	  and busy cells pulled by a targeted query                sync.go
//	global_sync / blocklist_sync → paged pulls → imports       sync.go
//	  (per cell: region → count, the sum to engine.ImportGlobal)
//	entry created → waiting imports applied (HMAC index)       propagation.go
//	cleanup: DELETE … LIMIT of expired rows                    sync.go, rows.go
//	schema and its idempotent migration                        schema.go
//	settings and defaults, what operators see                  config.go, stats.go
//
// The package imports the engine, never the regional origin.
package propagation
