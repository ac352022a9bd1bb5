// Package ratelimit is a distributed rate limiter for Caddy: the
// `ratelimit` handler (http.handlers.ratelimit), the `ratelimit` app (the
// global option) and its admin API (admin.api.ratelimit).
//
// A request's path, and the file that holds each step:
//
//	ServeHTTP                      handler.go: each zone's key and cost
//	  │                              (templates.go, cost.go), IP masking
//	  │                              (identifiers.go)
//	  ├─ engine decision           engine/: all zones at once, from memory
//	  │    └─ origin read          origin/: only when the tier asks (cold key,
//	  │                              near the limit, strict mode)
//	  ├─ headers                   headers.go: RateLimit, X-RateLimit-*, Retry-After
//	  ├─ next handler, or 429      handler.go (deny); dry run: dryrun.go
//	  └─ replay                    engine/ → origin/: the charged units reach
//	                                 Redis in the background
//
// Around it:
//
//	handler_config.go    the handler's zones: config and what it compiles to
//	handler_caddyfile.go the directive, line by line
//	validate.go          the checks the Caddyfile and Validate (JSON) share
//	app.go               the app: settings, Provision, Start, Stop, Cleanup
//	state.go             the process's one engine in a caddy.UsagePool, and
//	                     the live apps (provisioned, started) around it
//	backend.go           the one interface of a backend's lifecycle; the
//	                     app loops over the list of kinds
//	options.go           the global option: one table of lines, one parser
//	                     per kind of value
//	redis.go             the Redis backend (origin/), its lines;
//	redis_status.go      its status section and metrics
//	mysql.go             the MySQL backend (propagation/), its lines;
//	mysql_status.go      its status section, /ratelimit/blocklist, metrics
//	mysql_region.go      the region's role through the Redis backend: the
//	                     origin's role API as propagation.Region
//	overrides.go         runtime overrides: the process's book, the lookup
//	overrides_sync.go    where changes are stored and read (Redis, MySQL)
//	overrides_admin.go   the admin routes of runtime overrides
//	reset.go             a key's reset for the region or every region
//	counters.go          counters declared once: status and Prometheus
//	                     are made from the same list
//	zones.go             zone definitions across handlers and configs
//	admin.go             admin API: the module, its routes, status, the
//	                     query and answer helpers every route uses
//	admin_keys.go        its counters and strict-keys routes
//	metrics.go           the handler's metrics and the engine's collector
//	logs.go              log lines of the engine and origin hooks
//
// # Words
//
// One word per idea, in names, comments, metrics and the README:
//
//   - zone: one named limit of a handler (its namespace in the engine); zone
//     names are global to the process.
//   - identifier: what a zone's key evaluates to for a request (an API key,
//     an IP prefix); a key is (zone, identifier, window).
//   - cell: one fixed window of one key, (zone, identifier, window,
//     sequence), with its counters; sequence = ⌊unix_ms / window_ms⌋.
//   - entry: one key in memory: its current cell and the previous one.
//   - incarnation: one cell object of a key and sequence in a process; a
//     key forgotten or evicted and made again in the same window is a new
//     incarnation, with its own record at the origin.
//   - plain cell, linked cell: a plain cell holds what a decision needs; a
//     linked cell also holds the counters the backends use (replay, own
//     total, imported count, published count).
//   - origin: the region's Redis, behind engine.Origin (package origin).
//   - regional count: what the region counted in a cell (this process's
//     committed units and what the origin returned).
//   - own total: every unit this process handed the origin for a cell; each
//     write carries it whole, so writes are idempotent.
//   - replay: handing committed units to the origin in the background, on
//     the slow or the fast tick.
//   - read: an origin read of a cell and the one before it; a cold read is
//     the first touch's, waited for; a refresh is a stale cell's.
//   - reservation: a decision made at the origin, atomically (a shared key
//     near its limit, or in strict mode); requests that arrive while one is
//     in flight form the next one (a group).
//   - shared: a cell in which the origin has shown another process's units.
//   - strict mode: a key denied within the last window; a decision that
//     would allow it is made at the origin.
//   - cross-region layer: MySQL between regions (package propagation).
//   - published count: a region's count of a cell, written to MySQL.
//   - denial row: a cell's first denial, written to MySQL with the region's
//     counts.
//   - imported count (global): what other regions counted in a cell; kept
//     apart from the regional count, never published again.
//   - role: the region's right to talk to MySQL, a lease in its Redis; its
//     holder publishes and pulls for the region, the other nodes are
//     members; a process without Redis is its own region.
//   - registration: a member's note in the region's Redis that a cell is
//     worth publishing, which the holder takes.
//   - runtime override: an operator's limit for one key, set through the
//     admin API; its scope is where it is stored (node, region, global).
//   - changes pull: a read of the rows whose updated_ms is past the newest
//     change seen; a whole read is the safety net that reads every row.
//   - backend: Redis or MySQL as the app wires them (backend.go).
package ratelimit
