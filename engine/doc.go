// Package engine is the local decision engine of the rate limiter: per-key
// sliding-window counters in memory, decided without a network round trip,
// with hooks through which a regional origin (package origin) converges the
// counts of several processes. It imports nothing from Caddy, Redis or
// MySQL; time comes from an injectable clock so tests cross window borders
// without sleeping.
//
// A decision's path, and the file that holds each step:
//
//	Decide / DecideMany                      engine.go
//	  locate: one map lookup, rotate cells   engine.go, cell.go, zone.go, entrymap.go, keys.go
//	  converge: cold or stale cell → read    read.go    (single flight, one deadline)
//	  fits? no  → deny (never waits)         engine.go, window.go, strict.go
//	        yes → shared and near the limit
//	              → decide at the origin     reserve.go (one call per cell in flight;
//	                                         the requests behind it share the next)
//	            → else compare-and-swap      engine.go (charge)
//	  committed units → replay queue         replay.go (slow and fast ticks)
//	replay loop → Origin.Flush → merge max   replay.go
//	janitor: idle entries, the entry cap     janitor.go
//	operators: Stats, Inspect, Scan, Forget  stats.go
//	cross-region layer: entry creation and   global.go (SetGlobal, ScanCells,
//	  first denials out, imports in            ImportGlobal, MarkPublished)
//
// The types the layers above see (Key, Limit, Decision, Origin, Totals,
// Delta, Reservation) are in api.go.
package engine
