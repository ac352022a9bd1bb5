// Package engine is the local decision engine of the rate limiter: per-key
// sliding-window counters in memory, decided without a network round trip,
// with hooks through which a regional origin (package origin) converges the
// counts of several processes. It imports nothing from Caddy, Redis or
// MySQL; time comes from an injectable clock so tests cross window borders
// without sleeping.
//
// A decision's path, and the file that holds each step:
//
//	Decide                                   decide.go
//	DecideMany: all limits or none           batch.go (speculative charges, then commit
//	                                         or roll back)
//	  locate: one map lookup, rotate cells,  locate.go, entry.go, cell.go, zone.go,
//	    a plain cell upgraded to linked        entrymap.go, keys.go
//	  converge: cold or stale cell → read    read.go (single flight, one deadline)
//	  fits? no  → deny (never waits)         decide.go, window.go, strict.go
//	        yes → shared and near the limit
//	              → decide at the origin     reserve.go (one call per cell in flight;
//	                                         the requests behind it share the next)
//	            → else compare-and-swap      decide.go (charge)
//	  committed units → replay queue         replay.go (slow and fast queues)
//	replay loop → Origin.Flush → merge max   flush.go (ticks, workers, shutdown)
//	origin restarted empty → Resend          resend.go
//	janitor: idle entries, the entry cap     janitor.go
//	operators: Stats                         stats.go
//	  Inspect, Overlay, Scan, StrictKeys     inspect.go
//	  Forget, ForgetMatching, DropMatching   forget.go
//	cross-region layer: entry creation and   global.go (SetGlobal, ScanCells,
//	  first denials out, imports in            ImportGlobal, MarkPublished)
//
// The engine's construction, settings and lifecycle (New, SetOrigin,
// SetTiming, Close) are in engine.go; the types the layers above see (Key,
// Limit, Decision, Origin, Totals, Delta, Reservation) in api.go.
package engine
