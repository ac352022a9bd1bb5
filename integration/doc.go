// Package integration holds end-to-end tests that run real Caddy processes
// built from cmd/caddy against real servers started privately by the tests.
package integration
