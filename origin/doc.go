// Package origin is the regional origin of the rate limiter: the Redis I/O
// behind engine.Origin. The engine decides when to read, reserve and replay
// (pressure tiers, ticks, single flight, timeouts) and merges what comes
// back with max; this package only moves counts in and out of Redis, with
// two circuit breakers per endpoint so a sick or slow Redis costs requests
// no latency.
//
// Cells live at <prefix>:{<namespace>:<identifier>}:<window_ms>:<sequence>
// (keys.go), each with a contribution hash <cell>:own holding every
// process's units as an absolute total. Every call is a script
// (scripts.go):
//
//	engine read (cold or stale)  → Read    → read.go: queued, pipelined per endpoint
//	engine reservation           → Reserve → read.go: one EVALSHA, both cells in one slot,
//	                                         deciding every request of the group in order
//	engine replay tick           → Flush   → flush.go: one pipeline per endpoint
//
// Outside a Cluster, reads and writes go 64 cells to a script call
// (many.go): the keys in one buffer, the reply as one string.
//
// Placement over partitions is in route.go, the clients in client.go, the
// breakers in endpoint.go (with starve.go: a slow call counts only when this
// process was not itself starved of CPU), configuration in config.go and
// what operators see in stats.go.
package origin
