// Command caddy is Caddy with the standard modules and the ratelimit module,
// the same program `xcaddy build --with github.com/edgelimit/caddy-ratelimit`
// produces, so `go run ./cmd/caddy` works with Go alone.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/edgelimit/caddy-ratelimit"
)

func main() {
	caddycmd.Main()
}
