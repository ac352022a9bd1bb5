// Package origin is the regional origin of the rate limiter: the Redis I/O
// behind engine.Origin. The engine decides when to read, reserve and replay
// (pressure tiers, ticks, one read per cell at a time, timeouts) and merges
// what comes back with max; this package only moves counts in and out of
// Redis, with two circuit breakers per endpoint so a sick or slow Redis
// costs requests no latency.
//
// A cell is one hash at <prefix>:{<namespace>:<identifier>}:<window_ms>:<sequence>:c
// (keys.go), holding the region's total, the count imported from other
// regions and the own total of each process's incarnation of the cell.
// Every call is a script (scripts.go):
//
//	engine read (cold or refresh) → Read    → read.go: queued, pipelined per endpoint
//	engine reservation            → Reserve → reserve.go: one EVALSHA, both cells in
//	                                          one slot, deciding the group in order
//	engine replay tick            → Flush   → flush.go: one pipeline per endpoint
//
// Off the engine's path, restart.go (WatchRestarts) sees a Redis restarted
// empty by its run IDs, so that the owner sends every live cell's total
// again, and processes.go (WatchProcesses) records the process among the
// region's in Redis every second and counts them, for the engine's young
// cells (engine.SetProcesses).
//
// For the cross-region layer, role.go keeps the region's role in Redis (a
// lease, the registry of cells to publish, first denials, the holder's
// imports), and overrides.go the region's runtime overrides (a hash whose
// fields keep their newest version, a change counter the nodes poll, a
// queue for the holder).
//
// Outside a Cluster, reads and writes go 64 cells to a script call
// (many.go): the keys in one buffer, the reply as one string.
//
// Around them:
//
//	redis.go      the origin: New, Options, Close and the errors
//	config.go     Config: defaults, validation, the engine's tunables
//	addresses.go  where Redis is: URLs, seeds and sentinels as endpoint specs
//	client.go     an endpoint's go-redis client: timeouts, pool, TLS
//	endpoint.go   one Redis deployment: its client, breakers and counters
//	route.go      which endpoint a key lives on (rendezvous hashing)
//	breaker.go    an endpoint's two breakers and their notifications
//	starve.go     a slow call counts only when this process was not itself
//	              starved of CPU
//	stats.go      what operators see: calls by op and outcome, Stats
//
// Each file's tests are beside it. convergence_test.go, failover_test.go
// and password_test.go are scenarios across files. helpers_test.go holds
// the helpers that several test files share; a helper of one file's tests
// stays in that file.
package origin
