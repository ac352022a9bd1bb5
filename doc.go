// Package ratelimit is a distributed rate limiter for Caddy.
package ratelimit
