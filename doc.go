// Package ratelimit is a distributed rate limiter for Caddy: the
// `ratelimit` handler (http.handlers.ratelimit), the `ratelimit` app (the
// global option) and its admin API (admin.api.ratelimit).
//
// A request's path, and the file that holds each step:
//
//	ServeHTTP                      module.go: each zone's key and cost
//	  │                              (templates.go), IP masking (identifiers.go)
//	  ├─ engine decision           engine/: all zones at once, from memory
//	  │    └─ origin read          origin/: only when the tier asks (cold key,
//	  │                              near the limit, strict mode)
//	  ├─ headers                   headers.go: RateLimit, X-RateLimit-*, Retry-After
//	  ├─ next handler, or 429      module.go (deny); dry run: dryrun.go
//	  └─ async replay              engine/ → origin/: the charged units reach
//	                                 Redis in the background
//
// Around it:
//
//	caddyfile.go   the directive and the global option, line by line
//	validate.go    the checks they share with Validate (JSON configs)
//	app.go         the app: the process's one engine in a caddy.UsagePool
//	apps.go        the one registry of live apps (provisioned, started)
//	redis.go       the Redis origin's lifecycle across reloads
//	zones.go       zone definitions across handlers and configs
//	admin.go       admin API: status, counters, strict keys
//	metrics.go     Prometheus collectors
//	logs.go        log lines of the engine and origin hooks
package ratelimit
